"""The terminal dashboard: pure render functions over :class:`RunState`, one ``Live``.

Every ``render_*`` function takes the state and the current time and returns a Rich
renderable without side effects, so tests can print it to a recording console.
:class:`LiveDashboard` owns the single :class:`rich.live.Live` and redraws at most
every ``refresh_s`` seconds, from the thread that feeds it events (no refresh thread
touches the state).

It fits the terminal: at 80 x 24 the job table drops its bars first (the figures stay),
shortens only ids too long for their column, each to a form no other shown id has (head
and tail around ``…``), and ends with a ``+N more`` line for the jobs that do not fit; the
memory table drops its bar and uses short sizes (``4.0G``). Once the run has ended
(:meth:`~hisparse_cli.progress.ProgressTracker.finish`) every figure is taken at the end
time, so the last frame shows what the summary shows. Figures not known yet read ``-``.
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
from hisparse_cli.chunking import ChunkPartFinished
from hisparse_cli.display import escaped, terminal_text
from hisparse_cli.pipes import guard_consoles
from hisparse_cli.progress import (
    FINISHED_PHASES,
    RUNNING_PHASES,
    DeviceMemory,
    JobRow,
    ProgressTracker,
    RunState,
    RunSummary,
    chunk_label,
    chunk_step,
    decode_tok_s_recent,
    decode_tok_s_run,
    decoding_known,
    h2d_gbps_recent,
    hit_rate,
    job_eta_s,
    job_tok_s,
    phase_counts,
    prefill_tok_s_live,
    tokens_out,
)

PHASE_STYLES = {
    "queued": "dim",
    "map": "blue",
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
WIDE = 110
"""Console columns from which the job and memory tables show their bars."""
ID_MIN = 8


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


def fmt_bytes_short(num_bytes: float) -> str:
    """At most 5 characters: ``4.0G`` / ``512M`` / ``12K`` / ``0``."""
    for unit, size in (("T", 2**40), ("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if num_bytes >= size:
            value = num_bytes / size
            return f"{value:.1f}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return f"{int(num_bytes)}"


def short_ids(ids: list[str], width: int) -> dict[str, str]:
    """Each id as shown in a column of ``width`` characters: whole when it fits, else a
    head and a tail around ``…`` chosen so that no two shown ids read the same (ids that
    share a long prefix keep their differing tails; ids sharing a suffix keep their heads).
    Raises nothing; ``width`` below :data:`ID_MIN` counts as :data:`ID_MIN`."""
    width = max(ID_MIN, width)
    shown: dict[str, str] = {i: i for i in ids if len(i) <= width}
    used = set(shown.values())
    for ident in (i for i in ids if len(i) > width):
        room = width - 1
        candidates = [room // 3, 0, room, *range(1, room)]  # head chars; the tail is the rest
        for head in candidates:
            form = ident[:head] + "…" + (ident[len(ident) - (room - head) :] if room > head else "")
            if form not in used:
                break
        shown[ident] = form  # all forms taken (ids equal in their first and last chars): last
        used.add(form)
    return shown


def text_bar(fraction: float, width: int = BAR_WIDTH) -> str:
    """A bar of ``width`` cells, ``fraction`` of them full (``█`` full, ``░`` empty)."""
    full = round(max(0.0, min(1.0, fraction)) * width)
    return "█" * full + "░" * (width - full)


# ----------------------------------------------------------------------------- renderers


def render_dashboard(
    state: RunState, now: float, max_rows: int = 20, width: int | None = None,
    height: int | None = None,
) -> RenderableType:  # fmt: skip
    """The whole dashboard: header, memory, throughput and the job table, fitted to a
    console of ``width`` x ``height`` (``None``: no limit; ``max_rows`` caps the jobs)."""
    now = state.clock(now)
    parts: list[RenderableType] = [render_header(state, now)]
    used = 1 + 4  # header; throughput grid
    if state.memory or state.host_pool_total:
        parts.append(render_memory(state, width))
        used += 5 + len(state.memory) + (1 if state.host_pool_total else 0)
    parts.append(render_throughput(state, now))
    if height is not None:
        max_rows = max(1, min(max_rows, height - used - 7))  # job table: 6 lines + "+N more"
    parts.append(render_jobs(state, now, max_rows, width))
    return Group(*parts)


def chunk_parts(state: RunState) -> str:
    """``; chunk parts 4 done, 2 running, 3 queued`` while the chunk policy's map jobs
    (not counted as jobs) have not all ended, else ``""``."""
    parts = phase_counts(state, parts=True)
    running = parts["prefill"] + parts["decode"]
    if not running and not parts["queued"]:
        return ""
    return f"; chunk parts {parts['done']} done, {running} running, {parts['queued']} queued"


def render_header(state: RunState, now: float) -> Text:
    """One line: elapsed time and job counts by phase (plus a cancelling notice)."""
    counts = phase_counts(state)
    shown = ", ".join(f"{n} {phase}" for phase, n in counts.items() if n)
    text = Text(
        f"hisparse  {fmt_seconds(now - state.started_t)}  jobs: {shown or 'none'}"
        f"{chunk_parts(state)}"
    )
    if state.cancelling:
        text.append(
            "  cancelling: finishing running jobs (Ctrl-C again to stop now)", "bold yellow"
        )
    return text


SHORT_LABELS = {"indexer meta": "meta", "activations": "act"}


def render_memory(state: RunState, width: int | None = None) -> Table:
    """Per device: weights / hot KV / indexer metadata / activations, then used / free /
    total; the host pool row has no parts, only used / free / total. Below :data:`WIDE`
    columns: no bar, short sizes and labels (it fits 80 columns)."""
    wide = width is None or width >= WIDE
    size = fmt_bytes if wide else fmt_bytes_short
    table = Table(title="memory", title_justify="left", expand=False)
    table.add_column("device", no_wrap=True)
    for label, _, style in MEMORY_PARTS:
        table.add_column(
            label if wide else SHORT_LABELS.get(label, label), justify="right", style=style
        )
    table.add_column("used", justify="right", style="bold")
    table.add_column("free", justify="right", style="green")
    table.add_column("total", justify="right")
    if wide:
        table.add_column("use", no_wrap=True)
    for mem in list(state.memory.values()):
        bar = [memory_bar(mem)] if wide else []
        sizes = [size(getattr(mem, attr)) for _, attr, _ in MEMORY_PARTS]
        table.add_row(mem.device, *sizes, *_totals(mem.used, mem.free, mem.total, size), *bar)
    if state.host_pool_total:
        used, total = state.host_pool_used, state.host_pool_total
        parts = [""] * len(MEMORY_PARTS)  # the pool holds KV records, not these parts
        bar = [Text(text_bar(used / total), "blue")] if wide else []
        label = "host pool" if wide else "pool"
        if state.host_pool_dtype:
            label += f" {state.host_pool_dtype}"
        if 0 < state.host_pool_pinned < total:  # page-locked in chunks as jobs need it
            label += (
                f" ({size(state.host_pool_pinned)} pinned)"
                if wide
                else f" {size(state.host_pool_pinned)}p"
            )
        table.add_row(label, *parts, *_totals(used, total - used, total, size), *bar)
    return table


def _totals(
    used: int, free: int, total: int, size: Callable[[float], str] = fmt_bytes
) -> list[RenderableType]:
    """The used / free / total cells, in the table's column order."""
    return [size(used), size(max(0, free)), size(total)]


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
    decoding = decoding_known(state)
    table.add_row(
        "decode (5 s)",
        fmt_rate(decode_tok_s_recent(state, now) if decoding else None),
        "decode (run)",
        fmt_rate(decode_tok_s_run(state, now) if decoding else None),
    )
    table.add_row(
        "prefill (now)",
        fmt_rate(prefill_tok_s_live(state, now)),
        "cache hit rate",
        fmt_percent(hit_rate(state)),
    )
    table.add_row(
        "host→device (5 s)",
        fmt_rate(h2d_gbps_recent(state, now) if decoding else None, "GB/s", 2),
        "copied",
        fmt_bytes(state.h2d_bytes) if decoding else "-",
    )
    table.add_row(
        "prefilled", f"{state.prefill_tokens:,.0f} tok", "tokens out", f"{tokens_out(state):,} tok"
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


JOB_FIXED_COLUMNS = 7 + 9 + 9 + 5 + 7 + 5 + 2 * 7 + 8
"""Width of the job table less its id text, without bars: in (``100,000``), phase
(``cancelled``), progress figure (``1000/1000``), TTFT and ETA (``1m05s``), tok/s, each
cell's padding (2) and the 8 borders."""


def render_jobs(state: RunState, now: float, max_rows: int = 20, width: int | None = None) -> Table:
    """The job table: running first, then latest finished, then queued; then a
    ``+N more`` line for the jobs that do not fit. Below :data:`WIDE` columns the bars go
    and long ids are shortened apart (:func:`short_ids`)."""
    bars = width is None or width >= WIDE
    table = Table(title="jobs", title_justify="left", caption_justify="left")
    for name, justify in (
        ("id", "left"),
        ("in", "right"),
        ("phase", "left"),
        ("progress", "left"),
        ("TTFT", "right"),
        ("tok/s", "right"),
        ("ETA", "right"),
    ):
        table.add_column(name, justify=justify, no_wrap=True)
    rows = visible_rows(state, max_rows)
    id_width = (
        None
        if width is None
        else max(ID_MIN, width - JOB_FIXED_COLUMNS - (0 if not bars else BAR_WIDTH + 1))
    )
    names = short_ids([r.id for r in rows], id_width) if id_width else {r.id: r.id for r in rows}
    for row in rows:
        table.add_row(*job_cells(row, now, bars, names[row.id]))
    shown = {r.id for r in rows}
    hidden = [r for r in list(state.jobs.values()) if r.id not in shown]
    if hidden:
        counts: dict[str, int] = {}
        for r in hidden:
            counts[r.phase] = counts.get(r.phase, 0) + 1
        what = ", ".join(f"{n} {phase}" for phase, n in counts.items())
        table.caption = f"+{len(hidden)} more job(s) not shown ({what})"
    return table


def visible_rows(state: RunState, max_rows: int) -> list[JobRow]:
    """Which jobs fit: running, then most recently finished, then queued."""
    rows = list(state.jobs.values())
    running = [r for r in rows if r.phase in RUNNING_PHASES]
    finished = sorted(
        (r for r in rows if r.phase in FINISHED_PHASES and r.phase != "skipped"),
        key=lambda r: r.finished_t or 0.0,
        reverse=True,
    )
    queued = [r for r in rows if r.phase == "queued"]
    skipped = [r for r in rows if r.phase == "skipped"]
    return (running + finished + queued + skipped)[:max_rows]


def job_cells(
    row: JobRow, now: float, bars: bool = True, name: str | None = None
) -> list[RenderableType]:
    """Cells of one job row: id (or its shortened ``name``), tokens in (a chunked job's:
    its map jobs' that ended and its reduce step's, as its ``done`` line), phase (a
    chunked job's ``map``, ``map L2``, ``reduce``), progress, TTFT, tok/s, ETA."""
    style = PHASE_STYLES.get(row.phase, "")
    phase = chunk_label(row).rsplit(" ", 1)[0] if chunk_step(row) else row.phase
    tokens_in = row.prompt_tokens + row.part_prompt_tokens
    return [
        Text(name or row.id),
        f"{tokens_in:,}" if tokens_in else "-",
        Text(phase, style),
        job_progress(row, bars),
        fmt_seconds(row.ttft_s),
        fmt_rate(job_tok_s(row, now), ""),
        fmt_seconds(job_eta_s(row, now)),
    ]


def job_progress(row: JobRow, bar: bool = True) -> Text:
    """Bar (unless ``bar`` is off) and figure: prefill share while prefilling, tokens /
    limit while decoding, a chunked job's map jobs ended / all of its level; a chunked
    job that ended: its whole document's tokens out (``40 out``, as its ``done`` line)."""
    if row.phase == "map":
        figure = f"{row.level_done}/{row.level_parts}"
        fraction = row.level_done / row.level_parts if row.level_parts else 0.0
        return Text(f"{text_bar(fraction)} {figure}" if bar else figure, PHASE_STYLES["map"])
    if row.phase == "prefill":
        figure = f"{100 * row.prefill_fraction:3.0f}%"
        return Text(f"{text_bar(row.prefill_fraction)} {figure}" if bar else figure, "yellow")
    if row.phase == "failed":
        error = escaped(row.error)  # a file name's newline or escape sequence: shown as such
        return Text(error[:60] if bar else error[:10], "red")
    if row.phase in ("queued", "skipped"):
        return Text("")
    limit = row.max_tokens or row.generated or 1
    done = 1.0 if row.phase == "done" else row.generated / limit
    figure = f"{row.generated}/{row.max_tokens or '?'}"
    if row.parts and row.phase in FINISHED_PHASES:  # the reduce step's limit: not the job's
        figure = f"{row.generated + row.part_generated} out"
    return Text(f"{text_bar(done)} {figure}" if bar else figure, PHASE_STYLES[row.phase])


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
    if summary.refused:
        table.add_row("refused inputs", Text(f"{summary.refused} (not run)", "red"))
    if summary.cancelled or summary.not_run:
        table.add_row("cancelled / not run", f"{summary.cancelled} / {summary.not_run}")
    table.add_row("tokens in / out", f"{summary.prompt_tokens:,} / {summary.generated_tokens:,}")
    table.add_row(
        "time", f"{fmt_seconds(summary.wall_s)} ({fmt_rate(summary.decode_tok_s)} decode)"
    )
    table.add_row("output", Text(escaped(summary.output_dir)))  # Text: "[bold]" is a name
    if summary.preset:
        table.add_row("preset", Text(escaped(summary.preset)))
    return table


def finish_text(row: JobRow) -> Text:
    """One line when a job ends (printed above the live display)."""
    if row.phase == "failed":  # one line, as the plain reporter's (reporters.finish_line)
        return Text(f"✗ {row.id}: {escaped(row.error)}", "red")
    generated = row.generated + row.part_generated  # a chunked job's: its whole document's
    if row.phase == "cancelled":
        return Text(f"■ {row.id}: cancelled after {generated} tokens", "magenta")
    rate = fmt_rate(row.decode_tok_s)
    return Text(
        f"✓ {row.id}: {generated} tokens ({row.finish_reason}), TTFT {fmt_seconds(row.ttft_s)}, {rate}",
        "green",
    )


# ----------------------------------------------------------------------------- live


class LiveDashboard:
    """Reporter for a terminal: one ``Live`` redrawn from the event loop.

    Parameters
    ----------
    console
        The terminal console. Its file (and ``err_console``'s) is replaced by a
        :class:`hisparse_cli.pipes.PipeGuard` of it: a closed pipe (``FORCE_COLOR=1 hisparse
        run ... | head``) ends the output, not the run (Rich itself would exit).
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
        err_console: Console | None = None,
    ) -> None:
        self.console, self.tracker, self.clock = console, tracker, clock
        self.err_console = err_console or Console(stderr=True)
        guard_consoles(console, self.err_console)  # a closed pipe: dropped, not SystemExit
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
        """Print finish lines (map jobs' included) and redraw when due."""
        job_id = (
            event.result.job_id
            if isinstance(event, JobFinished)
            else event.part_id
            if isinstance(event, ChunkPartFinished)
            else getattr(event, "job_id", None)
        )
        ended = isinstance(event, JobFinished | JobFailed | ChunkPartFinished)
        if ended and job_id in self.tracker.state.jobs:
            row = self.tracker.state.jobs[job_id]  # a failure is an error: stderr
            (self.err_console if row.phase == "failed" else self.console).print(finish_text(row))
        self.refresh()

    def refresh(self, force: bool = False) -> None:
        """Redraw if ``refresh_s`` has passed (or ``force``)."""
        now = self.clock()
        if self._live is not None and (force or now - self._drawn_t >= self.refresh_s):
            self._live.update(self._render(), refresh=True)
            self._drawn_t = now

    def note(self, message: str, level: str = "info") -> None:
        """Print a message above the display: info on stdout, warnings and errors on
        stderr (Rich's ``Live`` keeps both above the display)."""
        style = {"warning": "yellow", "error": "bold red"}.get(level, "")
        text = Text(terminal_text(message), style)  # no escape sequence of a name: shown
        (self.console if level == "info" else self.err_console).print(text)

    def skipped(self, job_ids: list[str]) -> None:
        """Mention jobs skipped because results.jsonl already holds them."""
        if job_ids:
            self.note(f"skipping {len(job_ids)} job(s) already done (use --force to redo)")

    def summary(self, summary: RunSummary) -> None:
        """Print the end-of-run table."""
        self.console.print(render_summary(summary))

    def _render(self) -> RenderableType:
        size = self.console.size
        return render_dashboard(
            self.tracker.state, self.clock(), self.max_rows, size.width, size.height
        )
