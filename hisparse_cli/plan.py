"""Deciding, before the engine starts, what each job needs: run, skip or fail.

Every input is read and checked here (:func:`~hisparse_cli.textio.read_document`), so
unreadable, binary or empty documents are reported before any model is loaded; such
a job fails on its own and the rest of the batch runs. A job whose last line in
``results.jsonl`` succeeded with the same resume key is skipped unless ``force``.

A job whose inputs are refused for their content (binary, undecodable, empty) gets a
resume key from the bytes refused and is marked ``final``: those bytes fail again with
the same settings. A job whose last line is such a final failure with the same key
(or a prompt refused for its length, recorded by the runner) is not tried again:
status ``failed-before``, no new line, unless ``retry_failed`` or ``force``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from hisparse_cli.keys import job_key, record_hash, settings_record
from hisparse_cli.manifest import JobSpec
from hisparse_cli.openai_batch import messages_sha256
from hisparse_cli.results import FINAL_INPUT, FINAL_PROMPT, ResultsLog
from hisparse_cli.textio import (
    EMPTY,
    Document,
    DocumentError,
    bom_codec,
    input_bytes,
    read_documents,
)

RUN, SKIP, INVALID, FAILED_BEFORE = "run", "skip", "invalid", "failed-before"


@dataclass(frozen=True)
class PlannedJob:
    """A job and what to do with it.

    status: ``run``, ``skip`` (already done), ``invalid`` (see ``error``) or
        ``failed-before`` (its last line is a final failure with the same key; ``error``
        is that line's error).
    removed_controls: control characters dropped from its inputs (worth a warning).
    warnings: notes on inputs read despite looking binary (``--allow-binary``) and on
        control characters removed (file, count, byte offset and line of the first).
    final: ``"input"`` when the failure (``invalid``) follows from the bytes of the
        inputs and the settings the key covers, so it would fail again (recorded as the
        line's ``final``); else ``None``.
    left_out: positions in ``spec.inputs`` of the files the job left out, empty ones
        among several (:func:`~hisparse_cli.textio.read_documents`); its line's ``input``
        lists the others, ``input_left_out`` these.
    left_out_reasons: why each of ``left_out`` was left out (empty, or only invisible
        characters).
    settings: what ``settings_hash`` hashes (:func:`~hisparse_cli.keys.settings_record`),
        kept on its line as ``settings``; its ``text`` is :func:`keyed_text_options`.
    text_options: the text options asked (``--encoding``, ``--errors``).
    """

    spec: JobSpec
    status: str
    settings_hash: str
    input_sha256: tuple[str, ...] = ()
    key: str = ""
    error: str = ""
    removed_controls: int = 0
    warnings: tuple[str, ...] = ()
    final: str | None = None
    left_out: tuple[int, ...] = ()
    settings: dict[str, Any] = field(default_factory=dict)
    left_out_reasons: tuple[str, ...] = ()
    text_options: dict[str, str] = field(default_factory=dict)

    def with_text(self, boms: Sequence[str | None]) -> PlannedJob:
        """The same job with its settings' text options as read: ``boms`` the codec of
        each input's byte-order mark (``None`` for one without) (:func:`keyed_text_options`)."""
        if not self.settings:
            return self
        text = keyed_text_options(self.text_options, boms)
        settings = {**self.settings, "text": text}
        return replace(self, settings=settings, settings_hash=record_hash(settings))

    def with_documents(self, documents: Sequence[Document]) -> PlannedJob:
        """The same job keyed by ``documents`` (their content may have changed since planning)."""
        keyed = self.with_text([d.bom_encoding for d in documents])
        hashes = tuple(d.sha256 for d in documents)
        removed = sum(d.removed_controls for d in documents)
        read = {d.path for d in documents}
        left_out = tuple(i for i, p in enumerate(self.spec.inputs) if Path(p) not in read)
        why = dict(documents[0].left_out) if documents else {}
        return replace(
            keyed,
            left_out=left_out,
            left_out_reasons=tuple(why.get(Path(self.spec.inputs[i]), EMPTY) for i in left_out),
            input_sha256=hashes,
            key=job_key(hashes, keyed.settings_hash),
            removed_controls=removed,
            warnings=tuple(
                note for d in documents for note in (d.warning, d.control_note) if note
            ),
        )

    def base_record(self, model: str) -> dict[str, Any]:
        """Fields of this job's ``results.jsonl`` line known before it runs: ``input``
        the files it read (``input_sha256`` theirs), and ``input_left_out`` (only when it
        left one out) the others, each with its ``index`` among the job's inputs."""
        inputs = self.spec.inputs
        reasons = self.left_out_reasons or (EMPTY,) * len(self.left_out)
        left_out = [
            {"path": str(inputs[i]), "index": i, "reason": reason}
            for i, reason in zip(self.left_out, reasons, strict=True)
        ]
        return {
            "id": self.spec.id,
            "output": self.spec.output,
            "input": [str(p) for i, p in enumerate(inputs) if i not in self.left_out],  # "-": stdin
            **({"input_left_out": left_out} if left_out else {}),
            "input_sha256": list(self.input_sha256),
            "key": self.key,
            "settings_hash": self.settings_hash,
            **({"settings": self.settings} if self.settings else {}),
            "task": self.spec.task.task,
            "model": model,
            **({"custom_id": self.spec.custom_id} if self.spec.custom_id is not None else {}),
            "truncated": None,  # set when context_policy=truncate cut the document
        }


def keyed_text_options(text_options: dict[str, str], boms: Sequence[str | None]) -> dict[str, str]:
    """The text options a job's resume key records: as asked, but where a byte-order mark
    decided the encoding of every input (a file with one is read in its mark's encoding
    whatever ``--encoding`` says), the marks' codecs in its place, so another
    ``--encoding`` keeps the key. ``boms``: each input's mark's codec, ``None`` for none."""
    if not boms or None in boms:
        return dict(text_options)
    return {**text_options, "encoding": ",".join(dict.fromkeys(boms))}


def plan_jobs(
    specs: Sequence[JobSpec],
    config: EngineConfig,
    model_id: str,
    text_options: dict[str, str],
    log: ResultsLog,
    force: bool = False,
    allow_binary: bool = False,
    retry_failed: bool = False,
    stdin: bytes | None = None,
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
        key: it only changes the text of documents that fail without it, so a final
        failure recorded without it is tried again with it.
    retry_failed
        Try jobs again whose last line is a final failure with the same key
        (``--retry-failed``; ``force`` does too).
    stdin
        The bytes of standard input, for a job over :data:`~hisparse_cli.textio.STDIN`.
    """
    retry = force or retry_failed
    reading = {**text_options, "allow_binary": allow_binary, "stdin": stdin}
    return [_plan_one(spec, config, model_id, reading, log, force, retry) for spec in specs]


def _plan_one(
    spec: JobSpec,
    config: EngineConfig,
    model_id: str,
    reading: dict[str, Any],
    log: ResultsLog,
    force: bool,
    retry: bool,
) -> PlannedJob:
    """``reading``: :func:`read_documents`'s keyword arguments (text options first)."""
    text_options = {k: reading[k] for k in ("encoding", "errors")}
    record = settings_record(spec.task, spec.sampling, model_id, config, text_options)
    settings = record_hash(record)
    planned = PlannedJob(spec, RUN, settings, settings=record, text_options=text_options)
    if spec.messages is not None:  # an OpenAI-batch request: its messages are the input
        hashes = (messages_sha256(spec.messages),)
        planned = replace(planned, input_sha256=hashes, key=job_key(hashes, settings))
        if not force and log.is_done(spec.id, planned.key):
            return replace(planned, status=SKIP)
        return _unless_failed_before(planned, log, retry, RUN, "", FINAL_PROMPT)
    try:
        documents = read_documents(spec.inputs, **reading)
    except DocumentError as exc:
        read = _content_hashes(spec.inputs, reading["stdin"]) if exc.sha256 else None
        if read is None:  # unreadable: may work next time
            return replace(planned, status=INVALID, error=str(exc))
        hashes, boms = read
        planned = planned.with_text(boms)
        key = job_key(hashes, planned.settings_hash)
        planned = replace(planned, input_sha256=hashes, key=key, final=FINAL_INPUT)
        return _unless_failed_before(planned, log, retry, INVALID, str(exc), FINAL_INPUT)
    planned = planned.with_documents(documents)
    if not force and log.is_done(spec.id, planned.key):
        return replace(planned, status=SKIP)
    return _unless_failed_before(planned, log, retry, RUN, "", FINAL_PROMPT)


def _unless_failed_before(
    planned: PlannedJob, log: ResultsLog, retry: bool, status: str, error: str, kind: str
) -> PlannedJob:
    """``planned`` with ``status`` and ``error``, or ``failed-before`` when its last line
    is a final failure of ``kind`` with the same key (and ``retry`` is off): a document
    refused without ``--allow-binary`` that now reads is tried again, as its key is the
    same but the kind of failure it could meet is not."""
    earlier = None if retry else log.final_failure(planned.spec.id, planned.key, kind)
    if earlier is not None:
        return replace(planned, status=FAILED_BEFORE, error=str(earlier.get("error") or ""))
    return replace(planned, status=status, error=error)


def _content_hashes(
    paths: Sequence[Path], stdin: bytes | None
) -> tuple[tuple[str, ...], tuple[str | None, ...]] | None:
    """SHA-256 of each input's bytes (``stdin`` for standard input) and the codec of its
    byte-order mark (``None`` for none), or ``None`` if one cannot be read."""
    try:
        data = [input_bytes(p, stdin) for p in paths]
    except DocumentError:
        return None
    boms = [bom_codec(d) for d in data]
    return (
        tuple(hashlib.sha256(d).hexdigest() for d in data),
        tuple(b[0] if b is not None else None for b in boms),
    )
