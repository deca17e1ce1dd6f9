"""Start-up of `hisparse run`: process start to the first prefill, step by step.

Runs ``python -m hisparse_cli run --preset P --max-new-tokens 1 --json-progress DOC`` as
a subprocess ``--runs`` times per tree (trees interleaved run by run, so a busy machine
slows them alike) and reads when each step ended, in seconds from just before the process
was started:

- ``import``: ``import hisparse_cli.main`` alone (a separate process, timed inside it);
- ``cli_ready`` .. ``engine``: the ``startup_times`` object of the JSON progress
  (:class:`engine.events.StartupTimes`; ``time.monotonic()`` is one clock for all
  processes of the machine): CLI parsed, config resolved, load started, engine modules
  imported, GGUF metadata read, tokenizer built, weights read, model placed, kernels,
  KV cache and engine built;
- ``first_prefill``: the ``job_admitted`` event's ``t`` (the engine admits the job and
  its next step is the job's first prefill chunk: ``Engine.run`` runs ``_admit`` then
  ``_prefill_turn``), ``first_token``, ``wall``;
- ``help_s`` / ``presets_s``: wall time of ``hisparse --help`` and ``hisparse presets``;
- ``cuda_ready``: when the background thread of a one-GPU run had made the CUDA context
  (:func:`engine.cuda_devices.start_cuda_context`).

``--probes N`` also times the pieces alone, each in a fresh interpreter of this tree, N
times (median): ``python -c pass``; ``import torch``; ``import triton`` after torch;
the device probe (:func:`engine.cuda_devices.probe_cuda_devices`: NVML, no torch); with
torch imported, ``torch.cuda.device_count()`` and then the first CUDA tensor (the
context); ``cuInit`` + the primary context through ctypes; both at once, the way a run
overlaps them (torch imported while a thread makes the context). On a GPU it prints what
the probe read against what torch reads (names, GiB), which must agree.

A tree without the ``startup_times`` object (a checkout from before it existed) reports
``model_loaded`` (arrival of the "model loaded" line) and the engine events only. The
figure issue 16 sets a target for is ``first_prefill - weights_load`` (weights read and
placed: ``model - tokenizer``) <= 3 s.

Usage (CPU, this checkout against another one, 5 runs each):

    python scripts/measure_startup.py --runs 5 --tree "before=/tmp/before" \\
        --out docs/bench/startup_cpu.json

On the GPU (``--warmup 1``: one unrecorded run per tree first, so the Triton cache is
warm; the model file passed through to ``hisparse run`` after ``--``):

    python scripts/measure_startup.py --preset h200 --warmup 1 --runs 5 \\
        --out startup_h200.json -- --model smollm2.gguf

Extra ``hisparse run`` arguments go after ``--``. The whole breakdown on an H200 in one
command (``--preset auto``, the run's default, resolves through NVML):

    python scripts/measure_startup.py --preset auto --warmup 1 --runs 3 --probes 3 \\
        --out startup_h200.json -- --model /tmp/smol.gguf
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_run import run_stamped, tree_env  # scripts/bench_run.py, beside this file

ROOT = Path(__file__).resolve().parents[1]
ROWS = (
    ("import", "import hisparse_cli.main (own process)"),
    ("cli_ready", "CLI parsed (imports done)"),
    ("config_resolved", "config resolved"),
    ("load_started", "model load started"),
    ("cuda_ready", "CUDA context made (background thread)"),
    ("engine_imported", "engine modules imported"),
    ("metadata", "GGUF metadata read"),
    ("tokenizer", "tokenizer built"),
    ("weights", "weights read"),
    ("model", "model placed on the device"),
    ("engine", "KV cache + engine built"),
    ("model_loaded", "'model loaded' line arrived"),
    ("first_prefill", "first prefill starts"),
    ("first_token", "first token"),
    ("wall", "wall"),
    ("weights_load", "weights load (read + placed)"),
    ("startup_less_weights", "first prefill - weights load"),
    ("help_s", "hisparse --help (wall)"),
    ("presets_s", "hisparse presets (wall)"),
)
SHORT_DOC_CHARS = 1500  # ~550 prompt tokens of examples/howto-sorting.txt


def import_seconds(tree: Path) -> float:
    """Seconds ``import hisparse_cli.main`` takes in a fresh interpreter of ``tree``."""
    code = (
        "import time; t = time.monotonic(); import hisparse_cli.main; print(time.monotonic() - t)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tree,
        env=tree_env(tree),
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def wall_seconds(tree: Path, args: list[str]) -> float:
    """Wall time of ``hisparse ARGS`` (output discarded)."""
    t0 = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "hisparse_cli", *args], cwd=tree, env=tree_env(tree),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True,
    )  # fmt: skip
    return time.monotonic() - t0


def run_once(tree: Path, preset: str, doc: Path, extra: list[str]) -> dict:
    """One `hisparse run`; every step in seconds from just before the process started."""
    with tempfile.TemporaryDirectory(prefix="startup-") as out_dir:
        args = ["--preset", preset, "--max-new-tokens", "1", "--output-dir", out_dir]
        rc, wall, events, t0 = run_stamped(tree, [*args, *extra, str(doc)])
    row: dict = {"rc": rc, "wall": wall}
    for arrived, event in events:
        kind = event.get("event")
        if kind == "startup_times":
            row |= {k: v - t0 for k, v in event["marks"].items()}
        elif kind == "info" and str(event.get("message", "")).startswith("model loaded"):
            row["model_loaded"] = arrived
        elif kind == "job_admitted" and "first_prefill" not in row:
            row["first_prefill"] = event["t"] - t0
        elif kind == "first_token" and "first_token" not in row:
            row["first_token"] = event["t"] - t0
    if "model" in row and "tokenizer" in row:
        row["weights_load"] = row["model"] - row["tokenizer"]
        if "first_prefill" in row:
            row["startup_less_weights"] = row["first_prefill"] - row["weights_load"]
    return row


def medians(rows: list[dict]) -> dict:
    """Per key, the median over the runs that have it."""
    keys = {k for r in rows for k in r if isinstance(r[k], int | float) and k != "rc"}
    return {k: statistics.median(r[k] for r in rows if k in r) for k in sorted(keys)}


def table(labels: list[str], summary: dict[str, dict], runs: int) -> str:
    """One row per step (median seconds from process start), one column per tree."""
    width = max(12, *(len(x) + 2 for x in labels))
    lines = [f"{f'median of {runs} (s)':40}" + "".join(f"{x:>{width}}" for x in labels)]
    for key, name in ROWS:
        cells = [summary[x].get(key) for x in labels]
        if all(c is None for c in cells):
            continue
        lines.append(
            f"{name:40}" + "".join(f"{'-' if c is None else f'{c:.2f}':>{width}}" for c in cells)
        )
    return "\n".join(lines)


PROBES = {  # name -> Python code run in a fresh interpreter; it prints seconds (JSON)
    "python": "import time; t = time.perf_counter()",
    "import torch": "import time; t = time.perf_counter(); import torch",
    "import triton (torch imported)": (
        "import torch, time; t = time.perf_counter(); import triton, triton.language"
    ),
    "device probe (NVML, no torch)": (
        "import time; t = time.perf_counter(); from engine.cuda_devices import "
        "probe_cuda_devices as p; d = p(); extra = dict(source=d.source, note=d.note, "
        "devices=[(x.name, round(x.memory_gib, 3)) for x in d.devices])"
    ),
    "torch.cuda.device_count (torch imported)": (
        "import torch, time; t = time.perf_counter(); n = torch.cuda.device_count(); "
        "extra = dict(devices=[(torch.cuda.get_device_properties(i).name, "
        "round(torch.cuda.get_device_properties(i).total_memory / 2**30, 3)) for i in range(n)])"
    ),
    "first CUDA tensor (torch imported, device counted)": (
        "import torch, time; torch.cuda.device_count(); t = time.perf_counter(); "
        "torch.zeros(1, device='cuda'); torch.cuda.synchronize()"
    ),
    "cuInit + primary context (ctypes)": (
        "import time, ctypes; t = time.perf_counter(); c = ctypes.CDLL('libcuda.so.1'); "
        "d, x = ctypes.c_int(), ctypes.c_void_p(); assert c.cuInit(0) == 0; "
        "assert c.cuDeviceGet(ctypes.byref(d), 0) == 0; "
        "assert c.cuDevicePrimaryCtxRetain(ctypes.byref(x), d) == 0"
    ),
    "import torch + first CUDA tensor": (
        "import time; t = time.perf_counter(); import torch; torch.zeros(1, device='cuda'); "
        "torch.cuda.synchronize()"
    ),
    "the same, context started on a thread first": (
        "import time; t = time.perf_counter(); from engine.cuda_devices import "
        "start_cuda_context as s; m = {}; s(0, m); import torch; "
        "torch.zeros(1, device='cuda'); torch.cuda.synchronize(); "
        "extra = dict(cuda_ready=m.get('cuda_ready', 0) - t if m else None)"
    ),
}


def time_probes(repeats: int) -> dict[str, dict]:
    """Each of :data:`PROBES` in a fresh interpreter of this tree, ``repeats`` times:
    median seconds, the runs, and what the probe printed beside its time (or its error)."""
    found: dict[str, dict] = {}
    for name, code in PROBES.items():
        wrapped = (
            "extra = {}\n" + code.replace("; ", "\n") + "\n"
            "import json; print(json.dumps(dict(s=time.perf_counter() - t, extra=extra)))"
        )
        runs, extra, error = [], None, None
        for _ in range(repeats):
            out = subprocess.run(
                [sys.executable, "-c", wrapped], cwd=ROOT, env=tree_env(ROOT),
                capture_output=True, text=True,
            )  # fmt: skip
            if out.returncode != 0:
                error = (out.stderr.strip().splitlines() or ["failed"])[-1]
                break
            row = json.loads(out.stdout.strip().splitlines()[-1])
            runs.append(row["s"])
            extra = row["extra"] or extra
        found[name] = {
            "median_s": statistics.median(runs) if runs else None,
            "runs_s": runs,
            "printed": extra,
            "error": error,
        }
    return found


def print_probes(probes: dict[str, dict]) -> None:
    """One line per probe; then the devices as the probe and as torch read them."""
    for name, row in probes.items():
        shown = row["error"] or f"{row['median_s']:.3f} s"
        print(f"{name:52}{shown}")
    mine = (probes.get("device probe (NVML, no torch)") or {}).get("printed") or {}
    theirs = (probes.get("torch.cuda.device_count (torch imported)") or {}).get("printed") or {}
    if mine or theirs:
        note = f" ({mine['note']})" if mine.get("note") else ""
        print(f"device probe answered from {mine.get('source')}: {mine.get('devices')}{note}")
        print(f"torch reads: {theirs.get('devices')}")


def short_document(path: Path | None, folder: Path) -> Path:
    """``path``, or the first characters of examples/howto-sorting.txt written to ``folder``."""
    if path is not None:
        return path.resolve()
    doc = folder / "short.txt"
    text = (ROOT / "examples" / "howto-sorting.txt").read_text(encoding="utf-8")
    doc.write_text(text[:SHORT_DOC_CHARS], encoding="utf-8")
    return doc


def time_parts(repeats: int, model: str | None = None) -> dict[str, dict[str, float]]:
    """The replaced parts against what they replace, in this process, alternating
    ``repeats`` times (median seconds): gguf-py's ``GGUFReader`` vs ``FastGGUFReader`` on
    ``model`` (the run's ``--model`` GGUF; default the embedded model); the tokenizer's size bound from its whole JSON
    (``json.loads(backend.to_str())``, as before) vs from its steps; ``torch.zeros`` vs
    ``engine.kv.host_pool.zeros`` of the CPU preset's page metadata and hot buffer
    (per layer ``[P, Hkv, 2, D]`` and ``[max_batch * Hkv * buffer_pages, 2, S, D]``)."""
    sys.path.insert(0, str(ROOT))
    import gguf
    import torch

    from engine.capacity.shapes import get_model_shape
    from engine.kv.host_pool import zeros
    from engine.kv.sizing import default_pool_pages
    from engine.presets import resolve_config
    from engine.text.tokenizer import TextTokenizer, _steps
    from engine.weights.embedded import default_model_path
    from engine.weights.gguf_reader import FastGGUFReader

    path = Path(model) if model else default_model_path()
    backend = TextTokenizer.from_gguf(FastGGUFReader(path), reference="llama.cpp").backend
    config, model = resolve_config("cpu"), get_model_shape("smollm2-135m")
    hkv, d, s = model.num_kv_heads, model.head_dim, config.page_size
    meta = (default_pool_pages(model, config), hkv, 2, d)
    slots = (config.max_batch * hkv * config.buffer_pages, 2, s, d)
    layers = model.num_layers
    pairs = {
        "GGUF metadata": (lambda: gguf.GGUFReader(path), lambda: FastGGUFReader(path)),
        "tokenizer size bound": (
            lambda: json.loads(backend.to_str()),
            lambda: _steps(backend),
        ),
        "CPU KV metadata + hot buffer": (
            lambda: [torch.zeros(x) for _ in range(layers) for x in (meta, slots)],
            lambda: [zeros(x, torch.float32, "cpu") for _ in range(layers) for x in (meta, slots)],
        ),
    }
    times: dict[str, dict[str, list[float]]] = {k: {"before": [], "after": []} for k in pairs}
    for _ in range(repeats):
        for name, (before, after) in pairs.items():
            for side, fn in (("before", before), ("after", after)):
                t0 = time.perf_counter()
                kept = fn()
                times[name][side].append(time.perf_counter() - t0)
                del kept
    return {k: {side: statistics.median(v) for side, v in d.items()} for k, d in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="runs per tree (interleaved)")
    ap.add_argument(
        "--warmup", type=int, default=0, help="unrecorded runs per tree first (a cold Triton cache)"
    )
    ap.add_argument("--preset", default="cpu", help="hisparse run --preset")
    ap.add_argument("--doc", type=Path, help="the document (default: a short one, ~550 tokens)")
    ap.add_argument("--tree", action="append", default=[], help="LABEL=PATH of another checkout")
    ap.add_argument("--label", default="this tree", help="this checkout's column")
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
    ap.add_argument(
        "--parts", type=int, default=0, help="also time the replaced parts in-process, N times"
    )
    ap.add_argument(
        "--probes",
        type=int,
        default=0,
        help="also time the pieces alone (fresh processes), N times",
    )
    ap.add_argument(
        "run_args", nargs=argparse.REMAINDER, help="-- then more hisparse run arguments"
    )
    ns = ap.parse_args()
    extra = [a for a in ns.run_args if a != "--"]
    extra = [str(Path(a).resolve()) if Path(a).exists() else a for a in extra]  # cwd: each tree
    trees = [(ns.label, ROOT)]
    for spec in ns.tree:
        label, _, path = spec.partition("=")
        if not path:
            ap.error(f"--tree {spec!r}: expected LABEL=PATH")
        trees.append((label, Path(path).resolve()))
    runs: dict[str, list[dict]] = {label: [] for label, _ in trees}
    with tempfile.TemporaryDirectory(prefix="startup-doc-") as tmp:
        doc = short_document(ns.doc, Path(tmp))
        for _ in range(ns.warmup):
            for label, tree in trees:
                print(
                    f"warm-up {label}: rc {run_once(tree, ns.preset, doc, extra)['rc']}", flush=True
                )
        for i in range(ns.runs):
            for label, tree in trees:
                row = run_once(tree, ns.preset, doc, extra)
                row["import"] = import_seconds(tree)
                row["help_s"] = wall_seconds(tree, ["--help"])
                row["presets_s"] = wall_seconds(tree, ["presets"])
                runs[label].append(row)
                first = row.get("first_prefill")
                shown = "-" if first is None else f"{first:.2f}"
                print(f"run {i + 1}/{ns.runs} {label}: rc {row['rc']}, first prefill {shown} s, "
                      f"wall {row['wall']:.1f} s", flush=True)  # fmt: skip
    labels = [label for label, _ in trees]
    summary = {label: medians(runs[label]) for label in labels}
    print(table(labels, summary, ns.runs))
    model = extra[extra.index("--model") + 1] if "--model" in extra[:-1] else None
    parts = time_parts(ns.parts, model) if ns.parts else {}
    for name, sides in parts.items():
        print(f"{name:40}{sides['before']:>10.3f} s before {sides['after']:>8.3f} s after")
    probes = time_probes(ns.probes) if ns.probes else {}
    print_probes(probes)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "command": sys.argv,
        "preset": ns.preset,
        "run_args": extra,
        "warmup": ns.warmup,
        "machine": platform.node(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "trees": {label: str(tree) for label, tree in trees},
        "median_s": summary,
        "parts_median_s": parts,
        "probes": probes,
        "runs": runs,
    }
    ns.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {ns.out}")
    return 0 if all(r["rc"] == 0 for rows in runs.values() for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
