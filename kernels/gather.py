"""Gather: copy missed records from the KV pool (pinned host memory) into hot-buffer slots."""

from __future__ import annotations

import torch


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
