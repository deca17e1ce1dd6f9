"""CUDA-graph replay of the decode step (:mod:`engine.decode.cuda_graph`) on a GPU: the same
tokens, logits (bit for bit), hits and misses as eager launches, for every attention mode,
through batch changes (a new graph per batch size / width bucket) and forced misses; with
the hierarchy the replay runs two micro-batches on two streams (``decode_overlap``).

Weights are synthetic (a small random 4-bit model generated on the device), so the test
needs no model file. The CPU counterpart (the captured function run eagerly against the
eager step) is ``tests/engine/test_engine_ladder.py::test_static_graph_step_equals_eager_step``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import EngineConfig, SamplingParams
from engine.events import Job

pytestmark = pytest.mark.cuda

SHAPE = dict(num_layers=3, hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def model():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from engine.model.llama import LlamaModel
    from engine.model.rope import Rope
    from engine.weights.synthetic import TINY, synthetic_weights

    cfg = dataclasses.replace(TINY, intermediate_size=512, vocab_size=4096, **SHAPE)
    weights = synthetic_weights(cfg, device="cuda")
    rope = Rope(cfg.head_dim, cfg.rope_theta)
    return LlamaModel(weights, torch.device("cuda"), torch.bfloat16, "int4", rope)


def _engine(model, cuda_graph: bool, **kw):
    from engine.serve.engine import Engine
    from kernels.dispatch import get_ops

    cfg = EngineConfig(
        device="cuda",
        dtype="bfloat16",
        kv_dtype="bfloat16",
        host_pool_gb=0.25,
        max_batch=4,
        page_size=16,
        cuda_graph=cuda_graph,
        **kw,
    )
    eng = Engine(model, None, cfg, get_ops("cuda"), 4096)
    eng.keep_logits = True
    return eng


MODES = {
    "hierarchical": dict(attention="sparse", top_k=128, device_buffer=160, local_window=32),
    "hierarchical-two-streams": dict(
        attention="sparse", top_k=128, device_buffer=160, local_window=32, decode_overlap=True
    ),
    "hierarchical-copy-stream-writes": dict(
        attention="sparse", top_k=128, device_buffer=160, local_window=32, decode_write_stream=True
    ),
    "hierarchical-prefetch": dict(
        attention="sparse", top_k=128, device_buffer=256, local_window=32, prefetch_pages=4
    ),
    "hierarchical-prefetch-copy-stream-writes": dict(
        attention="sparse",
        top_k=128,
        device_buffer=256,
        local_window=32,
        prefetch_pages=4,
        decode_write_stream=True,
    ),
    "hierarchical-fp8-hot-two-streams": dict(
        attention="sparse", top_k=128, device_buffer=160, local_window=32, decode_overlap=True,
        kv_host_dtype="fp8", hot_buffer_dtype="fp8",
    ),  # fmt: skip
    "hierarchical-fp8-three-streams": dict(
        attention="sparse", top_k=128, device_buffer=160, local_window=32, decode_overlap=True,
        decode_micro_batches=3, kv_host_dtype="fp8",
    ),  # fmt: skip
    "sparse-resident": dict(attention="sparse", hierarchical=False, top_k=128),
    "dense": dict(attention="dense"),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_graph_replay_equals_eager(model, mode):
    eager = _engine(model, False, **MODES[mode])
    graph = _engine(model, True, **MODES[mode])
    assert eager.graphs is None and graph.graphs is not None, graph.graphs_off_reason
    # Micro-batches on their streams exactly when the hierarchy runs with decode_overlap
    # (the eager engine splits the same way, one micro-batch after the other).
    assert graph.graphs.overlap == mode.endswith("-streams") == eager.split_batches
    gen = torch.Generator().manual_seed(0)
    lengths = [300, 1000, 2100, 45]
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in lengths]
    runs = {}
    for name, eng in (("eager", eager), ("graph", graph)):
        reqs = []
        for i, p in enumerate(prompts):
            r = eng.open_request(Job(f"{name}{i}", tuple(p), SamplingParams(max_tokens=64)))
            eng.prefill(r)
            reqs.append(r)
        runs[name] = (eng, reqs)
    misses = prefetched = 0
    for step in range(40):
        if step == 15:  # a job leaves: a new batch size, a new graph
            for eng, reqs in runs.values():
                eng.close_request(reqs.pop(1))
        out = {}
        for name, (eng, reqs) in runs.items():
            out[name] = eng.decode_step(reqs)
            for r, t in zip(reqs, out[name], strict=True):
                r.generated.append(t)
        assert out["eager"] == out["graph"], f"tokens differ at step {step}"
        for a, b in zip(runs["eager"][1], runs["graph"][1], strict=True):
            assert torch.equal(a.logits, b.logits), f"logits differ at step {step}"
        if eager.cache.hierarchical:
            assert torch.equal(eager.attn.hits, graph.attn.hits), f"hits differ at step {step}"
            assert torch.equal(eager.attn.misses, graph.attn.misses), f"step {step}"
            assert torch.equal(eager.attn.prefetched, graph.attn.prefetched), f"step {step}"
            misses += int(graph.attn.misses.sum())
            prefetched += int(graph.attn.prefetched.sum())
    assert graph.graphs.captures == 2 and graph.graphs.replays == 38
    if graph.cache.hierarchical:
        assert misses > 0
        assert (prefetched > 0) == ("prefetch" in mode)
        graph.cache.check_integrity()


def _replay_pair(
    engines: dict, lengths: list[int], seed: int, steps: int = 40
) -> tuple[dict, dict]:
    """Decode the same random prompts (``lengths`` tokens) through two graph-replaying
    engines (``{name: engine}``) for ``steps`` steps, asserting equal tokens and logits at
    every step and that every step after the first replayed a graph; returns
    ``{name: (engine, requests)}`` with the caches synchronised and checked, and
    ``{name: records prefetched}``."""
    runs, prefetched = {}, dict.fromkeys(engines, 0)
    for name, eng in engines.items():
        gen = torch.Generator().manual_seed(seed)
        reqs = []
        for i, n in enumerate(lengths):
            p = torch.randint(0, 4096, (n,), generator=gen).tolist()
            r = eng.open_request(Job(f"{name}{i}", tuple(p), SamplingParams(max_tokens=64)))
            eng.prefill(r)
            reqs.append(r)
        runs[name] = (eng, reqs)
    first, second = runs
    for step in range(steps):
        out = {}
        for name, (eng, reqs) in runs.items():
            out[name] = eng.decode_step(reqs)
            prefetched[name] += int(eng.attn.prefetched.sum())
            for r, t in zip(reqs, out[name], strict=True):
                r.generated.append(t)
        assert out[first] == out[second], f"tokens differ at step {step}"
        for a, b in zip(runs[first][1], runs[second][1], strict=True):
            assert torch.equal(a.logits, b.logits), f"logits differ at step {step}"
    for eng, _ in runs.values():  # every step replayed a graph (no capture was refused)
        assert eng.graphs is not None and not eng.graphs.disabled_reason
        assert eng.graphs.replays == steps - 1
        eng.cache.synchronize()
        torch.cuda.synchronize()
        eng.cache.check_integrity()
    return runs, prefetched


def test_prefetch_changes_nothing(model):
    """Near-miss prefetch on the copy stream (``prefetch_pages``) vs none, both replayed
    from graphs: the same tokens and logits every step (attention reads the same records,
    some from other slots), records prefetched, and a sound cache. (Whether prefetch
    saves misses depends on the weights' locality: measured by the bench, not here.)"""
    base = dict(attention="sparse", top_k=128, device_buffer=256, local_window=32)
    engines = {
        name: _engine(model, True, prefetch_pages=m, **base)
        for name, m in (("prefetch", 4), ("none", 0))
    }
    assert engines["prefetch"].cache.late_stream is not None
    assert engines["none"].cache.late_stream is None
    _, prefetched = _replay_pair(engines, [900, 2500, 70], seed=5)
    assert prefetched["prefetch"] > 0 and prefetched["none"] == 0


def test_decode_write_stream_changes_nothing(model):
    """Decode write-through on a copy stream (``decode_write_stream``) vs the append kernel
    writing the pool on the compute stream (the default), both replayed from graphs: the
    same tokens and logits every step, and bit-identical pool records at the end."""
    hier = MODES["hierarchical"]
    engines = {}
    for name, on in (("stream", True), ("inline", False)):
        eng = _engine(model, True, decode_write_stream=on, **hier)
        assert eng.cache.deferred_writes == on and (eng.cache.late_stream is not None) == on
        if not on:  # a cache set up for late writes, run by an engine that writes inline
            eng.cache.defer_decode_writes()  # (the bench's modes share one cache)
        engines[name] = eng
    runs, _ = _replay_pair(engines, [700, 1500, 60], seed=3)
    caches = [eng.cache for eng, _ in runs.values()]
    for ra, rb in zip(runs["stream"][1], runs["inline"][1], strict=True):
        pa, pb = caches[0].seqs[ra.seq_id], caches[1].seqs[rb.seq_id]
        assert pa.pages == pb.pages and pa.num_tokens == pb.num_tokens
        s = caches[0].page_size
        for layer in range(caches[0].num_layers):
            a = caches[0].pool[layer][pa.pages]
            b = caches[1].pool[layer][pb.pages]
            for j in range(len(pa.pages)):  # only written token rows (the rest is unwritten)
                n = min(s, pa.num_tokens - j * s)
                if n > 0:
                    assert torch.equal(a[j, :, :, :n], b[j, :, :, :n]), f"layer {layer} page {j}"


def test_gather_turns_change_nothing(model):
    """The two micro-batches' gathers taking turns on the host link (``gather_turns``, the
    default with ``decode_overlap``) vs sharing it, both replayed from graphs on two
    streams, with fp8 host records: the same tokens, logits, hits and misses every step."""
    hier = dict(MODES["hierarchical-two-streams"], kv_host_dtype="fp8")
    engines = {
        name: _engine(model, True, gather_turns=on, **hier)
        for name, on in (("turns", True), ("shared", False))
    }
    runs, _ = _replay_pair(engines, [900, 2500, 70, 1300], seed=8)
    (ta, _), (sa, _) = runs["turns"], runs["shared"]
    assert ta.graphs.overlap and sa.graphs.overlap
    assert torch.equal(ta.attn.hits, sa.attn.hits) and torch.equal(ta.attn.misses, sa.attn.misses)
    assert int(ta.attn.misses.sum()) + int(ta.attn.hits.sum()) > 0


def test_fp8_hot_buffer_reads_what_a_bf16_one_does(model):
    """``hot_buffer_dtype=fp8`` (fp8 slots copied as the host pool stores them, attention
    dequantising) against the default bf16 hot buffer over the same fp8 host pool, both
    replayed from graphs on two streams with write-through on the copy stream and
    prefetch: the same tokens, logits, hits and misses every step, and each slot that
    holds a page holds the same values. (The same logits hold for this tiny model; with
    the real model's sizes the attention kernel's fp8 variant rounds about 1 output in
    20,000 differently: ``sparse_decode_attention``'s docstring.)"""
    from kernels.fp8_kv import fp8_dequantize_ref

    base = dict(MODES["hierarchical-prefetch-copy-stream-writes"], kv_host_dtype="fp8")
    engines = {
        name: _engine(model, True, hot_buffer_dtype=name, **base) for name in ("fp8", "bf16")
    }
    runs, prefetched = _replay_pair(engines, [900, 2500, 70, 1300], seed=9)
    (fa, _), (ba, _) = runs["fp8"], runs["bf16"]
    assert torch.equal(fa.attn.hits, ba.attn.hits) and torch.equal(fa.attn.misses, ba.attn.misses)
    assert prefetched["fp8"] == prefetched["bf16"] > 0
    for layer in range(fa.cache.num_layers):
        assert fa.cache.slots[layer].dtype == torch.float8_e4m3fn
        assert torch.equal(fa.cache.slot_page[layer], ba.cache.slot_page[layer])
        held = fa.cache.slot_page[layer] >= 0
        deq = fp8_dequantize_ref(fa.cache.slots[layer][held], fa.cache.slot_scale[layer][held], torch.bfloat16)
        want = ba.cache.slots[layer][held]  # (rows past a page's tokens may hold NaN bytes)
        assert torch.equal(deq.isnan(), want.isnan()), f"layer {layer}"
        assert torch.equal(deq.nan_to_num(), want.nan_to_num()), f"layer {layer}"
    assert fa.cache.hot_buffer_bytes < 0.6 * ba.cache.hot_buffer_bytes


# ----- asynchronous decode (EngineConfig.async_decode) ---------------------------------


class _IdsTokenizer:
    """What ``Engine.run`` needs of a tokenizer: ``decode`` (ids as text) and no stop ids."""

    eos_ids = frozenset()

    def decode(self, ids) -> str:
        return " ".join(map(str, ids))


def _run_results(eng, jobs) -> dict:
    from engine.events import JobFailed, JobFinished

    eng.tokenizer = _IdsTokenizer()
    out = {}
    for e in eng.run(jobs):
        if isinstance(e, JobFinished):
            r = e.result
            out[r.job_id] = (r.token_ids, r.finish_reason, r.cache.hits, r.cache.misses)
        elif isinstance(e, JobFailed):
            out[e.job_id] = ("failed", e.error)
    return out


def _run_jobs(max_tokens: list[int], seed: int = 11) -> list[Job]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [300, 1000, 2100, 45, 700, 1300][: len(max_tokens)]
    return [
        Job(
            f"j{i}",
            tuple(torch.randint(0, 4096, (n,), generator=gen).tolist()),
            SamplingParams(max_tokens=m),
        )
        for i, (n, m) in enumerate(zip(lengths, max_tokens, strict=True))
    ]


@pytest.mark.parametrize("mode", ["hierarchical", "hierarchical-prefetch", "dense"])
def test_async_run_graph_equals_eager(model, mode):
    """``Engine.run`` with asynchronous decode, graph replays vs eager launches: the same
    schedule (finishes one step late in both), so the same tokens, hits and misses, bit
    for bit, through staggered finishes and jobs admitted into freed room (max_batch 4,
    six jobs)."""
    jobs = _run_jobs([20, 45, 33, 60, 25, 40])
    res = {}
    for name, graph in (("graph", True), ("eager", False)):
        eng = _engine(model, graph, async_decode=True, **MODES[mode])
        eng.keep_logits = False
        assert eng.async_decode
        res[name] = _run_results(eng, jobs)
        if graph:
            assert eng.graphs.replays > 0 and not eng.graphs.disabled_reason
        eng.cache.synchronize()
        torch.cuda.synchronize()
        eng.cache.check_integrity()
    assert all(v[0] != "failed" for v in res["graph"].values()), res["graph"]
    assert res["graph"] == res["eager"]


def test_async_run_equals_sync_run(model):
    """Jobs that finish together run the same batches with or without asynchronous decode
    (only the discarded step after the finish differs): the same tokens and counters."""
    jobs = _run_jobs([40, 40, 40, 40])
    res = {}
    for name, on in (("async", True), ("sync", False)):
        eng = _engine(model, True, async_decode=on, **MODES["hierarchical"])
        eng.keep_logits = False
        res[name] = _run_results(eng, jobs)
    assert res["async"] == res["sync"]


def test_chained_graph_steps_equal_eager_steps(model):
    """``launch_step(batch, prev)`` chains replays without uploading (the graph leaves its
    argmax, lengths + 1 and step + 1 in its inputs): tokens and logits equal the eager
    engine's synchronous steps, bit for bit."""
    runs = {}
    for name, graph in (("graph", True), ("eager", False)):
        eng = _engine(model, graph, **MODES["hierarchical"])
        gen = torch.Generator().manual_seed(2)
        reqs = []
        for i, n in enumerate([800, 1900, 64]):
            p = torch.randint(0, 4096, (n,), generator=gen).tolist()
            r = eng.open_request(Job(f"{name}{i}", tuple(p), SamplingParams(max_tokens=64)))
            eng.prefill(r)
            reqs.append(r)
        runs[name] = (eng, reqs)
    eng, reqs = runs["graph"]
    handles, prev = [], None
    for _ in range(30):
        prev = eng.launch_step(reqs, prev)
        handles.append(prev)
    graph_tokens = [eng.read_step(h)[0] for h in handles]
    eager, ereqs = runs["eager"]
    for step, (h, toks) in enumerate(zip(handles, graph_tokens, strict=True)):
        want = eager.decode_step(ereqs)
        for r, t in zip(ereqs, want, strict=True):
            r.generated.append(t)
        assert toks == want, f"tokens differ at step {step}"
        for i, r in enumerate(ereqs):
            assert torch.equal(h.logits[i], r.logits), f"logits differ at step {step}"
    assert eng.graphs.replays == 29
    assert [h.captured for h in handles] == [True] + [False] * 29  # one capture, then replays
