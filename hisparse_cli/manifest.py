"""Jobs from a manifest or from document paths, validated before anything runs.

Job fields: ``id``, ``input`` (path, glob or list of them; several files are joined
into one document), ``task``, ``prompt`` (alias ``template``), ``question``,
``fields``, ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``,
``stop`` (string or list) and ``output`` (file name in the output dir; ``.txt`` is
added). Paths are relative to the manifest's folder. A glob never matches a file in the
run's output folder (``output_dir``: its ``results.jsonl``, ``<id>.txt``, ``config.json``
and lock file are outputs, never inputs); skipped files are noted once.

Precedence per job: built-in defaults < manifest ``defaults`` < the job's own fields <
command-line flags (a flag beats the file). Without ``task``, a job with a ``prompt``
is ``custom`` and any other is ``summarize``. Without ``id``, the id is derived from
the first input path (:func:`hisparse_cli.naming.derive_ids`).

Every problem found (unknown fields, wrong types, bad values, missing files, globs
matching nothing, duplicate ids, two jobs writing the same output file) is collected
with file, line and field, and all are raised together in one :class:`ManifestError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import fnmatch
import glob
import os
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import SAMPLING_CHECKS, EngineConfig, SamplingParams, setting_problem
from hisparse_cli.display import escaped
from hisparse_cli.manifest_source import (
    COMMAND_LINE,
    PRESET_SAMPLING,
    PRESET_SAMPLING_FIELDS,
    Entry,
    Problem,
    RawManifest,
    read_manifest_file,
)
from hisparse_cli.naming import (
    EarlierJob,
    derive_ids,
    name_problem,
    output_filename,
    stdin_job_id,
)
from hisparse_cli.openai_batch import BATCH_OUTPUT_FILE
from hisparse_cli.results import LOCK_FILE, PARTIAL_FILE, RESULTS_FILE
from hisparse_cli.settings import CONFIG_FILE
from hisparse_cli.tasks import TASKS, TaskSpec, template_problem
from hisparse_cli.textio import STDIN, broken_link, file_identity, shown_path

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
    were read, so the caller can add the problems of the combined engine settings
    (:meth:`add`)."""

    def __init__(
        self,
        problems: Sequence[Problem],
        engine: dict[str, Any] | None = None,
        engine_origin: Entry | None = None,
    ) -> None:
        self.problems: list[Problem] = []
        self.add(problems)
        self.engine = engine or {}
        self.engine_origin = engine_origin

    def add(self, problems: Sequence[Problem]) -> None:
        """Add ``problems``, keeping all in reading order: the command line's (and the
        preset's, which have no line) first, then each file's by line (stable)."""
        self.problems = sorted(
            [*self.problems, *problems],
            key=lambda p: (p.line is not None, str(p.file) if p.line is not None else "", p.line or 0),
        )
        super().__init__("\n".join(str(p) for p in self.problems))


@dataclass(frozen=True)
class JobSpec:
    """One validated job.

    inputs: files read and joined into the job's document, in order.
    output: file name of the text result inside the output dir (``*.txt``).
    origin: ``file:line`` (or ``command line``) for messages.
    messages: the chat messages of an OpenAI-batch request (:mod:`hisparse_cli.openai_batch`;
        ``inputs`` is then empty and ``task.task`` is ``chat``), else ``None``.
    custom_id: that request's ``custom_id`` (the id may differ when it is not file-safe).
    sampling_from: (job field, where it was set) for each sampling field given in some
        layer (:func:`value_source`); :meth:`source` reads it.
    """

    id: str
    inputs: tuple[Path, ...]
    task: TaskSpec
    sampling: SamplingParams
    output: str
    origin: str
    messages: tuple[dict[str, str], ...] | None = None
    custom_id: str | None = None
    sampling_from: tuple[tuple[str, str], ...] = ()

    def source(self, name: str) -> str:
        """Where sampling field ``name`` (``max_new_tokens``, ``temperature``, ...) of this
        job was set, in words: a flag, a manifest line, the preset, or ``default``."""
        return dict(self.sampling_from).get(name, "default")


@dataclass(frozen=True)
class Manifest:
    """Validated jobs plus the engine settings of ``defaults.engine``.

    engine_origin: where ``defaults.engine`` was read (file and line of each setting), for
    problems found once the settings meet the preset and the flags.
    warnings: notes for the user that do not stop the run (a symbolic link a glob did not
    follow because it leads back into a folder already searched).
    batch: whether this is an OpenAI-batch manifest (results also go to ``batch_output.jsonl``).
    rejected: its lines that are not usable requests (:class:`~hisparse_cli.openai_batch.Rejected`);
        the other requests run.
    """

    jobs: tuple[JobSpec, ...]
    engine: dict[str, Any]
    engine_origin: Entry | None = None
    warnings: tuple[str, ...] = ()
    batch: bool = False
    rejected: tuple[Any, ...] = ()


def load_manifest(
    path: Path | str,
    overrides: Mapping[str, Any] | None = None,
    earlier_jobs: Sequence[EarlierJob] = (),
    sampling_base: Entry | None = None,
    output_dir: Path | None = None,
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
    sampling_base
        Sampling fields below the manifest's (the preset's ``sampling`` block,
        :func:`hisparse_cli.settings.preset_sampling`).
    output_dir
        The run's output folder: globs skip the files in it (:class:`OutputFolder`).

    Raises
    ------
    ManifestError
        With every problem found.
    """
    path = Path(path)
    raw = read_manifest_file(path)
    if raw.batch is not None:
        return _build_batch(raw, str(path), overrides, sampling_base)
    outputs = OutputFolder(output_dir)
    return _build(
        raw, path.parent, overrides, earlier_jobs, sampling_base=sampling_base, outputs=outputs
    )


BATCH_FLAGS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")
"""Job flags that apply to an OpenAI batch (they beat each request's body)."""
SAMPLING_FIELDS = BATCH_FLAGS
"""The job fields a preset's ``sampling`` block sets (checked as a manifest's are)."""


def _build_batch(
    raw: RawManifest,
    file: str,
    overrides: Mapping[str, Any] | None,
    sampling_base: Entry | None = None,
) -> Manifest:
    """Jobs of an OpenAI-batch manifest (:mod:`hisparse_cli.openai_batch`): bad lines are
    rejected one by one (the rest run); a flag that cannot apply (``--task``, ``--prompt``,
    ...) or a bad flag value is a :class:`ManifestError`."""
    from hisparse_cli import openai_batch

    problems: list[Problem] = []
    values = {k: v for k, v in (overrides or {}).items() if v is not None}
    for name in [k for k in values if k not in BATCH_FLAGS]:
        flag = CLI_FLAGS.get(name, name)
        problems.append(
            Problem(COMMAND_LINE, None, flag, "does not apply to an OpenAI batch manifest "
                    f"({escaped(file)}): each request's body.messages is its prompt")
        )  # fmt: skip
    cli = _clean(Entry(COMMAND_LINE, "", None, values), problems, allowed=BATCH_FLAGS)
    sampling_base = sampling_base and _clean(sampling_base, problems, allowed=SAMPLING_FIELDS)
    if problems:
        raise ManifestError(problems)
    requests, rejected = openai_batch.read_batch(file, raw.batch or [], raw.batch_errors)
    taken: set[str] = set()
    jobs = []
    for request in requests:
        ident = openai_batch.job_id_for(request.custom_id, taken)
        base = sampling_base.values if sampling_base is not None else {}
        sampling = openai_batch.sampling_params({**base, **request.sampling, **cli.values})
        body = Entry(file, "request body", request.line, dict(request.sampling))
        jobs.append(
            JobSpec(
                ident, (), TaskSpec(task=openai_batch.CHAT_TASK), sampling,
                output_filename(ident), f"{file}:{request.line}", request.messages,
                request.custom_id, sampling_sources(_merge([sampling_base, body, cli])),
            )
        )  # fmt: skip
    if not jobs and not rejected:
        raise ManifestError([Problem(file, None, "jobs", "the manifest holds no requests")])
    return Manifest(tuple(jobs), {}, None, (), batch=True, rejected=tuple(rejected))


def jobs_from_paths(
    patterns: Sequence[str],
    overrides: Mapping[str, Any] | None = None,
    base: Path | None = None,
    earlier_jobs: Sequence[EarlierJob] = (),
    stdin_sha256: str | None = None,
    sampling_base: Entry | None = None,
    output_dir: Path | None = None,
    earlier_outputs: Collection[Path] = (),
) -> Manifest:
    """One job per document (the short form ``hisparse run docs/*.txt``).

    Parameters
    ----------
    patterns
        Paths or globs, relative to ``base`` (default: the current directory). A file
        named twice (also through a symbolic link, a hard link or another spelling)
        yields one job, with a note naming each path;
        the check is linear in the number of paths. ``-`` is standard input: one job
        after the files', whose input is :data:`~hisparse_cli.textio.STDIN`, with the id
        :func:`~hisparse_cli.naming.stdin_job_id` gives it (``stdin``).
    overrides
        Job fields from command-line flags.
    earlier_jobs
        As for :func:`load_manifest`: a document keeps the id an earlier run gave it.
    stdin_sha256
        SHA-256 of standard input's bytes when ``-`` is among ``patterns``: standard
        input with the text of an earlier job over standard input keeps its id, other
        text gets another id (never taking over an earlier result).
    sampling_base, output_dir
        As for :func:`load_manifest` (a glob skips the output folder's files; a path
        named without one is taken as it is, unless it is one of ``earlier_outputs``).
    earlier_outputs
        The files earlier runs wrote in ``output_dir`` (resolved:
        :func:`~hisparse_cli.results.earlier_outputs`): a result named again (``hisparse
        run docs/*.txt -o docs``, the shell expanding the glob, on a second run) is no
        document, nor is one of the run's own files there (``config.json``,
        ``results.jsonl``, ...: :func:`_run_files`); it is skipped with one warning naming
        it (every document skipped is a problem: nothing to run).

    Raises
    ------
    ManifestError
        Missing files, globs matching nothing, directories, bad flag values.
    """
    base = base or Path.cwd()
    raw = RawManifest()
    warnings: list[str] = []
    found = _Unique()
    outputs = OutputFolder(output_dir)
    unreadable: list[tuple[str, Problem]] = []  # named paths that are missing or folders
    unmatched: list[Problem] = []  # globs that give no document
    found_problems: list[Problem] = []  # in the order of the arguments
    has_stdin = "-" in patterns
    for pattern in (p for p in patterns if p != "-"):
        problems: list[Problem] = []
        found.extend(expand_documents(pattern, base, problems, warnings, outputs), pattern)
        if problems and pattern.strip() and not _GLOB_CHARS.search(os.path.expanduser(pattern)):
            unreadable.append((pattern, problems[0]))  # a job that fails: it names a file
        elif problems:
            unmatched.extend(problems)
        found_problems.extend(problems)
    files = found.files
    warnings.extend(found.notes(base))
    own = _run_files(output_dir)
    results = [f for f in files if f.resolve() in earlier_outputs or f.resolve() in own]
    if results:  # an earlier run's result or file, given back by the shell's glob: no document
        files = [f for f in files if f not in results]
        note = _earlier_results_note(results, own, outputs.shown)
        if files or has_stdin:
            warnings.append(f"DOCS: skipped {note}")
        else:
            problem = f"skipped {note}; no other document is left to run"
            raw.problems.append(Problem(COMMAND_LINE, None, "DOCS", problem))
    if patterns.count("-") > 1:
        warnings.append(f"DOCS: '-' (standard input) is named {patterns.count('-')} times: one job")
    if files or has_stdin:  # the named-but-unreadable ones become failing jobs
        kept = {id(problem) for _, problem in unreadable} | {id(p) for p in unmatched}
        raw.problems.extend(p for p in found_problems if id(p) not in kept)
    else:  # nothing to run: every problem stops the run, as for a manifest
        raw.problems.extend(found_problems)
        unreadable, unmatched = [], []
    for _, problem in unreadable:  # the rest of the batch carries on; this job fails
        warnings.append(f"{problem.message}: that document's job fails, the others run")
    named = [*files, *(_absolute(base, os.path.expanduser(p)) for p, _ in unreadable)]
    stdin_id = None if not has_stdin else stdin_job_id(stdin_sha256, earlier_jobs)
    ids = derive_ids(named, [stdin_id] if stdin_id else [], earlier=earlier_jobs)
    for i, (ident, path) in enumerate(zip(ids, named, strict=True)):
        values = {"id": ident, "input": glob.escape(str(path))}
        label = f"document {path}" if i < len(files) else f"{UNREADABLE_LABEL}{path}"
        raw.jobs.append(Entry(COMMAND_LINE, label, None, values))
    if stdin_id is not None:  # after the files
        raw.jobs.append(Entry(COMMAND_LINE, STDIN_LABEL, None, {"id": stdin_id, "input": "-"}))
    manifest = _build(
        raw, base, overrides, warnings=warnings, sampling_base=sampling_base, outputs=outputs
    )
    # a glob that gives no document has no job to fail: refused as an input, the rest run
    return dataclasses.replace(manifest, rejected=tuple(UnmatchedInput(p) for p in unmatched))


@dataclass(frozen=True)
class UnmatchedInput:
    """A command-line glob that gave no document (it matches nothing, or only folders)
    while other documents were named: refused like a bad batch line (an error on stderr,
    counted as refused in the summary, exit status 1), the other documents run."""

    problem: Problem

    def __str__(self) -> str:
        return f"{self.problem}: nothing from it runs, the other documents do"


def _run_files(output_dir: Path | None) -> set[Path]:
    """The files every run writes in ``output_dir`` itself, resolved: ``config.json``,
    ``results.jsonl``, the lock file, ``batch_output.jsonl`` and the ``results.jsonl.partial``
    files (``.partial.2`` ...) that there are; none without an output folder. A
    ``config.json`` or ``results.jsonl`` that hisparse did not write
    (:func:`hisparse_cli.settings.is_hisparse_config`,
    :func:`hisparse_cli.results.is_hisparse_results`) is left out: it is no run file but a
    file of the user's, which the run refuses to replace (and a job reading it fails)."""
    if output_dir is None:
        return set()
    from hisparse_cli.results import is_hisparse_results
    from hisparse_cli.settings import is_hisparse_config

    names = {*RUN_FILES, PARTIAL_FILE}
    with contextlib.suppress(OSError):
        for path in Path(output_dir).glob(glob.escape(PARTIAL_FILE) + ".*"):
            names |= {path.name} if path.suffix[1:].isdigit() else set()
    for name, ours in ((CONFIG_FILE, is_hisparse_config), (RESULTS_FILE, is_hisparse_results)):
        try:
            if not ours((Path(output_dir) / name).read_bytes()):
                names.discard(name)
        except OSError:  # missing or unreadable: nothing of the user's to protect
            pass
    return {(Path(output_dir) / name).resolve() for name in names}


def _earlier_results_note(files: Sequence[Path], own: Collection[Path], folder: str | None) -> str:
    """How a note names ``files``, results an earlier run wrote in the output folder
    ``folder`` or the run's own files there (``own``: :func:`_run_files`) that were named
    as documents (:func:`jobs_from_paths`)."""
    cwd = Path.cwd()
    names = [shown_path(p.relative_to(cwd) if p.is_relative_to(cwd) else p) for p in files]
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    runs = [p.resolve().name for p in files if p.resolve() in own]
    why = []
    if len(runs) < len(files):
        whose = "each" if not runs else f"{len(files) - len(runs)} of them"
        why.append(f"its {RESULTS_FILE} names {whose} as a job's output")
    if runs:
        why.append(f"{', '.join(runs)}: the run's own files, which every run writes")
    return (
        f"{len(names)} file(s) that an earlier run wrote in the output folder {folder} "
        f"({', '.join(names[:3])}{more}; {'; '.join(why)}): "
        f"a result{' or a run file' if runs else ''} is never read as a document; to use "
        "one, copy it out of that folder or choose another --output-dir"
    )


UNREADABLE_LABEL = "unreadable document "
"""Label of a command-line document that is missing or a folder while others exist: its
job is kept (it fails on reading, naming the path, and gets its results line)."""
STDIN_LABEL = "document - (standard input)"
"""Label of the job over standard input (``hisparse run -``)."""


# ----------------------------------------------------------------------------- build


def _build(
    raw: RawManifest,
    base: Path,
    overrides: Mapping[str, Any] | None,
    earlier_jobs: Sequence[EarlierJob] = (),
    warnings: list[str] | None = None,
    sampling_base: Entry | None = None,
    outputs: OutputFolder | None = None,
) -> Manifest:
    problems = raw.problems
    warnings = [] if warnings is None else warnings
    values = {k: v for k, v in (overrides or {}).items() if v is not None}
    cli = _clean(Entry(COMMAND_LINE, "", None, values), problems, allowed=CLI_FLAGS)
    defaults = raw.defaults and _clean(raw.defaults, problems, allowed=_DEFAULT_FIELDS)
    sampling_base = sampling_base and _clean(sampling_base, problems, allowed=SAMPLING_FIELDS)
    engine = _engine_settings(raw.engine, problems)
    jobs = [_clean(e, problems, allowed=JOB_FIELDS) for e in raw.jobs]
    merged = [_merge([sampling_base, defaults, job, cli]) for job in jobs]
    inputs = [
        _job_inputs(m, job, base, problems, warnings, outputs)
        for m, job in zip(merged, jobs, strict=True)
    ]
    if outputs is not None:
        warnings.extend(outputs.notes())
    _assign_ids(merged, inputs, jobs, earlier_jobs, problems)
    specs = [
        _spec(m, job, paths, problems) for m, job, paths in zip(merged, jobs, inputs, strict=True)
    ]
    _check_unique(specs, merged, problems)
    if problems:
        raise ManifestError(list(dict.fromkeys(problems)), engine, raw.engine)
    jobs_ = tuple(s for s in specs if s is not None)
    return Manifest(jobs_, engine, raw.engine, tuple(dict.fromkeys(warnings)))


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


def _job_inputs(
    merged: Merged,
    job: Entry,
    base: Path,
    problems: list[Problem],
    warnings: list[str],
    outputs: OutputFolder | None = None,
) -> list[Path]:
    if "input" not in merged:
        if "input" not in job.invalid:
            problems.append(_problem(job, "input", "is required (a path, a glob or a list)"))
        return []
    value, entry = merged["input"]
    patterns = [value] if isinstance(value, str) else value
    if job.file == COMMAND_LINE and job.label.startswith(UNREADABLE_LABEL):
        return [Path(job.label[len(UNREADABLE_LABEL) :])]  # fails when read, naming it
    if job.file == COMMAND_LINE and job.label == STDIN_LABEL:
        return [STDIN]
    files = _Unique()
    for pattern in patterns:
        files.extend(_expand(pattern, base, entry, problems, warnings, outputs))
    return files.files


class _Unique:
    """Files in the order first met, each real file once: two paths to the same file (a
    symbolic link, ``a/../b``, a hard link: :func:`~hisparse_cli.textio.file_identity`)
    count once. A dict makes it linear."""

    def __init__(self) -> None:
        self.files: list[Path] = []
        # the file's identity -> each (path, pattern) that named it
        self._given: dict[object, list[tuple[Path, str | None]]] = {}

    def extend(self, paths: Iterable[Path], pattern: str | None = None) -> None:
        """Add ``paths``, the files of ``pattern`` as the user gave it (for :meth:`notes`)."""
        for path in paths:
            key = file_identity(path)
            if key not in self._given:
                self.files.append(path)
            self._given.setdefault(key, []).append((path, pattern))

    def notes(self, base: Path) -> list[str]:
        """One note per file given more than once, naming each path as given
        (:func:`_as_given`), and the file they lead to (relative to ``base`` where it is
        inside it) only when none of them names it but through a symbolic link; paths
        that lead to several names of it are hard links, and the note says so."""
        notes = []
        for given in self._given.values():
            if len(given) < 2:
                continue
            names = ", ".join(_as_given(path, pattern, base) for path, pattern in given)
            reals = list(dict.fromkeys(path.resolve() for path, _ in given))
            if len(reals) > 1:  # ln a.txt b.txt: one file under two names
                leads = " (hard links to one file: the first is read)"
            else:
                real = reals[0]
                shown = shown_path(real.relative_to(base) if real.is_relative_to(base) else real)
                leads = "" if any(path == real for path, _ in given) else f" ({shown})"
            notes.append(f"DOCS: {names} are the same file{leads}: one job")
        return notes


def _as_given(path: Path, pattern: str | None, base: Path) -> str:
    """How ``path``, found from ``pattern`` (relative to ``base``), is named in notes: the
    pattern itself when it names one file, else the match as a path from ``base``
    (absolute for an absolute glob) with its glob."""
    if pattern is None:
        return shown_path(path)
    text = os.path.expanduser(pattern)
    if not _GLOB_CHARS.search(text):
        return shown_path(pattern)
    shown = path if Path(text).is_absolute() else os.path.relpath(path, base)
    return f"{shown_path(shown)} (glob {pattern!r})"


class OutputFolder:
    """The run's output folder as globs see it: the files directly in it (the run's
    ``results.jsonl``, ``<id>.txt``, ``config.json``, lock file) are outputs, never
    inputs, so :func:`_expand` leaves them out of every glob's matches and this keeps
    them for one note. A file is in it when its folder or the file it leads to is
    (symbolic links resolved, the output folder's too); its subfolders are searched as
    usual. ``None``: no output folder (nothing is left out). ``default``: the command's
    default folder, which its messages name (``hisparse eval``'s is ``hisparse-eval``)."""

    def __init__(self, output_dir: Path | str | None, default: str = "hisparse-out") -> None:
        self.shown = None if output_dir is None else escaped(str(output_dir))
        self.default = default
        self.real = None if output_dir is None else Path(os.path.realpath(output_dir))
        self.skipped: dict[Path, None] = {}  # in the order met, each once

    def holds(self, path: Path) -> bool:
        """Whether ``path`` is one of the output folder's own files."""
        if self.real is None:
            return False
        return (
            Path(os.path.realpath(path.parent)) == self.real
            or Path(os.path.realpath(path)).parent == self.real
        )

    def keep(self, files: Iterable[Path]) -> list[Path]:
        """``files`` less the output folder's, which are kept for :meth:`notes`."""
        kept = []
        for path in files:
            if self.holds(path):
                self.skipped[path] = None
            else:
                kept.append(path)
        return kept

    def only_there(self, pattern: str, count: int) -> str:
        """The problem of a glob whose ``count`` files are all in the output folder."""
        return (
            f"glob {pattern!r} matches only files in the output folder {self.shown} "
            f"({count} file(s)); a glob never reads the folder the run writes its results "
            f"in: choose another --output-dir (the default is {self.default})"
        )

    def notes(self) -> list[str]:
        """One note naming the files globs left out (none if none was)."""
        if not self.skipped:
            return []
        cwd = Path.cwd()
        names = [
            shown_path(p.relative_to(cwd) if p.is_relative_to(cwd) else p) for p in self.skipped
        ]
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        return [
            f"input globs skipped {len(names)} file(s) in the output folder {self.shown} "
            f"({', '.join(names[:3])}{more}): the run writes its results there, so no file "
            "there is ever read by a glob; to use them, name them or choose another --output-dir"
        ]


def expand_documents(
    pattern: str,
    base: Path,
    problems: list[Problem],
    warnings: list[str],
    outputs: OutputFolder,
) -> list[Path]:
    """The files of a command-line document argument (``DOCS`` of ``hisparse run`` and
    ``hisparse eval``): a path or a glob relative to ``base``, as :func:`_expand` finds
    them (``**`` safe from link loops; a glob never matches a file of ``outputs``, the
    command's output folder); its problems are ``DOCS`` problems of the command line."""
    entry = Entry(COMMAND_LINE, "", None, {"input": pattern})
    return _expand(pattern, base, entry, problems, warnings, outputs)


def _expand(
    pattern: str,
    base: Path,
    entry: Entry,
    problems: list[Problem],
    warnings: list[str] | None = None,
    outputs: OutputFolder | None = None,
) -> list[Path]:
    """Files matching ``pattern`` (relative to ``base``), reporting missing ones; a
    symbolic link a ``**`` glob did not follow (:func:`walk_glob`), and a broken one a
    glob matched (skipped: naming where it points), are noted in ``warnings``. A glob leaves out the files in the run's output folder (``outputs``,
    which keeps them for its note); a glob that matched only those is a problem."""
    if not pattern.strip():  # "" would be the current folder
        problems.append(
            _problem(entry, "input", f"{pattern!r} is empty (an unset shell variable?)")
        )
        return []
    text = os.path.expanduser(pattern)
    if _GLOB_CHARS.search(text):
        matches, skipped = walk_glob(text, base)
        # a broken symbolic link is no file to read: named with where it points, skipped
        broken = {m: link for m in matches if (link := broken_link(_absolute(base, m)))}
        if outputs is not None:  # the output folder's are left out as its files are
            held = set(outputs.keep(_absolute(base, m) for m in broken))
            broken = {m: link for m, link in broken.items() if _absolute(base, m) in held}
        skipped += [f"{shown_path(m)} {link}; skipped" for m, link in broken.items()]
        if warnings is not None:
            where = f"{entry.file}:{entry.where('input')}" if entry.where("input") else entry.file
            warnings.extend(f"{where}: input glob {pattern!r}: {note}" for note in skipped)
        files = [f for f in (_absolute(base, m) for m in matches) if f.is_file()]
        kept = outputs.keep(files) if outputs is not None else files
        if files and not kept:
            problems.append(_problem(entry, "input", outputs.only_there(pattern, len(files))))
        elif not files:
            found = f"glob {pattern!r} matches no files (in {base})"
            if broken:  # all it matched: say which, and why each is no file
                first, link = next(iter(broken.items()))
                more = f" (and {len(broken) - 1} more such links)" if len(broken) > 1 else ""
                found = f"{found}: {shown_path(first)} {link}{more}"
            problems.append(_problem(entry, "input", found))
        return kept
    path = _absolute(base, text)
    if path.is_dir():
        problems.append(
            _problem(entry, "input", f"{pattern!r} is a directory (use a glob such as dir/*.txt)")
        )
    elif path.is_file():
        return [path]
    elif path.exists() or text == "-":
        what = "standard input" if text == "-" else "not a regular file (a pipe or a device)"
        problems.append(
            _problem(
                entry,
                "input",
                f"{pattern!r} is {what}: a manifest's documents are files; save the text to "
                "a file, or pipe one document to `hisparse run -`"
                if text == "-"
                else f"{pattern!r} is {what}: documents are read from files; save the text "
                "to a file, or pipe it to `hisparse run -`",
            )
        )
    elif link := broken_link(path):
        problems.append(_problem(entry, "input", f"{pattern!r} {link}"))
    else:
        problems.append(
            _problem(entry, "input", f"file not found: {pattern!r} (looked for {shown_path(path)})")
        )
    return []


def _absolute(base: Path, path: str) -> Path:
    return Path(os.path.abspath(base / path))


def walk_glob(pattern: str, base: Path) -> tuple[list[str], list[str]]:
    """Paths matching ``pattern`` as :func:`glob.glob` (``recursive=True``, relative to
    ``base``) finds them, but safe from symbolic-link loops.

    A pattern without a ``**`` part goes to :func:`glob.glob` (it cannot recurse). With
    ``**``, the folders are walked here: symbolic links to folders are followed, but no
    folder is searched twice for the same part of the pattern (folders are told apart by
    device and inode), so a link back to a parent (``d/s/l -> ..``) neither repeats files
    nor makes the walk endless. Folders reached through a link are searched after all
    others, so the link, not the real folder, is what is skipped. As in :mod:`glob`, ``*``/``?``/``[...]`` match within one
    name and never a leading ``.`` unless the part starts with one, and ``**`` skips
    hidden folders.

    Parameters
    ----------
    pattern
        Glob, absolute or relative to ``base``.
    base
        Folder relative patterns start from.

    Returns
    -------
    matches : list of str
        Matching paths (files and folders), sorted; relative to ``base`` for a relative
        pattern.
    skipped : list of str
        One note per symbolic link not followed: the link, where it leads, and why.
    """
    parts = pattern.split("/")
    if "**" not in parts:
        return sorted(glob.glob(pattern, root_dir=base, recursive=True)), []
    absolute = pattern.startswith("/")
    if absolute:
        parts = parts[1:]
    parts = [p for p in parts if p]  # "a//b" and a trailing "/" as glob treats them
    lead = 0
    while lead < len(parts) and not _GLOB_CHARS.search(parts[lead]):
        lead += 1
    start = "/" + "/".join(parts[:lead]) if absolute else "/".join(parts[:lead])
    pats = parts[lead:]
    root = os.path.join(base, start) if start else str(base)
    matches: list[str] = []
    skipped: list[str] = []
    seen: set[tuple[int, int, int]] = set()
    stack: list[tuple[str, str, int]] = [(root, start, 0)]  # (real path, shown path, part)
    links: list[tuple[str, str, int]] = []  # folders reached through a link: searched last
    while stack or links:
        where, shown, i = stack.pop() if stack else links.pop()
        if i == len(pats):
            matches.append(shown)
            continue
        try:
            info = os.stat(where)
        except OSError:
            continue
        key = (info.st_dev, info.st_ino, i)
        if key in seen:
            if os.path.islink(where):
                target, real = os.readlink(where), os.path.realpath(where)
                skipped.append(
                    f"skipped symbolic link {shown_path(shown)} -> {shown_path(target)} (leads "
                    f"back into {shown_path(real)}, already searched)"
                )
            continue
        seen.add(key)
        part = pats[i]
        entries = _entries(where)
        if part == "**":
            stack.append((where, shown, i + 1))  # ** matching no folder
            for name, is_dir, is_link in entries:
                if name.startswith("."):
                    continue
                path, child = os.path.join(where, name), _join(shown, name)
                if is_dir:
                    (links if is_link else stack).append((path, child, i))
                elif i + 1 == len(pats):
                    matches.append(child)
            continue
        if _GLOB_CHARS.search(part):
            hidden_ok = part.startswith(".")
            names = [
                e
                for e in entries
                if (hidden_ok or not e[0].startswith(".")) and fnmatch.fnmatchcase(e[0], part)
            ]
        else:
            names = [e for e in entries if e[0] == part]
        for name, is_dir, is_link in names:
            path, child = os.path.join(where, name), _join(shown, name)
            if i + 1 == len(pats):
                matches.append(child)
            elif is_dir:
                (links if is_link else stack).append((path, child, i + 1))
    return sorted(set(matches)), skipped


def _entries(folder: str) -> list[tuple[str, bool, bool]]:
    """(name, is a folder (following links), is a symbolic link) of each entry of
    ``folder``; none if it cannot be read."""
    try:
        with os.scandir(folder) as it:
            found = []
            for e in it:
                try:
                    found.append((e.name, e.is_dir(), e.is_symlink()))
                except OSError:
                    found.append((e.name, False, False))
            return found
    except OSError:
        return []


def _join(shown: str, name: str) -> str:
    if not shown:
        return name
    return shown + name if shown.endswith("/") else f"{shown}/{name}"


def _assign_ids(
    merged: list[Merged],
    inputs: list[list[Path]],
    jobs: list[Entry],
    earlier_jobs: Sequence[EarlierJob],
    problems: list[Problem],
) -> None:
    """Give jobs without an ``id`` one derived from their first input (a job whose
    ``id`` is invalid gets none, so it adds no follow-on problems).

    Two jobs without an ``id`` over the same files (also through a symbolic link, a hard
    link or another spelling, as the command line counts a file named twice) are a problem of
    the second, which gets no id: they would take the same id and output (``duplicate id
    'doc-1ced6f2f'``, an id the manifest never wrote), or, with an earlier job of those
    files in the output folder, quietly two (the same job run twice)."""
    missing = [i for i, m in enumerate(merged) if "id" not in m and "id" not in jobs[i].invalid]
    missing = [i for i in missing if inputs[i]]
    readers: dict[tuple[object, ...], int] = {}  # the files' identities -> the first job
    for i in list(missing):
        first = readers.setdefault(tuple(file_identity(p) for p in inputs[i]), i)
        if first != i:
            missing.remove(i)
            message = _same_inputs(jobs[first], inputs, first, i)
            problems.append(_problem(jobs[i], "input", message))
    taken = [m["id"][0] for m in merged if "id" in m]
    derived = derive_ids(
        [inputs[i][0] for i in missing],
        taken=taken,
        earlier=earlier_jobs,
        inputs=[inputs[i] for i in missing],
    )
    for i, ident in zip(missing, derived, strict=True):
        merged[i]["id"] = (ident, jobs[i])


def _same_inputs(first: Entry, inputs: list[list[Path]], i: int, j: int) -> str:
    """Job ``j``'s problem when it reads the files of job ``i`` (``first``), neither with
    an id."""
    line = first.where("input") or first.line
    place = f"{escaped(first.label)}, line {line}" if line else escaped(first.label)
    cwd = Path.cwd()

    def shown(paths: list[Path]) -> str:
        return ", ".join(
            shown_path(os.path.relpath(p) if p.is_relative_to(cwd) else p) for p in paths
        )

    mine, theirs = shown(inputs[j]), shown(inputs[i])
    linked = [p.resolve() for p in inputs[j]] != [p.resolve() for p in inputs[i]]
    what = "hard links to the same file(s)" if linked else "the same"
    same = f" ({mine} and {theirs} are {what})" if mine != theirs else ""
    return (
        f"reads the same file(s) as {place}{same}, and neither job has an id: both "
        "would take the same id and output file; give each job an id of its own (two "
        "questions on one document, say), or drop one"
    )


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
    origin = f"{job.file}:{line}" if line else job.file
    sources = sampling_sources(merged)
    return JobSpec(ident, tuple(inputs), task, sampling, output, origin, sampling_from=sources)


def sampling_sources(merged: Merged) -> tuple[tuple[str, str], ...]:
    """(field, :func:`value_source`) for each sampling field ``merged`` sets."""
    return tuple(
        (name, value_source(entry, name))
        for name, (_, entry) in merged.items()
        if name in SAMPLING_FIELDS
    )


def value_source(entry: Entry, name: str) -> str:
    """Where ``entry`` (a layer of a job's fields) set field ``name``, in words:
    ``command line (--max-new-tokens)``, ``preset cpu's sampling.max_tokens``,
    ``jobs.yaml:2 defaults.max_new_tokens``, ``jobs.yaml:7 jobs[0].max_new_tokens`` or
    ``requests.jsonl:3 request body``."""
    if entry.file == COMMAND_LINE and not entry.label:  # the flags
        return f"command line ({CLI_FLAGS.get(name, name)})"
    if entry.label == PRESET_SAMPLING:
        keys = {job: key for key, job in PRESET_SAMPLING_FIELDS.items()}
        return f"preset {Path(entry.file).stem}'s sampling.{keys.get(name, name)}"
    line = entry.where(name)
    where = f"{entry.file}:{line}" if line else entry.file
    if entry.label == "request body":  # an OpenAI-batch request: its line
        return f"{where} request body"
    return f"{where} {entry.label}.{name}" if entry.label else f"{where} {name}"


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
        # A job with other problems still has its id checked, so one pass reports both.
        job_id = spec.id if spec is not None else m.get("id", (None, None))[0]
        if not isinstance(job_id, str) or not job_id:
            continue
        id_entry, out_entry = m["id"][1], m.get("output", m["id"])[1]
        first = ids.setdefault(job_id.casefold(), id_entry)
        if first is not id_entry:
            problems.append(_problem(id_entry, "id", f"duplicate id {job_id!r} ({_place(first)})"))
            continue
        if spec is None:
            continue
        owner, first_out = outputs.setdefault(spec.output.casefold(), (spec.id, out_entry))
        if first_out is not out_entry:
            message = f"output file {spec.output!r} is also written by job {owner!r} ({_place(first_out)})"
            problems.append(_problem(out_entry, "output", message))


def _place(entry: Entry) -> str:
    line = entry.where("id")
    return f"first used on line {line}" if line else f"first used by {escaped(entry.label)}"


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
    if (isinstance(value, bool) and bool not in accepted) or not isinstance(value, accepted):
        return f"must be {_plain_type(declared)}, got {value!r}"
    return setting_problem(name, value)


_PLAIN_TYPES = {"str": "a string", "int": "an integer", "float": "a number",
                "bool": "true or false", "None": "null", "dict[str, Any]": "a mapping"}  # fmt: skip


def _plain_type(declared: str) -> str:
    """``"int | None"`` -> ``"an integer or null"``: a field's type in words."""
    return " or ".join(_PLAIN_TYPES.get(part, part) for part in declared.split(" | "))


# ----------------------------------------------------------------------------- checks


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
    if isinstance(value, list) and "" in value:  # --fields a,,b
        return f"has an empty field name, got {value!r}"
    found = _check_strings(value, "a list of field names or schema text")
    if found is None and isinstance(value, list):  # the keys of one JSON object: distinct
        repeated = sorted({v for v in value if value.count(v) > 1})
        if repeated:
            return f"repeats field name(s) {', '.join(map(repr, repeated))}"
    return found


def _check_task(value: Any) -> str | None:
    if value in TASKS:
        return None
    close = difflib.get_close_matches(value, TASKS, n=1) if isinstance(value, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"must be one of {', '.join(TASKS)}, got {value!r}{hint}"


RUN_FILES = (RESULTS_FILE, CONFIG_FILE, LOCK_FILE, BATCH_OUTPUT_FILE)
"""The files a run writes in its output folder itself (``batch_output.jsonl`` for an
OpenAI batch): never a job's ``output``."""


def _check_output(value: Any) -> str | None:
    if isinstance(value, str) and value.casefold() in {n.casefold() for n in RUN_FILES}:
        shown = ", ".join(RUN_FILES[:-1]) + f" and {RUN_FILES[-1]}"
        return (
            f"{value!r} is a file the run writes in the output folder itself ({shown}); "
            "choose another name for this job's result file"
        )
    return name_problem(value)


def _check_prompt(value: Any) -> str | None:
    return _check_text(value) or template_problem(value)


_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "id": name_problem,
    "output": _check_output,
    "input": _check_input,
    "task": _check_task,
    "prompt": _check_prompt,
    "template": _check_prompt,
    "question": _check_text,
    "fields": _check_fields,
    # the sampling fields: engine.config's rules, as a preset's sampling block has them
    **{name: SAMPLING_CHECKS[name] for name in ("temperature", "top_p", "top_k", "seed", "stop")},
    "max_new_tokens": SAMPLING_CHECKS["max_tokens"],
}
