"""Deciding, before the engine starts, what each job needs: run, skip or fail.

Every input is read and checked here (:func:`~hisparse_cli.textio.read_document`), so
unreadable, binary or empty documents are reported before any model is loaded; such
a job fails on its own and the rest of the batch runs. A job whose last line in
``results.jsonl`` succeeded with the same resume key is skipped unless ``force``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from engine.config import EngineConfig
from hisparse_cli.keys import job_key, settings_hash
from hisparse_cli.manifest import JobSpec
from hisparse_cli.results import ResultsLog
from hisparse_cli.textio import Document, DocumentError, read_documents

RUN, SKIP, INVALID = "run", "skip", "invalid"


@dataclass(frozen=True)
class PlannedJob:
    """A job and what to do with it.

    status: ``run``, ``skip`` (already done) or ``invalid`` (see ``error``).
    removed_controls: control characters dropped from its inputs (worth a warning).
    warnings: notes on inputs read despite looking binary (``--allow-binary``).
    """

    spec: JobSpec
    status: str
    settings_hash: str
    input_sha256: tuple[str, ...] = ()
    key: str = ""
    error: str = ""
    removed_controls: int = 0
    warnings: tuple[str, ...] = ()

    def with_documents(self, documents: Sequence[Document]) -> PlannedJob:
        """The same job keyed by ``documents`` (their content may have changed since planning)."""
        hashes = tuple(d.sha256 for d in documents)
        removed = sum(d.removed_controls for d in documents)
        return replace(
            self,
            input_sha256=hashes,
            key=job_key(hashes, self.settings_hash),
            removed_controls=removed,
            warnings=tuple(d.warning for d in documents if d.warning),
        )

    def base_record(self, model: str) -> dict[str, Any]:
        """Fields of this job's ``results.jsonl`` line known before it runs."""
        return {
            "id": self.spec.id,
            "output": self.spec.output,
            "input": [str(p) for p in self.spec.inputs],
            "input_sha256": list(self.input_sha256),
            "key": self.key,
            "settings_hash": self.settings_hash,
            "task": self.spec.task.task,
            "model": model,
            "truncated": None,  # set when context_policy=truncate cut the document
        }


def plan_jobs(
    specs: Sequence[JobSpec],
    config: EngineConfig,
    model_id: str,
    text_options: dict[str, str],
    log: ResultsLog,
    force: bool = False,
    allow_binary: bool = False,
) -> list[PlannedJob]:
    """Read every job's inputs, compute its resume key and decide its status.

    Parameters
    ----------
    specs
        Validated jobs.
    config
        Resolved engine config (its output-affecting settings enter the key).
    model_id
        :func:`~hisparse_cli.keys.model_fingerprint` of the model.
    text_options
        ``{"encoding": ..., "errors": ...}`` for :func:`read_documents`.
    log
        Results of earlier runs in the same output dir.
    force
        Run every valid job even when already done.
    allow_binary
        Read inputs that look binary anyway (``--allow-binary``). Not part of the resume
        key: it only changes the text of documents that fail without it.
    """
    return [
        _plan_one(spec, config, model_id, text_options, log, force, allow_binary) for spec in specs
    ]


def _plan_one(
    spec: JobSpec,
    config: EngineConfig,
    model_id: str,
    text_options: dict[str, str],
    log: ResultsLog,
    force: bool,
    allow_binary: bool,
) -> PlannedJob:
    settings = settings_hash(spec.task, spec.sampling, model_id, config, text_options)
    planned = PlannedJob(spec, RUN, settings)
    try:
        documents = read_documents(spec.inputs, **text_options, allow_binary=allow_binary)
    except DocumentError as exc:
        return replace(planned, status=INVALID, error=str(exc))
    planned = planned.with_documents(documents)
    if not force and log.is_done(spec.id, planned.key):
        return replace(planned, status=SKIP)
    return planned
