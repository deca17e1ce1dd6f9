"""Plan vs measured peak memory per device (issue 6).

For each scenario this plans the run with the capacity planner
(:func:`engine.capacity.planner.plan`, what ``hisparse plan`` prints) and then runs it for real
(:class:`engine.serve.workers.ParallelEngine`: one worker process per device, data-parallel or
a layer pipeline, a single device included), and records per device:

* planned bytes by part: weights, hot KV slab pool, page metadata, activations/scratch,
  communication buffers, reserve and their total (``DeviceMemory.used_bytes``), against
  the device's capacity (``min(memory_gb, --memory-budget)``);
* measured, from inside each worker (:class:`engine.events.MemorySnapshot`, the last one
  of the run): the bytes of its weights, slab records and page metadata tensors, and on
  CUDA ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over the run (each
  worker resets them once its model is loaded; the load's own peaks are kept apart), the
  device's used memory (``cudaMemGetInfo``: every process and CUDA context) and the
  process's pinned host bytes (``torch.cuda.host_memory_stats``);
* with ``--memory-budget``, each worker's budget split (:class:`engine.capacity.budget.KVSizing`);
* the pinned host pool: planned (the jobs' KV, and the pool) vs allocated (the workers'
  pools) and what the pinned allocator holds (it rounds each layer's block up to a power
  of two).

Scenarios (GPU; ``--scenarios`` picks, default all that the machine can run):

  a  ``--preset h200``, one GPU, no budget;
  b  ``--preset dual4090 --memory-budget 48 --host-pool <fits>``, ``parallel: data`` on
     ``cuda:0,cuda:1``;
  c  as b with ``parallel: pipeline`` on ``cuda:0,cuda:1``;
  d  as b with both workers on ``cuda:0`` (a fallback: run only when one GPU is present,
     unless named in ``--scenarios``).

A scenario that needs more GPUs than ``torch.cuda.device_count()`` is skipped with the
reason. Every job is ``--context`` positions (prompt + ``--max-tokens``), greedy; the
host pool is sized to hold exactly the scenario's jobs (``<fits>``). The run settings are
the preset's, with ``max_batch`` set to the scenario's jobs: ``max_batch`` is the whole
box's, so a data-parallel worker decodes ``ceil(max_batch / n)`` rows, in the planner and
in the run (:func:`engine.serve.workers.worker_config`).

Documents: ``--corpus-tokens FILE`` (pre-tokenised with the embedded tokenizer on the CPU
box: ``bash scripts/bench_capacity.sh prep`` writes ``.bench/corpus_tokens.json``) or the
``*.txt`` corpus (``--corpus``, default ``$HISPARSE_CORPUS`` or ``../shared/corpus``),
tokenised here. With a token file and a synthetic model the workers run with
``extra.tokenizer: ids`` and need no GGUF. Weights of ``synthetic:`` models are random
(4-bit, the published shape): their memory is real, their text is not.

Modes:

* GPU (default), one command on a 2 x H200 machine (~4 min; ``scripts/measure_memory.sh``
  wraps it with the GPU names, a log and a timeout)::

      python scripts/measure_memory.py --corpus-tokens .bench/corpus_tokens.json \\
          --out $OUT/memory.json

* ``--cpu``: the same code path on two CPU workers (scenarios ``cpu-data``,
  ``cpu-pipeline``) with the embedded model (or ``--model``) and a small budget; CUDA
  figures read 0 there. A CPU test runs it.
* ``--dry-run``: plan only (no engine, no GPU needed).

The table goes to stdout (Rich); ``--out`` gets JSON, rewritten after each scenario, so a
run cut short still reports what it finished. ``--time-limit`` starts no scenario after
that many seconds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from engine import events as ev  # noqa: E402
from engine.capacity.budget import pool_page_bytes  # noqa: E402
from engine.capacity.planner import GIB, Plan, job_host_bytes, parse_context, plan  # noqa: E402
from engine.config import EngineConfig, ModelConfig, SamplingParams  # noqa: E402
from engine.measure.bench_kv import (  # noqa: E402
    corpus_dir,
    corpus_streams,
    document_ids,
    read_corpus_tokens,
)
from engine.presets import load_preset_full, resolve_config  # noqa: E402

FORMAT = "hisparse-memory"
VERSION = 1
DEFAULT_GPU_MODEL = "synthetic:qwen2.5-7b"
PLANNED_PARTS = ("weights", "kv_slab", "metadata", "activation", "comm", "reserve")


@dataclass(frozen=True)
class Scenario:
    """One measured configuration.

    ``devices``: one per worker; ``gpus``: distinct GPUs it needs; ``jobs``: concurrent
    jobs on the whole box; ``memory_budget_gb``: per-device cap (``None``: the device);
    ``overrides``: EngineConfig fields over the preset; ``fallback``: run only when the
    machine has fewer GPUs than ``fallback`` (unless named explicitly).
    """

    key: str
    name: str
    description: str
    preset: str
    devices: tuple[str, ...]
    parallel: str
    gpus: int
    jobs: int
    memory_budget_gb: float | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    fallback: int = 0


GPU_SCENARIOS = (
    Scenario("a", "h200", "--preset h200, one GPU", "h200", ("cuda:0",), "data", 1, 4),
    Scenario(
        "b",
        "dual4090-data",
        "--preset dual4090 --memory-budget 48, parallel data on 2 GPUs",
        "dual4090",
        ("cuda:0", "cuda:1"),
        "data",
        2,
        4,
        48.0,
    ),
    Scenario(
        "c",
        "dual4090-pipeline",
        "--preset dual4090 --memory-budget 48, parallel pipeline on 2 GPUs",
        "dual4090",
        ("cuda:0", "cuda:1"),
        "pipeline",
        2,
        4,
        48.0,
    ),
    Scenario(
        "d",
        "dual4090-data-1gpu",
        "as b with both workers on cuda:0 (fallback for one GPU)",
        "dual4090",
        ("cuda:0", "cuda:0"),
        "data",
        1,
        4,
        48.0,
        fallback=2,
    ),
)
# Two CPU workers, small hot buffer (the hierarchy evicts), a small budget.
CPU_OVERRIDES = {"top_k": 128, "device_buffer": 256, "local_window": 64, "prefill_chunk": 256}
CPU_SCENARIOS = (
    Scenario(
        "cpu-data",
        "cpu-data",
        "--preset cpu, parallel data on two CPU workers, small budget",
        "cpu",
        ("cpu", "cpu"),
        "data",
        0,
        2,
        2.0,
        CPU_OVERRIDES,
    ),
    Scenario(
        "cpu-pipeline",
        "cpu-pipeline",
        "--preset cpu, parallel pipeline on two CPU workers, small budget",
        "cpu",
        ("cpu", "cpu"),
        "pipeline",
        0,
        2,
        2.0,
        CPU_OVERRIDES,
    ),
)


# ----------------------------------------------------------------------------- settings


def model_shape(model: str | None) -> ModelConfig:
    """The shape the planner uses for ``model`` (``None``: the embedded SmolLM2-135M)."""
    if model is not None and model.startswith("synthetic:"):
        from engine.weights.synthetic import synthetic_shape

        return synthetic_shape(model)
    from engine.capacity.shapes import get_model_shape

    return get_model_shape(model or "smollm2-135m")


@dataclass(frozen=True)
class Settings:
    """What one scenario plans and runs with.

    ``plan_config``: the planner's (``max_batch`` for the whole box); ``run_config``: the
    run's (the same, on the scenario's first device, ``extra.tokenizer``; the workers take
    their share); ``per_worker_batch``: rows a worker decodes at once; ``context``:
    positions per job; ``prompt_tokens = context - max_tokens``.
    """

    plan_config: EngineConfig
    run_config: EngineConfig
    hardware: Any
    context: int
    prompt_tokens: int
    max_tokens: int
    per_worker_batch: int


def scenario_settings(
    sc: Scenario,
    shape: ModelConfig,
    context: int,
    max_tokens: int,
    budget: float | None,
    ids_tokenizer: bool,
) -> Settings:
    """Resolve the preset with the scenario's overrides and size the host pool to hold
    exactly ``sc.jobs`` jobs of ``context`` positions (plus half a page against rounding).
    ``max_context`` is set to ``context`` so the engine sizes its prefill scratch and page
    tables (and a budget's split) for the planned context.

    Raises
    ------
    ConfigError
        A setting the preset or the overrides make invalid.
    """
    loaded = load_preset_full(sc.preset)
    budget = sc.memory_budget_gb if budget is None else budget
    n = len(sc.devices)
    overrides = {
        **sc.overrides,
        "max_batch": sc.jobs,
        "memory_budget_gb": budget,
        "max_context": context,  # the engine's limit = the plan's context (scratch, tables)
    }
    base = resolve_config(loaded, {}, overrides)
    per_job = job_host_bytes(shape, base, context)
    host_gb = (sc.jobs * per_job + pool_page_bytes(shape, base) // 2) / GIB
    plan_config = base.replace(host_pool_gb=max(host_gb, 1e-3))
    per_worker = -(-sc.jobs // n) if sc.parallel == "data" else sc.jobs
    run_config = plan_config.replace(
        device=sc.devices[0], tokenizer="ids" if ids_tokenizer else None
    )
    hardware = loaded.hardware.replace(devices=sc.devices, parallel=sc.parallel)
    return Settings(
        plan_config, run_config, hardware, context, context - max_tokens, max_tokens, per_worker
    )


def planned_devices(p: Plan) -> list[dict[str, Any]]:
    """Per device of the plan: bytes by part, total and capacity."""
    rows = []
    for d in p.devices:
        rows.append(
            {
                "device": d.device,
                "layers": list(d.layers),
                "jobs": d.num_jobs,
                "weights": d.weights_bytes,
                "kv_slab": d.kv_slab_bytes,
                "metadata": d.metadata_bytes,
                "activation": d.activation_bytes,
                "comm": d.comm_bytes,
                "reserve": d.reserve_bytes,
                "total": d.used_bytes,
                "capacity": d.capacity_bytes,
            }
        )
    return rows


# ----------------------------------------------------------------------------- documents


def load_streams(args, vocab_size: int, tokenizer) -> tuple[str, list[list[int]]]:
    """Token streams of the corpus: the pre-tokenised file, else the ``*.txt`` corpus
    tokenised with ``tokenizer``. Returns (source, streams)."""
    if args.corpus_tokens is not None:
        _, streams = read_corpus_tokens(args.corpus_tokens, vocab_size)
        return str(args.corpus_tokens), streams
    directory = corpus_dir(args.corpus)
    _, streams = corpus_streams(tokenizer, directory)
    return str(directory), streams


def make_jobs(sc: Scenario, streams: list[list[int]], s: Settings) -> list[ev.Job]:
    """``sc.jobs`` greedy jobs of ``s.prompt_tokens`` corpus tokens, document ``i`` from
    file ``i`` on (:func:`engine.measure.bench_kv.document_ids`)."""
    sampling = SamplingParams(max_tokens=s.max_tokens, temperature=0.0)
    return [
        ev.Job(f"{sc.name}-{i}", document_ids(streams, i, s.prompt_tokens), sampling)
        for i in range(sc.jobs)
    ]


# ----------------------------------------------------------------------------- measuring


def _rank(snap: ev.MemorySnapshot, devices: tuple[str, ...]) -> int:
    """The worker a (relabelled) snapshot came from."""
    if snap.stage >= 0:
        return snap.stage
    if "#" in snap.device:
        return int(snap.device.rsplit("#", 1)[1])
    return devices.index(snap.device) if snap.device in devices else 0


def run_scenario(
    sc: Scenario, s: Settings, model: str | None, jobs: list[ev.Job], tokenizer
) -> dict[str, Any]:
    """Run ``jobs`` on ``sc.devices``; per worker, what it measured.

    Returns a dict: ``workers`` (per rank: ``info`` of the worker, ``snapshot`` its last
    :class:`MemorySnapshot` as a dict, ``jobs`` placed on it), ``jobs`` (finished /
    failed counts, errors, generated tokens), ``host_pool`` (last summed figures),
    ``load_s`` and ``run_s``.

    Raises
    ------
    RuntimeError
        A worker failed to start (its error in the message).
    """
    from engine.serve.workers import JobPlaced, ParallelEngine

    t0 = time.monotonic()
    engine = ParallelEngine(s.run_config, model, sc.devices, sc.parallel, tokenizer=tokenizer)
    try:
        load_s = time.monotonic() - t0
        infos = [dict(w.info) for w in engine.workers]
        last: dict[int, ev.MemorySnapshot] = {}
        placed: dict[int, int] = {}
        finished, failed, tokens = 0, {}, 0
        host = (0, 0)
        t1 = time.monotonic()
        for event in engine.run(jobs):
            if isinstance(event, ev.MemorySnapshot):
                last[_rank(event, sc.devices)] = event
                host = (event.host_pool_used, event.host_pool_total)
            elif isinstance(event, JobPlaced):
                placed[event.worker] = placed.get(event.worker, 0) + 1
            elif isinstance(event, ev.JobFinished):
                finished += 1
                tokens += len(event.result.token_ids)
            elif isinstance(event, ev.JobFailed):
                failed[event.job_id] = event.error
        run_s = time.monotonic() - t1
    finally:
        engine.close()
    workers = []
    for rank, info in enumerate(infos):
        info.pop("model_config", None)
        snap = last.get(rank)
        workers.append(
            {
                "rank": rank,
                "device": sc.devices[rank],
                "info": info,
                "snapshot": _snapshot_dict(snap) if snap is not None else None,
                "jobs_placed": placed.get(rank, 0),
            }
        )
    return {
        "workers": workers,
        "jobs": {"finished": finished, "failed": len(failed), "errors": failed, "tokens": tokens},
        "host_pool": {"used_last": host[0], "total": host[1]},
        "load_s": round(load_s, 2),
        "run_s": round(run_s, 2),
    }


def _snapshot_dict(snap: ev.MemorySnapshot) -> dict[str, Any]:
    return {k: getattr(snap, k) for k in snap.__dataclass_fields__ if k != "t"}


def device_rows(planned: list[dict], measured: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Planned and measured side by side, one row per device (worker).

    Measured ``scratch_peak`` = ``peak_allocated`` less the weights, slab records and
    metadata the worker holds (what the activations, prefill scratch, page tables and LRU
    state took at the peak); ``None`` without CUDA figures.
    """
    rows = []
    for i, p in enumerate(planned):
        row: dict[str, Any] = {"planned": p}
        if measured is not None:
            w = measured["workers"][i]
            snap = w["snapshot"] or {}
            steady = sum(snap.get(k, 0) for k in ("weights", "hot_buffer", "metadata"))
            peak = snap.get("peak_allocated", 0)
            row["measured"] = {
                "weights": snap.get("weights"),
                "kv_slab": snap.get("hot_buffer"),
                "metadata": snap.get("metadata"),
                "scratch_peak": peak - steady if peak else None,
                "peak_allocated": peak or None,
                "peak_reserved": snap.get("peak_reserved") or None,
                "device_used": snap.get("device_used") or None,
                "pinned_host": snap.get("pinned_host") or None,
                "host_pool": w["info"].get("host_pool_bytes"),
                "load_peak_allocated": w["info"].get("load_peak_allocated"),
                "load_peak_reserved": w["info"].get("load_peak_reserved"),
                "max_batch": w["info"].get("max_batch"),
                "budget_sizing": w["info"].get("budget_sizing"),
                "jobs_placed": w["jobs_placed"],
            }
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- report


def _gib(n: int | float | None) -> str:
    """GiB with two decimals; under 0.01 GiB in MiB (``12.5M``); ``n/a`` for ``None``."""
    if n is None:
        return "n/a"
    return f"{n / GIB:.2f}" if abs(n) >= GIB / 100 or n == 0 else f"{n / 2**20:.1f}M"


def render(report: dict[str, Any], console: Console) -> None:
    """Print the planned and the measured per-device tables and the host-pool table."""
    planned = _table(
        "planned per device (GiB; hisparse plan)",
        ("weights", "slabs", "meta", "act", "comm", "reserve", "total", "capacity"),
    )
    measured = _table(
        "measured per device (GiB; tensors the worker holds, CUDA peaks over the run)",
        (
            "weights",
            "slabs",
            "meta",
            "peak alloc",
            "peak resv",
            "scratch pk",
            "dev used",
            "load peak",
            "batch",
            "jobs",
        ),
    )
    host = Table(title="pinned host pool (GiB)")
    for col in ("scenario", "status", "jobs KV", "pool plan", "pool alloc", "pinned"):
        host.add_column(col, justify="left" if col in ("scenario", "status") else "right")
    for sc in report["scenarios"]:
        status = sc["status"] + (f": {sc['reason']}" if sc.get("reason") else "")
        h = sc.get("host", {})
        host.add_row(
            sc["name"],
            status,
            _gib(h.get("planned_jobs_kv")),
            _gib(h.get("planned_pool")),
            _gib(h.get("allocated_pool")),
            _gib(h.get("pinned")),
        )
        if sc["status"] == "skipped":
            continue
        for row in sc.get("rows", []):
            p, m = row["planned"], row.get("measured")
            name = p["device"]
            if sc["parallel"] == "pipeline":
                name += f" L{p['layers'][0]}-{p['layers'][1] - 1}"
            parts = ("weights", "kv_slab", "metadata", "activation", "comm", "reserve", "total")
            planned.add_row(sc["name"], name, *(_gib(p[k]) for k in (*parts, "capacity")))
            if m is None:
                continue
            measured.add_row(
                sc["name"],
                name,
                *(
                    _gib(m.get(k))
                    for k in (
                        "weights",
                        "kv_slab",
                        "metadata",
                        "peak_allocated",
                        "peak_reserved",
                        "scratch_peak",
                        "device_used",
                        "load_peak_allocated",
                    )
                ),
                str(m.get("max_batch")),
                str(m.get("jobs_placed")),
            )
    console.print("GiB; 'M' = MiB; n/a: not measured (CUDA figures on CPU)")
    console.print(planned)
    if measured.row_count:
        console.print(measured)
    console.print(host)


def say(console: Console, message: str) -> None:
    """Print a progress line as plain text (no Rich markup: ``[name]`` stays)."""
    console.print(message, markup=False, highlight=False)


def _table(title: str, columns: tuple[str, ...]) -> Table:
    table = Table(title=title)
    table.add_column("scenario")
    table.add_column("device")
    for col in columns:
        table.add_column(col, justify="right")
    return table


def machine_info() -> dict[str, Any]:
    """GPUs (from ``nvidia-smi``, so this process opens no CUDA context), torch, host RAM."""
    gpus: list[str] = []
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
            gpus = [line.strip() for line in out.splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError):
            pass
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "gpus": gpus,
        "cuda_device_count": torch.cuda.device_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host_ram_bytes": ram,
        "cpu_count": os.cpu_count(),
    }


def skip_reason(sc: Scenario, gpus: int, named: bool, cpu: bool) -> str | None:
    """Why ``sc`` does not run on a machine with ``gpus`` GPUs (``None``: it runs)."""
    if cpu:
        return None
    if gpus < sc.gpus:
        return f"needs {sc.gpus} GPU(s), this machine has {gpus}"
    if sc.fallback and gpus >= sc.fallback and not named:
        return (
            f"fallback for fewer than {sc.fallback} GPUs; this machine has {gpus} "
            f"(name it in --scenarios to run it anyway)"
        )
    return None


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON report path.")
    p.add_argument("--cpu", action="store_true", help="CPU scenarios (two CPU workers).")
    p.add_argument("--dry-run", action="store_true", help="Plan only; run nothing.")
    p.add_argument(
        "--scenarios", default="", help="Comma-separated keys (a,b,c,d or cpu-data,cpu-pipeline)."
    )
    p.add_argument(
        "--model", default=None, help=f"Model (GPU: {DEFAULT_GPU_MODEL}; CPU: the embedded one)."
    )
    p.add_argument("--context", default=None, help="Positions per job (default 32K GPU, 1K CPU).")
    p.add_argument("--max-tokens", type=int, default=None, help="Generated tokens (16 GPU, 4 CPU).")
    p.add_argument("--jobs", type=int, default=None, help="Concurrent jobs per scenario.")
    p.add_argument("--memory-budget", type=float, default=None, help="Override the budget, GiB.")
    p.add_argument("--corpus-tokens", type=Path, default=None, help="Pre-tokenised corpus.")
    p.add_argument("--corpus", type=Path, default=None, help="*.txt corpus (no --corpus-tokens).")
    p.add_argument("--time-limit", type=float, default=300.0, help="Start no scenario after S s.")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the scenarios; 0 if every scenario that ran measured all its jobs, else 1."""
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 160)
    started = time.monotonic()
    catalogue = CPU_SCENARIOS if args.cpu else GPU_SCENARIOS
    wanted = [k.strip() for k in args.scenarios.split(",") if k.strip()]
    unknown = sorted(set(wanted) - {s.key for s in catalogue})
    if unknown:
        known = ", ".join(s.key for s in catalogue)
        say(console, f"unknown scenario(s) {', '.join(unknown)}; known: {known}")
        return 2
    chosen = [s for s in catalogue if not wanted or s.key in wanted]
    model = args.model if args.model is not None else (None if args.cpu else DEFAULT_GPU_MODEL)
    context = parse_context(args.context or ("1K" if args.cpu else "32K"))
    max_tokens = args.max_tokens or (4 if args.cpu else 16)
    shape = model_shape(model)
    synthetic = model is not None and model.startswith("synthetic:")
    ids = synthetic and args.corpus_tokens is not None
    gpus = 0 if args.cpu else torch.cuda.device_count()
    report: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": [sys.executable, *sys.argv],
        "machine": machine_info(),
        "settings": {
            "model": model or "embedded SmolLM2-135M-Instruct",
            "synthetic_weights": synthetic,
            "context": context,
            "max_tokens": max_tokens,
            "mode": "dry-run" if args.dry_run else ("cpu" if args.cpu else "gpu"),
        },
        "scenarios": [],
    }
    tokenizer, streams = None, None
    ok = True
    for base_sc in chosen:
        sc = base_sc if args.jobs is None else _with_jobs(base_sc, args.jobs)
        entry: dict[str, Any] = {
            "key": sc.key,
            "name": sc.name,
            "description": sc.description,
            "preset": sc.preset,
            "devices": list(sc.devices),
            "parallel": sc.parallel,
            "jobs": sc.jobs,
        }
        report["scenarios"].append(entry)
        reason = None if args.dry_run else skip_reason(sc, gpus, sc.key in wanted, args.cpu)
        if reason is None and not args.dry_run and time.monotonic() - started > args.time_limit:
            reason = f"time limit: {args.time_limit:.0f} s passed before it started"
        s = scenario_settings(sc, shape, context, max_tokens, args.memory_budget, ids)
        p = plan(shape, s.plan_config, s.hardware, sc.jobs, context)
        entry.update(
            plan_config=s.plan_config.to_dict(),
            run_config=s.run_config.to_dict(),
            per_worker_max_batch=s.per_worker_batch,
            plan=p.to_dict(),
            host={
                "planned_jobs_kv": p.host_needed_bytes,
                "planned_pool": p.host_pool_bytes,
            },
        )
        planned = planned_devices(p)
        if reason is not None or args.dry_run:
            if reason is None:
                reason = "" if p.feasible else "plan refuses: " + "; ".join(p.reasons)
            status = "skipped" if not args.dry_run else "planned"
            entry.update(status=status, reason=reason, rows=device_rows(planned, None))
            say(console, f"[{sc.name}] {status}{': ' + reason if reason else ''}")
            _write(args.out, report)
            continue
        if tokenizer is None:
            from engine.load import load_tokenizer

            tokenizer = load_tokenizer(model, "ids" if ids else None)[0]
            source, streams = load_streams(args, shape.vocab_size, tokenizer)
            report["settings"]["documents"] = source
        say(console, f"[{sc.name}] {sc.description}: {sc.jobs} jobs x {context} positions ...")
        t0 = time.monotonic()
        try:
            measured = run_scenario(sc, s, model, make_jobs(sc, streams, s), tokenizer)
        except Exception as exc:  # noqa: BLE001 - report it, go on with the next scenario
            ok = False
            entry.update(status="failed", reason=f"{type(exc).__name__}: {exc}")
            entry["rows"] = device_rows(planned, None)
            say(console, f"[{sc.name}] failed: {exc}")
            _write(args.out, report)
            continue
        rows = device_rows(planned, measured)
        failed = measured["jobs"]["failed"]
        ok = ok and failed == 0
        entry.update(
            status="measured" if failed == 0 else "measured with failed jobs",
            reason="" if failed == 0 else f"{failed} job(s) failed",
            rows=rows,
            run=measured["jobs"],
            load_s=measured["load_s"],
            run_s=measured["run_s"],
            elapsed_s=round(time.monotonic() - t0, 2),
        )
        workers = measured["workers"]
        pinned = sum(((w["snapshot"] or {}).get("pinned_host") or 0) for w in workers)
        entry["host"].update(
            allocated_pool=sum((w["info"].get("host_pool_bytes") or 0) for w in workers),
            pinned=pinned or None,
        )
        say(
            console,
            f"[{sc.name}] {measured['jobs']['finished']} finished, {failed} failed; "
            f"load {measured['load_s']:.1f} s, run {measured['run_s']:.1f} s",
        )
        _write(args.out, report)
    report["elapsed_s"] = round(time.monotonic() - started, 2)
    _write(args.out, report)
    render(report, console)
    say(console, f"wrote {args.out}")
    return 0 if ok else 1


def _with_jobs(sc: Scenario, jobs: int) -> Scenario:
    from dataclasses import replace

    return replace(sc, jobs=jobs)


def _write(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=_json_default) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (set, tuple)):
        return list(obj)
    if isinstance(obj, float) and math.isnan(obj):
        return None
    return str(obj)


if __name__ == "__main__":
    raise SystemExit(main())
