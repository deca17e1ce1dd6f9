"""The resolved engine config: defaults < preset < manifest ``defaults.engine`` < flags.

Each layer is a dict of :class:`~engine.config.EngineConfig` field overrides applied with
``EngineConfig.replace``; ``extra`` dicts are merged key by key rather than replaced.
The result is validated once, at the end.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.config import ConfigError, EngineConfig
from hisparse_cli.results import write_text_atomic

CONFIG_FILE = "config.json"


def preset_overrides(name: str) -> dict[str, Any]:
    """EngineConfig overrides of preset ``name`` (``engine.presets.load_preset``).

    While ``engine.presets`` does not exist every preset is empty.

    Raises
    ------
    ConfigError
        The preset is unknown or malformed (the message names it).
    """
    try:
        from engine.presets import load_preset
    except ModuleNotFoundError as exc:
        if exc.name != "engine.presets":
            raise
        return {}
    try:
        return dict(load_preset(name))
    except (OSError, KeyError, ValueError) as exc:  # ConfigError is a ValueError
        raise ConfigError(f"preset {name!r}: {exc}") from None


def resolve_engine_config(
    preset: str,
    manifest_engine: Mapping[str, Any] | None = None,
    cli: Mapping[str, Any] | None = None,
) -> EngineConfig:
    """Apply the layers in precedence order and validate.

    Parameters
    ----------
    preset
        Preset name (see :func:`preset_overrides`).
    manifest_engine
        ``defaults.engine`` of the manifest.
    cli
        Overrides from flags; ``None`` values (flag not given) are skipped.

    Raises
    ------
    ConfigError
        Unknown field (naming the layer) or a value :meth:`EngineConfig.validate` rejects.
    """
    config = EngineConfig()
    layers = (
        (f"preset {preset!r}", preset_overrides(preset)),
        ("manifest defaults.engine", dict(manifest_engine or {})),
        ("command-line flags", {k: v for k, v in (cli or {}).items() if v is not None}),
    )
    for source, overrides in layers:
        config = _apply(config, source, overrides)
    config.validate()
    return config


def _apply(config: EngineConfig, source: str, overrides: dict[str, Any]) -> EngineConfig:
    if isinstance(overrides.get("extra"), dict):
        overrides = {**overrides, "extra": {**config.extra, **overrides["extra"]}}
    try:
        return config.replace(**overrides)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def config_document(config: EngineConfig, preset: str, model: str | None) -> dict[str, Any]:
    """What ``config.json`` and ``--print-config`` show."""
    return {"preset": preset, "model": model, "engine": config.to_dict()}


def save_config(output_dir: Path, document: dict[str, Any]) -> Path:
    """Write ``config.json`` into ``output_dir`` atomically; return its path."""
    path = output_dir / CONFIG_FILE
    write_text_atomic(path, json.dumps(document, indent=2, sort_keys=True, default=str) + "\n")
    return path
