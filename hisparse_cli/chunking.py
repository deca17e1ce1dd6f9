"""The ``chunk`` context policy's bookkeeping in a run: map jobs, levels, the reduce job.

A job whose document does not fit the context under ``context_policy: chunk`` becomes
*map* jobs, one per overlapping chunk (:func:`engine.text.context.chunk_document`), with
ids ``<job>@<level>.<i>``; they go to the engine with the other jobs of the batch and
run batched like them. A level's map jobs are registered at once and each is built (its
chunk's text read, its prompt tokenised) only when the engine draws it, so a huge
document's are never all in memory. When every map job of a level has finished, their
texts joined (:func:`engine.text.context.reduce_document`) are the next document: if its
prompt fits, the *reduce* job runs under the job's own id and its result is the job's
result; otherwise it is chunked again (level + 1). Map results are kept in memory only:
they get no results line, so a run stopped half-way redoes the whole job on resume (its
line, written once, is what resume reads). A map job that fails fails the job (no later
one is built); one cancelled leaves it not run.

The job's results line counts the whole document: its ``prompt_tokens`` and
``generated_tokens`` are those of every map job (all levels) plus the reduce job's, as
are its ``cache`` (hot-buffer traffic summed) and its ``audit`` (audited steps pooled:
:meth:`ChunkedJob.whole_audit`), and ``chunked`` keeps the parts
(:meth:`ChunkedJob.attribute`).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from engine.decode.audit import AuditTally
from engine.events import AuditStats, CacheStats, Event, Job
from hisparse_cli.results import AuditLimits, audit_figures, audit_record, cache_record

SEPARATOR = "@"
"""Between a job's id and its map jobs' ``<level>.<index>``."""


@dataclass(frozen=True)
class ChunkPartFinished(Event):
    """A map job ended (finished, failed or cancelled): what the displays get in place of
    its ``JobFinished`` or ``JobFailed``, so that those stay one per job asked for (JSON
    progress: a ``chunk_part_finished`` object). ``job_id``: the job it is part of;
    ``part_id``: its own, ``<job_id>@<level>.<index>`` (``index`` from 1);
    ``prompt_tokens`` and ``generated_tokens``: its own; ``finish_reason``: its result's
    (``stop``, ``length``, ``error``, ``cancelled``), ``error`` why it failed (``""``)."""

    job_id: str
    part_id: str
    level: int
    index: int
    prompt_tokens: int
    generated_tokens: int
    finish_reason: str
    error: str = ""


@dataclass
class ChunkedJob:
    """One job under the ``chunk`` policy: its map levels so far (``chunks``: the map
    jobs of each level), the texts of the current level (index -> text), and the tokens
    of its map jobs that ended (prompt and generated, every level); ``started``: a part
    (map or reduce job) was admitted; ``recorded``: its results line is written."""

    job_id: str
    chunks: list[int] = field(default_factory=list)
    texts: dict[int, str] = field(default_factory=dict)
    outstanding: set[str] = field(default_factory=set)
    done: bool = False
    started: bool = False
    recorded: bool = False
    map_prompt_tokens: int = 0
    map_generated_tokens: int = 0
    t_start: float | None = None
    """When its first map job was admitted (``time.monotonic()``): the job's start, from
    which its time to first token counts (the reduce step's first token)."""
    reduce_ttft_s: float | None = None
    """The reduce step's own time to first token, from its admission."""
    map_prefill_s: float = 0.0
    """Seconds its map jobs spent in prefill, summed (each: prompt tokens / its prefill
    rate)."""
    map_decode_s: float = 0.0
    """Seconds its map jobs spent decoding after their first tokens, summed."""
    map_decode_tokens: int = 0
    """Tokens its map jobs generated after their first ones (what their decode rates count)."""
    reduce_rates: tuple[float, float] | None = None
    """The reduce step's own ``(prefill_tok_s, decode_tok_s)``."""
    map_cache: CacheStats | None = None
    """Hot-buffer traffic of its map jobs that ended with a result, summed (``None``
    before one)."""
    map_audit: AuditTally | None = None
    """Sums of its map jobs' audited steps (``--audit``; ``None`` before one reported)."""
    reduce_cache: CacheStats | None = None
    """The reduce step's own hot-buffer traffic."""
    reduce_audit: AuditStats | None = None
    """The reduce step's own audit."""

    @property
    def level(self) -> int:
        return len(self.chunks)

    def summary(self) -> dict[str, object]:
        """The ``chunked`` field of the job's results line: map jobs per level and in
        all, and the number of levels (reduce steps)."""
        return {
            "policy": "chunk",
            "chunks": sum(self.chunks),
            "levels": self.level,
            "per_level": list(self.chunks),
        }

    def whole_rates(
        self, prompt_tokens: int, prefill_tok_s: float, generated: int, decode_tok_s: float
    ) -> tuple[float, float]:
        """The job's ``(prefill_tok_s, decode_tok_s)`` over the whole document, from its
        reduce step's figures (``prompt_tokens``, ``generated`` tokens and their rates) and
        its map jobs' (:meth:`ChunkScheduler.count`): all prompt tokens over all prefill
        seconds, all tokens after each part's first over all decode seconds — the rates a
        job read whole reports, its parts' seconds summed as if run one after another (in a
        batch they overlap). Records the reduce step's own (:attr:`reduce_rates`). A rate
        that is 0 (nothing measured) counts no seconds."""
        self.reduce_rates = (prefill_tok_s, decode_tok_s)
        prefill_s = self.map_prefill_s + (prompt_tokens / prefill_tok_s if prefill_tok_s else 0)
        after_first = max(generated - 1, 0)
        decode_s = self.map_decode_s + (after_first / decode_tok_s if decode_tok_s else 0)
        prompt = prompt_tokens + self.map_prompt_tokens
        decoded = after_first + self.map_decode_tokens
        return (prompt / prefill_s if prefill_s else 0.0, decoded / decode_s if decode_s else 0.0)

    def whole_cache(self, reduce: CacheStats) -> CacheStats:
        """The job's hot-buffer traffic over the whole document: its map jobs' (every
        level) plus its reduce step's, ``reduce`` (recorded: :attr:`reduce_cache`)."""
        self.reduce_cache = reduce
        return _add_cache(self.map_cache, reduce)

    def whole_audit(self, reduce: AuditStats | None) -> AuditStats | None:
        """The job's audit over the whole document: every part's audited steps pooled —
        steps, agreements and seconds summed, ``kl_max`` the largest, the means taken
        again over all steps (:meth:`engine.decode.audit.AuditTally.stats`) — from its map
        jobs' and its reduce step's, ``reduce`` (recorded: :attr:`reduce_audit`)."""
        self.reduce_audit = reduce
        if self.map_audit is None:
            return reduce
        tally = dataclasses.replace(self.map_audit)
        return (tally if reduce is None else _add_audit(tally, reduce)).stats()

    def attribute(
        self, record: dict[str, Any], audit_limits: AuditLimits | None = None
    ) -> dict[str, Any]:
        """``record`` (the job's results line, its token counts the reduce job's, ``None``
        when it never ran) counting the whole document: ``prompt_tokens`` and
        ``generated_tokens`` become map jobs' + reduce job's, and ``chunked`` gets the
        parts (``map_prompt_tokens``, ``map_generated_tokens``, ``reduce_prompt_tokens``,
        ``reduce_generated_tokens``, ``reduce_ttft_s``: the reduce step's own time to first
        token; the line's ``ttft_s`` counts from the job's start; ``reduce_prefill_tok_s``,
        ``reduce_decode_tok_s``: the reduce step's own rates; the line's are the whole
        document's, :meth:`whole_rates`; ``reduce_cache`` and, with an audit,
        ``reduce_audit``: the reduce step's own; the line's are the whole document's,
        :meth:`whole_cache`, :meth:`whole_audit`). A line without a ``cache`` (the job
        failed or was cancelled before its reduce step ended) gets its map jobs' traffic
        and audit, those of the parts that ran (the audit flagged by ``audit_limits``)."""
        prompt, generated = record.get("prompt_tokens") or 0, record.get("generated_tokens") or 0
        parts = {
            "map_prompt_tokens": self.map_prompt_tokens,
            "map_generated_tokens": self.map_generated_tokens,
            "reduce_prompt_tokens": prompt,
            "reduce_generated_tokens": generated,
            "reduce_ttft_s": self.reduce_ttft_s,
            "reduce_prefill_tok_s": self.reduce_rates[0] if self.reduce_rates else None,
            "reduce_decode_tok_s": self.reduce_rates[1] if self.reduce_rates else None,
            "reduce_cache": cache_record(self.reduce_cache) if self.reduce_cache else None,
        }
        if self.map_audit is not None or self.reduce_audit is not None:
            reduce_audit = self.reduce_audit
            parts["reduce_audit"] = audit_figures(reduce_audit) if reduce_audit else None
        whole = {}
        if record.get("cache") is None and self.map_cache is not None:
            whole["cache"] = cache_record(self.map_cache)
            if self.map_audit is not None and "audit" not in record:
                limits = audit_limits or AuditLimits()
                whole["audit"] = audit_record(self.map_audit.stats(), limits)
        total = prompt + self.map_prompt_tokens
        return {
            **record,
            **whole,
            "prompt_tokens": total or record.get("prompt_tokens"),
            "generated_tokens": generated + self.map_generated_tokens,
            "chunked": {**self.summary(), **parts},
        }


def _add_cache(total: CacheStats | None, cache: CacheStats) -> CacheStats:
    """``total`` (``None``: nothing yet) with ``cache``'s traffic added."""
    if total is None:
        return cache
    return CacheStats(
        hits=total.hits + cache.hits,
        misses=total.misses + cache.misses,
        h2d_bytes=total.h2d_bytes + cache.h2d_bytes,
        prefetched=total.prefetched + cache.prefetched,
    )


def _add_audit(tally: AuditTally, audit: AuditStats) -> AuditTally:
    """``tally`` with ``audit``'s steps added: its means times its steps are its sums."""
    n = audit.steps
    tally.steps += n
    tally.agree += round(audit.top1_agreement * n)
    tally.kl_sum += audit.kl_mean * n
    tally.kl_max = max(tally.kl_max, audit.kl_max)
    tally.mass_sum += audit.mass_kept_mean * n
    tally.seconds += audit.seconds
    return tally


class ChunkScheduler:
    """Map and reduce jobs of a run's chunked jobs.

    Parameters
    ----------
    next_level : ``(job id, document) -> jobs``: the jobs for ``document`` (the joined
        results of a finished level): the reduce job under the job's own id when its
        prompt fits, else the next level's map jobs (registered through :meth:`maps`;
        an iterable, drawn as the engine takes jobs: :meth:`take_ready`).
    """

    def __init__(self, next_level: Callable[[str, str], Iterable[Job]]) -> None:
        self.next_level = next_level
        self.jobs: dict[str, ChunkedJob] = {}
        self.owner: dict[str, tuple[str, int]] = {}  # map job id -> (job id, index)
        self.ready: deque[Iterator[Job]] = deque()  # jobs of finished levels, drawn in order

    def is_map(self, job_id: str) -> bool:
        """Whether ``job_id`` is one of this run's map jobs."""
        return job_id in self.owner

    def part(self, map_id: str) -> tuple[str, int, int]:
        """``(job id, level, index from 1)`` of a map job not yet ended."""
        job_id, index = self.owner[map_id]
        return job_id, self.jobs[job_id].level, index + 1

    def maps(self, job_id: str, count: int) -> list[str]:
        """The ids of the next level's ``count`` map jobs of ``job_id``, registered at once
        (the level ends when every one has finished); the caller builds the jobs, as they
        are drawn where the chunks are many (:meth:`BatchRun._map_jobs`)."""
        state = self.jobs.setdefault(job_id, ChunkedJob(job_id))
        state.chunks.append(count)
        state.texts = {}
        ids = []
        for i in range(count):
            map_id = f"{job_id}{SEPARATOR}{state.level}.{i + 1}"
            self.owner[map_id] = (job_id, i)
            state.outstanding.add(map_id)
            ids.append(map_id)
        return ids

    def admitted(self, map_id: str, t: float | None = None) -> str | None:
        """A map job was admitted (at ``t``, ``time.monotonic()``): its job has started
        (:meth:`cancelled_jobs`); the first admission is the job's start
        (:attr:`ChunkedJob.t_start`). Returns the job's id when this admission started it."""
        owner = self.owner.get(map_id)
        if owner is None:
            return None
        state = self.jobs[owner[0]]
        first = not state.started
        state.started = True
        if first and t is not None:
            state.t_start = t
        return state.job_id if first else None

    def cancelled_jobs(self) -> list[ChunkedJob]:
        """After a cancel: the jobs that started but have no results line yet (stopped
        in a map level, between levels or with their reduce job not admitted)."""
        return [s for s in self.jobs.values() if s.started and not s.recorded]

    def count(
        self,
        map_id: str,
        prompt_tokens: int,
        generated_tokens: int,
        rates: tuple[float, float] | None = None,
        cache: CacheStats | None = None,
        audit: AuditStats | None = None,
    ) -> None:
        """Add an ended map job's tokens to its job's (:meth:`ChunkedJob.attribute`), and,
        for one that finished, its time from its ``rates`` (``(prefill_tok_s,
        decode_tok_s)``, as its result has them; :meth:`ChunkedJob.whole_rates`), its
        hot-buffer traffic ``cache`` and its ``audit`` (:meth:`ChunkedJob.whole_cache`,
        :meth:`ChunkedJob.whole_audit`)."""
        owner = self.owner.get(map_id)
        if owner is not None:
            state = self.jobs[owner[0]]
            state.map_prompt_tokens += prompt_tokens
            state.map_generated_tokens += generated_tokens
            if cache is not None:
                state.map_cache = _add_cache(state.map_cache, cache)
            if audit is not None:
                state.map_audit = _add_audit(state.map_audit or AuditTally(), audit)
            if rates is not None:
                prefill, decode = rates
                after_first = max(generated_tokens - 1, 0)
                state.map_prefill_s += prompt_tokens / prefill if prefill else 0.0
                state.map_decode_s += after_first / decode if decode else 0.0
                state.map_decode_tokens += after_first if decode else 0

    def finished(self, map_id: str, text: str) -> None:
        """A map job's text; the last of its level queues the next level's jobs
        (:attr:`ready`)."""
        job_id, index = self.owner.pop(map_id)
        state = self.jobs[job_id]
        state.outstanding.discard(map_id)
        if state.done:
            return
        state.texts[index] = text
        if not state.outstanding:
            from engine.text.context import reduce_document

            texts = [state.texts[i] for i in range(len(state.texts))]
            self.ready.append(iter(self.next_level(job_id, reduce_document(texts))))

    def abandon(self, map_id: str) -> str | None:
        """A map job that failed or was cancelled: the job is given up (its other map jobs'
        results are dropped). Returns the job's id the first time, else ``None``."""
        job_id, _ = self.owner.pop(map_id)
        state = self.jobs[job_id]
        state.outstanding.discard(map_id)
        if state.done:
            return None
        state.done = True
        return job_id

    def close(self, job_id: str) -> None:
        """The job's reduce job ended (or it could not be built)."""
        if job_id in self.jobs:
            self.jobs[job_id].done = True

    def take_ready(self) -> Iterator[Job]:
        """The jobs queued by finished levels, in order, each built as it is drawn (a
        level's map jobs: :meth:`maps`); stops when none is left."""
        while self.ready:
            job = next(self.ready[0], None)
            if job is None:
                self.ready.popleft()
            else:
                yield job

    def waiting(self) -> bool:
        """Whether a job still has map jobs running or jobs ready to hand out."""
        return bool(self.ready) or any(s.outstanding and not s.done for s in self.jobs.values())
