"""Gather: copy missed records from the KV pool (pinned host memory) into hot-buffer slots.

:func:`gather` is the Triton version: the GPU itself reads the pinned host pool through
unified virtual addressing: pinned memory (``torch.Tensor.pin_memory()``,
``torch.empty(..., pin_memory=True)``) is mapped into every device's address space, and
Triton's launcher turns a tensor's ``data_ptr()`` into the device pointer with
``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER)``, the driver-API twin of
``cudaHostGetDevicePointer`` (pageable memory is refused there). One launch moves every
record of the load list, with no host synchronisation and no copy-engine calls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import (
    INDEX_DTYPES,
    check_device,
    check_tensor,
    host_visible,
    next_pow2,
    require,
    require_runnable,
)


def gather_ref(
    kv_pool: torch.Tensor,
    kv_slots: torch.Tensor,
    block_table: torch.Tensor,
    load_pages: torch.Tensor,
    load_slots: torch.Tensor,
) -> None:
    """Copy each load-list entry ``(b, h, page) -> slot`` in place, byte-exact.

    Parameters
    ----------
    kv_pool : ``[P_pool, Hkv, 2, S, D]`` one layer of the host pool (record = ``[2, S, D]``)
    kv_slots : ``[N, 2, S, D]`` one layer of the hot buffer, same dtype; written in place
    block_table : int32 ``[B, P_max]`` request page -> pool page
    load_pages : int32 ``[B, Hkv, K]`` request page to load, -1 for no load
    load_slots : int32 ``[B, Hkv, K]`` destination slot, -1 for no load
    """
    mask = load_slots >= 0
    if not bool(mask.any()):
        return
    b_idx, h_idx, _ = torch.nonzero(mask, as_tuple=True)
    pool_pages = block_table.long()[b_idx, load_pages[mask].long()]
    src = kv_pool[pool_pages.to(kv_pool.device), h_idx.to(kv_pool.device)]
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
) -> None:
    """Triton :func:`gather_ref`: byte-exact, one launch, no host synchronisation.

    Parameters
    ----------
    kv_pool : ``[P_pool, Hkv, 2, S, D]`` on the device or in pinned host memory (read by
        the kernel through unified addressing); each record ``[2, S, D]`` contiguous
    kv_slots : ``[N, 2, S, D]`` on the device, same dtype, records contiguous
    block_table : int32/int64 ``[B, P_max]``, unit stride on ``P_max``
    load_pages, load_slots : int32/int64 ``[B, Hkv, K]``, unit stride on ``K``
    """
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
