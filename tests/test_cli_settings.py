"""Engine config precedence and the preset hook."""

from __future__ import annotations

import json
import sys

import pytest

from engine.config import ConfigError
from hisparse_cli import settings


def test_layers_apply_in_order(monkeypatch):
    monkeypatch.setattr(
        settings, "preset_overrides", lambda name: {"top_k": 256, "extra": {"a": 1}}
    )
    config = settings.resolve_engine_config(
        "x", {"top_k": 512, "page_size": 32}, {"page_size": 64, "extra": {"b": 2}, "indexer": None}
    )
    assert (config.top_k, config.page_size, config.indexer) == (512, 64, "quest")
    assert config.extra == {"a": 1, "b": 2}


def test_unknown_field_names_the_layer(monkeypatch):
    monkeypatch.setattr(settings, "preset_overrides", lambda name: {"warp_drive": True})
    with pytest.raises(ConfigError, match="preset 'x': unknown setting"):
        settings.resolve_engine_config("x")


def test_validation_runs_on_the_result(monkeypatch):
    monkeypatch.setattr(settings, "preset_overrides", lambda name: {})
    with pytest.raises(ConfigError, match="page_size"):
        settings.resolve_engine_config("x", cli={"page_size": 8})


def test_missing_presets_module_means_empty(monkeypatch):
    monkeypatch.setitem(sys.modules, "engine.presets", None)  # import raises ModuleNotFoundError
    assert settings.preset_overrides("cpu") == {}


def test_preset_errors_become_config_errors(monkeypatch):
    import types

    def load_preset(name):
        raise KeyError(name)

    monkeypatch.setitem(
        sys.modules, "engine.presets", types.SimpleNamespace(load_preset=load_preset)
    )
    with pytest.raises(ConfigError, match="preset 'moon'"):
        settings.preset_overrides("moon")


def test_save_config_writes_json(tmp_path, monkeypatch):
    monkeypatch.setattr(settings, "preset_overrides", lambda name: {})
    config = settings.resolve_engine_config("cpu")
    path = settings.save_config(tmp_path, settings.config_document(config, "cpu", None))
    assert json.loads(path.read_text())["engine"]["top_k"] == config.top_k
