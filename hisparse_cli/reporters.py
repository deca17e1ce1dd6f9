"""Progress for logs and machines: plain lines and JSON lines.

All reporters share one interface (context manager, ``on_event``, ``note``,
``skipped``, ``summary``) with :class:`~hisparse_cli.dashboard.LiveDashboard`:

- :class:`PlainReporter` (stdout is not a terminal): a progress line every
  ``interval_s`` seconds and one line per job that finishes or fails, each ending in a
  newline, nothing redrawn, so a CI log reads top to bottom.
- :class:`JsonReporter` (``--json-progress``): one JSON object per line on stdout.
  Job lifecycle events (``job_queued``, ``job_admitted``, ``first_token``,
  ``job_finished``, ``job_failed``, ``job_skipped``) are written as they happen;
  the high-rate ones (decode steps, prefill progress, memory snapshots) are folded
  into a ``progress`` object every ``interval_s`` seconds; ``warning`` and a final
  ``summary`` object complete the stream.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Callable
from typing import Any, Protocol, Self, TextIO

from rich.console import Console

from engine.events import (
    DecodeStep,
    Event,
    JobFailed,
    JobFinished,
    MemorySnapshot,
    PrefillProgress,
)
from hisparse_cli.dashboard import (
    LiveDashboard,
    fmt_bytes,
    fmt_percent,
    fmt_rate,
    fmt_seconds,
    render_summary,
)
from hisparse_cli.progress import (
    JobRow,
    ProgressTracker,
    RunState,
    RunSummary,
    decode_tok_s_recent,
    decode_tok_s_run,
    h2d_gbps_recent,
    hit_rate,
    phase_counts,
    prefill_tok_s_recent,
)

PLAIN_INTERVAL_S = 10.0
JSON_INTERVAL_S = 2.0
_PERIODIC_EVENTS = (DecodeStep, PrefillProgress, MemorySnapshot)


class Reporter(Protocol):
    """What the run loop talks to."""

    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> None: ...
    def on_event(self, event: Event) -> None: ...
    def note(self, message: str, level: str = "info") -> None: ...
    def skipped(self, job_ids: list[str]) -> None: ...
    def summary(self, summary: RunSummary) -> None: ...


def make_reporter(
    console: Console,
    tracker: ProgressTracker,
    json_progress: bool,
    clock: Callable[[], float] = time.monotonic,
) -> Reporter:
    """JSON lines if asked, the live dashboard on a terminal, plain lines otherwise."""
    if json_progress:
        return JsonReporter(console.file, tracker, clock=clock)
    if console.is_terminal:
        return LiveDashboard(console, tracker, clock=clock)
    return PlainReporter(console.file, tracker, clock=clock)


# ----------------------------------------------------------------------------- plain


def progress_line(state: RunState, now: float) -> str:
    """One status line: elapsed, jobs, throughput, cache, transfer and memory."""
    counts = phase_counts(state)
    total = len(state.jobs) - counts["skipped"]
    ended = counts["done"] + counts["failed"] + counts["cancelled"]
    running = counts["prefill"] + counts["decode"]
    parts = [
        (
            f"[{fmt_seconds(now - state.started_t):>6}] jobs {ended}/{total} ended "
            f"({counts['done']} ok, {counts['failed']} failed, {running} running, "
            f"{counts['queued']} queued)"
        ),
        f"decode {fmt_rate(decode_tok_s_recent(state, now))} (5 s), {fmt_rate(decode_tok_s_run(state, now))} run",
        f"prefill {fmt_rate(prefill_tok_s_recent(state, now))}",
        f"cache hit {fmt_percent(hit_rate(state))}",
        f"h2d {fmt_rate(h2d_gbps_recent(state, now), 'GB/s', 2)}",
    ]
    parts += [f"{m.device} {fmt_bytes(m.used)}/{fmt_bytes(m.total)}" for m in state.memory.values()]
    return " | ".join(parts)


def finish_line(row: JobRow) -> str:
    """One line for a job that ended."""
    if row.phase == "failed":
        return f"FAILED {row.id}: {row.error}"
    if row.phase == "cancelled":
        return f"cancelled {row.id} after {row.generated} tokens"
    return (
        f"done {row.id}: {row.prompt_tokens} tokens in, {row.generated} out ({row.finish_reason}), "
        f"TTFT {fmt_seconds(row.ttft_s)}, {fmt_rate(row.decode_tok_s)}"
    )


class PlainReporter:
    """Line-oriented progress for logs (see module docstring)."""

    def __init__(
        self,
        stream: TextIO,
        tracker: ProgressTracker,
        interval_s: float = PLAIN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream, self.tracker, self.interval_s, self.clock = stream, tracker, interval_s, clock
        self._printed_t = clock()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stream.flush()

    def on_event(self, event: Event) -> None:
        """A line per finished/failed job; a progress line when the interval has passed."""
        if isinstance(event, JobFinished | JobFailed):
            row = self.tracker.state.jobs.get(_job_id(event))
            if row is not None:
                self._write(finish_line(row))
        now = self.clock()
        if now - self._printed_t >= self.interval_s:
            self._write(progress_line(self.tracker.state, now))
            self._printed_t = now

    def note(self, message: str, level: str = "info") -> None:
        """Write ``message`` (prefixed by ``warning:``/``error:`` for those levels)."""
        self._write(message if level == "info" else f"{level}: {message}")

    def skipped(self, job_ids: list[str]) -> None:
        """One line for all skipped jobs."""
        if job_ids:
            self._write(f"skipping {len(job_ids)} job(s) already done (use --force to redo)")

    def summary(self, summary: RunSummary) -> None:
        """The summary table, rendered as plain text."""
        console = Console(file=self.stream, width=100, force_terminal=False, no_color=True)
        console.print(render_summary(summary))

    def _write(self, line: str) -> None:
        self.stream.write(line.rstrip("\n") + "\n")
        self.stream.flush()


# ----------------------------------------------------------------------------- JSON


def event_name(event: Event) -> str:
    """``JobFinished`` -> ``job_finished``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(event).__name__).lower()


def event_json(event: Event) -> dict[str, Any]:
    """JSON-ready form of a lifecycle event (a result loses its token ids)."""
    if isinstance(event, JobFinished):
        result = dataclasses.asdict(event.result)
        result["generated_tokens"] = len(result.pop("token_ids"))
        result["hit_rate"] = event.result.cache.hit_rate
        return {"event": "job_finished", "t": event.t, **result}
    return {"event": event_name(event), **dataclasses.asdict(event)}


def progress_json(state: RunState, now: float) -> dict[str, Any]:
    """The periodic ``progress`` object."""
    return {
        "event": "progress",
        "t": now,
        "elapsed_s": now - state.started_t,
        "jobs": phase_counts(state),
        "decode_tok_s": decode_tok_s_recent(state, now),
        "decode_tok_s_run": decode_tok_s_run(state, now),
        "prefill_tok_s": prefill_tok_s_recent(state, now),
        "hit_rate": hit_rate(state),
        "h2d_gbps": h2d_gbps_recent(state, now),
        "memory": {d: {**dataclasses.asdict(m), "free": m.free} for d, m in state.memory.items()},
        "host_pool": {
            "used": state.host_pool_used,
            "pinned": state.host_pool_pinned,
            "total": state.host_pool_total,
            "dtype": state.host_pool_dtype,
        },
    }


class JsonReporter:
    """JSON lines on ``stream`` (see module docstring)."""

    def __init__(
        self,
        stream: TextIO,
        tracker: ProgressTracker,
        interval_s: float = JSON_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream, self.tracker, self.interval_s, self.clock = stream, tracker, interval_s, clock
        self._printed_t = clock()
        self._pending = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pending:
            self._emit(progress_json(self.tracker.state, self.clock()))

    def on_event(self, event: Event) -> None:
        """Lifecycle events at once; the rest folded into periodic progress objects."""
        if isinstance(event, _PERIODIC_EVENTS):
            self._pending = True
        else:
            self._emit(event_json(event))
        now = self.clock()
        if self._pending and now - self._printed_t >= self.interval_s:
            self._emit(progress_json(self.tracker.state, now))
            self._printed_t, self._pending = now, False

    def note(self, message: str, level: str = "info") -> None:
        """A ``{"event": "<level>", "message": ...}`` object."""
        self._emit({"event": level, "message": message})

    def skipped(self, job_ids: list[str]) -> None:
        """One ``job_skipped`` object per job."""
        for job_id in job_ids:
            self._emit({"event": "job_skipped", "job_id": job_id, "reason": "already done"})

    def summary(self, summary: RunSummary) -> None:
        """The final ``summary`` object."""
        self._emit({"event": "summary", **dataclasses.asdict(summary)})

    def _emit(self, obj: dict[str, Any]) -> None:
        self.stream.write(json.dumps(obj, ensure_ascii=False, default=str) + "\n")
        self.stream.flush()


def _job_id(event: JobFinished | JobFailed) -> str:
    return event.result.job_id if isinstance(event, JobFinished) else event.job_id
