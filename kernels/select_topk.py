"""Top-k page selection: the selection bitmask from page scores (and the ``dense``
indexer's all-pages bitmask).

:func:`select_topk_ref` is the PyTorch reference; :func:`select_topk` the Triton version,
which ranks pages by a packed 64-bit key — the score's bits made order-preserving, then the
page index, so every key is distinct and ``torch.topk`` picks exactly the pages of the
reference's stable sort — and packs the bitmask in a kernel that compares each page's key
with the row's ``budget``-th largest. No host synchronisation.
"""

from __future__ import annotations

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


def _ranked(
    scores: torch.Tensor,
    num_pages: torch.Tensor,
    top_k_pages: int,
    sink_pages: int,
    window_pages: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top-k rule's ranking: ``order`` int64 ``[B, Hkv, k]`` (forced pages first, then
    by score descending, ties to the lower page; ``k = min(max(top_k_pages, sink_pages +
    window_pages), P_max)``), ``budget`` int64 ``[B, 1]`` (pages each row keeps: its first
    ``budget`` entries) and ``valid`` bool ``[B, P_max]`` (page < num_pages)."""
    p_max = scores.shape[-1]
    idx = torch.arange(p_max, device=scores.device)[None, :]
    n = num_pages.to(scores.device).long()[:, None]
    valid = idx < n
    forced = valid & ((idx < sink_pages) | (idx >= n - window_pages))
    budget = torch.maximum(torch.clamp(n, max=top_k_pages), forced.sum(-1, keepdim=True))
    key = scores.float().masked_fill(forced[:, None, :], float("inf"))
    key = key.masked_fill(~valid[:, None, :], float("-inf"))
    k = min(max(top_k_pages, sink_pages + window_pages), p_max)
    # Stable order: sort descending by score, ascending by index on ties.
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :k]
    return order, budget, valid


def select_topk_ref(
    scores: torch.Tensor,
    num_pages: torch.Tensor,
    top_k_pages: int,
    sink_pages: int,
    window_pages: int,
) -> torch.Tensor:
    """Top-k pages per (request, KV head) as a selection bitmask.

    The sink pages (the first ``sink_pages``) and the local window (the last
    ``window_pages``, tail page included) are always selected; the rest of the budget of
    ``top_k_pages`` goes to the highest-scoring other pages. When a context has no more
    than ``top_k_pages`` pages every page is selected, so no page is lost to rounding.
    Ties are broken towards the lower page index (``torch.topk`` over a stable key).

    Parameters
    ----------
    scores : float32 ``[B, Hkv, P_max]`` (``-inf`` on unused pages)
    num_pages : int32 ``[B]``

    Returns
    -------
    int32 ``[B, Hkv, ceil(P_max/32)]`` bitmask.
    """
    b, hkv, p_max = scores.shape
    order, budget, valid = _ranked(scores, num_pages, top_k_pages, sink_pages, window_pages)
    k = order.shape[-1]
    rank = torch.arange(k, device=scores.device)[None, None, :]
    keep = (rank < budget[:, :, None]).expand(b, hkv, k)
    mask = torch.zeros(b, hkv, p_max, dtype=torch.bool, device=scores.device)
    mask.scatter_(-1, order, keep)
    return pack_bits(mask & valid[:, None, :])


def select_topk_pages_ref(
    scores: torch.Tensor,
    num_pages: torch.Tensor,
    top_k_pages: int,
    sink_pages: int,
    window_pages: int,
    k_max: int,
) -> torch.Tensor:
    """The pages :func:`select_topk_ref` selects, as indices in position order instead of
    a bitmask: equal to ``selected_pages(select_topk_ref(...), P_max, k_max)``
    (:func:`kernels.bitmask.selected_pages`) without packing and unpacking the bits (the
    CPU direct path, :class:`engine.decode.attention.DecodeAttention`).

    Parameters
    ----------
    scores : float32 ``[B, Hkv, P_max]`` (``-inf`` on unused pages); num_pages : int32
    ``[B]``; top_k_pages, sink_pages, window_pages : as :func:`select_topk_ref`
    k_max : K_max, the padded output width

    Returns
    -------
    int64 ``[B, Hkv, K_max]``: ascending page indices, padded with -1.

    Raises
    ------
    ValueError
        If a row selects more than ``k_max`` pages.
    """
    b, hkv, p_max = scores.shape
    order, budget, _ = _ranked(scores, num_pages, top_k_pages, sink_pages, window_pages)
    k = order.shape[-1]
    if k > k_max and b and int(budget.max()) > k_max:
        raise ValueError(f"a selection holds {int(budget.max())} pages but k_max={k_max}")
    k = min(k, k_max)
    # The first ``budget`` entries of the order are valid pages (valid pages are a prefix
    # of the indices, so they win every tie with the -inf unused ones).
    order = order[..., :k]
    rank = torch.arange(k, device=scores.device)[None, None, :]
    drop = rank >= budget[:, :, None]
    pages = order.masked_fill_(drop, p_max).sort(dim=-1).values
    pages.masked_fill_(pages == p_max, -1)
    if k < k_max:
        pages = torch.nn.functional.pad(pages, (0, k_max - k), value=-1)
    return pages


def dense_selection(num_pages: torch.Tensor, num_kv_heads: int, p_max: int) -> torch.Tensor:
    """Bitmask selecting every used page (the ``dense`` indexer): int32 ``[B, Hkv, W]``."""
    idx = torch.arange(p_max, device=num_pages.device)[None, :]
    mask = idx < num_pages.long()[:, None]
    return pack_bits(mask[:, None, :].expand(-1, num_kv_heads, -1))


KEY_MIN = -9223372036854775808
"""int64 min: the padding key, below every key :func:`_order_key` makes for a page below
``2**32 - 1``."""
KEY_MIN_C = tl.constexpr(KEY_MIN)
""":data:`KEY_MIN` for use inside kernels."""


@triton.jit
def _order_key(x, page):
    """Distinct int64 keys of float32 scores ``x`` at pages ``page`` (same shape): high
    word the score's order-preserving bits (-0.0 as +0.0, as in the float sort), low word
    ``2**32 - 1 - page``; descending key order = score descending, ties to the lower page."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return bits.to(tl.int64) * 4294967296 + (4294967295 - page.to(tl.int64))


@triton.jit
def _topk_key_kernel(
    scores_ptr,
    num_pages_ptr,
    key_ptr,
    num_kv_heads,
    p_max,
    sink_pages,
    window_pages,
    stride_sc_b,
    stride_sc_h,
    BLOCK_P: tl.constexpr,
):
    """Distinct int64 keys whose descending order is the reference's stable order:
    high word = the score's order-preserving bits (forced pages +inf, unused -inf),
    low word = ``2**32 - 1 - page``, so ties go to the lower page."""
    row = tl.program_id(0)
    pid_p = tl.program_id(1)
    b = row // num_kv_heads
    h = row % num_kv_heads
    n = tl.load(num_pages_ptr + b).to(tl.int32)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_p = offs_p < p_max
    x = tl.load(scores_ptr + b * stride_sc_b + h * stride_sc_h + offs_p, mask=mask_p, other=0.0)
    x = x.to(tl.float32)
    valid = offs_p < n
    forced = valid & ((offs_p < sink_pages) | (offs_p >= n - window_pages))
    x = tl.where(forced, float("inf"), x)
    x = tl.where(valid, x, float("-inf"))
    key = _order_key(x, offs_p)
    tl.store(key_ptr + row.to(tl.int64) * p_max + offs_p, key, mask=mask_p)


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _select_pack_kernel(
    key_ptr,
    top_ptr,
    num_pages_ptr,
    sel_ptr,
    num_kv_heads,
    p_max,
    num_words,
    k,
    top_k_pages,
    sink_pages,
    window_pages,
    BLOCK_W: tl.constexpr,
):
    """One (request, KV head, word block): bit = key >= the row's ``budget``-th key."""
    row = tl.program_id(0)
    pid_w = tl.program_id(1)
    b = row // num_kv_heads
    n = tl.load(num_pages_ptr + b).to(tl.int32)
    forced = n - tl.maximum(n - window_pages - sink_pages, 0)
    budget = tl.maximum(tl.minimum(n, top_k_pages), forced)
    thr = tl.load(top_ptr + row.to(tl.int64) * k + tl.maximum(budget - 1, 0))
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_bit = tl.arange(0, 32)
    page = offs_w[:, None] * 32 + offs_bit[None, :]
    limit = tl.where(budget > 0, tl.minimum(n, p_max), 0)
    mask = page < limit
    key = tl.load(key_ptr + row.to(tl.int64) * p_max + page, mask=mask, other=0)
    bits = tl.where(mask & (key >= thr), 1, 0) << offs_bit[None, :]
    words = tl.reduce(bits, 1, _or)
    tl.store(sel_ptr + row.to(tl.int64) * num_words + offs_w, words, mask=offs_w < num_words)


TOPK_BLOCK = 1024
"""Row length of :func:`top_keys`' first stage."""

TOPK_FEW_ROWS = 64
"""Below this many rows :func:`top_keys` splits long rows (with more rows ``torch.topk``
already fills the GPU: at 128K x 32 jobs the two stages measured slower on an H200)."""


def top_keys(key: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest of each row of *distinct* keys, descending: ``torch.topk(key, k,
    dim=-1, sorted=True).values``, computed in two stages where rows are long.

    ``torch.topk`` gives each row of a few very long rows to one thread block (a 256K
    context at 16-token pages is 16K keys a row, and one job has only ``Hkv`` rows), so it
    runs on a handful of the GPU's SMs. With fewer than :data:`TOPK_FEW_ROWS` rows, rows of
    at least ``4 x TOPK_BLOCK`` keys are cut
    into blocks of ``TOPK_BLOCK`` (or the next power of two >= ``k``), each block keeps its
    own top ``k``, and the top ``k`` of those are the row's: with distinct keys that is the
    same set in the same order (every key of the row's top ``k`` is in its block's top
    ``k``). The padding is ``int64`` min, below every key :func:`_topk_key_kernel` makes.

    Parameters
    ----------
    key : int64 ``[..., P]``, distinct within a row; k : ``1 <= k <= P``

    Returns
    -------
    int64 ``[..., k]``, descending.
    """
    p = key.shape[-1]
    blk = max(TOPK_BLOCK, next_pow2(k))
    if p < 4 * blk or key.numel() >= TOPK_FEW_ROWS * p:
        return torch.topk(key, k, dim=-1, sorted=True).values
    nb = -(-p // blk)
    if nb * blk != p:
        key = torch.nn.functional.pad(key, (0, nb * blk - p), value=KEY_MIN)
    part = torch.topk(key.view(*key.shape[:-1], nb, blk), k, dim=-1, sorted=False).values
    return torch.topk(part.flatten(-2), k, dim=-1, sorted=True).values


def select_topk(
    scores: torch.Tensor,
    num_pages: torch.Tensor,
    top_k_pages: int,
    sink_pages: int,
    window_pages: int,
) -> torch.Tensor:
    """:func:`select_topk_ref` on the device: two small kernels around ``torch.topk``;
    the same bitmask as the reference (NaN scores aside), no host synchronisation.

    Parameters
    ----------
    scores : float32 ``[B, Hkv, P_max]`` (``-inf`` on unused pages), unit stride on ``P_max``
    num_pages : int32/int64 ``[B]``

    Returns
    -------
    int32 ``[B, Hkv, ceil(P_max/32)]`` bitmask.
    """
    check_tensor("scores", scores, 3, FLOAT_DTYPES)
    check_tensor("num_pages", num_pages, 1, INDEX_DTYPES, unit_last=False)
    require(min(top_k_pages, sink_pages, window_pages) >= 0, "page counts must be >= 0")
    b, hkv, p_max = scores.shape
    check_shape("num_pages", num_pages, (b,))
    check_device(scores.device, num_pages=num_pages)
    require_runnable(scores.device)
    w = num_words(p_max)
    sel = torch.empty((b, hkv, w), dtype=torch.int32, device=scores.device)
    if sel.numel() == 0:
        return sel
    key = torch.empty((b, hkv, p_max), dtype=torch.int64, device=scores.device)
    block_p = min(1024, next_pow2(p_max))
    _topk_key_kernel[(b * hkv, -(-p_max // block_p))](
        scores,
        num_pages,
        key,
        hkv,
        p_max,
        sink_pages,
        window_pages,
        scores.stride(0),
        scores.stride(1),
        BLOCK_P=block_p,
        num_warps=4,
    )
    k = min(max(top_k_pages, sink_pages + window_pages), p_max)
    top = top_keys(key, max(k, 1))
    block_w = min(32, next_pow2(w))
    _select_pack_kernel[(b * hkv, -(-w // block_w))](
        key,
        top,
        num_pages,
        sel,
        hkv,
        p_max,
        w,
        max(k, 1),
        top_k_pages,
        sink_pages,
        window_pages,
        BLOCK_W=block_w,
        num_warps=4,
    )
    return sel
