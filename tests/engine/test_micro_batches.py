"""Decode micro-batches (``decode_overlap``, ``decode_micro_batches``) on the CPU: the
row split of :func:`engine.decode.cuda_graph.split_plan`, and a step split into two or
three micro-batches (run one after the other here; on streams of their own on a GPU,
``tests/engine/test_cuda_graph.py``) equals the unsplit step bit for bit."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig, SamplingParams
from engine.decode.attention import StepPlan
from engine.decode.cuda_graph import split_plan
from engine.events import Job

# Small pages, budget and hot buffer over prompts of 120-400 tokens: misses every step.
SPARSE = dict(
    host_pool_gb=0.25, max_batch=5, page_size=16, top_k=48, sink_tokens=16,
    local_window=16, device_buffer=96, prefill_chunk=128, tokenizer="ids",
)  # fmt: skip


def make(**overrides):
    from engine.load import load_engine

    return load_engine(EngineConfig(**{**SPARSE, **overrides}), "synthetic:tiny")


def _plan(b: int) -> StepPlan:
    return StepPlan(
        seq_ids=list(range(b)),
        block_table=torch.arange(b * 4).view(b, 4),
        seq_lens=torch.arange(b),
        num_pages=torch.arange(b),
        positions=torch.arange(b),
        slab_ids=None,
        step=0,
        hits=torch.zeros(b, 2),
        row0=3,
    )


@pytest.mark.parametrize(
    "b,parts,sizes",
    [
        (5, 2, [3, 2]),
        (7, 3, [3, 2, 2]),
        (6, 3, [2, 2, 2]),
        (2, 3, [1, 1]),
        (1, 2, [1]),
        (4, 4, [1, 1, 1, 1]),
    ],
)
def test_split_plan_groups_contiguous_rows(b, parts, sizes):
    """Contiguous groups, the first ones larger, no more groups than rows; each group's
    rows, staging offset and counters (views of the whole plan's) are its own."""
    plan = _plan(b)
    groups = split_plan(plan, parts)
    assert [len(g.seq_ids) for g in groups] == sizes
    start = 0
    for g in groups:
        n = len(g.seq_ids)
        assert g.seq_ids == list(range(start, start + n))
        assert torch.equal(g.block_table, plan.block_table[start : start + n])
        assert g.row0 == plan.row0 + start
        g.hits.fill_(start + 1)  # written through into the plan's counters
        assert torch.equal(plan.hits[start : start + n], torch.full((n, 2), start + 1.0))
        start += n
    assert start == b


def _decode(eng, prompts, steps, static=False):
    """Prefill ``prompts`` and decode ``steps`` steps as micro-batches (the engine's
    ``decode_micro_batches``); with ``static`` through the function a CUDA graph captures,
    run eagerly (``DecodeGraphs(capture=False, split=True)``). Returns per step the
    tokens, logits, hits, misses and how many micro-batches ran."""
    from engine.decode.cuda_graph import DecodeGraphs

    eng.split_batches = True  # as on CUDA with decode_overlap
    if static:
        eng.graphs = DecodeGraphs(eng, capture=False, split=True)
    chains = []
    inner = eng.decode_layers

    def counted(plan, h):
        chains.append(len(plan.seq_ids))
        return inner(plan, h)

    eng.decode_layers = counted
    reqs = []
    for i, p in enumerate(prompts):
        r = eng.open_request(Job(f"j{i}", tuple(p), SamplingParams(max_tokens=steps + 2)))
        eng.prefill(r)
        reqs.append(r)
    eng.keep_logits = True
    out = []
    for step in range(steps):
        if step == steps // 2:  # a job leaves: the batch and its split change
            eng.close_request(reqs.pop(1))
        chains.clear()
        tokens = eng.decode_step(reqs)
        for r, t in zip(reqs, tokens, strict=True):
            r.generated.append(t)
        logits = torch.stack([r.logits for r in reqs])
        out.append((tokens, logits, eng.attn.hits.clone(), eng.attn.misses.clone(), list(chains)))
    for r in reqs:
        eng.close_request(r)
    eng.cache.check_integrity()
    return out


@pytest.mark.parametrize("micro_batches,rows", [(2, ([3, 2], [2, 2])), (3, ([2, 2, 1], [2, 1, 1]))])
def test_static_micro_batches_equal_the_eager_ones(micro_batches, rows):
    """Five jobs of different lengths (then four) decoded as ``micro_batches``
    micro-batches, by the eager step and by the function a CUDA graph captures: the same
    split, tokens, logits, hits and misses at every step bit for bit, with misses forced
    by a small hot buffer. (The unsplit step's logits differ from these in the last bits
    on the CPU: the products' blocking depends on the rows.)"""
    g = torch.Generator().manual_seed(5)
    prompts = [
        torch.randint(5, 40000, (n,), generator=g).tolist() for n in (300, 211, 400, 120, 260)
    ]
    cfg = dict(decode_overlap=True, decode_micro_batches=micro_batches)
    eager = _decode(make(**cfg), prompts, 12)
    static = _decode(make(**cfg), prompts, 12, static=True)
    misses = 0
    for step, (a, b) in enumerate(zip(eager, static, strict=True)):
        assert a[4] == b[4] == list(rows[step >= 6]), f"split at step {step}"
        assert a[0] == b[0], f"tokens differ at step {step}"
        assert torch.equal(a[1], b[1]), f"logits differ at step {step}"
        assert torch.equal(a[2], b[2]) and torch.equal(a[3], b[3]), (
            f"traffic differs at step {step}"
        )
        misses += int(b[3].sum())
    assert misses > 0


def test_micro_batches_below_two_are_refused():
    """``decode_micro_batches`` is checked like every setting: one or a non-integer names
    the field."""
    for bad in (1, 0, 2.5, True):
        problems = EngineConfig(decode_micro_batches=bad).problems()
        assert any("decode_micro_batches" in str(p) for p in problems), bad
