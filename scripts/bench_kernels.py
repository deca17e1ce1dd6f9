"""Benchmark the decode kernels on a CUDA GPU; print a table and write JSON (``--out``).

Sections (``--sections``, comma-separated; all by default):

* ``ceilings`` — device copy (read + write, ``Tensor.copy_``) and pinned host -> device copy;
* ``attention`` — sparse decode attention at 32K/128K/256K contexts, top-k 2048 tokens,
  batch 1/8/32, 32 query / 8 KV heads, head_dim 128, bf16: time, bytes read, GB/s against
  the device-copy ceiling, speed-up over dense decode attention with torch SDPA on the full
  context (KV contiguous on the GPU); a small launch-shape sweep at 128K;
* ``resolve`` — resolve µs per layer at batch 8 and 32 against the sparse attention time of
  the same layer (target <= 10%);
* ``gather`` — GB/s for 16/32/64 KiB records from pinned host memory against the pinned
  ``cudaMemcpy`` ceiling (target >= 90%);
* ``gather_fp8`` — the same loads from an fp8 host pool (``kv_host_dtype=fp8``: e4m3
  records + one int8 exponent per row, dequantised to bf16 in the gather) against the
  bf16 gather, page sizes 16-128: link bytes per miss, µs, records/s and the speed-up;
* ``int4`` — W4A16 linear on the engine's ``Int4Weight`` (group 32, the GGUF Q4_0/Q4_1
  group): bf16 ``F.linear``, torch's ``_weight_int4pack_mm`` on ``Int4Linear``'s packing and
  the Triton ``group_int4_linear`` (default tiles and a small tile sweep) on SmolLM2-135M
  and 8B-class shapes;
* ``int4_decode`` — one layer's four linears of qwen2.5-7b and llama3.1-8b through the
  engine's ``Int4Linear`` regimes (tinygemm, Triton over the source weight, dequantise +
  GEMM) at decode batch sizes 1-48: where ``TRITON_MIN_ROWS`` belongs;
* ``int4_tune`` — the Triton W4A16 kernels' tile space on qwen2.5-7b's four decode linears,
  group 128 (``quantize_int4``) and 32 (GGUF blocks), decode rows 1-32: the tensor-core
  kernel (``kind="dot"``) and the float32 multiply-add one (``kind="gemv"``) over tiles and
  split-K, against tinygemm and the default ``q4_config``; µs, GB/s of weight bytes, the
  best config of each (linear, rows): where ``q4_config``'s choices come from;
* ``fused`` — the element-wise work of one decode layer around attention (everything but
  the linears, attention and the MLP activation), unfused (torch RMSNorm, residual adds,
  cos/sin + rotate-half, ``append_kv``) against fused (``kernels.rmsnorm.rms_norm`` with the
  residual add, ``kernels.rope_append.rope_append``), SmolLM2-135M and qwen2.5-7b shapes,
  batch 1/8/32, bf16: µs per layer in CUDA-graph replay and eager, kernels per layer.

Timing: CUDA events around CUDA-graph replays of ``inner`` calls (launch gaps removed),
after warm-up, median of ``reps``; inputs rotate over enough copies to exceed the L2 cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.bitmask import pack_bits  # noqa: E402
from kernels.gather import gather  # noqa: E402
from kernels.int4_matmul import (  # noqa: E402
    Q4Config,
    group_int4_linear,
    group_int4_linear_ref,
    q4_config,
)
from kernels.resolve import resolve  # noqa: E402
from kernels.sparse_attention import DecodeConfig, sparse_decode_attention  # noqa: E402

DEV = torch.device("cuda")
L2_BYTES = 64 << 20
HQ, HKV, D = 32, 8, 128
TOP_K_TOKENS = 2048
CONTEXTS = (32768, 131072, 262144)
BATCHES = (1, 8, 32)
SWEEP_CONTEXT = 131072
RESOLVE_BATCHES = (8, 32)
GATHER_POOL_BYTES = 2 << 30
CEILING_BYTES = 1 << 30


# --- timing --------------------------------------------------------------------------------


def time_us(
    calls: list[Callable[[], object]], reps: int = 30, repeat: int = 1, graph: bool = True
) -> float:
    """Median µs per call of ``calls`` (run in order, ``repeat`` times, per timed replay)."""
    seq = calls * repeat
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    run: Callable[[], object]
    if graph:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for fn in calls:
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for fn in seq:
                    fn()
            run = g.replay
        except Exception as err:  # noqa: BLE001 - fall back to eager launches
            print(f"  (graph capture failed: {err!r}; timing eager launches)", flush=True)
            torch.cuda.synchronize()
            graph = False
    if not graph:

        def run() -> None:
            for fn in seq:
                fn()

    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / len(seq))
    return statistics.median(times)


def copies_for(nbytes: int, cap: int = 32) -> int:
    """Input copies to rotate so that one pass exceeds ~4x the L2 cache."""
    return max(1, min(cap, math.ceil(4 * L2_BYTES / max(nbytes, 1))))


# --- ceilings --------------------------------------------------------------------------------


def bench_ceilings() -> dict:
    n = CEILING_BYTES
    src = torch.empty(n, dtype=torch.uint8, device=DEV).random_()
    dst = torch.empty_like(src)
    us = time_us([lambda: dst.copy_(src)], reps=20, graph=False)
    copy_gbps = 2 * n / us / 1e3
    host = torch.empty(CEILING_BYTES // 4, dtype=torch.uint8, pin_memory=True).fill_(0x5A)
    dev = torch.empty(host.shape, dtype=torch.uint8, device=DEV)
    us_h2d = time_us([lambda: dev.copy_(host, non_blocking=True)], reps=10, graph=False)
    return {
        "device_copy_gbps": copy_gbps,
        "device_copy_bytes": 2 * n,
        "h2d_pinned_gbps": host.numel() / us_h2d / 1e3,
        "h2d_pinned_bytes": host.numel(),
    }


# --- attention -------------------------------------------------------------------------------


def sparse_setup(b: int, ctx: int, s: int, gen: torch.Generator) -> dict:
    """One copy of the sparse-attention inputs: top-k 2048 tokens (sink page, 2 window pages,
    random others), records scattered over a hot buffer of ``B*Hkv*K`` slots."""
    p = ctx // s
    k = TOP_K_TOKENS // s
    seq_len = ctx - 17
    num_pages = -(-seq_len // s)
    mask = torch.zeros(b, HKV, p, dtype=torch.bool)
    mask[:, :, 0] = True
    mask[:, :, num_pages - 2 : num_pages] = True
    scores = torch.rand(b, HKV, num_pages - 3, generator=gen)
    mask[:, :, 1 : num_pages - 2].scatter_(-1, scores.topk(k - 3, dim=-1).indices, True)
    rows = b * HKV
    slots = torch.randperm(rows * k, generator=gen).view(b, HKV, k).int()
    return {
        "q": torch.randn(b, HQ, D, generator=gen).bfloat16().to(DEV),
        "kv_slots": torch.empty(rows * k, 2, s, D, dtype=torch.bfloat16, device=DEV).normal_(),
        "selection": pack_bits(mask).to(DEV),
        "slot_list": slots.to(DEV),
        "seq_lens": torch.full((b,), seq_len, dtype=torch.int32, device=DEV),
        "scale": D**-0.5,
    }


def sparse_bytes(b: int, s: int) -> int:
    """Bytes the sparse kernel must read: selected K/V records, q, slot lists, words; + out."""
    k = TOP_K_TOKENS // s
    return b * HKV * k * 2 * s * D * 2 + 2 * b * HQ * D * 2 + b * HKV * k * 4


def time_sparse(
    b: int, ctx: int, s: int, config: DecodeConfig | None, gen: torch.Generator
) -> float:
    sets = [sparse_setup(b, ctx, s, gen) for _ in range(copies_for(sparse_bytes(b, s)))]
    return time_us([lambda a=a: sparse_decode_attention(**a, config=config) for a in sets])


def time_dense(b: int, ctx: int) -> float:
    """Dense decode attention with torch SDPA over contiguous [B, Hkv, T, D] KV."""
    nbytes = 2 * b * HKV * ctx * D * 2
    sets = []
    for _ in range(copies_for(nbytes, cap=4)):
        kk = torch.empty(b, HKV, ctx, D, dtype=torch.bfloat16, device=DEV).normal_()
        vv = torch.empty_like(kk).normal_()
        q = torch.randn(b, HQ, 1, D, dtype=torch.bfloat16, device=DEV)
        sets.append((q, kk, vv))

    def call(q, kk, vv):
        return torch.nn.functional.scaled_dot_product_attention(
            q, kk, vv, scale=D**-0.5, enable_gqa=True
        )

    return time_us([lambda t=t: call(*t) for t in sets], reps=10)


SWEEP = [
    DecodeConfig(),
    DecodeConfig(tile_tokens=128),
    DecodeConfig(num_warps=8),
    DecodeConfig(num_stages=3),
    DecodeConfig(waves=4),
    DecodeConfig(tile_tokens=128, num_warps=8, num_stages=3),
]


def bench_attention(ceil_gbps: float, out: dict) -> None:
    gen = torch.Generator().manual_seed(0)
    s = 64
    sweep = out.setdefault("attention_sweep", [])
    best_cfg, best_score = DecodeConfig(), math.inf
    for b in BATCHES:
        for cfg in SWEEP:
            us = time_sparse(b, SWEEP_CONTEXT, s, cfg, gen)
            sweep.append({"batch": b, "config": cfg.__dict__, "us": us})
            print(f"  sweep b={b:2d} {cfg}: {us:.1f} us", flush=True)
    for cfg in SWEEP:
        score = sum(math.log(r["us"]) for r in sweep if r["config"] == cfg.__dict__)
        if score < best_score:
            best_cfg, best_score = cfg, score
    out["attention_best_config"] = best_cfg.__dict__
    rows = out.setdefault("attention", [])
    for ctx in CONTEXTS:
        for b in BATCHES:
            us = time_sparse(b, ctx, s, DecodeConfig(), gen)
            us_best = time_sparse(b, ctx, s, best_cfg, gen)
            nbytes = sparse_bytes(b, s)
            dense_us = time_dense(b, ctx)
            row = {
                "ctx": ctx,
                "batch": b,
                "page_size": s,
                "top_k_tokens": TOP_K_TOKENS,
                "sparse_us": us,
                "sparse_best_us": us_best,
                "bytes_read": nbytes,
                "gbps": nbytes / us_best / 1e3,
                "pct_of_copy_ceiling": 100 * nbytes / us_best / 1e3 / ceil_gbps,
                "dense_sdpa_us": dense_us,
                "dense_bytes": 2 * b * HKV * ctx * D * 2,
                "speedup_vs_dense": dense_us / us_best,
            }
            rows.append(row)
            print(
                f"  ctx={ctx // 1024:3d}K b={b:2d}: sparse {us:7.1f} us (best cfg {us_best:7.1f}), "
                f"{row['gbps']:6.0f} GB/s, dense {dense_us:8.1f} us, x{row['speedup_vs_dense']:.1f}",
                flush=True,
            )
            torch.cuda.empty_cache()


# --- resolve ---------------------------------------------------------------------------------


def resolve_setup(b: int, p: int, k: int, c: int, n_sel: int, gen: torch.Generator):
    """State plus ``n_sel`` selections that drift (~25% new pages per step), so misses happen."""
    rows = b * HKV
    slab_ids = torch.arange(rows, dtype=torch.int32).view(b, HKV).to(DEV)
    state = [
        torch.full((rows, p), -1, dtype=torch.int32, device=DEV),
        torch.full((rows * c,), -1, dtype=torch.int32, device=DEV),
        torch.full((rows * c,), -1, dtype=torch.int64, device=DEV),
    ]
    base = torch.rand(b, HKV, p, generator=gen)
    sels = []
    for _ in range(n_sel):
        base = torch.where(
            torch.rand(b, HKV, p, generator=gen) < 0.01, torch.rand(b, HKV, p, generator=gen), base
        )
        mask = torch.zeros(b, HKV, p, dtype=torch.bool)
        mask.scatter_(-1, base.topk(k, dim=-1).indices, True)
        sels.append(pack_bits(mask).to(DEV))
    return slab_ids, state, sels


def bench_resolve(out: dict) -> None:
    gen = torch.Generator().manual_seed(1)
    rows = out.setdefault("resolve", [])
    ctx = SWEEP_CONTEXT
    for s, c_factor in ((64, 2), (16, 2)):
        k = TOP_K_TOKENS // s
        c = c_factor * k
        p = ctx // s
        for b in RESOLVE_BATCHES:
            slab_ids, state, sels = resolve_setup(b, p, k, c, 8, gen)
            calls = [
                lambda sel=sel, st=state, sl=slab_ids, c=c, k=k: resolve(sel, sl, *st, 1, c, k)
                for sel in sels
            ]
            us = time_us(calls)
            for sel in sels:  # one more pass over the drifting selections, eagerly
                _, _, load_slots, hit = resolve(sel, slab_ids, *state, 2, c, k)
            misses = (load_slots >= 0).sum(-1).float().mean().item()
            attn = time_sparse(b, ctx, s, DecodeConfig(), gen)
            row = {
                "ctx": ctx,
                "batch": b,
                "page_size": s,
                "k_pages": k,
                "slots_per_slab": c,
                "resolve_us": us,
                "sparse_attention_us": attn,
                "ratio_pct": 100 * us / attn,
                "mean_hits": hit.float().mean().item(),
                "mean_misses": misses,
            }
            rows.append(row)
            print(
                f"  S={s} K={k} C={c} b={b:2d}: resolve {us:6.1f} us, attention {attn:6.1f} us ({row['ratio_pct']:.0f}%)",
                flush=True,
            )


# --- gather ----------------------------------------------------------------------------------


def bench_gather(ceilings: dict, out: dict) -> None:
    gen = torch.Generator().manual_seed(2)
    rows = out.setdefault("gather", [])
    pool_bytes = GATHER_POOL_BYTES
    host = torch.empty(pool_bytes, dtype=torch.uint8, pin_memory=True)
    noise = torch.empty(min(pool_bytes, 256 << 20), dtype=torch.uint8, device=DEV).random_()
    for off in range(0, pool_bytes, noise.numel()):
        host[off : off + noise.numel()].copy_(noise)
    del noise
    b = 8
    for s in (32, 64, 128):
        rec_bytes = 2 * s * D * 2
        p_pool = pool_bytes // (HKV * rec_bytes)
        pool = host.view(torch.bfloat16).view(p_pool, HKV, 2, s, D)
        p_max = p_pool // b
        k = min(32, p_max)
        block_table = (
            torch.randperm(p_pool, generator=gen)[: b * p_max].view(b, p_max).int().to(DEV)
        )
        slots = torch.empty(b * HKV * k, 2, s, D, dtype=torch.bfloat16, device=DEV)
        lists = []
        for _ in range(4):
            lp = torch.stack(
                [torch.randperm(p_max, generator=gen)[:k] for _ in range(b * HKV)]
            ).view(b, HKV, k)
            ls = torch.randperm(b * HKV * k, generator=gen).view(b, HKV, k)
            lists.append((lp.int().to(DEV), ls.int().to(DEV)))
        nbytes = b * HKV * k * rec_bytes
        us = time_us(
            [
                lambda lp=lp, ls=ls, p=pool, sl=slots, bt=block_table: gather(p, sl, bt, lp, ls)
                for lp, ls in lists
            ],
            reps=10,
        )
        # The same records through the copy engine, one tensor.copy_ per record.
        recs = [
            (int(block_table[0, int(lists[0][0][0, h, j])]), h)
            for h in range(HKV)
            for j in range(k)
        ]
        dst = slots[: len(recs)]
        t0 = torch.cuda.Event(enable_timing=True)
        t1 = torch.cuda.Event(enable_timing=True)
        t0.record()
        for i, (pp, h) in enumerate(recs):
            dst[i].copy_(pool[pp, h], non_blocking=True)
        t1.record()
        t1.synchronize()
        per_record_gbps = len(recs) * rec_bytes / (t0.elapsed_time(t1) * 1e3) / 1e3
        gbps = nbytes / us / 1e3
        row = {
            "record_kib": rec_bytes // 1024,
            "records": b * HKV * k,
            "us": us,
            "gbps": gbps,
            "pct_of_pinned_memcpy": 100 * gbps / ceilings["h2d_pinned_gbps"],
            "per_record_copy_gbps": per_record_gbps,
        }
        rows.append(row)
        print(
            f"  {rec_bytes // 1024:2d} KiB records: {gbps:5.1f} GB/s ({row['pct_of_pinned_memcpy']:.0f}% of "
            f"pinned memcpy), per-record copy_ {per_record_gbps:.1f} GB/s",
            flush=True,
        )


def bench_gather_fp8(out: dict) -> None:
    """bf16 vs fp8 host pages: one gather of ``b x Hkv x k`` random records per call."""
    from kernels.fp8_kv import FP8

    gen = torch.Generator().manual_seed(3)
    rows = out.setdefault("gather_fp8", [])
    b, k = 8, 32
    for s in (16, 32, 64, 128):
        bf16_rec = 2 * s * D * 2
        fp8_rec = 2 * s * (D + 1)
        p_pool = GATHER_POOL_BYTES // (HKV * bf16_rec)
        p_max = p_pool // b
        kk = min(k, p_max)
        # contents do not change the timing: the bf16 gather copies bytes; fp8 1.0 x 2**-3
        x = torch.zeros(p_pool, HKV, 2, s, D, dtype=torch.bfloat16, pin_memory=True)
        q = torch.empty(p_pool, HKV, 2, s, D, dtype=FP8, pin_memory=True)
        q.view(torch.uint8).fill_(0x38)
        e = torch.full((p_pool, HKV, 2, s), -3, dtype=torch.int8, pin_memory=True)
        block_table = (
            torch.randperm(p_pool, generator=gen)[: b * p_max].view(b, p_max).int().to(DEV)
        )
        slots = torch.empty(b * HKV * kk, 2, s, D, dtype=torch.bfloat16, device=DEV)
        lists = []
        for _ in range(4):
            lp = torch.stack(
                [torch.randperm(p_max, generator=gen)[:kk] for _ in range(b * HKV)]
            ).view(b, HKV, kk)
            ls = torch.randperm(b * HKV * kk, generator=gen).view(b, HKV, kk)
            lists.append((lp.int().to(DEV), ls.int().to(DEV)))
        n = b * HKV * kk
        us_bf16 = time_us(
            [
                lambda lp=lp, ls=ls, p=x, sl=slots, bt=block_table: gather(p, sl, bt, lp, ls)
                for lp, ls in lists
            ],
            reps=10,
        )
        us_fp8 = time_us(
            [
                lambda lp=lp, ls=ls, p=q, sl=slots, bt=block_table, sc=e: gather(
                    p, sl, bt, lp, ls, pool_scale=sc
                )
                for lp, ls in lists
            ],
            reps=10,
        )
        row = {
            "page_size": s,
            "records": n,
            "bf16_link_bytes_per_miss": bf16_rec,
            "fp8_link_bytes_per_miss": fp8_rec,
            "link_bytes_ratio": fp8_rec / bf16_rec,
            "bf16_us": us_bf16,
            "fp8_us": us_fp8,
            "bf16_link_gbps": n * bf16_rec / us_bf16 / 1e3,
            "fp8_link_gbps": n * fp8_rec / us_fp8 / 1e3,
            "speedup": us_bf16 / us_fp8,
        }
        rows.append(row)
        print(
            f"  S={s:3d}: bf16 {us_bf16:7.1f} us, fp8 {us_fp8:7.1f} us "
            f"(x{row['speedup']:.2f}; {fp8_rec} vs {bf16_rec} link bytes per miss)",
            flush=True,
        )
        x = q = e = None  # free the pinned pools before the next page size


# --- int4 ------------------------------------------------------------------------------------

TG = 64  # Int4Linear keeps tinygemm's packed copy (timed beside the Triton kernels)
INT4_SHAPES = [(576, 576), (1536, 576), (576, 1536), (4096, 4096), (14336, 4096), (4096, 14336)]
INT4_MS = [1, 8, 32, 256]
INT4_GROUP = 32


def q4_sweep(m: int, k: int, default: Q4Config) -> list[Q4Config]:
    bm = default.block_m
    cands = [default]
    for bn, bk, stages in ((32, 128, 4), (64, 256, 3), (128, 128, 3), (64, 64, 4)):
        if k % bk == 0:
            cands.append(Q4Config(bm, bn, bk, default.split_k, num_warps=4, num_stages=stages))
    if m >= 256:
        cands = [
            default,
            Q4Config(64, 128, 64, 1, 4, 3),
            Q4Config(128, 128, 64, 1, 8, 3),
            Q4Config(64, 64, 128, 1, 4, 4),
        ]
    return cands


def bench_int4(out: dict) -> None:
    """bf16 ``F.linear``, tinygemm and ``group_int4_linear`` over one ``Int4Weight`` (as
    ``quantize_int4`` makes it, group ``INT4_GROUP``) per shape, weights rotated over copies."""
    from engine.weights.quant import Int4Linear, Int4Weight, quantize_int4

    gen = torch.Generator(device=DEV).manual_seed(3)
    rows = out.setdefault("int4", [])
    for n, k in INT4_SHAPES:
        w = torch.randn(n, k, generator=gen, device=DEV) * 0.02
        w_bf16 = w.bfloat16()
        q = quantize_int4(w, group_size=INT4_GROUP)
        del w
        q_bytes = n * k // 2 + n * (k // INT4_GROUP) * 8
        n_q = copies_for(q_bytes)
        n_bf = copies_for(n * k * 2, cap=4)
        w_copies = [w_bf16] + [w_bf16.clone() for _ in range(n_bf - 1)]
        # Separate device copies (Int4Linear keeps a weight already on the device as it is).
        lins = [Int4Linear(q, None, DEV, torch.bfloat16, triton_min_rows=TG)] + [
            Int4Linear(
                Int4Weight(q.q.clone(), q.scale.clone(), q.offset.clone(), INT4_GROUP),
                None,
                DEV,
                torch.bfloat16,
                triton_min_rows=TG,
            )
            for _ in range(n_q - 1)
        ]
        del q
        src = lins[0].source
        for m in INT4_MS:
            x = torch.randn(m, k, generator=gen, device=DEV).bfloat16()
            ref = group_int4_linear_ref(x.float(), src.q, src.scale, src.offset, INT4_GROUP)
            row: dict = {"n": n, "k": k, "m": m, "group": INT4_GROUP, "weight_copies": n_q}
            row["bf16_us"] = time_us(
                [lambda w_=w_, x=x: torch.nn.functional.linear(x, w_) for w_ in w_copies]
            )

            def run_tinygemm(lin, x=x):
                return torch.ops.aten._weight_int4pack_mm(
                    x, lin.packed, lin.group_size, lin.scales_and_zeros
                )

            def run_triton(lin, x=x, config=None):
                s = lin.source
                return group_int4_linear(x, s.q, s.scale, s.offset, s.group_size, config=config)

            y = run_tinygemm(lins[0])
            row["tinygemm_rel_err"] = ((y.float() - ref).norm() / ref.norm()).item()
            row["tinygemm_us"] = time_us([lambda lin=lin: run_tinygemm(lin) for lin in lins])
            default = q4_config(m, n, k, DEV)
            y = run_triton(lins[0])
            row["triton_rel_err"] = ((y.float() - ref).norm() / ref.norm()).item()
            best = (math.inf, None)
            for cfg in q4_sweep(m, k, default):
                try:
                    calls = [lambda lin=lin, c=cfg: run_triton(lin, config=c) for lin in lins]
                    us = time_us(calls, reps=15)
                except Exception as err:  # noqa: BLE001
                    print(f"  config {cfg} failed: {err!r}", flush=True)
                    continue
                if cfg == default:
                    row["triton_us"] = us
                if us < best[0]:
                    best = (us, cfg)
            row["triton_best_us"] = best[0]
            row["triton_best_config"] = best[1].__dict__ if best[1] else None
            rows.append(row)
            print(
                f"  N={n:5d} K={k:5d} M={m:3d}: bf16 {row['bf16_us']:7.1f} us | tinygemm "
                f"{row['tinygemm_us']:7.1f} us (err {row['tinygemm_rel_err']:.1e}) | triton "
                f"{row.get('triton_us', float('nan')):7.1f} best {best[0]:7.1f} us "
                f"(err {row['triton_rel_err']:.1e})",
                flush=True,
            )
        del w_copies, lins, src
        torch.cuda.empty_cache()


# --- report ----------------------------------------------------------------------------------


def print_tables(res: dict) -> None:
    c = res.get("ceilings", {})
    if c:
        print(
            f"\nceilings: device copy {c['device_copy_gbps']:.0f} GB/s, pinned H2D {c['h2d_pinned_gbps']:.1f} GB/s"
        )
    if res.get("attention"):
        print("\nsparse attention (bf16, 32/8 heads, D=128, S=64, top-k 2048 tokens)")
        print("ctx    B   sparse_us  best_us   MB_read   GB/s  %copy  dense_us  speedup")
        for r in res["attention"]:
            print(
                f"{r['ctx'] // 1024:4d}K {r['batch']:3d} {r['sparse_us']:9.1f} {r['sparse_best_us']:8.1f} "
                f"{r['bytes_read'] / 1e6:8.1f} {r['gbps']:6.0f} {r['pct_of_copy_ceiling']:5.0f}% "
                f"{r['dense_sdpa_us']:9.1f} {r['speedup_vs_dense']:7.1f}x"
            )
        print(f"best launch shape: {res.get('attention_best_config')}")
    if res.get("resolve"):
        print("\nresolve per layer (128K context)")
        print("S   K    C    B   resolve_us  attention_us  ratio")
        for r in res["resolve"]:
            print(
                f"{r['page_size']:<3d} {r['k_pages']:<4d} {r['slots_per_slab']:<4d} {r['batch']:<3d} "
                f"{r['resolve_us']:10.1f} {r['sparse_attention_us']:13.1f} {r['ratio_pct']:5.0f}%"
            )
    if res.get("gather"):
        print("\ngather from pinned host")
        print("record  records   us      GB/s   %memcpy  per-record copy_ GB/s")
        for r in res["gather"]:
            print(
                f"{r['record_kib']:3d}KiB {r['records']:7d} {r['us']:8.1f} {r['gbps']:7.1f} "
                f"{r['pct_of_pinned_memcpy']:7.0f}% {r['per_record_copy_gbps']:10.1f}"
            )
    if res.get("gather_fp8"):
        print("\ngather from pinned host: bf16 vs fp8 records (dequantised to bf16)")
        print("S    records  B/miss bf16  B/miss fp8  bf16_us   fp8_us  speed-up  fp8 GB/s")
        for r in res["gather_fp8"]:
            print(
                f"{r['page_size']:<4d} {r['records']:7d} {r['bf16_link_bytes_per_miss']:11d} "
                f"{r['fp8_link_bytes_per_miss']:11d} {r['bf16_us']:8.1f} {r['fp8_us']:8.1f} "
                f"{r['speedup']:8.2f} {r['fp8_link_gbps']:9.1f}"
            )
    if res.get("int4"):
        print("\nW4A16 linear (µs, group 32; Triton best = best of a small tile sweep)")
        print("    N     K    M   bf16  tinygemm    triton  tri_best")
        for r in res["int4"]:
            print(
                f"{r['n']:5d} {r['k']:5d} {r['m']:4d} {r['bf16_us']:6.1f} {r['tinygemm_us']:9.1f} "
                f"{r.get('triton_us', float('nan')):9.1f} {r['triton_best_us']:9.1f}"
            )
    if res.get("int4_decode"):
        print("\nW4A16 per layer (4 linears, group 128; µs) — engine Int4Linear regimes")
        print("model          M  tinygemm   triton  dequant+gemm  best")
        for r in res["int4_decode"]:
            print(
                f"{r['model']:12s} {r['m']:3d} {r['tinygemm_us']:9.1f} {r['triton_us']:8.1f} "
                f"{r['dequant_gemm_us']:13.1f}  {r['best']}"
            )
    if res.get("fused"):
        print("\none decode layer's norms, residual adds, RoPE, append (bf16; µs per layer)")
        print("model          B  unfused_graph  fused_graph  speedup  unfused_eager  fused_eager  kernels  exact")
        for r in res["fused"]:
            print(
                f"{r['model']:12s} {r['batch']:3d} {r['unfused_graph_us']:14.1f} {r['fused_graph_us']:12.1f} "
                f"{r['graph_speedup']:7.1f}x {r['unfused_eager_us']:14.1f} {r['fused_eager_us']:12.1f} "
                f"{r['unfused_kernels']:4d}->{r['fused_kernels']:<3d} {r['q_k_h_bit_identical']}"
            )


# --- int4 for decode batches (the engine's Int4Linear) ----------------------------------------

# (N, K) of a layer's four linears: fused QKV, output, fused gate/up, down.
DECODE_LAYERS = {
    "qwen2.5-7b": [(3584 + 2 * 512, 3584), (3584, 3584), (2 * 18944, 3584), (3584, 18944)],
    "llama3.1-8b": [(4096 + 2 * 1024, 4096), (4096, 4096), (2 * 14336, 4096), (4096, 14336)],
}
DECODE_MS = [1, 4, 8, 12, 16, 24, 32, 48]


def bench_int4_decode(out: dict) -> None:
    """One layer's four linears of a real shape through :class:`engine.weights.quant.Int4Linear`
    (group-128 weights as ``quantize_int4`` makes them) in each regime, forced: tinygemm,
    the Triton dequant-matmul over the source (``group_int4_linear``) and dequantise +
    dense GEMM, at decode batch sizes ``DECODE_MS``."""
    from engine.weights.quant import Int4Linear, quantize_int4
    from kernels.int4_matmul import group_int4_linear

    gen = torch.Generator(device=DEV).manual_seed(5)
    rows = out.setdefault("int4_decode", [])
    for model, shapes in DECODE_LAYERS.items():
        lins = []
        for n, k in shapes:
            w = quantize_int4(torch.randn(n, k, generator=gen, device=DEV) * 0.02)
            lins.append(Int4Linear(w, None, torch.device(DEV), torch.bfloat16, triton_min_rows=TG))
        hidden = shapes[1][1]
        for m in DECODE_MS:
            xs = [torch.randn(m, k, generator=gen, device=DEV).bfloat16() for _, k in shapes]
            tg = [
                lambda lin=lin, x=x: torch.ops.aten._weight_int4pack_mm(
                    x, lin.packed, lin.group_size, lin.scales_and_zeros
                )
                for lin, x in zip(lins, xs, strict=True)
            ]
            tri = [
                lambda s=lin.source, x=x: group_int4_linear(x, s.q, s.scale, s.offset, s.group_size)
                for lin, x in zip(lins, xs, strict=True)
            ]
            deq = [
                lambda s=lin.source, x=x: torch.nn.functional.linear(
                    x, s.dequantize(torch.bfloat16)
                )
                for lin, x in zip(lins, xs, strict=True)
            ]
            ref = [x.float() @ lin.source.dequantize().T for lin, x in zip(lins, xs, strict=True)]
            err = max(
                ((f().float() - r).norm() / r.norm()).item() for f, r in zip(tri, ref, strict=True)
            )
            row = {
                "model": model,
                "hidden": hidden,
                "m": m,
                "tinygemm_us": time_us(tg, reps=20),
                "triton_us": time_us(tri, reps=20),
                "dequant_gemm_us": time_us(deq, reps=10),
                "triton_rel_err": err,
            }
            row["best"] = min(("tinygemm", "triton", "dequant_gemm"), key=lambda c: row[f"{c}_us"])
            rows.append(row)
            print(
                f"  {model} M={m:3d}: tinygemm {row['tinygemm_us']:7.1f} | triton "
                f"{row['triton_us']:7.1f} | dequant+gemm {row['dequant_gemm_us']:7.1f} us/layer",
                flush=True,
            )
        del lins
        torch.cuda.empty_cache()


TUNE_MS = [1, 2, 4, 8, 16, 32]
TUNE_GROUPS = [128, 32]


def _tune_tiles(m: int) -> list[Q4Config]:
    """Tile candidates (split-K left to phase two): the gemv kernel up to 8 rows (one M
    tile of ``next_pow2(m)`` rows), the dot kernel from 4 rows."""
    cands = []
    if m <= 8:
        bm = next_pow2_int(m)
        for bn in (32, 64):
            for bk in (256, 512):
                for warps in (4, 8):
                    cands.append(Q4Config(bm, bn, bk, 1, warps, 3, kind="gemv"))
    if m >= 4:
        bm = 16 if m <= 16 else 32
        for bn in (64, 128):
            for bk in (128, 256):
                for warps in (4, 8):
                    cands.append(Q4Config(bm, bn, bk, 1, warps, 3 if bk == 256 else 4))
    return cands


def next_pow2_int(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def bench_int4_tune(out: dict) -> None:
    """Phase one: every tile of :func:`_tune_tiles` with the split-K that gives about two
    programs per SM; phase two: the best three tiles at split-K 1/2/4/8/16. Weight bytes:
    nibbles plus the float32 scale and offset per group."""
    from engine.weights.quant import Int4Linear, Int4Weight, quantize_int4

    gen = torch.Generator(device=DEV).manual_seed(11)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    rows = out.setdefault("int4_tune", [])
    shapes = DECODE_LAYERS["qwen2.5-7b"]
    for group in TUNE_GROUPS:
        for n, k in shapes:
            q = quantize_int4(torch.randn(n, k, generator=gen, device=DEV) * 0.02, group_size=group)
            nbytes = n * k // 2 + n * (k // group) * 8
            copies = [q] + [
                Int4Weight(q.q.clone(), q.scale.clone(), q.offset.clone(), group)
                for _ in range(copies_for(nbytes, cap=8) - 1)
            ]
            lin = Int4Linear(q, None, DEV, torch.bfloat16, triton_min_rows=TG)
            for m in TUNE_MS:
                x = torch.randn(m, k, generator=gen, device=DEV).bfloat16()
                ref = group_int4_linear_ref(x.float(), q.q, q.scale, q.offset, group)

                def timed(cfg):
                    y = group_int4_linear(x, q.q, q.scale, q.offset, group, config=cfg)
                    err = ((y.float() - ref).norm() / ref.norm()).item()
                    if not err < 1e-2:
                        raise AssertionError(f"{cfg}: relative error {err:.3g}")
                    calls = [
                        lambda w=w: group_int4_linear(x, w.q, w.scale, w.offset, group, config=cfg)
                        for w in copies
                    ]
                    return time_us(calls, reps=10)

                def fill_split(cfg):
                    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
                    return max(1, min(k // cfg.block_k, 16, (2 * sms) // max(tiles, 1)))

                row = {"n": n, "k": k, "m": m, "group": group, "weight_bytes": nbytes}
                row["tinygemm_us"] = time_us(
                    [lambda: torch.ops.aten._weight_int4pack_mm(
                        x, lin.packed, group, lin.scales_and_zeros)],
                    reps=10,
                ) if m < 64 else None
                row["default_us"] = timed(q4_config(m, n, k, DEV))
                row["default_config"] = q4_config(m, n, k, DEV).__dict__
                phase1 = []
                for cfg in _tune_tiles(m):
                    cfg = dataclasses.replace(cfg, split_k=fill_split(cfg))
                    try:
                        phase1.append((timed(cfg), cfg))
                    except Exception as err:  # noqa: BLE001 - a tile that does not compile
                        print(f"  {cfg}: {err!r}"[:300], flush=True)
                phase1.sort(key=lambda t: t[0])
                trials = list(phase1)
                for _, cfg in phase1[:3]:
                    for split in (1, 2, 4, 8, 16):
                        if split != cfg.split_k and split <= k // cfg.block_k:
                            c2 = dataclasses.replace(cfg, split_k=split)
                            trials.append((timed(c2), c2))
                best = {}
                for us, cfg in trials:
                    if cfg.kind not in best or us < best[cfg.kind][0]:
                        best[cfg.kind] = (us, cfg)
                for kind, (us, cfg) in best.items():
                    row[f"best_{kind}_us"] = us
                    row[f"best_{kind}_config"] = cfg.__dict__
                row["best_gbps"] = nbytes / min(us for us, _ in best.values()) / 1e3
                rows.append(row)
                print(
                    f"  g{group} N={n:5d} K={k:5d} M={m:2d}: tinygemm {row['tinygemm_us'] or 0:6.1f} "
                    f"default {row['default_us']:6.1f} "
                    + " ".join(f"{kd} {us:6.1f} ({c.block_m},{c.block_n},{c.block_k},s{c.split_k},"
                               f"w{c.num_warps})" for kd, (us, c) in best.items())
                    + f" = {row['best_gbps']:5.0f} GB/s",
                    flush=True,
                )
            del copies, lin, q
            torch.cuda.empty_cache()


# --- fused norm / RoPE + append (one decode layer's ops around attention) -------------------

FUSED_SHAPES = {  # model: (hidden, q heads, kv heads, head dim, rope theta)
    "smollm2-135m": (576, 9, 3, 64, 100000.0),
    "qwen2.5-7b": (3584, 28, 4, 128, 1000000.0),
}
FUSED_BATCHES = (1, 8, 32)


def _count_kernels(calls: list[Callable[[], object]]) -> int:
    """CUDA kernels launched by one pass over ``calls`` (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for fn in calls:
            fn()
        torch.cuda.synchronize()
    return sum(
        1 for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
    )


def bench_fused(out: dict) -> None:
    """One decode layer's norms, residual adds, RoPE and append, unfused vs fused.

    Unfused is what :class:`engine.model.llama.LlamaModel` ran before the fusion:
    ``rms_norm`` (torch ops), ``Rope.cos_sin`` + ``apply_rope`` on q and k, Triton
    ``append_kv``, ``h + o`` then ``rms_norm``, ``h + mlp``. Fused: ``rms_norm`` (Triton),
    ``rope_append``, ``rms_norm`` with the residual, ``h + mlp``. Results are checked to
    agree (bf16 rounding) before timing."""
    from engine.model.llama import rms_norm as torch_rms_norm
    from engine.model.rope import Rope, apply_rope
    from kernels.append_kv import append_kv
    from kernels.rmsnorm import rms_norm
    from kernels.rope_append import RopeParams, rope_append

    gen = torch.Generator(device=DEV).manual_seed(9)
    rows = out.setdefault("fused", [])
    s, p_max = 64, 8
    for model, (hidden, hq, hkv, d, theta) in FUSED_SHAPES.items():
        rope = Rope(d, theta)
        params = RopeParams(rope.inv_freq.to(DEV))
        w1, w2 = (torch.rand(hidden, device=DEV, generator=gen) + 0.5 for _ in range(2))
        for b in FUSED_BATCHES:
            h = torch.randn(b, hidden, device=DEV, generator=gen).bfloat16()
            o, mlp = (torch.randn(b, hidden, device=DEV, generator=gen).bfloat16() for _ in range(2))
            qkv = torch.randn(b, (hq + 2 * hkv) * d, device=DEV, generator=gen).bfloat16()
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q, k, v = q.view(b, hq, d), k.view(b, hkv, d), v.view(b, hkv, d)
            pos = torch.randint(s, p_max * s, (b,), device=DEV, generator=gen)
            table = torch.randperm(b * p_max, device=DEV, generator=gen).view(b, p_max).int()
            pools = [torch.zeros(b * p_max, hkv, 2, s, d, device=DEV).bfloat16() for _ in range(2)]
            metas = [torch.zeros(b * p_max, hkv, 2, d, device=DEV).bfloat16() for _ in range(2)]

            t = dict(h=h, o=o, mlp=mlp, q=q, k=k, v=v, pos=pos, table=table, w1=w1, w2=w2)

            def unfused(t=t, pool=pools[0], meta=metas[0], rope=rope):
                torch_rms_norm(t["h"], t["w1"], 1e-5)
                cos, sin = rope.cos_sin(t["pos"], t["h"].dtype)
                qr, kr = apply_rope(t["q"], cos, sin), apply_rope(t["k"], cos, sin)
                append_kv(kr, t["v"], t["pos"], t["table"], pool, meta)
                h2 = t["h"] + t["o"]
                torch_rms_norm(h2, t["w2"], 1e-5)
                return qr, kr, h2 + t["mlp"]

            def fused(t=t, pool=pools[1], meta=metas[1], params=params):
                rms_norm(t["h"], t["w1"], 1e-5)
                qr, kr = rope_append(
                    t["q"], t["k"], t["v"], t["pos"], params, t["table"], pool, meta
                )
                _, h2 = rms_norm(t["o"], t["w2"], 1e-5, t["h"])
                return qr, kr, h2 + t["mlp"]

            ref, got = unfused(), fused()
            err = max(max_abs_diff(a, c) for a, c in zip(ref, got, strict=True))
            exact = all(torch.equal(a, c) for a, c in zip(ref, got, strict=True))
            row = {
                "model": model,
                "batch": b,
                "unfused_graph_us": time_us([unfused], reps=30, repeat=20),
                "fused_graph_us": time_us([fused], reps=30, repeat=20),
                "unfused_eager_us": time_us([unfused], reps=30, repeat=20, graph=False),
                "fused_eager_us": time_us([fused], reps=30, repeat=20, graph=False),
                "unfused_kernels": _count_kernels([unfused]),
                "fused_kernels": _count_kernels([fused]),
                "max_abs_diff": err,
                "q_k_h_bit_identical": exact,
            }
            row["graph_speedup"] = row["unfused_graph_us"] / row["fused_graph_us"]
            rows.append(row)
            print(
                f"  {model} B={b:2d}: unfused {row['unfused_graph_us']:6.1f} us "
                f"({row['unfused_kernels']} kernels) | fused {row['fused_graph_us']:6.1f} us "
                f"({row['fused_kernels']} kernels) per layer, graph replay",
                flush=True,
            )


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write results as JSON here")
    parser.add_argument(
        "--sections", default="ceilings,attention,resolve,gather,gather_fp8,int4,int4_decode,fused"
    )
    parser.add_argument(
        "--tune-rows",
        default=",".join(map(str, TUNE_MS)),
        help="int4_tune: the decode row counts to sweep (comma list)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    res: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.date.today().isoformat(),
        "errors": {},
    }
    sections = args.sections.split(",")
    TUNE_MS[:] = [int(v) for v in args.tune_rows.split(",")]

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps(res, indent=1))

    t0 = time.time()
    res["ceilings"] = bench_ceilings()
    save()
    for name in sections:
        if name == "ceilings":
            continue
        print(f"[{time.time() - t0:6.1f} s] {name}", flush=True)
        try:
            if name == "attention":
                bench_attention(res["ceilings"]["device_copy_gbps"], res)
            elif name == "resolve":
                bench_resolve(res)
            elif name == "gather":
                bench_gather(res["ceilings"], res)
            elif name == "gather_fp8":
                bench_gather_fp8(res)
            elif name == "int4":
                bench_int4(res)
            elif name == "int4_decode":
                bench_int4_decode(res)
            elif name == "int4_tune":
                bench_int4_tune(res)
            elif name == "fused":
                bench_fused(res)
            else:
                raise ValueError(f"unknown section {name}")
        except Exception:  # noqa: BLE001 - keep the other sections
            res["errors"][name] = traceback.format_exc()
            print(res["errors"][name], flush=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        save()
    res["wall_s"] = time.time() - t0
    save()
    print_tables(res)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
