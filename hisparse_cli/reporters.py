"""Progress for logs and machines: plain lines and JSON lines.

All reporters share one interface (context manager, ``on_event``, ``note``,
``skipped``, ``summary``) with :class:`~hisparse_cli.dashboard.LiveDashboard`:

- :class:`PlainReporter` (stdout is not a terminal): a progress line every
  ``interval_s`` seconds (from a timer thread, so a long prefill without events still
  gets its lines; each names the jobs prefilling and their share done) and one line per
  job that finishes or fails, each ending in a newline, nothing redrawn, so a CI log reads
  top to bottom. Warnings and errors go to stderr (``err_stream``).
- :class:`JsonReporter` (``--json-progress``): one JSON object per line on stdout.
  Job lifecycle events (``job_queued``, ``job_admitted``, ``first_token``,
  ``job_finished``, ``job_failed``, ``job_skipped``; a ``context_policy: chunk`` map job
  ends with a ``chunk_part_finished`` instead, so ``job_finished`` and ``job_failed`` are
  one per job asked for, and a chunked job's one ``job_queued`` comes just before its first
  map job's) are written as they happen;
  the high-rate ones (decode steps, prefill progress, memory snapshots) are folded
  into a ``progress`` object every ``interval_s`` seconds (also from a timer thread);
  ``warning`` and a final ``summary`` object complete the stream. Every object has
  ``time``, the wall-clock time it was written (ISO 8601, UTC, milliseconds), beside the
  monotonic ``t`` of events.

A closed stdout (``hisparse run ... | head -1``) stops none of them: their streams are
:func:`hisparse_cli.pipes.guard`-ed, so once the reader is gone their writes are dropped
and stderr says so once; the run carries on.

Unknown figures (no decode step yet, no prefill seen) read ``-`` (JSON ``null``).
"""

from __future__ import annotations

import dataclasses
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any, Protocol, Self

from rich.console import Console

from engine.events import (
    DecodeStep,
    Event,
    JobFailed,
    JobFinished,
    JobQueued,
    MemorySnapshot,
    PrefillProgress,
)
from hisparse_cli.chunking import ChunkPartFinished
from hisparse_cli.dashboard import (
    LiveDashboard,
    chunk_parts,
    fmt_bytes,
    fmt_percent,
    fmt_rate,
    fmt_seconds,
    render_summary,
)
from hisparse_cli.display import escaped, terminal_text
from hisparse_cli.pipes import STDOUT_CLOSED, guard
from hisparse_cli.progress import (
    RUNNING_PHASES,
    JobRow,
    ProgressTracker,
    RunState,
    RunSummary,
    chunk_label,
    chunk_step,
    chunked_jobs,
    decode_tok_s_recent,
    decode_tok_s_run,
    decoding_known,
    h2d_gbps_recent,
    hit_rate,
    phase_counts,
    prefill_tok_s_live,
    prefilling,
)
from hisparse_cli.results import json_line, utc_now

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
    err_console: Console | None = None,
) -> Reporter:
    """JSON lines if asked, the live dashboard on a terminal, plain lines otherwise;
    warnings and errors of the plain and live displays go to ``err_console`` (stderr)."""
    err_console = err_console or Console(stderr=True)
    if json_progress:
        return JsonReporter(console.file, tracker, clock=clock, err_stream=err_console.file)
    if console.is_terminal:
        return LiveDashboard(console, tracker, clock=clock, err_console=err_console)
    return PlainReporter(console.file, tracker, clock=clock, err_stream=err_console.file)


class _Ticker:
    """Calls ``tick`` every ``interval_s`` seconds of wall time on a daemon thread until
    stopped (the steady progress lines of a non-terminal output)."""

    def __init__(self, interval_s: float, tick: Callable[[], None]) -> None:
        self.interval_s, self.tick = interval_s, tick
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.interval_s <= 0 or self.interval_s == float("inf") or self.interval_s > 1e6:
            return
        self._thread = threading.Thread(target=self._loop, name="hisparse-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except RuntimeError:  # the state changed under a reader: the next tick shows it
                continue


# ----------------------------------------------------------------------------- plain


def progress_line(state: RunState, now: float) -> str:
    """One status line: elapsed, jobs, throughput, cache, transfer and memory; the jobs
    prefilling and the chunked jobs running (``chunked long map 3/7``)."""
    counts = phase_counts(state)
    total = sum(counts.values()) - counts["skipped"]  # the jobs asked for, not map jobs
    ended = counts["done"] + counts["failed"] + counts["cancelled"]
    running = sum(counts[phase] for phase in RUNNING_PHASES)
    now = state.clock(now)
    decoding = decoding_known(state)
    parts = [
        (
            f"[{fmt_seconds(now - state.started_t):>6}] jobs {ended}/{total} ended "
            f"({counts['done']} ok, {counts['failed']} failed, {running} running, "
            f"{counts['queued']} queued{chunk_parts(state)})"
        ),
        f"decode {fmt_rate(decode_tok_s_recent(state, now) if decoding else None)} (5 s), "
        f"{fmt_rate(decode_tok_s_run(state, now) if decoding else None)} run",
        f"prefill {fmt_rate(prefill_tok_s_live(state, now))}",
        f"cache hit {fmt_percent(hit_rate(state))}",
        f"h2d {fmt_rate(h2d_gbps_recent(state, now) if decoding else None, 'GB/s', 2)}",
    ]
    jobs = prefilling(state)
    if jobs:
        shown = ", ".join(f"{r.id} {100 * r.prefill_fraction:.0f}%" for r in jobs[:4])
        parts.append(f"prefilling {shown}{f' +{len(jobs) - 4} more' if len(jobs) > 4 else ''}")
    chunked = chunked_jobs(state)
    if chunked:
        shown = ", ".join(f"{r.id} {chunk_label(r)}" for r in chunked[:4])
        more = f" +{len(chunked) - 4} more" if len(chunked) > 4 else ""
        parts.append(f"chunked {shown}{more}")
    memory = list(state.memory.values())
    parts += [f"{m.device} {fmt_bytes(m.used)}/{fmt_bytes(m.total)}" for m in memory]
    return " | ".join(parts)


def finish_line(row: JobRow) -> str:
    """One line for a job that ended; a chunked job's tokens are its whole document's
    (map jobs and reduce), as on its results line. One line it stays: a newline in the
    error (a file name's) is written ``\\n`` (:func:`~hisparse_cli.display.escaped`)."""
    generated = row.generated + row.part_generated
    if row.phase == "failed":
        return f"FAILED {row.id}: {escaped(row.error)}"
    if row.phase == "cancelled":
        return f"cancelled {row.id} after {generated} tokens"
    parts = f"; {row.parts} chunk parts + reduce" if row.parts else ""
    return (
        f"done {row.id}: {row.prompt_tokens + row.part_prompt_tokens} tokens in, {generated} "
        f"out ({row.finish_reason}{parts}), TTFT {fmt_seconds(row.ttft_s)}, "
        f"{fmt_rate(row.decode_tok_s)}"
    )


class PlainReporter:
    """Line-oriented progress for logs (see module docstring)."""

    def __init__(
        self,
        stream: IO[str],
        tracker: ProgressTracker,
        interval_s: float = PLAIN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        err_stream: IO[str] | None = None,
    ) -> None:
        self.tracker, self.interval_s, self.clock = tracker, interval_s, clock
        self.err_stream = guard(err_stream if err_stream is not None else sys.stderr)
        self.stream = guard(stream, STDOUT_CLOSED, self.err_stream)  # a closed pipe: dropped
        self._printed_t = clock()
        self._lock = threading.Lock()
        self._ticker = _Ticker(interval_s, self._tick)

    def __enter__(self) -> Self:
        self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ticker.stop()
        self.stream.flush()

    def on_event(self, event: Event) -> None:
        """A line per finished/failed job (map jobs included); a progress line when the
        interval has passed."""
        if isinstance(event, JobFinished | JobFailed | ChunkPartFinished):
            row = self.tracker.state.jobs.get(_job_id(event))
            if row is not None:  # a failure is an error: stderr, as the README says
                failed = row.phase == "failed"
                self._write(finish_line(row), self.err_stream if failed else None)
        self._tick(due_only=True)

    def _tick(self, due_only: bool = False) -> None:
        """A progress line now (the timer), or only when the interval has passed."""
        with self._lock:
            now = self.clock()
            if due_only and now - self._printed_t < self.interval_s:
                return
            self._printed_t = now
        self._write(progress_line(self.tracker.state, now))

    def note(self, message: str, level: str = "info") -> None:
        """Write ``message``: info on stdout, ``warning:``/``error:`` lines on stderr."""
        if level == "info":
            self._write(message)
        else:
            self._write(f"{level}: {message}", self.err_stream)

    def skipped(self, job_ids: list[str]) -> None:
        """One line for all skipped jobs."""
        if job_ids:
            self._write(f"skipping {len(job_ids)} job(s) already done (use --force to redo)")

    def summary(self, summary: RunSummary) -> None:
        """The summary table, rendered as plain text."""
        console = Console(file=self.stream, width=100, force_terminal=False, no_color=True)
        console.print(render_summary(summary))

    def _write(self, line: str, stream: IO[str] | None = None) -> None:
        """``line`` and a newline, no control character of it reaching the terminal
        (:func:`~hisparse_cli.display.terminal_text`: a name's escape sequence)."""
        stream = stream or self.stream
        with self._lock:
            stream.write(terminal_text(line.rstrip("\n")) + "\n")
            stream.flush()


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
    """The periodic ``progress`` object (``null`` for figures not known yet;
    ``prefill``: job id -> share of its prefill done, for the jobs prefilling;
    ``chunked``: job id -> its ``step`` (``map``, ``reduce``), map ``level``, and that
    level's map jobs ``done`` of all (``parts``), for the chunked jobs running)."""
    now = state.clock(now)
    decoding = decoding_known(state)
    return {
        "event": "progress",
        "t": now,
        "elapsed_s": now - state.started_t,
        "jobs": phase_counts(state),
        "chunk_parts": phase_counts(state, parts=True),  # map jobs; ended: done, failed...
        "chunked": {
            r.id: {
                "step": chunk_step(r),
                "level": r.level,
                "done": r.level_done,
                "parts": r.level_parts,
            }
            for r in chunked_jobs(state)
        },
        "decode_tok_s": decode_tok_s_recent(state, now) if decoding else None,
        "decode_tok_s_run": decode_tok_s_run(state, now) if decoding else None,
        "prefill_tok_s": prefill_tok_s_live(state, now),
        "prefill": {r.id: r.prefill_fraction for r in prefilling(state)},
        "hit_rate": hit_rate(state),
        "h2d_gbps": h2d_gbps_recent(state, now) if decoding else None,
        "memory": {
            d: {**dataclasses.asdict(m), "free": m.free} for d, m in list(state.memory.items())
        },
        "host_pool": {
            "used": state.host_pool_used,
            "pinned": state.host_pool_pinned,
            "total": state.host_pool_total,
            "dtype": state.host_pool_dtype,
        },
    }


class JsonReporter:
    """JSON lines on ``stream`` (see module docstring); ``err_stream`` (stderr) hears once
    when ``stream``'s pipe closes."""

    def __init__(
        self,
        stream: IO[str],
        tracker: ProgressTracker,
        interval_s: float = JSON_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        err_stream: IO[str] | None = None,
    ) -> None:
        self.tracker, self.interval_s, self.clock = tracker, interval_s, clock
        err_stream = guard(err_stream if err_stream is not None else sys.stderr)
        self.stream = guard(stream, STDOUT_CLOSED, err_stream)  # a closed pipe: dropped
        self._printed_t = clock()
        self._pending = False
        self._chunked: set[str] = set()  # chunked jobs whose job_queued was written
        self._lock = threading.Lock()
        self._ticker = _Ticker(interval_s, self._tick)

    def __enter__(self) -> Self:
        self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ticker.stop()
        if self._pending:
            self._emit(progress_json(self.tracker.state, self.clock()))

    def on_event(self, event: Event) -> None:
        """Lifecycle events at once; the rest folded into periodic progress objects."""
        if isinstance(event, _PERIODIC_EVENTS):
            self._pending = True
        elif not isinstance(event, JobQueued) or self._queued(event):
            self._emit(self._whole_document(event_json(event)))
        now = self.clock()
        if self._pending and now - self._printed_t >= self.interval_s:
            self._emit(progress_json(self.tracker.state, now))
            self._printed_t, self._pending = now, False

    def _queued(self, event: JobQueued) -> bool:
        """Whether to write ``event``'s ``job_queued``: a chunked job's own is written once,
        just before its first map job's (``prompt_tokens`` ``null``: its document is split;
        ``chunk_parts``: its first level's map jobs), so its reduce step's is not."""
        row = self.tracker.state.jobs.get(event.job_id)
        owner = self.tracker.state.jobs.get(row.part_of) if row and row.part_of else None
        if owner is not None and owner.id not in self._chunked:
            self._chunked.add(owner.id)
            self._emit(
                {
                    "event": "job_queued",
                    "t": event.t,
                    "job_id": owner.id,
                    "prompt_tokens": None,
                    "chunk_parts": owner.level_parts,
                }
            )
        return event.job_id not in self._chunked

    def _whole_document(self, obj: dict[str, Any]) -> dict[str, Any]:
        """A ``job_finished`` object of a chunked job (its reduce step) counts the whole
        document's tokens, its map jobs' included, as its results line and done line do
        (``chunk_parts``: how many map jobs ended); other objects as they are."""
        row = self.tracker.state.jobs.get(obj.get("job_id", "")) if "job_id" in obj else None
        if obj.get("event") != "job_finished" or row is None or not row.parts:
            return obj
        return {
            **obj,
            "prompt_tokens": obj["prompt_tokens"] + row.part_prompt_tokens,
            "generated_tokens": obj["generated_tokens"] + row.part_generated,
            "chunk_parts": row.parts,
        }

    def _tick(self) -> None:
        """The timer: a progress object when none was written for ``interval_s`` while a
        job runs (a prefill without events included)."""
        now = self.clock()
        running = any(r.phase in RUNNING_PHASES for r in list(self.tracker.state.jobs.values()))
        if (self._pending or running) and now - self._printed_t >= self.interval_s:
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
        """One JSON line: ``obj`` with ``time`` (wall clock, ISO 8601 UTC) and, where the
        object has none of its own (notes, skips, the summary), ``t`` on the run's clock."""
        stamped = {**obj, "t": obj["t"] if "t" in obj else self.clock(), "time": utc_now()}
        line = json_line(stamped) + "\n"
        with self._lock:
            self.stream.write(line)
            self.stream.flush()


def _job_id(event: JobFinished | JobFailed | ChunkPartFinished) -> str:
    """The id of the row that ended (a map job's own)."""
    if isinstance(event, ChunkPartFinished):
        return event.part_id
    return event.result.job_id if isinstance(event, JobFinished) else event.job_id
