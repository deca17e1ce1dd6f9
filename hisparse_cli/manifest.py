"""Jobs from a manifest or from document paths, validated before anything runs.

Job fields: ``id``, ``input`` (path, glob or list of them; several files are joined
into one document), ``task``, ``prompt`` (alias ``template``), ``question``,
``fields``, ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``,
``stop`` (string or list) and ``output`` (file name in the output dir; ``.txt`` is
added). Paths are relative to the manifest's folder.

Precedence per job: built-in defaults < manifest ``defaults`` < the job's own fields <
command-line flags (a flag beats the file). Without ``task``, a job with a ``prompt``
is ``custom`` and any other is ``summarize``. Without ``id``, the id is derived from
the first input path (:func:`hisparse_cli.naming.derive_ids`).

Every problem found (unknown fields, wrong types, bad values, missing files, globs
matching nothing, duplicate ids, two jobs writing the same output file) is collected
with file, line and field, and all are raised together in one :class:`ManifestError`.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import EngineConfig, SamplingParams, setting_problem
from hisparse_cli.manifest_source import (
    COMMAND_LINE,
    Entry,
    Problem,
    RawManifest,
    read_manifest_file,
)
from hisparse_cli.naming import EarlierJob, derive_ids, name_problem, output_filename
from hisparse_cli.tasks import TASKS, TaskSpec, template_problem

JOB_FIELDS = (
    "id",
    "input",
    "task",
    "prompt",
    "template",
    "question",
    "fields",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "output",
)
PER_JOB_ONLY = ("id", "input", "output")
CLI_FLAGS = {
    "task": "--task",
    "prompt": "--prompt",
    "question": "--question",
    "fields": "--fields",
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "seed": "--seed",
    "stop": "--stop",
}
_CLI_NAMES = {**CLI_FLAGS, "input": "DOCS"}
_GLOB_CHARS = re.compile(r"[*?\[]")


class ManifestError(Exception):
    """The jobs cannot run as given; ``problems`` lists every finding. ``engine`` and
    ``engine_origin`` are the manifest's valid ``defaults.engine`` settings and where they
    were read, so the caller can add the problems of the combined engine settings."""

    def __init__(
        self,
        problems: Sequence[Problem],
        engine: dict[str, Any] | None = None,
        engine_origin: Entry | None = None,
    ) -> None:
        self.problems = list(problems)
        self.engine = engine or {}
        self.engine_origin = engine_origin
        super().__init__("\n".join(str(p) for p in self.problems))


@dataclass(frozen=True)
class JobSpec:
    """One validated job.

    inputs: files read and joined into the job's document, in order.
    output: file name of the text result inside the output dir (``*.txt``).
    origin: ``file:line`` (or ``command line``) for messages.
    """

    id: str
    inputs: tuple[Path, ...]
    task: TaskSpec
    sampling: SamplingParams
    output: str
    origin: str


@dataclass(frozen=True)
class Manifest:
    """Validated jobs plus the engine settings of ``defaults.engine``.

    engine_origin: where ``defaults.engine`` was read (file and line of each setting), for
    problems found once the settings meet the preset and the flags.
    """

    jobs: tuple[JobSpec, ...]
    engine: dict[str, Any]
    engine_origin: Entry | None = None


def load_manifest(
    path: Path | str,
    overrides: Mapping[str, Any] | None = None,
    earlier_jobs: Sequence[EarlierJob] = (),
) -> Manifest:
    """Read and validate a YAML or JSONL manifest.

    Parameters
    ----------
    path
        The manifest; input paths in it are relative to its folder.
    overrides
        Job fields from command-line flags (``None`` values are ignored); they beat
        the manifest.
    earlier_jobs
        Jobs earlier runs recorded in the output directory
        (:func:`hisparse_cli.results.earlier_jobs`): jobs without an ``id`` over the same
        inputs keep their ids; other derived ids avoid their ids and output files.

    Raises
    ------
    ManifestError
        With every problem found.
    """
    path = Path(path)
    return _build(read_manifest_file(path), path.parent, overrides, earlier_jobs)


def jobs_from_paths(
    patterns: Sequence[str],
    overrides: Mapping[str, Any] | None = None,
    base: Path | None = None,
    earlier_jobs: Sequence[EarlierJob] = (),
) -> Manifest:
    """One job per document (the short form ``hisparse run docs/*.txt``).

    Parameters
    ----------
    patterns
        Paths or globs, relative to ``base`` (default: the current directory). A path
        given twice yields one job.
    overrides
        Job fields from command-line flags.
    earlier_jobs
        As for :func:`load_manifest`: a document keeps the id an earlier run gave it.

    Raises
    ------
    ManifestError
        Missing files, globs matching nothing, directories, bad flag values.
    """
    base = base or Path.cwd()
    raw = RawManifest()
    files: list[Path] = []
    for pattern in patterns:
        entry = Entry(COMMAND_LINE, "", None, {"input": pattern})
        found = _expand(pattern, base, entry, raw.problems)
        files.extend(f for f in found if f not in files)
    for ident, path in zip(derive_ids(files, earlier=earlier_jobs), files, strict=True):
        values = {"id": ident, "input": glob.escape(str(path))}
        raw.jobs.append(Entry(COMMAND_LINE, f"document {path}", None, values))
    return _build(raw, base, overrides)


# ----------------------------------------------------------------------------- build


def _build(
    raw: RawManifest,
    base: Path,
    overrides: Mapping[str, Any] | None,
    earlier_jobs: Sequence[EarlierJob] = (),
) -> Manifest:
    problems = raw.problems
    values = {k: v for k, v in (overrides or {}).items() if v is not None}
    cli = _clean(Entry(COMMAND_LINE, "", None, values), problems, allowed=CLI_FLAGS)
    defaults = raw.defaults and _clean(raw.defaults, problems, allowed=_DEFAULT_FIELDS)
    engine = _engine_settings(raw.engine, problems)
    jobs = [_clean(e, problems, allowed=JOB_FIELDS) for e in raw.jobs]
    merged = [_merge([defaults, job, cli]) for job in jobs]
    inputs = [_job_inputs(m, job, base, problems) for m, job in zip(merged, jobs, strict=True)]
    _assign_ids(merged, inputs, jobs, earlier_jobs)
    specs = [
        _spec(m, job, paths, problems) for m, job, paths in zip(merged, jobs, inputs, strict=True)
    ]
    _check_unique(specs, merged, problems)
    if problems:
        raise ManifestError(list(dict.fromkeys(problems)), engine, raw.engine)
    return Manifest(tuple(s for s in specs if s is not None), engine, raw.engine)


_DEFAULT_FIELDS = tuple(f for f in JOB_FIELDS if f not in PER_JOB_ONLY)
Merged = dict[str, tuple[Any, Entry]]


def _clean(entry: Entry, problems: list[Problem], allowed: Iterable[str]) -> Entry:
    """Drop (and report) unknown and invalid fields; ``template`` becomes ``prompt``."""
    allowed = tuple(allowed)
    clean = Entry(entry.file, entry.label, entry.line, {}, dict(entry.lines))
    for name, value in entry.values.items():
        message = _field_problem(name, value, allowed, entry.label)
        if message:
            problems.append(_problem(entry, name, message))
            clean.invalid.add("prompt" if name == "template" else name)
        else:
            clean.values[name] = value  # None stays: it clears a default in _merge
    if "template" in clean.values:
        if "prompt" in clean.values:
            problems.append(_problem(entry, "template", "give either prompt or template, not both"))
        clean.values["prompt"] = clean.values.pop("template")
        clean.lines.setdefault("prompt", entry.where("template") or 0)
    return clean


def _field_problem(name: str, value: Any, allowed: tuple[str, ...], label: str) -> str | None:
    if name not in allowed:
        return _unknown_field(name, allowed, label)
    return None if value is None else _CHECKS[name](value)


def _unknown_field(name: str, allowed: tuple[str, ...], label: str) -> str:
    if label == "defaults" and name in PER_JOB_ONLY:
        return "cannot be set in defaults (it is per job)"
    if name == "engine":
        return "unknown field; engine settings go under defaults.engine"
    close = difflib.get_close_matches(name, allowed, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown field{hint}; known fields: {', '.join(allowed)}"


def _merge(entries: Sequence[Entry | None]) -> Merged:
    merged: Merged = {}
    for entry in entries:
        if entry is not None:
            merged.update({k: (v, entry) for k, v in entry.values.items()})
    return {k: (v, entry) for k, (v, entry) in merged.items() if v is not None}


def _job_inputs(merged: Merged, job: Entry, base: Path, problems: list[Problem]) -> list[Path]:
    if "input" not in merged:
        if "input" not in job.invalid:
            problems.append(_problem(job, "input", "is required (a path, a glob or a list)"))
        return []
    value, entry = merged["input"]
    patterns = [value] if isinstance(value, str) else value
    files: list[Path] = []
    for pattern in patterns:
        files.extend(f for f in _expand(pattern, base, entry, problems) if f not in files)
    return files


def _expand(pattern: str, base: Path, entry: Entry, problems: list[Problem]) -> list[Path]:
    """Files matching ``pattern`` (relative to ``base``), reporting missing ones."""
    text = os.path.expanduser(pattern)
    if _GLOB_CHARS.search(text):
        matches = sorted(glob.glob(text, root_dir=base, recursive=True))
        files = [_absolute(base, m) for m in matches if _absolute(base, m).is_file()]
        if not files:
            problems.append(
                _problem(entry, "input", f"glob {pattern!r} matches no files (in {base})")
            )
        return files
    path = _absolute(base, text)
    if path.is_dir():
        problems.append(
            _problem(entry, "input", f"{pattern!r} is a directory (use a glob such as dir/*.txt)")
        )
    elif not path.is_file():
        problems.append(
            _problem(entry, "input", f"file not found: {pattern!r} (looked for {path})")
        )
    else:
        return [path]
    return []


def _absolute(base: Path, path: str) -> Path:
    return Path(os.path.abspath(base / path))


def _assign_ids(
    merged: list[Merged],
    inputs: list[list[Path]],
    jobs: list[Entry],
    earlier_jobs: Sequence[EarlierJob],
) -> None:
    """Give jobs without an ``id`` one derived from their first input (a job whose
    ``id`` is invalid gets none, so it adds no follow-on problems)."""
    missing = [i for i, m in enumerate(merged) if "id" not in m and "id" not in jobs[i].invalid]
    missing = [i for i in missing if inputs[i]]
    taken = [m["id"][0] for m in merged if "id" in m]
    derived = derive_ids(
        [inputs[i][0] for i in missing],
        taken=taken,
        earlier=earlier_jobs,
        inputs=[inputs[i] for i in missing],
    )
    for i, ident in zip(missing, derived, strict=True):
        merged[i]["id"] = (ident, jobs[i])


def _spec(
    merged: Merged, job: Entry, inputs: list[Path], problems: list[Problem]
) -> JobSpec | None:
    task = _task_spec(merged)
    _task_problems(task, merged, job, problems)
    sampling = _sampling(merged)
    if "id" not in merged or not inputs:
        return None
    ident = merged["id"][0]
    output = output_filename(merged.get("output", (ident,))[0])
    line = job.where("id")
    return JobSpec(
        ident, tuple(inputs), task, sampling, output, f"{job.file}:{line}" if line else job.file
    )


def _task_problems(task: TaskSpec, merged: Merged, job: Entry, problems: list[Problem]) -> None:
    """Report task inconsistencies: a conflicting field where it was set; a missing one
    on the job, or on the command line when ``--task`` chose the task."""
    task_entry = merged.get("task", (None, job))[1]
    owner = task_entry if task_entry.file == COMMAND_LINE else job
    for name, message in task.problems():
        if name in job.invalid or name in task_entry.invalid:
            continue
        entry = merged[name][1] if name in merged else owner
        problems.append(_problem(entry, name, message))


def _task_spec(merged: Merged) -> TaskSpec:
    values = {k: v for k, (v, _) in merged.items()}
    default_task = "custom" if "prompt" in values else "summarize"
    fields = values.get("fields")
    return TaskSpec(
        task=values.get("task", default_task),
        prompt=values.get("prompt"),
        question=values.get("question"),
        fields=tuple(fields) if isinstance(fields, list) else fields,
    )


def _sampling(merged: Merged) -> SamplingParams:
    values = {k: v for k, (v, _) in merged.items()}
    stop = values.get("stop", ())
    return SamplingParams(
        temperature=float(values.get("temperature", 0.0)),
        top_p=float(values.get("top_p", 1.0)),
        top_k=values.get("top_k", 0),
        seed=values.get("seed"),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        max_tokens=values.get("max_new_tokens", SamplingParams().max_tokens),
    )


def _check_unique(
    specs: list[JobSpec | None], merged: list[Merged], problems: list[Problem]
) -> None:
    ids: dict[str, Entry] = {}
    outputs: dict[str, tuple[str, Entry]] = {}
    for spec, m in zip(specs, merged, strict=True):
        if spec is None:
            continue
        id_entry, out_entry = m["id"][1], m.get("output", m["id"])[1]
        first = ids.setdefault(spec.id.casefold(), id_entry)
        if first is not id_entry:
            problems.append(_problem(id_entry, "id", f"duplicate id {spec.id!r} ({_place(first)})"))
            continue
        owner, first_out = outputs.setdefault(spec.output.casefold(), (spec.id, out_entry))
        if first_out is not out_entry:
            message = f"output file {spec.output!r} is also written by job {owner!r} ({_place(first_out)})"
            problems.append(_problem(out_entry, "output", message))


def _place(entry: Entry) -> str:
    line = entry.where("id")
    return f"first used on line {line}" if line else f"first used by {entry.label}"


def _problem(entry: Entry, name: str, message: str) -> Problem:
    if entry.file == COMMAND_LINE and name in _CLI_NAMES:
        return Problem(COMMAND_LINE, None, _CLI_NAMES[name], message)
    if entry.file == COMMAND_LINE and entry.label:  # "document PATH": not a dotted path
        return Problem(COMMAND_LINE, None, f"{entry.label}, {name}", message)
    label = f"{entry.label}.{name}" if entry.label else name
    return Problem(entry.file, entry.where(name), label, message)


# ----------------------------------------------------------------------------- engine


_ENGINE_FIELDS = {f.name: str(f.type) for f in dataclasses.fields(EngineConfig)}
_TYPE_NAMES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "None": (type(None),),
    "dict[str, Any]": (dict,),
}


def _engine_settings(entry: Entry | None, problems: list[Problem]) -> dict[str, Any]:
    """``defaults.engine``: EngineConfig field -> value, checking names, types and each
    value on its own (:func:`engine.config.setting_problem`); settings that only clash
    with others (which may come from the preset or flags) are checked when the layers are
    resolved (:func:`hisparse_cli.settings.resolve_engine_config`)."""
    if entry is None:
        return {}
    settings = {}
    for name, value in entry.values.items():
        message = _engine_problem(name, value)
        if message:
            problems.append(_problem(entry, name, message))
        else:
            settings[name] = value
    return settings


def _engine_problem(name: str, value: Any) -> str | None:
    if name not in _ENGINE_FIELDS:
        close = difflib.get_close_matches(name, _ENGINE_FIELDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown engine setting{hint}"
    declared = _ENGINE_FIELDS[name]
    accepted = tuple(t for part in declared.split(" | ") for t in _TYPE_NAMES.get(part, (object,)))
    if isinstance(value, bool) and bool not in accepted:
        return f"must be {declared}, got {value!r}"
    if not isinstance(value, accepted):
        return f"must be {declared}, got {value!r}"
    return setting_problem(name, value)


# ----------------------------------------------------------------------------- checks


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_text(value: Any) -> str | None:
    if not isinstance(value, str) or not value.strip():
        return f"must be a non-empty string, got {value!r}"
    return None


def _check_strings(value: Any, what: str) -> str | None:
    if isinstance(value, str):
        return _check_text(value)
    if not isinstance(value, list) or not value:
        return f"must be {what}, got {value!r}"
    bad = [v for v in value if not isinstance(v, str) or not v]
    return f"must be {what}; bad item(s): {bad!r}" if bad else None


def _check_input(value: Any) -> str | None:
    return _check_strings(value, "a path, a glob or a non-empty list of them")


def _check_fields(value: Any) -> str | None:
    return _check_strings(value, "a list of field names or schema text")


def _check_stop(value: Any) -> str | None:
    return _check_strings(value, "a string or a list of strings")


def _check_task(value: Any) -> str | None:
    return None if value in TASKS else f"must be one of {', '.join(TASKS)}, got {value!r}"


def _check_prompt(value: Any) -> str | None:
    return _check_text(value) or template_problem(value)


def _check_max_new_tokens(value: Any) -> str | None:
    return None if _is_int(value) and value > 0 else f"must be a positive integer, got {value!r}"


def _check_temperature(value: Any) -> str | None:
    return None if _is_number(value) and value >= 0 else f"must be a number >= 0, got {value!r}"


def _check_top_p(value: Any) -> str | None:
    return (
        None
        if _is_number(value) and 0 < value <= 1
        else f"must be a number in (0, 1], got {value!r}"
    )


def _check_top_k(value: Any) -> str | None:
    ok = _is_int(value) and value >= -1
    return None if ok else f"must be an integer >= 0 (0 or -1 disables), got {value!r}"


def _check_seed(value: Any) -> str | None:
    return None if _is_int(value) else f"must be an integer, got {value!r}"


_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "id": name_problem,
    "output": name_problem,
    "input": _check_input,
    "task": _check_task,
    "prompt": _check_prompt,
    "template": _check_prompt,
    "question": _check_text,
    "fields": _check_fields,
    "max_new_tokens": _check_max_new_tokens,
    "temperature": _check_temperature,
    "top_p": _check_top_p,
    "top_k": _check_top_k,
    "seed": _check_seed,
    "stop": _check_stop,
}
