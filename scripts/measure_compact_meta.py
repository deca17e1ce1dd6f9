"""Compact Quest page metadata: would int8 bounds select the same pages? (issue 20, part 2)

A measurement, not an engine mode: it decodes greedily with the exact metadata (flat
``kv_dtype`` key min/max, the default and reference) and, at every decode step, layer and
KV head, also scores the pages from an int8 copy of that metadata and selects from it:

* **int8**: per (layer, page, KV head) one fp32 scale ``s = max(|kmin|, |kmax|) / 127`` over
  the ``D`` dims, ``kmin`` rounded down and ``kmax`` up to multiples of ``s``
  (``floor``/``ceil``, then nudged one step outward where the fp32 product came back
  inside), so the dequantised pair still bounds every key of the page and Quest's score
  stays an upper bound. Bytes per (layer, page, KV head): ``2 D + 4`` against ``2 D b_kv``.

Reported: the share of (step, layer, KV head) whose int8 selection differs from the exact
one, the mean share of selected pages that differ, that every int8 pair bounds the exact
pair, and the metadata bytes a decode step reads per job (all pages of all layers) next to
the KV bytes, for the model's shape and for bf16 metadata. CPU, the embedded model by
default. Prints a table and writes JSON.

Usage::

    OMP_NUM_THREADS=1 python scripts/measure_compact_meta.py --tokens 2048 --steps 16 \
        --out docs/bench/compact_meta_cpu.json
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

from engine.config import EngineConfig, SamplingParams  # noqa: E402
from engine.events import Job  # noqa: E402
from engine.load import load_engine  # noqa: E402
from engine.measure.bench_kv import corpus_dir  # noqa: E402
from kernels.bitmask import unpack_bits  # noqa: E402


def int8_bounds(meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``meta [P, Hkv, 2, D]`` (key min, max) as int8 ``[P, Hkv, 2, D]`` and fp32 scales
    ``[P, Hkv]``, min rounded down and max up (see the module docstring)."""
    m = meta.float()
    amax = m.abs().amax((2, 3)).clamp_min(torch.finfo(torch.float32).tiny)
    scale = amax / 127
    scale = torch.where(127 * scale < amax, torch.nextafter(scale, amax), scale)  # 127 s >= amax
    s = scale[:, :, None]
    lo = torch.floor(m[:, :, 0] / s)
    hi = torch.ceil(m[:, :, 1] / s)
    lo = torch.where(lo * s > m[:, :, 0], lo - 1, lo)  # fp32 rounding came back inside
    hi = torch.where(hi * s < m[:, :, 1], hi + 1, hi)
    # |k| <= amax <= 127 s, so lo >= -128 and clamping hi to 127 keeps 127 s >= kmax
    q = torch.stack([lo, hi], dim=2).clamp(-128, 127).to(torch.int8)
    return q, scale


def dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 ``[P, Hkv, 2, D]`` and ``[P, Hkv]`` back to fp32 bounds."""
    return q.float() * scale[:, :, None, None]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus", type=Path, default=corpus_dir())
    p.add_argument("--doc", default="library-re.txt")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--top-k", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    cfg = EngineConfig(
        hierarchical=False,
        host_pool_gb=0.5,
        max_batch=1,
        page_size=args.page_size,
        top_k=args.top_k,
        sink_tokens=16,
        local_window=32,
    )
    engine = load_engine(cfg, args.model)
    attn, cache = engine.attn, engine.cache
    stats = {"rows": 0, "rows_differ": 0, "pages_sel": 0, "pages_differ": 0, "bound_ok": True}
    select = attn.select

    def both(plan, layer, q, scores=None):
        exact = select(plan, layer, q, scores)
        meta = cache.meta[layer]
        q8, sc = int8_bounds(meta)
        deq = dequant(q8, sc)
        stats["bound_ok"] &= bool((deq[:, :, 0] <= meta[:, :, 0].float()).all())
        stats["bound_ok"] &= bool((deq[:, :, 1] >= meta[:, :, 1].float()).all())
        scores8 = attn.ops.quest_scores(
            q, deq.to(meta.dtype), plan.block_table, plan.num_pages, cfg.group_combine, attn.scale
        )
        compact = attn.ops.select_topk(
            scores8, plan.num_pages, cfg.top_k_pages, cfg.sink_pages, cfg.window_pages
        )
        p_max = plan.block_table.shape[1]
        a, b = unpack_bits(exact, p_max), unpack_bits(compact, p_max)  # [B, Hkv, P_max]
        stats["rows"] += a.shape[0] * a.shape[1]
        stats["rows_differ"] += int((a != b).any(-1).sum())
        stats["pages_sel"] += int(a.sum())
        stats["pages_differ"] += int((a & ~b).sum())
        return exact

    attn.select = both
    text = (args.corpus / args.doc).read_text("utf-8")
    ids = engine.tokenizer.encode(text)[: args.tokens]
    req = engine.open_request(Job("m", tuple(ids), SamplingParams(max_tokens=args.steps + 1)))
    engine.prefill(req)
    while len(req.generated) < args.steps:
        req.generated.append(engine.decode_step([req])[0])
    engine.close_request(req)
    shape = engine.model.config
    pages = -(-len(ids) // args.page_size)
    per = shape.num_layers * shape.num_kv_heads * pages
    d = shape.head_dim
    kv_bytes = per * 2 * args.page_size * d * 2  # bf16 KV of the job
    exact_bytes = per * 2 * d * 2  # bf16 metadata
    int8_bytes = per * (2 * d + 4)
    result = {
        "what": "int8 page metadata (outward-rounded, per page x KV head scale) vs exact Quest",
        "model": args.model or "embedded SmolLM2-135M-Instruct",
        "doc": args.doc,
        "tokens": len(ids),
        "steps": args.steps,
        "top_k": args.top_k,
        "page_size": args.page_size,
        "group_combine": cfg.group_combine,
        "rows_layer_head_step": stats["rows"],
        "share_rows_with_a_different_page_set": stats["rows_differ"] / max(stats["rows"], 1),
        "share_selected_pages_differing": stats["pages_differ"] / max(stats["pages_sel"], 1),
        "int8_pairs_bound_exact_pairs": stats["bound_ok"],
        "bytes_per_step_per_job": {
            "kv_bf16": kv_bytes,
            "meta_exact_bf16": exact_bytes,
            "meta_int8": int8_bytes,
            "meta_exact_over_kv": exact_bytes / kv_bytes,
            "meta_int8_over_kv": int8_bytes / kv_bytes,
        },
        "machine": platform.node(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python scripts/measure_compact_meta.py " + " ".join(argv or sys.argv[1:]),
    }
    b = result["bytes_per_step_per_job"]
    print(f"(step, layer, KV head) rows: {stats['rows']}")
    print(f"rows whose int8 page set differs: {result['share_rows_with_a_different_page_set']:.2%}")
    print(f"selected pages that differ:      {result['share_selected_pages_differing']:.2%}")
    print(f"int8 bounds enclose exact:       {stats['bound_ok']}")
    print(
        f"metadata per step: exact {b['meta_exact_bf16'] / 2**20:.2f} MiB (KV/{1 / b['meta_exact_over_kv']:.0f}), "
        f"int8 {b['meta_int8'] / 2**20:.2f} MiB (KV/{1 / b['meta_int8_over_kv']:.0f})"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
