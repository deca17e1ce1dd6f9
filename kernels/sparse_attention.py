"""Sparse decode attention over selected pages (GQA), and the dense reference.

One query token per request. The reduction runs over the selected pages in page-position
order, whatever slots hold them, so the result does not depend on slot placement.

:func:`sparse_decode_attention` is the Triton version (flash-decoding): one program per
(request, KV head, split) walks its share of the selected pages, tile by tile, with all
G query heads of the group in one ``tl.dot``; a second kernel merges the splits' partial
results by log-sum-exp in a fixed order.

Two per-layer options (Gemma 2/3; transformers ``eager_attention_forward`` and the
sliding-window mask of ``masking_utils``): ``softcap`` caps each logit as
``softcap * tanh(logit / softcap)`` after the scale (attention logit soft-capping), and
``window`` (a sliding-window layer) keeps only the last ``window`` positions of each context,
``pos >= seq_len - window`` (transformers: ``kv_idx > q_idx - sliding_window``).

An fp8 hot buffer (``hot_buffer_dtype=fp8``: ``float8_e4m3fn`` slots with ``slot_scale``,
one int8 exponent per token row, :mod:`kernels.fp8_kv`) is dequantised to ``kv_dtype`` as
it is read, so attention sees exactly the values a hot buffer in ``kv_dtype`` holds after
:func:`kernels.gather.gather_fp8` (power-of-two scaling is exact): the same bits out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._launch import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_device,
    check_shape,
    check_tensor,
    interpreted,
    next_pow2,
    num_sms,
    require,
    require_runnable,
)
from kernels.append_kv import _pow2
from kernels.bitmask import selected_pages
from kernels.fp8_kv import FP8, fp8_dequantize_ref


def _valid_positions(
    pages: torch.Tensor, seq_lens: torch.Tensor, s: int, window: int | None
) -> torch.Tensor:
    """bool ``[B, Hkv, K, S]``: the positions of the selected ``pages`` (int64
    ``[B, Hkv, K]``, -1 padded) that attention reads: a real page, before ``seq_lens``
    (int ``[B]``) and, with ``window``, at or after ``seq_len - window``."""
    pos = pages[..., None] * s + torch.arange(s, device=pages.device)
    lens = seq_lens.to(pages.device).long()[:, None, None, None]
    ok = (pages[..., None] >= 0) & (pos < lens)
    if window:
        ok &= pos >= lens - window
    return ok


def sparse_decode_attention_ref(
    q: torch.Tensor,
    kv_slots: torch.Tensor,
    selection: torch.Tensor,
    slot_list: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    pages: torch.Tensor | None = None,
    *,
    slot_scale: torch.Tensor | None = None,
    kv_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Attention of each request's query over the tokens of its selected pages.

    Parameters
    ----------
    q : ``[B, Hq, D]`` queries (bf16/fp16/fp32)
    kv_slots : ``[N, 2, S, D]`` record slots (``[:, 0]`` keys, ``[:, 1]`` values)
    selection : int32 ``[B, Hkv, W]`` bitmask; the j-th set bit (position order) is the
        page held by ``slot_list[b, h, j]``
    slot_list : int32 ``[B, Hkv, K_max]`` slot per selected page, -1 padded
    seq_lens : int32 ``[B]`` tokens in each context; positions >= seq_len (the unused
        part of the last page) are masked
    scale : softmax scale, usually ``D ** -0.5``
    softcap : logits become ``softcap * tanh(logits / softcap)`` (``None``: off)
    window : only positions ``>= seq_len - window`` count (a sliding-window layer;
        ``None``: all)
    pages : int ``[B, Hkv, K_max]`` the selected pages in position order, -1 padded
        (:func:`kernels.bitmask.selected_pages` of ``selection``), when the caller has them:
        ``selection`` is then not read (may be ``None``). Same result.
    slot_scale : int8 ``[N, 2, S]`` scale exponents of an fp8 ``kv_slots``
        (``float8_e4m3fn``; required then, ignored otherwise)
    kv_dtype : the dtype fp8 records are dequantised to before the products (the KV
        cache's ``kv_dtype``; default ``q.dtype``)

    Returns
    -------
    ``[B, Hq, D]`` in ``q.dtype``; fp32 accumulation, max-subtracted softmax.

    Raises
    ------
    ValueError : an fp8 ``kv_slots`` without ``slot_scale``
    """
    b, hq, d = q.shape
    hkv, k_max = slot_list.shape[1], slot_list.shape[2]
    s = kv_slots.shape[2]
    if pages is None:
        pages = selected_pages(selection, selection.shape[-1] * 32, k_max)
    pages = pages.long()  # [B, Hkv, K]
    # Keys and values gathered record by record (index_select copies whole rows; advanced
    # indexing on CPU computes an offset per element and was ~4x slower). The values are
    # gathered after the logits: the keys are still in cache for their product then (keys
    # and values of a layer at 8K, 2 x 1.5 MiB in float32, overflow a 2 MiB L2).
    idx = slot_list.clamp(min=0).reshape(-1).long()
    fp8 = kv_slots.dtype == FP8
    if fp8 and slot_scale is None:
        raise ValueError("an fp8 kv_slots needs slot_scale")
    # fp8 rows are selected through a uint8 view (index_select has no fp8 kernel everywhere)
    flat = (kv_slots.view(torch.uint8) if fp8 else kv_slots).reshape(kv_slots.shape[0], 2, s * d)

    def rows(part: int) -> torch.Tensor:
        """Keys (0) or values (1) of the listed slots, float32 ``[B, Hkv, K*S, D]``."""
        x = flat[:, part].index_select(0, idx)
        if fp8:
            e = slot_scale[:, part].index_select(0, idx)
            x = fp8_dequantize_ref(x.view(FP8).view(-1, s, d), e, kv_dtype or q.dtype)
        return x.float().view(b, hkv, k_max * s, d)

    keys = rows(0)
    qg = q.float().view(b, hkv, hq // hkv, d)
    logits = torch.einsum("bhgd,bhtd->bhgt", qg, keys) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    bad = ~_valid_positions(pages, seq_lens, s, window).reshape(b, hkv, 1, k_max * s)
    logits.masked_fill_(bad, float("-inf"))
    m = logits.amax(dim=-1, keepdim=True)
    p = logits.sub_(m).exp_()
    vals = rows(1)
    # Unwritten positions (past seq_len, or pool memory never initialised) may hold any
    # bits, NaN included: zero them so 0-weight * NaN cannot leak into the output. (vals
    # is a fresh copy here, and ``.float()`` copies any other dtype: in place is safe;
    # only the masked rows are written.)
    vals.view(-1, d).index_fill_(0, bad.reshape(-1).nonzero().squeeze(1), 0.0)
    out = torch.einsum("bhgt,bhtd->bhgd", p, vals) / p.sum(dim=-1, keepdim=True)
    return out.reshape(b, hq, d).to(q.dtype)


def dense_decode_attention_ref(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention over every token of each context, read through the block table.

    Independent of the sparse path (uses ``torch.nn.functional.scaled_dot_product_attention``,
    or with ``softcap`` an explicit softmax); the correctness ladder compares the two.

    Parameters
    ----------
    q : ``[B, Hq, D]``; kv_pool : ``[P_pool, Hkv, 2, S, D]``; block_table : int32
    ``[B, P_max]``; seq_lens : int32 ``[B]``; softcap, window : as in
    :func:`sparse_decode_attention_ref`.

    Returns
    -------
    ``[B, Hq, D]`` in ``q.dtype``.
    """
    b, hq, d = q.shape
    _, hkv, _, s, _ = kv_pool.shape
    p_used = int(-(-int(seq_lens.max()) // s))
    table = block_table[:, :p_used].clamp(min=0).long()
    rec = kv_pool[table]  # [B, P, Hkv, 2, S, D]
    keys = rec[:, :, :, 0].permute(0, 2, 1, 3, 4).reshape(b, hkv, p_used * s, d)
    vals = rec[:, :, :, 1].permute(0, 2, 1, 3, 4).reshape(b, hkv, p_used * s, d)
    pos = torch.arange(p_used * s, device=q.device)
    lens = seq_lens.to(q.device).long()[:, None]
    keep = pos[None, :] < lens
    if window:
        keep &= pos[None, :] >= lens - window
    mask = keep[:, None, None, :]
    dt = torch.float32 if q.device.type == "cpu" else q.dtype
    # Positions past seq_len (the unused part of the last page, pool memory never written)
    # may hold any bits, NaN included: zero them, or NaN * 0-weight reaches the output.
    valid = mask[:, :, 0, :, None]  # [B, 1, T, 1]
    keys = keys.masked_fill(~valid, 0.0)
    vals = vals.masked_fill(~valid, 0.0)
    if softcap:
        g = hq // hkv
        logits = torch.einsum("bhgd,bhtd->bhgt", q.float().view(b, hkv, g, d), keys.float())
        logits = softcap * torch.tanh(logits * scale / softcap)
        weights = logits.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        out = torch.einsum("bhgt,bhtd->bhgd", weights, vals.float())
        return out.reshape(b, hq, d).to(q.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.to(dt).view(b, hq, 1, d),
        keys.to(dt),
        vals.to(dt),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.view(b, hq, d).to(q.dtype)


@triton.jit
def _to_kv_dtype(x, KV_DT: tl.constexpr):
    """``x`` rounded to the KV dtype coded ``KV_DT`` (0 float32, 1 bfloat16, 2 float16)."""
    if KV_DT == 1:
        return x.to(tl.bfloat16)
    elif KV_DT == 2:
        return x.to(tl.float16)
    else:
        return x


KV_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""``KV_DT`` of :func:`_sparse_decode_split_kernel`: the dtype fp8 slots are read as."""


@triton.jit
def _sparse_decode_split_kernel(
    q_ptr,
    kv_ptr,
    sc_ptr,
    sel_ptr,
    slot_list_ptr,
    seq_lens_ptr,
    o_ptr,
    lse_ptr,
    scale_log2e,
    softcap,
    window,
    num_kv_heads,
    num_words,
    k_max,
    pages_per_split,
    stride_q_b,
    stride_q_h,
    stride_kv_n,
    stride_kv_kv,
    stride_kv_s,
    stride_sc_n,
    stride_sc_kv,
    stride_sel_b,
    stride_sel_h,
    stride_sl_b,
    stride_sl_h,
    stride_o_0,
    stride_o_1,
    stride_o_2,
    stride_lse_r,
    stride_lse_s,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGES_PER_TILE: tl.constexpr,
    BLOCK_W: tl.constexpr,
    FP32_DOT: tl.constexpr,
    DIRECT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    KV_FP8: tl.constexpr,
    KV_DT: tl.constexpr,
):
    """One (request, KV head, split): attention over selected-page ranks
    ``[split * pages_per_split, (split + 1) * pages_per_split)``.

    Rank ``j`` is the ``j``-th set bit of the selection, held by ``slot_list[b, h, j]``.
    The prefix popcount of the selection words
    below the context's last whole page gives ``c_full``: ranks ``< c_full`` are whole
    pages inside the context, rank ``c_full`` is the partial last page if its bit is
    set, and later ranks lie past ``seq_len`` (masked).

    ``SOFTCAP``: logits ``softcap * tanh(logit / softcap)`` (``scale_log2e`` is then the
    plain scale and the log2 factor comes after the cap). ``WINDOW``: the window starts at
    ``lo = max(seq_len - window, 0)``; the same popcount gives ``c_lo``, the selected
    pages wholly before it (skipped: the walk starts at rank ``c_lo``), and whether rank
    ``c_lo`` is the page holding ``lo`` (its tokens before ``lo`` masked). The first rank
    walked still holds a valid token, so the running max stays finite; a split left with
    no rank keeps ``l = 0`` (log-sum-exp ``-inf`` in the merge).

    ``KV_FP8``: the slots are e4m3 with one int8 exponent per token row at ``sc_ptr``
    (``[N, 2, S]``); each row is scaled back in fp32 and rounded to ``KV_DT`` (0 float32,
    1 bfloat16, 2 float16), the values a hot buffer in that dtype holds.
    """
    row = tl.program_id(0)
    split = tl.program_id(1)
    b = row // num_kv_heads
    h = row % num_kv_heads

    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    n_full = seq_len // PAGE_SIZE
    rem = seq_len % PAGE_SIZE
    sel_row = sel_ptr + b * stride_sel_b + h * stride_sel_h

    # Prefix popcount of the selection below the last whole page, and the tail page's bit,
    # in one pass over the words (read whatever seq_len is, overlapping its load).
    offs_bit = tl.arange(0, 32)
    c_full = tl.full([], 0, tl.int32)
    has_tail = tl.full([], 0, tl.int32)
    lo = tl.maximum(seq_len - window, 0)
    lo_page = lo // PAGE_SIZE
    lo_rem = lo % PAGE_SIZE
    c_lo = tl.full([], 0, tl.int32)
    has_lo = tl.full([], 0, tl.int32)
    for w0 in range(0, num_words, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        words = tl.load(sel_row + offs_w, mask=offs_w < num_words, other=0)
        bits = (words[:, None] >> offs_bit[None, :]) & 1
        page = offs_w[:, None] * 32 + offs_bit[None, :]
        c_full += tl.sum(tl.sum(tl.where(page < n_full, bits, 0), axis=1), axis=0)
        has_tail += tl.sum(tl.sum(tl.where(page == n_full, bits, 0), axis=1), axis=0)
        if WINDOW:
            c_lo += tl.sum(tl.sum(tl.where(page < lo_page, bits, 0), axis=1), axis=0)
            has_lo += tl.sum(tl.sum(tl.where(page == lo_page, bits, 0), axis=1), axis=0)
    n_valid = tl.minimum(c_full + tl.where(rem > 0, has_tail, 0), k_max)

    r_lo = split * pages_per_split
    r_hi = tl.minimum(r_lo + pages_per_split, n_valid)
    if WINDOW:
        r_lo = tl.maximum(r_lo, c_lo)
    lo_cut = tl.where(has_lo > 0, lo_rem, 0)  # tokens of rank c_lo before the window

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < G
    mask_d = offs_d < D
    q = tl.load(
        q_ptr + b * stride_q_b + (h * G + offs_g)[:, None] * stride_q_h + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)

    BLOCK_N: tl.constexpr = PAGES_PER_TILE * PAGE_SIZE
    offs_n = tl.arange(0, BLOCK_N)
    tile_rank = offs_n // PAGE_SIZE
    tok = offs_n % PAGE_SIZE
    sl_row = slot_list_ptr + b * stride_sl_b + h * stride_sl_h

    # Every tile's first rank holds a valid token (r0 < n_valid), so m_i stays finite.
    # Loads feed tl.dot directly (masked by validity), which keeps them pipelined.
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for r0 in range(r_lo, r_hi, PAGES_PER_TILE):
        rank = r0 + tile_rank
        mask_n = rank < r_hi
        slot = tl.load(sl_row + rank, mask=mask_n, other=0)
        slot = tl.maximum(slot, 0).to(tl.int64)
        valid = mask_n & ((rank < c_full) | (tok < rem))
        if WINDOW:  # rank c_lo may be the page the window starts in
            valid = valid & ((rank != c_lo) | (tok >= lo_cut))
        rec = kv_ptr + slot * stride_kv_n + tok * stride_kv_s
        mask_kv = valid[:, None] & mask_d[None, :]
        k = tl.load(rec[:, None] + offs_d[None, :], mask=mask_kv, other=0.0)
        v = tl.load(rec[:, None] + stride_kv_kv + offs_d[None, :], mask=mask_kv, other=0.0)
        if KV_FP8:
            sc = sc_ptr + slot * stride_sc_n + tok
            ek = tl.load(sc, mask=valid, other=0).to(tl.int32)
            ev = tl.load(sc + stride_sc_kv, mask=valid, other=0).to(tl.int32)
            k = _to_kv_dtype(k.to(tl.float32) * _pow2(ek)[:, None], KV_DT)
            v = _to_kv_dtype(v.to(tl.float32) * _pow2(ev)[:, None], KV_DT)
        if FP32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        if SOFTCAP:  # softcap * tanh(x / softcap), tanh(y) = 1 - 2 / (exp(2y) + 1)
            y = qk * (scale_log2e / softcap)
            qk = softcap * (1.0 - 2.0 / (tl.exp2(y * 2.8853900817779268) + 1.0))
            qk = qk * 1.4426950408889634
        else:
            qk = qk * scale_log2e
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    mask_o = mask_g[:, None] & mask_d[None, :]
    if DIRECT:
        # Single split: o is the output [B, Hq, D].
        out = acc / l_i[:, None]
        o_rows = o_ptr + b * stride_o_0 + (h * G + offs_g)[:, None] * stride_o_1
        tl.store(o_rows + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=mask_o)
    else:
        # o is [R, SPLITS, G, D] (fp32), lse [R, SPLITS, G] (log2 domain).
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_rows = o_ptr + row * stride_o_0 + split * stride_o_1 + offs_g[:, None] * stride_o_2
        tl.store(o_rows + offs_d[None, :], out, mask=mask_o)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row * stride_lse_r + split * stride_lse_s + offs_g, lse, mask=mask_g)


@triton.jit
def _sparse_decode_merge_kernel(
    o_ptr,
    lse_ptr,
    out_ptr,
    num_kv_heads,
    num_splits,
    stride_o_r,
    stride_o_s,
    stride_o_g,
    stride_lse_r,
    stride_lse_s,
    stride_out_b,
    stride_out_h,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One (request, query head): merge the splits' partial outputs by log-sum-exp.

    The reduction order over splits is fixed by the tile shape, so the result is
    deterministic and independent of where the pages' records live.
    """
    row = tl.program_id(0)
    g = tl.program_id(1)
    b = row // num_kv_heads
    h = row % num_kv_heads
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < D
    lse = tl.load(
        lse_ptr + row * stride_lse_r + offs_s * stride_lse_s + g, mask=mask_s, other=float("-inf")
    )
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - m)
    o = tl.load(
        o_ptr + row * stride_o_r + offs_s[:, None] * stride_o_s + g * stride_o_g + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)
    dst = out_ptr + b * stride_out_b + (h * G + g) * stride_out_h + offs_d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask_d)


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of :func:`sparse_decode_attention`.

    tile_tokens : tokens per ``tl.dot`` tile (whole pages; at least one page)
    waves : split-K aims at ``waves * SMs`` programs
    num_warps, num_stages : Triton launch options of the split kernel
    """

    tile_tokens: int = 64
    waves: int = 2
    num_warps: int = 4
    num_stages: int = 2


def _pages_per_split(
    rows: int, k_max: int, pages_per_tile: int, waves: int, device: torch.device
) -> int:
    """Pages per split: about ``waves * SMs`` programs, whole tiles each."""
    num_tiles = max(1, -(-k_max // pages_per_tile))
    splits = min(num_tiles, max(1, -(-waves * num_sms(device) // max(rows, 1))))
    return -(-num_tiles // splits) * pages_per_tile


def sparse_decode_attention(
    q: torch.Tensor,
    kv_slots: torch.Tensor,
    selection: torch.Tensor,
    slot_list: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    *,
    slot_scale: torch.Tensor | None = None,
    kv_dtype: torch.dtype | None = None,
    pages_per_split: int | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Triton :func:`sparse_decode_attention_ref`: same arguments, same result within
    rounding (fp32 inputs: 1e-5; bf16/fp16: the output dtype's rounding).

    Parameters
    ----------
    q : ``[B, Hq, D]`` bf16/fp16/fp32, unit stride on ``D``
    kv_slots : ``[N, 2, S, D]`` records, unit stride on ``D``; ``S`` a power of two;
        bf16/fp16/fp32, or float8_e4m3fn with ``slot_scale``
    slot_scale : int8 ``[N, 2, S]`` scale exponents of fp8 ``kv_slots``, unit stride on ``S``
    kv_dtype : the dtype fp8 records are read as (default ``q.dtype``); ignored otherwise.
        The reference gives fp8 slots the same bits as slots in ``kv_dtype`` holding the
        dequantised records. This kernel does under the interpreter, but compiled it lays
        the dequantised operand out for the MMA differently (Triton's ``kWidth`` 4 against
        2 for records loaded in ``kv_dtype``), which sums along the head dim and the tokens
        in another order: on an H200 (triton 3.6) 3-4 of 69,120 bf16 outputs of run-like
        cases differ by one unit in the last place (docs/performance.md, "Why an fp8 hot
        buffer's text differs")
    selection : int32 ``[B, Hkv, W]`` bitmask (unit stride on ``W``)
    slot_list : int32/int64 ``[B, Hkv, K_max]``
    seq_lens : int32/int64 ``[B]``
    scale : softmax scale
    softcap : logit soft-cap (``None``: off); window : sliding window in tokens (``None``:
        off); see :func:`sparse_decode_attention_ref`
    pages_per_split : selected pages per program (split-K width); ``None`` picks one so
        that ``B * Hkv * splits`` fills the device ``config.waves`` times. Results are
        deterministic for a given ``(B, Hkv, K_max)`` and launch shape, and independent
        of slot placement.
    config : launch shape (:class:`DecodeConfig`); ``None`` for the default

    Returns
    -------
    ``[B, Hq, D]`` in ``q.dtype``. When ``q`` and the KV dtypes differ, both are
    computed in fp32.

    Raises
    ------
    ValueError : a shape, dtype, stride or device that does not match the above
    """
    check_tensor("q", q, 3, FLOAT_DTYPES)
    check_tensor("kv_slots", kv_slots, 4, (*FLOAT_DTYPES, FP8))
    check_tensor("selection", selection, 3, (torch.int32,))
    check_tensor("slot_list", slot_list, 3, INDEX_DTYPES)
    check_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES, unit_last=False)
    b, hq, d = q.shape
    _, two, s, d_kv = kv_slots.shape
    hkv, k_max = slot_list.shape[1], slot_list.shape[2]
    require(two == 2, f"kv_slots must be [N, 2, S, D], got {tuple(kv_slots.shape)}")
    require(d_kv == d, f"kv_slots head dim {d_kv} != q head dim {d}")
    require(s > 0 and s & (s - 1) == 0, f"page size S={s} must be a power of two")
    require(hkv > 0 and hq % hkv == 0, f"Hq={hq} is not a multiple of Hkv={hkv}")
    check_shape("slot_list", slot_list, (b, hkv, k_max))
    require(
        selection.shape[:2] == (b, hkv),
        f"selection must be [B={b}, Hkv={hkv}, W], got {tuple(selection.shape)}",
    )
    check_shape("seq_lens", seq_lens, (b,))
    check_device(
        q.device, kv_slots=kv_slots, selection=selection, slot_list=slot_list, seq_lens=seq_lens
    )
    kv_fp8 = kv_slots.dtype == FP8
    kv_dt = (kv_dtype or q.dtype) if kv_fp8 else kv_slots.dtype
    if kv_fp8:
        require(slot_scale is not None, "an fp8 kv_slots needs slot_scale")
        check_tensor("slot_scale", slot_scale, 3, (torch.int8,))
        check_shape("slot_scale", slot_scale, (kv_slots.shape[0], 2, s))
        check_device(q.device, slot_scale=slot_scale)
        require(kv_dt in KV_DTYPE_CODES, f"kv_dtype {kv_dt} is not one of {list(KV_DTYPE_CODES)}")
    else:
        slot_scale = seq_lens.as_strided((1, 1, 1), (0, 0, 0))  # never read
    require_runnable(q.device)

    g = hq // hkv
    rows = b * hkv
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if rows == 0 or k_max == 0:
        return out.fill_(float("nan"))
    cfg = config or DecodeConfig()
    pages_per_tile = max(1, cfg.tile_tokens // s)
    if pages_per_split is None:
        pages_per_split = _pages_per_split(rows, k_max, pages_per_tile, cfg.waves, q.device)
    require(pages_per_split > 0, f"pages_per_split must be positive, got {pages_per_split}")
    pages_per_split = -(-pages_per_split // pages_per_tile) * pages_per_tile
    num_splits = -(-k_max // pages_per_split)
    direct = num_splits == 1
    if direct:
        o_part, lse_part = out, out.new_empty((1, 1), dtype=torch.float32)
        stride_o = (out.stride(0), out.stride(1), 0)
    else:
        o_part = torch.empty((rows, num_splits, g, d), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((rows, num_splits, g), dtype=torch.float32, device=q.device)
        stride_o = o_part.stride()[:3]
    # The interpreter's tl.dot multiplies bf16 bit patterns as integers: upcast there.
    fp32_dot = (
        q.dtype != kv_dt
        or q.dtype == torch.float32
        or (q.dtype == torch.bfloat16 and interpreted())
    )
    block_d = max(16, next_pow2(d))
    _sparse_decode_split_kernel[(rows, num_splits)](
        q,
        kv_slots,
        slot_scale,
        selection,
        slot_list,
        seq_lens,
        o_part,
        lse_part,
        scale if softcap else scale * math.log2(math.e),
        float(softcap or 1.0),
        int(window or 0),
        hkv,
        selection.shape[2],
        k_max,
        pages_per_split,
        q.stride(0),
        q.stride(1),
        kv_slots.stride(0),
        kv_slots.stride(1),
        kv_slots.stride(2),
        slot_scale.stride(0),
        slot_scale.stride(1),
        selection.stride(0),
        selection.stride(1),
        slot_list.stride(0),
        slot_list.stride(1),
        *stride_o,
        lse_part.stride(0),
        lse_part.stride(1),
        G=g,
        BLOCK_G=max(16, next_pow2(g)),
        D=d,
        BLOCK_D=block_d,
        PAGE_SIZE=s,
        PAGES_PER_TILE=pages_per_tile,
        BLOCK_W=64,
        FP32_DOT=fp32_dot,
        DIRECT=direct,
        SOFTCAP=bool(softcap),
        WINDOW=bool(window),
        KV_FP8=kv_fp8,
        KV_DT=KV_DTYPE_CODES.get(kv_dt, 0),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if not direct:
        _sparse_decode_merge_kernel[(rows, g)](
            o_part,
            lse_part,
            out,
            hkv,
            num_splits,
            o_part.stride(0),
            o_part.stride(1),
            o_part.stride(2),
            lse_part.stride(0),
            lse_part.stride(1),
            out.stride(0),
            out.stride(1),
            G=g,
            D=d,
            BLOCK_D=block_d,
            BLOCK_S=max(2, next_pow2(num_splits)),
            num_warps=4,
        )
    return out


def dense_decode_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Triton :func:`dense_decode_attention_ref`: every page of each context, read in
    place from the KV pool by the split-K kernel of :func:`sparse_decode_attention` with
    all pages selected (paged flash-decoding; no copy of the context, no host
    synchronisation, so the dense baseline can be captured in a CUDA graph too).

    Parameters
    ----------
    q : ``[B, Hq, D]``; kv_pool : ``[P_pool, Hkv, 2, S, D]`` on ``q``'s device;
    block_table : int32 ``[B, W]`` (-1 past each request's pages); seq_lens : int32 ``[B]``.

    Returns
    -------
    ``[B, Hq, D]`` in ``q.dtype`` (equal to the reference within the output dtype's rounding).
    """
    from kernels.select_topk import dense_selection
    from kernels.slot_list import resident_slot_list_triton

    check_tensor("kv_pool", kv_pool, 5, FLOAT_DTYPES)
    _, hkv, two, s, d = kv_pool.shape
    require(two == 2, f"kv_pool must be [P, Hkv, 2, S, D], got {tuple(kv_pool.shape)}")
    width = block_table.shape[1]
    num_pages = torch.div(seq_lens + (s - 1), s, rounding_mode="floor")
    selection = dense_selection(num_pages, hkv, width)
    slot_list = resident_slot_list_triton(selection, block_table, width)
    records = kv_pool.view(-1, 2, s, d)
    return sparse_decode_attention(
        q, records, selection, slot_list, seq_lens, scale, softcap, window
    )
