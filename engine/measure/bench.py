"""``hisparse bench``: decode throughput against concurrency, every mode under one budget.

The question (DESIGN.md, "Figures that matter"; the HiSparse paper's throughput-vs-
concurrency figure): under the same per-device memory budget, how far does each KV layout
scale before admission stops?

Modes (:data:`MODES`), all built on ONE placed :class:`engine.model.llama.LlamaModel`:

* ``dense`` — dense attention, every record resident in a device KV pool;
* ``sparse`` — the same sparse attention as the hierarchy, KV pool resident on the device
  (``hierarchical=False``): the all-resident sparse baseline;
* ``hierarchical`` — host pool + hot buffer (resolve, gather of misses);
* ``noio`` — ``hierarchical`` with ``skip_host_io=True``: gathers skipped, output invalid;
  the throughput ceiling if all host IO were hidden;
* ``copystream`` (not in the default sweep) — ``hierarchical`` with
  ``decode_write_stream=True``: each new token reaches the host pool from a copy stream
  instead of the append kernel on the compute stream (the default); ``copystream`` vs
  ``hierarchical`` is the step time with and without the copy stream hiding the
  write-through.
* ``sharedlink`` (not in the default sweep) — ``hierarchical`` with
  ``gather_turns=False``: the two micro-batches' gathers (``decode_overlap``) share the
  host link at once instead of taking turns; ``sharedlink`` vs ``hierarchical`` is the
  step time with and without the turns;
* ``prefetch`` (not in the default sweep) — ``hierarchical`` with ``prefetch_pages``
  (``--prefetch-pages``, else the base config's, else :func:`default_prefetch_pages`): after each
  layer's attention the near misses of its ranking are loaded on the copy stream
  (:meth:`engine.decode.attention.DecodeAttention.prefetch`); ``prefetch`` vs ``hierarchical``
  is the step time with and without the copy stream hiding prefetch. Its ``misses`` are
  the selected records still missing; ``prefetched`` counts the records prefetched, and
  both cross the host link (``h2d_bytes``).

Budget (:mod:`engine.capacity.budget`): every mode gets ``--memory-budget`` GiB; device-resident
pools get what the planner's arithmetic leaves after weights, activations and reserve, so
the resident baselines stop admitting at their wall; their concurrency sweep ends at the
first level where admission stops ("admission stopped": the admitted jobs are decoded,
the rest would queue). The hierarchical pool lives in (pinned) host memory and is sized
once for the run from ``--host-pool`` (default: the preset's ``host_pool_gb``, capped by
available RAM); ``noio`` shares it.

KV reuse: each document is prefilled ONCE per context into a *master copy* (per layer the
records ``[P, Hkv, 2, S, D]`` and page metadata ``[P, Hkv, 2, D]``, on the compute device,
:class:`MasterKV`); every job of every mode and level copies it into its own pool pages
(:func:`import_kv`, contiguous page runs -> one copy per run and layer) and continues from
the prefill's first token. Documents are the corpus files (``$HISPARSE_CORPUS`` or
``shared/corpus``, ``*.txt`` sorted by name) concatenated in that order; document ``i``
starts at file ``i mod F`` and wraps around, cut to the prompt length; job ``j`` uses
document ``j mod D``. A context of T tokens is prompt + decoded tokens: the prompt is
``T - decode_reserve`` tokens, so each job owns exactly ``T / S`` pages.

Prefill shortcut (synthetic models, ``--prefill window``, the default there): the model's
own layers with attention over a local window (each query sees at least the previous
``--prefill-window`` tokens, at most that plus one chunk) instead of the whole prefix,
whose cost grows with the square of the context. Its K/V, TTFT and prefill tokens/s are
those of the shortcut, not of a full prefill. ``--prefill full`` runs the engine's own
prefill. Decode is always real.

Per run (mode x context x level): decode tokens/s over ``--decode-steps`` steps after
``--warmup-steps``; step P50/P99; hit rate; host->device bytes and GB/s; peak device
memory of the engine (``torch.cuda.max_memory_allocated`` reset per run, less the bench's
own tensors); pinned host pool bytes; a step-time breakdown from a separate instrumented
pass (kernel ops and linear layers wrapped with CUDA events, perf_counter on CPU); and a
roofline: weight bytes / HBM + selected KV bytes / HBM + missed KV bytes / host link.

Soak (``--soak N``): one batch decoded N steps: memory drift, P99/mean step latency and
``cache.check_integrity()`` every ``--soak-every`` steps.

Companions: :mod:`engine.measure.bench_kv` (corpus, master copies, prefill),
:mod:`engine.measure.profiling` (timed ops and linears), :mod:`engine.measure.report` (roofline,
printed lines, ``bench.json``), :mod:`engine.capacity.budget` (the budget split).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import platform
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.capacity.budget import KVSizing, budget_cache, pool_page_bytes
from engine.capacity.planner import GIB, format_context
from engine.config import ConfigError, EngineConfig, SamplingParams
from engine.events import Job
from engine.kv.cache import CacheFullError, KVCache
from engine.kv.sizing import available_host_bytes
from engine.measure.bench_kv import (
    MasterKV,
    corpus_dir,
    corpus_streams,
    document_ids,
    free_device_memory,
    import_kv,
    prefill_documents,
    read_corpus_tokens,
    sync,
)
from engine.measure.profiling import PHASES, PhaseTimer, kernel_breakdown, timed_model, timed_ops
from engine.measure.report import (
    COMPLETE,
    INTERRUPTED,
    REPORT_FORMAT,
    RUNNING,
    header_lines,
    point_line,
    roofline,
    seed_scenario,
    write_report,
)
from engine.model.llama import LlamaModel
from engine.serve.engine import Engine, Request
from kernels.dispatch import Ops

MODES = ("dense", "sparse", "hierarchical", "noio", "copystream", "prefetch", "sharedlink")
DEFAULT_MODES = MODES[:4]
DEFAULT_PREFETCH_FRACTION = 0.25  # prefetch mode: near-miss pages per top-k page
PREFILL_METHODS = ("auto", "full", "window")
# DESIGN.md, H200: device copy 4.23 TB/s (read + write) -> ~2.1 TB/s of reads; pinned
# host->device copy 55.2 GB/s.
DEFAULT_HBM_GBPS = 4230.0 / 2
DEFAULT_LINK_GBPS = 55.2
DEFAULT_MASTER_GB = 24.0
SOAK_DRIFT_TARGET = 0.03
SOAK_P99_OVER_MEAN_TARGET = 1.8

SYNTHETIC_NOTE = (
    "weights are synthetic (random 4-bit of the named shape): attention patterns, hence "
    "selection locality, hit and miss rates, differ from a trained model's; speed and memory "
    "figures hold, miss rates do not. For miss rates under real locality record selection "
    "traces with the real small model (`hisparse run --trace FILE`) and replay them through "
    "cache policies with `hisparse replay`."
)
NOIO_NOTE = "noio skips host->device gathers (output invalid): a throughput ceiling only."
DENSE_NOTE = (
    "dense uses the reference dense attention, which materialises each layer's gathered K/V "
    "while it runs; that transient is not in the budget, so dense peaks may exceed it."
)
DENSE_TRITON_NOTE = (
    "dense uses paged flash-decoding over every page, read in place (the split-K sparse "
    "kernel with all pages selected), so the baseline is as fast as our kernels allow."
)
GRAPH_NOTE = (
    "decode steps replay CUDA graphs (one per batch size and page-table width); the "
    "breakdown is then GPU kernel time per phase from the profiler (idle = wall - busy: "
    "launch gaps and host work); breakdown_eager_ms is an instrumented eager step."
)
TIMING_NOTE = (
    "breakdown: GPU time between CUDA events around each wrapped op (linears = weights; "
    "quest scores / top-k / slot lists = select); launch gaps inside an op count toward it; "
    "other = step wall time - the phases (host overhead, norms, RoPE, sampling)."
)

RUN_FIELDS = (
    "mode",
    "context",
    "concurrency",
    "admitted",
    "status",
    "capacity",
    "decode_steps",
    "decode_tok_s",
    "step_ms_mean",
    "step_ms_p50",
    "step_ms_p99",
    "ttft_s",
    "prefill_tok_s",
    "prefill_method",
    "hits",
    "misses",
    "prefetched",
    "hit_rate",
    "h2d_bytes",
    "h2d_gbps",
    "gather_gbps",
    "peak_gpu_bytes",
    "peak_gpu_bytes_raw",
    "budget_bytes",
    "peak_over_budget",
    "pinned_host_bytes",
    "host_pool_bytes",
    "device_pool_bytes",
    "breakdown_ms",
    "breakdown_source",
    "breakdown_eager_ms",
    "top_kernels",
    "all_kernels",
    "alone_ms",
    "active_ms",
    "cuda_graph",
    "roofline",
    "token_sha256",
    "error",
)


# ----------------------------------------------------------------------------- spec


@dataclass(frozen=True)
class BenchSpec:
    """What to run. ``config`` is the resolved base engine config (preset < flags);
    each mode derives its own from it (:func:`mode_config`)."""

    model: str
    config: EngineConfig
    contexts: tuple[int, ...]
    concurrency: tuple[int, ...]
    out_dir: Path
    modes: tuple[str, ...] = DEFAULT_MODES
    decode_steps: int = 32
    warmup_steps: int = 4
    profile_steps: int = 4
    num_docs: int = 4
    master_gb: float = DEFAULT_MASTER_GB
    prefill: str = "auto"
    prefill_window: int = 1024
    soak_steps: int = 0
    soak_batch: int | None = None
    soak_every: int = 100
    soak_mode: str = "hierarchical"
    hbm_gbps: float | None = None
    link_gbps: float | None = None
    host_pool_gb: float | None = None
    time_limit_s: float | None = None
    corpus_dir: Path | None = None
    corpus_tokens: Path | None = None
    prefetch_pages: int | None = None

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the bad setting."""
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ConfigError(f"modes {bad or '(none)'}: choose from {', '.join(MODES)}")
        if self.soak_steps and self.soak_mode not in MODES:
            raise ConfigError(f"soak mode {self.soak_mode!r} is not one of {', '.join(MODES)}")
        self._validate_prefetch()
        if self.prefill not in PREFILL_METHODS:
            raise ConfigError(
                f"prefill {self.prefill!r} is not one of {', '.join(PREFILL_METHODS)}"
            )
        if not self.contexts or not self.concurrency:
            raise ConfigError("give at least one context and one concurrency level")
        if list(self.concurrency) != sorted(set(self.concurrency)) or self.concurrency[0] < 1:
            raise ConfigError(f"concurrency {list(self.concurrency)} must be ascending, >= 1")
        if self.config.memory_budget_gb is None:
            raise ConfigError("--memory-budget is required (GiB per device, every mode)")
        for name in ("decode_steps", "num_docs", "soak_every", "prefill_window"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        for t in self.contexts:
            if t - self.decode_reserve < self.config.page_size:
                raise ConfigError(
                    f"context {t} leaves no prompt after {self.decode_reserve} decode tokens"
                )

    def _validate_prefetch(self) -> None:
        """``--prefetch-pages`` only with the prefetch mode, >= 1, and every mode's
        config consistent (the prefetch mode's pages must fit the hot buffer)."""
        runs = set(self.modes) | ({self.soak_mode} if self.soak_steps else set())
        if self.prefetch_pages is not None:
            if self.prefetch_pages < 1:
                raise ConfigError(f"--prefetch-pages must be >= 1, got {self.prefetch_pages}")
            if "prefetch" not in runs:
                raise ConfigError(
                    "--prefetch-pages applies to the prefetch mode only; add prefetch to --modes"
                )
        for mode in sorted(runs):
            problems = mode_config(self.config, mode, self.prefetch_pages).problems()
            if not problems:
                continue
            where = f"mode {mode}"
            if mode == "prefetch":
                m = mode_config(self.config, mode, self.prefetch_pages).prefetch_pages
                if self.prefetch_pages is not None:
                    source = "--prefetch-pages"
                elif self.config.prefetch_pages:
                    source = "the preset's prefetch_pages"
                else:
                    source = "the default: a quarter of the top-k pages, at most the hot "
                    source += "buffer's spare pages"
                where = f"mode prefetch with {m} prefetch pages ({source})"
            raise ConfigError(f"{where}: " + "; ".join(p.message for p in problems))

    @property
    def decode_reserve(self) -> int:
        """Tokens each job may decode (warm-up, timed, instrumented and soak steps), whole
        pages; the prompt is the context less this."""
        sweep = self.warmup_steps + self.decode_steps + self.profile_steps
        soak = self.soak_steps + _soak_warmup(self.soak_steps) if self.soak_steps else 0
        s = self.config.page_size
        return -(-(max(sweep, soak) + 1) // s) * s


def default_prefetch_pages(base: EngineConfig) -> int:
    """Prefetch pages of the ``prefetch`` mode when none are given:
    :data:`DEFAULT_PREFETCH_FRACTION` of the top-k pages, at most the hot buffer's pages
    beyond what one step selects, at least 1."""
    share = round(base.top_k_pages * DEFAULT_PREFETCH_FRACTION)
    return max(1, min(share, base.buffer_pages - base.max_selected_pages))


def mode_config(
    base: EngineConfig, mode: str, prefetch_pages: int | None = None
) -> EngineConfig:
    """The engine config of ``mode`` (see the module notes), with the hierarchy's own resolve
    and gather (``cpu_direct_reads`` off); only ``prefetch`` has ``prefetch_pages``: ``prefetch_pages`` if given, else the base config's, else
    :func:`default_prefetch_pages`."""
    prefetch = prefetch_pages or base.prefetch_pages or default_prefetch_pages(base)
    changes = {
        "dense": {"attention": "dense", "hierarchical": False, "skip_host_io": False},
        "sparse": {"attention": "sparse", "hierarchical": False, "skip_host_io": False},
        "hierarchical": {"attention": "sparse", "hierarchical": True, "skip_host_io": False},
        "noio": {"attention": "sparse", "hierarchical": True, "skip_host_io": True},
        "copystream": {
            "attention": "sparse",
            "hierarchical": True,
            "skip_host_io": False,
            "decode_write_stream": True,
        },
        "prefetch": {
            "attention": "sparse",
            "hierarchical": True,
            "skip_host_io": False,
            "prefetch_pages": prefetch,
        },
        "sharedlink": {
            "attention": "sparse",
            "hierarchical": True,
            "skip_host_io": False,
            "gather_turns": False,
        },
    }[mode]
    # The bench measures the hierarchy itself, also on a CPU device, where the cpu preset
    # reads the pool in place (cpu_direct_reads: no resolve, no gather, no misses).
    return base.replace(**{"prefetch_pages": 0, "cpu_direct_reads": False, **changes})


def parse_int_list(text: str, parse: Callable[[str], int] = int) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``; ``parse`` reads each item (e.g. ``parse_context``)."""
    return tuple(parse(x.strip()) for x in text.split(",") if x.strip())


# ----------------------------------------------------------------------------- runs


@dataclass
class ModeEngine:
    """A mode's engine, its budget split, and how many jobs of a context it admits."""

    mode: str
    engine: Engine
    sizing: KVSizing
    capacity: int
    binding: str


def _step(engine: Engine, reqs: list[Request]) -> None:
    for r, tok in zip(reqs, engine.decode_step(reqs), strict=True):
        r.generated.append(tok)


def _open_jobs(
    engine: Engine, masters: list[MasterKV], level: int, tag: str, reserve: int
) -> list[Request]:
    """Admit up to ``level`` jobs (job j reuses document j mod D) and load their KV."""
    reqs = []
    for j in range(level):
        m = masters[j % len(masters)]
        job = Job(f"{tag}-{j}", m.prompt_ids, SamplingParams(max_tokens=reserve))
        try:
            req = engine.open_request(job)
        except CacheFullError:
            break
        import_kv(engine.cache, req.seq_id, m)
        req.generated = [m.first_token]
        req.phase = "decode"
        req.t_first = time.monotonic()
        reqs.append(req)
    return reqs


class _Chain:
    """Decode steps of one batch as the engine's run loop issues them: with
    ``engine.async_decode`` each call launches the next step before reading the one in
    flight (the device feeds the greedy tokens on; see ``Engine._decode_turn``), else it
    launches and reads one step. :meth:`step` returns the counters of the step it read
    (none on the first asynchronous call); :meth:`flush` reads the last one. Every
    launched step is read, so a run of ``n`` calls plus a flush decodes ``n`` tokens."""

    def __init__(self, engine: Engine, reqs: list[Request]):
        self.engine, self.reqs = engine, reqs
        self.prev = None

    def step(self) -> tuple[int, int, int] | None:
        eng = self.engine
        if not eng.async_decode:
            return self._read(eng.launch_step(self.reqs))
        nxt = eng.launch_step(self.reqs, self.prev)
        read = self._read(self.prev) if self.prev is not None else None
        self.prev = nxt
        return read

    def flush(self) -> tuple[int, int, int] | None:
        prev, self.prev = self.prev, None
        return self._read(prev) if prev is not None else None

    def _read(self, handle) -> tuple[int, int, int]:
        tokens, hits, misses, prefetched = self.engine.read_step(handle)
        for r, tok in zip(self.reqs, tokens, strict=True):
            r.generated.append(tok)
        return sum(hits), sum(misses), sum(prefetched)


def _run_steps(engine: Engine, reqs: list[Request], steps: int) -> None:
    """``steps`` decode steps of ``reqs`` (warm-up; soak), issued as :class:`_Chain` does."""
    chain = _Chain(engine, reqs)
    for _ in range(steps):
        chain.step()
    chain.flush()


def _decode_timed(
    engine: Engine, reqs: list[Request], steps: int
) -> tuple[list[float], int, int, int]:
    """Step wall times (s) and the hits / misses / prefetched records over ``steps``
    steps. A step's time is the interval between the host's reads of consecutive steps
    (launch to read for the first), as the run loop sees it."""
    chain = _Chain(engine, reqs)
    totals = [0, 0, 0]
    times = []
    last = time.perf_counter()
    for i in range(steps + 1):
        read = chain.step() if i < steps else chain.flush()
        if read is None:
            continue
        now = time.perf_counter()
        times.append(now - last)
        last = now
        totals = [t + x for t, x in zip(totals, read, strict=True)]
    return times, totals[0], totals[1], totals[2]


def _step_loaded_bytes(engine: Engine, reqs: list[Request]) -> int:
    """One synchronous decode step; the bytes it moved host -> device (missed and
    prefetched records; 0 with ``skip_host_io``)."""
    _step(engine, reqs)
    attn = engine.attn
    if engine.config.skip_host_io or attn.misses is None or attn.prefetched is None:
        return 0
    return int(attn.misses.sum() + attn.prefetched.sum()) * engine.cache.record_bytes


def _profile(engine: Engine, reqs: list[Request], steps: int) -> dict[str, Any]:
    """The step-time breakdown (mean ms per phase). With CUDA graphs: GPU kernel time per
    phase of the replayed steps themselves (profiler records, :func:`kernel_breakdown`),
    plus the eager instrumented pass as ``breakdown_eager_ms``; without: the eager pass."""
    if steps < 1:
        return {"breakdown_ms": None, "gather_gbps": None}
    eager = _profile_eager(engine, reqs, steps)
    if engine.graphs is None or engine.graphs.disabled_reason:
        return eager
    moved = [0]
    chain = _Chain(engine, reqs)
    record_bytes = 0 if engine.config.skip_host_io else engine.cache.record_bytes

    def count(read: tuple[int, int, int] | None) -> None:
        if read is not None:
            moved[0] += (read[1] + read[2]) * record_bytes

    def one_step() -> None:
        count(chain.step())

    try:
        kb = kernel_breakdown(one_step, steps)
    except Exception as e:  # noqa: BLE001 - a profiler failure must not lose the point
        chain.flush()
        return {**eager, "breakdown_source": f"eager (kernel profile failed: {e!r})"}
    count(chain.flush())
    gather_ms = kb["breakdown_ms"]["gather"] * steps
    return {
        "breakdown_ms": kb["breakdown_ms"],
        "breakdown_source": "cuda-graph kernels (profiler)",
        "top_kernels": kb["kernels"],
        "all_kernels": kb["all_kernels"],
        "alone_ms": kb["alone_ms"],
        "active_ms": kb["active_ms"],
        "breakdown_eager_ms": eager["breakdown_ms"],
        "gather_gbps": moved[0] / (gather_ms / 1e3) / 1e9 if gather_ms > 0 and moved[0] else None,
    }


def _profile_eager(engine: Engine, reqs: list[Request], steps: int) -> dict[str, Any]:
    """Instrumented eager steps on an engine sharing ``engine``'s cache: mean ms per phase."""
    timer = PhaseTimer(engine.cache.device)
    prof = Engine(
        timed_model(engine.model, timer),
        engine.tokenizer,
        engine.config,
        timed_ops(engine.ops, timer),
        engine.context_limit,
        cache=engine.cache,
    )
    prof.step = engine.step
    sums: dict[str, float] = defaultdict(float)
    moved = 0
    for _ in range(steps):
        timer.reset()
        sync(engine.cache.device)
        t0 = time.perf_counter()
        moved += _step_loaded_bytes(prof, reqs)
        wall_ms = (time.perf_counter() - t0) * 1e3
        phases = timer.totals_ms()
        for p in PHASES:
            sums[p] += phases.get(p, 0.0)
        sums["total"] += wall_ms
    engine.step = prof.step
    mean = {p: sums[p] / steps for p in (*PHASES, "total")}
    mean["other"] = max(mean["total"] - sum(mean[p] for p in PHASES), 0.0)
    gather_s = sums["gather"] / 1e3
    return {
        "breakdown_ms": mean,
        "breakdown_source": "eager steps, CUDA events around each op",
        "gather_gbps": moved / gather_s / 1e9 if gather_s > 0 and moved else None,
    }


def run_point(
    me: ModeEngine,
    masters: list[MasterKV],
    context: int,
    level: int,
    spec: BenchSpec,
    prefill: dict[str, Any],
) -> dict[str, Any]:
    """One (mode, context, concurrency) measurement; releases its jobs at the end."""
    engine, cache = me.engine, me.engine.cache
    dev = cache.device
    outside = _device_allocated(dev) - engine.model.weight_bytes - _cache_tensor_bytes(cache)
    _reset_peak(dev)
    tag = f"{me.mode}-{format_context(context)}-c{level}"
    reqs = _open_jobs(engine, masters, level, tag, spec.decode_reserve)
    row = _empty_row(me.mode, context, level, me.capacity, spec, prefill)
    row.update(admitted=len(reqs), status="ok" if len(reqs) == level else "admission_stopped")
    row.update(_memory_fields(me, spec))
    if not reqs:
        return row
    try:
        _run_steps(engine, reqs, spec.warmup_steps)
        times, hits, misses, prefetched = _decode_timed(engine, reqs, spec.decode_steps)
        row.update(_decode_fields(me, reqs, times, hits, misses, prefetched, spec))
        row.update(_profile(engine, reqs, spec.profile_steps))
        _idle_of_timed_steps(row)
        row["cuda_graph"] = engine.graphs is not None and not engine.graphs.disabled_reason
        row["token_sha256"] = [_sha(r.generated) for r in reqs]
        raw = _peak(dev)
        row["peak_gpu_bytes_raw"] = raw
        if raw is not None:
            row["peak_gpu_bytes"] = raw - outside
            row["peak_over_budget"] = row["peak_gpu_bytes"] > row["budget_bytes"]
    finally:
        for r in reqs:
            engine.close_request(r)
    return row


def _idle_of_timed_steps(row: dict[str, Any]) -> None:
    """Add ``idle_timed`` to a CUDA-graph breakdown: the timed (unprofiled) mean step less
    the profiled GPU kernel time. The profiled step's own ``idle`` includes the profiler's
    overhead, so it overstates the gaps a run sees."""
    bd = row.get("breakdown_ms")
    if not bd or "gpu_busy" not in bd or not row.get("step_ms_mean"):
        return
    bd["idle_timed"] = max(row["step_ms_mean"] - bd["gpu_busy"], 0.0)


def _decode_fields(me, reqs, times, hits, misses, prefetched, spec) -> dict[str, Any]:
    cfg, cache = me.engine.config, me.engine.cache
    total_s = sum(times)
    loaded = misses + prefetched
    moved = 0 if (cfg.skip_host_io or not cache.hierarchical) else loaded * cache.record_bytes
    ms = sorted(t * 1e3 for t in times)
    mean_ms = total_s * 1e3 / len(times)
    pages = [cache.pages_for(r.num_tokens) for r in reqs]
    return {
        "decode_tok_s": len(reqs) * len(times) / total_s,
        "step_ms_mean": mean_ms,
        "step_ms_p50": _percentile(ms, 50),
        "step_ms_p99": _percentile(ms, 99),
        "hits": hits if cache.hierarchical else None,
        "misses": misses if cache.hierarchical else None,
        "prefetched": prefetched if cache.hierarchical else None,
        "hit_rate": hits / (hits + misses) if cache.hierarchical and hits + misses else None,
        "h2d_bytes": moved,
        "h2d_gbps": moved / total_s / 1e9,
        "roofline": None
        if spec.hbm_gbps is None or spec.link_gbps is None  # a CPU's: left out
        else roofline(
            me.engine.model, cfg, pages, loaded / len(times), mean_ms, spec.hbm_gbps, spec.link_gbps
        ),
    }


def _memory_fields(me: ModeEngine, spec: BenchSpec) -> dict[str, Any]:
    cache = me.engine.cache
    host = cache.pool_bytes_total if cache.hierarchical else 0
    pinned = host if cache.hierarchical and cache.device.type == "cuda" else 0
    return {
        "budget_bytes": me.sizing.budget_bytes,
        "host_pool_bytes": host,
        "pinned_host_bytes": pinned,
        "device_pool_bytes": 0 if cache.hierarchical else cache.pool_bytes_total,
    }


def _empty_row(mode, context, level, capacity, spec, prefill) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(RUN_FIELDS)
    row.update(
        mode=mode,
        context=context,
        concurrency=level,
        capacity=capacity,
        admitted=0,
        decode_steps=spec.decode_steps,
        ttft_s=prefill.get("ttft_s"),
        prefill_tok_s=prefill.get("prefill_tok_s"),
        prefill_method=prefill.get("method"),
    )
    return row


# ----------------------------------------------------------------------------- engines


def _cache_tensor_bytes(cache: KVCache) -> int:
    """Bytes of the cache's tensors on its compute device."""
    tensors = [
        *cache.pool,
        *cache.meta,
        *cache.slots,
        *(t for t in cache.slot_scale if t is not None),
        *cache.page_table,
        *cache.slot_page,
        *cache.slot_last_use,
    ]
    return sum(t.nbytes for t in tensors if t.device.type == cache.device.type)


def hierarchical_pool_pages(
    need_pages: int, cap_bytes: int, model_cfg, config: EngineConfig, pinned: bool
) -> int:
    """Host pool pages for the hierarchical modes: ``need_pages`` capped by ``cap_bytes``.

    Pinned pools are registered in exact chunks (:class:`engine.kv.host_pool.HostPool`),
    so no rounding applies; ``pinned`` is kept for callers and reports.
    """
    layer_page = pool_page_bytes(model_cfg, config) // model_cfg.num_layers
    per_layer_cap = cap_bytes // model_cfg.num_layers
    pages = min(need_pages, per_layer_cap // layer_page)
    if pages < 1:
        raise ConfigError(f"host pool cap {cap_bytes / GIB:.2f} GiB holds no KV page")
    return pages


def _host_cap_bytes(spec: BenchSpec) -> int:
    """``--host-pool`` as given; else the preset's ``host_pool_gb`` capped at 80 % of the
    available RAM less 4 GiB."""
    if spec.host_pool_gb is not None:
        return int(spec.host_pool_gb * GIB)
    cap = int(spec.config.host_pool_gb * GIB)
    avail = available_host_bytes()
    if avail is not None:
        cap = min(cap, int(avail * 0.8) - 4 * GIB)
    return max(cap, 0)


def build_mode_engine(
    mode: str,
    model: LlamaModel,
    tokenizer,
    ops: Ops,
    spec: BenchSpec,
    context: int,
    shared: dict[str, Any],
) -> ModeEngine:
    """The engine of ``mode`` for ``context``: resident modes get a fresh budget-sized
    pool; the hierarchical modes share one host pool for the whole run (``shared``)."""
    cfg = mode_config(spec.config, mode, spec.prefetch_pages)
    pages_per_job = context // cfg.page_size
    if not cfg.hierarchical or cfg.attention == "dense":
        cfg, cache, sizing = budget_cache(model, cfg, context)
        engine = Engine(model, tokenizer, cfg, ops, context, cache=cache)
        return ModeEngine(mode, engine, sizing, sizing.max_jobs(pages_per_job), "device pool")
    if "hier_cache" not in shared:
        need = max(spec.concurrency) * max(spec.contexts) // cfg.page_size
        pinned = model.device.type == "cuda"
        pages = hierarchical_pool_pages(need, _host_cap_bytes(spec), model.config, cfg, pinned)
        hcfg, cache, sizing = budget_cache(model, cfg, max(spec.contexts), num_pool_pages=pages)
        shared.update(hier_cache=cache, hier_sizing=sizing, hier_batch=hcfg.max_batch)
    cache, sizing = shared["hier_cache"], shared["hier_sizing"]
    cfg = cfg.replace(max_batch=shared["hier_batch"])
    if cfg.decode_write_stream and cache.pinned and not cache.deferred_writes:
        cache.defer_decode_writes()  # engines of the other modes still write inline
    engine = Engine(model, tokenizer, cfg, ops, context, cache=cache)
    by_pool = cache.num_pool_pages // pages_per_job
    by_device = (sizing.room_bytes - sizing.num_pool_pages * sizing.meta_page_bytes) // max(
        sizing.per_request_device_bytes, 1
    )
    limits = {
        "host pool": by_pool,
        "device (hot-buffer slabs)": by_device,
        "max_batch": cfg.max_batch,
    }
    binding = min(limits, key=lambda k: limits[k])
    return ModeEngine(mode, engine, sizing, min(by_pool, sizing.max_batch), binding)


# ----------------------------------------------------------------------------- soak


def _soak_warmup(steps: int) -> int:
    return min(10, max(steps // 10, 1))


def run_soak(
    me: ModeEngine, masters: list[MasterKV], context: int, spec: BenchSpec, batch: int
) -> dict[str, Any]:
    """Decode one batch for ``spec.soak_steps`` steps (after a short warm-up): step
    latency, memory drift and integrity checks every ``spec.soak_every`` steps."""
    engine, dev = me.engine, me.engine.cache.device
    tag = f"soak-{me.mode}-{format_context(context)}"
    reqs = _open_jobs(engine, masters, batch, tag, spec.decode_reserve)
    out: dict[str, Any] = {
        "mode": me.mode,
        "context": context,
        "batch": len(reqs),
        "steps": spec.soak_steps,
    }
    if not reqs:
        return {**out, "error": "no job admitted"}
    warm = _soak_warmup(spec.soak_steps)
    latencies, samples, checks, failure = [], [], 0, None
    try:
        _run_steps(engine, reqs, warm)
        samples.append((0, _memory_sample(dev)))
        for i in range(1, spec.soak_steps + 1):
            t0 = time.perf_counter()
            _step(engine, reqs)
            latencies.append((time.perf_counter() - t0) * 1e3)
            if i % spec.soak_every == 0 or i == spec.soak_steps:
                samples.append((i, _memory_sample(dev)))
                checks += 1
                try:
                    engine.cache.check_integrity()
                except AssertionError as e:
                    failure = f"step {i}: {e}"
                    break
    finally:
        for r in reqs:
            engine.close_request(r)
    return {**out, **_soak_summary(latencies, samples, checks, failure, warm, dev)}


def _soak_summary(latencies, samples, checks, failure, warm, device) -> dict[str, Any]:
    mean = sum(latencies) / len(latencies) if latencies else 0.0
    p99 = _percentile(sorted(latencies), 99) if latencies else 0.0
    first, last = samples[0][1], samples[-1][1]
    drift = (last - first) / first if first else 0.0
    return {
        "warmup_steps": warm,
        "step_ms": latencies,
        "step_ms_mean": mean,
        "step_ms_p50": _percentile(sorted(latencies), 50) if latencies else 0.0,
        "step_ms_p99": p99,
        "p99_over_mean": p99 / mean if mean else None,
        "memory_samples": [{"step": s, "bytes": b} for s, b in samples],
        "memory_kind": "cuda_allocated" if device.type == "cuda" else "process_rss",
        "memory_drift": drift,
        "integrity_checks": checks,
        "integrity_ok": failure is None,
        "integrity_failure": failure,
        "targets": {
            "memory_drift_max": SOAK_DRIFT_TARGET,
            "p99_over_mean_max": SOAK_P99_OVER_MEAN_TARGET,
        },
        "pass": failure is None
        and abs(drift) <= SOAK_DRIFT_TARGET
        and (p99 / mean if mean else 0.0) <= SOAK_P99_OVER_MEAN_TARGET,
    }


# ----------------------------------------------------------------------------- driver


@dataclass
class _Run:
    """What every context and mode of one bench run shares."""

    spec: BenchSpec
    model: LlamaModel
    tokenizer: Any
    ops: Ops
    streams: list[list[int]]
    method: str
    report: dict[str, Any]
    log: Callable[[str], None]
    t_start: float
    shared: dict[str, Any] = field(default_factory=dict)

    def out_of_time(self) -> bool:
        limit = self.spec.time_limit_s
        return limit is not None and time.monotonic() - self.t_start > limit


class BenchInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped :func:`run_bench` during the sweep: ``path`` is the ``bench.json``
    written with the ``runs`` done before, its ``status`` ``interrupted``."""

    def __init__(self, path: Path, runs: int) -> None:
        super().__init__(path, runs)
        self.path, self.runs = path, runs


def run_bench(spec: BenchSpec, log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Run the whole benchmark; writes ``bench.json`` (after every run; the CLI adds the plots).

    Raises
    ------
    BenchInterrupted
        Ctrl-C during the sweep (a ``KeyboardInterrupt``): ``bench.json`` is written with
        the runs done, its ``status`` ``interrupted``.
    ConfigError
        Bad settings (see :meth:`BenchSpec.validate`), or a budget that holds no weights.
    FileNotFoundError
        Model or corpus missing.
    """
    from engine.load import load_weights, place_model

    spec.validate()
    batch = max(*spec.concurrency, spec.soak_batch or 1)
    spec = dataclasses.replace(spec, config=spec.config.replace(max_batch=batch))
    t_start = time.monotonic()
    config = spec.config
    loaded = _load(spec, load_weights)
    rope_cfg = _rope_config(config, loaded[0].config, max(spec.contexts))
    placed = place_model(config, spec.model, rope_config=rope_cfg, weights=loaded)
    del loaded  # the placed model holds what it needs
    model, tokenizer, name, fmt = placed.model, placed.tokenizer, placed.name, placed.weight_format
    device = model.device
    spec, spec_bandwidths = _bandwidths(spec, device)
    free_device_memory()
    synthetic = name.startswith("synthetic:")
    method = spec.prefill if spec.prefill != "auto" else ("window" if synthetic else "full")
    if spec.corpus_tokens is not None:
        files, streams = read_corpus_tokens(spec.corpus_tokens, model.config.vocab_size)
    else:
        files, streams = corpus_streams(tokenizer, corpus_dir(spec.corpus_dir))
    report = _report_skeleton(spec, name, model, fmt, synthetic, method, files, spec_bandwidths)
    for line in header_lines(report):
        log(line)
    run = _Run(
        spec,
        model,
        tokenizer,
        placed.ops,
        streams,
        method,
        report,
        log,
        t_start,
    )
    try:
        for context in spec.contexts:
            _run_context(run, context)
    except KeyboardInterrupt as exc:  # Ctrl-C (SIGTERM where the caller makes it one)
        report["status"] = INTERRUPTED
        report["elapsed_s"] = time.monotonic() - t_start
        report.setdefault("plots", [])
        raise BenchInterrupted(write_report(report, spec.out_dir), len(report["runs"])) from exc
    report["status"] = COMPLETE
    run.shared.clear()
    free_device_memory()
    report["elapsed_s"] = time.monotonic() - t_start
    report.setdefault("plots", [])
    path = write_report(report, spec.out_dir)
    log(f"wrote {path}")
    return report


def measure_bandwidths(device: torch.device, gib: float = 2.0) -> tuple[float, float]:
    """Measured (HBM read GB/s, host->device GB/s) of ``device``: ``torch.sum`` over a
    ``gib`` GiB bf16 tensor (bytes read / time) and a copy of a pinned ``gib / 2`` GiB
    host tensor to the device; the median of 5 timed runs after one warm-up, CUDA events."""
    n = int(gib * GIB) // 2
    x = torch.ones(n, dtype=torch.bfloat16, device=device)
    host = torch.ones(n // 2, dtype=torch.bfloat16).pin_memory()
    dst = torch.empty(n // 2, dtype=torch.bfloat16, device=device)

    def median_ms(fn) -> float:
        fn()
        times = []
        for _ in range(5):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[2]

    hbm = x.nbytes / (median_ms(lambda: x.sum(dtype=torch.float32)) / 1e3) / 1e9
    link = host.nbytes / (median_ms(lambda: dst.copy_(host, non_blocking=True)) / 1e3) / 1e9
    return hbm, link


CPU_ROOFLINE_NOTE = (
    "roofline ratios left out on the CPU: the roofline reads weights and KV at a GPU's HBM "
    "bandwidth and misses over its host link, which this machine has not (--hbm-gbps and "
    "--link-gbps give it figures to compute them with)"
)


def _bandwidths(spec: BenchSpec, device: torch.device) -> tuple[BenchSpec, dict[str, Any]]:
    """Fill the roofline bandwidths the spec leaves unset: measured on CUDA, else the
    H200 defaults (:data:`DEFAULT_HBM_GBPS`, :data:`DEFAULT_LINK_GBPS`). Off CUDA, unless
    both are given, there is no roofline: both ``None`` (the rows' ``roofline`` is
    ``None``; :data:`CPU_ROOFLINE_NOTE` says why)."""
    info: dict[str, Any] = {"source": {}}
    hbm, link = spec.hbm_gbps, spec.link_gbps
    if device.type != "cuda" and None in (hbm, link):
        why = "none: no GPU here (give --hbm-gbps and --link-gbps)"
        source = dict.fromkeys(("hbm_gbps", "link_gbps"), why)
        info = {"hbm_gbps": None, "link_gbps": None, "source": source}
        return dataclasses.replace(spec, hbm_gbps=None, link_gbps=None), info
    measured = measure_bandwidths(device) if device.type == "cuda" and None in (hbm, link) else None
    for key, given, idx, default in (
        ("hbm_gbps", hbm, 0, DEFAULT_HBM_GBPS),
        ("link_gbps", link, 1, DEFAULT_LINK_GBPS),
    ):
        if given is not None:
            info[key], info["source"][key] = given, "given"
        elif measured is not None:
            info[key] = measured[idx]
            info["source"][key] = (
                "measured: torch.sum over 2 GiB bf16" if idx == 0 else "measured: pinned 1 GiB H2D"
            )
        else:
            info[key], info["source"][key] = default, "H200 default (no GPU to measure)"
    spec = dataclasses.replace(spec, hbm_gbps=info["hbm_gbps"], link_gbps=info["link_gbps"])
    return spec, info


def _run_context(run: _Run, context: int) -> None:
    """Prefill the context's documents once, then sweep every mode over them."""
    spec, model = run.spec, run.model
    prompt = context - spec.decode_reserve
    doc_bytes = (prompt // spec.config.page_size + 1) * pool_page_bytes(model.config, spec.config)
    room = int(spec.master_gb * GIB) // doc_bytes
    num_docs = max(1, min(spec.num_docs, max(spec.concurrency), room))
    docs = [document_ids(run.streams, i, prompt) for i in range(num_docs)]
    masters = prefill_documents(
        model, run.tokenizer, run.ops, spec.config, docs, run.method, spec.prefill_window
    )
    prefill = _prefill_summary(masters, run.method, spec)
    entry = {
        "context": context,
        "prompt_tokens": prompt,
        "decode_reserve": spec.decode_reserve,
        "num_docs": num_docs,
        "prefill": prefill,
        "sizing": {},
        "capacity": {},
    }
    run.report["contexts"].append(entry)
    run.log(
        f"{format_context(context)}: {num_docs} document(s) of {prompt} tokens prefilled once "
        f"({run.method}): TTFT {prefill['ttft_s']:.2f} s, {prefill['prefill_tok_s']:.0f} tok/s"
    )
    for mode in spec.modes:
        _run_mode(run, mode, context, masters, entry)
    del masters
    free_device_memory()


def _run_mode(run: _Run, mode: str, context: int, masters: list[MasterKV], entry: dict) -> None:
    """The concurrency sweep of one mode (until admission stops), then the soak if due."""
    spec, report, prefill = run.spec, run.report, entry["prefill"]
    try:
        me = build_mode_engine(mode, run.model, run.tokenizer, run.ops, spec, context, run.shared)
    except (ConfigError, CacheFullError, RuntimeError) as e:  # budget too small, OOM
        row = _empty_row(mode, context, spec.concurrency[0], 0, spec, prefill)
        row.update(status="error", error=str(e))
        report["runs"].append(row)
        run.log(point_line(row))
        free_device_memory()
        return
    entry["sizing"][mode] = me.sizing.to_dict()
    entry["capacity"][mode] = {"max_jobs": me.capacity, "binding": me.binding}
    ctx = format_context(context)
    run.log(f"{mode:>12} {ctx:>5} admits at most {me.capacity} job(s) ({me.binding})")
    for level in spec.concurrency:
        if run.out_of_time():
            row = _empty_row(mode, context, level, me.capacity, spec, prefill)
            row["status"] = "skipped_time_limit"
            report["runs"].append(row)
            continue
        row = _safe_point(me, masters, context, level, spec, prefill)
        report["runs"].append(row)
        run.log(point_line(row))
        write_report(report, spec.out_dir)
        if row["status"] != "ok":
            break
    due = spec.soak_steps and mode == spec.soak_mode and context == spec.contexts[0]
    if due and report["soak"] is None and not run.out_of_time():
        batch = spec.soak_batch or min(max(spec.concurrency), me.capacity)
        soak = run_soak(me, masters, context, spec, batch)
        report["soak"] = soak
        _log_soak(soak, run.log)
        write_report(report, spec.out_dir)
    del me
    free_device_memory()


def _safe_point(me, masters, context, level, spec, prefill) -> dict[str, Any]:
    try:
        return run_point(me, masters, context, level, spec, prefill)
    except (RuntimeError, MemoryError) as e:  # e.g. CUDA out of memory at this level
        row = _empty_row(me.mode, context, level, me.capacity, spec, prefill)
        row.update(status="error", error=f"{type(e).__name__}: {e}")
        free_device_memory()
        return row


def _log_soak(soak: dict[str, Any], log) -> None:
    if "error" in soak:
        log(f"soak: {soak['error']}")
        return
    log(
        f"soak {soak['mode']} batch {soak['batch']} x {soak['steps']} steps: mean "
        f"{soak['step_ms_mean']:.2f} ms, P99/mean {soak['p99_over_mean']:.2f} (target <= "
        f"{SOAK_P99_OVER_MEAN_TARGET}), memory drift {soak['memory_drift'] * 100:.2f} % (target <= "
        f"{SOAK_DRIFT_TARGET * 100:.0f} %), integrity {soak['integrity_checks']} checks "
        f"{'ok' if soak['integrity_ok'] else 'FAILED: ' + str(soak['integrity_failure'])}"
    )


def _prefill_summary(masters: list[MasterKV], method: str, spec: BenchSpec) -> dict[str, Any]:
    ttft = [m.prefill_s for m in masters]
    tokens = sum(m.num_tokens for m in masters)
    return {
        "method": method,
        "window_tokens": spec.prefill_window if method == "window" else None,
        "ttft_s": sum(ttft) / len(ttft),
        "prefill_tok_s": tokens / sum(ttft) if sum(ttft) > 0 else None,
        "per_document_s": ttft,
        "master_bytes": sum(m.nbytes for m in masters),
    }


def _report_skeleton(
    spec, name, model, fmt, synthetic, method, files, spec_bandwidths
) -> dict[str, Any]:
    notes = []
    if synthetic:
        notes.append(SYNTHETIC_NOTE)
    if method == "window":
        notes.append(
            f"prefill shortcut: attention over a local window "
            f"of {spec.prefill_window} tokens (+ up to one chunk); TTFT and prefill tok/s are the "
            "shortcut's; decode is real."
        )
    dev = model.device
    triton_ops = dev.type == "cuda" and spec.config.use_triton is not False
    notes += [NOIO_NOTE, DENSE_TRITON_NOTE if triton_ops else DENSE_NOTE]
    notes.append(GRAPH_NOTE if triton_ops and spec.config.cuda_graph else TIMING_NOTE)
    bw = spec_bandwidths
    notes.append(
        CPU_ROOFLINE_NOTE
        if bw["hbm_gbps"] is None
        else f"roofline bandwidths: HBM {bw['hbm_gbps']:.0f} GB/s ({bw['source']['hbm_gbps']}), "
        f"host link {bw['link_gbps']:.1f} GB/s ({bw['source']['link_gbps']})"
    )
    return {
        "format": REPORT_FORMAT,
        "version": 1,
        "status": RUNNING,
        "model": name,
        "model_shape": dataclasses.asdict(model.config),
        "synthetic": synthetic,
        "weight_format": fmt,
        "weights_bytes": model.weight_bytes,
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev)
        if dev.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "memory_budget_gb": spec.config.memory_budget_gb,
        "modes": list(spec.modes),
        "mode_configs": {
            m: mode_config(spec.config, m, spec.prefetch_pages).to_dict() for m in spec.modes
        },
        "contexts_requested": list(spec.contexts),
        "concurrency": list(spec.concurrency),
        "decode_steps": spec.decode_steps,
        "warmup_steps": spec.warmup_steps,
        "profile_steps": spec.profile_steps,
        "corpus": {
            "dir": str(spec.corpus_tokens or corpus_dir(spec.corpus_dir)),
            "files_in_order": files,
            "rule": "files sorted by name, concatenated; document i starts at file i mod F "
            "and wraps; job j uses document j mod D",
        },
        "roofline_bandwidths": dict(spec_bandwidths),
        "notes": notes,
        "seed_scenario": seed_scenario(),
        "contexts": [],
        "runs": [],
        "soak": None,
        "plots": [],
    }


# ----------------------------------------------------------------------------- helpers


def _load(spec: BenchSpec, load_weights) -> tuple[Any, Any, str]:
    """Weights, tokenizer and name. With ``corpus_tokens`` a synthetic model is built
    without its tokenizer (the embedded GGUF it comes from need not be installed); the
    engine then runs with no tokenizer (the bench never detokenizes)."""
    if spec.corpus_tokens is None:
        return load_weights(spec.model)
    if not spec.model.startswith("synthetic:"):
        raise ConfigError("--corpus-tokens holds embedded-tokenizer ids: synthetic models only")
    from engine.weights.synthetic import synthetic_shape, synthetic_weights

    cfg = synthetic_shape(spec.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return synthetic_weights(cfg, device=device), None, f"synthetic:{cfg.name}"


def _rope_config(config: EngineConfig, model_cfg, max_context: int) -> EngineConfig:
    """Extend the RoPE (context_policy extend) when a context exceeds the trained one."""
    if max_context <= model_cfg.max_position:
        return config
    return config.replace(context_policy="extend", max_context=max_context)


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile of an ascending list."""
    if not sorted_values:
        return 0.0
    pos = (len(sorted_values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _sha(tokens: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()[:16]


def _device_allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _memory_sample(device: torch.device) -> int:
    """Device bytes allocated (CUDA) or the process's resident set (CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

