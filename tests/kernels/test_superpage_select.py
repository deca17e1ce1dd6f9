"""Two-level superpage selection (``page_metadata=superpage``): the Triton kernels against
the PyTorch reference on awkward shapes (Triton's interpreter on CPU, see
tests/conftest.py), and the reference against flat Quest where every page is a candidate."""

from __future__ import annotations

import os

import pytest
import torch
from kernel_cases import poisoned_allocations

import kernels.superpage_select as superpage_select_module
from kernels.bitmask import unpack_bits
from kernels.quest_scores import quest_scores_ref
from kernels.select_topk import select_topk_ref
from kernels.superpage_select import (
    SUPERPAGE_COMBINES,
    num_candidates,
    superpage_meta_ref,
    superpage_select,
    superpage_select_ref,
    superpage_table,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
    reason="no CUDA and Triton's interpreter is off (run this module through tests/conftest.py)",
)


def superpage_case(b, hq, hkv, d, s_sp, p_max, nums, seed, integer=True):
    """Inputs of one step: pages of each request scattered over a pool, the superpage rows
    handed out in order, every superpage's bounds written except each request's newest
    (left stale: the selection must refresh it). Integer-valued (halves / quarters) inputs
    make every fp32 bound sum exact."""
    gen = torch.Generator().manual_seed(seed)
    p_pool = sum(nums) + 5
    if integer:
        meta = torch.randint(-8, 8, (p_pool, hkv, 2, d), generator=gen) / 4
        q = torch.randint(-4, 4, (b, hq, d), generator=gen) / 2
    else:
        meta = torch.randn(p_pool, hkv, 2, d, generator=gen)
        q = torch.randn(b, hq, d, generator=gen)
    meta = meta.sort(dim=2).values
    perm = torch.randperm(p_pool, generator=gen)
    block_table = torch.full((b, p_max), -1, dtype=torch.int32)
    page_super = torch.full((p_pool,), -1, dtype=torch.int32)
    super_meta = torch.full((p_pool // s_sp + b + 4, hkv, 2, d), 7.0)  # stale rows
    off, row = 0, 3  # rows 0..2 unused: a row index is not a request index
    for i, n in enumerate(nums):
        pages = perm[off : off + n]
        off += n
        block_table[i, :n] = pages.int()
        if n:
            bounds = superpage_meta_ref(meta, pages, s_sp)
            for j in range(bounds.shape[0]):
                page_super[pages[j * s_sp]] = row + j
                if j < bounds.shape[0] - 1:
                    super_meta[row + j] = bounds[j]
            row += bounds.shape[0]
    num_pages = torch.tensor(nums, dtype=torch.int32)
    return q, meta, super_meta, page_super, block_table, num_pages


CASES = [
    # b, hq, hkv, d, s_sp, p_max, pages per request, top_k, sink, window, candidates
    (3, 6, 2, 16, 4, 37, [37, 5, 20], 6, 1, 2, 3),
    (2, 3, 3, 24, 3, 40, [0, 40], 10, 0, 1, 4),  # an empty row, G = 1, D and S_sp not 2^k
    (1, 4, 1, 8, 16, 257, [250], 20, 2, 3, 2),  # one KV head, P_max past a word
    (2, 8, 2, 32, 5, 64, [64, 33], 7, 1, 1, 100),  # every superpage a candidate
    (4, 2, 2, 16, 2, 9, [9, 1, 2, 8], 3, 1, 1, 2),  # contexts inside the budget
]


@pytest.mark.parametrize("ranking", ["fused", "no tl.topk", "torch.topk"])
@pytest.mark.parametrize("combine", SUPERPAGE_COMBINES)
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_triton_matches_reference(case, combine, ranking, monkeypatch):
    """Both ways of ranking: rows ranked inside one program (``tl.topk``, ``tl.sort`` where
    the top is the whole row), or ``torch.topk`` and the separate key / forced-word / pick
    kernels (rows past ``FUSED_SORT_MAX``, or a Triton without ``tl.topk``)."""
    if ranking == "torch.topk":
        monkeypatch.setattr(superpage_select_module, "FUSED_SORT_MAX", 0)
    elif ranking == "no tl.topk":  # a Triton without tl.topk takes the torch.topk path
        monkeypatch.delattr(superpage_select_module.tl, "topk")
    b, hq, hkv, d, s_sp, p_max, nums, top_k, sink, window, c = case
    args = superpage_case(b, hq, hkv, d, s_sp, p_max, nums, seed=p_max + hq)
    q, meta, super_meta, page_super, block_table, num_pages = args
    ref_meta, out_meta = super_meta.clone(), super_meta.to(DEVICE)
    rest = (top_k, sink, window, s_sp, c, combine, 0.5)
    ref = superpage_select_ref(q, meta, ref_meta, page_super, block_table, num_pages, *rest)
    dev = [t.to(DEVICE) for t in (q, meta)]
    with poisoned_allocations():
        out = superpage_select(
            *dev, out_meta, page_super.to(DEVICE), block_table.to(DEVICE),
            num_pages.to(DEVICE), *rest,
        ).cpu()  # fmt: skip
    assert torch.equal(ref, out), (unpack_bits(ref, p_max) ^ unpack_bits(out, p_max)).nonzero()
    assert torch.equal(ref_meta, out_meta.cpu()), "the newest superpages' refresh differs"


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_refresh_gives_every_superpage_its_pages_bounds(case):
    b, hq, hkv, d, s_sp, p_max, nums, top_k, sink, window, c = case
    q, meta, super_meta, page_super, block_table, num_pages = superpage_case(
        b, hq, hkv, d, s_sp, p_max, nums, seed=3
    )
    superpage_select_ref(
        q, meta, super_meta, page_super, block_table, num_pages, top_k, sink, window, s_sp, c
    )
    table = superpage_table(page_super, block_table, s_sp)
    for i, n in enumerate(nums):
        if n:
            want = superpage_meta_ref(meta, block_table[i, :n], s_sp)
            assert torch.equal(super_meta[table[i, : want.shape[0]].long()], want)


def test_superpage_bounds_enclose_their_pages():
    gen = torch.Generator().manual_seed(1)
    meta = torch.randn(50, 2, 2, 8, generator=gen).sort(dim=2).values
    pages = torch.randperm(50, generator=gen)[:23]
    sup = superpage_meta_ref(meta, pages, 5)
    assert sup.shape == (5, 2, 2, 8)
    for j in range(5):
        rows = meta[pages[j * 5 : (j + 1) * 5]]
        assert torch.equal(sup[j, :, 0], rows[:, :, 0].amin(0))
        assert torch.equal(sup[j, :, 1], rows[:, :, 1].amax(0))


@pytest.mark.parametrize("combine", SUPERPAGE_COMBINES)
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_every_superpage_a_candidate_is_flat_quest(case, combine):
    """With C at least the superpages in use, every page is scored: the same selection as
    flat Quest (sums exact with these inputs; normmax's log-softmax runs over the same
    pages in another order, so within its rounding: no ties at the edge here)."""
    b, hq, hkv, d, s_sp, p_max, nums, top_k, sink, window, _ = case
    q, meta, super_meta, page_super, block_table, num_pages = superpage_case(
        b, hq, hkv, d, s_sp, p_max, nums, seed=11, integer=combine != "normmax"
    )
    c = -(-p_max // s_sp)
    got = superpage_select_ref(
        q, meta, super_meta, page_super, block_table, num_pages, top_k, sink, window, s_sp, c,
        combine, 0.5,
    )  # fmt: skip
    flat = quest_scores_ref(q, meta, block_table, num_pages, combine, 0.5)
    assert torch.equal(got, select_topk_ref(flat, num_pages, top_k, sink, window))


def test_context_within_budget_selects_every_page():
    q, meta, super_meta, page_super, block_table, num_pages = superpage_case(
        2, 4, 2, 8, 4, 30, [30, 11], seed=5
    )
    k = 30  # the budget covers both contexts; C from the engine's rule
    c = num_candidates(k, 4, 1.0)
    sel = superpage_select_ref(
        q, meta, super_meta, page_super, block_table, num_pages, k, 1, 1, 4, c
    )
    bits = unpack_bits(sel, 30)
    assert bits[0].all() and bits[1, :, :11].all() and not bits[1, :, 11:].any()


def test_num_candidates_holds_the_budget():
    assert num_candidates(128, 16, 2.0) == 16
    assert num_candidates(128, 16, 4.0) == 32
    assert num_candidates(10, 16, 1.0) == 1
    assert num_candidates(33, 8, 1.0) * 8 >= 33


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("combine", SUPERPAGE_COMBINES)
def test_cuda_realistic_shape_matches_reference_and_replays_in_a_graph(combine):
    """64 jobs x 4096 pages (64K tokens at page 16), SmolLM2's 9 / 3 heads x D 64, bf16
    metadata, top_k 128 pages, 64 candidate superpages: native kernels == reference bit
    for bit (exact sums; ``normmax``'s exp/log round differently on the GPU, so there at
    most 1 % of the (job, KV head) rows may differ, near-ties at the budget's edge), and a
    CUDA graph replay (no host synchronisation) gives the eager result."""
    nums = [4096 - 7 * i for i in range(64)]
    case = superpage_case(64, 9, 3, 64, 16, 4096, nums, seed=4)
    q, meta, super_meta, page_super, block_table, num_pages = (t.cuda() for t in case)
    meta, super_meta = meta.bfloat16(), super_meta.bfloat16()
    rest = (128, 1, 4, 16, 64, combine, 0.125)
    ref_meta = super_meta.clone()
    want = superpage_select_ref(q, meta, ref_meta, page_super, block_table, num_pages, *rest)
    got = superpage_select(q, meta, super_meta, page_super, block_table, num_pages, *rest)
    assert torch.equal(super_meta, ref_meta)
    rows_differ = (got != want).any(-1).float().mean().item()
    assert rows_differ == 0 if combine != "normmax" else rows_differ <= 0.01
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        superpage_select(q, meta, super_meta, page_super, block_table, num_pages, *rest)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        captured = superpage_select(q, meta, super_meta, page_super, block_table, num_pages, *rest)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, got)
