"""Time `hisparse run` itself, the path users take: start-up, model load, time to the first
admission, TTFT per job, prefill and decode rates, pinned host memory and wall time.

Runs ``python -m hisparse_cli run ARGS --json-progress --force --output-dir OUT`` as a
subprocess (one per ``--label``/tree), stamps every JSON progress line with the time it
arrived, and reads ``OUT/results.jsonl``. Prints one table and writes JSON.

Usage (on the GPU box, the embedded model extended to 64K, the corpus):

    python scripts/bench_run.py --out bench_out/run.json -- \\
        --preset h200 --context-policy extend --max-context 65536 --max-new-tokens 128 \\
        ../shared/corpus/*.txt

``--tree LABEL=PATH`` (repeatable) runs the same command with ``PYTHONPATH=PATH`` (another
checkout, e.g. an earlier commit unpacked with ``git archive``) for a side-by-side table;
without it the current tree runs once, labelled ``this tree``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tree_env(tree: Path) -> dict[str, str]:
    """The environment of a run of ``tree``: its root first on ``PYTHONPATH``, unbuffered."""
    extra = os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(tree), extra) if p)}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_stamped(tree: Path, args: list[str]) -> tuple[int, float, list, float]:
    """``hisparse run ARGS --json-progress --force`` of ``tree``: its exit code, wall
    seconds, every JSON progress object with the seconds from the start at which it
    arrived, and the start (``time.monotonic()``, the clock of the objects' ``t``)."""
    cmd = [sys.executable, "-m", "hisparse_cli", "run", *args, "--json-progress", "--force"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=tree, env=tree_env(tree), stdout=subprocess.PIPE, text=True)
    events = []
    for line in proc.stdout:
        try:
            events.append((time.monotonic() - t0, json.loads(line)))
        except json.JSONDecodeError:
            continue
    rc = proc.wait()
    return rc, time.monotonic() - t0, events, t0


def run_once(label: str, tree: Path, args: list[str], out_dir: Path) -> dict:
    """One `hisparse run`; returns its timings (seconds from the process start)."""
    rc, wall, events, _ = run_stamped(tree, [*args, "--output-dir", str(out_dir)])
    return summarise(label, rc, wall, events, out_dir / "results.jsonl")


def summarise(label: str, rc: int, wall: float, events: list, results_path: Path) -> dict:
    """The figures of one run from its stamped events and its results file."""
    loaded_at = next((t for t, e in events if "model loaded" in str(e.get("message", ""))), None)
    load_note = next((e["message"] for _, e in events if "model loaded" in str(e.get("message", ""))), "")
    admitted = [t for t, e in events if e.get("event") == "job_admitted"]
    finished = [t for t, e in events if e.get("event") == "job_finished"]
    progress = [e for _, e in events if e.get("event") == "progress"]
    rows = []
    if results_path.exists():
        rows = [json.loads(x) for x in results_path.read_text().splitlines() if x.strip()]
    ok = [r for r in rows if r.get("ok")]
    ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    decode = [p["decode_tok_s"] for p in progress if p.get("decode_tok_s")]
    pinned = max((p["host_pool"].get("pinned", 0) for p in progress), default=0)
    total = max((p["host_pool"].get("total", 0) for p in progress), default=0)
    gen = sum(r.get("generated_tokens") or 0 for r in ok)
    prompt = sum(r.get("prompt_tokens") or 0 for r in ok)
    summary = next((e for _, e in events if e.get("event") == "summary"), {})
    steady = {int(b): v for b, v in (summary.get("steady_decode") or {}).items()}
    full = max(steady) if steady else None
    first_admit = min(admitted) if admitted else None
    decode_span = (max(finished) - first_admit) if finished and first_admit else None
    return {
        "label": label,
        "rc": rc,
        "wall_s": wall,
        "model_loaded_s": loaded_at,
        "load_note": load_note,
        "first_admission_s": first_admit,
        "jobs_ok": len(ok),
        "jobs": len(rows),
        "prompt_tokens": prompt,
        "generated_tokens": gen,
        "ttft_s_median": statistics.median(ttft) if ttft else None,
        "ttft_s_max": max(ttft) if ttft else None,
        "decode_tok_s_peak": max(decode) if decode else None,
        "steady_decode": steady,
        "steady_batch": full,
        "steady_tok_s": steady[full]["tok_s"] if full else None,
        "steady_step_ms": steady[full]["step_ms"] if full else None,
        "generated_tok_s_after_admission": gen / decode_span if decode_span else None,
        "host_pool_pinned_gib": pinned / 2**30,
        "host_pool_cap_gib": total / 2**30,
    }


def table(rows: list[dict]) -> str:
    """The printed comparison, one column per run."""
    keys = [
        ("wall_s", "wall (s)"),
        ("model_loaded_s", "model loaded at (s)"),
        ("first_admission_s", "first admission (s)"),
        ("ttft_s_median", "TTFT median (s)"),
        ("ttft_s_max", "TTFT max (s)"),
        ("decode_tok_s_peak", "decode tok/s (peak of progress)"),
        ("steady_batch", "largest batch decoding alone"),
        ("steady_tok_s", "  its decode tok/s (no prefill)"),
        ("steady_step_ms", "  its step (ms)"),
        ("generated_tok_s_after_admission", "generated tok/s from 1st admission"),
        ("host_pool_pinned_gib", "host pool pinned (GiB)"),
        ("host_pool_cap_gib", "host pool cap (GiB)"),
        ("jobs_ok", "jobs ok"),
    ]
    width = max(len(r["label"]) for r in rows) + 2
    lines = [f"{'':36}" + "".join(f"{r['label']:>{max(width, 12)}}" for r in rows)]
    for key, name in keys:
        cells = []
        for r in rows:
            v = r.get(key)
            cells.append(f"{'-' if v is None else (f'{v:.2f}' if isinstance(v, float) else v):>{max(width, 12)}}")
        lines.append(f"{name:36}" + "".join(cells))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
    ap.add_argument("--tree", action="append", default=[], help="LABEL=PATH of another checkout")
    ap.add_argument("run_args", nargs=argparse.REMAINDER, help="-- then hisparse run arguments")
    ns = ap.parse_args()
    args = [a for a in ns.run_args if a != "--"]
    if not args:
        ap.error("give the hisparse run arguments after --")
    trees = [("this tree", ROOT)]
    for spec in ns.tree:
        label, _, path = spec.partition("=")
        if not path:
            ap.error(f"--tree {spec!r}: expected LABEL=PATH")
        trees.append((label, Path(path).resolve()))
    args = [str(Path(a).resolve()) if Path(a).exists() else a for a in args]
    rows = []
    for label, tree in trees:
        with tempfile.TemporaryDirectory(prefix="bench-run-") as tmp:
            rows.append(run_once(label, tree, args, Path(tmp)))
            print(f"{label}: rc {rows[-1]['rc']}, wall {rows[-1]['wall_s']:.1f} s", flush=True)
    print(table(rows))
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps({"args": args, "runs": rows}, indent=1))
    print(f"wrote {ns.out}")
    return 0 if all(r["rc"] in (0, 1) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
