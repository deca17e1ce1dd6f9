"""Select per decode step on a GPU: exact flat Quest against the two-level superpage index
(issue 20), at the real model's shape; checks the Triton kernels against the references
first.

For each model shape (``--shapes``: the embedded SmolLM2-135M, 30 layers x 9 query / 3 KV
heads x D 64, and qwen2.5-7b, 28 x 28 / 4 x 128) at ``--context`` tokens x ``--jobs``
jobs, page 16, top_k 2048 tokens, sink 16 and window 64 tokens, ``normmax``:

1. **check** — on a smaller batch with integer-valued metadata and queries (every fp32
   bound exact): :func:`kernels.superpage_select.superpage_select` equals
   :func:`~kernels.superpage_select.superpage_select_ref` bit for bit (selection and the
   refreshed superpage rows), and replays from a CUDA graph with the same result;
2. **time** — one layer's select, replayed from a CUDA graph (median of 30), times the
   layers = select per step: exact (``quest_scores`` + ``select_topk``) and superpage at
   each ``--variants`` entry (superpage pages x oversample, e.g. ``16x8``, ``8x8``);
   metadata bytes read per step (bf16) and their share of the KV;
3. **kernels** (``--profile``) — the same layer's select run eagerly under
   ``torch.profiler``: device µs per kernel (mean of 20 calls), the breakdown of each
   variant's time.

The metadata is random (timing does not depend on the values; the fidelity of the
selection is measured on the real model by ``scripts/measure_superpage.py``).

Usage (one H200, < 2 min)::

    python scripts/bench_superpage.py --out superpage_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import time_us  # noqa: E402

import kernels.superpage_select as superpage_module  # noqa: E402
from kernels.quest_scores import quest_scores  # noqa: E402
from kernels.select_topk import select_topk  # noqa: E402
from kernels.superpage_select import (  # noqa: E402
    num_candidates,
    superpage_select,
    superpage_select_ref,
)

DEV = torch.device("cuda")
SHAPES = {  # layers, Hq, Hkv, D
    "smollm2-135m": (30, 9, 3, 64),
    "qwen2.5-7b": (28, 28, 4, 128),
}
PAGE, TOP_K, SINK, WINDOW = 16, 2048, 16, 64


def make_step(
    b: int, hq: int, hkv: int, d: int, ctx: int, integer: bool, seed: int, sp: int
) -> dict:
    """One layer's selection inputs for ``b`` jobs of ``ctx`` tokens, pool pages shuffled,
    superpages of ``sp`` pages (``ctx // PAGE`` a multiple of ``sp``)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    p = ctx // PAGE
    n_pool = b * p
    if integer:
        meta = torch.randint(-8, 8, (n_pool, hkv, 2, d), generator=gen, device=DEV) / 4
        q = torch.randint(-4, 4, (b, hq, d), generator=gen, device=DEV) / 2
    else:
        meta = torch.randn(n_pool, hkv, 2, d, generator=gen, device=DEV)
        q = torch.randn(b, hq, d, generator=gen, device=DEV)
    meta = meta.sort(dim=2).values.to(torch.bfloat16)
    q = q.to(torch.bfloat16)
    block_table = torch.randperm(n_pool, generator=gen, device=DEV).view(b, p).int()
    num_pages = torch.full((b,), p, dtype=torch.int32, device=DEV)
    spn = -(-p // sp)
    rows = meta[block_table.long()].view(b, spn, sp, hkv, 2, d)
    super_meta = torch.stack([rows[..., 0, :].amin(2), rows[..., 1, :].amax(2)], dim=-2).view(
        b * spn, hkv, 2, d
    )  # row of superpage j of job i: i * spn + j
    page_super = torch.full((n_pool,), -1, dtype=torch.int32, device=DEV)
    page_super[block_table[:, ::sp].long()] = torch.arange(
        b * spn, device=DEV, dtype=torch.int32
    ).view(b, spn)
    return dict(q=q, meta=meta, super_meta=super_meta, page_super=page_super,
                block_table=block_table, num_pages=num_pages)  # fmt: skip


def run_superpage(
    t: dict, sp: int, c: int, ref: bool = False, combine: str = "normmax", ranking: str = "fused"
) -> torch.Tensor:
    """One layer's superpage select; ``ranking="topk"`` takes the ``torch.topk`` path the
    kernels keep for rows past ``FUSED_SORT_MAX`` (the path before the fused kernels)."""
    fn = superpage_select_ref if ref else superpage_select
    saved = superpage_module.FUSED_SORT_MAX
    superpage_module.FUSED_SORT_MAX = 0 if ranking == "topk" else saved
    try:
        return fn(
            t["q"], t["meta"], t["super_meta"], t["page_super"], t["block_table"],
            t["num_pages"], TOP_K // PAGE, SINK // PAGE, WINDOW // PAGE, sp, c, combine, None,
        )  # fmt: skip
    finally:
        superpage_module.FUSED_SORT_MAX = saved


def run_exact(t: dict) -> torch.Tensor:
    scores = quest_scores(t["q"], t["meta"], t["block_table"], t["num_pages"], "normmax")
    return select_topk(scores, t["num_pages"], TOP_K // PAGE, SINK // PAGE, WINDOW // PAGE)


def check(
    hq: int, hkv: int, d: int, ctx: int, variants: list[tuple[int, float]], rankings: list[str]
) -> dict:
    """Triton == reference (and graph replay == eager) on 4 jobs of ``ctx``, exact inputs,
    the ``max`` rule (exact sums: bit for bit); ``normmax`` reported as the share of
    (job, KV head) rows equal (the GPU's exp/log round differently)."""
    out = {}
    for (sp, o), r in [(v, r) for v in variants for r in rankings]:
        c = num_candidates(TOP_K // PAGE, sp, o)
        t = make_step(4, hq, hkv, d, ctx, integer=True, seed=1, sp=sp)
        t_ref = {**t, "super_meta": t["super_meta"].clone()}
        eager = run_superpage(t, sp, c, combine="max", ranking=r)
        want = run_superpage(t_ref, sp, c, ref=True, combine="max")
        norm = run_superpage(t, sp, c, ranking=r) == run_superpage(t_ref, sp, c, ref=True)
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run_superpage(t, sp, c, combine="max", ranking=r)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            captured = run_superpage(t, sp, c, combine="max", ranking=r)
        graph.replay()
        torch.cuda.synchronize()
        name = variant_name(sp, o, r)
        out[name] = {
            "triton_equals_reference": bool(torch.equal(eager, want)),
            "refreshed_rows_equal": bool(torch.equal(t["super_meta"], t_ref["super_meta"])),
            "graph_equals_eager": bool(torch.equal(captured, eager)),
        }
        out[name]["normmax_rows_equal_share"] = norm.all(-1).float().mean().item()
    return out


def meta_bytes(b: int, hkv: int, d: int, rows_per_head: int) -> int:
    return b * hkv * rows_per_head * 2 * d * 2


def kernel_breakdown(fn, calls: int = 20) -> dict[str, float]:
    """Device µs per call of each CUDA kernel ``fn`` launches (``torch.profiler``, eager,
    mean over ``calls`` calls after a warm-up), largest first."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None)
        if us is None:  # torch < 2.4 names it cuda_time_total
            us = ev.cuda_time_total
        if us > 0 and ev.device_type.name == "CUDA":
            totals[ev.key[:60]] = totals.get(ev.key[:60], 0.0) + us / calls
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def variant_name(sp: int, oversample: float, ranking: str) -> str:
    return f"{sp}x{oversample:g}" + ("" if ranking == "fused" else f" {ranking}")


def bench_shape(
    name: str,
    ctx: int,
    jobs: int,
    variants: list[tuple[int, float]],
    rankings: list[str],
    prof: bool = False,
) -> dict:
    layers, hq, hkv, d = SHAPES[name]
    p = ctx // PAGE
    kv_layer = jobs * hkv * p * 2 * PAGE * d * 2
    checked = check(hq, hkv, d, 8192, variants, rankings)
    res = {"layers": layers, "hq": hq, "hkv": hkv, "d": d, "check": checked}
    steps = {
        sp: make_step(jobs, hq, hkv, d, ctx, integer=False, seed=2, sp=sp) for sp, _ in variants
    }
    t0 = next(iter(steps.values()))  # the page metadata and queries are the same for every sp
    rows = {"exact": (lambda: run_exact(t0), p)}
    for (sp, o), r in [(v, r) for v in variants for r in rankings]:
        c = num_candidates(TOP_K // PAGE, sp, o)
        key = "superpage " + variant_name(sp, o, r)
        rows[key] = (
            lambda t=steps[sp], sp=sp, c=c, r=r: run_superpage(t, sp, c, ranking=r),
            -(-p // sp) + c * sp + sp,
        )
    for key, (fn, rows_per_head) in rows.items():
        us = time_us([fn])
        nbytes = meta_bytes(jobs, hkv, d, rows_per_head)
        res[key] = {
            "us_per_layer": us,
            "ms_per_step": us * layers / 1e3,
            "meta_bytes_per_step": nbytes * layers,
            "kv_over_meta": kv_layer / nbytes,
            "meta_gbps": nbytes / us / 1e3,
        }
        if prof:
            res[key]["kernels_us_per_layer"] = kernel_breakdown(fn)
    base = res["exact"]["ms_per_step"]
    for key in rows:
        res[key]["vs_exact"] = res[key]["ms_per_step"] / base
    return res


def parse_variants(text: str) -> list[tuple[int, float]]:
    """``"16x8,8x8"`` -> ``[(16, 8.0), (8, 8.0)]`` (superpage pages x oversample)."""
    out = []
    for item in text.split(","):
        sp, _, o = item.strip().partition("x")
        out.append((int(sp), float(o)))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--jobs", type=int, default=32)
    p.add_argument(
        "--variants",
        default="16x2,16x4,16x8",
        help="superpage pages x oversample, comma-separated (the engine's superpage_pages, "
        "superpage_oversample)",
    )
    p.add_argument("--shapes", default="smollm2-135m,qwen2.5-7b")
    p.add_argument("--profile", action="store_true", help="also list each variant's kernels")
    p.add_argument(
        "--rankings",
        default="fused,topk",
        help="superpage ranking paths to time: fused (rows sorted in one program), topk "
        "(torch.topk and separate kernels, the path for rows past FUSED_SORT_MAX)",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    try:
        variants = parse_variants(args.variants)
    except ValueError:
        p.error(f"--variants: SxO items such as 16x8,8x8, not {args.variants!r}")
    rankings = args.rankings.split(",")
    if not set(rankings) <= {"fused", "topk"}:
        p.error(f"--rankings: fused and/or topk, not {args.rankings!r}")
    out = {
        "what": "select per decode step: exact Quest vs superpage (issue 20)",
        "context": args.context,
        "jobs": args.jobs,
        "page_size": PAGE,
        "variants": args.variants,
        "top_k_tokens": TOP_K,
        "device": torch.cuda.get_device_name(DEV),
        "torch": torch.__version__,
        "machine": platform.node(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "shapes": {},
    }
    for name in args.shapes.split(","):
        res = bench_shape(name, args.context, args.jobs, variants, rankings, args.profile)
        out["shapes"][name] = res
        print(f"{name}: {args.jobs} jobs x {args.context} tokens, {res['layers']} layers")
        print(f"  check: {res['check']}")
        print(
            f"  {'variant':<22}{'ms/step':>9}{'vs exact':>10}{'MiB/step':>10}{'KV/x':>7}{'GB/s':>8}"
        )
        for key, r in res.items():
            if isinstance(r, dict) and "ms_per_step" in r:
                print(
                    f"  {key:<22}{r['ms_per_step']:>9.3f}{r['vs_exact']:>10.2f}"
                    f"{r['meta_bytes_per_step'] / 2**20:>10.1f}{r['kv_over_meta']:>7.0f}"
                    f"{r['meta_gbps']:>8.0f}"
                )
        for key, r in res.items():
            if isinstance(r, dict) and "kernels_us_per_layer" in r:
                k = r["kernels_us_per_layer"]
                print(f"  {key}: {sum(k.values()):.1f} us of kernels a layer, {len(k)} kinds")
                for kname, us in k.items():
                    print(f"    {us:8.2f} us  {kname}")
    ok = all(
        v["triton_equals_reference"] and v["refreshed_rows_equal"] and v["graph_equals_eager"]
        and v["normmax_rows_equal_share"] >= 0.99
        for s in out["shapes"].values()
        for v in s["check"].values()
    )  # fmt: skip
    print("kernels check:", "PASS" if ok else "FAIL")
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
