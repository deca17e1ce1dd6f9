"""Resume keys: what a job's output depends on, hashed.

``settings_hash`` covers the task and prompt, sampling, model, text decoding options
and the engine settings that can change the generated text. ``job_key`` adds the
SHA-256 of every input file. A job whose last successful line in ``results.jsonl``
carries the same id and key is skipped on the next run.

Engine settings left out of the key (:data:`OUTPUT_NEUTRAL_SETTINGS`) only move work
between devices or memories, change speed, or are exact by design (the hierarchical
hot buffer equals all-resident sparse attention bit for bit), so changing them does
not redo finished jobs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.config import EngineConfig, SamplingParams
from hisparse_cli.manifest_source import PRESET_SAMPLING_FIELDS
from hisparse_cli.tasks import TaskSpec

KEY_VERSION = 1
DEFAULT_MODEL_ID = "embedded-default"
OUTPUT_NEUTRAL_SETTINGS = frozenset(
    {
        "device",
        "hierarchical",
        "cpu_direct_reads",
        "device_buffer",
        "max_batch",
        "prefill_chunk",
        "prefill_turn_tokens",
        "prefill_copy_stream",
        "decode_write_stream",
        "gather_turns",
        "prefetch_pages",
        "cuda_graph",
        "decode_overlap",
        "decode_micro_batches",
        "async_decode",
        "host_pool_gb",
        "memory_budget_gb",
        "use_triton",
        "num_threads",
        "devices",
        "parallel",
        "trace_path",
        "int4_triton_min_rows",
        "host_memory_gb",
        "audit_steps",  # the audit only reads the KV (tests/engine/test_audit.py)
        "audit_seed",
    }
)


ADDED_SETTINGS = {"hot_buffer_dtype": "bf16"}
"""Settings added after :data:`KEY_VERSION` 1, with the value that behaves as runs did
before them: they enter the key only at another value, so earlier results keep their keys.
``hot_buffer_dtype`` is not output-neutral: an fp8 hot buffer changed the text of a
`hisparse run` on the H200 (docs/performance.md, "An fp8 hot buffer")."""


def output_settings(config: EngineConfig) -> dict[str, Any]:
    """The engine settings that can change generated text (all but the neutral ones, and
    the :data:`ADDED_SETTINGS` at their old behaviour's value)."""
    return output_only(config.to_dict())


def output_only(engine: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`output_settings` of engine settings given as a dict (``config.json``'s)."""
    return {
        k: v
        for k, v in engine.items()
        if k not in OUTPUT_NEUTRAL_SETTINGS and ADDED_SETTINGS.get(k, object()) != v
    }


def model_fingerprint(model: str | None) -> str:
    """Identity of a model for the key: file name, size and modification time.

    Name/size/mtime rather than a content hash, because weights are gigabytes; moving
    the file keeps the identity, rewriting it changes it. A directory uses the same of
    each file directly inside it. ``None`` (the embedded default) is a fixed string.
    """
    if model is None:
        return DEFAULT_MODEL_ID
    path = Path(model)
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    parts = [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files if p.exists()]
    return f"{path.name}|{'|'.join(parts)}"


def settings_record(
    task: TaskSpec,
    sampling: SamplingParams,
    model_id: str,
    config: EngineConfig,
    text_options: dict[str, str],
) -> dict[str, Any]:
    """Everything but the inputs that determines a job's output: what
    :func:`settings_hash` hashes, kept on the job's ``results.jsonl`` line (``settings``)
    so a later run can say which of them it changed (:func:`setting_changes`).

    Parameters
    ----------
    task
        Task, prompt template, question and fields.
    sampling
        Sampling parameters (seed included).
    model_id
        :func:`model_fingerprint` of the model.
    config
        Resolved engine config; only :func:`output_settings` enter the record.
    text_options
        How documents are decoded (``encoding``, ``errors``).
    """
    payload = {
        "version": KEY_VERSION,
        "task": task.to_dict(),
        "sampling": dataclasses.asdict(sampling),
        "model": model_id,
        "engine": output_settings(config),
        "text": text_options,
    }
    if task.task == "extract" and isinstance(task.fields, tuple):
        # the reply is decoded constrained to the JSON object (engine.decode.json_constraint):
        # not the output an unconstrained run of the same job wrote
        payload["reply"] = "json-object"
    return payload


def settings_hash(
    task: TaskSpec,
    sampling: SamplingParams,
    model_id: str,
    config: EngineConfig,
    text_options: dict[str, str],
) -> str:
    """SHA-256 (hex) of :func:`settings_record` (the same parameters)."""
    return record_hash(settings_record(task, sampling, model_id, config, text_options))


def record_hash(record: Mapping[str, Any]) -> str:
    """:func:`settings_hash` of a :func:`settings_record` (also one read back from JSON)."""
    return _sha256_json(record)


def setting_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """``"name old -> new"`` for each setting that differs between two
    :func:`settings_record` s (task, sampling, model, engine, text decoding, in that order),
    named as a manifest or ``config.json`` names them: ``top_k 2048 -> 1024`` is the
    engine's (``--top-k-tokens``), ``top_k (sampling) 0 -> 40`` the job's."""
    old, new = _as_json(old), _as_json(new)  # a record read back from a line: lists, not tuples
    changes = []
    engine_names = set(_section(old, "engine")) | set(_section(new, "engine"))
    for section in ("task", "sampling", "model", "engine", "text"):
        if section == "model":
            if old.get("model") != new.get("model"):
                changes.append(_model_change(old.get("model"), new.get("model")))
            continue
        before, after = _section(old, section), _section(new, section)
        for name in [*before, *(k for k in after if k not in before)]:
            if before.get(name) != after.get(name):
                label = PRESET_SAMPLING_FIELDS.get(name, name) if section == "sampling" else name
                if section != "engine" and label in engine_names:
                    label = f"{label} ({section})"
                changes.append(f"{label} {_shown(before.get(name))} -> {_shown(after.get(name))}")
    for name in ("reply", "version"):  # the reply follows the task's fields: said above
        if not changes and old.get(name) != new.get(name):
            changes.append(f"{name} {_shown(old.get(name))} -> {_shown(new.get(name))}")
    return changes


def _as_json(record: Mapping[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(record, default=str))


def _section(record: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = record.get(name)
    return dict(value) if isinstance(value, Mapping) else {}


def _model_change(before: Any, after: Any) -> str:
    """A model fingerprint's change: the file names, or that the same name was rewritten."""
    names = [str(m).split("|", 1)[0] if m is not None else None for m in (before, after)]
    if names[0] == names[1]:
        return f"model {names[1]} (the file changed)"
    return f"model {_shown(names[0])} -> {_shown(names[1])}"


_PLAIN = re.compile(r"[\w.:/+-]{1,40}")


def _shown(value: Any) -> str:
    """A setting's value in a line of text: short words as they are, other text quoted,
    ``unset`` for none, long values cut."""
    if value is None:
        return "unset"
    if isinstance(value, str) and _PLAIN.fullmatch(value):
        return value
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= 40 else text[:39] + "…"


def job_key(input_sha256: Sequence[str], settings: str) -> str:
    """Resume key: SHA-256 of the input content hashes (in order) and ``settings``."""
    return _sha256_json({"inputs": list(input_sha256), "settings": settings})


def _sha256_json(payload: Any) -> str:
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()
