"""Parsing a manifest file into entries that remember the line of every field.

YAML (``.yaml``/``.yml``)::

    defaults:                 # optional; applies to every job
      task: answer
      max_new_tokens: 200
      engine: {attention: sparse, top_k: 1024}   # EngineConfig fields
    jobs:
      - id: q1
        input: reports/2023.txt
        question: What was the revenue?

A top-level list is accepted as ``jobs`` without defaults. YAML merge keys work as the
merge spec has them (https://yaml.org/type/merge.html; ``<<: *name`` or ``<<: [*a, *b]``:
a key given beside the merge beats the merged one, the first mapping of a list beats the
later ones); a merged field is reported on the line of its ``<<``. A top-level key
starting with ``x-`` holds anchors and is otherwise ignored.

JSONL (``.jsonl``/``.ndjson``): one JSON object per line; a line whose only key is
``defaults`` holds the defaults (``{"defaults": {"task": "summarize", "engine": {...}}}``).
Blank lines are skipped. A key given twice in one object, at any depth, is reported
(``json.loads`` keeps the last silently). A JSONL file whose first JSON-object line has
``custom_id`` or ``body`` is an OpenAI batch (:mod:`hisparse_cli.openai_batch`): its lines
are kept as parsed (``RawManifest.batch``) for that module to check one by one (a line
with a key given twice is one it rejects).

Values are built with PyYAML's safe constructor (``yaml.safe_load`` semantics) but
from the composed node tree, so each key keeps its line number; duplicate keys,
which ``safe_load`` silently overwrites, are reported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.presets import MAX_YAML_VALUES, yaml_expanded_size
from hisparse_cli.display import escaped

COMMAND_LINE = "command line"
PRESET_SAMPLING = "preset sampling"
"""The label of a preset's ``sampling`` block as an :class:`Entry` (the lowest layer of a
job's sampling fields)."""
PRESET_SAMPLING_FIELDS = {"max_tokens": "max_new_tokens"}
"""A preset ``sampling`` key -> the job field it sets, where the names differ."""
YAML_SUFFIXES = (".yaml", ".yml", ".json")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
TOP_LEVEL_KEYS = ("defaults", "jobs")
EXTENSION_PREFIX = "x-"
"""A top-level YAML key starting with this (``x-common: &common {...}``, as docker-compose
has them) holds anchors for jobs to merge (``<<: *common``); it is otherwise ignored."""


@dataclass(frozen=True)
class Problem:
    """One validation finding: where (file, line, field) and what. Shown (``str``) with
    control characters in the file and field (a document's name) escaped."""

    file: str
    line: int | None
    field: str
    message: str

    def __str__(self) -> str:
        file, name = escaped(self.file), escaped(self.field)
        where = f"{file}:{self.line}" if self.line else file
        return f"{where}: {name}: {self.message}" if name else f"{where}: {self.message}"


@dataclass
class Entry:
    """One mapping of fields (a job, the defaults, or the command-line flags).

    lines: field -> line of its key; fields without one report ``line``.
    invalid: fields dropped by validation (already reported).
    """

    file: str
    label: str
    line: int | None
    values: dict[str, Any]
    lines: dict[str, int] = field(default_factory=dict)
    invalid: set[str] = field(default_factory=set)

    def where(self, name: str) -> int | None:
        """Line to report for field ``name``."""
        return self.lines.get(name, self.line)


@dataclass
class RawManifest:
    """Entries read from one source, plus the problems met while reading it."""

    jobs: list[Entry] = field(default_factory=list)
    defaults: Entry | None = None
    engine: Entry | None = None
    problems: list[Problem] = field(default_factory=list)
    batch: list[tuple[int, Any]] | None = None
    """OpenAI-batch lines: (line number, parsed JSON, or ``None`` with the reason in
    ``batch_errors``); ``None`` when the file is not a batch."""
    batch_errors: dict[int, str] = field(default_factory=dict)


def read_manifest_file(path: Path) -> RawManifest:
    """Parse ``path`` (YAML or JSONL by suffix) into entries; never raises on bad content.

    Returns
    -------
    RawManifest
        With ``problems`` filled for syntax errors, non-mapping entries, duplicate keys
        and unknown top-level keys; field values are not checked here.
    """
    raw = RawManifest()
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raw.problems.append(Problem(str(path), None, "", f"cannot read manifest: {exc}"))
        return raw
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        _read_jsonl(str(path), text, raw)
    elif suffix in YAML_SUFFIXES:
        _read_yaml(str(path), text, raw)
    else:
        raw.problems.append(
            Problem(str(path), None, "", "manifest must end in .yaml, .yml, .json or .jsonl")
        )
    return raw


# ----------------------------------------------------------------------------- YAML


def _read_yaml(file: str, text: str, raw: RawManifest) -> None:
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            raw.problems.append(Problem(file, None, "", "manifest is empty"))
        elif yaml_expanded_size(root) > MAX_YAML_VALUES:  # "billion laughs": aliases of aliases
            raw.problems.append(
                Problem(
                    file,
                    None,
                    "",
                    f"expands to more than {MAX_YAML_VALUES:,} values through YAML aliases "
                    "(*name repeating &name); write the values out or use fewer aliases",
                )
            )
        elif isinstance(root, yaml.SequenceNode):
            _yaml_jobs(file, root, loader, raw)
        elif isinstance(root, yaml.MappingNode):
            _yaml_top(file, root, loader, raw)
        else:
            raw.problems.append(
                Problem(file, _line(root), "", "must be a mapping with jobs: (and defaults:)")
            )
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else None
        raw.problems.append(Problem(file, line, "", f"not valid YAML: {_yaml_message(exc)}"))
    except RecursionError:
        raw.problems.append(Problem(file, None, "", TOO_DEEP))
    finally:
        loader.dispose()


def _yaml_top(file: str, root: yaml.MappingNode, loader: yaml.SafeLoader, raw: RawManifest) -> None:
    top = _yaml_entry(file, "", root, loader, raw, construct=False)
    if top is None:
        return
    entry, nodes = top
    for key in entry.values:
        if key not in TOP_LEVEL_KEYS and not key.startswith(EXTENSION_PREFIX):
            message = (
                "unknown top-level key (expected defaults, jobs; a key starting with x- "
                "holds YAML anchors for <<: merges and is otherwise ignored)"
            )
            raw.problems.append(Problem(file, entry.where(key), key, message))
    if "jobs" not in nodes:
        raw.problems.append(Problem(file, entry.line, "jobs", "is required (a list of jobs)"))
    elif not isinstance(nodes["jobs"], yaml.SequenceNode):
        raw.problems.append(Problem(file, entry.where("jobs"), "jobs", "must be a list of jobs"))
    else:
        _yaml_jobs(file, nodes["jobs"], loader, raw)
    if "defaults" in nodes:
        _yaml_defaults(file, nodes["defaults"], loader, raw)


def _yaml_jobs(
    file: str, node: yaml.SequenceNode, loader: yaml.SafeLoader, raw: RawManifest
) -> None:
    if not node.value:
        raw.problems.append(Problem(file, _line(node), "jobs", "is empty"))
    for i, item in enumerate(node.value):
        parsed = _yaml_entry(file, f"jobs[{i}]", item, loader, raw)
        if parsed:
            raw.jobs.append(parsed[0])


def _yaml_defaults(file: str, node: yaml.Node, loader: yaml.SafeLoader, raw: RawManifest) -> None:
    parsed = _yaml_entry(file, "defaults", node, loader, raw)
    if parsed is None:
        return
    raw.defaults, nodes = parsed
    if "engine" in nodes:
        engine = _yaml_entry(file, "defaults.engine", nodes["engine"], loader, raw)
        raw.engine = engine[0] if engine else None
        del raw.defaults.values["engine"]


def _yaml_entry(
    file: str,
    label: str,
    node: yaml.Node,
    loader: yaml.SafeLoader,
    raw: RawManifest,
    construct: bool = True,
) -> tuple[Entry, dict[str, yaml.Node]] | None:
    """A mapping node -> Entry (values constructed safely) and the value nodes by key."""
    if not isinstance(node, yaml.MappingNode):
        raw.problems.append(Problem(file, _line(node), label, "must be a mapping of field: value"))
        return None
    entry, nodes = Entry(file, label, _line(node), {}), {}
    merges: list[tuple[int, dict[str, yaml.Node]]] = []  # (line of <<, its keys)
    merge_line: int | None = None  # the line of this mapping's first <<
    for key_node, value_node in node.value:
        key, line = key_node.value, _line(key_node)
        if key_node.tag == MERGE_TAG and merge_line is not None:  # the first would win silently
            where = f"{label}.<<" if label else "<<"
            message = (
                f"duplicate key (first given on line {merge_line}; merge several with <<: [*a, *b])"
            )
            raw.problems.append(Problem(file, line, where, message))
        elif key_node.tag == MERGE_TAG:
            merge_line = line
            merged = _merge_source(file, label, value_node, line, raw)
            if merged is not None:
                merges.append((line, merged))
        elif not isinstance(key_node, yaml.ScalarNode) or not key:
            raw.problems.append(Problem(file, line, label, "field names must be plain strings"))
        elif key in entry.values:
            where = f"{label}.{key}" if label else key
            raw.problems.append(
                Problem(
                    file, line, where, f"duplicate key (first given on line {entry.lines[key]})"
                )
            )
        else:
            entry.values[key] = _construct(value_node, loader) if construct else None
            entry.lines[key], nodes[key] = line, value_node
    for line, merged in merges:  # a key given beside a merge beats the merged one
        for key, value_node in merged.items():
            if key not in nodes:
                entry.values[key] = _construct(value_node, loader) if construct else None
                entry.lines[key], nodes[key] = line, value_node
    return entry, nodes


MERGE_TAG = "tag:yaml.org,2002:merge"
"""The tag of a ``<<`` key (a YAML merge: ``<<: *name`` or ``<<: [*a, *b]``)."""


def _merge_source(
    file: str, label: str, node: yaml.Node, line: int, raw: RawManifest
) -> dict[str, yaml.Node] | None:
    """The keys and value nodes a ``<<`` key at ``line`` merges in, as the YAML merge
    spec gives them: of a list of mappings the first that has a key wins (PyYAML 6.0.4's
    ``safe_load`` lets the last win); a mapping's own keys beat the ones it merges itself. ``None`` (a problem reported)
    when the value is not a mapping or a list of mappings."""
    sources = node.value if isinstance(node, yaml.SequenceNode) else [node]
    if not sources or not all(isinstance(s, yaml.MappingNode) for s in sources):
        where = f"{label}.<<" if label else "<<"
        message = "a merge (<<) takes a mapping or a list of them (<<: *name or <<: [*a, *b])"
        raw.problems.append(Problem(file, line, where, message))
        return None
    found: dict[str, yaml.Node] = {}
    for source in sources:
        for key, value in _mapping_keys(source).items():
            found.setdefault(key, value)
    return found


def _mapping_keys(node: yaml.MappingNode) -> dict[str, yaml.Node]:
    """A merged mapping's keys and value nodes, its own merges resolved (its own
    problems, as duplicate keys, are reported where it is written, not where it is
    merged). Aliases cannot loop here: :func:`yaml_expanded_size` refused those."""
    own: dict[str, yaml.Node] = {}
    merged: dict[str, yaml.Node] = {}
    for key_node, value_node in node.value:
        if key_node.tag == MERGE_TAG:
            inner = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            for source in inner:
                if isinstance(source, yaml.MappingNode):
                    for key, value in _mapping_keys(source).items():
                        merged.setdefault(key, value)
        elif isinstance(key_node, yaml.ScalarNode) and key_node.value:
            own[key_node.value] = value_node
    return {**merged, **own}


def _construct(node: yaml.Node, loader: yaml.SafeLoader) -> Any:
    return loader.construct_object(node, deep=True)


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _yaml_message(exc: yaml.YAMLError) -> str:
    problem = getattr(exc, "problem", None)
    return str(problem) if problem else str(exc).splitlines()[0]


# ----------------------------------------------------------------------------- JSONL


TOO_DEEP = "not readable: nested too deeply (past Python's recursion limit)"
"""A JSON line whose arrays or objects nest past what ``json.loads`` can recurse into."""


def _read_jsonl(file: str, text: str, raw: RawManifest) -> None:
    if _read_batch(text, raw):
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line, object_pairs_hook=_Pairs)
        except json.JSONDecodeError as exc:
            raw.problems.append(
                Problem(file, number, "", f"not valid JSON: {exc.msg} (column {exc.colno})")
            )
            continue
        except RecursionError:
            raw.problems.append(Problem(file, number, "", TOO_DEEP))
            continue
        for where in _duplicate_keys(obj, "" if _is_defaults(obj) else "job"):
            raw.problems.append(Problem(file, number, where, DUPLICATE_JSON_KEY))
        if not isinstance(obj, dict):
            raw.problems.append(Problem(file, number, "", "each line must be a JSON object"))
        elif _is_defaults(obj):
            _jsonl_defaults(file, number, obj["defaults"], raw)
        else:
            raw.jobs.append(_json_entry(file, "job", number, obj))
    if not raw.jobs and not raw.problems:
        raw.problems.append(Problem(file, None, "jobs", "the manifest holds no jobs"))
    _one_json_value(file, text, raw)


def _one_json_value(file: str, text: str, raw: RawManifest) -> None:
    """A JSONL manifest whose first line is not JSON while the whole file is (pretty-printed
    JSON named ``.jsonl``): one problem saying what the format is, instead of one "not valid
    JSON" per line of it (and jobs of the lines that happened to parse)."""
    first = next((n for n, line in enumerate(text.splitlines(), 1) if line.strip()), None)
    broken = [p for p in raw.problems if p.message.startswith("not valid JSON")]
    if first is None or not any(p.line == first for p in broken):
        return
    try:
        json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return
    raw.jobs, raw.defaults, raw.engine = [], None, None  # what its lines gave: pieces
    raw.problems = [
        Problem(
            file, first, "", "the file is one JSON value over several lines; a .jsonl "
            "manifest takes one JSON object per line (one job each; defaults as "
            "{\"defaults\": {...}}), or name the file .json to read it whole (jobs: and "
            "defaults:, as in YAML)",
        )
    ]  # fmt: skip


DUPLICATE_JSON_KEY = (
    "duplicate key (given twice in one JSON object, where the last would silently win)"
)


class _Pairs(dict):
    """A JSON object as :func:`json.loads` builds it with ``object_pairs_hook``, also
    remembering the keys given more than once (which a plain ``dict`` drops silently)."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.duplicates: list[str] = []
        if len(self) < len(pairs):
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    self.duplicates.append(key)
                seen.add(key)


def _duplicate_keys(value: Any, path: str) -> list[str]:
    """The dotted paths (``job.input``, ``defaults.engine.top_k``, ``body.messages[0].role``)
    of the keys given twice in one object of ``value``, at any depth, each once."""
    found: list[str] = []
    todo = [(value, path)]  # no recursion: json.loads takes deeper nesting than Python's stack
    while todo:
        value, path = todo.pop()
        if isinstance(value, _Pairs):
            found += [f"{path}.{key}" if path else key for key in dict.fromkeys(value.duplicates)]
            items = [(item, f"{path}.{key}" if path else key) for key, item in value.items()]
            todo += reversed(items)
        elif isinstance(value, list):
            todo += reversed([(item, f"{path}[{i}]") for i, item in enumerate(value)])
    return found


def _is_defaults(obj: Any) -> bool:
    """Whether a JSONL manifest line is the defaults line (its only key is ``defaults``)."""
    return isinstance(obj, dict) and set(obj) == {"defaults"}


def _read_batch(text: str, raw: RawManifest) -> bool:
    """Keep the lines of an OpenAI batch (the first object line has ``custom_id`` or
    ``body``) in ``raw.batch``; return whether the file is one."""
    from hisparse_cli.openai_batch import is_batch_request

    lines: list[tuple[int, Any]] = []
    errors: dict[int, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            lines.append((number, json.loads(line, object_pairs_hook=_Pairs)))
        except json.JSONDecodeError as exc:
            lines.append((number, None))
            errors[number] = f"not valid JSON: {exc.msg} (column {exc.colno})"
            continue
        except RecursionError:
            lines.append((number, None))
            errors[number] = TOO_DEEP
            continue
        duplicates = _duplicate_keys(lines[-1][1], "")
        if duplicates:  # the request is rejected, the rest of the batch runs
            errors[number] = "; ".join(f"{where}: {DUPLICATE_JSON_KEY}" for where in duplicates)
    first = next((obj for _, obj in lines if isinstance(obj, dict)), None)
    if not is_batch_request(first):
        return False
    raw.batch, raw.batch_errors = lines, errors
    return True


def _jsonl_defaults(file: str, number: int, value: Any, raw: RawManifest) -> None:
    if raw.defaults is not None:
        first = raw.defaults.line
        raw.problems.append(
            Problem(file, number, "defaults", f"given twice (first on line {first})")
        )
    elif not isinstance(value, dict):
        raw.problems.append(Problem(file, number, "defaults", "must be a JSON object"))
    else:
        raw.defaults = _json_entry(file, "defaults", number, value)
        engine = raw.defaults.values.pop("engine", None)
        if isinstance(engine, dict):
            raw.engine = _json_entry(file, "defaults.engine", number, engine)
        elif engine is not None:
            raw.problems.append(Problem(file, number, "defaults.engine", "must be a JSON object"))


def _json_entry(file: str, label: str, number: int, obj: dict) -> Entry:
    return Entry(file, label, number, dict(obj), {key: number for key in obj})
