"""Figures and files of :mod:`engine.measure.bench`: the roofline model of a decode step, the
printed lines and ``bench.json``. The plots are drawn by :mod:`hisparse_cli.bench_plots`
(the engine never imports matplotlib)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from engine.capacity.budget import record_bytes
from engine.capacity.planner import GIB, format_context
from engine.config import ConfigError, EngineConfig
from engine.kv.sizing import dtype_bytes, host_record_bytes
from engine.model.llama import LlamaModel
from kernels.superpage_select import num_candidates

REPORT_FILE = "bench.json"
REPORT_FORMAT = "hisparse-bench"
"""``bench.json``'s ``format``: what tells a report bench wrote from another file of that
name."""
RUNNING, COMPLETE, INTERRUPTED = "running", "complete", "interrupted"
"""``bench.json``'s ``status``: the sweep goes on (what a killed bench leaves), ended, or was
stopped by Ctrl-C / SIGTERM (the report holds the runs done before)."""


# ----------------------------------------------------------------------------- roofline


def selected_pages(config: EngineConfig, num_pages: int) -> int:
    """Pages the indexer selects per (request, layer, KV head) in a context of
    ``num_pages`` pages (all of them for ``attention=dense``)."""
    if config.attention == "dense":
        return num_pages
    forced = min(num_pages, config.sink_pages + config.window_pages)
    return min(num_pages, max(config.top_k_pages, forced))


def weight_read_bytes(model: LlamaModel) -> int:
    """Weight bytes one decode step streams: each linear in the form decode reads it (the
    int4 packing and its scales, not a prefill-side copy) and the LM head; the embedding
    table is read by rows only and norms are negligible."""
    linears = [
        lin
        for layer in model.layers
        for lin in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)
    ]
    if model.lm_head is not None:
        linears.append(model.lm_head)
    return sum(_decode_read_bytes(lin) for lin in linears)


def _decode_read_bytes(lin) -> int:
    packed = getattr(lin, "packed", None)
    if packed is None:
        return lin.nbytes
    return packed.nbytes + lin.scales_and_zeros.nbytes


def roofline(
    model: LlamaModel,
    config: EngineConfig,
    pages: list[int],
    misses_per_step: float,
    measured_ms: float,
    hbm_gbps: float,
    link_gbps: float,
) -> dict[str, Any]:
    """Modelled step time: weights / HBM + selected KV / HBM + missed KV / host link
    (missed records as the host pool stores them: fp8 with ``kv_host_dtype=fp8``).

    ``pages`` are the jobs' context pages; ``misses_per_step`` records loaded per step
    (0 for resident modes and for ``noio``, which moves nothing).

    The Quest page metadata the indexer reads is counted apart: ``metadata_bytes`` is what
    a step reads (every page's key min / max, 1/S of the KV, with ``page_metadata=exact``;
    superpage rows + the candidates' page rows + the refreshed tail with ``superpage``,
    :func:`metadata_rows_per_head`), and ``modeled_with_metadata_ms`` /
    ``measured_over_roofline_with_metadata`` add it at HBM bandwidth; ``modeled_ms`` keeps
    the weights + KV model of earlier figures.
    """
    cfg = model.config
    rec = record_bytes(cfg, config)
    per_page = cfg.num_layers * cfg.num_kv_heads * rec
    weights = weight_read_bytes(model)
    selected = sum(selected_pages(config, p) for p in pages) * per_page
    moved = (
        0 if (config.skip_host_io or not config.hierarchical or config.attention == "dense") else 1
    )
    missed = int(misses_per_step * host_record_bytes(cfg, config) * moved)  # fp8: 2 S (D + 1)
    meta = 0
    if config.attention != "dense" and config.indexer == "quest":
        pair_row = cfg.num_layers * cfg.num_kv_heads * 2 * cfg.head_dim * dtype_bytes(config.kv_dtype)
        meta = sum(metadata_rows_per_head(config, p) for p in pages) * pair_row
    hbm, link = hbm_gbps * 1e9, link_gbps * 1e9
    modeled_ms = ((weights + selected) / hbm + missed / link) * 1e3
    with_meta_ms = modeled_ms + meta / hbm * 1e3
    return {
        "weight_bytes": weights,
        "selected_kv_bytes": selected,
        "missed_kv_bytes": missed,
        "metadata_bytes": meta,
        "hbm_gbps": hbm_gbps,
        "link_gbps": link_gbps,
        "modeled_ms": modeled_ms,
        "measured_ms": measured_ms,
        "measured_over_roofline": measured_ms / modeled_ms if modeled_ms > 0 else None,
        "modeled_with_metadata_ms": with_meta_ms,
        "measured_over_roofline_with_metadata": (
            measured_ms / with_meta_ms if with_meta_ms > 0 else None
        ),
    }


def metadata_rows_per_head(config: EngineConfig, num_pages: int) -> int:
    """Page-metadata pair rows (a key min and max of ``D`` values each) that one decode
    step's Quest selection reads per (job, layer, KV head) for a ``num_pages``-page
    context: every page with ``page_metadata=exact``; with ``superpage``, every
    superpage's row, the pages of the ``C`` best superpages (:func:`num_candidates`) and
    the newest superpage's pages, refreshed each step (the formula of
    :mod:`kernels.superpage_select`)."""
    if config.page_metadata != "superpage":
        return num_pages
    sp = config.superpage_pages
    supers = -(-num_pages // sp)
    c = min(num_candidates(config.top_k_pages, sp, config.superpage_oversample), supers)
    return supers + c * sp + sp


# ----------------------------------------------------------------------------- report


def seed_scenario() -> dict[str, Any]:
    """The planner's seed scenario (llama2-13b-gqa8 shape, 4-bit, 8 x 256K on ``dual4090``)."""
    from engine.capacity.planner import plan
    from engine.capacity.shapes import get_model_shape
    from engine.presets import load_preset_full, resolve_config

    command = "hisparse plan --preset dual4090 --model llama2-13b-gqa8 --jobs 8 --context 256K"
    try:
        preset = load_preset_full("dual4090")
        result = plan(
            get_model_shape("llama2-13b-gqa8"), resolve_config(preset), preset.hardware, 8, 256 * 1024
        )
    except (ConfigError, OSError) as e:
        return {"command": command, "error": str(e)}
    return {
        "command": command,
        "feasible": result.feasible,
        "job_kv_gib": result.job_kv_bytes / GIB,
        "host_needed_gib": result.host_needed_bytes / GIB,
        "dense_job_device_gib": result.dense_job_device_bytes / GIB,
        "dense_max_jobs": result.dense.max_jobs,
        "dense_holds_one_256k_job": result.dense.max_jobs >= 1,
        "hierarchical_max_jobs": result.capacity.max_jobs,
    }


def header_lines(report: dict[str, Any]) -> list[str]:
    """The printed header: what runs, under which budget, and what the figures mean."""
    lines = [
        f"hisparse bench: {report['model']} on {report['device']} ({report['device_name']}), "
        f"budget {report['memory_budget_gb']} GiB per device, modes {', '.join(report['modes'])}",
        f"contexts {', '.join(format_context(c) for c in report['contexts_requested'])}; "
        f"concurrency {report['concurrency']}; decode {report['decode_steps']} steps after "
        f"{report['warmup_steps']} warm-up",
    ]
    lines += [f"NOTE: {n}" for n in report["notes"]]
    seed = report.get("seed_scenario") or {}
    if "host_needed_gib" in seed:
        lines.append(
            f"planner seed scenario ({seed['command']}): host pool needs "
            f"{seed['host_needed_gib']:.0f} GiB; dense baseline needs {seed['dense_job_device_gib']:.1f} "
            f"GiB per 256K job and holds {seed['dense_max_jobs']} per 48 GB card"
        )
    return lines


def point_line(row: dict[str, Any]) -> str:
    """One printed line per run."""
    head = f"{row['mode']:>12} {format_context(row['context']):>5} c={row['concurrency']:<3}"
    if row["status"] == "admission_stopped" and not row["admitted"]:
        return f"{head} admission stopped: not one job fits"
    if row["status"] not in ("ok", "admission_stopped"):
        return f"{head} {row['status']}: {row.get('error') or ''}"
    hit = f"{row['hit_rate']:.3f}" if row["hit_rate"] is not None else "  -  "
    peak = (
        f"{row['peak_gpu_bytes'] / GIB:6.2f} GiB" if row["peak_gpu_bytes"] is not None else "   -  "
    )
    roof = ""  # none on a CPU (engine.measure.bench.CPU_ROOFLINE_NOTE)
    if row["roofline"] is not None:
        ratio = row["roofline"]["measured_over_roofline"]
        meta = row["roofline"].get("measured_over_roofline_with_metadata")
        roof = f"  x{ratio:.1f} roofline"
        roof += f" (x{meta:.1f} with metadata)" if meta and meta != ratio else ""
    prefetched = row.get("prefetched")
    pf = f"  prefetched {prefetched / row['decode_steps']:.0f}/step" if prefetched else ""
    stop = (
        f"  [admission stopped at {row['admitted']}]"
        if row["status"] == "admission_stopped"
        else ""
    )
    return (
        f"{head} {row['decode_tok_s']:9.1f} tok/s  step p50 {row['step_ms_p50']:7.2f} ms p99 "
        f"{row['step_ms_p99']:7.2f} ms  hit {hit}  h2d {row['h2d_gbps']:6.2f} GB/s  peak {peak}"
        f"{roof}{pf}{stop}"
    )


def write_report(report: dict[str, Any], out_dir: Path) -> Path:
    """Write ``bench.json`` atomically; returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / REPORT_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=_json_default), encoding="utf-8")
    tmp.replace(path)
    return path


def _json_default(obj):
    if isinstance(obj, Path):
        return str(obj)
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    return str(obj)
