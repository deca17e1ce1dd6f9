"""The terminal dashboard: pure render functions over :class:`RunState`, one ``Live``.

Every ``render_*`` function takes the state and the current time and returns a Rich
renderable without side effects, so tests can print it to a recording console.
:class:`LiveDashboard` owns the single :class:`rich.live.Live` and redraws at most
every ``refresh_s`` seconds, from the thread that feeds it events (no refresh thread
touches the state).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Self

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from engine.events import Event, JobFailed, JobFinished
from hisparse_cli.progress import (
    FINISHED_PHASES,
    DeviceMemory,
    JobRow,
    ProgressTracker,
    RunState,
    RunSummary,
    decode_tok_s_recent,
    decode_tok_s_run,
    h2d_gbps_recent,
    hit_rate,
    job_eta_s,
    job_tok_s,
    phase_counts,
    prefill_tok_s_recent,
)

PHASE_STYLES = {
    "queued": "dim",
    "prefill": "yellow",
    "decode": "cyan",
    "done": "green",
    "failed": "bold red",
    "cancelled": "magenta",
    "skipped": "dim",
}
MEMORY_PARTS = (
    ("weights", "weights", "blue"),
    ("hot KV", "hot_buffer", "magenta"),
    ("indexer meta", "metadata", "yellow"),
    ("activations", "activations", "cyan"),
)
BAR_WIDTH = 20


# ----------------------------------------------------------------------------- formatting


def fmt_bytes(num_bytes: float) -> str:
    """``1.50 GiB`` / ``12.0 MiB`` / ``512 B``."""
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:.2f} GiB"
    if num_bytes >= 2**20:
        return f"{num_bytes / 2**20:.1f} MiB"
    if num_bytes >= 2**10:
        return f"{num_bytes / 2**10:.1f} KiB"
    return f"{int(num_bytes)} B"


def fmt_seconds(seconds: float | None) -> str:
    """``-`` / ``0.42s`` / ``1m05s`` / ``2h03m``."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.2f}s" if seconds < 10 else f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def fmt_rate(value: float | None, unit: str = "tok/s", digits: int = 1) -> str:
    """``123.4 tok/s`` or ``-``."""
    return "-" if value is None else f"{value:,.{digits}f} {unit}".rstrip()


def fmt_percent(value: float | None) -> str:
    """``87.5%`` or ``-``."""
    return "-" if value is None else f"{100 * value:.1f}%"


def text_bar(fraction: float, width: int = BAR_WIDTH) -> str:
    """A bar of ``width`` cells, ``fraction`` of them full (``█`` full, ``░`` empty)."""
    full = round(max(0.0, min(1.0, fraction)) * width)
    return "█" * full + "░" * (width - full)


# ----------------------------------------------------------------------------- renderers


def render_dashboard(state: RunState, now: float, max_rows: int = 20) -> RenderableType:
    """The whole dashboard: header, memory, throughput and the job table."""
    parts: list[RenderableType] = [render_header(state, now)]
    if state.memory or state.host_pool_total:
        parts.append(render_memory(state))
    parts.append(render_throughput(state, now))
    parts.append(render_jobs(state, now, max_rows))
    return Group(*parts)


def render_header(state: RunState, now: float) -> Text:
    """One line: elapsed time and job counts by phase (plus a cancelling notice)."""
    counts = phase_counts(state)
    shown = ", ".join(f"{n} {phase}" for phase, n in counts.items() if n)
    text = Text(f"hisparse  {fmt_seconds(now - state.started_t)}  jobs: {shown or 'none'}")
    if state.cancelling:
        text.append(
            "  cancelling: finishing running jobs (Ctrl-C again to stop now)", "bold yellow"
        )
    return text


def render_memory(state: RunState) -> Table:
    """Per device: weights / hot KV / indexer metadata / activations, then used / free /
    total; the host pool row has no parts, only used / free / total."""
    table = Table(title="memory", title_justify="left", expand=False)
    table.add_column("device")
    for label, _, style in MEMORY_PARTS:
        table.add_column(label, justify="right", style=style)
    table.add_column("used", justify="right", style="bold")
    table.add_column("free", justify="right", style="green")
    table.add_column("total", justify="right")
    table.add_column("use", no_wrap=True)
    for mem in state.memory.values():
        table.add_row(*_memory_row(mem))
    if state.host_pool_total:
        used, total = state.host_pool_used, state.host_pool_total
        parts = [""] * len(MEMORY_PARTS)  # the pool holds KV records, not these parts
        pool_bar = Text(text_bar(used / total), "blue")
        label = "host pool"
        if 0 < state.host_pool_pinned < total:  # page-locked in chunks as jobs need it
            label = f"host pool ({fmt_bytes(state.host_pool_pinned)} pinned)"
        table.add_row(label, *parts, *_totals(used, total - used, total), pool_bar)
    return table


def _memory_row(mem: DeviceMemory) -> list[RenderableType]:
    sizes = [fmt_bytes(getattr(mem, attr)) for _, attr, _ in MEMORY_PARTS]
    return [mem.device, *sizes, *_totals(mem.used, mem.free, mem.total), memory_bar(mem)]


def _totals(used: int, free: int, total: int) -> list[RenderableType]:
    """The used / free / total cells, in the table's column order."""
    return [fmt_bytes(used), fmt_bytes(max(0, free)), fmt_bytes(total)]


def memory_bar(mem: DeviceMemory, width: int = BAR_WIDTH) -> Text:
    """A stacked bar of the device's memory parts; free space as ``░``."""
    bar = Text()
    total = max(mem.total, mem.used, 1)
    for _, attr, style in MEMORY_PARTS:
        bar.append("█" * round(width * getattr(mem, attr) / total), style)
    bar.append("░" * max(0, width - len(bar.plain)), "dim")
    return bar


def render_throughput(state: RunState, now: float) -> Table:
    """Decode and prefill tokens/s, cache hit rate, host->device GB/s, token totals."""
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row(
        "decode (5 s)",
        fmt_rate(decode_tok_s_recent(state, now)),
        "decode (run)",
        fmt_rate(decode_tok_s_run(state, now)),
    )
    table.add_row(
        "prefill (5 s)",
        fmt_rate(prefill_tok_s_recent(state, now)),
        "cache hit rate",
        fmt_percent(hit_rate(state)),
    )
    table.add_row(
        "host→device (5 s)",
        fmt_rate(h2d_gbps_recent(state, now), "GB/s", 2),
        "copied",
        fmt_bytes(state.h2d_bytes),
    )
    table.add_row(
        "prefilled", f"{state.prefill_tokens:,.0f} tok", "generated", f"{state.decode_tokens:,} tok"
    )
    if state.audit.steps:
        table.add_row("audit (vs dense)", audit_text(state), "", "")
    return table


def audit_text(state: RunState) -> str:
    """The run's audit so far (``--audit``): top-1 agreement, mean KL(dense || sparse),
    mean attention mass kept and the audited steps, e.g. ``top-1 94% · KL 0.021 · mass
    88% · 16 steps``."""
    a = state.audit
    return (
        f"top-1 {fmt_percent(a.agreement)} · KL {a.kl_mean or 0.0:.3f} · "
        f"mass {fmt_percent(a.mass_kept)} · {a.steps} steps"
    )


def render_jobs(state: RunState, now: float, max_rows: int = 20) -> Table:
    """The job table: running first, then latest finished, then queued."""
    table = Table(title="jobs", title_justify="left")
    for name, justify in (
        ("id", "left"),
        ("in", "right"),
        ("phase", "left"),
        ("progress", "left"),
        ("TTFT", "right"),
        ("tok/s", "right"),
        ("ETA", "right"),
    ):
        table.add_column(name, justify=justify, no_wrap=name != "id")
    rows = visible_rows(state, max_rows)
    for row in rows:
        table.add_row(*job_cells(row, now))
    hidden = len(state.jobs) - len(rows)
    if hidden > 0:
        table.caption = f"… {hidden} more job(s) not shown"
    return table


def visible_rows(state: RunState, max_rows: int) -> list[JobRow]:
    """Which jobs fit: running, then most recently finished, then queued."""
    rows = list(state.jobs.values())
    running = [r for r in rows if r.phase in ("prefill", "decode")]
    finished = sorted(
        (r for r in rows if r.phase in FINISHED_PHASES and r.phase != "skipped"),
        key=lambda r: r.finished_t or 0.0,
        reverse=True,
    )
    queued = [r for r in rows if r.phase == "queued"]
    skipped = [r for r in rows if r.phase == "skipped"]
    return (running + finished + queued + skipped)[:max_rows]


def job_cells(row: JobRow, now: float) -> list[RenderableType]:
    """Cells of one job row: id, tokens in, phase, progress, TTFT, tok/s, ETA."""
    style = PHASE_STYLES.get(row.phase, "")
    return [
        row.id,
        f"{row.prompt_tokens:,}" if row.prompt_tokens else "-",
        Text(row.phase, style),
        job_progress(row),
        fmt_seconds(row.ttft_s),
        fmt_rate(job_tok_s(row, now), ""),
        fmt_seconds(job_eta_s(row, now)),
    ]


def job_progress(row: JobRow) -> Text:
    """Bar and figure: prefill share while prefilling, tokens / limit while decoding."""
    if row.phase == "prefill":
        return Text(
            f"{text_bar(row.prefill_fraction)} {100 * row.prefill_fraction:3.0f}%", "yellow"
        )
    if row.phase == "failed":
        return Text(row.error[:60], "red")
    if row.phase in ("queued", "skipped"):
        return Text("")
    limit = row.max_tokens or row.generated or 1
    done = 1.0 if row.phase == "done" else row.generated / limit
    return Text(
        f"{text_bar(done)} {row.generated}/{row.max_tokens or '?'}", PHASE_STYLES[row.phase]
    )


def render_summary(summary: RunSummary) -> Table:
    """The end-of-run table: jobs ok/failed/skipped, tokens, time, output dir."""
    table = Table(
        title="interrupted" if summary.interrupted else "summary",
        title_justify="left",
        show_header=False,
    )
    table.add_column(style="bold")
    table.add_column()
    table.add_row("jobs ok", str(summary.ok))
    table.add_row("failed", Text(str(summary.failed), "red" if summary.failed else ""))
    table.add_row("skipped (already done)", str(summary.skipped))
    if summary.cancelled or summary.not_run:
        table.add_row("cancelled / not run", f"{summary.cancelled} / {summary.not_run}")
    table.add_row("tokens in / out", f"{summary.prompt_tokens:,} / {summary.generated_tokens:,}")
    table.add_row(
        "time", f"{fmt_seconds(summary.wall_s)} ({fmt_rate(summary.decode_tok_s)} decode)"
    )
    table.add_row("output", summary.output_dir)
    if summary.preset:
        table.add_row("preset", summary.preset)
    return table


def finish_text(row: JobRow) -> Text:
    """One line when a job ends (printed above the live display)."""
    if row.phase == "failed":
        return Text(f"✗ {row.id}: {row.error}", "red")
    if row.phase == "cancelled":
        return Text(f"■ {row.id}: cancelled after {row.generated} tokens", "magenta")
    rate = fmt_rate(row.decode_tok_s)
    return Text(
        f"✓ {row.id}: {row.generated} tokens ({row.finish_reason}), TTFT {fmt_seconds(row.ttft_s)}, {rate}",
        "green",
    )


# ----------------------------------------------------------------------------- live


class LiveDashboard:
    """Reporter for a terminal: one ``Live`` redrawn from the event loop.

    Parameters
    ----------
    console
        The terminal console.
    tracker
        Source of the state to draw.
    clock
        ``time.monotonic`` or a test clock.
    refresh_s
        Minimum seconds between redraws.
    """

    def __init__(
        self,
        console: Console,
        tracker: ProgressTracker,
        clock: Callable[[], float] = time.monotonic,
        refresh_s: float = 0.25,
        max_rows: int = 20,
    ) -> None:
        self.console, self.tracker, self.clock = console, tracker, clock
        self.refresh_s, self.max_rows = refresh_s, max_rows
        self._live: Live | None = None
        self._drawn_t = float("-inf")

    def __enter__(self) -> Self:
        self._live = Live(self._render(), console=self.console, auto_refresh=False)
        self._live.start(refresh=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self._render(), refresh=True)
            self._live.stop()
            self._live = None

    def on_event(self, event: Event) -> None:
        """Print finish lines and redraw when due."""
        job_id = (
            event.result.job_id
            if isinstance(event, JobFinished)
            else getattr(event, "job_id", None)
        )
        if isinstance(event, JobFinished | JobFailed) and job_id in self.tracker.state.jobs:
            self.console.print(finish_text(self.tracker.state.jobs[job_id]))
        self.refresh()

    def refresh(self, force: bool = False) -> None:
        """Redraw if ``refresh_s`` has passed (or ``force``)."""
        now = self.clock()
        if self._live is not None and (force or now - self._drawn_t >= self.refresh_s):
            self._live.update(self._render(), refresh=True)
            self._drawn_t = now

    def note(self, message: str, level: str = "info") -> None:
        """Print a message above the display."""
        style = {"warning": "yellow", "error": "bold red"}.get(level, "")
        self.console.print(Text(message, style))

    def skipped(self, job_ids: list[str]) -> None:
        """Mention jobs skipped because results.jsonl already holds them."""
        if job_ids:
            self.note(f"skipping {len(job_ids)} job(s) already done (use --force to redo)")

    def summary(self, summary: RunSummary) -> None:
        """Print the end-of-run table."""
        self.console.print(render_summary(summary))

    def _render(self) -> RenderableType:
        return render_dashboard(self.tracker.state, self.clock(), self.max_rows)
