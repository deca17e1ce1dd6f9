"""Run state built from engine events, and the figures derived from it.

:class:`ProgressTracker` is the only writer: it folds each event into a
:class:`RunState` (plain dataclasses). Everything that displays progress (the Rich
dashboard, plain log lines, JSON lines) reads the state through the pure functions
here, given the current time ``now`` (``time.monotonic()`` seconds, like ``Event.t``).

Rates over "the last 5 s" use the samples whose event time lies in
``[now - window_s, now]``, divided by the window (or by the run's age when younger).
Prefill tokens are estimated from ``PrefillProgress.done / total`` times the job's
prompt tokens, so they do not depend on the unit of ``done``. The live prefill rate
(:func:`prefill_tok_s_live`) also counts the time since the latest progress event of a
prefill still running, so a long prefill with sparse events does not read 0 between them;
once no job is prefilling it is ``None``, not a finished phase's pace. Figures not known
(yet) are ``None`` (shown ``-``).

The displays may read the state from a timer thread while the run loop folds events in:
readers copy ``samples``, ``jobs`` and ``memory`` (``list(...)``, atomic in CPython) before
iterating them. :meth:`ProgressTracker.finish` freezes the clock the displays use
(``ended_t``), so the last frame and the summary show the same time and rates.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.decode.audit import AuditTally
from engine.events import (
    AuditStep,
    DecodeStep,
    Event,
    FirstToken,
    JobAdmitted,
    JobFailed,
    JobFinished,
    JobQueued,
    MemorySnapshot,
    PrefillProgress,
)

PHASES = ("queued", "map", "prefill", "decode", "done", "failed", "cancelled", "skipped")
"""A job's phases; ``map``: a ``context_policy: chunk`` job whose map jobs run (from the
first one's admission until its reduce step's admission; then ``prefill`` and ``decode``
are its reduce step's: :func:`chunk_step`)."""
RUNNING_PHASES = ("map", "prefill", "decode")
FINISHED_PHASES = ("done", "failed", "cancelled", "skipped")
WINDOW_S = 5.0


@dataclass
class JobRow:
    """One job as the dashboard shows it; times are monotonic seconds."""

    id: str
    prompt_tokens: int = 0
    phase: str = "queued"
    prefill_fraction: float = 0.0
    generated: int = 0
    max_tokens: int = 0
    admitted_t: float | None = None
    first_token_t: float | None = None
    finished_t: float | None = None
    ttft_s: float | None = None
    decode_tok_s: float | None = None
    finish_reason: str = ""
    error: str = ""
    last_prefill_t: float | None = None
    part_of: str = ""
    """The job a ``context_policy: chunk`` map job is part of (``""``: a job the user
    asked for); such rows are not counted as jobs (:func:`phase_counts`)."""
    parts: int = 0
    part_prompt_tokens: int = 0
    part_generated: int = 0
    """A chunked job's map jobs that ended and their tokens (:meth:`ProgressTracker.retire_part`):
    with the row's own (the reduce job's) they are the job's results line's figures."""
    level: int = 0
    level_parts: int = 0
    level_done: int = 0
    """A chunked job's map level (from 1; 0: not chunked), its map jobs and those of them
    that ended (:meth:`ProgressTracker.add_parts`)."""


@dataclass
class DeviceMemory:
    """Last :class:`MemorySnapshot` of one device, in bytes."""

    device: str
    weights: int = 0
    hot_buffer: int = 0
    metadata: int = 0
    activations: int = 0
    total: int = 0

    @property
    def used(self) -> int:
        return self.weights + self.hot_buffer + self.metadata + self.activations

    @property
    def free(self) -> int:
        return max(0, self.total - self.used)


@dataclass
class Sample:
    """Work seen at time ``t`` (one decode step or one prefill progress event)."""

    t: float
    decode_tokens: int = 0
    prefill_tokens: float = 0.0
    h2d_bytes: int = 0
    step_s: float = 0.0
    start: float | None = None  # prefill samples: when the work they count began


@dataclass
class AuditFigures(AuditTally):
    """Running sums of the run's audited decode steps (``--audit``; :class:`AuditStep`):
    the engine's per-job :class:`engine.decode.audit.AuditTally` over every job, with the
    means ``None`` before any step."""

    def add_step(self, event: AuditStep) -> None:
        self.add(event.agree, event.kl, event.mass_kept)

    @property
    def agreement(self) -> float | None:
        """Share of audited steps whose top-1 token agreed (``None`` before any)."""
        return self.agree / self.steps if self.steps else None

    @property
    def kl_mean(self) -> float | None:
        return self.kl_sum / self.steps if self.steps else None

    @property
    def mass_kept(self) -> float | None:
        return self.mass_sum / self.steps if self.steps else None


@dataclass
class RunState:
    """Everything the progress displays need."""

    started_t: float
    jobs: dict[str, JobRow] = field(default_factory=dict)
    memory: dict[str, DeviceMemory] = field(default_factory=dict)
    host_pool_used: int = 0
    host_pool_total: int = 0
    host_pool_pinned: int = 0
    host_pool_dtype: str = ""  # kv_host_dtype of the host pool (bf16, fp8)
    decode_tokens: int = 0
    prefill_tokens: float = 0.0
    decode_steps: int = 0
    hits: int = 0
    misses: int = 0
    h2d_bytes: int = 0
    step_s: float = 0.0
    first_decode_t: float | None = None
    last_t: float = 0.0
    samples: deque[Sample] = field(default_factory=deque)
    cancelling: bool = False
    last_prefill: Sample | None = None
    ended_t: float | None = None
    steady: dict[int, list[float]] = field(default_factory=dict)
    """Batch size -> [steps, seconds] of decode steps that shared no turn with a prefill."""

    audit: AuditFigures = field(default_factory=lambda: AuditFigures())
    map_prompt_tokens: int = 0
    map_generated_tokens: int = 0
    """Tokens of ``context_policy: chunk`` map jobs that ended: their rows leave
    :attr:`jobs`, their tokens still count in the summary and in :func:`tokens_out`."""
    parts_ended: dict[str, int] = field(default_factory=dict)
    """Those map jobs by the phase they ended in (``done``, ``failed``, ``cancelled``):
    :func:`phase_counts` with ``parts``."""

    def clock(self, now: float) -> float:
        """``now``, or the end time once :meth:`ProgressTracker.finish` froze it."""
        return now if self.ended_t is None else self.ended_t


class ProgressTracker:
    """Folds events into a :class:`RunState`.

    Parameters
    ----------
    started_t
        Monotonic time the run started.
    window_s
        How much history the rate windows keep.
    """

    def __init__(self, started_t: float, window_s: float = WINDOW_S) -> None:
        self.state = RunState(started_t=started_t, last_t=started_t)
        self.window_s = window_s

    def add_job(
        self, job_id: str, phase: str = "queued", prompt_tokens: int = 0, part_of: str = ""
    ) -> JobRow:
        """Register a job before the engine reports it (``skipped`` ones never are);
        ``part_of``: the job a map job is part of."""
        row = self.state.jobs.setdefault(job_id, JobRow(job_id))
        row.phase, row.prompt_tokens = phase, prompt_tokens or row.prompt_tokens
        row.part_of = part_of or row.part_of
        return row

    def add_parts(self, job_id: str, part_ids: list[str]) -> None:
        """The next level of ``job_id``'s map jobs, ``part_ids``: shown queued (not counted
        as jobs), counted by its row (``level``, ``level_parts``, ``level_done``)."""
        owner = self._row(job_id)
        owner.level, owner.level_parts, owner.level_done = owner.level + 1, len(part_ids), 0
        for part_id in part_ids:
            self.add_job(part_id, part_of=job_id)

    def retire_part(self, map_id: str) -> JobRow | None:
        """An ended map job's row leaves the table; it counts as ended in its phase
        (``RunState.parts_ended``) and for its job's row (``level_done``), and its tokens
        count for its job's row (``part_*``) and for the run (``RunState.map_*_tokens``):
        its prompt tokens only if it ran (:func:`part_ran`). Returns the row."""
        row = self.state.jobs.pop(map_id, None)
        if row is None:
            return None
        prompt_tokens = part_prompt_tokens(row)
        self.state.map_prompt_tokens += prompt_tokens
        self.state.map_generated_tokens += row.generated
        if row.phase in FINISHED_PHASES:
            ended = self.state.parts_ended
            ended[row.phase] = ended.get(row.phase, 0) + 1
        owner = self.state.jobs.get(row.part_of)
        if owner is not None:
            owner.parts += 1
            owner.level_done += 1
            owner.part_prompt_tokens += prompt_tokens
            owner.part_generated += row.generated
        return row

    def forget(self, job_id: str) -> None:
        """A row that will never run leaves the table uncounted (a map job registered but
        never built: its job was given up, or the run cancelled)."""
        self.state.jobs.pop(job_id, None)

    def finish(self, t: float) -> None:
        """The run ended at ``t``: every display and the summary use this time from now on."""
        if self.state.ended_t is None:
            self.state.ended_t = t

    def set_phase(self, job_id: str, phase: str) -> None:
        """Force a job's phase (e.g. ``cancelled`` for one never admitted)."""
        self._row(job_id).phase = phase

    def update(self, event: Event) -> None:
        """Apply one engine event."""
        self.state.last_t = max(self.state.last_t, event.t)
        handler = _HANDLERS.get(type(event))
        if handler is not None:
            handler(self, event)
        self._trim(event.t)

    def _row(self, job_id: str) -> JobRow:
        return self.state.jobs.setdefault(job_id, JobRow(job_id))

    def _trim(self, now: float) -> None:
        samples = self.state.samples
        while samples and samples[0].t < now - self.window_s:
            samples.popleft()

    def _queued(self, event: JobQueued) -> None:
        row = self._row(event.job_id)
        row.prompt_tokens = event.prompt_tokens
        row.phase = "map" if row.phase == "map" else "queued"  # a reduce step: still running

    def _admitted(self, event: JobAdmitted) -> None:
        row = self._row(event.job_id)
        row.prompt_tokens, row.phase, row.admitted_t = event.prompt_tokens, "prefill", event.t
        owner = self.state.jobs.get(row.part_of) if row.part_of else None
        if owner is not None and owner.phase == "queued":  # its first map job: it runs
            owner.phase = "map"

    def _prefill(self, event: PrefillProgress) -> None:
        row = self._row(event.job_id)
        fraction = event.done / event.total if event.total else 1.0
        tokens = max(0.0, fraction - row.prefill_fraction) * row.prompt_tokens
        row.prefill_fraction, row.phase = fraction, "prefill"
        self._prefilled(row, event.t, tokens)

    def _prefilled(self, row: JobRow, t: float, tokens: float) -> None:
        start = row.last_prefill_t if row.last_prefill_t is not None else row.admitted_t
        sample = Sample(t, prefill_tokens=tokens, start=t if start is None else min(start, t))
        row.last_prefill_t = t
        self.state.prefill_tokens += tokens
        self.state.samples.append(sample)
        self.state.last_prefill = sample

    def _first_token(self, event: FirstToken) -> None:
        row = self._row(event.job_id)
        if row.prefill_fraction < 1.0 and row.prompt_tokens:  # the prefill's last part
            self._prefilled(row, event.t, (1.0 - row.prefill_fraction) * row.prompt_tokens)
        row.phase, row.ttft_s, row.first_token_t = "decode", event.ttft_s, event.t
        row.prefill_fraction, row.generated = 1.0, max(row.generated, 1)

    def _decode(self, event: DecodeStep) -> None:
        new_tokens = sum(
            self._decode_row(job_id, n, event) for job_id, n in event.generated.items()
        )
        state = self.state
        state.decode_tokens += new_tokens
        state.decode_steps += 1
        state.hits += event.hits
        state.misses += event.misses
        state.h2d_bytes += event.h2d_bytes
        state.step_s += event.step_s
        if not (event.with_prefill or event.graph_capture):
            acc = state.steady.setdefault(event.batch_size, [0, 0.0])
            acc[0] += 1
            acc[1] += event.step_s
        if state.first_decode_t is None:
            state.first_decode_t = event.t - event.step_s
        state.samples.append(Sample(event.t, new_tokens, 0.0, event.h2d_bytes, event.step_s))

    def _decode_row(self, job_id: str, generated: int, event: DecodeStep) -> int:
        row = self._row(job_id)
        new_tokens = max(0, generated - row.generated)
        row.generated, row.phase = generated, "decode"
        row.max_tokens = event.max_tokens.get(job_id, row.max_tokens)
        if row.first_token_t is None:
            row.first_token_t = event.t
        return new_tokens

    def _finished(self, event: JobFinished) -> None:
        result = event.result
        row = self._row(result.job_id)
        row.finished_t, row.finish_reason, row.error = event.t, result.finish_reason, result.error
        row.generated, row.prompt_tokens = len(result.token_ids), result.prompt_tokens
        row.ttft_s, row.decode_tok_s = result.ttft_s, result.decode_tok_s
        row.phase = _finished_phase(result.finish_reason, result.error)

    def _failed(self, event: JobFailed) -> None:
        row = self._row(event.job_id)
        row.phase, row.error, row.finished_t = "failed", event.error, event.t

    def _audit(self, event: AuditStep) -> None:
        self.state.audit.add_step(event)

    def _memory(self, event: MemorySnapshot) -> None:
        self.state.memory[event.device] = DeviceMemory(
            event.device,
            event.weights,
            event.hot_buffer,
            event.metadata,
            event.activations,
            event.total,
        )
        self.state.host_pool_used = event.host_pool_used
        self.state.host_pool_total = event.host_pool_total
        self.state.host_pool_pinned = event.host_pool_pinned
        self.state.host_pool_dtype = event.host_pool_dtype


_HANDLERS = {
    JobQueued: ProgressTracker._queued,
    JobAdmitted: ProgressTracker._admitted,
    PrefillProgress: ProgressTracker._prefill,
    FirstToken: ProgressTracker._first_token,
    DecodeStep: ProgressTracker._decode,
    JobFinished: ProgressTracker._finished,
    JobFailed: ProgressTracker._failed,
    MemorySnapshot: ProgressTracker._memory,
    AuditStep: ProgressTracker._audit,
}


def part_ran(row: JobRow) -> bool:
    """Whether a map job ran: its prefill reported progress (a share done, or its first
    token). One cancelled (Ctrl-C) while queued, or admitted but still waiting for its
    prefill (the engine prefills one job at a time), did not."""
    return row.prefill_fraction > 0 or row.first_token_t is not None or row.generated > 0


def part_prompt_tokens(row: JobRow) -> int:
    """The prompt tokens an ended map job counts for its job and the run: its own if it
    ran (:func:`part_ran`), else 0."""
    return row.prompt_tokens if part_ran(row) else 0


def _finished_phase(finish_reason: str, error: str) -> str:
    if finish_reason == "cancelled":
        return "cancelled"
    return "failed" if error or finish_reason == "error" else "done"


# ----------------------------------------------------------------------------- figures


def window_span(state: RunState, now: float, window_s: float = WINDOW_S) -> float:
    """Seconds the rate window covers: ``window_s``, or the run's age when younger."""
    return max(1e-9, min(window_s, now - state.started_t))


def recent(state: RunState, now: float, window_s: float = WINDOW_S) -> list[Sample]:
    """Samples of the last ``window_s`` seconds."""
    return [s for s in list(state.samples) if now - window_s <= s.t <= now]


def decode_tok_s_recent(state: RunState, now: float, window_s: float = WINDOW_S) -> float:
    """Decode tokens/s of all jobs over the last ``window_s`` seconds."""
    tokens = sum(s.decode_tokens for s in recent(state, now, window_s))
    return tokens / window_span(state, now, window_s)


def decode_tok_s_run(state: RunState, now: float) -> float:
    """Decode tokens/s of all jobs over the run's decode steps: tokens generated by decode
    steps / seconds spent in them (prefills between steps, waiting and loading excluded,
    as in each job's own ``decode_tok_s``). ``now`` is unused, kept for the rate API."""
    if state.step_s <= 0:
        return 0.0
    return state.decode_tokens / state.step_s


def prefill_tok_s_recent(state: RunState, now: float, window_s: float = WINDOW_S) -> float:
    """Prefill tokens/s over the last ``window_s`` seconds."""
    tokens = sum(s.prefill_tokens for s in recent(state, now, window_s))
    return tokens / window_span(state, now, window_s)


def prefill_tok_s_live(state: RunState, now: float, window_s: float = WINDOW_S) -> float | None:
    """Prefill tokens/s now, while a job is prefilling: the prefill tokens of the last
    ``window_s`` seconds' samples, plus the latest sample, over the seconds from the start
    of the earliest of them to ``now`` (so the time since the latest event of a running
    prefill counts). Each sample's tokens are divided over a span that begins no later
    than their work did, so a finished prefill's tokens in the window can only lower the
    rate. ``None`` before any prefill work was seen and whenever no job is prefilling (a
    finished phase's pace is not shown as the present one)."""
    samples = [s for s in recent(state, now, window_s) if s.start is not None]
    last = state.last_prefill
    if last is None or not any(r.phase == "prefill" for r in list(state.jobs.values())):
        return None
    if last not in samples:
        samples.append(last)
    start = min(s.start for s in samples if s.start is not None)
    return sum(s.prefill_tokens for s in samples) / max(1e-9, now - start)


def prefilling(state: RunState) -> list[JobRow]:
    """Jobs in prefill now (their ``prefill_fraction`` is the share done)."""
    return [r for r in list(state.jobs.values()) if r.phase == "prefill"]


def decoding_known(state: RunState) -> bool:
    """Whether any decode step ran (before one, decode and transfer rates are unknown)."""
    return state.decode_steps > 0


def h2d_gbps_recent(state: RunState, now: float, window_s: float = WINDOW_S) -> float:
    """Host -> device GB/s during the decode steps of the last ``window_s`` seconds."""
    samples = recent(state, now, window_s)
    seconds = sum(s.step_s for s in samples)
    return sum(s.h2d_bytes for s in samples) / seconds / 1e9 if seconds > 0 else 0.0


def hit_rate(state: RunState) -> float | None:
    """Hot-buffer hit rate of the run so far (``None`` before any lookup)."""
    total = state.hits + state.misses
    return state.hits / total if total else None


def job_tok_s(row: JobRow, now: float) -> float | None:
    """Decode tokens/s of one job (the engine's figure once it has finished)."""
    if row.decode_tok_s:
        return row.decode_tok_s
    if row.first_token_t is None or row.generated < 2:
        return None
    end = row.finished_t if row.finished_t is not None else now
    return (row.generated - 1) / max(1e-9, end - row.first_token_t)


def job_eta_s(row: JobRow, now: float) -> float | None:
    """Seconds until ``row`` reaches its token limit at its current pace (upper bound)."""
    if row.phase == "prefill" and row.admitted_t is not None and row.prefill_fraction > 0:
        elapsed = now - row.admitted_t
        return elapsed * (1 - row.prefill_fraction) / row.prefill_fraction
    rate = job_tok_s(row, now)
    if row.phase != "decode" or not rate or not row.max_tokens:
        return None
    return max(0, row.max_tokens - row.generated) / rate


def phase_counts(state: RunState, parts: bool = False) -> dict[str, int]:
    """Number of jobs in each phase (all of :data:`PHASES`, zeros included): the jobs the
    user asked for, or with ``parts`` the chunk policy's map jobs (those that ended
    counted in the phase they ended in)."""
    counts = dict.fromkeys(PHASES, 0)
    for row in list(state.jobs.values()):
        if bool(row.part_of) == parts:
            counts[row.phase] = counts.get(row.phase, 0) + 1
    if parts:
        for phase, n in list(state.parts_ended.items()):
            counts[phase] += n
    return counts


def chunk_step(row: JobRow) -> str:
    """What a chunked job is running: ``map`` (its map jobs), ``reduce`` (its reduce
    step), else ``""``."""
    if row.phase == "map":
        return "map"
    return "reduce" if row.level and row.phase in ("prefill", "decode") else ""


def chunk_label(row: JobRow) -> str:
    """A chunked job's step in words: ``map 3/7`` (its level's map jobs ended of all;
    ``map L2 1/3`` from level 2), ``reduce``, or ``""``."""
    step = chunk_step(row)
    if step != "map":
        return step
    level = f" L{row.level}" if row.level > 1 else ""
    return f"map{level} {row.level_done}/{row.level_parts}"


def chunked_jobs(state: RunState) -> list[JobRow]:
    """The chunked jobs running now (:func:`chunk_step`)."""
    return [r for r in list(state.jobs.values()) if chunk_step(r)]


# ----------------------------------------------------------------------------- summary


@dataclass(frozen=True)
class RunSummary:
    """Outcome of a run: job counts, tokens and wall time.

    not_run: jobs handed to the engine that never finished (cancelled before admission,
    or the engine stopped early).
    refused: lines of an OpenAI-batch manifest refused before the run (not jobs; each has
    an ``invalid_request`` line in ``batch_output.jsonl``).
    """

    ok: int
    failed: int
    skipped: int
    cancelled: int
    not_run: int
    prompt_tokens: int
    generated_tokens: int
    wall_s: float
    decode_tok_s: float | None  # None when no decode step ran
    output_dir: str
    interrupted: bool = False
    preset: str = ""
    refused: int = 0
    steady_decode: dict[int, dict[str, float]] = field(default_factory=dict)
    """Batch size -> ``{"steps", "step_ms", "tok_s"}`` of the decode steps that shared no
    turn with a prefill and captured no CUDA graph: the batch's own rate, comparable to ``hisparse bench`` at the
    same number of jobs."""


def tokens_out(state: RunState) -> int:
    """Tokens generated by every job so far (first tokens included), as the summary counts."""
    return sum(r.generated for r in list(state.jobs.values())) + state.map_generated_tokens


def summarize(
    state: RunState, now: float, output_dir: str, interrupted: bool = False, preset: str = ""
) -> RunSummary:
    """Summary of ``state`` at time ``now``; ``preset``: the preset the run used."""
    counts = phase_counts(state)
    now = state.clock(now)
    ran = [r for r in list(state.jobs.values()) if r.phase in ("done", "failed", "cancelled")]
    return RunSummary(
        ok=counts["done"],
        failed=counts["failed"],
        skipped=counts["skipped"],
        cancelled=counts["cancelled"],
        not_run=counts["queued"] + sum(counts[p] for p in RUNNING_PHASES),
        prompt_tokens=sum(r.prompt_tokens for r in ran) + state.map_prompt_tokens,
        generated_tokens=sum(r.generated for r in ran) + state.map_generated_tokens,
        wall_s=max(0.0, now - state.started_t),
        decode_tok_s=decode_tok_s_run(state, now) if decoding_known(state) else None,
        output_dir=output_dir,
        interrupted=interrupted,
        preset=preset,
        steady_decode={
            b: {"steps": n, "step_ms": 1e3 * sec / n, "tok_s": b * n / sec}
            for b, (n, sec) in sorted(state.steady.items())
            if n and sec > 0
        },
    )
