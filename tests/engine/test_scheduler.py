"""The engine's scheduler: asynchronous decode and prefill turns.

Asynchronous decode (``EngineConfig.async_decode``): step t+1 launched before the host
reads step t, the greedy tokens fed on the device, finishes applied one step late.
Prefill turns (``EngineConfig.prefill_turn_tokens``): a long prompt's layer spread over
several turns, so the running batch keeps decoding while it prefills.

On the CPU the launch is synchronous, but the schedule is the same as on CUDA (a job that
finishes at step t rides step t+1, its token there discarded), so these tests check what
the GPU path relies on: the same tokens, texts, finish reasons and cache counters as the
synchronous engine, through staggered finishes, stop tokens, stop strings and a hierarchy
that misses; the freed room reused by jobs admitted later. A tiny synthetic 4-bit model, no
model file. The CUDA counterpart is ``tests/engine/test_cuda_graph.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import EngineConfig, SamplingParams
from engine.events import Job as EvJob
from engine.events import JobFailed, JobFinished


class _DigitsTokenizer:
    """Token id ``i`` decodes to ``"<i>"``: stop strings can span several tokens."""

    def __init__(self, eos: frozenset[int] = frozenset()):
        self.eos_ids = eos

    def decode(self, ids) -> str:
        return "".join(f"<{i}>" for i in ids)


@pytest.fixture(scope="module")
def model():
    from engine.model.llama import LlamaModel
    from engine.model.rope import Rope
    from engine.weights.synthetic import TINY, synthetic_weights

    cfg = dataclasses.replace(TINY, vocab_size=97)
    weights = synthetic_weights(cfg, device="cpu")
    return LlamaModel(weights, torch.device("cpu"), torch.float32, "int4", Rope(cfg.head_dim, cfg.rope_theta))


def _engine(model, async_decode: bool, eos=frozenset(), **kw):
    from engine.serve.engine import Engine
    from kernels.dispatch import get_ops

    settings = dict(
        device="cpu",
        dtype="float32",
        kv_dtype="float32",
        host_pool_gb=0.05,
        max_batch=3,
        page_size=16,
        async_decode=async_decode,
    )
    cfg = EngineConfig(**{**settings, **kw})
    return Engine(model, _DigitsTokenizer(eos), cfg, get_ops("cpu"), 2048)


def _jobs(stop=()):
    gen = torch.Generator().manual_seed(1)
    lengths = [40, 130, 75, 20, 260]
    max_tokens = [6, 17, 11, 9, 13]
    return [
        EvJob(
            f"j{i}",
            tuple(torch.randint(0, 97, (n,), generator=gen).tolist()),
            SamplingParams(max_tokens=m, stop=tuple(stop)),
        )
        for i, (n, m) in enumerate(zip(lengths, max_tokens, strict=True))
    ]


def _results(engine, jobs):
    out = {}
    for e in engine.run(jobs):
        if isinstance(e, JobFinished):
            r = e.result
            out[r.job_id] = (r.token_ids, r.text, r.finish_reason, r.cache.hits, r.cache.misses)
        elif isinstance(e, JobFailed):
            out[e.job_id] = ("failed", e.error)
    return out


MODES = {
    "dense": dict(attention="dense"),
    "hierarchical-misses": dict(attention="sparse", top_k=32, device_buffer=48, local_window=16),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_async_run_equals_sync_run(model, mode):
    sync = _results(_engine(model, False, **MODES[mode]), _jobs())
    asyn = _results(_engine(model, True, **MODES[mode]), _jobs())
    assert set(sync) == {f"j{i}" for i in range(5)}
    assert all(v[0] != "failed" for v in sync.values()), sync
    assert asyn == sync
    if mode == "hierarchical-misses":
        assert sum(v[4] for v in sync.values()) > 0, "the hierarchy never missed"


def test_async_stop_tokens_and_strings_equal_sync(model):
    """A stop token and a stop string that spans tokens end jobs at the same token in
    both schedules (the stop string is taken from the synchronous run's own output)."""
    base = _results(_engine(model, False), _jobs())
    eos = frozenset({base["j1"][0][5]})
    stop = [base["j2"][1][8:15]]  # a piece of j2's reply crossing token boundaries
    sync = _results(_engine(model, False, eos), _jobs(stop))
    asyn = _results(_engine(model, True, eos), _jobs(stop))
    assert asyn == sync
    assert sync["j1"][2] == "stop" and len(sync["j1"][0]) <= 5
    assert sync["j2"][2] == "stop" and stop[0] not in sync["j2"][1]


def test_async_launches_the_next_step_before_reading(model):
    """The run loop keeps one step in flight while the batch is unchanged: it launches
    step t+1 (tokens fed from step t's argmax) before it reads step t."""
    eng = _engine(model, True)
    order = []
    launch, read = eng.launch_step, eng.read_step

    def traced_launch(batch, prev=None):
        h = launch(batch, prev)
        order.append(("launch", h.step, prev is not None))
        return h

    def traced_read(handle):
        order.append(("read", handle.step))
        return read(handle)

    eng.launch_step, eng.read_step = traced_launch, traced_read
    job = EvJob("solo", tuple(range(30)), SamplingParams(max_tokens=5))
    results = [e for e in eng.run([job]) if isinstance(e, JobFinished)]
    assert len(results) == 1 and len(results[0].result.token_ids) == 5
    # prefill gives token 1; steps 1-4 give tokens 2-5; step 5 rides along and is dropped
    assert order[:4] == [("launch", 1, False), ("launch", 2, True), ("read", 1), ("launch", 3, True)]
    assert sum(1 for o in order if o[0] == "launch") == 5
    assert [o[1] for o in order if o[0] == "read"] == [1, 2, 3, 4, 5]


def test_stop_window_finds_what_a_full_decode_finds():
    from engine.serve.engine import _find_stop, _stop_window

    tok = _DigitsTokenizer()
    ids = list(range(200))
    stops = ["<120><121><1", "9><150>"]
    first = None
    for n in range(1, len(ids) + 1):
        full = _find_stop(tok.decode(ids[:n]), stops)
        tail = tok.decode(ids[:n][-_stop_window(stops) :])
        if full is not None and first is None:
            first = n
            assert any(s in tail for s in stops)
            assert len(tail) < len(tok.decode(ids[:n]))  # the window is a real tail
    assert first == 123  # "<120><121><1" completes with token 122


def _steps_during_prefill(engine, jobs, job_id):
    """Decode steps launched for the running batch between ``job_id``'s admission and its
    first token (the engine's step counter), and every job's tokens."""
    from engine.events import FirstToken, JobAdmitted

    start, steps, results = 0, None, {}
    for e in engine.run(jobs):
        if isinstance(e, JobAdmitted) and e.job_id == job_id:
            start = engine.step
        elif isinstance(e, FirstToken) and e.job_id == job_id:
            steps = engine.step - start
        elif isinstance(e, JobFinished):
            results[e.result.job_id] = e.result.token_ids
    return steps, results


@pytest.mark.parametrize("async_decode", [False, True])
def test_prefill_turns_spread_a_long_prompt_over_decode_steps(model, async_decode):
    """A 1500-token prompt admitted while a short job decodes: with 256-token turns each of
    its 2 layers takes 6 turns (12 decode steps of the other job meanwhile), with whole-layer
    turns 2; every job's tokens are the same either way (each job's prefill is the same
    computation, chunk for chunk)."""
    gen = torch.Generator().manual_seed(3)
    short = EvJob("short", tuple(torch.randint(0, 97, (20,), generator=gen).tolist()), SamplingParams(max_tokens=60))
    long = EvJob("long", tuple(torch.randint(0, 97, (1500,), generator=gen).tolist()), SamplingParams(max_tokens=4))
    out = {}
    for name, turn in (("chunks", 256), ("layers", 0)):
        eng = _engine(model, async_decode, prefill_chunk=256, prefill_turn_tokens=turn, max_batch=2)
        out[name] = _steps_during_prefill(eng, [short, long], "long")
    layers = TINY_LAYERS
    assert out["layers"][0] == layers
    assert out["chunks"][0] == layers * 6  # ceil(1500 / 256) chunks per layer
    assert out["chunks"][1] == out["layers"][1] and set(out["chunks"][1]) == {"short", "long"}


TINY_LAYERS = 2  # engine.weights.synthetic.TINY


@pytest.mark.parametrize("async_decode", [False, True])
def test_decode_step_time_covers_the_step(model, async_decode):
    """A step's ``step_s`` counts the step's own work (on the CPU the launch runs it): with
    every step made to take >= 20 ms, no DecodeStep reports less."""
    import time as _time

    from engine.events import DecodeStep

    eng = _engine(model, async_decode)
    inner = eng.decode_batch

    def slow(*args, **kwargs):
        _time.sleep(0.02)
        return inner(*args, **kwargs)

    eng.decode_batch = slow
    steps = [e for e in eng.run(_jobs()[:2]) if isinstance(e, DecodeStep)]
    assert steps and min(e.step_s for e in steps) >= 0.02
