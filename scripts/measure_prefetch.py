"""Near-miss prefetch under real selection locality (the real small model, CPU).

``prefetch_pages`` (:meth:`engine.decode.attention.DecodeAttention.prefetch`) loads, after each
layer's attention, the pages ranked just below the top-k of that step's indexer scores,
betting that the next step selects some of them. Whether the bet pays depends on how
selections move from step to step, which synthetic weights (``hisparse bench``) cannot
show. This script measures it with the embedded SmolLM2-135M-Instruct on a corpus
document: for each (top_k, device_buffer, prefetch_pages) it decodes ``--steps`` greedy
tokens through the hierarchical cache and reports, over the steps after ``--warmup``:

* ``misses`` — selected records not resident when their layer needed them (records);
* ``prefetched`` — records loaded by prefetch over the same steps;
* ``saved`` — misses fewer than the same top_k / buffer without prefetch;
* ``loads_per_saved`` — prefetched records per miss saved (the host-link price of a hit);
* ``same_tokens`` — the greedy tokens equal those without prefetch (they must: prefetch
  only changes where records come from).

Usage::

    OMP_NUM_THREADS=2 python scripts/measure_prefetch.py --doc howto-sorting.txt \\
        --out prefetch_cpu.json

Prints a table and writes JSON (settings, machine, date, rows).
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

# (top_k tokens, device_buffer tokens, prefetch pages); page 16, sink 16, window 32.
DEFAULT_CONFIGS = (
    (256, 512, 0),
    (256, 512, 4),
    (256, 512, 8),
    (512, 1024, 0),
    (512, 1024, 8),
    (512, 1024, 16),
)


def parse_configs(text: str) -> tuple[tuple[int, int, int], ...]:
    """``"256:512:0,256:512:4"`` -> ``((256, 512, 0), (256, 512, 4))``, each a valid engine
    config, each (top_k, buffer) pair's baseline (prefetch 0) first.

    Raises
    ------
    argparse.ArgumentTypeError
        Naming the bad item (argparse then exits with status 2).
    """
    out: list[tuple[int, int, int]] = []
    for item in text.split(","):
        parts = item.strip().split(":")
        try:
            top_k, buffer, prefetch = (int(p) for p in parts)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"item {item!r} is not TOP_K:BUFFER:PREFETCH (three integers)"
            ) from None
        problems = config_for(top_k, buffer, prefetch).problems()
        if problems:
            raise argparse.ArgumentTypeError(f"item {item!r}: {problems[0]}")
        if prefetch and (top_k, buffer, 0) not in out:
            raise argparse.ArgumentTypeError(
                f"item {item!r} needs its baseline {top_k}:{buffer}:0 before it"
            )
        out.append((top_k, buffer, prefetch))
    return tuple(out)


def config_for(top_k: int, buffer: int, prefetch: int) -> EngineConfig:
    """The hierarchical CPU engine config of one measured point (page 16, sink 16,
    window 32, one request)."""
    return EngineConfig(
        attention="sparse",
        hierarchical=True,
        indexer="quest",
        page_size=16,
        top_k=top_k,
        device_buffer=buffer,
        sink_tokens=16,
        local_window=32,
        prefetch_pages=prefetch,
        host_pool_gb=1.0,
        max_batch=1,
    )


def decode_run(ids: list[int], top_k: int, buffer: int, prefetch: int, steps: int, warmup: int):
    """Greedy tokens and (hits, misses, prefetched) over the steps after ``warmup``."""
    eng = load_engine(config_for(top_k, buffer, prefetch), None)
    req = eng.open_request(Job("p", tuple(ids), SamplingParams(max_tokens=steps + 1)))
    eng.prefill(req)
    hits = misses = prefetched = 0
    for step in range(steps):
        req.generated.append(eng.decode_step([req])[0])
        if step >= warmup:
            hits += int(eng.attn.hits.sum())
            misses += int(eng.attn.misses.sum())
            prefetched += int(eng.attn.prefetched.sum())
    eng.cache.check_integrity()
    tokens = list(req.generated)
    eng.close_request(req)
    return tokens, hits, misses, prefetched, len(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--doc", default="howto-sorting.txt", help="corpus file name")
    ap.add_argument("--chars", type=int, default=40000, help="characters of the document kept")
    ap.add_argument(
        "--steps", type=int, default=48, help="greedy decode steps per point (default 48)"
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=8,
        help="first steps left out of the counts (default 8; counted = steps - warmup)",
    )
    ap.add_argument(
        "--configs",
        type=parse_configs,
        default=DEFAULT_CONFIGS,
        help="TOP_K:BUFFER:PREFETCH,... in tokens, tokens, pages (each top_k/buffer pair "
        "needs a PREFETCH=0 entry first: the baseline; default "
        + ",".join(":".join(map(str, c)) for c in DEFAULT_CONFIGS)
        + ")",
    )
    ap.add_argument("--out", type=Path, default=Path("prefetch_cpu.json"), help="JSON report path")
    args = ap.parse_args()
    if not 0 <= args.warmup < args.steps:
        ap.error(f"--warmup {args.warmup} must be >= 0 and below --steps {args.steps}")

    text = (corpus_dir() / args.doc).read_text(encoding="utf-8")[: args.chars]
    tok = load_engine(EngineConfig(), None).tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "Summarize this document:\n\n" + text}])
    rows, base = [], {}
    counted = args.steps - args.warmup
    print(f"{args.doc}: {len(ids)} prompt tokens, {counted} steps counted after {args.warmup}")
    print(
        f"{'top_k':>6} {'buffer':>7} {'pf':>4} {'miss rate':>9} {'misses':>7} "
        f"{'prefetched':>10} {'saved':>6} {'loads/saved':>11} same"
    )
    for top_k, buffer, prefetch in args.configs:
        tokens, hits, misses, prefetched, n = decode_run(
            ids, top_k, buffer, prefetch, args.steps, args.warmup
        )
        if prefetch == 0:
            base[(top_k, buffer)] = (misses, tokens)
        ref_misses, ref_tokens = base.get((top_k, buffer), (None, None))
        saved = ref_misses - misses if ref_misses is not None else None
        row = {
            "top_k": top_k,
            "device_buffer": buffer,
            "prefetch_pages": prefetch,
            "prompt_tokens": n,
            "hits": hits,
            "misses": misses,
            "miss_rate": misses / (hits + misses) if hits + misses else None,
            "prefetched": prefetched,
            "saved": saved,
            "loads_per_saved": prefetched / saved if saved else None,
            "same_tokens": tokens == ref_tokens if ref_tokens is not None else None,
        }
        rows.append(row)
        lps = f"{row['loads_per_saved']:.1f}" if row["loads_per_saved"] else "-"
        print(
            f"{top_k:>6} {buffer:>7} {prefetch:>4} {row['miss_rate']:>9.4f} {misses:>7} "
            f"{prefetched:>10} {saved if saved is not None else '-':>6} {lps:>11} "
            f"{row['same_tokens']}",
            flush=True,
        )
    report = {
        "what": "near-miss prefetch under real locality (embedded SmolLM2-135M, CPU)",
        "command": " ".join(sys.argv),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor() or ''} "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}",
        "doc": args.doc,
        "steps": args.steps,
        "warmup": args.warmup,
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
