"""The resolve kernel at issue 16's shape (B = 32 jobs, Hkv = 3, C = 256 or 384 slots a
slab, K = 64 pages selected of P = 4096, 30 layers a step, ~1 % of pages new each step):
GPU time per launch of :func:`kernels.resolve.resolve` at 1/2/4/8 warps, and of a variant
kept only here that finds a row's few victims by repeated minimum over the slab's keys
instead of sorting them (the sort kept above ``sort_above`` misses). The variant is checked
against :func:`kernels.resolve.resolve_ref` (outputs and state, bit for bit) before it is
timed. Launches are timed inside one CUDA graph of 30 resolves, less a graph of the
selection copy alone. Measured on an H100 (2026-12-07): the variant saves 0.4 us of
7.1 us a launch at C = 256, so the engine keeps the sort (docs/performance.md).

    python scripts/measure_resolve_victims.py     # CUDA only; prints one line a setting
"""

import sys
import time

import torch
import triton
import triton.language as tl

from kernels._launch import next_pow2
from kernels.bitmask import pack_bits
from kernels.resolve import resolve, resolve_ref

BIG = (1 << 63) - 1


@triton.jit(do_not_specialize=["step"])
def _resolve_min_kernel(
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
    SORT_ABOVE: tl.constexpr,
):
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

    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < slots_per_slab
    own_page = tl.load(slot_page_ptr + first_slot + offs_c, mask=mask_c, other=-1)
    last_use = tl.load(slot_last_use_ptr + first_slot + offs_c, mask=mask_c, other=0)
    has_page = own_page >= 0
    page_c = tl.where(has_page, own_page, 0)
    in_sel = mask_c & has_page & (page_c < num_words * 32)
    word_c = tl.load(sel_row + page_c // 32, mask=in_sel, other=0)
    free = mask_c & ~(has_page & (((word_c >> (page_c % 32)) & 1) != 0))
    key = tl.where(free, (last_use.to(tl.int64) + 1) * BLOCK_C, 1 << 62) + offs_c

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

    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < tl.minimum(n_sel, k_max)
    page_k = tl.load(ws_pages + offs_k, mask=mask_k, other=0)
    cur = tl.load(pt_row + page_k, mask=mask_k, other=-1)
    hit = mask_k & (cur >= 0)
    miss = mask_k & (cur < 0)
    miss_i = miss.to(tl.int32)
    rank = tl.cumsum(miss_i, axis=0) - miss_i
    n_miss = tl.sum(miss_i, axis=0)
    victim_key = tl.zeros([BLOCK_K], tl.int64)
    if n_miss > SORT_ABOVE:
        tl.store(keys_row + offs_c, tl.sort(key))
        tl.debug_barrier()
        victim_key = tl.load(keys_row + rank, mask=miss, other=0)
    else:
        for r in range(0, n_miss):
            kmin = tl.min(key, axis=0)
            victim_key = tl.where(rank == r, kmin, victim_key)
            key = tl.where(key == kmin, 0x7FFFFFFFFFFFFFFF, key)
    victim = tl.where(miss, first_slot + victim_key % BLOCK_C, -1).to(tl.int32)
    old = tl.load(slot_page_ptr + victim, mask=miss, other=-1)
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
    if ACCUMULATE:
        tl.atomic_add(hits_acc_ptr + b, num_hits.to(tl.int64))
        tl.atomic_add(misses_acc_ptr + b, n_miss.to(tl.int64))


def resolve_min(
    selection,
    slab_ids,
    page_table,
    slot_page,
    slot_last_use,
    step,
    c,
    k_max,
    hits_acc=None,
    misses_acc=None,
    num_warps=4,
    sort_above=8,
):
    b, hkv, w = selection.shape
    dev = selection.device
    shape = (b, hkv, k_max)
    slot_list = torch.empty(shape, dtype=torch.int32, device=dev)
    load_pages = torch.empty(shape, dtype=torch.int32, device=dev)
    load_slots = torch.empty(shape, dtype=torch.int32, device=dev)
    hits = torch.empty((b, hkv), dtype=torch.int32, device=dev)
    step_from_ptr = isinstance(step, torch.Tensor)
    step_ptr, step_v = (step, 0) if step_from_ptr else (slot_last_use, step)
    block_c = max(16, next_pow2(c))
    ws = torch.empty((b * hkv, k_max), dtype=torch.int32, device=dev)
    keys = torch.empty((b * hkv, block_c), dtype=torch.int64, device=dev)
    acc = hits_acc is not None
    _resolve_min_kernel[(b * hkv,)](
        selection,
        slab_ids,
        page_table,
        slot_page,
        slot_last_use,
        step_ptr,
        step_v,
        slot_list,
        load_pages,
        load_slots,
        hits,
        hits_acc if acc else hits,
        misses_acc if acc else hits,
        ws,
        keys,
        hkv,
        page_table.shape[1],
        w,
        c,
        k_max,
        selection.stride(0),
        selection.stride(1),
        slab_ids.stride(0),
        slab_ids.stride(1),
        page_table.stride(0),
        BLOCK_C=block_c,
        BLOCK_W=max(1, min(64, next_pow2(w))),
        BLOCK_K=max(16, next_pow2(k_max)),
        STEP_FROM_PTR=step_from_ptr,
        ACCUMULATE=acc,
        SORT_ABOVE=sort_above,
        num_warps=num_warps,
    )
    return slot_list, load_pages, load_slots, hits


def make_bank(steps, layers, b, hkv, p, k, churn, gen):
    """Selections [steps, layers, b, hkv, W]: k pages a row, `churn` replaced a step."""
    out = []
    cur = torch.stack([torch.randperm(p, generator=gen)[:k] for _ in range(layers * b * hkv)])
    for _ in range(steps):
        mask = torch.zeros(layers * b * hkv, p, dtype=torch.bool)
        mask.scatter_(1, cur, True)
        out.append(pack_bits(mask).view(layers, b, hkv, -1))
        for r in range(cur.shape[0]):
            n = int(torch.poisson(torch.tensor(float(churn)), generator=gen))
            if n:
                idx = torch.randperm(k, generator=gen)[:n]
                fresh = torch.randperm(p, generator=gen)[: 4 * n]
                fresh = fresh[~torch.isin(fresh, cur[r])][:n]
                cur[r, idx[: len(fresh)]] = fresh
    return torch.stack(out)


def state(layers, b, hkv, c, p, dev):
    n = b * hkv * c
    return [
        (
            torch.full((b * hkv, p), -1, dtype=torch.int32, device=dev),
            torch.full((n,), -1, dtype=torch.int32, device=dev),
            torch.full((n,), -1, dtype=torch.int64, device=dev),
        )
        for _ in range(layers)
    ]


def check(dev):
    gen = torch.Generator().manual_seed(1)
    for b, hkv, c, p, k, churn in [
        (4, 3, 256, 4096, 64, 2.0),
        (3, 2, 100, 700, 40, 12.0),
        (2, 1, 64, 200, 64, 30.0),
    ]:
        bank = make_bank(20, 1, b, hkv, p, k, churn, gen).to(dev)
        sa, sb = state(1, b, hkv, c, p, dev)[0], state(1, b, hkv, c, p, dev)[0]
        slabs = torch.arange(b * hkv, dtype=torch.int32, device=dev).view(b, hkv)
        for s in range(20):
            sel = bank[s, 0].contiguous()
            ra = resolve_ref(sel, slabs, *sa, s, c, k)
            rb = resolve_min(sel, slabs, *sb, s, c, k, sort_above=8)
            for x, y in zip(ra, rb, strict=True):
                assert torch.equal(x.cpu(), y.cpu()), (b, hkv, c, s)
            for x, y in zip(sa, sb, strict=True):
                assert torch.equal(x.cpu(), y.cpu()), (b, hkv, c, s, "state")
    print("variant == resolve_ref: ok")


def timed(fn_name, fn, layers, b, hkv, c, p, k, bank, dev, reps=100):
    st = state(layers, b, hkv, c, p, dev)
    slabs = torch.arange(b * hkv, dtype=torch.int32, device=dev).view(b, hkv)
    step = torch.zeros(1, dtype=torch.int64, device=dev)
    sel = torch.empty_like(bank[0])
    acc_h = torch.zeros(b, dtype=torch.int64, device=dev)
    acc_m = torch.zeros(b, dtype=torch.int64, device=dev)

    def body(run):
        sel.copy_(bank.index_select(0, step % bank.shape[0]).squeeze(0))
        if run:
            for layer in range(layers):
                fn(sel[layer], slabs, *st[layer], step, c, k, acc_h, acc_m)
        step.add_(1)

    res = {}
    for run in (False, True):
        for _ in range(3):
            body(run)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body(run)
        for _ in range(10):
            g.replay()
        acc_h.zero_(), acc_m.zero_()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        res[run] = e0.elapsed_time(e1) / reps
    hits, misses = int(acc_h.sum()), int(acc_m.sum())
    per = (res[True] - res[False]) / layers * 1000
    print(
        f"{fn_name:28s} step {res[True]:.3f} ms (copy only {res[False]:.3f}) "
        f"resolve {per:.2f} us/launch  hit {hits / max(1, hits + misses):.3f}",
        flush=True,
    )
    return per


def main():
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    check(dev)
    gen = torch.Generator().manual_seed(0)
    layers, b, hkv, p, k = 30, 32, 3, 4096, 64
    t0 = time.time()
    bank = make_bank(48, layers, b, hkv, p, k, 2.0, gen).to(dev)
    print(f"bank built in {time.time() - t0:.1f}s", flush=True)
    out = {}
    for c in (256, 384):
        for w in (1, 2, 4, 8):
            out[f"sort C={c} warps={w}"] = timed(
                f"sort C={c} warps={w}",
                lambda *a, w=w: resolve(*a[:8], hits_acc=a[8], misses_acc=a[9], num_warps=w),
                layers,
                b,
                hkv,
                c,
                p,
                k,
                bank,
                dev,
            )
        for w in (1, 2, 4):
            for sa in (8, 16):
                out[f"min C={c} warps={w} sort>{sa}"] = timed(
                    f"min C={c} warps={w} sort>{sa}",
                    lambda *a, w=w, sa=sa: resolve_min(*a, num_warps=w, sort_above=sa),
                    layers,
                    b,
                    hkv,
                    c,
                    p,
                    k,
                    bank,
                    dev,
                )
    # heavy churn: many misses a row (the first steps after admission)
    bank_h = make_bank(12, layers, b, hkv, p, k, 20.0, gen).to(dev)
    for name, fn in [
        ("sort heavy w4", lambda *a: resolve(*a[:8], hits_acc=a[8], misses_acc=a[9])),
        ("min heavy w4", lambda *a: resolve_min(*a, num_warps=4)),
    ]:
        timed(name, fn, layers, b, hkv, 256, p, k, bank_h, dev)


if __name__ == "__main__":
    sys.exit(main())
