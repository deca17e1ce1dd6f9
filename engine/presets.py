"""Hardware presets: YAML files in ``presets/`` and the config precedence chain.

A preset file has four blocks::

    description: one line
    model: llama2-13b-gqa8     # optional: shape ``hisparse plan`` uses by default
    hardware: {devices: [...], memory_gb: ..., host_link_gbps: ..., host_memory_gb: ...,
               parallel: data|pipeline, device_name: ..., compute_capability: ...}
    engine:   {<EngineConfig field>: value, ...}
    sampling: {temperature: ..., top_p: ..., max_tokens: ...}

Precedence (lowest first): ``EngineConfig`` defaults < preset ``engine`` block <
manifest defaults < CLI flags (:func:`resolve_config`). Unknown keys raise
:class:`PresetError` naming the file and the key.

The presets directory is ``Path(__file__).parents[1] / "presets"`` (the repository root
in a checkout, ``site-packages/presets`` in a wheel built with the package-data noted in
the README); ``HISPARSE_PRESETS_DIR`` overrides it.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.capacity.planner import Hardware
from engine.config import (
    ENV_SETTINGS,
    ConfigError,
    EngineConfig,
    SamplingParams,
    env_overrides,
    given,
    layered_config,
    sampling_problem,
    setting_problem,
)

TOP_LEVEL_KEYS = ("description", "model", "hardware", "engine", "sampling")
HARDWARE_KEYS = tuple(f.name for f in dataclasses.fields(Hardware))
ENGINE_KEYS = tuple(f.name for f in dataclasses.fields(EngineConfig))
SAMPLING_KEYS = tuple(f.name for f in dataclasses.fields(SamplingParams))

# Declared field types (annotation strings, see ``from __future__ import annotations``)
# -> accepted Python types of a YAML value.
_ACCEPTED_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "int | None": (int, type(None)),
    "float | None": (int, float, type(None)),
    "bool | None": (bool, type(None)),
    "dict[str, Any]": (dict,),
    "tuple[str, ...]": (list, tuple),
}
# The same words as the manifest's and the flags' messages ("must be an integer ...").
_TYPE_WORDS = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "int | None": "an integer or null",
    "float | None": "a number or null",
    "bool | None": "true, false or null",
    "dict[str, Any]": "a mapping",
    "tuple[str, ...]": "a list of strings",
}


class PresetError(ConfigError):
    """A preset file is missing, malformed, or holds an unknown key or bad value."""


@dataclass(frozen=True)
class Preset:
    """One parsed preset file.

    engine: EngineConfig overrides (field name -> value), not yet applied.
    sampling: SamplingParams overrides.
    model: shape name ``hisparse plan`` uses when no ``--model`` is given.
    """

    name: str
    path: Path
    description: str
    hardware: Hardware
    engine: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    model: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "model": self.model,
            "hardware": self.hardware.to_dict(),
            "engine": dict(self.engine),
            "sampling": dict(self.sampling),
        }


def presets_dir() -> Path:
    """The directory the named presets are read from."""
    override = os.environ.get("HISPARSE_PRESETS_DIR")
    return (
        Path(override) if override else Path(__file__).resolve().parents[1] / "presets"
    )


def list_presets() -> list[str]:
    """Names of the presets in :func:`presets_dir`, sorted."""
    directory = presets_dir()
    if not directory.is_dir():
        return []
    return sorted(p.stem for p in directory.glob("*.yaml"))


PRESET_SUFFIXES = (".yaml", ".yml")
"""What a preset file's name ends in: a ``--preset`` that does (or that holds a ``/``) is a
file; any other is a preset name (``presets/NAME.yaml``)."""


def preset_path(name_or_path: str | Path) -> Path:
    """The file for a preset name (``h200``) or a path to a YAML file.

    A value ending in ``.yaml``/``.yml`` or holding a ``/`` is a path; any other is a
    preset name, but where no preset has that name and a file or folder does, the message
    says what it is (``--preset model.txt``: not a YAML preset file) rather than
    "unknown preset".

    Raises
    ------
    PresetError
        No such preset (the message lists the known ones), no such file, a folder, a
        pipe or a device, or a file whose name is not a preset file's.
    """
    text = str(name_or_path)
    candidate = Path(text).expanduser()
    is_path = candidate.suffix.lower() in PRESET_SUFFIXES or os.sep in text or "/" in text
    if not is_path:
        path = presets_dir() / f"{text}.yaml"
        if path.is_file():
            return path
    known = ", ".join(list_presets()) or "none"
    if candidate.is_dir():
        raise PresetError(
            f"preset file {text!r} is a directory: give a preset's YAML file or a preset "
            f"name (known presets: {known})"
        )
    if candidate.exists() and not candidate.is_file():
        raise PresetError(
            f"preset file {text!r} is not a regular file (a pipe or a device): give a "
            "preset's YAML file"
        )
    if candidate.is_file():
        if candidate.suffix.lower() in PRESET_SUFFIXES:
            return candidate
        raise PresetError(
            f"preset file {text!r} is not a YAML preset file: a preset file's name ends in "
            f".yaml or .yml (known presets: {known})"
        )
    if is_path:
        raise PresetError(f"preset file {text!r} does not exist")
    raise PresetError(f"unknown preset {text!r}; known presets: {known}")


def load_preset_full(name_or_path: str | Path) -> Preset:
    """Read and check one preset file.

    Raises
    ------
    PresetError
        Unreadable YAML, an unknown key in any block (named with the file), a value of
        the wrong type, or engine/sampling settings that fail validation.
    """
    path = preset_path(name_or_path)
    data, lines, problems = _read_yaml(path)
    problems += _key_problems(path, lines, "", data, TOP_LEVEL_KEYS)
    blocks = {}
    for name in ("hardware", "engine", "sampling"):
        blocks[name] = data.get(name) or {}
        if not isinstance(blocks[name], dict):
            problems.append(
                _problem(path, lines, (name,),
                         f"{name} must be a mapping, got {type(blocks[name]).__name__}")
            )  # fmt: skip
            blocks[name] = {}
    engine, sampling = dict(blocks["engine"]), dict(blocks["sampling"])
    if isinstance(sampling.get("stop"), str):  # one stop string, as a manifest takes it
        sampling["stop"] = [sampling["stop"]]
    for name, block, known, cls, check in (
        ("hardware", blocks["hardware"], HARDWARE_KEYS, Hardware, Hardware.field_problem),
        ("engine", engine, ENGINE_KEYS, EngineConfig, setting_problem),
        ("sampling", sampling, SAMPLING_KEYS, SamplingParams, sampling_problem),
    ):
        problems += _key_problems(path, lines, name, block, known)
        typed = name != "sampling"  # SAMPLING_CHECKS check the types too, in their words
        problems += _value_problems(path, lines, name, block, cls, check, typed)
    if data.get("model") is not None:  # the shape `hisparse plan` uses by default
        from engine.capacity.shapes import get_model_shape

        try:
            get_model_shape(str(data["model"]))
        except ConfigError as exc:
            problems.append(_problem(path, lines, ("model",), f"model: {exc}"))
    problems += _clash_problems(path, lines, engine)
    if problems:  # every one at once, in line order, each with its line, as a manifest's
        problems.sort(key=lambda problem: problem[0])  # stable: the line-less ones first
        raise PresetError("\n".join(text for _, text in problems))
    try:
        hardware = Hardware.from_dict(dict(blocks["hardware"]), source=str(path))
        EngineConfig().replace(**engine).validate()  # what only clashes between settings
        _sampling(sampling).validate()
    except PresetError:
        raise
    except ConfigError as exc:
        text = str(exc)
        raise PresetError(text if text.startswith(str(path)) else f"{path}: {text}") from None
    model = data.get("model")
    return Preset(
        name=path.stem,
        path=path,
        description=str(data.get("description", "")),
        hardware=hardware,
        engine=engine,
        sampling=sampling,
        model=None if model is None else str(model),
    )


def load_preset(name_or_path: str | Path) -> dict[str, Any]:
    """The preset's ``engine`` block: EngineConfig overrides (field name -> value)."""
    return dict(load_preset_full(name_or_path).engine)


def resolve_config(
    preset: str | Path | Preset | dict[str, Any] | None,
    manifest_defaults: dict[str, Any] | None = None,
    cli_overrides: dict[str, Any] | None = None,
) -> EngineConfig:
    """Apply defaults < preset < manifest defaults < CLI flags and validate.

    Parameters
    ----------
    preset
        A preset name or file, a loaded :class:`Preset`, an ``engine`` overrides dict,
        or ``None`` for the built-in defaults.
    manifest_defaults
        EngineConfig field -> value from the job manifest's defaults.
    cli_overrides
        EngineConfig field -> value from flags; ``None`` values (flags not given) are
        skipped, so a Typer option defaulting to ``None`` never masks a lower layer.

    Raises
    ------
    ConfigError
        An unknown field (naming the layer it came from) or a setting that fails
        :meth:`EngineConfig.validate`.
    """
    config = layered_config(
        (
            ("preset", _preset_engine(preset)),
            ("manifest defaults", manifest_defaults or {}),
            ("command-line flags", given(cli_overrides)),
        )
    )
    config.validate()
    return config


def resolve_sampling(
    preset: str | Path | Preset | None,
    manifest_defaults: dict[str, Any] | None = None,
    cli_overrides: dict[str, Any] | None = None,
) -> SamplingParams:
    """Sampling with the same precedence: defaults < preset ``sampling`` < manifest < CLI."""
    values: dict[str, Any] = {}
    if preset is not None:
        loaded = preset if isinstance(preset, Preset) else load_preset_full(preset)
        values.update(loaded.sampling)
    values.update(manifest_defaults or {})
    values.update(given(cli_overrides))
    unknown = sorted(set(values) - set(SAMPLING_KEYS))
    if unknown:
        raise ConfigError(f"unknown sampling setting(s): {', '.join(unknown)}")
    params = _sampling(values)
    params.validate()
    return params


ENV_FIELDS = frozenset(name for name, _ in ENV_SETTINGS.values())
"""The EngineConfig fields the environment may set (:data:`engine.config.ENV_SETTINGS`)."""


def resolved_preset_dict(name_or_path: str | Path) -> dict[str, Any]:
    """What ``hisparse presets show`` prints: the preset with its engine block resolved
    over the defaults and its sampling block over :class:`SamplingParams`' defaults, as a
    preset file holds it (:data:`TOP_LEVEL_KEYS`), so a copy loads as it is and resolves to
    the same settings. The preset's name and file are not keys of a preset file: ``show``
    prints them as a comment.

    The environment (:data:`engine.config.ENV_SETTINGS`) is not read, and its fields are
    left out unless the preset sets them: in a copy they would be preset settings, which
    beat the environment (:func:`engine.config.layered_config`), so the copy would freeze
    this shell's ``HISPARSE_HOST_MEMORY_GB`` (or the default) where the original follows
    the environment it runs in (:func:`environment_notes` says what they are here)."""
    preset = load_preset_full(name_or_path)
    sampling = dataclasses.asdict(resolve_sampling(preset))
    sampling["stop"] = list(sampling["stop"])
    engine = EngineConfig().replace(**preset.engine).to_dict()
    return {
        "description": preset.description,
        "model": preset.model,
        "hardware": preset.hardware.to_dict(),
        "engine": {
            name: value
            for name, value in engine.items()
            if name in preset.engine or name not in ENV_FIELDS
        },
        "sampling": sampling,
    }


def defaulted_settings(name_or_path: str | Path) -> dict[str, set[str]]:
    """The settings of :func:`resolved_preset_dict`'s ``hardware``, ``engine`` and
    ``sampling`` blocks that the preset file does not set (block -> names): their values
    are the built-in defaults. ``hisparse presets show`` marks them ``# default``."""
    path = preset_path(name_or_path)
    data = _read_yaml(path)[0]
    resolved = resolved_preset_dict(path)
    found: dict[str, set[str]] = {}
    for block in ("hardware", "engine", "sampling"):
        given = data.get(block)
        given = given if isinstance(given, dict) else {}
        found[block] = {name for name in resolved[block] if name not in given}
    return found


def environment_notes(engine: dict[str, Any]) -> list[str]:
    """One line per :data:`engine.config.ENV_SETTINGS` variable set here whose field
    ``engine`` (a :func:`resolved_preset_dict` engine block) leaves to the environment:
    ``engine.host_memory_gb: 64.0 from HISPARSE_HOST_MEMORY_GB (the environment, not the
    preset)``. ``hisparse presets show`` prints them as YAML comments.

    Raises
    ------
    ConfigError
        A variable that is not a number (:func:`engine.config.env_overrides`).
    """
    found = env_overrides()
    return [
        f"engine.{name}: {found[name]} from {var} (the environment, not the preset)"
        for var, (name, _) in ENV_SETTINGS.items()
        if name in found and name not in engine
    ]


# ----------------------------------------------------------------------------- helpers


MAX_YAML_VALUES = 1_000_000
"""Largest number of values a YAML manifest or preset may expand to once every alias is
replaced by what it names. Aliases of aliases grow exponentially (the "billion laughs" file: nine
levels of ten), and validation walks every value."""


def yaml_expanded_size(root: yaml.Node) -> int:
    """How many nodes ``root`` stands for with every alias expanded (more than
    :data:`MAX_YAML_VALUES` for a node that contains itself); each distinct node is sized
    once (an alias is the same node object again), so this is linear in the file. The
    recursion is as deep as the composer's own."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:  # &a [*a]: endless once expanded
            return MAX_YAML_VALUES + 1
        open_nodes.add(key)
        total = 1
        for child in _children(node):
            total += size(child)
            if total > MAX_YAML_VALUES:
                break
        open_nodes.discard(key)
        sizes[key] = total
        return total

    return size(root)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _read_yaml(
    path: Path,
) -> tuple[dict[str, Any], dict[tuple[str, ...], int], list[tuple[int, str]]]:
    """The preset's mapping, the line (1-based) of each top-level key and of each key of a
    block (``("engine", "page_size") -> 27``), and a problem for each key given twice (YAML
    keeps the last silently)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PresetError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PresetError(
            f"{path}: not a YAML preset file: not UTF-8 text (byte "
            f"0x{data[exc.start]:02x} at offset {exc.start}; a binary file?)"
        ) from None
    return _compose(path, yaml.SafeLoader(text))


def _compose(
    path: Path, loader: yaml.SafeLoader
) -> tuple[dict[str, Any], dict[tuple[str, ...], int], list[tuple[int, str]]]:
    try:
        root = loader.get_single_node()
        if root is not None and yaml_expanded_size(root) > MAX_YAML_VALUES:
            raise PresetError(
                f"{path}: expands to more than {MAX_YAML_VALUES:,} values through YAML "
                "aliases (*name repeating &name)"
            )
        data = loader.construct_document(root) if root is not None else None
    except yaml.YAMLError as exc:
        raise PresetError(_yaml_error(path, exc)) from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise PresetError(
            f"{path}: a preset is a YAML mapping with description/hardware/engine"
        )
    lines: dict[tuple[str, ...], int] = {}
    problems: list[tuple[int, str]] = []
    for key, value in root.value:
        _note_line(path, lines, problems, (str(key.value),), key)
        for inner, _ in value.value if isinstance(value, yaml.MappingNode) else ():
            _note_line(path, lines, problems, (str(key.value), str(inner.value)), inner)
    return data, lines, problems


def _yaml_error(path: Path, exc: yaml.YAMLError) -> str:
    """A YAML syntax error as one line, ``path:line: not valid YAML: what (column N)``,
    as a manifest's (PyYAML's own text spans three lines and names the file again)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if mark is None:
        return f"{path}: not valid YAML: {what}"
    return f"{path}:{mark.line + 1}: not valid YAML: {what} (column {mark.column + 1})"


def _note_line(
    path: Path,
    lines: dict[tuple[str, ...], int],
    problems: list[tuple[int, str]],
    key: tuple[str, ...],
    node: yaml.Node,
) -> None:
    line = node.start_mark.line + 1
    if key in lines:
        problems.append(
            (line, f"{path}:{line}: {'.'.join(key)}: duplicate key "
                   f"(first given on line {lines[key]})")
        )  # fmt: skip
    else:
        lines[key] = line


def _problem(
    path: Path, lines: dict[tuple[str, ...], int], key: tuple[str, ...], text: str
) -> tuple[int, str]:
    """A problem at ``key``: (its line, ``path:line: text``), or (0, ``path: text``) where
    the line is not known; :func:`load_preset_full` reports them sorted by line."""
    line = lines.get(key, 0)
    return line, f"{path}:{line}: {text}" if line else f"{path}: {text}"


def _key_problems(
    path: Path,
    lines: dict[tuple[str, ...], int],
    block: str,
    values: dict[str, Any],
    known: tuple[str, ...],
) -> list[tuple[int, str]]:
    """One problem (:func:`_problem`) per unknown key of ``block`` ("" for the top
    level), with the closest known key and the list of known ones."""
    where = f"keys under {block}" if block else "top-level keys"
    problems = []
    for name in sorted(set(values) - set(known), key=str):
        close = difflib.get_close_matches(str(name), known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        key = (block, str(name)) if block else (str(name),)
        problems.append(
            _problem(path, lines, key,
                     f"{'.'.join(key)}: unknown key{hint}; known {where}: {', '.join(known)}")
        )  # fmt: skip
    return problems


def _value_problems(
    path: Path,
    lines: dict[tuple[str, ...], int],
    block: str,
    values: dict[str, Any],
    cls: type,
    check: Callable[[str, Any], str | None] | None = None,
    typed: bool = True,
) -> list[tuple[int, str]]:
    """One problem (:func:`_problem`) per known key of ``block`` whose value has the
    wrong type for its ``cls`` field (unless ``typed`` is false: ``check`` judges the
    types too) or, with ``check``, fails ``check(name, value)`` on its own
    (:func:`_value_message`)."""
    declared = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    problems = []
    for name, value in values.items():
        if name not in declared:
            continue  # reported by _key_problems
        message = _value_message(declared[name], name, value, check, typed)
        if message:
            problems.append(_problem(path, lines, (block, name), f"{block}.{name}: {message}"))
    return problems


def _value_message(
    kind: str,
    name: str,
    value: Any,
    check: Callable[[str, Any], str | None] | None,
    typed: bool = True,
) -> str | None:
    """What is wrong with ``value`` for field ``name`` of declared type ``kind`` on its
    own: its type (unless ``typed`` is false), then ``check(name, value)``; ``None`` when
    nothing is."""
    accepted = _ACCEPTED_TYPES.get(kind) if typed else None
    if accepted is not None and (
        (isinstance(value, bool) and bool not in accepted) or not isinstance(value, accepted)
    ):
        return f"must be {_TYPE_WORDS.get(kind, kind)}, got {value!r}"
    return check(name, value) if check is not None else None


def _clash_problems(
    path: Path, lines: dict[tuple[str, ...], int], engine: dict[str, Any]
) -> list[tuple[int, str]]:
    """Engine settings that clash with each other (:meth:`EngineConfig.problems`), each at
    the line of the one at fault and named ``engine.<field>``, as a manifest's
    ``defaults.engine`` clashes are. Only settings that are each valid are compared: a
    clash with a bad or unknown key is left until that key is fixed (its own problem is
    reported beside these)."""
    declared = {f.name: str(f.type) for f in dataclasses.fields(EngineConfig)}
    valid = {
        name: value
        for name, value in engine.items()
        if name in declared and not _value_message(declared[name], name, value, setting_problem)
    }
    bad = set(engine) - set(valid)
    problems = []
    for found in EngineConfig().replace(**valid).problems():
        if len(found.fields) > 1 and not bad & set(found.fields):
            name = found.fields[0]
            text = f"engine.{name}: {found.message}"
            problems.append(_problem(path, lines, ("engine", name), text))
    return problems


def _preset_engine(
    preset: str | Path | Preset | dict[str, Any] | None,
) -> dict[str, Any]:
    if preset is None:
        return {}
    if isinstance(preset, Preset):
        return dict(preset.engine)
    if isinstance(preset, dict):
        return dict(preset)
    return load_preset(preset)


def _sampling(values: dict[str, Any]) -> SamplingParams:
    values = dict(values)
    if "stop" in values:
        values["stop"] = tuple(values["stop"])
    return SamplingParams(**values)
