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
    """Run :func:`jobs`: (results by job id, audit events, the hot buffer's state after).

    The host pool is zeroed first. It is ``torch.empty`` by design (``HostPool`` touches
    nothing up front), so the rows of a page past its last token hold whatever the
    allocator handed out, and a gather copies whole pages into the hot buffer; two engines
    in one process would then differ there by chance (this test's old intermittent
    failure). Those rows are never read as keys or values."""
    c = engine.cache
    for t in (*c.pool, *(s for s in c.pool_scale if s is not None)):
        t.zero_()
    events = list(engine.run(jobs()))
    results = {e.result.job_id: e.result for e in events if isinstance(e, ev.JobFinished)}
    audits = [e for e in events if isinstance(e, ev.AuditStep)]
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


def spy_on(monkeypatch, names):
    """Record the last return value of ``engine.decode.audit``'s functions ``names``."""
    import engine.decode.audit as fidelity

    seen = {}
    for name in names:
        fn = getattr(fidelity, name)

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            seen[_name] = _fn(*args, **kwargs)
            return seen[_name]

        monkeypatch.setattr(fidelity, name, wrapped)
    return seen


def audited_first_step(eng, batch_jobs):
    """Prefill ``batch_jobs`` and run their first decode step, audited on every row:
    (requests, the tokens they fed, the step's handle once read)."""
    reqs = [eng.open_request(j) for j in batch_jobs]
    fed = [eng.prefill(r) for r in reqs]
    for r in reqs:
        r.audit_at = frozenset({1}) if eng.auditor is not None else frozenset()
    handle = eng.launch_step(reqs)
    eng.read_step(handle)
    return reqs, fed, handle


def test_audit_dense_forward_equals_a_dense_engine(monkeypatch):
    """At the first decode step the cache holds only prefill K/V (dense in both engines),
    so the audit's dense logits are the dense engine's logits of that step; its mass kept
    equals the oracle's exact page masses summed over the selected pages."""
    from kernels.bitmask import unpack_bits
    from kernels.oracle_scores import oracle_scores_ref

    seen = spy_on(monkeypatch, ["dense_pass", "snapshot"])
    job = jobs(max_tokens=2)[0]  # its one decode step is audited
    out = {}
    for name, eng in (("sparse", make(audit_steps=1)), ("dense", make(attention="dense"))):
        eng.keep_logits = True
        [req], _, handle = audited_first_step(eng, [job])
        out[name] = req.logits
        if name == "sparse":
            audit = handle.audit
            assert audit.seq_ids == [req.seq_id] and audit.steps == [1]
            agree_f, kl_f, kept_f = audit.figures[:, 0].tolist()
            cache, num_tokens = eng.cache, len(job.prompt_ids) + 1
            cap = seen["snapshot"]
            assert cap.layers == list(range(SYNTHETIC_LAYERS))
            table = torch.tensor([cache.seqs[req.seq_id].pages], dtype=torch.int32)
            lens = torch.tensor([num_tokens], dtype=torch.int32)
            oracle = 0.0
            for layer in cap.layers:
                q, sel = cap.q[layer, 0], cap.selection[layer, 0]
                mass = oracle_scores_ref(q[None], cache.pool[layer], table, lens, eng.model.scale)[0]
                oracle += float((mass.clamp(min=0) * unpack_bits(sel, mass.shape[-1])).sum())
            oracle /= SYNTHETIC_LAYERS * cap.q.shape[2]
        eng.close_request(req)
    torch.testing.assert_close(seen["dense_pass"][0][0], out["dense"], atol=1e-4, rtol=1e-4)
    agree, kl = compare(out["sparse"], out["dense"])
    assert kl > 1e-6  # the budget does lose something here
    assert agree_f == float(agree) and kl_f == pytest.approx(kl, rel=1e-3, abs=1e-6)
    assert 0.0 < kept_f < 1.0
    assert kept_f == pytest.approx(oracle, rel=1e-5)


@pytest.mark.parametrize("path", ["eager", "static", "static-split"])
def test_batched_audit_equals_the_per_row_reference(monkeypatch, path):
    """Two rows audited in one step: the one batched dense pass gives each row the
    figures of the plain per-row path (:func:`dense_step_logits`, :func:`mass_kept`,
    :func:`compare`) on the same cache; through the engine's static-buffer step (the
    function a CUDA graph captures, whose per-layer queries and selections are held, not
    copied) and its two micro-batches, bit for bit the eager step's figures."""
    import engine.decode.audit as fidelity
    from engine.decode.cuda_graph import DecodeGraphs

    seen = spy_on(monkeypatch, ["dense_pass", "snapshot"])
    figures = {}
    for variant in ("eager", path):
        eng = make(audit_steps=1)
        eng.keep_logits = True
        eng.split_batches = path == "static-split"  # eager splits the same way
        if variant != "eager":
            eng.graphs = DecodeGraphs(eng, capture=False, split=variant == "static-split")
        reqs, fed, handle = audited_first_step(eng, jobs(max_tokens=2))
        assert handle.audit.seq_ids == [r.seq_id for r in reqs]
        figures[variant] = handle.audit.figures.clone()
        cap = seen["snapshot"]
        dense, kept = seen["dense_pass"]
        for i, r in enumerate(reqs):
            n = eng.cache.seqs[r.seq_id].num_tokens  # counts the fed token now
            ref = fidelity.dense_step_logits(eng.model, eng.cache, r.seq_id, fed[i], n - 1)
            torch.testing.assert_close(dense[i], ref, atol=1e-4, rtol=1e-4)
            per_layer = {layer: (cap.q[j, i], cap.selection[j, i]) for j, layer in enumerate(cap.layers)}
            ref_kept = fidelity.mass_kept(eng.cache, r.seq_id, per_layer, n, eng.model.scale)
            assert float(kept[i]) == pytest.approx(ref_kept, rel=1e-5)
            agree, kl = compare(r.logits, ref)
            assert figures[variant][0, i] == float(agree)
            assert float(figures[variant][1, i]) == pytest.approx(kl, rel=1e-3, abs=1e-6)
        for r in reqs:
            eng.close_request(r)
    assert torch.equal(figures["eager"], figures[path])


def test_row_groups_bound_the_staged_bytes():
    from engine.decode.audit import row_groups

    assert row_groups([3, 3, 3], 6) == [[0, 1], [2]]
    assert row_groups([9, 1, 1], 4) == [[0], [1, 2]]  # a row alone may exceed the limit
    assert row_groups([1, 1], 100) == [[0, 1]]


def test_audit_in_row_groups_equals_one_pass(monkeypatch):
    """Rows split over several dense passes (their records over ``STAGING_BYTES``) get
    the figures of one pass over all of them."""
    import engine.decode.audit as fidelity

    figures = []
    for limit in (fidelity.STAGING_BYTES, 1):
        monkeypatch.setattr(fidelity, "STAGING_BYTES", limit)
        eng = make(audit_steps=1)
        reqs, _, handle = audited_first_step(eng, jobs(max_tokens=2))
        figures.append(handle.audit.figures.clone())
        for r in reqs:
            eng.close_request(r)
    torch.testing.assert_close(figures[0], figures[1], atol=1e-5, rtol=1e-4)


def test_audit_graph_plumbing(monkeypatch):
    """The auditor's CUDA-graph path without CUDA: a stand-in graph whose replay runs the
    pass on the static inputs. Every audited step after the first of a shape is a replay
    of the inputs copied in (block table padded to the width bucket), and the figures
    equal the eager passes'."""
    from engine.decode.audit import Auditor

    class StandIn:
        def __init__(self, auditor, g):
            self.auditor, self.g = auditor, g

        def replay(self):
            self.g.out.copy_(self.auditor._pass(*self.auditor._inputs(self.g)))

    def capture(self, g):
        g.out = self._pass(*self._inputs(g)).clone()
        g.graph = StandIn(self, g)
        self.captures += 1

    monkeypatch.setattr(Auditor, "_capture", capture)
    _, eager, _ = run(make(audit_steps=4, audit_seed=7))
    eng = make(audit_steps=4, audit_seed=7)
    eng.auditor.use_graphs = True
    _, graphed, _ = run(eng)
    # One width bucket (32 pages); steps auditing one row and both rows: two shapes.
    assert [key[0] for key in eng.auditor.graphs] == [(2, 32), (1, 32)]
    assert eng.auditor.captures == 2 and eng.auditor.replays == 4  # 6 passes, 8 rows
    assert len(eager) == len(graphed) == 8
    for a, b in zip(eager, graphed, strict=True):
        assert (a.job_id, a.step, a.agree) == (b.job_id, b.step, b.agree)
        assert b.kl == pytest.approx(a.kl, rel=1e-4, abs=1e-7)
        assert b.mass_kept == pytest.approx(a.mass_kept, rel=1e-5)


def test_figures_in_flight_are_waited_for(monkeypatch):
    """A pass whose figures have not landed (a CUDA pass on its stream, stood in for on
    the CPU) is reported only once ready — except that a job's result waits for its own,
    and its pages are released only after every pass reading them has finished."""
    import engine.decode.audit as fidelity

    class Pending:
        """An event that completes after ``polls`` queries (or when waited for)."""

        def __init__(self, polls):
            self.polls, self.waited = polls, False

        def query(self):
            self.polls -= 1
            return self.polls < 0 or self.waited

        def synchronize(self):
            self.waited = True

    submit = fidelity.Auditor.submit
    events = []

    def slow_submit(self, *args, **kwargs):
        p = submit(self, *args, **kwargs)
        p.done = Pending(polls=3)
        events.append(p.done)
        return p

    monkeypatch.setattr(fidelity.Auditor, "submit", slow_submit)
    eng = make(audit_steps=4, audit_seed=7)
    release = eng.cache.release
    released = []

    def checked_release(seq_id):
        assert all(p.done.waited or p.done.polls < 0 for p in eng.auditor.passes if seq_id in p.seq_ids)
        released.append(seq_id)
        release(seq_id)

    monkeypatch.setattr(eng.cache, "release", checked_release)
    out = list(eng.run(jobs()))
    results = [e.result for e in out if isinstance(e, ev.JobFinished)]
    assert len(results) == 2 and len(released) == 2 and len(events) >= 4
    assert any(e.waited for e in events)  # some result had to wait for its audit
    for r in results:
        assert r.audit.steps == 4
        steps = [e for e in out if isinstance(e, ev.AuditStep) and e.job_id == r.job_id]
        assert len(steps) == 4  # each reported once, before the job's result
        assert max(out.index(e) for e in steps) < next(
            i for i, e in enumerate(out) if isinstance(e, ev.JobFinished) and e.result.job_id == r.job_id
        )
    assert not eng.auditor.passes


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


CUDA = dict(device="cuda", dtype="bfloat16", kv_dtype="bfloat16")


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [True, False])
def test_audit_leaves_the_cuda_decode_bit_identical(graphs):
    """On CUDA an audited step replays its graph like the others (with graphs on) and its
    dense pass runs on a side stream beside the next steps: the tokens, cache traffic and
    hot-buffer state still equal the unaudited run's, and no step fell back to eager."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    plain_eng, audit_eng = make(cuda_graph=graphs, **CUDA), make(audit_steps=4, cuda_graph=graphs, **CUDA)
    plain, _, state0 = run(plain_eng)
    audited, steps, state1 = run(audit_eng)
    for job_id, r in plain.items():
        a = audited[job_id]
        assert a.token_ids == r.token_ids and a.cache == r.cache
        assert a.audit.steps == 4 and 0.0 < a.audit.mass_kept_mean < 1.0
        assert a.audit.seconds > 0
    assert all(torch.equal(x, y) for x, y in zip(state0, state1, strict=True))
    if graphs:
        assert audit_eng.graphs.replays == plain_eng.graphs.replays > 0
        assert audit_eng.graphs.captures == plain_eng.graphs.captures
        assert audit_eng.auditor.captures >= 1 and audit_eng.auditor.replays >= 1
    else:
        assert audit_eng.auditor.captures == 0


@pytest.mark.cuda
def test_cuda_audit_figures_equal_with_and_without_graphs():
    """The queries and selections an audited graph replay leaves in its pool equal the
    eager step's, and the audit's own graph replays compute what its eager pass does:
    the same audit figures, step by step (same kernels on the same inputs, the block
    table padded to the same width; a tolerance only for a library choosing another
    algorithm inside a graph)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    figures = {}
    for graphs in (True, False):
        _, steps, _ = run(make(audit_steps=4, cuda_graph=graphs, **CUDA))
        figures[graphs] = sorted((s.job_id, s.step, s.agree, s.kl, s.mass_kept) for s in steps)
    assert len(figures[True]) == 8
    for a, b in zip(figures[True], figures[False], strict=True):  # equal up to library noise
        assert a[:3] == b[:3]
        assert a[3] == pytest.approx(b[3], rel=1e-3, abs=1e-6)
        assert a[4] == pytest.approx(b[4], rel=1e-5)
