"""The resolved engine config: defaults < preset < manifest ``defaults.engine`` < flags.

The layers are applied by the engine's one precedence chain
(:func:`engine.config.layered_config`: defaults < environment < preset < manifest < flags);
this module validates the result once, at the end, and reports every problem together
(:class:`SettingsError`), each where the setting at fault was given.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.config import (
    ENV_SETTINGS,
    ConfigError,
    EngineConfig,
    SettingProblem,
    env_overrides,
    given,
    layered_config,
)
from hisparse_cli.display import shown_message
from hisparse_cli.manifest_source import (
    COMMAND_LINE,
    PRESET_SAMPLING,
    PRESET_SAMPLING_FIELDS,
    Entry,
    Problem,
)
from hisparse_cli.results import marked_document, write_text_atomic

CONFIG_FILE = "config.json"
CONFIG_MARKER = {"written_by": "hisparse"}
"""What :func:`save_config` adds to ``config.json``, so a run tells its own file from
another one of that name (:func:`is_hisparse_config`)."""
CONFIG_KEYS = ("preset", "model", "engine")
"""Keys every ``config.json`` hisparse wrote has, those of earlier versions (without
:data:`CONFIG_MARKER`) included."""


def preset_overrides(name: str) -> dict[str, Any]:
    """EngineConfig overrides of preset ``name`` (the preset's ``engine`` block).

    Raises
    ------
    ConfigError
        The preset is unknown or malformed (the message names it).
    """
    preset = _load_preset(name)
    return {} if preset is None else dict(preset.engine)


def preset_sampling(name: str) -> Entry | None:
    """The ``sampling`` block of preset ``name`` as the lowest layer of every job's
    sampling fields (below the manifest's defaults, the job and the flags; a preset's
    ``max_tokens`` is the jobs' ``max_new_tokens``), or ``None`` when it sets none.

    Raises
    ------
    ConfigError
        The preset is unknown or malformed (the message names it).
    """
    preset = _load_preset(name)
    if preset is None or not preset.sampling:
        return None
    values = {
        PRESET_SAMPLING_FIELDS.get(key, key): list(value) if key == "stop" else value
        for key, value in preset.sampling.items()
    }
    return Entry(str(preset.path), PRESET_SAMPLING, None, values)


def _load_preset(name: str) -> Any:
    """:func:`engine.presets.load_preset_full` of ``name`` (``None`` while
    ``engine.presets`` does not exist), its errors as a :class:`ConfigError` naming it."""
    try:
        from engine.presets import load_preset_full
    except ModuleNotFoundError as exc:
        if exc.name != "engine.presets":
            raise
        return None
    try:
        return load_preset_full(name)
    except (OSError, KeyError, ValueError) as exc:  # ConfigError is a ValueError
        from hisparse_cli.auto_preset import name_auto

        text = name_auto(str(exc))  # "unknown preset 'x'; ...": named once, not twice
        named = any(f"preset {kind}{name!r}" in text for kind in ("", "file ")) or text.startswith(
            str(Path(name).expanduser())
        )
        text = text if named else f"preset {name!r}: {text}"
        raise ConfigError(shown_message(text, [name])) from None  # a name's newline escaped


class SettingsError(ConfigError):
    """The resolved engine settings cannot run; ``problems`` lists every one, each placed
    where the setting at fault was given (flag, manifest line, preset or default)."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


ENGINE_FLAGS = {
    "top_k": "--top-k-tokens",
    "memory_budget_gb": "--memory-budget",
    "host_pool_gb": "--host-pool",
    "num_threads": "--threads",
    "audit_steps": "--audit",
    "hot_buffer_dtype": "--hot-dtype",
}
"""EngineConfig field -> its ``hisparse run`` flag where that is not ``--field-name``."""


def engine_flag(name: str) -> str:
    """The ``hisparse run`` flag that sets EngineConfig field ``name``."""
    return ENGINE_FLAGS.get(name, "--" + name.replace("_", "-"))


def resolve_engine_config(
    preset: str,
    manifest_engine: Mapping[str, Any] | None = None,
    cli: Mapping[str, Any] | None = None,
    manifest_origin: Entry | None = None,
) -> EngineConfig:
    """Apply the layers in precedence order and validate the result.

    Parameters
    ----------
    preset
        Preset name (see :func:`preset_overrides`).
    manifest_engine
        ``defaults.engine`` of the manifest.
    cli
        Overrides from flags; ``None`` values (flag not given) are skipped.
    manifest_origin
        The manifest's ``defaults.engine`` entry (file and line of each setting), so
        problems with its settings name ``file:line: defaults.engine.<field>``.

    Raises
    ------
    ConfigError
        Unknown field (naming the layer).
    SettingsError
        Every problem :meth:`EngineConfig.problems` finds, each placed at the
        highest-precedence layer that set one of the settings involved.
    """
    layers = (
        (f"preset {preset!r}", preset_overrides(preset)),
        ("manifest defaults.engine", dict(manifest_engine or {})),
        ("command-line flags", given(cli)),
    )
    config = layered_config(layers)
    found = config.problems()
    if found:
        sources = [env_overrides(), *(overrides for _, overrides in layers)]
        raise SettingsError([_place(p, preset, sources, manifest_origin) for p in found])
    return config


def _place(
    problem: SettingProblem,
    preset: str,
    layers: list[dict[str, Any]],
    manifest_origin: Entry | None,
) -> Problem:
    """``problem`` as a located :class:`Problem`: at the field of ``problem.fields`` set by
    the highest layer (flags > manifest > preset > environment > built-in defaults)."""
    name = max(problem.fields, key=lambda f: _layer_of(f, layers))  # first of the highest
    rank, message = _layer_of(name, layers), problem.message
    if rank == 4:
        return Problem(COMMAND_LINE, None, engine_flag(name), message)
    if rank == 3 and manifest_origin is not None:
        label = f"{manifest_origin.label}.{name}"
        return Problem(manifest_origin.file, manifest_origin.where(name), label, message)
    if rank == 3:
        return Problem("manifest", None, f"defaults.engine.{name}", message)
    if rank == 2:
        return Problem(f"preset {preset!r}", None, f"engine.{name}", message)
    if rank == 1:
        var = next(v for v, (field, _) in ENV_SETTINGS.items() if field == name)
        return Problem("environment", None, var, message)
    return Problem("built-in defaults", None, name, message)


def _layer_of(name: str, layers: list[dict[str, Any]]) -> int:
    """0 built-in default, 1 environment, 2 preset, 3 manifest, 4 flags: the last layer
    setting ``name``."""
    return max((i + 1 for i, layer in enumerate(layers) if name in layer), default=0)


CUDA_ONLY_SETTINGS = {
    "cuda_graph": "CUDA graphs need a CUDA device",
    "decode_overlap": "micro-batch overlap needs a CUDA device",
}
"""On/off engine settings that only act on CUDA: setting -> why it is off on a CPU run."""


def config_document(config: EngineConfig, preset: str, model: str | None) -> dict[str, Any]:
    """What ``config.json`` and ``--print-config`` show: the engine settings as they take
    effect. On a run whose devices are all ``cpu``, the :data:`CUDA_ONLY_SETTINGS` read
    ``false``, and ``effective`` says for each that it was asked for and why it is off."""
    engine = config.to_dict()
    devices = list(config.devices) or [config.device]
    notes = {}
    if all(d.split(":")[0] == "cpu" for d in devices):
        for name, why in CUDA_ONLY_SETTINGS.items():
            if engine.get(name) is True:
                engine[name] = False
                notes[name] = f"requested true; off on this CPU run ({why})"
    document = {"preset": preset, "model": model, "engine": engine}
    if notes:
        document["effective"] = notes
    return document


def job_settings(spec: Any) -> dict[str, Any]:
    """What ``--print-config`` shows of one job (a :class:`~hisparse_cli.manifest.JobSpec`):
    its id, where it was given, its inputs, task, result file and sampling settings as the
    run would apply them (preset < manifest defaults < the job's own < flags), and under
    ``sampling_from`` where each of those was set (:meth:`JobSpec.source`: a flag, a
    manifest line, the preset, or ``default``); a seed not given is shown as the one
    derived from the job id, with ``seed_from: "job id"``."""
    task = {k: v for k, v in dataclasses.asdict(spec.task).items() if v is not None}
    sampling = dataclasses.asdict(spec.sampling)
    sampling["stop"] = list(sampling["stop"])
    sources = {name: spec.source(JOB_FIELD.get(name, name)) for name in sampling}
    if spec.sampling.seed is None:  # what the engine uses (engine.config.job_seed)
        sampling["seed"], sampling["seed_from"] = spec.sampling.seed_for(spec.id), "job id"
        sources["seed"] = "job id"
    return {
        "id": spec.id,
        "origin": spec.origin,
        "inputs": [str(p) for p in spec.inputs],
        **task,
        "output": spec.output,
        "sampling": sampling,
        "sampling_from": {key: sources[key] for key in sorted(sources)},
    }


JOB_FIELD = PRESET_SAMPLING_FIELDS
"""A :class:`~engine.config.SamplingParams` field -> the job field that sets it, where the
names differ (``max_tokens`` is the jobs' ``max_new_tokens``, as in a preset)."""


def save_config(output_dir: Path, document: dict[str, Any]) -> Path:
    """Write ``config.json`` (``document`` with :data:`CONFIG_MARKER`) into ``output_dir``
    atomically; return its path."""
    path = output_dir / CONFIG_FILE
    text = json.dumps({**document, **CONFIG_MARKER}, indent=2, sort_keys=True, default=str)
    write_text_atomic(path, text + "\n")
    return path


def is_hisparse_config(data: bytes) -> bool:
    """Whether ``data``, the bytes of a ``config.json``, is one hisparse wrote: a JSON
    object with :data:`CONFIG_MARKER`, or (earlier versions) with :data:`CONFIG_KEYS`
    and ``engine`` an object, or empty (:func:`~hisparse_cli.results.marked_document`);
    any other file is someone else's, which a run must not replace."""

    def earlier(document: dict) -> bool:
        return all(k in document for k in CONFIG_KEYS) and isinstance(document["engine"], dict)

    return marked_document(data, CONFIG_MARKER, earlier)
