"""Plots of a ``hisparse bench`` report (matplotlib, Agg): decode tokens/s against
concurrency per context, and the soak's step latency. Drawn by the CLI after
:func:`engine.measure.bench.run_bench` has written ``bench.json``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from engine.capacity.planner import format_context
from engine.measure.report import REPORT_FILE, REPORT_FORMAT, write_report
from hisparse_cli.results import marked_document


def plot_throughput(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """One PNG per context: decode tokens/s against concurrency, a line per mode; where
    admission stops the last point is marked with the number admitted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for context in report["contexts_requested"]:
        rows = [r for r in report["runs"] if r["context"] == context and r["admitted"]]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for mode in report["modes"]:
            pts = [r for r in rows if r["mode"] == mode and r["decode_tok_s"] is not None]
            if not pts:
                continue
            (line,) = ax.plot(
                [r["concurrency"] for r in pts], [r["decode_tok_s"] for r in pts], "o-", label=mode
            )
            for r in pts:
                if r["status"] == "admission_stopped":
                    ax.plot(r["concurrency"], r["decode_tok_s"], "x", color=line.get_color(), ms=12)
                    ax.annotate(
                        f"admits {r['admitted']}",
                        (r["concurrency"], r["decode_tok_s"]),
                        textcoords="offset points",
                        xytext=(4, -12),
                        fontsize=8,
                    )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent jobs")
        ax.set_ylabel("decode tokens/s (all jobs)")
        synth = " - synthetic weights" if report["synthetic"] else ""
        ax.set_title(
            f"{report['model']}, {format_context(context)}, {report['memory_budget_gb']} GiB budget{synth}",
            fontsize=9,
        )
        ax.grid(True, alpha=0.3)
        ax.legend()
        path = out_dir / f"throughput_{format_context(context)}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_soak(soak: dict[str, Any] | None, out_dir: Path) -> Path | None:
    """Step latency over the soak, with its mean and P99."""
    if not soak or not soak.get("step_ms"):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lat = soak["step_ms"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(lat) + 1), lat, lw=0.8, label="step latency")
    ax.axhline(
        soak["step_ms_mean"],
        color="k",
        ls="--",
        lw=0.8,
        label=f"mean {soak['step_ms_mean']:.2f} ms",
    )
    ax.axhline(
        soak["step_ms_p99"], color="r", ls=":", lw=0.8, label=f"P99 {soak['step_ms_p99']:.2f} ms"
    )
    ax.set_xlabel("decode step")
    ax.set_ylabel("ms")
    ax.set_title(
        f"soak: {soak['mode']}, batch {soak['batch']}, {format_context(soak['context'])}, "
        f"drift {soak['memory_drift'] * 100:.2f} %",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    path = out_dir / SOAK_PLOT
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


SOAK_PLOT = "soak_step_latency.png"
PLOT_NAME = re.compile(r"throughput_\d+[KM]?\.png|" + re.escape(SOAK_PLOT))
"""The names of the plots bench draws (:func:`plot_throughput`, :func:`plot_soak`)."""


def is_bench_report(data: bytes) -> bool:
    """Whether ``data``, the bytes of a ``bench.json``, is one bench wrote: a JSON object
    whose ``format`` is ``hisparse-bench``, or empty
    (:func:`~hisparse_cli.results.marked_document`); any other file is someone else's,
    which bench must not replace, ``--force`` or not."""
    return marked_document(data, {"format": REPORT_FORMAT})


def plot_names(contexts: list[int], soak: bool) -> list[str]:
    """The plots a bench of ``contexts`` (tokens; with a ``soak``) may draw."""
    names = [f"throughput_{format_context(c)}.png" for c in contexts]
    return names + ([SOAK_PLOT] if soak else [])


def remove_plots(out_dir: Path) -> list[str]:
    """Remove the plots an earlier bench drew in ``out_dir`` (files named as
    :data:`PLOT_NAME`; nothing else), so that a new run (``--force``) leaves none that
    its ``bench.json`` does not name. Returns their names, sorted."""
    if not out_dir.is_dir():
        return []
    removed = []
    for path in sorted(out_dir.iterdir()):
        if PLOT_NAME.fullmatch(path.name) and path.is_file() and not path.is_symlink():
            path.unlink()
            removed.append(path.name)
    return removed


def make_plots(report: dict[str, Any], out_dir: Path) -> list[str]:
    """All plots of a report (file names); none, with a note, without matplotlib."""
    try:
        names = [p.name for p in plot_throughput(report, out_dir)]
        soak_png = plot_soak(report.get("soak"), out_dir)
    except ImportError as e:
        report["notes"].append(f"no plots: {e} (rerun with --replot where matplotlib is installed)")
        return []
    return names + ([soak_png.name] if soak_png else [])


REPORT_KEYS = {"contexts_requested": list, "runs": list, "modes": list, "notes": list}
"""The fields of ``bench.json`` the plots read, and their JSON types."""


def replot(out_dir: Path) -> list[str]:
    """Redraw the plots of ``out_dir/bench.json`` (e.g. on a machine with matplotlib).

    Raises
    ------
    OSError
        No ``bench.json`` there, or it cannot be read.
    ValueError
        It is not JSON (a cut-off file), or not a bench report: another JSON value, a
        field the plots read missing or of another shape.
    """
    report = json.loads((out_dir / REPORT_FILE).read_text(encoding="utf-8"))
    if not isinstance(report, dict):
        raise ValueError("not a bench report (its JSON is not an object)")
    for key, kind in REPORT_KEYS.items():
        if not isinstance(report.get(key), kind):
            raise ValueError(f"not a bench report (no {key} list)")
    try:
        report["plots"] = make_plots(report, out_dir)
    except (KeyError, TypeError, AttributeError, IndexError) as exc:  # a run of another shape
        raise ValueError(f"not a bench report ({type(exc).__name__}: {exc})") from None
    write_report(report, out_dir)
    return report["plots"]
