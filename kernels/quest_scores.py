"""Quest page scores: per (request, KV head, page), the G query heads' upper bounds on the
page's attention logits, combined into one ranking (issue #18).

Quest (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference", arXiv:2406.10774) bounds a page's attention logit from above by
``sum_d max(q_d * min_d, q_d * max_d)`` using the element-wise key min and max of the page.
For GQA one selection serves the G query heads that share a KV head; Quest sums their
bounds, which lets heads that do not attend to a page outvote the one that does, so the
combine is a setting (:data:`GROUP_COMBINES`, :func:`combine_group_ref`: ``sum``, ``max``,
``normmax``, ``union``; ``EngineConfig.group_combine``).

:func:`quest_scores_ref` is the PyTorch reference (the tests' oracle);
:func:`quest_scores_matmul` the CPU path (the bounds as one GEMM, equal up to rounding);
:func:`quest_scores` the Triton version: one program per (request, KV head, page block),
plus for ``normmax`` one normalising program per (request, KV head) and for ``union`` a
``torch.sort`` on the device; no host synchronisation.
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

GROUP_COMBINES = ("sum", "max", "normmax", "union")
"""Ways to combine the G query heads' Quest bounds into one page score per KV head
(:func:`quest_scores_ref`); ``EngineConfig.group_combine`` names one."""


def quest_head_bounds_ref(
    q: torch.Tensor,
    meta: torch.Tensor,
    block_table: torch.Tensor,
    num_pages: torch.Tensor,
) -> torch.Tensor:
    """Quest upper bound of every query head's logit on every page (before the GQA combine).

    ``u[b, i, p] = sum_d max(q[b, i, d] * kmin[p, h, d], q[b, i, d] * kmax[p, h, d])`` with
    ``h = i // G`` the KV head of query head ``i`` (Tang et al. 2024, arXiv:2406.10774,
    Algorithm 1): no key of page ``p`` has a larger dot product with ``q[b, i]``. Unscaled
    (logit units before the softmax scale).

    Parameters
    ----------
    q : ``[B, Hq, D]`` queries (after RoPE), any float dtype
    meta : ``[P_pool, Hkv, 2, D]`` page metadata (``[:, :, 0]`` key min, ``[:, :, 1]`` key max)
    block_table : int32 ``[B, P_max]`` pool page of each request page (-1 unused)
    num_pages : int32 ``[B]`` pages in use per request

    Returns
    -------
    float32 ``[B, Hq, P_max]``; ``-inf`` on pages >= ``num_pages``.
    """
    b, hq, _ = q.shape
    p_max = block_table.shape[1]
    bounds = _bound_terms(q, meta, block_table).sum(dim=4).reshape(b, hq, p_max)
    return bounds.masked_fill(~_valid_pages(num_pages, p_max, q.device)[:, None, :], float("-inf"))


def _bound_terms(q: torch.Tensor, meta: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """float32 ``[B, Hkv, G, P_max, D]``: ``max(q_d * kmin_d, q_d * kmax_d)``.

    Computed in a ``[B, Hkv, P_max, G, D]`` buffer (returned as a permuted view; D stays
    innermost, so a reduction over D alone gives the same bits as over a contiguous
    ``[.., G, P_max, D]`` tensor): the broadcast products run along contiguous rows, ~2x
    faster on CPU. The pages' metadata is gathered with ``index_select`` (whole rows).
    """
    b, hq, d = q.shape
    hkv = meta.shape[1]
    p_max = block_table.shape[1]
    qg = q.float().view(b, hkv, 1, hq // hkv, d)
    idx = block_table.clamp(min=0).reshape(-1).long()
    pages = meta.index_select(0, idx).float().view(b, p_max, hkv, 2, d).transpose(1, 2)
    lo = pages[:, :, :, 0, None, :] * qg  # [B, Hkv, P_max, G, D]
    hi = pages[:, :, :, 1, None, :] * qg
    return torch.maximum(lo, hi, out=lo).permute(0, 1, 3, 2, 4)


def _bound_terms_contiguous(
    q: torch.Tensor, meta: torch.Tensor, block_table: torch.Tensor
) -> torch.Tensor:
    """:func:`_bound_terms` as a contiguous ``[B, Hkv, G, P_max, D]`` tensor (the ``sum``
    rule reduces over G and D at once, whose order depends on the layout)."""
    b, hq, d = q.shape
    hkv = meta.shape[1]
    p_max = block_table.shape[1]
    qg = q.float().view(b, hkv, hq // hkv, d)
    idx = block_table.clamp(min=0).reshape(-1).long()
    pages = meta.index_select(0, idx).float().view(b, p_max, hkv, 2, d)
    kmin = pages[:, :, :, 0].permute(0, 2, 1, 3)  # [B, Hkv, P_max, D]
    kmax = pages[:, :, :, 1].permute(0, 2, 1, 3)
    lo = torch.einsum("bhgd,bhpd->bhgpd", qg, kmin)
    hi = torch.einsum("bhgd,bhpd->bhgpd", qg, kmax)
    return torch.maximum(lo, hi)


def _valid_pages(num_pages: torch.Tensor, p_max: int, device: torch.device) -> torch.Tensor:
    """bool ``[B, P_max]``: page < num_pages."""
    return torch.arange(p_max, device=device)[None, :] < num_pages.to(device)[:, None]


def combine_group_ref(
    bounds: torch.Tensor, num_pages: torch.Tensor, hkv: int, combine: str, scale: float
) -> torch.Tensor:
    """One score per (request, KV head, page) from the G query heads' bounds.

    With ``u_g(p)`` head ``g``'s bound on page ``p`` (:func:`quest_head_bounds_ref`) and the
    valid pages ``p < num_pages``:

    * ``sum`` — ``sum_g u_g(p)``: Quest's GQA rule (one selection serves the group). A head
      that attends to one page can be outvoted by the others.
    * ``max`` — ``max_g u_g(p)``: a page ranks by the head that bounds it highest.
    * ``normmax`` — ``max_g [scale * u_g(p) - log sum_{p' valid} exp(scale * u_g(p'))]``: each
      head's scaled bounds are log-softmax normalised over the pages first (the log of the
      share of that head's attention the page would get if every bound were tight), so a
      head whose logits are all large does not dominate one that picks out a page.
    * ``union`` — ``-min_g rank_g(p)``, where ``rank_g(p)`` is ``p``'s 0-based place in head
      ``g``'s own ranking (``u_g`` descending, ties to the lower page): selecting the top k
      by this score gives every head its best page, then every head its second best, ...
      (the union of the per-head top lists, round by round) until the KV head's budget of
      pages is full; pages of one round tie, and ``select_topk`` breaks ties towards the
      lower page index. The budget (pages per KV head) is the same as for the other rules.

    With G = 1 ``sum``, ``max`` and ``normmax`` give the same ranking as the head's bound.

    Parameters
    ----------
    bounds : float32 ``[B, Hq, P_max]`` (``-inf`` on unused pages)
    num_pages : int ``[B]``; hkv : KV heads (``Hq % hkv == 0``)
    combine : one of :data:`GROUP_COMBINES`
    scale : softmax scale of the logits (``normmax`` only), e.g. ``D ** -0.5``

    Returns
    -------
    float32 ``[B, Hkv, P_max]``; ``-inf`` on pages >= ``num_pages``.

    Raises
    ------
    ValueError : unknown ``combine``
    """
    require(combine in GROUP_COMBINES, f"combine must be one of {GROUP_COMBINES}, got {combine!r}")
    b, hq, p_max = bounds.shape
    valid = _valid_pages(num_pages, p_max, bounds.device)[:, None, :]  # [B, 1, P_max]
    u = bounds.float().view(b, hkv, hq // hkv, p_max).masked_fill(~valid[:, :, None], -math.inf)
    if combine == "sum":
        scores = u.sum(dim=2)
    elif combine == "max":
        scores = u.amax(dim=2)
    elif combine == "normmax":
        x = u * scale
        lse = torch.logsumexp(x, dim=-1, keepdim=True)  # -inf rows (no page) stay -inf below
        scores = (x - lse).amax(dim=2)
    else:
        order = torch.sort(u, dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(
            -1, order, torch.arange(p_max, device=u.device).expand_as(order)
        )
        scores = (-rank.amin(dim=2)).float()  # +0.0 for rank 0
    return scores.masked_fill(~valid, float("-inf"))


def quest_scores_ref(
    q: torch.Tensor,
    meta: torch.Tensor,
    block_table: torch.Tensor,
    num_pages: torch.Tensor,
    combine: str = "sum",
    scale: float | None = None,
) -> torch.Tensor:
    """Quest page score per (request, KV head, page): the G query heads' upper bounds
    (:func:`quest_head_bounds_ref`) combined by ``combine`` (:func:`combine_group_ref`).

    Parameters
    ----------
    q : ``[B, Hq, D]`` queries (after RoPE), any float dtype
    meta : ``[P_pool, Hkv, 2, D]`` page metadata (``[:, :, 0]`` key min, ``[:, :, 1]`` key max)
    block_table : int32 ``[B, P_max]`` pool page of each request page (-1 unused)
    num_pages : int32 ``[B]`` pages in use per request
    combine : ``sum`` (Quest's rule, the default here), ``max``, ``normmax`` or ``union``
    scale : softmax scale for ``normmax``; ``None`` means ``D ** -0.5``

    Returns
    -------
    float32 ``[B, Hkv, P_max]``; ``-inf`` on pages >= ``num_pages``.

    Raises
    ------
    ValueError : unknown ``combine``
    """
    require(combine in GROUP_COMBINES, f"combine must be one of {GROUP_COMBINES}, got {combine!r}")
    if combine == "sum":  # summed over (G, D) at once, as Quest's rule always was here
        p_max = block_table.shape[1]
        scores = _bound_terms_contiguous(q, meta, block_table).sum(dim=(2, 4))
        valid = _valid_pages(num_pages, p_max, q.device)
        return scores.masked_fill(~valid[:, None, :], float("-inf"))
    bounds = quest_head_bounds_ref(q, meta, block_table, num_pages)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return combine_group_ref(bounds, num_pages, meta.shape[1], combine, scale)


def quest_head_bounds_matmul(
    q: torch.Tensor,
    meta: torch.Tensor,
    block_table: torch.Tensor,
    num_pages: torch.Tensor,
) -> torch.Tensor:
    """:func:`quest_head_bounds_ref` as one matrix product per (request, KV head): the CPU
    path's formulation (:data:`kernels.dispatch.CPU_OPS`).

    With ``min <= max`` element-wise, ``max(q_d * min_d, q_d * max_d) = q⁻_d * min_d +
    q⁺_d * max_d`` (``q⁻ = min(q, 0)``, ``q⁺ = max(q, 0)``), so a head's bounds on all pages
    are ``[q⁻ | q⁺] @ [min | max].T``: a ``[G, 2D] x [2D, P_max]`` GEMM over the page
    records as stored (``meta[p, h]`` is ``[min | max]``), instead of ~10 element-wise passes
    over ``[P_max, G, D]`` (3-4x faster on a CPU: docs/performance.md, "CPU decode:
    int4 products"). The sum runs in the GEMM's order, so values differ from the reference's by
    float32 rounding (relative ~1e-7 of the bound's terms) and a top-k may differ from the
    reference's on near-ties; :func:`quest_head_bounds_ref` stays the oracle.

    Parameters and returns as :func:`quest_head_bounds_ref` (pages in use must have
    ``min <= max``, as the append maintains; unused pages are ``-inf`` whatever they hold).
    """
    b, hq, d = q.shape
    hkv = meta.shape[1]
    p_max = block_table.shape[1]
    qf = q.float().view(b, hkv, hq // hkv, d)
    q_pm = torch.cat([qf.clamp(max=0), qf.clamp(min=0)], dim=-1)  # [B, Hkv, G, 2D]
    idx = block_table.clamp(min=0).reshape(-1).long()
    pages = meta.reshape(meta.shape[0], hkv, 2 * d).index_select(0, idx).float()
    pages = pages.view(b, p_max, hkv, 2 * d).permute(0, 2, 3, 1)  # [B, Hkv, 2D, P_max]
    bounds = torch.matmul(q_pm, pages).view(b, hq, p_max)
    return bounds.masked_fill_(~_valid_pages(num_pages, p_max, q.device)[:, None, :], -math.inf)


def quest_scores_matmul(
    q: torch.Tensor,
    meta: torch.Tensor,
    block_table: torch.Tensor,
    num_pages: torch.Tensor,
    combine: str = "sum",
    scale: float | None = None,
) -> torch.Tensor:
    """:func:`quest_scores_ref` with the bounds of :func:`quest_head_bounds_matmul` (the CPU
    path; same arguments, returns and errors; values equal to the reference's up to float32
    summation order, see there)."""
    require(combine in GROUP_COMBINES, f"combine must be one of {GROUP_COMBINES}, got {combine!r}")
    bounds = quest_head_bounds_matmul(q, meta, block_table, num_pages)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b, hq, p_max = bounds.shape
    hkv = meta.shape[1]
    if combine != "normmax":
        return combine_group_ref(bounds, num_pages, hkv, combine, scale)
    # combine_group_ref's normmax without its re-masking (the bounds are -inf past
    # num_pages already): the same ops on the same values
    x = bounds.view(b, hkv, hq // hkv, p_max) * scale
    scores = x.sub_(torch.logsumexp(x, dim=-1, keepdim=True)).amax(dim=2)
    return scores.masked_fill_(~_valid_pages(num_pages, p_max, q.device)[:, None, :], -math.inf)


_COMBINE_SUM, _COMBINE_MAX, _COMBINE_HEADS = 0, 1, 2


@triton.jit
def _quest_scores_kernel(
    q_ptr,
    meta_ptr,
    block_table_ptr,
    num_pages_ptr,
    out_ptr,
    num_kv_heads,
    p_max,
    stride_q_b,
    stride_q_h,
    stride_meta_p,
    stride_meta_h,
    stride_meta_mm,
    stride_bt_b,
    stride_out_b,
    stride_out_h,
    part_m_ptr,
    part_s_ptr,
    num_blocks,
    scale,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    MODE: tl.constexpr,
    PARTIALS: tl.constexpr,
):
    """One (request, KV head, page block) of the bounds ``u_g = sum_d max(q_g*min, q_g*max)``:
    MODE 0 writes ``sum_g u_g`` and MODE 1 ``max_g u_g`` to ``out [B, Hkv, P_max]``, MODE 2
    every ``u_g`` to ``out [B, Hq, P_max]`` (row ``h * G + g``). With ``PARTIALS`` (MODE 2,
    ``normmax``) also this block's log-sum-exp terms of ``scale * u_g`` over its valid pages:
    the maximum ``m`` and ``sum exp(x - m)`` to ``part_m / part_s [B, Hq, num_blocks]``."""
    row = tl.program_id(0)
    pid_p = tl.program_id(1)
    b = row // num_kv_heads
    h = row % num_kv_heads
    n = tl.load(num_pages_ptr + b)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    mask_p = (offs_p < p_max) & (offs_p < n)
    mask_d = offs_d < D
    pool_page = tl.load(block_table_ptr + b * stride_bt_b + offs_p, mask=mask_p, other=0)
    pool_page = tl.maximum(pool_page, 0).to(tl.int64)
    meta = meta_ptr + pool_page[:, None] * stride_meta_p + h * stride_meta_h + offs_d[None, :]
    mask_pd = mask_p[:, None] & mask_d[None, :]
    kmin = tl.load(meta, mask=mask_pd, other=0.0).to(tl.float32)
    kmax = tl.load(meta + stride_meta_mm, mask=mask_pd, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_P, BLOCK_D], tl.float32)
    best = tl.full([BLOCK_P], float("-inf"), tl.float32)
    for g in tl.static_range(G):
        qg = tl.load(
            q_ptr + b * stride_q_b + (h * G + g) * stride_q_h + offs_d, mask=mask_d, other=0.0
        )
        qg = qg.to(tl.float32)[None, :]
        term = tl.maximum(qg * kmin, qg * kmax, propagate_nan=tl.PropagateNan.ALL)
        if MODE == 0:
            acc += term
        else:
            u = tl.sum(term, axis=1)
            if MODE == 1:
                best = tl.maximum(best, u, propagate_nan=tl.PropagateNan.ALL)
            else:
                dst = out_ptr + b * stride_out_b + (h * G + g) * stride_out_h + offs_p
                tl.store(dst, tl.where(mask_p, u, float("-inf")), mask=offs_p < p_max)
                if PARTIALS:
                    x = tl.where(mask_p, u * scale, float("-inf"))
                    m = tl.max(x, axis=0)
                    shift = tl.where(m == float("-inf"), 0.0, m)
                    part = (b * (num_kv_heads * G) + h * G + g).to(tl.int64) * num_blocks + pid_p
                    tl.store(part_m_ptr + part, m)
                    tl.store(part_s_ptr + part, tl.sum(tl.exp(x - shift), axis=0))
    if MODE != 2:
        score = tl.sum(acc, axis=1) if MODE == 0 else best
        score = tl.where(mask_p, score, float("-inf"))
        dst = out_ptr + b * stride_out_b + h * stride_out_h + offs_p
        tl.store(dst, score, mask=offs_p < p_max)


NORMMAX_PARTIAL_TILE = 2048
"""Partial log-sum-exp terms (heads x page blocks) :func:`_normmax_kernel` combines per
loop iteration."""


@triton.jit
def _normmax_block(base, lse, mask_g, offs_p, p_max, n, scale, dst_row):
    """Store ``max_g [scale * u_g(p) - lse_g]`` for the pages ``offs_p`` of one (request, KV
    head): ``base`` points at its G heads' bounds ``[BLOCK_G, 1]``, ``dst_row`` at its output
    row; ``-inf`` past ``n`` valid pages."""
    valid_p = (offs_p < p_max) & (offs_p < n)
    mask = mask_g[:, None] & valid_p[None, :]
    x = tl.load(base + offs_p[None, :], mask=mask, other=float("-inf")) * scale
    y = tl.where(mask, x - lse[:, None], float("-inf"))
    score = tl.where(valid_p, tl.max(y, axis=0), float("-inf"))
    tl.store(dst_row + offs_p, score, mask=offs_p < p_max)


@triton.jit
def _normmax_kernel(
    bounds_ptr,
    part_m_ptr,
    part_s_ptr,
    num_pages_ptr,
    out_ptr,
    num_kv_heads,
    p_max,
    num_blocks,
    scale,
    stride_u_b,
    stride_u_h,
    stride_out_b,
    stride_out_h,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_NB: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """One (request, KV head, page block): ``max_g [scale*u_g(p) - logsumexp_p' scale*u_g(p')]``
    over the ``num_pages`` valid pages. Each head's log-sum-exp comes from the page blocks'
    partial terms (``m``, ``sum exp(x - m)``) that :func:`_quest_scores_kernel` wrote, combined
    online; every block of the page axis is its own program (a long context with few jobs
    keeps the GPU busy: one program per (request, KV head) looping over 16K pages was ~0.16 ms
    a layer at 256K)."""
    row = tl.program_id(0)
    pid_p = tl.program_id(1)
    b = row // num_kv_heads
    h = row % num_kv_heads
    n = tl.load(num_pages_ptr + b)
    offs_g = tl.arange(0, BLOCK_G)
    mask_g = offs_g < G
    part = (row * G + offs_g)[:, None].to(tl.int64) * num_blocks
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_G], tl.float32)
    for start in range(0, num_blocks, BLOCK_NB):
        offs_nb = start + tl.arange(0, BLOCK_NB)
        mask = mask_g[:, None] & (offs_nb < num_blocks)[None, :]
        pm = tl.load(part_m_ptr + part + offs_nb[None, :], mask=mask, other=float("-inf"))
        ps = tl.load(part_s_ptr + part + offs_nb[None, :], mask=mask, other=0.0)
        m_new = tl.maximum(m, tl.max(pm, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(ps * tl.exp(pm - shift[:, None]), axis=1)
        m = m_new
    lse = tl.where(s > 0, m + tl.log(tl.where(s > 0, s, 1.0)), 0.0)  # no valid page: unused
    base = bounds_ptr + b * stride_u_b + (h * G + offs_g)[:, None].to(tl.int64) * stride_u_h
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    dst_row = out_ptr + b * stride_out_b + h * stride_out_h
    _normmax_block(base, lse, mask_g, offs_p, p_max, n, scale, dst_row)


@triton.jit
def _normmax_rows_kernel(
    bounds_ptr,
    num_pages_ptr,
    out_ptr,
    num_kv_heads,
    p_max,
    scale,
    stride_u_b,
    stride_u_h,
    stride_out_b,
    stride_out_h,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """One (request, KV head): ``max_g [scale*u_g(p) - logsumexp_p' scale*u_g(p')]`` over the
    ``num_pages`` valid pages; two passes over the page axis (online log-sum-exp per head,
    then the normalised maximum) in one program. For short rows (the superpage selection's
    candidates, :mod:`kernels.superpage_select`); :func:`quest_scores` splits long page axes
    over programs (:func:`_normmax_kernel`)."""
    row = tl.program_id(0)
    b = row // num_kv_heads
    h = row % num_kv_heads
    n = tl.load(num_pages_ptr + b)
    offs_g = tl.arange(0, BLOCK_G)
    mask_g = offs_g < G
    base = bounds_ptr + b * stride_u_b + (h * G + offs_g)[:, None].to(tl.int64) * stride_u_h
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_G], tl.float32)
    for start in range(0, p_max, BLOCK_P):
        offs_p = start + tl.arange(0, BLOCK_P)
        mask = mask_g[:, None] & ((offs_p < p_max) & (offs_p < n))[None, :]
        x = tl.load(base + offs_p[None, :], mask=mask, other=float("-inf")) * scale
        m_new = tl.maximum(m, tl.max(x, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift[:, None]), axis=1)
        m = m_new
    lse = tl.where(s > 0, m + tl.log(tl.where(s > 0, s, 1.0)), 0.0)  # no valid page: unused
    dst_row = out_ptr + b * stride_out_b + h * stride_out_h
    for start in range(0, p_max, BLOCK_P):
        _normmax_block(base, lse, mask_g, start + tl.arange(0, BLOCK_P), p_max, n, scale, dst_row)


def quest_scores(
    q: torch.Tensor,
    meta: torch.Tensor,
    block_table: torch.Tensor,
    num_pages: torch.Tensor,
    combine: str = "sum",
    scale: float | None = None,
) -> torch.Tensor:
    """Triton :func:`quest_scores_ref` (same arguments; fp32 sums in another order, so
    equal within fp32 rounding, exactly equal where the sums are exact).

    ``sum`` and ``max`` are one kernel; ``normmax`` writes the per-head bounds
    ``[B, Hq, P_max]`` and normalises them in a second kernel; ``union`` ranks the per-head
    bounds with ``torch.sort`` on the device (:func:`combine_group_ref`). None of them
    synchronises with the host.

    Parameters
    ----------
    q : ``[B, Hq, D]``, unit stride on ``D``
    meta : ``[P_pool, Hkv, 2, D]``, unit stride on ``D``
    block_table : int32/int64 ``[B, P_max]``, unit stride on ``P_max``
    num_pages : int32/int64 ``[B]``
    combine : one of :data:`GROUP_COMBINES`; scale : ``normmax``'s softmax scale
        (``None``: ``D ** -0.5``)

    Returns
    -------
    float32 ``[B, Hkv, P_max]``; ``-inf`` on pages >= ``num_pages``.

    Raises
    ------
    ValueError : bad shapes, dtypes, devices or ``combine``
    """
    check_tensor("q", q, 3, FLOAT_DTYPES)
    check_tensor("meta", meta, 4, FLOAT_DTYPES)
    check_tensor("block_table", block_table, 2, INDEX_DTYPES)
    check_tensor("num_pages", num_pages, 1, INDEX_DTYPES, unit_last=False)
    require(combine in GROUP_COMBINES, f"combine must be one of {GROUP_COMBINES}, got {combine!r}")
    b, hq, d = q.shape
    hkv = meta.shape[1]
    p_max = block_table.shape[1]
    require(hkv > 0 and hq % hkv == 0, f"Hq={hq} is not a multiple of Hkv={hkv}")
    require(
        meta.shape[2:] == (2, d), f"meta must be [P_pool, Hkv, 2, {d}], got {tuple(meta.shape)}"
    )
    require(block_table.shape[0] == b, f"block_table has {block_table.shape[0]} rows, batch is {b}")
    check_shape("num_pages", num_pages, (b,))
    check_device(q.device, meta=meta, block_table=block_table, num_pages=num_pages)
    require_runnable(q.device)
    scale = d**-0.5 if scale is None else float(scale)
    out = torch.empty((b, hkv, p_max), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    g = hq // hkv
    mode = {"sum": _COMBINE_SUM, "max": _COMBINE_MAX}.get(combine, _COMBINE_HEADS)
    dst = (
        out
        if mode != _COMBINE_HEADS
        else torch.empty((b, hq, p_max), dtype=torch.float32, device=q.device)
    )
    block_d = next_pow2(d)
    block_p = max(16, min(64, 4096 // block_d, next_pow2(p_max)))
    num_blocks = -(-p_max // block_p)
    normmax = combine == "normmax"
    # the page blocks' log-sum-exp terms of each head (normmax only)
    part_m = torch.empty((b, hq, num_blocks) if normmax else (1,), dtype=torch.float32,
                         device=q.device)  # fmt: skip
    part_s = torch.empty_like(part_m)
    _quest_scores_kernel[(b * hkv, num_blocks)](
        q,
        meta,
        block_table,
        num_pages,
        dst,
        hkv,
        p_max,
        q.stride(0),
        q.stride(1),
        meta.stride(0),
        meta.stride(1),
        meta.stride(2),
        block_table.stride(0),
        dst.stride(0),
        dst.stride(1),
        part_m,
        part_s,
        num_blocks,
        scale,
        G=g,
        D=d,
        BLOCK_D=block_d,
        BLOCK_P=block_p,
        MODE=mode,
        PARTIALS=normmax,
        num_warps=4,
    )
    if combine == "union":
        return combine_group_ref(dst, num_pages, hkv, "union", scale)
    if normmax:
        block_g = next_pow2(g)
        block_p2 = max(16, min(1024 // block_g, next_pow2(p_max)))
        _normmax_kernel[(b * hkv, -(-p_max // block_p2))](
            dst,
            part_m,
            part_s,
            num_pages,
            out,
            hkv,
            p_max,
            num_blocks,
            scale,
            dst.stride(0),
            dst.stride(1),
            out.stride(0),
            out.stride(1),
            G=g,
            BLOCK_G=block_g,
            BLOCK_NB=max(16, min(NORMMAX_PARTIAL_TILE // block_g, next_pow2(num_blocks))),
            BLOCK_P=block_p2,
            num_warps=4,
        )
    return out
