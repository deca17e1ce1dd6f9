"""Two-level Quest selection: score superpages, then only the pages inside the best ones
(issue 20, "compact page metadata").

A *superpage* is ``S_sp`` consecutive request pages (``EngineConfig.superpage_pages``);
its metadata ``super_meta [P_sp_pool, Hkv, 2, D]`` holds the element-wise key min / max
of its pages, so it bounds each of them and its Quest bound (Tang et al. 2024,
arXiv:2406.10774) is at least every page's. A decode step, per (request, KV head):

1. **refresh** the superpage holding the newest page from its pages' metadata (the only
   superpage a decode append can change; prefill writes whole superpages);
2. **superpage scores**: :func:`kernels.quest_scores.quest_scores_ref` over ``super_meta``
   with the same GQA combine rule as pages (``normmax`` normalises over superpages);
3. keep the best ``C`` superpages (``num_candidates``; ties to the lower superpage);
4. **candidate page scores**: the Quest bound of each of the ``M = C * S_sp`` pages inside
   them, combined as for flat Quest (``normmax``: the log-softmax over the candidate
   pages, since the other pages' bounds are never read);
5. the sink pages and the local window are always selected; the rest of the budget
   (``top_k_pages``) goes to the best candidate pages (ties to the lower page). With
   ``C * S_sp >= top_k_pages`` a context of at most ``top_k_pages`` pages has every page
   a candidate, so every page is selected, as flat Quest does.

Metadata bytes read per (request, layer, KV head) and step: ``ceil(P / S_sp) + M + S_sp``
pair rows instead of ``P``. The selection equals flat Quest's when every superpage is a
candidate; with fewer it can miss pages whose superpage's box bound (loose: the min / max
over ``S_sp`` pages) ranks below ``C`` others (measured in docs/performance.md, "Compact
page metadata: superpages").

A superpage's metadata row is found through ``page_super [P_pool]`` int32: the superpage
row of each pool page that starts a superpage of its request (the cache fills it when it
hands out pages), so superpage ``j`` of request ``b`` is
``page_super[block_table[b, j * S_sp]]`` and the step needs no other table.

:func:`superpage_select_ref` is the PyTorch reference (the CPU path, the tests' oracle);
:func:`superpage_select` the Triton version (fixed shapes, no host synchronisation: CUDA
graph safe), equal to the reference bit for bit where the fp32 sums are exact.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._launch import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_device,
    check_shape,
    check_tensor,
    next_pow2,
    require,
    require_runnable,
)
from kernels.bitmask import num_words, pack_bits
from kernels.quest_scores import (
    _normmax_rows_kernel,
    quest_scores,
    quest_scores_ref,
)
from kernels.select_topk import KEY_MIN_C, _or, _order_key, _topk_key_kernel

SUPERPAGE_COMBINES = ("sum", "max", "normmax")
"""GQA combine rules the two-level selection supports (``union`` ranks every page)."""


def superpage_table(
    page_super: torch.Tensor, block_table: torch.Tensor, superpage_pages: int
) -> torch.Tensor:
    """int32 ``[B, ceil(P_max / S_sp)]``: the ``super_meta`` row of each request superpage
    (``page_super`` at the superpage's first pool page; -1 where that page is unused)."""
    first = block_table[:, ::superpage_pages]
    rows = page_super[first.clamp(min=0).long()]
    return torch.where(first >= 0, rows, torch.full_like(rows, -1)).to(torch.int32)


def num_candidates(top_k_pages: int, superpage_pages: int, oversample: float) -> int:
    """Superpages kept per (request, KV head): enough to hold ``oversample x top_k_pages``
    pages, at least enough to hold ``top_k_pages``."""
    need = max(math.ceil(oversample * top_k_pages), top_k_pages)
    return max(1, -(-need // superpage_pages))


def superpage_meta_ref(
    meta: torch.Tensor, pages: torch.Tensor, superpage_pages: int
) -> torch.Tensor:
    """Superpage bounds of one request's pages: ``[ceil(n / S_sp), Hkv, 2, D]`` (min of the
    mins, max of the maxes of each run of ``S_sp`` pages; the last run may be partial).

    Parameters
    ----------
    meta : ``[P_pool, Hkv, 2, D]`` page metadata; pages : int ``[n]`` pool pages in request order
    """
    n = pages.shape[0]
    rows = meta.index_select(0, pages.long())
    pad = -n % superpage_pages
    if pad:  # repeat the last page: min/max unchanged
        rows = torch.cat([rows, rows[-1:].expand(pad, *rows.shape[1:])])
    rows = rows.view(-1, superpage_pages, *rows.shape[1:])
    return torch.stack([rows[:, :, :, 0].amin(1), rows[:, :, :, 1].amax(1)], dim=2)


def refresh_tail_ref(
    meta: torch.Tensor,
    super_meta: torch.Tensor,
    page_super: torch.Tensor,
    block_table: torch.Tensor,
    num_pages: torch.Tensor,
    superpage_pages: int,
) -> None:
    """Set each request's newest superpage (the one holding page ``num_pages - 1``) from
    its pages' metadata, in place; requests with no page are skipped."""
    s = superpage_pages
    p_max = block_table.shape[1]
    table = superpage_table(page_super, block_table, s)
    n = num_pages.long().to(block_table.device)
    last = ((n - 1).clamp(min=0) // s)[:, None]  # [B, 1]
    idx = last * s + torch.arange(s, device=block_table.device)[None, :]  # [B, S_sp]
    ok = (idx < n[:, None]) & (idx < p_max)
    pages = block_table.gather(1, idx.clamp(max=p_max - 1)).long().clamp(min=0)
    rows = meta[pages].float()  # [B, S_sp, Hkv, 2, D]
    okf = ok[:, :, None, None]
    lo = rows[:, :, :, 0].masked_fill(~okf, math.inf).amin(1)
    hi = rows[:, :, :, 1].masked_fill(~okf, -math.inf).amax(1)
    dst = table.gather(1, last).squeeze(1).long()  # [B]
    has = (n > 0) & (dst >= 0)
    fresh = torch.stack([lo, hi], dim=2).to(super_meta.dtype)
    super_meta[dst[has]] = fresh[has]


def _forced_and_budget(
    num_pages: torch.Tensor, top_k_pages: int, sink_pages: int, window_pages: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request: forced page count and the free budget (pages chosen by score)."""
    n = num_pages.long()
    forced = n - (n - window_pages - sink_pages).clamp(min=0)
    budget = torch.maximum(n.clamp(max=top_k_pages), forced)
    return forced, budget - forced


def _forced_mask(num_pages: torch.Tensor, p_max: int, sink_pages: int, window_pages: int):
    """bool ``[B, P_max]``: the sink pages and the local window of each request."""
    idx = torch.arange(p_max, device=num_pages.device)[None, :]
    n = num_pages.long()[:, None]
    return (idx < n) & ((idx < sink_pages) | (idx >= n - window_pages))


def superpage_select_ref(
    q: torch.Tensor,
    meta: torch.Tensor,
    super_meta: torch.Tensor,
    page_super: torch.Tensor,
    block_table: torch.Tensor,
    num_pages: torch.Tensor,
    top_k_pages: int,
    sink_pages: int,
    window_pages: int,
    superpage_pages: int,
    num_candidates: int,
    combine: str = "normmax",
    scale: float | None = None,
) -> torch.Tensor:
    """Two-level Quest selection bitmask (module docstring, steps 1-5); refreshes the
    newest superpage of each request in ``super_meta`` first.

    Parameters
    ----------
    q : ``[B, Hq, D]`` queries after RoPE
    meta : ``[P_pool, Hkv, 2, D]`` page metadata (key min, max)
    super_meta : ``[P_sp_pool, Hkv, 2, D]`` superpage metadata (updated in place)
    page_super : int32 ``[P_pool]`` superpage row of a superpage's first pool page
    block_table : int32 ``[B, P_max]`` (-1 unused); num_pages : int32 ``[B]``
    top_k_pages, sink_pages, window_pages : as :func:`kernels.select_topk.select_topk_ref`
    superpage_pages : ``S_sp``; num_candidates : ``C`` superpages kept (capped at
        ``ceil(P_max / S_sp)``)
    combine : ``sum``, ``max`` or ``normmax``; scale : softmax scale (``None``: ``D**-0.5``)

    Returns
    -------
    int32 ``[B, Hkv, ceil(P_max / 32)]`` selection bitmask.

    Raises
    ------
    ValueError : ``combine`` not in :data:`SUPERPAGE_COMBINES`
    """
    require(combine in SUPERPAGE_COMBINES, f"combine must be one of {SUPERPAGE_COMBINES}")
    b, hq, d = q.shape
    hkv = meta.shape[1]
    g = hq // hkv
    p_max = block_table.shape[1]
    s = superpage_pages
    scale = d**-0.5 if scale is None else scale
    dev = q.device
    refresh_tail_ref(meta, super_meta, page_super, block_table, num_pages, s)
    n = num_pages.long().to(dev)
    sp_scores = quest_scores_ref(
        q, super_meta, superpage_table(page_super, block_table, s), (n + s - 1) // s, combine, scale
    )  # [B, Hkv, SPn]
    c = min(num_candidates, sp_scores.shape[-1])
    order = torch.sort(sp_scores, dim=-1, descending=True, stable=True).indices[..., :c]
    cand = (order[..., None] * s + torch.arange(s, device=dev)).flatten(2)  # [B, Hkv, M]
    valid = cand < torch.minimum(n, torch.tensor(p_max, device=dev))[:, None, None]
    pool = block_table.long().gather(1, cand.clamp(max=p_max - 1).flatten(1)).clamp(min=0)
    heads = torch.arange(hkv, device=dev)[None, :, None]
    rows = meta[pool.view(b, hkv, -1), heads].float()  # [B, Hkv, M, 2, D]
    qg = q.float().view(b, hkv, g, 1, d)
    u = torch.maximum(qg * rows[:, :, None, :, 0], qg * rows[:, :, None, :, 1]).sum(-1)
    u = u.masked_fill(~valid[:, :, None], -math.inf)  # [B, Hkv, G, M]
    if combine == "sum":
        score = u.sum(2)
    elif combine == "max":
        score = u.amax(2)
    else:
        x = u * scale
        score = (x - torch.logsumexp(x, dim=-1, keepdim=True)).amax(2)
    forced_all = _forced_mask(n, p_max, sink_pages, window_pages)  # [B, P_max]
    forced_c = forced_all.gather(1, cand.clamp(max=p_max - 1).flatten(1)).view_as(cand)
    usable = valid & ~forced_c
    score = score.masked_fill(~usable, -math.inf)
    # best first, ties to the lower page: sort by page, then stably by score
    by_page = torch.sort(cand, dim=-1, stable=True)
    score_p = score.gather(-1, by_page.indices)
    rank_order = torch.sort(score_p, dim=-1, descending=True, stable=True).indices
    ranked_pages = by_page.values.gather(-1, rank_order)
    ranked_usable = usable.gather(-1, by_page.indices).gather(-1, rank_order)
    _, free = _forced_and_budget(n, top_k_pages, sink_pages, window_pages)
    rank = torch.arange(ranked_pages.shape[-1], device=dev)
    keep = ranked_usable & (rank[None, None, :] < free[:, None, None])
    picked = torch.zeros(b, hkv, p_max, dtype=torch.int32, device=dev)
    picked.scatter_add_(-1, ranked_pages.clamp(max=p_max - 1), keep.int())
    return pack_bits(forced_all[:, None, :] | (picked > 0))


@triton.jit
def _refresh_tail_kernel(
    meta_ptr,
    super_ptr,
    page_super_ptr,
    block_table_ptr,
    num_pages_ptr,
    table_ptr,
    n_sp_ptr,
    num_kv_heads,
    p_max,
    spn,
    stride_meta_p,
    stride_meta_h,
    stride_meta_mm,
    stride_sup_p,
    stride_sup_h,
    stride_sup_mm,
    stride_bt_b,
    S_SP: tl.constexpr,
    BLOCK_S: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """One (request, KV head): the newest superpage's min / max from its pages' metadata;
    the KV head 0 program also writes the request's superpage table row
    (:func:`superpage_table`) and superpage count ``ceil(num_pages / S_sp)``."""
    row = tl.program_id(0)
    b = row // num_kv_heads
    h = row % num_kv_heads
    n = tl.load(num_pages_ptr + b).to(tl.int32)
    if h == 0:
        tl.store(n_sp_ptr + b, (n + S_SP - 1) // S_SP)
        for start in range(0, spn, BLOCK_T):
            offs_t = start + tl.arange(0, BLOCK_T)
            mask_t = offs_t < spn
            first = tl.load(
                block_table_ptr + b * stride_bt_b + offs_t * S_SP, mask=mask_t, other=-1
            )
            sup = tl.load(page_super_ptr + tl.maximum(first, 0), mask=first >= 0, other=-1)
            tl.store(table_ptr + b * spn + offs_t, tl.where(first >= 0, sup, -1), mask=mask_t)
    j0 = (tl.maximum(n - 1, 0) // S_SP) * S_SP
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    page = j0 + offs_s
    mask_s = (offs_s < S_SP) & (page < n) & (page < p_max)
    mask_d = offs_d < D
    pool_page = tl.load(block_table_ptr + b * stride_bt_b + page, mask=mask_s, other=0)
    pool_page = tl.maximum(pool_page, 0).to(tl.int64)
    src = meta_ptr + pool_page[:, None] * stride_meta_p + h * stride_meta_h + offs_d[None, :]
    mask = mask_s[:, None] & mask_d[None, :]
    lo = tl.min(tl.load(src, mask=mask, other=float("inf")).to(tl.float32), axis=0)
    hi = tl.max(
        tl.load(src + stride_meta_mm, mask=mask, other=float("-inf")).to(tl.float32), axis=0
    )
    first = tl.load(block_table_ptr + b * stride_bt_b + j0, mask=n > 0, other=-1)
    dst_row = tl.load(page_super_ptr + tl.maximum(first, 0), mask=first >= 0, other=-1)
    ok = (n > 0) & (first >= 0) & (dst_row >= 0)
    mask_out = mask_d & ((tl.zeros([BLOCK_D], tl.int32) + ok.to(tl.int32)) != 0)
    dst = super_ptr + tl.maximum(dst_row, 0).to(tl.int64) * stride_sup_p + h * stride_sup_h
    ty = super_ptr.dtype.element_ty
    tl.store(dst + offs_d, lo.to(ty), mask=mask_out)
    tl.store(dst + stride_sup_mm + offs_d, hi.to(ty), mask=mask_out)


@triton.jit
def _candidate_bounds_kernel(
    q_ptr,
    meta_ptr,
    block_table_ptr,
    num_pages_ptr,
    sp_key_ptr,
    cand_ptr,
    out_ptr,
    num_kv_heads,
    p_max,
    num_cand,
    c,
    stride_q_b,
    stride_q_h,
    stride_meta_p,
    stride_meta_h,
    stride_meta_mm,
    stride_bt_b,
    stride_out_b,
    stride_out_h,
    G: tl.constexpr,
    S_SP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    MODE: tl.constexpr,
):
    """One (request, KV head, candidate block): the request page of each candidate
    (``cand [B, Hkv, M]``, from the kept superpages' packed keys) and its Quest bounds,
    combined as :func:`kernels.quest_scores._quest_scores_kernel`'s MODE (0 sum, 1 max,
    2 every head to ``out [B, Hq, M]``); ``-inf`` on candidates past ``num_pages``."""
    row = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = row // num_kv_heads
    h = row % num_kv_heads
    n = tl.minimum(tl.load(num_pages_ptr + b).to(tl.int32), p_max)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    in_m = offs_m < num_cand
    sp_key = tl.load(sp_key_ptr + row.to(tl.int64) * c + offs_m // S_SP, mask=in_m, other=0)
    sp = 4294967295 - (sp_key & 4294967295)
    page = (sp * S_SP + offs_m % S_SP).to(tl.int32)
    tl.store(cand_ptr + row.to(tl.int64) * num_cand + offs_m, page, mask=in_m)
    mask_m = in_m & (page < n)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    pool_page = tl.load(block_table_ptr + b * stride_bt_b + page, mask=mask_m, other=0)
    pool_page = tl.maximum(pool_page, 0).to(tl.int64)
    meta = meta_ptr + pool_page[:, None] * stride_meta_p + h * stride_meta_h + offs_d[None, :]
    mask = mask_m[:, None] & mask_d[None, :]
    kmin = tl.load(meta, mask=mask, other=0.0).to(tl.float32)
    kmax = tl.load(meta + stride_meta_mm, mask=mask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_M], tl.float32)
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for g in tl.static_range(G):
        qg = tl.load(
            q_ptr + b * stride_q_b + (h * G + g) * stride_q_h + offs_d, mask=mask_d, other=0.0
        )
        qg = qg.to(tl.float32)[None, :]
        u = tl.sum(tl.maximum(qg * kmin, qg * kmax, propagate_nan=tl.PropagateNan.ALL), axis=1)
        if MODE == 0:
            acc += u
        elif MODE == 1:
            best = tl.maximum(best, u, propagate_nan=tl.PropagateNan.ALL)
        else:
            dst = out_ptr + b * stride_out_b + (h * G + g) * stride_out_h + offs_m
            tl.store(dst, tl.where(mask_m, u, float("-inf")), mask=in_m)
    if MODE != 2:
        score = acc if MODE == 0 else best
        dst = out_ptr + b * stride_out_b + h * stride_out_h + offs_m
        tl.store(dst, tl.where(mask_m, score, float("-inf")), mask=in_m)


@triton.jit
def _candidate_key_kernel(
    score_ptr,
    cand_ptr,
    num_pages_ptr,
    key_ptr,
    num_kv_heads,
    p_max,
    num_cand,
    sink_pages,
    window_pages,
    BLOCK_M: tl.constexpr,
):
    """Distinct int64 keys of the candidates, descending = best first, ties to the lower
    page (as :func:`kernels.select_topk._topk_key_kernel`); forced or unused pages -inf."""
    row = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = row // num_kv_heads
    n = tl.minimum(tl.load(num_pages_ptr + b).to(tl.int32), p_max)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    in_m = offs_m < num_cand
    base = row.to(tl.int64) * num_cand + offs_m
    page = tl.load(cand_ptr + base, mask=in_m, other=0)
    x = tl.load(score_ptr + base, mask=in_m, other=float("-inf")).to(tl.float32)
    forced = (page < sink_pages) | (page >= n - window_pages)
    x = tl.where((page < n) & ~forced, x, float("-inf"))
    tl.store(key_ptr + base, _order_key(x, page), mask=in_m)


@triton.jit
def _forced_words_kernel(
    num_pages_ptr,
    sel_ptr,
    num_kv_heads,
    p_max,
    num_words,
    sink_pages,
    window_pages,
    BLOCK_W: tl.constexpr,
):
    """One (request, KV head, word block): the bitmask words of the sink and window pages."""
    row = tl.program_id(0)
    pid_w = tl.program_id(1)
    b = row // num_kv_heads
    n = tl.minimum(tl.load(num_pages_ptr + b).to(tl.int32), p_max)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_bit = tl.arange(0, 32)
    page = offs_w[:, None] * 32 + offs_bit[None, :]
    forced = (page < n) & ((page < sink_pages) | (page >= n - window_pages))
    words = tl.reduce(tl.where(forced, 1, 0) << offs_bit[None, :], 1, _or)
    tl.store(sel_ptr + row.to(tl.int64) * num_words + offs_w, words, mask=offs_w < num_words)


@triton.jit
def _pick_kernel(
    top_ptr,
    num_pages_ptr,
    sel_ptr,
    num_kv_heads,
    num_words,
    k,
    top_k_pages,
    sink_pages,
    window_pages,
    BLOCK_K: tl.constexpr,
):
    """One (request, KV head, rank block): set the bits of the best ``budget - forced``
    candidates (``top [B, Hkv, k]``, keys in descending order) that are usable."""
    row = tl.program_id(0)
    pid_k = tl.program_id(1)
    b = row // num_kv_heads
    n = tl.load(num_pages_ptr + b).to(tl.int32)
    forced = n - tl.maximum(n - window_pages - sink_pages, 0)
    free = tl.maximum(tl.minimum(n, top_k_pages), forced) - forced
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = offs_k < k
    key = tl.load(top_ptr + row.to(tl.int64) * k + offs_k, mask=mask_k, other=0)
    page = (4294967295 - (key & 4294967295)).to(tl.int32)
    forced_p = (page < sink_pages) | (page >= n - window_pages)
    usable = mask_k & (offs_k < free) & (page < n) & ~forced_p
    word = sel_ptr + row.to(tl.int64) * num_words + page // 32
    tl.atomic_or(word, (1 << (page % 32)).to(tl.int32), mask=usable)


FUSED_SORT_MAX = 4096
"""Longest row (superpages, or candidate pages ``M``; rounded up to a power of two) that
:func:`superpage_select` ranks inside one program (``tl.topk`` / ``tl.sort``); longer rows
go through ``torch.topk`` and the separate key / forced-word / pick kernels."""


@triton.jit
def _ranked(key, K: tl.constexpr):
    """The ``K`` largest of a row of keys, descending (``tl.topk``; ``tl.sort`` when ``K``
    is the whole row)."""
    if K == key.shape[0]:
        return tl.sort(key, descending=True)
    return tl.topk(key, K)


def _sort_warps(n: int) -> int:
    """Warps of a program that ranks a row of ``n`` keys in registers: 8 from 512 keys.
    A hand choice for SmolLM2's 128K x 32-job shape, not compared against other counts by
    a repo benchmark; ``scripts/bench_superpage.py`` times the result."""
    return 4 if n < 512 else 8


def _rank_width(k: int, n: int) -> int:
    """Keys a row's ranking keeps: the next power of two >= ``k`` (``tl.topk``), or the
    whole row of ``next_pow2(n)`` (``tl.sort``) where that is no wider."""
    return min(next_pow2(max(k, 1)), next_pow2(n))


def _fused_ranking(n: int) -> bool:
    """Whether a row of ``n`` keys is ranked inside one program: at most
    :data:`FUSED_SORT_MAX` keys, and a Triton with ``tl.topk`` (``pyproject.toml`` allows
    Triton 3.2; without it the ``torch.topk`` path runs, as for long rows)."""
    return next_pow2(n) <= FUSED_SORT_MAX and hasattr(tl, "topk")


@triton.jit
def _top_superpages_kernel(
    score_ptr,
    n_sp_ptr,
    top_ptr,
    num_kv_heads,
    spn,
    c,
    stride_sc_b,
    stride_sc_h,
    BLOCK: tl.constexpr,
    K: tl.constexpr,
):
    """One (request, KV head): the keys of its best ``c <= K`` superpages, descending (what
    :func:`kernels.select_topk._topk_key_kernel` with no forced pages and ``torch.topk``
    give), ranked in registers from the row's ``spn <= BLOCK`` keys."""
    row = tl.program_id(0)
    b = row // num_kv_heads
    h = row % num_kv_heads
    n = tl.load(n_sp_ptr + b)
    offs = tl.arange(0, BLOCK)
    in_row = offs < spn
    x = tl.load(score_ptr + b * stride_sc_b + h * stride_sc_h + offs, mask=in_row, other=0.0)
    x = tl.where(offs < n, x.to(tl.float32), float("-inf"))
    key = tl.where(in_row, _order_key(x, offs), KEY_MIN_C)
    top = _ranked(key, K)
    offs_k = tl.arange(0, K)
    tl.store(top_ptr + row.to(tl.int64) * c + offs_k, top, mask=offs_k < c)


@triton.jit
def _pick_candidates_kernel(
    bounds_ptr,
    cand_ptr,
    num_pages_ptr,
    sel_ptr,
    num_kv_heads,
    p_max,
    num_cand,
    num_words,
    top_k_pages,
    sink_pages,
    window_pages,
    scale,
    stride_u_b,
    stride_u_h,
    G: tl.constexpr,
    NORMMAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    K: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """One (request, KV head): steps 4-5 of the module docstring after the candidates'
    bounds, in one program. ``NORMMAX``: each head's log-softmax over the candidates
    (``bounds [B, Hq, M]``), the maximum over the group; else ``bounds [B, Hkv, M]`` are
    the scores. Then the candidates' keys (forced and unused pages ``-inf``), their best
    ``K`` (``>= top_k_pages``, or the whole row) ranked in registers for the ``free``-th
    best key, the row's forced words, and the bits of the usable candidates at or above
    that key (``atomic_or``: a word can hold pages of two candidate superpages)."""
    row = tl.program_id(0)
    b = row // num_kv_heads
    h = row % num_kv_heads
    n = tl.minimum(tl.load(num_pages_ptr + b).to(tl.int32), p_max)
    offs_m = tl.arange(0, BLOCK_M)
    in_m = offs_m < num_cand
    page = tl.load(cand_ptr + row.to(tl.int64) * num_cand + offs_m, mask=in_m, other=0)
    valid = in_m & (page < n)
    if NORMMAX:
        score = tl.full([BLOCK_M], float("-inf"), tl.float32)
        for g in tl.static_range(G):
            src = bounds_ptr + b * stride_u_b + (h * G + g) * stride_u_h + offs_m
            x = tl.load(src, mask=valid, other=float("-inf")) * scale
            m = tl.max(x, axis=0)
            shift = tl.where(m == float("-inf"), 0.0, m)
            total = tl.sum(tl.exp(x - shift), axis=0)
            lse = tl.where(total > 0, m + tl.log(tl.where(total > 0, total, 1.0)), 0.0)
            score = tl.maximum(score, tl.where(valid, x - lse, float("-inf")))
    else:
        src = bounds_ptr + b * stride_u_b + h * stride_u_h + offs_m
        score = tl.load(src, mask=valid, other=float("-inf"))
    usable = valid & ~((page < sink_pages) | (page >= n - window_pages))
    key = tl.where(in_m, _order_key(tl.where(usable, score, float("-inf")), page), KEY_MIN_C)
    ranked = _ranked(key, K)
    forced = n - tl.maximum(n - window_pages - sink_pages, 0)
    free = tl.maximum(tl.minimum(n, top_k_pages), forced) - forced
    last = tl.minimum(tl.minimum(free, num_cand), K) - 1
    thr = tl.sum(tl.where(tl.arange(0, K) == last, ranked, 0), axis=0)
    thr = tl.where(free > 0, thr, 9223372036854775807)  # no free slot: nothing picked
    picked = usable & (key >= thr)
    sel_row = sel_ptr + row.to(tl.int64) * num_words
    offs_bit = tl.arange(0, 32)
    for start in range(0, num_words, BLOCK_W):
        offs_w = start + tl.arange(0, BLOCK_W)
        pg = offs_w[:, None] * 32 + offs_bit[None, :]
        is_forced = (pg < n) & ((pg < sink_pages) | (pg >= n - window_pages))
        words = tl.reduce(tl.where(is_forced, 1, 0) << offs_bit[None, :], 1, _or)
        tl.store(sel_row + offs_w, words, mask=offs_w < num_words)
    tl.debug_barrier()  # the words above are written before any thread ORs into them
    tl.atomic_or(sel_row + page // 32, (1 << (page % 32)).to(tl.int32), mask=picked)


def superpage_select(
    q: torch.Tensor,
    meta: torch.Tensor,
    super_meta: torch.Tensor,
    page_super: torch.Tensor,
    block_table: torch.Tensor,
    num_pages: torch.Tensor,
    top_k_pages: int,
    sink_pages: int,
    window_pages: int,
    superpage_pages: int,
    num_candidates: int,
    combine: str = "normmax",
    scale: float | None = None,
) -> torch.Tensor:
    """Triton :func:`superpage_select_ref` (same arguments and result; the same bitmask
    where the fp32 bound sums are exact, else equal up to near-ties at the budget's edge).

    Launches: the tail refresh (which also writes the superpage table);
    :func:`kernels.quest_scores.quest_scores` over the superpages; the best ``C``
    superpages (:func:`_top_superpages_kernel`: one in-register sort a row); the
    candidates' bounds; then one program a row for the rest (:func:`_pick_candidates_kernel`:
    ``normmax``'s log-softmax over the candidates, their keys, the sort for the budget,
    the forced words and the picked bits). Rows longer than :data:`FUSED_SORT_MAX` keys,
    or a Triton without ``tl.topk``, take ``torch.topk`` and separate key, forced-word and
    pick kernels instead. Fixed shapes, no host synchronisation.

    Raises
    ------
    ValueError : bad shapes, dtypes, devices or ``combine``
    """
    check_tensor("q", q, 3, FLOAT_DTYPES)
    check_tensor("meta", meta, 4, FLOAT_DTYPES)
    check_tensor("super_meta", super_meta, 4, FLOAT_DTYPES)
    check_tensor("page_super", page_super, 1, (torch.int32,))
    check_tensor("block_table", block_table, 2, INDEX_DTYPES)
    check_tensor("num_pages", num_pages, 1, INDEX_DTYPES, unit_last=False)
    require(combine in SUPERPAGE_COMBINES, f"combine must be one of {SUPERPAGE_COMBINES}")
    require(superpage_pages > 0 and num_candidates > 0, "superpage_pages, num_candidates > 0")
    require(min(top_k_pages, sink_pages, window_pages) >= 0, "page counts must be >= 0")
    b, hq, d = q.shape
    hkv = meta.shape[1]
    p_max = block_table.shape[1]
    require(hkv > 0 and hq % hkv == 0, f"Hq={hq} is not a multiple of Hkv={hkv}")
    require(meta.shape[2:] == (2, d), f"meta must be [P_pool, Hkv, 2, {d}]")
    require(super_meta.shape[1:] == meta.shape[1:], "super_meta must be [P_sp_pool, Hkv, 2, D]")
    require(block_table.shape[0] == b, f"block_table has {block_table.shape[0]} rows, batch is {b}")
    check_shape("num_pages", num_pages, (b,))
    check_device(q.device, meta=meta, super_meta=super_meta, page_super=page_super)
    check_device(q.device, block_table=block_table, num_pages=num_pages)
    require_runnable(q.device)
    s = superpage_pages
    scale = d**-0.5 if scale is None else float(scale)
    w = num_words(p_max)
    sel = torch.empty((b, hkv, w), dtype=torch.int32, device=q.device)
    if sel.numel() == 0:
        return sel
    g = hq // hkv
    block_d = next_pow2(d)
    spn = -(-p_max // s)
    table = torch.empty((b, spn), dtype=torch.int32, device=q.device)
    n_sp = torch.empty((b,), dtype=torch.int32, device=q.device)
    _refresh_tail_kernel[(b * hkv,)](
        meta, super_meta, page_super, block_table, num_pages, table, n_sp, hkv, p_max, spn,
        meta.stride(0), meta.stride(1), meta.stride(2),
        super_meta.stride(0), super_meta.stride(1), super_meta.stride(2),
        block_table.stride(0),
        S_SP=s, BLOCK_S=next_pow2(s), D=d, BLOCK_D=block_d,
        BLOCK_T=min(1024, next_pow2(spn)), num_warps=4,
    )  # fmt: skip
    sp_scores = quest_scores(q, super_meta, table, n_sp, combine, scale)  # [B, Hkv, SPn]
    c = min(num_candidates, spn)
    if _fused_ranking(spn):
        sp_top = torch.empty((b, hkv, c), dtype=torch.int64, device=q.device)
        _top_superpages_kernel[(b * hkv,)](
            sp_scores, n_sp, sp_top, hkv, spn, c, sp_scores.stride(0), sp_scores.stride(1),
            BLOCK=next_pow2(spn), K=_rank_width(c, spn), num_warps=_sort_warps(spn),
        )  # fmt: skip
    else:
        sp_key = torch.empty((b, hkv, spn), dtype=torch.int64, device=q.device)
        block_sp = min(1024, next_pow2(spn))
        _topk_key_kernel[(b * hkv, -(-spn // block_sp))](
            sp_scores, n_sp, sp_key, hkv, spn, 0, 0, sp_scores.stride(0), sp_scores.stride(1),
            BLOCK_P=block_sp, num_warps=4,
        )  # fmt: skip
        sp_top = torch.topk(sp_key, c, dim=-1, sorted=True).values.contiguous()
    m = c * s
    cand = torch.empty((b, hkv, m), dtype=torch.int32, device=q.device)
    score = torch.empty((b, hkv, m), dtype=torch.float32, device=q.device)
    mode = {"sum": 0, "max": 1}.get(combine, 2)
    dst = score if mode != 2 else torch.empty((b, hq, m), dtype=torch.float32, device=q.device)
    block_m = max(16, min(64, 4096 // block_d, next_pow2(m)))
    _candidate_bounds_kernel[(b * hkv, -(-m // block_m))](
        q, meta, block_table, num_pages, sp_top, cand, dst, hkv, p_max, m, c,
        q.stride(0), q.stride(1), meta.stride(0), meta.stride(1), meta.stride(2),
        block_table.stride(0), dst.stride(0), dst.stride(1),
        G=g, S_SP=s, D=d, BLOCK_D=block_d, BLOCK_M=block_m, MODE=mode, num_warps=4,
    )  # fmt: skip
    if _fused_ranking(m):
        _pick_candidates_kernel[(b * hkv,)](
            dst, cand, num_pages, sel, hkv, p_max, m, w, top_k_pages, sink_pages, window_pages,
            scale, dst.stride(0), dst.stride(1),
            G=g, NORMMAX=mode == 2, BLOCK_M=next_pow2(m), K=_rank_width(top_k_pages, m),
            BLOCK_W=min(128, next_pow2(w)),
            num_warps=_sort_warps(m),
        )  # fmt: skip
        return sel
    if mode == 2:
        block_g = next_pow2(g)
        every = torch.full((b,), m, dtype=torch.int32, device=q.device)
        _normmax_rows_kernel[(b * hkv,)](
            dst, every, score, hkv, m, scale, dst.stride(0), dst.stride(1),
            score.stride(0), score.stride(1),
            G=g, BLOCK_G=block_g, BLOCK_P=max(16, min(1024 // block_g, next_pow2(m))),
            num_warps=4,
        )  # fmt: skip
    key = torch.empty((b, hkv, m), dtype=torch.int64, device=q.device)
    block_k = min(1024, next_pow2(m))
    _candidate_key_kernel[(b * hkv, -(-m // block_k))](
        score, cand, num_pages, key, hkv, p_max, m, sink_pages, window_pages,
        BLOCK_M=block_k, num_warps=4,
    )  # fmt: skip
    k = max(1, min(top_k_pages, m))
    top = torch.topk(key, k, dim=-1, sorted=True).values.contiguous()
    block_w = min(32, next_pow2(w))
    _forced_words_kernel[(b * hkv, -(-w // block_w))](
        num_pages, sel, hkv, p_max, w, sink_pages, window_pages, BLOCK_W=block_w, num_warps=4
    )
    block_top = min(1024, next_pow2(k))
    _pick_kernel[(b * hkv, -(-k // block_top))](
        top, num_pages, sel, hkv, w, k, top_k_pages, sink_pages, window_pages,
        BLOCK_K=block_top, num_warps=4,
    )  # fmt: skip
    return sel
