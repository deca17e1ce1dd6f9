"""Slot list of the all-resident path: the selected pages' records, in position order,
as slots of the KV pool itself.

With every record resident (``hierarchical=False``) there is nothing to resolve: record
``(pool page p, KV head h)`` is slot ``p * Hkv + h`` of the pool viewed as
``[P_pool * Hkv, 2, S, D]``, so sparse attention reads the pool in place.
:func:`resident_slot_list` is the reference (and CPU path), :func:`resident_slot_list_triton`
the kernel (one program per (request, KV head) row, no host synchronisation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import (
    INDEX_DTYPES,
    check_device,
    check_tensor,
    next_pow2,
    require,
    require_runnable,
)
from kernels.bitmask import selected_pages


def resident_slot_list(
    selection: torch.Tensor, block_table: torch.Tensor, k_max: int
) -> torch.Tensor:
    """Slot list for the all-resident path, where record ``(pool page p, head h)`` is
    slot ``p * Hkv + h`` of the KV pool viewed as ``[P_pool * Hkv, 2, S, D]``.

    Parameters
    ----------
    selection : int32 ``[B, Hkv, W]``; block_table : int32 ``[B, P_max]``

    Returns
    -------
    int32 ``[B, Hkv, K_max]`` in position order, -1 padded.
    """
    b, hkv, _ = selection.shape
    p_max = block_table.shape[1]
    pages = selected_pages(selection, p_max, k_max).long()  # [B, Hkv, K]
    pool_page = torch.gather(
        block_table.long()[:, None, :].expand(-1, hkv, -1), 2, pages.clamp(min=0)
    )
    heads = torch.arange(hkv, device=selection.device)[None, :, None]
    slots = pool_page * hkv + heads
    return torch.where(pages >= 0, slots, torch.full_like(slots, -1)).to(torch.int32)


def resident_slots_of_pages(
    pages: torch.Tensor, block_table: torch.Tensor
) -> torch.Tensor:
    """:func:`resident_slot_list` from selected page indices instead of a bitmask:
    ``pages`` int ``[B, Hkv, K_max]`` (position order, -1 padded; e.g.
    :func:`kernels.select_topk.select_topk_pages_ref`), ``block_table`` int32 ``[B, P_max]``.

    Returns
    -------
    int64 ``[B, Hkv, K_max]``: slot ``pool_page * Hkv + h`` of each selected page, -1 padded.
    """
    b, hkv, k = pages.shape
    pool_page = block_table.long().gather(1, pages.clamp(min=0).view(b, hkv * k)).view(b, hkv, k)
    heads = torch.arange(hkv, device=pages.device)[None, :, None]
    return (pool_page * hkv + heads).masked_fill_(pages < 0, -1)


@triton.jit
def _resident_slot_list_kernel(
    sel_ptr,
    block_table_ptr,
    out_ptr,
    num_kv_heads,
    num_pages,
    k_max,
    stride_sel_b,
    stride_sel_h,
    stride_bt_b,
    BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One (request, KV head) row: slot ``pool_page * Hkv + h`` of each selected page."""
    row = tl.program_id(0)
    b = row // num_kv_heads
    h = row % num_kv_heads
    sel_row = sel_ptr + b * stride_sel_b + h * stride_sel_h
    out_row = out_ptr + row.to(tl.int64) * k_max
    n_sel = tl.full([], 0, tl.int32)
    for p0 in range(0, num_pages, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        word = tl.load(sel_row + offs_p // 32, mask=offs_p < num_pages, other=0)
        sel = (((word >> (offs_p % 32)) & 1) != 0) & (offs_p < num_pages)
        sel_i = sel.to(tl.int32)
        j = n_sel + tl.cumsum(sel_i, axis=0) - sel_i
        pool_page = tl.load(block_table_ptr + b * stride_bt_b + offs_p, mask=sel, other=0)
        slot = tl.maximum(pool_page, 0) * num_kv_heads + h
        tl.store(out_row + j, slot.to(tl.int32), mask=sel & (j < k_max))
        n_sel += tl.sum(sel_i, axis=0)
    for k0 in range(0, k_max, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_pad = (offs_k < k_max) & (offs_k >= n_sel)
        tl.store(out_row + offs_k, tl.full([BLOCK_K], -1, tl.int32), mask=mask_pad)


def resident_slot_list_triton(
    selection: torch.Tensor, block_table: torch.Tensor, k_max: int
) -> torch.Tensor:
    """Triton :func:`resident_slot_list` (no host synchronisation; a row selecting more
    than ``K_max`` pages keeps its first ``K_max``).

    Parameters
    ----------
    selection : int32 ``[B, Hkv, W]``; block_table : int32/int64 ``[B, P_max]``, unit
    stride on ``P_max``

    Returns
    -------
    int32 ``[B, Hkv, K_max]`` in position order, -1 padded.
    """
    check_tensor("selection", selection, 3, (torch.int32,))
    check_tensor("block_table", block_table, 2, INDEX_DTYPES)
    b, hkv, w = selection.shape
    num_pages = block_table.shape[1]
    require(block_table.shape[0] == b, f"block_table has {block_table.shape[0]} rows, batch is {b}")
    require(32 * w >= num_pages, f"selection has {w} words, too few for P_max={num_pages} pages")
    check_device(selection.device, block_table=block_table)
    require_runnable(selection.device)
    out = torch.empty((b, hkv, k_max), dtype=torch.int32, device=selection.device)
    if out.numel() == 0:
        return out
    _resident_slot_list_kernel[(b * hkv,)](
        selection,
        block_table,
        out,
        hkv,
        num_pages,
        k_max,
        selection.stride(0),
        selection.stride(1),
        block_table.stride(0),
        BLOCK_P=max(32, min(1024, next_pow2(num_pages))),
        BLOCK_K=max(16, min(256, next_pow2(k_max))),
        num_warps=4,
    )
    return out
