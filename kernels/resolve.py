"""Resolve: selection + page table + LRU state -> hits, victims, load list, slot list.

HiSparse (DESIGN.md) decouples logical availability from physical residency: each
(request, layer, KV head) owns one *slab* of ``C`` record slots in the hot buffer; slab
``s`` is slots ``s*C .. s*C + C - 1`` of the layer's slot array.

Semantics (the reference below is normative; the Triton kernel must match it exactly):

* a selected page with ``page_table[slab, page] >= 0`` is a **hit**; its slot's last-use
  step is refreshed to ``step``;
* every other selected page is a **miss**; misses, in ascending page order, take the
  slab's unselected slots in order of (last-use step, slot index) ascending — empty
  slots have last-use -1 and go first. A page selected in this step is never evicted;
* the victim's old page (if any) is unmapped, the miss is mapped, the slot's page and
  last-use are set;
* outputs list, per selection in page-position order, the slot of each selected page
  (``slot_list``) and the misses to copy (``load_pages`` -> ``load_slots``).

It requires ``K_max <= C`` (device_buffer >= top_k), which guarantees enough unselected
slots for every miss.
"""

from __future__ import annotations

import torch

from kernels.bitmask import selected_pages, unpack_bits


def resolve_ref(
    selection: torch.Tensor,
    slab_ids: torch.Tensor,
    page_table: torch.Tensor,
    slot_page: torch.Tensor,
    slot_last_use: torch.Tensor,
    step: int,
    slots_per_slab: int,
    k_max: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Resolve one layer's selections for the whole batch, updating state in place.

    Parameters
    ----------
    selection : int32 ``[B, Hkv, W]`` bitmask of selected pages
    slab_ids : int32 ``[B, Hkv]`` slab owned by each (request, KV head) in this layer
    page_table : int32 ``[num_slabs, P_max]`` page -> slot (global in the layer) or -1;
        updated in place. ``P_max`` is the page-axis width of ``selection`` (``32*W``
        may exceed it; bits past ``P_max`` must be zero).
    slot_page : int32 ``[N]`` page held by each slot or -1; updated in place
    slot_last_use : int64 ``[N]`` last step each slot was used, -1 if never; in place
    step : current decode step (monotonic)
    slots_per_slab : C
    k_max : K_max >= pages selected in any row, <= C

    Returns
    -------
    slot_list : int32 ``[B, Hkv, K_max]`` slot of each selected page, position order, -1 pad
    load_pages : int32 ``[B, Hkv, K_max]`` page to load for each miss, -1 elsewhere
    load_slots : int32 ``[B, Hkv, K_max]`` destination slot of each miss, -1 elsewhere
    hits : int32 ``[B, Hkv]`` selected pages already resident
    (misses are ``(load_slots >= 0).sum(-1)``.)
    """
    if k_max > slots_per_slab:
        raise ValueError(f"k_max={k_max} exceeds slots_per_slab={slots_per_slab}")
    b, hkv, _ = selection.shape
    p_max = page_table.shape[1]
    c = slots_per_slab
    dev = selection.device
    slabs = slab_ids.reshape(-1).long()  # [R]
    sel_mask = unpack_bits(selection.reshape(b * hkv, -1), p_max)  # [R, P_max]
    pages = selected_pages(selection.reshape(b * hkv, -1), p_max, k_max).long()  # [R, K]
    valid = pages >= 0
    cur = torch.gather(page_table[slabs].long(), 1, pages.clamp(min=0))
    hit = valid & (cur >= 0)
    miss = valid & (cur < 0)

    own = slabs[:, None] * c + torch.arange(c, device=dev)[None, :]  # [R, C]
    own_page = slot_page[own].long()
    own_selected = (own_page >= 0) & torch.gather(sel_mask, 1, own_page.clamp(min=0))
    big = torch.iinfo(torch.int64).max
    key = torch.where(own_selected, torch.full_like(own_page, big), slot_last_use[own].long())
    victims = torch.gather(own, 1, torch.sort(key, dim=1, stable=True).indices)  # [R, C]
    rank = (torch.cumsum(miss.long(), dim=1) - 1).clamp(min=0)
    victim = torch.gather(victims, 1, rank.clamp(max=c - 1))

    # Hits: refresh.
    slot_last_use[cur[hit]] = step
    # Misses: unmap the victims' old pages, map the new ones.
    v = victim[miss]
    rows = torch.nonzero(miss, as_tuple=True)[0]
    old = slot_page[v].long()
    had = old >= 0
    page_table[slabs[rows][had], old[had]] = -1
    page_table[slabs[rows], pages[miss]] = v.to(page_table.dtype)
    slot_page[v] = pages[miss].to(slot_page.dtype)
    slot_last_use[v] = step

    neg = torch.full_like(pages, -1)
    slot_list = torch.where(hit, cur, torch.where(miss, victim, neg))
    load_pages = torch.where(miss, pages, neg)
    load_slots = torch.where(miss, victim, neg)
    shape = (b, hkv, k_max)
    return (
        slot_list.view(shape).to(torch.int32),
        load_pages.view(shape).to(torch.int32),
        load_slots.view(shape).to(torch.int32),
        hit.sum(-1).view(b, hkv).to(torch.int32),
    )


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
