"""Append one token's K/V per request: write-through to the pool and the resident tail
page, and update the page metadata (element-wise key min/max)."""

from __future__ import annotations

import torch


def append_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    kv_pool: torch.Tensor,
    meta: torch.Tensor,
    kv_slots: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    slab_ids: torch.Tensor | None = None,
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
        and max, later tokens widen them
    kv_slots, page_table, slab_ids : hot buffer ``[N, 2, S, D]``, ``[num_slabs, P_max]``
        and ``[B, Hkv]``; when given, a resident tail page receives the token too
        (write-through), so it is never stale
    """
    b, hkv, _ = k.shape
    s = kv_pool.shape[3]
    pos = positions.long().to(block_table.device)
    page = pos // s
    off = pos % s
    pool_page = block_table.long()[torch.arange(b, device=block_table.device), page]
    pp, off_p = pool_page.to(kv_pool.device), off.to(kv_pool.device)
    kv_pool[pp, :, 0, off_p] = k.to(kv_pool.device, kv_pool.dtype)
    kv_pool[pp, :, 1, off_p] = v.to(kv_pool.device, kv_pool.dtype)
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
        kv_slots[slot[res], 0, off[bi]] = k[bi, hi].to(kv_slots.dtype)
        kv_slots[slot[res], 1, off[bi]] = v[bi, hi].to(kv_slots.dtype)
