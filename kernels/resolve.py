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

:func:`resolve` is the Triton version: one launch per layer, one program per
(request, KV head) row, no host synchronisation (CUDA-graph safe). Each program sorts its
slab's packed ``(last_use, slot)`` keys (selected slots sort last; a bitonic sort,
O(C log² C) in the slots per slab C, where the first version counted smaller keys,
O(C²), and cost 2.8 ms a step at C = 384), lists the selected pages in position order
from per-word popcounts of the selection, and resolves the ``K_max`` listed pages at
once: a prefix sum over misses gives each miss its victim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import (
    INDEX_DTYPES,
    check_device,
    check_shape,
    check_tensor,
    next_pow2,
    require,
    require_runnable,
)
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
    hits_acc: torch.Tensor | None = None,
    misses_acc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Resolve one layer's selections for the whole batch, updating state in place.

    Parameters
    ----------
    selection : int32 ``[B, Hkv, W]`` bitmask of selected pages
    slab_ids : int32 ``[B, Hkv]`` slab owned by each (request, KV head) in this layer
    page_table : int32 ``[num_slabs, P_max]`` page -> slot (global in the layer) or -1;
        updated in place. Selected pages must be ``< P_max``; ``32*W`` may be smaller
        or larger than ``P_max``.
    slot_page : int32 ``[N]`` page held by each slot or -1; updated in place
    slot_last_use : int64 ``[N]`` last step each slot was used, -1 if never; in place
    step : current decode step (monotonic)
    slots_per_slab : C
    k_max : K_max >= pages selected in any row, <= C
    hits_acc, misses_acc : optional int64 ``[B]`` step counters: each request's hits and
        misses of this call (summed over its KV heads) are added in place, so a decode
        step counts its cache traffic without extra reductions per layer

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
    p_bits = selection.shape[-1] * 32
    c = slots_per_slab
    dev = selection.device
    slabs = slab_ids.reshape(-1).long()  # [R]
    sel_mask = unpack_bits(selection.reshape(b * hkv, -1), p_bits)  # [R, 32*W]
    pages = selected_pages(selection.reshape(b * hkv, -1), p_bits, k_max).long()  # [R, K]
    valid = pages >= 0
    cur = torch.gather(page_table[slabs].long(), 1, pages.clamp(min=0))
    hit = valid & (cur >= 0)
    miss = valid & (cur < 0)

    own = slabs[:, None] * c + torch.arange(c, device=dev)[None, :]  # [R, C]
    own_page = slot_page[own].long()
    in_range = (own_page >= 0) & (own_page < p_bits)
    own_selected = in_range & torch.gather(sel_mask, 1, own_page.clamp(0, p_bits - 1))
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
    hits = hit.sum(-1).view(b, hkv).to(torch.int32)
    if hits_acc is not None and misses_acc is not None:
        hits_acc += hits.sum(-1)
        misses_acc += miss.view(b, -1).sum(-1)
    return (
        slot_list.view(shape).to(torch.int32),
        load_pages.view(shape).to(torch.int32),
        load_slots.view(shape).to(torch.int32),
        hits,
    )


@triton.jit(do_not_specialize=["step"])
def _resolve_kernel(
    sel_ptr,
    slab_ids_ptr,
    page_table_ptr,
    slot_page_ptr,
    slot_last_use_ptr,
    step_ptr,
    step,
    slot_list_ptr,
    load_pages_ptr,
    load_slots_ptr,
    hits_ptr,
    hits_acc_ptr,
    misses_acc_ptr,
    ws_ptr,
    keys_ptr,
    num_kv_heads,
    num_pages,
    num_words,
    slots_per_slab,
    k_max,
    stride_sel_b,
    stride_sel_h,
    stride_slab_b,
    stride_slab_h,
    stride_pt_slab,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STEP_FROM_PTR: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    """One (request, KV head) row: hits, LRU refresh, victims, page-table update, lists.

    Outputs ``slot_list``, ``load_pages``, ``load_slots`` are contiguous ``[R, K_max]``.
    Workspaces: ``ws`` int32 ``[R, K_max]`` (selected pages in position order), ``keys``
    int64 ``[R, BLOCK_C]`` (the slab's keys in eviction order).

    1. Eviction order: each slot's key packs ``(last_use, slot)``; selected slots (and
       padding) get keys above every free slot. The sorted keys are stored: the key of
       rank ``r`` names the ``r``-th victim (its slot is the key modulo ``BLOCK_C``).
    2. Selected pages: per selection word its popcount, their prefix sum over words and
       the prefix count within the word give page ``p`` its position ``j``; ``ws[0, j] = p``.
    3. Over the ``K_max`` positions: page-table lookup (hit or miss), a prefix sum over
       misses gives each miss its victim rank; then every state update and output store.
    """
    row = tl.program_id(0)
    b = row // num_kv_heads
    h = row % num_kv_heads
    if STEP_FROM_PTR:
        step = tl.load(step_ptr)
    step = step.to(tl.int64)
    sel_row = sel_ptr + b * stride_sel_b + h * stride_sel_h
    slab = tl.load(slab_ids_ptr + b * stride_slab_b + h * stride_slab_h).to(tl.int64)
    pt_row = page_table_ptr + slab * stride_pt_slab
    first_slot = slab * slots_per_slab
    out_row = row.to(tl.int64) * k_max
    ws_pages = ws_ptr + out_row
    keys_row = keys_ptr + row.to(tl.int64) * BLOCK_C

    # 1. Keys of the slab's slots: (last_use, slot) for free slots, above them the rest.
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < slots_per_slab
    own_page = tl.load(slot_page_ptr + first_slot + offs_c, mask=mask_c, other=-1)
    last_use = tl.load(slot_last_use_ptr + first_slot + offs_c, mask=mask_c, other=0)
    has_page = own_page >= 0
    page_c = tl.where(has_page, own_page, 0)
    # Pages past the selection's words (32 * W may be < P_max) count as unselected.
    in_sel = mask_c & has_page & (page_c < num_words * 32)
    word_c = tl.load(sel_row + page_c // 32, mask=in_sel, other=0)
    free = mask_c & ~(has_page & (((word_c >> (page_c % 32)) & 1) != 0))
    key = tl.where(free, (last_use.to(tl.int64) + 1) * BLOCK_C, 1 << 62) + offs_c
    tl.store(keys_row + offs_c, tl.sort(key))

    # 2. Selected pages in position order, from per-word popcounts.
    offs_bit = tl.arange(0, 32)
    n_sel = tl.full([], 0, tl.int32)
    for w0 in range(0, num_words, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        words = tl.load(sel_row + offs_w, mask=offs_w < num_words, other=0)
        page = offs_w[:, None] * 32 + offs_bit[None, :]
        bits = tl.where(page < num_pages, (words[:, None] >> offs_bit[None, :]) & 1, 0)
        count = tl.sum(bits, axis=1)
        j = (n_sel + tl.cumsum(count, axis=0) - count)[:, None] + tl.cumsum(bits, axis=1) - bits
        tl.store(ws_pages + j, page, mask=(bits != 0) & (j < k_max))
        n_sel += tl.sum(count, axis=0)
    tl.debug_barrier()

    # 3. Hits and misses over the K_max positions; state updates; outputs.
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < tl.minimum(n_sel, k_max)
    page_k = tl.load(ws_pages + offs_k, mask=mask_k, other=0)
    cur = tl.load(pt_row + page_k, mask=mask_k, other=-1)
    hit = mask_k & (cur >= 0)
    miss = mask_k & (cur < 0)
    miss_i = miss.to(tl.int32)
    rank = tl.cumsum(miss_i, axis=0) - miss_i
    victim_key = tl.load(keys_row + rank, mask=miss, other=0)
    victim = tl.where(miss, first_slot + victim_key % BLOCK_C, -1).to(tl.int32)
    old = tl.load(slot_page_ptr + victim, mask=miss, other=-1)
    # Every thread's loads of the state (a BLOCK_K element can live in several threads)
    # before any thread's stores: without it a copy of a victim could read its new page.
    tl.debug_barrier()
    tl.store(pt_row + old, tl.full([BLOCK_K], -1, tl.int32), mask=miss & (old >= 0))
    tl.store(pt_row + page_k, victim, mask=miss)
    tl.store(slot_page_ptr + victim, page_k, mask=miss)
    steps = tl.zeros([BLOCK_K], tl.int64) + step
    tl.store(slot_last_use_ptr + victim, steps, mask=miss)
    tl.store(slot_last_use_ptr + cur, steps, mask=hit)
    mask_out = offs_k < k_max
    tl.store(slot_list_ptr + out_row + offs_k, tl.where(hit, cur, victim), mask=mask_out)
    tl.store(load_pages_ptr + out_row + offs_k, tl.where(miss, page_k, -1), mask=mask_out)
    tl.store(load_slots_ptr + out_row + offs_k, tl.where(miss, victim, -1), mask=mask_out)
    num_hits = tl.sum(hit.to(tl.int32), axis=0)
    tl.store(hits_ptr + row, num_hits)
    if ACCUMULATE:  # the step's per-request counters (integer adds: order-free)
        tl.atomic_add(hits_acc_ptr + b, num_hits.to(tl.int64))
        tl.atomic_add(misses_acc_ptr + b, tl.sum(miss_i, axis=0).to(tl.int64))


def resolve(
    selection: torch.Tensor,
    slab_ids: torch.Tensor,
    page_table: torch.Tensor,
    slot_page: torch.Tensor,
    slot_last_use: torch.Tensor,
    step: int | torch.Tensor,
    slots_per_slab: int,
    k_max: int,
    hits_acc: torch.Tensor | None = None,
    misses_acc: torch.Tensor | None = None,
    *,
    block_words: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton :func:`resolve_ref`: one launch, bit-identical outputs and state updates.

    Parameters
    ----------
    selection : int32 ``[B, Hkv, W]`` (unit stride on ``W``)
    slab_ids : int32/int64 ``[B, Hkv]``; distinct rows own distinct slabs
    page_table : int32 ``[num_slabs, P_max]``, contiguous rows; in place
    slot_page : int32 ``[N]`` contiguous; in place
    slot_last_use : int64 ``[N]`` contiguous; in place
    step : the decode step, a Python int or an int64 device tensor of one element (the
        latter lets a captured CUDA graph replay with a new step)
    slots_per_slab : C (up to a few thousand; ~256 is the design point)
    k_max : K_max, ``<= C``
    hits_acc, misses_acc : optional int64 ``[B]`` counters, contiguous; this call's hits and
        misses per request are added in place (atomics in the same launch)
    block_words, num_warps : launch shape (selection words per loop iteration, 64 by
        default; warps, 4 by default)

    Returns
    -------
    slot_list, load_pages, load_slots : int32 ``[B, Hkv, K_max]``; hits : int32 ``[B, Hkv]``.
    A row selecting more than ``K_max`` pages (the reference raises) keeps its first
    ``K_max`` pages in the lists.
    """
    require(k_max <= slots_per_slab, f"k_max={k_max} exceeds slots_per_slab={slots_per_slab}")
    check_tensor("selection", selection, 3, (torch.int32,))
    check_tensor("slab_ids", slab_ids, 2, INDEX_DTYPES, unit_last=False)
    check_tensor("page_table", page_table, 2, (torch.int32,))
    check_tensor("slot_page", slot_page, 1, (torch.int32,))
    check_tensor("slot_last_use", slot_last_use, 1, (torch.int64,))
    b, hkv, w = selection.shape
    num_pages = page_table.shape[1]
    check_shape("slab_ids", slab_ids, (b, hkv))
    check_shape("slot_last_use", slot_last_use, tuple(slot_page.shape))
    step_ptr = slot_last_use
    step_from_ptr = isinstance(step, torch.Tensor)
    if step_from_ptr:
        require(step.numel() == 1 and step.dtype == torch.int64, "a tensor step must be one int64")
        step_ptr, step = step, 0
    dev = selection.device
    check_device(dev, slab_ids=slab_ids, page_table=page_table, slot_page=slot_page)
    check_device(dev, slot_last_use=slot_last_use, step=step_ptr)
    accumulate = hits_acc is not None and misses_acc is not None
    if accumulate:
        check_tensor("hits_acc", hits_acc, 1, (torch.int64,))
        check_tensor("misses_acc", misses_acc, 1, (torch.int64,))
        check_shape("hits_acc", hits_acc, (b,))
        check_shape("misses_acc", misses_acc, (b,))
        check_device(dev, hits_acc=hits_acc, misses_acc=misses_acc)
    require_runnable(dev)

    shape = (b, hkv, k_max)
    slot_list = torch.empty(shape, dtype=torch.int32, device=dev)
    load_pages = torch.empty(shape, dtype=torch.int32, device=dev)
    load_slots = torch.empty(shape, dtype=torch.int32, device=dev)
    hits = torch.empty((b, hkv), dtype=torch.int32, device=dev)
    if b * hkv == 0:
        return slot_list, load_pages, load_slots, hits
    block_c = max(16, next_pow2(slots_per_slab))
    ws = torch.empty((b * hkv, k_max), dtype=torch.int32, device=dev)
    keys = torch.empty((b * hkv, block_c), dtype=torch.int64, device=dev)
    _resolve_kernel[(b * hkv,)](
        selection,
        slab_ids,
        page_table,
        slot_page,
        slot_last_use,
        step_ptr,
        step,
        slot_list,
        load_pages,
        load_slots,
        hits,
        hits_acc if accumulate else hits,
        misses_acc if accumulate else hits,
        ws,
        keys,
        hkv,
        num_pages,
        w,
        slots_per_slab,
        k_max,
        selection.stride(0),
        selection.stride(1),
        slab_ids.stride(0),
        slab_ids.stride(1),
        page_table.stride(0),
        BLOCK_C=block_c,
        BLOCK_W=max(1, min(block_words or 64, next_pow2(w))),
        BLOCK_K=max(16, next_pow2(k_max)),
        STEP_FROM_PTR=step_from_ptr,
        ACCUMULATE=accumulate,
        num_warps=num_warps or 4,
    )
    return slot_list, load_pages, load_slots, hits
