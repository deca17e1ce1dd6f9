"""Append one token's K/V per request: write-through to the pool and the resident tail
page, and update the page metadata (element-wise key min/max).

:func:`append_kv` is the Triton version: one program per (request, KV head) writes the
token to the pool — the GPU stores straight into pinned host memory through unified
addressing when the pool lives there (``D`` elements per head, posted writes over the
link, no host synchronisation) — to the resident tail slot, and widens the page's key
min/max.

Each of the three writes can be switched off, and the token can be copied to a small
device staging buffer instead, so a decode step can split the append in three launches
(:class:`engine.decode.attention.DecodeAttention` with a write-through copy stream):

1. compute stream: metadata + staging (``write_pool=False``, ``staging=...``);
2. copy stream: staging -> pool (``meta=None``), overlapping the layers that follow;
3. compute stream, after the layer's gather: the resident tail slot (``write_pool=False``,
   ``meta=None``), so a tail page the gather just loaded from the pool before step 2
   landed still ends up with the token.

With ``fp8=True`` (``kv_host_dtype=fp8``) every record written is the token rounded
through fp8 (:func:`kernels.fp8_kv.fp8_round_ref`: one power-of-two scale per row): an
fp8 pool (``float8_e4m3fn``, with ``pool_scale``) receives the fp8 values and their int8
exponent, a pool in the compute dtype (all-resident) the rounded token; the metadata and
the resident tail slot get the rounded token too, which is what the gather dequantises, so
the hierarchical path reads exactly what an all-resident fp8-rounded pool holds. Staging
keeps the token as given (the late pool write rounds it). An fp8 hot buffer
(``hot_buffer_dtype=fp8``: ``float8_e4m3fn`` slots with ``slot_scale``) receives the fp8
values and exponent, as an fp8 pool does.
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
    host_visible,
    next_pow2,
    require,
    require_runnable,
)
from kernels.fp8_kv import EXP_MAX, EXP_MIN, FP8, HEADROOM_BITS, fp8_quantize_ref, fp8_round_ref


def append_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    kv_pool: torch.Tensor,
    meta: torch.Tensor | None,
    kv_slots: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    slab_ids: torch.Tensor | None = None,
    *,
    write_pool: bool = True,
    staging: torch.Tensor | None = None,
    fp8: bool = False,
    pool_scale: torch.Tensor | None = None,
    slot_scale: torch.Tensor | None = None,
) -> None:
    """Write each request's new key/value and update page metadata, in place.

    Parameters
    ----------
    k, v : ``[B, Hkv, D]`` new key (after RoPE) and value
    positions : int ``[B]`` 0-based position of the new token
    block_table : int32 ``[B, P_max]``
    kv_pool : ``[P_pool, Hkv, 2, S, D]`` one layer of the KV pool (host pool when
        hierarchical); receives the token
    meta : ``[P_pool, Hkv, 2, D]`` page metadata; a page's first token initialises min
        and max, later tokens widen them; ``None`` leaves metadata alone
    kv_slots, page_table, slab_ids : hot buffer ``[N, 2, S, D]``, ``[num_slabs, P_max]``
        and ``[B, Hkv]``; when given, a resident tail page receives the token too
        (write-through), so it is never stale
    write_pool : False skips the pool write (a copy stream writes it later from
        ``staging``)
    staging : ``[B, Hkv, 2, D]``, receives ``k`` (index 0) and ``v`` (index 1) in its dtype
    fp8 : round the token through fp8 everywhere it is written but ``staging`` (see the
        module docstring)
    pool_scale : int8 ``[P_pool, Hkv, 2, S]`` scale exponents of an fp8 ``kv_pool``
        (``float8_e4m3fn``; needs ``fp8``), written with the pool
    slot_scale : int8 ``[N, 2, S]`` scale exponents of fp8 ``kv_slots`` (needs ``fp8``),
        written with the resident tail slot

    Raises
    ------
    ValueError : an fp8 ``kv_pool`` written without ``pool_scale`` and ``fp8``, or fp8
        ``kv_slots`` without ``slot_scale`` and ``fp8``
    """
    b, hkv, _ = k.shape
    s = kv_pool.shape[3]
    pool_fp8 = kv_pool.dtype == FP8
    if write_pool and pool_fp8 and (pool_scale is None or not fp8):
        raise ValueError("an fp8 kv_pool needs pool_scale and fp8=True")
    slots_fp8 = kv_slots is not None and kv_slots.dtype == FP8
    if slots_fp8 and (slot_scale is None or not fp8):
        raise ValueError("fp8 kv_slots need slot_scale and fp8=True")
    if staging is not None:
        staging[:, :, 0] = k.to(staging.device, staging.dtype)
        staging[:, :, 1] = v.to(staging.device, staging.dtype)
    if fp8:
        (qk, ek), (qv, ev) = fp8_quantize_ref(k), fp8_quantize_ref(v)
        k, v = fp8_round_ref(k), fp8_round_ref(v)
    pos = positions.long().to(block_table.device)
    page = pos // s
    off = pos % s
    pool_page = block_table.long()[torch.arange(b, device=block_table.device), page]
    if write_pool and pool_fp8:
        pp, off_p, dev = pool_page.to(kv_pool.device), off.to(kv_pool.device), kv_pool.device
        # index_put on float8 is not implemented everywhere: write through a uint8 view
        raw = kv_pool.view(torch.uint8)
        raw[pp, :, 0, off_p] = qk.to(dev).view(torch.uint8)
        raw[pp, :, 1, off_p] = qv.to(dev).view(torch.uint8)
        pool_scale[pp, :, 0, off_p] = ek.to(dev)
        pool_scale[pp, :, 1, off_p] = ev.to(dev)
    elif write_pool:
        pp, off_p = pool_page.to(kv_pool.device), off.to(kv_pool.device)
        kv_pool[pp, :, 0, off_p] = k.to(kv_pool.device, kv_pool.dtype)
        kv_pool[pp, :, 1, off_p] = v.to(kv_pool.device, kv_pool.dtype)
    if meta is not None:
        pm = pool_page.to(meta.device)
        kn = k.to(meta.device, meta.dtype)
        first = (off == 0).to(meta.device)[:, None, None]
        meta[pm, :, 0] = torch.where(first, kn, torch.minimum(meta[pm, :, 0], kn))
        meta[pm, :, 1] = torch.where(first, kn, torch.maximum(meta[pm, :, 1], kn))
    if kv_slots is None:
        return
    slot = page_table.long()[slab_ids.long(), page.to(page_table.device)[:, None]]  # [B, Hkv]
    res = slot >= 0
    if bool(res.any()):
        bi, hi = torch.nonzero(res, as_tuple=True)
        if slots_fp8:  # through a uint8 view, as the fp8 pool
            raw = kv_slots.view(torch.uint8)
            raw[slot[res], 0, off[bi]] = qk[bi, hi].to(raw.device).view(torch.uint8)
            raw[slot[res], 1, off[bi]] = qv[bi, hi].to(raw.device).view(torch.uint8)
            slot_scale[slot[res], 0, off[bi]] = ek[bi, hi].to(slot_scale.device)
            slot_scale[slot[res], 1, off[bi]] = ev[bi, hi].to(slot_scale.device)
            return
        kv_slots[slot[res], 0, off[bi]] = k[bi, hi].to(kv_slots.dtype)
        kv_slots[slot[res], 1, off[bi]] = v[bi, hi].to(kv_slots.dtype)


@triton.jit
def _pow2(e):
    """``2.0**e`` (fp32) for int32 ``e`` in [-126, 127], from its exponent bits."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_exponent(x, mask):
    """The int32 scale exponent of the row ``x`` (fp32, :func:`kernels.fp8_kv.fp8_exponent_ref`)."""
    amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=0)
    biased = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = biased - 127 - HEADROOM
    return tl.minimum(tl.maximum(e, EMIN), EMAX)


@triton.jit
def _round_e4m3(y):
    """fp32 ``y`` (``|y| <= 256``) rounded to the nearest e4m3 value, ties to even: adding
    and subtracting ``1.5 * 2**(E + 20)`` (``E`` = the exponent of ``y``, at least e4m3's
    smallest normal exponent -6) rounds away every bit below e4m3's unit in the last place
    ``2**(E - 3)``. The cast to fp8 that follows is then exact, which keeps the interpreter
    (whose fp32 -> e4m3 cast drops the carry into the exponent) and the GPU identical. A
    value rounded to zero keeps its sign (``-0.0``), as the reference's cast does."""
    expo = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    expo = tl.maximum(expo, -6)
    c = _pow2(expo + 20) * 1.5
    r = (y + c) - c
    return tl.where(r == 0.0, y * 0.0, r)  # keep the sign of a value rounded to zero


HEADROOM: tl.constexpr = tl.constexpr(HEADROOM_BITS)
EMIN: tl.constexpr = tl.constexpr(EXP_MIN)
EMAX: tl.constexpr = tl.constexpr(EXP_MAX)


@triton.jit
def _store_kv(dst, stride_kv, k, v, mask):
    """Store ``k`` at ``dst`` and ``v`` at ``dst + stride_kv``, cast to ``dst``'s dtype
    (exact for fp8 destinations: the values are e4m3 values already)."""
    dt = dst.dtype.element_ty
    tl.store(dst, k.to(dt), mask=mask)
    tl.store(dst + stride_kv, v.to(dt), mask=mask)


@triton.jit
def _store_exponents(dst, stride_kv, ek, ev):
    """Store one token row's int8 scale exponents of K (at ``dst``) and V."""
    tl.store(dst, ek.to(tl.int8))
    tl.store(dst + stride_kv, ev.to(tl.int8))


@triton.jit
def _widen_meta(meta, stride_mm, k, first, mask):
    """Widen the page's key min (at ``meta``) / max (``meta + stride_mm``) by ``k``, or
    start them at ``k`` for a page's ``first`` token. The key is rounded to the metadata
    dtype first (as the reference does), then compared in fp32: min/max return one of
    their inputs, so this is exact for every dtype."""
    mdt = meta.dtype.element_ty
    kn = k.to(mdt).to(tl.float32)
    lo = tl.load(meta, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(meta + stride_mm, mask=mask, other=0.0).to(tl.float32)
    lo = tl.where(first, kn, tl.minimum(lo, kn, propagate_nan=tl.PropagateNan.ALL))
    hi = tl.where(first, kn, tl.maximum(hi, kn, propagate_nan=tl.PropagateNan.ALL))
    tl.store(meta, lo.to(mdt), mask=mask)
    tl.store(meta + stride_mm, hi.to(mdt), mask=mask)


@triton.jit
def _append_kv_kernel(
    k_ptr,
    v_ptr,
    positions_ptr,
    block_table_ptr,
    pool_ptr,
    meta_ptr,
    slots_ptr,
    page_table_ptr,
    slab_ids_ptr,
    staging_ptr,
    scale_ptr,
    slot_scale_ptr,
    num_kv_heads,
    stride_k_b,
    stride_k_h,
    stride_v_b,
    stride_v_h,
    stride_bt_b,
    stride_pool_p,
    stride_pool_h,
    stride_pool_kv,
    stride_pool_s,
    stride_meta_p,
    stride_meta_h,
    stride_meta_mm,
    stride_slots_n,
    stride_slots_kv,
    stride_slots_s,
    stride_pt_slab,
    stride_slab_b,
    stride_slab_h,
    stride_st_b,
    stride_st_h,
    stride_st_kv,
    stride_sc_p,
    stride_sc_h,
    stride_sc_kv,
    stride_ss_n,
    stride_ss_kv,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    WRITE_POOL: tl.constexpr,
    HAS_META: tl.constexpr,
    HAS_STAGING: tl.constexpr,
    FP8: tl.constexpr,
    POOL_FP8: tl.constexpr,
    SLOTS_FP8: tl.constexpr,
):
    """One (request, KV head): staging copy, pool write, metadata min/max, resident tail
    write (each behind its flag); with ``FP8`` the token is rounded through fp8 first."""
    row = tl.program_id(0)
    b = row // num_kv_heads
    h = row % num_kv_heads
    pos = tl.load(positions_ptr + b).to(tl.int64)
    page = pos // PAGE_SIZE
    off = pos % PAGE_SIZE
    pool_page = tl.load(block_table_ptr + b * stride_bt_b + page).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    k = tl.load(k_ptr + b * stride_k_b + h * stride_k_h + offs_d, mask=mask_d)
    v = tl.load(v_ptr + b * stride_v_b + h * stride_v_h + offs_d, mask=mask_d)

    if HAS_STAGING:
        st = staging_ptr + b * stride_st_b + h * stride_st_h + offs_d
        tl.store(st, k.to(staging_ptr.dtype.element_ty), mask=mask_d)
        tl.store(st + stride_st_kv, v.to(staging_ptr.dtype.element_ty), mask=mask_d)

    kr, vr = k, v  # the values an fp8 destination receives (e4m3 values with FP8)
    if FP8:  # quantise (exact power-of-two scaling, RNE rounding) and round back
        kf = k.to(tl.float32)
        vf = v.to(tl.float32)
        ek = _fp8_exponent(kf, mask_d)
        ev = _fp8_exponent(vf, mask_d)
        # The rounded values stay in fp32 (each is an e4m3 value, so the fp8 cast for the
        # pool is exact) and are scaled back from there: converting the fp8 values back to
        # fp32 in this kernel gave wrong values on an H200 (triton 3.6) wherever the
        # metadata was also written, although the fp8 pool bytes were right.
        kr = _round_e4m3(kf * _pow2(-ek))
        vr = _round_e4m3(vf * _pow2(-ev))
        k = (kr * _pow2(ek)).to(k.dtype)
        v = (vr * _pow2(ev)).to(v.dtype)

    if WRITE_POOL:
        rec = pool_ptr + pool_page * stride_pool_p + h * stride_pool_h + off * stride_pool_s
        if POOL_FP8:
            _store_kv(rec + offs_d, stride_pool_kv, kr, vr, mask_d)
            sc = scale_ptr + pool_page * stride_sc_p + h * stride_sc_h + off
            _store_exponents(sc, stride_sc_kv, ek, ev)
        else:
            _store_kv(rec + offs_d, stride_pool_kv, k, v, mask_d)

    if HAS_META:
        meta = meta_ptr + pool_page * stride_meta_p + h * stride_meta_h + offs_d
        _widen_meta(meta, stride_meta_mm, k, off == 0, mask_d)

    if HAS_SLOTS:
        slab = tl.load(slab_ids_ptr + b * stride_slab_b + h * stride_slab_h).to(tl.int64)
        slot = tl.load(page_table_ptr + slab * stride_pt_slab + page).to(tl.int64)
        if slot >= 0:
            dst = slots_ptr + slot * stride_slots_n + off * stride_slots_s + offs_d
            if SLOTS_FP8:
                _store_kv(dst, stride_slots_kv, kr, vr, mask_d)
                ss = slot_scale_ptr + slot * stride_ss_n + off
                _store_exponents(ss, stride_ss_kv, ek, ev)
            else:
                _store_kv(dst, stride_slots_kv, k, v, mask_d)


def _unused(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """A placeholder argument for a pointer the kernel never dereferences (its flag off)."""
    return t.as_strided((1,) * ndim, (0,) * ndim)


def check_pool_writes(
    kv_pool: torch.Tensor, pool_scale: torch.Tensor | None, write_pool: bool, dev, k: torch.Tensor
) -> tuple[bool, torch.Tensor]:
    """Checks of the pool-writing kernels' pool arguments (``kv_pool [P_pool, Hkv, 2, S,
    D]``, fp8 ``pool_scale [P_pool, Hkv, 2, S]``): the pool (and the scales of an fp8
    pool) addressable from ``dev`` when written. Returns ``(write_scale, scale)``: whether
    the scales are written, and the scale argument to pass (a placeholder when not).

    Raises
    ------
    ValueError : a pool or scale tensor the device cannot reach, or an fp8 pool written
        without ``pool_scale``
    """
    require(
        not write_pool or host_visible(kv_pool, dev),
        f"kv_pool on {kv_pool.device} is not addressable from {dev}",
    )
    write_scale = write_pool and kv_pool.dtype == FP8
    if write_scale:
        _, hkv, _, s, _ = kv_pool.shape
        require(pool_scale is not None, "an fp8 kv_pool needs pool_scale")
        check_tensor("pool_scale", pool_scale, 4, (torch.int8,))
        check_shape("pool_scale", pool_scale, (kv_pool.shape[0], hkv, 2, s))
        require(
            host_visible(pool_scale, dev),
            f"pool_scale on {pool_scale.device} is not addressable from {dev}",
        )
    return write_scale, (pool_scale if write_scale else _unused(k, 4))  # unused: never read


def check_slot_writes(
    kv_slots: torch.Tensor | None,
    page_table: torch.Tensor | None,
    slab_ids: torch.Tensor | None,
    slot_scale: torch.Tensor | None,
    fp8: bool,
    shape: tuple[int, int, int, int],
    dev: torch.device,
    k: torch.Tensor,
) -> tuple[bool, torch.Tensor]:
    """Checks of the append kernels' hot-buffer arguments: ``kv_slots [N, 2, S, D]``
    (bf16/fp16/fp32, or float8_e4m3fn with int8 ``slot_scale [N, 2, S]`` and ``fp8``),
    int32 ``page_table [num_slabs, P_max]`` and ``slab_ids [B, Hkv]``, all or none, on
    ``dev``; ``shape`` is ``(B, Hkv, S, D)``. Returns ``(slots_fp8, slot_scale)``: whether
    the slots are fp8, and the scale argument to pass (a placeholder when not).

    Raises
    ------
    ValueError : the three given apart, a shape, dtype or device that does not match
    """
    b, hkv, s, d = shape
    has_slots = kv_slots is not None
    require(
        has_slots == (page_table is not None) == (slab_ids is not None),
        "kv_slots, page_table and slab_ids go together",
    )
    if not has_slots:
        return False, _unused(k, 3)
    check_tensor("kv_slots", kv_slots, 4, (*FLOAT_DTYPES, FP8))
    check_tensor("page_table", page_table, 2, INDEX_DTYPES)
    check_tensor("slab_ids", slab_ids, 2, INDEX_DTYPES, unit_last=False)
    require(
        kv_slots.shape[1:] == (2, s, d),
        f"kv_slots must be [N, 2, {s}, {d}], got {tuple(kv_slots.shape)}",
    )
    check_shape("slab_ids", slab_ids, (b, hkv))
    check_device(dev, kv_slots=kv_slots, page_table=page_table, slab_ids=slab_ids)
    if kv_slots.dtype != FP8:
        return False, _unused(k, 3)
    require(fp8 and slot_scale is not None, "fp8 kv_slots need slot_scale and fp8=True")
    check_tensor("slot_scale", slot_scale, 3, (torch.int8,))
    check_shape("slot_scale", slot_scale, (kv_slots.shape[0], 2, s))
    check_device(dev, slot_scale=slot_scale)
    return True, slot_scale


def append_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    kv_pool: torch.Tensor,
    meta: torch.Tensor | None,
    kv_slots: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    slab_ids: torch.Tensor | None = None,
    *,
    write_pool: bool = True,
    staging: torch.Tensor | None = None,
    fp8: bool = False,
    pool_scale: torch.Tensor | None = None,
    slot_scale: torch.Tensor | None = None,
) -> None:
    """Triton :func:`append_kv_ref`: same arguments, bit-identical results, one launch.

    Parameters
    ----------
    k, v : ``[B, Hkv, D]`` on the device, unit stride on ``D``
    positions : int32/int64 ``[B]``
    block_table : int32/int64 ``[B, P_max]``, unit stride on ``P_max``
    kv_pool : ``[P_pool, Hkv, 2, S, D]`` on the device or in pinned host memory (written
        by the kernel through unified addressing), unit stride on ``D``
    meta : ``[P_pool, Hkv, 2, D]`` on the device, unit stride on ``D``, or ``None``
    kv_slots, page_table, slab_ids : ``[N, 2, S, D]``, int32 ``[num_slabs, P_max]`` (unit
        stride on ``P_max``), int32/int64 ``[B, Hkv]`` — all or none
    write_pool : whether to write ``kv_pool`` (read only for its shape when False)
    staging : ``[B, Hkv, 2, D]`` on the device, unit stride on ``D``, or ``None``
    fp8, pool_scale : as in :func:`append_kv_ref`; ``pool_scale`` int8 ``[P_pool, Hkv, 2,
        S]`` where ``kv_pool`` lives, unit stride on ``S``
    slot_scale : int8 ``[N, 2, S]`` on the device, unit stride on ``S``: with fp8
        ``kv_slots`` (needs ``fp8``)

    Raises
    ------
    ValueError : a shape, dtype, stride or device that does not match the above
    """
    check_tensor("k", k, 3, FLOAT_DTYPES)
    check_tensor("v", v, 3, FLOAT_DTYPES)
    check_tensor("positions", positions, 1, INDEX_DTYPES, unit_last=False)
    check_tensor("block_table", block_table, 2, INDEX_DTYPES)
    check_tensor("kv_pool", kv_pool, 5, (*FLOAT_DTYPES, FP8) if fp8 else FLOAT_DTYPES)
    b, hkv, d = k.shape
    s = kv_pool.shape[3]
    check_shape("v", v, (b, hkv, d))
    check_shape("positions", positions, (b,))
    require(block_table.shape[0] == b, f"block_table has {block_table.shape[0]} rows, batch is {b}")
    require(
        kv_pool.shape[1:] == (hkv, 2, s, d),
        f"kv_pool must be [P_pool, {hkv}, 2, S, {d}], got {tuple(kv_pool.shape)}",
    )
    dev = k.device
    check_device(dev, v=v, positions=positions, block_table=block_table)
    if meta is not None:
        check_tensor("meta", meta, 4, FLOAT_DTYPES)
        require(
            meta.shape[1:] == (hkv, 2, d),
            f"meta must be [P_pool, {hkv}, 2, {d}], got {tuple(meta.shape)}",
        )
        check_device(dev, meta=meta)
    if staging is not None:
        check_tensor("staging", staging, 4, FLOAT_DTYPES)
        check_shape("staging", staging, (b, hkv, 2, d))
        check_device(dev, staging=staging)
    write_scale, scale = check_pool_writes(kv_pool, pool_scale, write_pool, dev, k)
    has_slots = kv_slots is not None
    slots_fp8, slot_scale = check_slot_writes(
        kv_slots, page_table, slab_ids, slot_scale, fp8, (b, hkv, s, d), dev, k
    )
    if kv_slots is None:
        kv_slots, page_table, slab_ids = _unused(k, 4), block_table, positions.view(-1, 1)
    has_meta, has_staging = meta is not None, staging is not None
    meta = meta if has_meta else _unused(k, 4)
    staging = staging if has_staging else _unused(k, 4)
    pool = kv_pool if write_pool else _unused(k, 5)
    require_runnable(dev)
    if b * hkv == 0:
        return
    _append_kv_kernel[(b * hkv,)](
        k,
        v,
        positions,
        block_table,
        pool,
        meta,
        kv_slots,
        page_table,
        slab_ids,
        staging,
        scale,
        slot_scale,
        hkv,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        block_table.stride(0),
        pool.stride(0),
        pool.stride(1),
        pool.stride(2),
        pool.stride(3),
        meta.stride(0),
        meta.stride(1),
        meta.stride(2),
        kv_slots.stride(0),
        kv_slots.stride(1),
        kv_slots.stride(2),
        page_table.stride(0),
        slab_ids.stride(0),
        slab_ids.stride(1),
        staging.stride(0),
        staging.stride(1),
        staging.stride(2),
        scale.stride(0),
        scale.stride(1),
        scale.stride(2),
        slot_scale.stride(0),
        slot_scale.stride(1),
        D=d,
        BLOCK_D=next_pow2(d),
        PAGE_SIZE=s,
        HAS_SLOTS=has_slots,
        WRITE_POOL=write_pool,
        HAS_META=has_meta,
        HAS_STAGING=has_staging,
        FP8=fp8,
        POOL_FP8=write_scale,
        SLOTS_FP8=slots_fp8,
        num_warps=1,
    )
