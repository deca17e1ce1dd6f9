"""The per-job fidelity audit (``audit_steps``, :mod:`engine.decode.audit`) on the tiny
synthetic model, CPU: the sparse decode is the same with and without it, its dense
forward equals a dense engine's step, and its figures reach the job's result."""

from __future__ import annotations

import pytest
import torch

from engine import events as ev
from engine.config import EngineConfig, SamplingParams
from engine.decode.audit import audit_schedule, compare

# Small pages and budget over a ~300-token prompt, a hot buffer that forces misses.
SPARSE = dict(
    host_pool_gb=0.25, max_batch=2, page_size=16, top_k=48, sink_tokens=16,
    local_window=16, device_buffer=96, prefill_chunk=128, tokenizer="ids",
)


SYNTHETIC_LAYERS = 2


def make(**overrides):
    from engine.load import load_engine

    return load_engine(EngineConfig(**{**SPARSE, **overrides}), "synthetic:tiny")


def jobs(max_tokens=8):
    g = torch.Generator().manual_seed(3)
    return [
        ev.Job(f"j{i}", tuple(torch.randint(5, 40000, (n,), generator=g).tolist()),
               SamplingParams(max_tokens=max_tokens))
        for i, n in enumerate((300, 211))
    ]


def run(engine):
    events = list(engine.run(jobs()))
    results = {e.result.job_id: e.result for e in events if isinstance(e, ev.JobFinished)}
    audits = [e for e in events if isinstance(e, ev.AuditStep)]
    c = engine.cache
    state = [t.clone() for name in ("slots", "page_table", "slot_page", "slot_last_use")
             for t in getattr(c, name)]
    return results, audits, state


def test_schedule_is_seeded_spread_and_in_range():
    a = audit_schedule("job", 101, 8, seed=0)
    assert a == audit_schedule("job", 101, 8, seed=0)
    assert a != audit_schedule("job", 101, 8, seed=1)
    assert len(a) == 8 and all(1 <= s <= 100 for s in a)
    ranked = sorted(a)  # one per stratum of 100 / 8 steps
    assert all(1 + (i * 100) // 8 <= s < 1 + ((i + 1) * 100) // 8 for i, s in enumerate(ranked))
    assert audit_schedule("job", 4, 8, seed=0) == frozenset({1, 2, 3})
    assert audit_schedule("job", 1, 8, seed=0) == frozenset()


@pytest.mark.parametrize("async_decode", [False, True])
def test_audit_leaves_the_sparse_decode_bit_identical(async_decode):
    """Audit on vs off (and with asynchronous decode, where an audited step is never
    chained to the step in flight): the same tokens, traffic and hot-buffer state; the
    audited steps are the scheduled ones."""
    plain, none, state0 = run(make(async_decode=async_decode))
    audited, steps, state1 = run(make(audit_steps=4, audit_seed=7, async_decode=async_decode))
    assert not none and all(r.audit is None for r in plain.values())
    for job_id, r in plain.items():
        a = audited[job_id]
        assert a.token_ids == r.token_ids and a.cache == r.cache
        assert a.audit is not None and a.audit.steps == 4
        mine = [s for s in steps if s.job_id == job_id]
        assert sorted(s.step for s in mine) == sorted(audit_schedule(job_id, 8, 4, 7))
        assert a.audit.top1_agreement == sum(s.agree for s in mine) / 4
        assert a.audit.kl_max == pytest.approx(max(s.kl for s in mine))
        assert 0.0 < a.audit.mass_kept_mean < 1.0  # 48 + sinks + window of ~300 tokens
        assert a.audit.seconds > 0
    assert len(state0) == len(state1) and all(torch.equal(x, y) for x, y in zip(state0, state1, strict=True))


def test_audit_dense_forward_equals_a_dense_engine(monkeypatch):
    """At the first decode step the cache holds only prefill K/V (dense in both engines),
    so the audit's dense logits are the dense engine's logits of that step; its mass kept
    equals the oracle's exact page masses summed over the selected pages."""
    import engine.decode.audit as fidelity
    from kernels.bitmask import unpack_bits
    from kernels.oracle_scores import oracle_scores_ref

    seen = {}

    def spy(name):
        fn = getattr(fidelity, name)

        def wrapped(*args):
            seen[name] = (args, fn(*args))
            return seen[name][1]

        monkeypatch.setattr(fidelity, name, wrapped)

    spy("dense_step_logits")
    spy("mass_kept")
    job = jobs(max_tokens=2)[0]  # its one decode step is audited
    out = {}
    for name, eng in (("sparse", make(audit_steps=1)), ("dense", make(attention="dense"))):
        eng.keep_logits = True
        req = eng.open_request(job)
        eng.prefill(req)
        handle = eng.launch_step([req])
        eng.read_step(handle)
        out[name] = req.logits
        if name == "sparse":
            [step] = handle.audits
            cache, seq_id, captured, num_tokens, scale = seen["mass_kept"][0]
            assert seq_id == req.seq_id and num_tokens == len(job.prompt_ids) + 1
            assert len(captured) == SYNTHETIC_LAYERS
            table = torch.tensor([cache.seqs[seq_id].pages], dtype=torch.int32)
            lens = torch.tensor([num_tokens], dtype=torch.int32)
            oracle = 0.0
            for layer, (q, sel) in captured.items():
                mass = oracle_scores_ref(q[None], cache.pool[layer], table, lens, scale)[0]
                oracle += float((mass.clamp(min=0) * unpack_bits(sel, mass.shape[-1])).sum())
            oracle /= SYNTHETIC_LAYERS * q.shape[0]
        eng.close_request(req)
    torch.testing.assert_close(seen["dense_step_logits"][1], out["dense"], atol=1e-4, rtol=1e-4)
    agree, kl = compare(out["sparse"], out["dense"])
    assert kl > 1e-6  # the budget does lose something here
    assert step.agree == agree and step.kl == pytest.approx(kl, rel=1e-3, abs=1e-6)
    assert 0.0 < step.mass_kept == seen["mass_kept"][1] < 1.0
    assert step.mass_kept == pytest.approx(oracle, rel=1e-5)


@pytest.mark.parametrize("kv_host_dtype", ["bf16", "fp8"])
def test_audit_of_a_full_budget_agrees(kv_host_dtype):
    """Every page selected: sparse equals dense. With fp8 host pages the audit's dense
    forward reads the records dequantised (as the sparse step does), not their raw fp8
    values."""
    results, steps, _ = run(
        make(top_k=512, device_buffer=1024, audit_steps=3, kv_host_dtype=kv_host_dtype)
    )
    for r in results.values():
        assert r.audit.steps == 3 and r.audit.top1_agreement == 1.0
        assert r.audit.kl_max < 1e-5 and r.audit.mass_kept_mean == pytest.approx(1.0, abs=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [True, False])
def test_audit_leaves_the_cuda_decode_bit_identical(graphs):
    """On CUDA an audited step runs eagerly (the others replay their graph): the tokens,
    cache traffic and hot-buffer state still equal the unaudited run's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cuda = dict(device="cuda", dtype="bfloat16", kv_dtype="bfloat16", cuda_graph=graphs)
    plain, _, state0 = run(make(**cuda))
    audited, steps, state1 = run(make(audit_steps=4, **cuda))
    for job_id, r in plain.items():
        a = audited[job_id]
        assert a.token_ids == r.token_ids and a.cache == r.cache
        assert a.audit.steps == 4 and 0.0 < a.audit.mass_kept_mean < 1.0
    assert all(torch.equal(x, y) for x, y in zip(state0, state1, strict=True))
