"""Gather: copy missed records from the KV pool (pinned host memory) into hot-buffer slots.

:func:`gather` is the Triton version: the GPU itself reads the pinned host pool through
unified virtual addressing: pinned memory (``torch.Tensor.pin_memory()``,
``torch.empty(..., pin_memory=True)``) is mapped into every device's address space, and
Triton's launcher turns a tensor's ``data_ptr()`` into the device pointer with
``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER)``, the driver-API twin of
``cudaHostGetDevicePointer`` (pageable memory is refused there). One launch moves every
record of the load list, with no host synchronisation and no copy-engine calls.

An fp8 host pool (``kv_host_dtype=fp8``: ``float8_e4m3fn`` records and their int8 scale
exponents, :mod:`kernels.fp8_kv`) is dequantised to the hot buffer's dtype as it is
copied: :func:`gather_fp8` reads half the bytes over the link and writes what
:func:`kernels.fp8_kv.fp8_dequantize_ref` gives, bit for bit. An fp8 hot buffer
(``hot_buffer_dtype=fp8``: ``float8_e4m3fn`` slots and ``slot_scale [N, 2, S]`` int8) gets
the records and their exponents as stored: attention dequantises them as it reads
(:mod:`kernels.sparse_attention`).
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
from kernels.fp8_kv import FP8, fp8_dequantize_ref


def gather_ref(
    kv_pool: torch.Tensor,
    kv_slots: torch.Tensor,
    block_table: torch.Tensor,
    load_pages: torch.Tensor,
    load_slots: torch.Tensor,
    pool_scale: torch.Tensor | None = None,
    slot_scale: torch.Tensor | None = None,
) -> None:
    """Copy each load-list entry ``(b, h, page) -> slot`` in place, byte-exact (with
    ``pool_scale``: dequantised from fp8, or with fp8 slots copied as stored).

    Parameters
    ----------
    kv_pool : ``[P_pool, Hkv, 2, S, D]`` one layer of the host pool (record = ``[2, S, D]``)
    kv_slots : ``[N, 2, S, D]`` one layer of the hot buffer, same dtype; written in place
    block_table : int32 ``[B, P_max]`` request page -> pool page
    load_pages : int32 ``[B, Hkv, K]`` request page to load, -1 for no load
    load_slots : int32 ``[B, Hkv, K]`` destination slot, -1 for no load
    pool_scale : int8 ``[P_pool, Hkv, 2, S]`` scale exponents of an fp8 ``kv_pool``
        (``float8_e4m3fn``); ``None`` for a pool in the slots' dtype
    slot_scale : int8 ``[N, 2, S]`` scale exponents of fp8 ``kv_slots`` (an fp8 hot buffer,
        from an fp8 pool): receives the records' exponents

    Raises
    ------
    ValueError : fp8 ``kv_slots`` without an fp8 pool, ``pool_scale`` and ``slot_scale``
    """
    slots_fp8 = kv_slots.dtype == FP8
    if slots_fp8 and (pool_scale is None or slot_scale is None or kv_pool.dtype != FP8):
        raise ValueError("fp8 kv_slots need an fp8 kv_pool, pool_scale and slot_scale")
    mask = load_slots >= 0
    if not bool(mask.any()):
        return
    b_idx, h_idx, _ = torch.nonzero(mask, as_tuple=True)
    pool_pages = block_table.long()[b_idx, load_pages[mask].long()]
    pp, hh = pool_pages.to(kv_pool.device), h_idx.to(kv_pool.device)
    if pool_scale is None and kv_pool.is_contiguous() and kv_slots.is_contiguous():
        # Whole records by row (index_select / index_copy_): on CPU, advanced indexing
        # computes an offset per element and is several times slower for 4-16 KiB rows.
        hkv = kv_pool.shape[1]
        rows = kv_pool.view(-1, *kv_pool.shape[2:]).index_select(0, pp * hkv + hh)
        dst = load_slots[mask].long().to(kv_slots.device)
        kv_slots.index_copy_(0, dst, rows.to(kv_slots.device, kv_slots.dtype, non_blocking=True))
        return
    if slots_fp8:  # fp8 records and their exponents as stored, through uint8 views
        dst = load_slots[mask].long().to(kv_slots.device)
        raw = kv_pool.view(torch.uint8)[pp, hh]
        kv_slots.view(torch.uint8)[dst] = raw.to(kv_slots.device, non_blocking=True)
        slot_scale[dst] = pool_scale[pp, hh].to(slot_scale.device, non_blocking=True)
        return
    if pool_scale is None:
        src = kv_pool[pp, hh]
    else:  # fp8 records: fancy indexing through a uint8 view (not every backend has fp8)
        q = kv_pool.view(torch.uint8)[pp, hh].view(FP8)
        src = fp8_dequantize_ref(q, pool_scale[pp, hh], kv_slots.dtype)
    kv_slots[load_slots[mask].long()] = src.to(kv_slots.device, non_blocking=True)


@triton.jit
def _gather_kernel(
    pool_ptr,
    slots_ptr,
    block_table_ptr,
    load_pages_ptr,
    load_slots_ptr,
    num_kv_heads,
    k_max,
    record_words,
    stride_pool_p,
    stride_pool_h,
    stride_slots_n,
    stride_bt_b,
    stride_lp_b,
    stride_lp_h,
    stride_ls_b,
    stride_ls_h,
    BLOCK: tl.constexpr,
):
    """One (load-list entry, chunk of ``BLOCK`` words): copy it if the entry is a load.

    Records are copied as 32-bit words, so the copy is byte-exact for every dtype.
    """
    entry = tl.program_id(0)
    chunk = tl.program_id(1)
    k = entry % k_max
    bh = entry // k_max
    h = bh % num_kv_heads
    b = bh // num_kv_heads
    slot = tl.load(load_slots_ptr + b * stride_ls_b + h * stride_ls_h + k)
    if slot >= 0:
        page = tl.load(load_pages_ptr + b * stride_lp_b + h * stride_lp_h + k)
        pool_page = tl.load(block_table_ptr + b * stride_bt_b + page).to(tl.int64)
        src = pool_ptr + pool_page * stride_pool_p + h * stride_pool_h
        dst = slots_ptr + slot.to(tl.int64) * stride_slots_n
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < record_words
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def _as_words(name: str, t: torch.Tensor, lead: int) -> torch.Tensor:
    """View ``t`` as 32-bit words; its records (dims ``lead:``) must be contiguous."""
    rec = t.shape[lead:]
    require(
        list(t.stride()[lead:]) == [rec[1] * rec[2], rec[2], 1],
        f"{name} records {tuple(rec)} must be contiguous, got strides {t.stride()}",
    )
    require(
        rec[2] * t.element_size() % 4 == 0,
        f"{name} rows of {rec[2] * t.element_size()} bytes are not whole 32-bit words",
    )
    try:
        return t.view(torch.int32)
    except RuntimeError as err:
        raise ValueError(f"{name} cannot be viewed as 32-bit words: {err}") from err


def gather(
    kv_pool: torch.Tensor,
    kv_slots: torch.Tensor,
    block_table: torch.Tensor,
    load_pages: torch.Tensor,
    load_slots: torch.Tensor,
    pool_scale: torch.Tensor | None = None,
    slot_scale: torch.Tensor | None = None,
) -> None:
    """Triton :func:`gather_ref`: byte-exact, one launch, no host synchronisation (an
    fp8 pool, with ``pool_scale``, goes to :func:`gather_fp8`).

    Parameters
    ----------
    kv_pool : ``[P_pool, Hkv, 2, S, D]`` on the device or in pinned host memory (read by
        the kernel through unified addressing); each record ``[2, S, D]`` contiguous
    kv_slots : ``[N, 2, S, D]`` on the device, same dtype, records contiguous
    block_table : int32/int64 ``[B, P_max]``, unit stride on ``P_max``
    load_pages, load_slots : int32/int64 ``[B, Hkv, K]``, unit stride on ``K``
    pool_scale, slot_scale : see :func:`gather_fp8`

    Raises
    ------
    ValueError : a shape, dtype, stride or device that does not match the above
    """
    if pool_scale is not None:
        gather_fp8(kv_pool, kv_slots, block_table, load_pages, load_slots, pool_scale, slot_scale)
        return
    check_tensor("kv_pool", kv_pool, 5, (kv_pool.dtype,))
    check_tensor("kv_slots", kv_slots, 4, (kv_pool.dtype,))
    check_tensor("block_table", block_table, 2, INDEX_DTYPES)
    check_tensor("load_pages", load_pages, 3, INDEX_DTYPES)
    check_tensor("load_slots", load_slots, 3, INDEX_DTYPES)
    b, hkv, k_max = load_slots.shape
    require(
        tuple(load_pages.shape) == (b, hkv, k_max),
        f"load_pages {tuple(load_pages.shape)} and load_slots {tuple(load_slots.shape)} differ",
    )
    require(block_table.shape[0] == b, f"block_table has {block_table.shape[0]} rows, batch is {b}")
    require(kv_pool.shape[1] == hkv, f"kv_pool has {kv_pool.shape[1]} KV heads, load list {hkv}")
    require(
        kv_pool.shape[2:] == kv_slots.shape[1:],
        f"record shapes differ: pool {tuple(kv_pool.shape[2:])}, slots {tuple(kv_slots.shape[1:])}",
    )
    dev = kv_slots.device
    check_device(dev, block_table=block_table, load_pages=load_pages, load_slots=load_slots)
    require(
        host_visible(kv_pool, dev),
        f"kv_pool on {kv_pool.device} is not addressable from {dev} (pin host memory)",
    )
    require_runnable(dev)
    pool_words = _as_words("kv_pool", kv_pool, 2)
    slot_words = _as_words("kv_slots", kv_slots, 1)
    if b * hkv * k_max == 0:
        return
    record_words = pool_words.shape[2] * pool_words.shape[3] * pool_words.shape[4]
    block = min(4096, next_pow2(record_words))
    grid = (b * hkv * k_max, -(-record_words // block))
    _gather_kernel[grid](
        pool_words,
        slot_words,
        block_table,
        load_pages,
        load_slots,
        hkv,
        k_max,
        record_words,
        pool_words.stride(0),
        pool_words.stride(1),
        slot_words.stride(0),
        block_table.stride(0),
        load_pages.stride(0),
        load_pages.stride(1),
        load_slots.stride(0),
        load_slots.stride(1),
        BLOCK=block,
        num_warps=8,
    )


@triton.jit
def _gather_fp8_kernel(
    pool_ptr,
    scale_ptr,
    slots_ptr,
    slot_scale_ptr,
    block_table_ptr,
    load_pages_ptr,
    load_slots_ptr,
    num_kv_heads,
    k_max,
    num_rows,
    stride_pool_p,
    stride_pool_h,
    stride_sc_p,
    stride_sc_h,
    stride_slots_n,
    stride_ss_n,
    stride_bt_b,
    stride_lp_b,
    stride_lp_h,
    stride_ls_b,
    stride_ls_h,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    RAW: tl.constexpr,
):
    """One (load-list entry, block of ``BLOCK_R`` rows): dequantise the rows of a load.

    A record is ``2 x S`` rows of ``D`` fp8 values (keys then values) with one int8
    exponent per row; row ``r`` of the slot gets ``q[r] * 2**e[r]`` in the slots' dtype.
    ``RAW`` (fp8 slots): the rows and exponents are copied as stored.
    """
    entry = tl.program_id(0)
    chunk = tl.program_id(1)
    k = entry % k_max
    bh = entry // k_max
    h = bh % num_kv_heads
    b = bh // num_kv_heads
    slot = tl.load(load_slots_ptr + b * stride_ls_b + h * stride_ls_h + k)
    if slot >= 0:
        page = tl.load(load_pages_ptr + b * stride_lp_b + h * stride_lp_h + k)
        pool_page = tl.load(block_table_ptr + b * stride_bt_b + page).to(tl.int64)
        rows = chunk * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_D)
        rmask = rows < num_rows
        mask = rmask[:, None] & (cols < D)[None, :]
        offs = rows[:, None] * D + cols[None, :]
        src = pool_ptr + pool_page * stride_pool_p + h * stride_pool_h
        e = tl.load(scale_ptr + pool_page * stride_sc_p + h * stride_sc_h + rows, mask=rmask, other=0)
        dst = slots_ptr + slot.to(tl.int64) * stride_slots_n
        if RAW:
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
            tl.store(slot_scale_ptr + slot.to(tl.int64) * stride_ss_n + rows, e, mask=rmask)
        else:
            q = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
            scale = ((e.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
            out = q * scale[:, None]
            tl.store(dst + offs, out.to(slots_ptr.dtype.element_ty), mask=mask)


def gather_fp8(
    kv_pool: torch.Tensor,
    kv_slots: torch.Tensor,
    block_table: torch.Tensor,
    load_pages: torch.Tensor,
    load_slots: torch.Tensor,
    pool_scale: torch.Tensor,
    slot_scale: torch.Tensor | None = None,
) -> None:
    """Triton :func:`gather_ref` of an fp8 pool: one launch, no host synchronisation.

    Parameters
    ----------
    kv_pool : float8_e4m3fn ``[P_pool, Hkv, 2, S, D]`` on the device or in pinned host
        memory, each record ``[2, S, D]`` contiguous
    kv_slots : ``[N, 2, S, D]`` float32/bfloat16/float16 (dequantised into) or
        float8_e4m3fn (copied into, with ``slot_scale``) on the device, records contiguous
    block_table, load_pages, load_slots : as in :func:`gather`
    pool_scale : int8 ``[P_pool, Hkv, 2, S]`` where ``kv_pool`` lives, each record's
        ``[2, S]`` contiguous
    slot_scale : int8 ``[N, 2, S]`` on the device, each slot's ``[2, S]`` contiguous: the
        exponents of fp8 ``kv_slots`` (required then)

    Raises
    ------
    ValueError : a shape, dtype, stride or device that does not match the above
    """
    check_tensor("kv_pool", kv_pool, 5, (FP8,))
    check_tensor("kv_slots", kv_slots, 4, (*FLOAT_DTYPES, FP8))
    check_tensor("pool_scale", pool_scale, 4, (torch.int8,))
    check_tensor("block_table", block_table, 2, INDEX_DTYPES)
    check_tensor("load_pages", load_pages, 3, INDEX_DTYPES)
    check_tensor("load_slots", load_slots, 3, INDEX_DTYPES)
    b, hkv, k_max = load_slots.shape
    p, _, two, s, d = kv_pool.shape
    require(
        tuple(load_pages.shape) == (b, hkv, k_max),
        f"load_pages {tuple(load_pages.shape)} and load_slots {tuple(load_slots.shape)} differ",
    )
    require(block_table.shape[0] == b, f"block_table has {block_table.shape[0]} rows, batch is {b}")
    require(kv_pool.shape[1] == hkv, f"kv_pool has {kv_pool.shape[1]} KV heads, load list {hkv}")
    require(
        kv_pool.shape[2:] == kv_slots.shape[1:],
        f"record shapes differ: pool {tuple(kv_pool.shape[2:])}, slots {tuple(kv_slots.shape[1:])}",
    )
    require(
        tuple(pool_scale.shape) == (p, hkv, two, s),
        f"pool_scale must be [{p}, {hkv}, {two}, {s}], got {tuple(pool_scale.shape)}",
    )
    for name, t in (("kv_pool", kv_pool), ("kv_slots", kv_slots)):
        require(
            list(t.stride()[-3:]) == [s * d, d, 1],
            f"{name} records must be contiguous, got strides {t.stride()}",
        )
    require(pool_scale.stride(2) == s, f"pool_scale rows must be contiguous, got {pool_scale.stride()}")
    dev = kv_slots.device
    raw = kv_slots.dtype == FP8
    if raw:
        require(slot_scale is not None, "fp8 kv_slots need slot_scale")
        check_tensor("slot_scale", slot_scale, 3, (torch.int8,))
        check_shape("slot_scale", slot_scale, (kv_slots.shape[0], two, s))
        require(slot_scale.stride(1) == s, f"slot_scale rows must be contiguous, got {slot_scale.stride()}")
        check_device(dev, slot_scale=slot_scale)
    else:
        slot_scale = pool_scale.as_strided((1,), (0,))  # never read
    check_device(dev, block_table=block_table, load_pages=load_pages, load_slots=load_slots)
    for name, t in (("kv_pool", kv_pool), ("pool_scale", pool_scale)):
        require(host_visible(t, dev), f"{name} on {t.device} is not addressable from {dev} (pin host memory)")
    require_runnable(dev)
    if b * hkv * k_max == 0:
        return
    num_rows = two * s
    block_d = next_pow2(d)
    block_r = max(1, min(next_pow2(num_rows), 4096 // block_d))
    grid = (b * hkv * k_max, -(-num_rows // block_r))
    _gather_fp8_kernel[grid](
        kv_pool,
        pool_scale,
        kv_slots,
        slot_scale,
        block_table,
        load_pages,
        load_slots,
        hkv,
        k_max,
        num_rows,
        kv_pool.stride(0),
        kv_pool.stride(1),
        pool_scale.stride(0),
        pool_scale.stride(1),
        kv_slots.stride(0),
        slot_scale.stride(0),
        block_table.stride(0),
        load_pages.stride(0),
        load_pages.stride(1),
        load_slots.stride(0),
        load_slots.stride(1),
        D=d,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        RAW=raw,
        num_warps=8,
    )
