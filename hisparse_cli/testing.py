"""A scripted stand-in for ``engine.load.Engine``: no model, same events.

Used by the CLI tests and handy for trying the dashboard::

    from hisparse_cli import runner, testing
    runner.load_engine = testing.fake_engine_factory(step_delay_s=0.05)

It follows the engine contract: ``run(jobs)`` yields ``JobQueued`` for each job (or
``JobFailed``, never queued, when prompt + ``max_tokens`` exceeds ``limit``), then
admits up to ``max_batch`` at a time (``JobAdmitted``, ``PrefillProgress``,
``FirstToken``), decodes them together (``DecodeStep``, ``MemorySnapshot``) and ends
each with ``JobFinished`` or ``JobFailed``; ``cancel()`` stops admission, ends the
running jobs with ``finish_reason='cancelled'`` and fails the queued ones with
``"cancelled before admission"`` (as ``engine.serve.engine.Engine`` does).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.events import (
    AuditStats,
    AuditStep,
    CacheStats,
    DecodeStep,
    Event,
    FirstToken,
    Job,
    JobAdmitted,
    JobFailed,
    JobFinished,
    JobQueued,
    JobResult,
    MemorySnapshot,
    PrefillProgress,
)

GiB = 2**30


class FakeTokenizer:
    """Whitespace "tokenizer": one id per word (ids are word lengths)."""

    eos_ids = (0,)

    def encode(self, text: str) -> list[int]:
        """One id per whitespace-separated word."""
        return [len(word) for word in text.split()]

    def decode(self, ids: Iterable[int]) -> str:
        """``w<id>`` words joined by spaces."""
        return " ".join(f"w{i}" for i in ids)

    def render_chat(self, messages: list[dict]) -> str:
        """ChatML-like rendering."""
        turns = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>" for m in messages]
        return "\n".join([*turns, "<|im_start|>assistant\n"])

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of :meth:`render_chat`."""
        return self.encode(self.render_chat(messages))

    def min_tokens(self, text: str) -> int | None:
        """No lower bound from the size alone (``None``): prompts are tokenised."""
        return None


@dataclass
class _Running:
    job: Job
    generated: int = 0
    admitted_t: float = 0.0
    audit_at: frozenset[int] = frozenset()
    audited: list[AuditStep] = field(default_factory=list)


@dataclass
class FakeEngine:
    """Scripted engine.

    fail: job id -> error (the job yields ``JobFailed`` at admission).
    limit: context limit; a longer prompt + ``max_tokens`` fails before it is queued.
    tokens: job id -> tokens to generate (default: the job's ``max_tokens``).
    texts: job id -> the reply text (default ``output of <id>: <n> tokens``).
    on_step: called with the step number before each decode step (tests send
        SIGINT from here).
    audit_disagree: job ids whose audited steps (``config.audit_steps``, chosen as the
        engine does) disagree with dense (KL 2.0, mass kept 0.5); the others agree (KL
        0.01, mass kept 0.95).
    """

    config: EngineConfig = field(default_factory=EngineConfig)
    fail: dict[str, str] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    limit: int = 100_000
    step_delay_s: float = 0.0
    on_step: Callable[[int], None] | None = None
    clock: Callable[[], float] = time.monotonic
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    model_config: Any = None
    model_name: str = "fake"
    weight_format: str = "float"
    weights_info: str = ""
    cancelled: bool = False
    closed: bool = False
    seen: list[Job] = field(default_factory=list)
    audit_disagree: set[str] = field(default_factory=set)

    @property
    def trace_paths(self) -> list[str]:
        """No selection traces."""
        return []

    def cancel(self) -> None:
        """Stop admitting; running jobs end as ``cancelled``."""
        self.cancelled = True

    def close(self) -> None:
        """Nothing to release; recorded for tests."""
        self.closed = True

    def prompt_limit(self) -> int:
        """Most tokens (prompt + max_tokens) a job may hold."""
        return self.limit

    def run(self, jobs: Iterable[Job | None]) -> Iterator[Event]:
        """Yield the events of processing ``jobs`` (see module docstring)."""
        queue: list[Job] = []
        step = 0
        for job in jobs:
            if job is None:  # none ready yet (chunk policy): run what is queued, ask again
                if not queue:
                    raise RuntimeError("the job source gave None while nothing runs")
                step = yield from self._run_queue(queue, step)
                queue = []
                continue
            self.seen.append(job)
            need = len(job.prompt_ids) + job.sampling.max_tokens
            if need > self.limit:  # as engine.serve.engine.Engine._check_job: never queued
                yield JobFailed(
                    self.clock(),
                    job.id,
                    f"prompt of {len(job.prompt_ids)} tokens + max_tokens "
                    f"{job.sampling.max_tokens} exceeds the context limit of {self.limit} tokens",
                )
                continue
            queue.append(job)
            yield JobQueued(self.clock(), job.id, len(job.prompt_ids))
        yield self._memory(0)
        yield from self._run_queue(queue, step)

    def _run_queue(self, queue: list[Job], step: int) -> Iterator[Event]:
        """Admit and decode ``queue`` in batches of ``max_batch``; returns the last step."""
        while queue and not self.cancelled:
            batch, queue = queue[: self.config.max_batch], queue[self.config.max_batch :]
            running = yield from self._admit(batch)
            step = yield from self._decode(running, step)
        for job in queue:
            yield JobFailed(self.clock(), job.id, "cancelled before admission")
        return step

    def _admit(self, batch: list[Job]) -> Iterator[Event]:
        running = []
        for job in batch:
            now = self.clock()
            if job.id in self.fail:
                yield JobFailed(now, job.id, self.fail[job.id])
                continue
            yield JobAdmitted(now, job.id, len(job.prompt_ids))
            for done in (1, 2):
                yield PrefillProgress(
                    self.clock(), job.id, done, 2, len(job.prompt_ids) * done // 2
                )
            yield FirstToken(self.clock(), job.id, self.clock() - now)
            running.append(_Running(job, 1, now, self._audit_at(job)))
        return running

    def _audit_at(self, job: Job) -> frozenset[int]:
        if not self.config.audit_steps:
            return frozenset()
        from engine.decode.audit import audit_schedule

        cfg = self.config
        return audit_schedule(job.id, job.sampling.max_tokens, cfg.audit_steps, cfg.audit_seed)

    def _decode(self, running: list[_Running], step: int) -> Iterator[Event]:
        while running:
            if self.on_step is not None:
                self.on_step(step)
            if self.cancelled:
                for r in running:
                    yield JobFinished(self.clock(), self._result(r, "cancelled"))
                return step
            time.sleep(self.step_delay_s)
            audits = []
            for r in running:
                if r.generated in r.audit_at:
                    bad = r.job.id in self.audit_disagree
                    kl, mass = (2.0, 0.5) if bad else (0.01, 0.95)
                    r.audited.append(AuditStep(self.clock(), r.job.id, r.generated, not bad, kl, mass))
                    audits.append(r.audited[-1])
                r.generated += 1
            step += 1
            yield self._step_event(running, step)
            yield from audits
            yield self._memory(len(running))
            for r in [r for r in running if r.generated >= self._target(r.job)]:
                running.remove(r)
                yield JobFinished(self.clock(), self._result(r, "length"))
        return step

    def _target(self, job: Job) -> int:
        return self.tokens.get(job.id, job.sampling.max_tokens)

    def _step_event(self, running: list[_Running], step: int) -> DecodeStep:
        generated = {r.job.id: r.generated for r in running}
        limits = {r.job.id: self._target(r.job) for r in running}
        return DecodeStep(self.clock(), step, len(running), 0.01, generated, limits, 3, 1, 16384)

    def _memory(self, batch: int) -> MemorySnapshot:
        return MemorySnapshot(
            self.clock(),
            "cpu",
            GiB,
            batch * GiB // 4,
            GiB // 8,
            GiB // 16,
            8 * GiB,
            batch * GiB,
            4 * GiB,
        )

    def _result(self, running: _Running, reason: str) -> JobResult:
        ids = tuple(range(running.generated))
        text = self.texts.get(
            running.job.id, f"output of {running.job.id}: {running.generated} tokens"
        )
        stats = CacheStats(
            hits=3 * running.generated,
            misses=running.generated,
            h2d_bytes=16384 * running.generated,
        )
        return JobResult(
            running.job.id,
            text,
            ids,
            len(running.job.prompt_ids),
            reason,
            0.01,
            1000.0,
            100.0,
            stats,
            audit=self._audit_stats(running) if self.config.audit_steps else None,
        )

    def _audit_stats(self, running: _Running) -> AuditStats:
        steps = running.audited
        n = len(steps)
        return AuditStats(
            steps=n,
            top1_agreement=sum(s.agree for s in steps) / n if n else 1.0,
            kl_mean=sum(s.kl for s in steps) / n if n else 0.0,
            kl_max=max((s.kl for s in steps), default=0.0),
            mass_kept_mean=sum(s.mass_kept for s in steps) / n if n else 1.0,
            seconds=0.001 * n,
        )


def fake_engine_factory(**kwargs: Any) -> Callable[[EngineConfig, str | None], FakeEngine]:
    """A ``load_engine`` replacement building a :class:`FakeEngine` with ``kwargs``.

    The engines it made are appended to the factory's ``engines`` list.
    """

    def load(config: EngineConfig, model: str | None, job_tokens: int | None = None) -> FakeEngine:
        engine = FakeEngine(config=config, **kwargs)  # job_tokens: what a budget sizes for
        load.engines.append(engine)
        return engine

    load.engines = []
    return load


def one_line_error(result: Any, *words: str) -> None:
    """Assert that a ``typer.testing.CliRunner`` result refused its input as the CLI
    refuses bad input: exit 2, one ``error:`` line on stderr holding every one of
    ``words`` (whitespace folded), and no traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    text = " ".join(result.stderr.split())
    assert "Traceback" not in result.output and "Traceback" not in text
    for word in words:
        assert word in text, text
