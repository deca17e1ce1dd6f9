"""The CPU decode path's references gather whole rows (``index_select`` / ``index_copy_``)
instead of advanced indexing, and compute the Quest bounds in a row-contiguous layout, for
speed (docs/performance.md, "CPU decode against llama.cpp"). They must give the same bits
as the plain formulations they replaced, written out here: the CPU results and the
correctness ladder's figures must not move."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.bitmask import pack_bits, selected_pages
from kernels.gather import gather_ref
from kernels.quest_scores import (
    GROUP_COMBINES,
    combine_group_ref,
    quest_head_bounds_matmul,
    quest_head_bounds_ref,
    quest_scores_matmul,
    quest_scores_ref,
)
from kernels.select_topk import select_topk_pages_ref, select_topk_ref
from kernels.slot_list import resident_slot_list, resident_slots_of_pages
from kernels.sparse_attention import sparse_decode_attention_ref


def _bits(x: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a float tensor (NaN payloads and signed zeros compared too)."""
    return x.view(torch.int32 if x.dtype == torch.float32 else torch.int16)


def _plain_sparse_attention(q, kv_slots, selection, slot_list, seq_lens, scale, softcap, window):
    b, hq, d = q.shape
    hkv, k_max = slot_list.shape[1], slot_list.shape[2]
    s = kv_slots.shape[2]
    pages = selected_pages(selection, selection.shape[-1] * 32, k_max).long()
    rec = kv_slots[slot_list.clamp(min=0).long()].float()
    keys = rec[:, :, :, 0].reshape(b, hkv, k_max * s, d)
    vals = rec[:, :, :, 1].reshape(b, hkv, k_max * s, d)
    pos = pages[..., None] * s + torch.arange(s)
    lens = seq_lens.long()[:, None, None, None]
    ok = (pages[..., None] >= 0) & (pos < lens)
    if window:
        ok &= pos >= lens - window
    ok = ok.reshape(b, hkv, 1, k_max * s)
    logits = torch.einsum("bhgd,bhtd->bhgt", q.float().view(b, hkv, hq // hkv, d), keys) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(~ok, float("-inf"))
    vals = vals.masked_fill(~ok.reshape(b, hkv, k_max * s, 1), 0.0)
    p = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    out = torch.einsum("bhgt,bhtd->bhgd", p, vals) / p.sum(dim=-1, keepdim=True)
    return out.reshape(b, hq, d).to(q.dtype)


def _plain_bounds(q, meta, block_table):
    b, hq, d = q.shape
    hkv = meta.shape[1]
    qg = q.float().view(b, hkv, hq // hkv, d)
    pages = meta[block_table.clamp(min=0).long()].float()
    kmin = pages[:, :, :, 0].permute(0, 2, 1, 3)
    kmax = pages[:, :, :, 1].permute(0, 2, 1, 3)
    lo = torch.einsum("bhgd,bhpd->bhgpd", qg, kmin)
    hi = torch.einsum("bhgd,bhpd->bhgpd", qg, kmax)
    return torch.maximum(lo, hi)


def _plain_quest(q, meta, block_table, num_pages, combine, scale):
    p_max = block_table.shape[1]
    valid = torch.arange(p_max)[None, :] < num_pages[:, None]
    terms = _plain_bounds(q, meta, block_table)
    if combine == "sum":
        return terms.sum(dim=(2, 4)).masked_fill(~valid[:, None, :], float("-inf"))
    b, hq = q.shape[:2]
    bounds = terms.sum(dim=4).reshape(b, hq, p_max)
    bounds = bounds.masked_fill(~valid[:, None, :], float("-inf"))
    return combine_group_ref(bounds, num_pages, meta.shape[1], combine, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_sparse_attention_reference_bits_unchanged(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    b, hkv, grp, d, s = 1 + seed % 3, 1 + seed % 3, [1, 3, 4, 2][seed], [16, 64, 128, 64][seed], 16
    n_slots, p, k_max = 50, 37, 9
    q = torch.randn(b, hkv * grp, d, generator=g).to(dtype)
    kv = torch.randn(n_slots, 2, s, d, generator=g).to(dtype)
    kv[:4] = float("nan")  # slots no row uses, read by the -1 padding (clamped to 0)
    mask = torch.zeros(b, hkv, p, dtype=torch.bool)
    slot_list = torch.full((b, hkv, k_max), -1, dtype=torch.int32)
    for i in range(b):
        for h in range(hkv):
            n = int(torch.randint(0, k_max + 1, (1,), generator=g))
            mask[i, h, torch.randperm(p, generator=g)[:n]] = True
            slot_list[i, h, :n] = (torch.randperm(n_slots - 4, generator=g)[:n] + 4).int()
    selection = pack_bits(mask)
    lens = torch.randint(1, p * s + 1, (b,), generator=g).int()
    for window in (None, 40):
        for softcap in (None, 30.0):
            args = (q, kv, selection, slot_list, lens, d**-0.5, softcap, window)
            got = sparse_decode_attention_ref(*args)
            assert torch.equal(_bits(got), _bits(_plain_sparse_attention(*args)))


@pytest.mark.parametrize("combine", GROUP_COMBINES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quest_reference_bits_unchanged(combine, dtype):
    g = torch.Generator().manual_seed(7)
    for b, hkv, grp, d, p in ((1, 3, 3, 64, 501), (3, 2, 4, 16, 37), (2, 1, 1, 128, 5)):
        q = torch.randn(b, hkv * grp, d, generator=g).to(dtype)
        meta = torch.randn(p + 9, hkv, 2, d, generator=g).sort(dim=2).values.to(dtype)
        table = torch.randint(-1, p + 9, (b, p), generator=g).int()
        num_pages = torch.randint(0, p + 1, (b,), generator=g).int()
        got = quest_scores_ref(q, meta, table, num_pages, combine, d**-0.5)
        want = _plain_quest(q, meta, table, num_pages, combine, d**-0.5)
        assert torch.equal(_bits(got), _bits(want))


def _max_abs(x: torch.Tensor) -> float:
    return float(x.abs().max()) if x.numel() else 0.0


def _quest_case(g, b, hkv, grp, d, p, dtype):
    q = torch.randn(b, hkv * grp, d, generator=g).to(dtype)
    meta = (3 * torch.randn(p + 9, hkv, 2, d, generator=g)).sort(dim=2).values.to(dtype)
    num_pages = torch.randint(0, p + 1, (b,), generator=g).int()
    num_pages[0] = p  # one full row
    # distinct pool pages per row (equal pages would tie exactly), -1 past num_pages
    table = torch.stack([torch.randperm(p + 9, generator=g)[:p] for _ in range(b)]).int()
    table[torch.arange(p)[None, :] >= num_pages[:, None]] = -1
    return q, meta, table, num_pages


QUEST_SHAPES = ((1, 3, 3, 64, 501), (3, 2, 4, 16, 37), (2, 1, 1, 128, 5), (2, 3, 3, 64, 130))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quest_matmul_bounds_close_to_the_oracle(dtype):
    """The CPU path's bounds (one GEMM of [q- | q+] against [min | max]) equal the
    element-wise oracle's up to float32 summation order, and are -inf in the same places."""
    g = torch.Generator().manual_seed(11)
    for b, hkv, grp, d, p in QUEST_SHAPES:
        q, meta, table, num_pages = _quest_case(g, b, hkv, grp, d, p, dtype)
        want = quest_head_bounds_ref(q, meta, table, num_pages)
        got = quest_head_bounds_matmul(q, meta, table, num_pages)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        finite = torch.isfinite(want)
        # a bound sums D terms |q_d * k_d|: float32 rounding of the sum is below
        # D * eps * sum_d |q_d| max|k|
        bound = q.float().abs().sum(-1).max() * meta.float().abs().max()
        tol = d * torch.finfo(torch.float32).eps * bound
        assert _max_abs((got - want)[finite]) <= float(tol)


def _union_rows_equal(q, meta, table, num_pages, got, want) -> int:
    """Assert ``union`` scores equal in every (row, KV head) whose heads' oracle bounds
    have no two values within twice the bounds' rounding (then every head ranks its
    pages alike); returns the number of rows checked."""
    b, hkv, grp = q.shape[0], meta.shape[1], q.shape[1] // meta.shape[1]
    ref = quest_head_bounds_ref(q, meta, table, num_pages)
    err = _max_abs((quest_head_bounds_matmul(q, meta, table, num_pages) - ref)[ref.isfinite()])
    checked = 0
    for i in range(b):
        n = int(num_pages[i])
        heads = ref[i, :, :n].reshape(hkv, grp, n).sort(dim=-1).values
        for h in range(hkv):
            if n < 2 or float((heads[h, :, 1:] - heads[h, :, :-1]).min()) > 2 * err + 1e-6:
                assert torch.equal(got[i, h], want[i, h]), (i, h)
                checked += 1
    return checked


@pytest.mark.parametrize("combine", GROUP_COMBINES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quest_matmul_selects_the_oracles_pages_away_from_ties(combine, dtype):
    """Scores close to the oracle's; the top-k pages equal the oracle's in every row whose
    k-th and (k+1)-th oracle scores are further apart than the rounding (a near-tie may
    go either way, as any two float32 summation orders may)."""
    g = torch.Generator().manual_seed(5)
    checked = 0
    for b, hkv, grp, d, p in QUEST_SHAPES:
        q, meta, table, num_pages = _quest_case(g, b, hkv, grp, d, p, dtype)
        want = quest_scores_ref(q, meta, table, num_pages, combine, d**-0.5)
        got = quest_scores_matmul(q, meta, table, num_pages, combine, d**-0.5)
        finite = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got), finite)
        assert torch.equal(got[~finite], want[~finite])
        if combine == "union":  # ranks: equal wherever no head's bounds nearly tie
            checked += _union_rows_equal(q, meta, table, num_pages, got, want)
            continue
        err = _max_abs((got - want)[finite])
        assert err <= 1e-5 * max(1.0, _max_abs(want[finite]))
        # a page can change sides only where two oracle scores lie within 2 x err
        tol = 2 * err + 1e-6
        for top_k in (1, 4, p // 3 + 1):
            sel_want = select_topk_pages_ref(want, num_pages, top_k, 1, 2, p)
            sel_got = select_topk_pages_ref(got, num_pages, top_k, 1, 2, p)
            ranked = want.masked_fill(~finite, -1e30).sort(dim=-1, descending=True).values
            for i in range(b):
                for h in range(hkv):
                    n, k = int(num_pages[i]), top_k
                    if n <= k + 3:  # everything (or all but the forced pages) fits
                        assert torch.equal(sel_got[i, h], sel_want[i, h])
                        continue
                    # the forced pages (1 sink, 2 local) move the boundary to rank k-3..k
                    lo = max(0, k - 4)
                    gaps = ranked[i, h, lo : k + 1] - ranked[i, h, lo + 1 : k + 2]
                    if float(gaps.min()) > tol:  # no near-tie at the boundary
                        assert torch.equal(sel_got[i, h], sel_want[i, h]), (b, hkv, i, h, k)
                        checked += 1
    assert checked > (8 if combine == "union" else 25)  # most of the 17 rows / 51 (row, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_reference_copies_the_same_records(dtype):
    g = torch.Generator().manual_seed(3)
    b, hkv, k, s, d, n_pool, n_slots = 2, 3, 6, 16, 64, 40, 80
    pool = torch.randn(n_pool, hkv, 2, s, d, generator=g).to(dtype)
    slots = torch.randn(n_slots, 2, s, d, generator=g).to(dtype)
    table = torch.randperm(n_pool, generator=g)[:20].int().repeat(b, 1)
    load_pages = torch.randint(-1, 20, (b, hkv, k), generator=g).int()
    load_slots = torch.randperm(n_slots, generator=g)[: b * hkv * k].view(b, hkv, k).int()
    load_slots[load_pages < 0] = -1
    want = slots.clone()
    m = load_slots >= 0
    bi, hi, _ = torch.nonzero(m, as_tuple=True)
    want[load_slots[m].long()] = pool[table.long()[bi, load_pages[m].long()], hi]
    gather_ref(pool, slots, table, load_pages, load_slots)
    assert torch.equal(_bits(slots), _bits(want))


def test_rope_cos_sin_memo_follows_its_inputs():
    from kernels.rope_append import RopeParams, _step_cos_sin, rope_cos_sin_ref

    rope = RopeParams(1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)))
    for pos in ([5], [5], [6], [5, 9]):
        p = torch.tensor(pos)
        for got, want in zip(_step_cos_sin(p, rope, torch.float32), rope_cos_sin_ref(p, rope, torch.float32), strict=True):
            assert torch.equal(got, want)
    rope.inv_freq.mul_(2.0)  # the table changed in place: no stale result
    p = torch.tensor([5, 9])
    assert torch.equal(_step_cos_sin(p, rope, torch.float32)[0], rope_cos_sin_ref(p, rope, torch.float32)[0])
    other = RopeParams(rope.inv_freq.clone(), attention_factor=0.5)
    assert torch.equal(_step_cos_sin(p, other, torch.bfloat16)[1], rope_cos_sin_ref(p, other, torch.bfloat16)[1])


# --- the CPU direct path: the selection as page indices, no bitmask (same pages) ---------


@pytest.mark.parametrize("seed", range(6))
def test_select_topk_pages_equals_the_bitmask_path(seed):
    """:func:`select_topk_pages_ref` gives the pages of :func:`select_topk_ref`'s bitmask
    (:func:`selected_pages`): ties (scores rounded to a few values), ``-inf`` and NaN
    scores on used pages, contexts shorter than the budget, empty contexts, sinks and
    windows larger than the budget, a padded output width."""
    g = torch.Generator().manual_seed(seed)
    b, hkv = 1 + seed % 4, 1 + seed % 3
    p_max = [5, 37, 64, 501, 130, 33][seed]
    top_k = [2, 8, 16, 128, 130, 1][seed]
    sink, window = [(1, 1), (0, 4), (2, 0), (1, 4), (3, 5), (4, 8)][seed]
    k_max = max(top_k, sink + window) + seed % 2 * 7
    scores = torch.randn(b, hkv, p_max, generator=g)
    if seed % 2:
        scores = (scores * 2).round() / 2  # many ties
    scores[..., 3::11] = float("-inf")
    scores[..., 5::17] = float("nan")
    num_pages = torch.randint(0, p_max + 1, (b,), generator=g).int()
    num_pages[0] = p_max
    scores = scores.masked_fill(torch.arange(p_max) >= num_pages[:, None, None].long(), -math.inf)
    want = selected_pages(select_topk_ref(scores, num_pages, top_k, sink, window), p_max, k_max)
    got = select_topk_pages_ref(scores, num_pages, top_k, sink, window, k_max)
    assert got.dtype == torch.int64 and got.shape == (b, hkv, k_max)
    assert torch.equal(got, want.long())


def test_select_topk_pages_refuses_a_narrow_output():
    scores = torch.randn(1, 1, 40)
    with pytest.raises(ValueError, match="k_max=4"):
        select_topk_pages_ref(scores, torch.tensor([40], dtype=torch.int32), 8, 1, 1, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_slots_and_attention_equal_the_bitmask_path(dtype):
    """Slots of the pool from page indices (:func:`resident_slots_of_pages`) equal
    :func:`resident_slot_list` of the bitmask, and attention given those pages equals
    attention that unpacks the bitmask, bit for bit (the CPU direct path against the
    all-resident path of the correctness ladder)."""
    g = torch.Generator().manual_seed(11)
    b, hkv, grp, s, d, n_pool, p_max, top_k = 3, 3, 3, 16, 64, 300, 120, 24
    pool = torch.randn(n_pool, hkv, 2, s, d, generator=g).to(dtype)
    table = torch.stack([torch.randperm(n_pool, generator=g)[:p_max] for _ in range(b)]).int()
    num_pages = torch.tensor([p_max, 17, 90], dtype=torch.int32)
    table[1, 17:] = -1
    lens = (num_pages - 1) * s + torch.tensor([16, 3, 9], dtype=torch.int32)
    scores = torch.randn(b, hkv, p_max, generator=g)
    scores = scores.masked_fill(torch.arange(p_max) >= num_pages[:, None, None].long(), -math.inf)
    q = torch.randn(b, hkv * grp, d, generator=g).to(dtype)
    selection = select_topk_ref(scores, num_pages, top_k, 1, 4)
    pages = select_topk_pages_ref(scores, num_pages, top_k, 1, 4, top_k)
    slots = resident_slots_of_pages(pages, table)
    assert torch.equal(slots, resident_slot_list(selection, table, top_k).long())
    records = pool.view(-1, 2, s, d)
    for softcap in (None, 30.0):
        want = sparse_decode_attention_ref(q, records, selection, slots.int(), lens, 0.125, softcap)
        got = sparse_decode_attention_ref(q, records, None, slots, lens, 0.125, softcap, pages=pages)
        assert torch.equal(_bits(got), _bits(want))
