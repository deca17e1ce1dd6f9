"""What ``hisparse eval`` shows and writes: the accuracy table (Rich) and its heatmap
(matplotlib, Agg; optional: without matplotlib the PNG is skipped with a note)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from rich.table import Table

from hisparse_cli.results import marked_document

HEATMAP_FILE = "eval.png"
REPORT_FORMAT = "hisparse-eval"
"""``eval.json``'s ``format``: what tells a report eval wrote from another file of that
name (:func:`is_eval_report`), as ``bench.json``'s ``hisparse-bench`` does."""
EARLIER_KEYS = ("model", "configs", "samples", "table")
"""Keys every ``eval.json`` eval wrote has, those of versions before :data:`REPORT_FORMAT`
included."""


def is_eval_report(data: bytes) -> bool:
    """Whether ``data``, the bytes of an ``eval.json``, is one eval wrote: a JSON object
    whose ``format`` is :data:`REPORT_FORMAT` or (earlier versions) one with
    :data:`EARLIER_KEYS` and ``table`` a list, or empty
    (:func:`~hisparse_cli.results.marked_document`); any other file is someone else's,
    which eval must not replace, ``--force`` or not."""
    def earlier(document: dict) -> bool:
        return all(k in document for k in EARLIER_KEYS) and isinstance(document["table"], list)

    return marked_document(data, {"format": REPORT_FORMAT}, earlier)


def cells(report: dict[str, Any]) -> tuple[list[tuple[str, int]], list[str], dict]:
    """Rows ``(task, length)`` and configuration names in report order, and the accuracy
    of each ``(task, length, config)``."""
    rows, configs, acc = [], [], {}
    for c in report["table"]:
        key = (c["task"], c["length"])
        if key not in rows:
            rows.append(key)
        if c["config"] not in configs:
            configs.append(c["config"])
        acc[(c["task"], c["length"], c["config"])] = c["accuracy"]
    return rows, configs, acc


def accuracy_table(report: dict[str, Any]) -> Table:
    """Accuracy (%) per task x length (rows) and configuration (columns); a sparse cell
    shows its difference from dense where the report has a dense column."""
    rows, configs, acc = cells(report)
    n = {(c["task"], c["length"]): c["samples"] for c in report["table"]}
    table = Table(title=f"hisparse eval: accuracy (%) - {report['model']}")
    for head in ("task", "length", "samples", *configs):  # long names wrap, never cut
        table.add_column(head, justify="left" if head == "task" else "right", overflow="fold")
    for task, length in rows:
        dense = acc.get((task, length, "dense"))
        out = []
        for c in configs:
            a = acc[(task, length, c)]
            delta = "" if dense is None or c == "dense" else f" ({a - dense:+.0f})"
            out.append(f"{a:.0f}{delta}")
        table.add_row(task, str(length), str(n[(task, length)]), *out)
    return table


def markdown_table(report: dict[str, Any]) -> str:
    """The same table in Markdown (for docs/performance.md)."""
    rows, configs, acc = cells(report)
    lines = [
        "| task | length | " + " | ".join(configs) + " |",
        "|---|---:|" + "---:|" * len(configs),
    ]
    for task, length in rows:
        vals = " | ".join(f"{acc[(task, length, c)]:.0f}" for c in configs)
        lines.append(f"| {task} | {length} | {vals} |")
    return "\n".join(lines)


def heatmap(report: dict[str, Any], path: Path) -> str:
    """Draw the accuracy heatmap to ``path``; returns ``""`` or why it was not drawn
    (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no heatmap: {e} (pip install matplotlib, then rerun)"
    rows, configs, acc = cells(report)
    grid = [[acc[(t, n, c)] for c in configs] for t, n in rows]
    fig, ax = plt.subplots(figsize=(2.4 + 1.3 * len(configs), 1.8 + 0.45 * len(rows)))
    im = ax.imshow(grid, vmin=0, vmax=100, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(configs)), configs, rotation=30, ha="right")
    ax.set_yticks(range(len(rows)), [f"{t} @ {n}" for t, n in rows])
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.0f}", ha="center", va="center", color="w" if v < 60 else "k")
    fig.colorbar(im, ax=ax, label="accuracy (%)")
    ax.set_title(f"hisparse eval - {report['model']}")
    with warnings.catch_warnings():  # long config names: a looser layout, not a warning
        warnings.filterwarnings("ignore", "Tight layout not applied", UserWarning)
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return ""


def write_report(report: dict[str, Any], out_dir: Path, name: str) -> Path:
    """``out_dir/name`` (JSON, indented; ``format`` :data:`REPORT_FORMAT` first), written
    whole then renamed into place."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    tmp = path.with_suffix(".json.tmp")
    report = {"format": REPORT_FORMAT, **report}
    tmp.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path
