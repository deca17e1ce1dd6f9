"""The surface every engine shows its front ends: one process (:class:`engine.serve.engine.Engine`),
several devices (:class:`engine.serve.workers.ParallelEngine`) or a test double
(:class:`hisparse_cli.testing.FakeEngine`). The runner, the workers and the pipeline use
only this; nothing probes an engine with ``getattr``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

from engine import events as ev
from engine.config import EngineConfig


@runtime_checkable
class BatchEngine(Protocol):
    """A batch generator over a KV hierarchy.

    Attributes
    ----------
    config : the resolved settings the engine runs with (after any budget sizing)
    tokenizer : encodes chat prompts (``encode_chat``, ``render_chat``, ``min_tokens``)
        and decodes tokens
    model_name : for results and reports
    weight_format : ``int4`` or ``float`` (what the linears run as)
    weights_info : what each source tensor type became, for the model line ("" unknown)
    trace_paths : the selection trace files written (``--trace``), one per worker; empty
        without a trace
    """

    config: EngineConfig
    tokenizer: Any
    model_name: str
    weight_format: str
    weights_info: str

    @property
    def trace_paths(self) -> list[str]: ...

    def prompt_limit(self) -> int:
        """Most tokens (prompt + max_tokens) a request may hold."""
        ...

    def cancel(self) -> None:
        """Stop admitting; running requests end ``cancelled`` (safe in a signal handler)."""
        ...

    def run(self, jobs: Iterable[ev.Job | None]) -> Iterator[ev.Event]:
        """Process ``jobs`` (continuous batching) and yield events as they happen."""
        ...

    def close(self) -> None:
        """Release what the engine holds (worker processes, trace files); idempotent."""
        ...
