"""Engine config precedence and the preset hook."""

from __future__ import annotations

import json
import sys

import pytest

from engine.config import ConfigError, EngineConfig
from hisparse_cli import settings


def test_layers_apply_in_order(monkeypatch):
    monkeypatch.setattr(
        settings, "preset_overrides", lambda name: {"top_k": 256, "devices": ["cpu", "cpu"]}
    )
    config = settings.resolve_engine_config(
        "x",
        {"top_k": 512, "page_size": 32},
        {"page_size": 64, "trace_path": "t.jsonl", "indexer": None},
    )
    assert (config.top_k, config.page_size, config.indexer) == (512, 64, "quest")
    assert (config.devices, config.trace_path) == (("cpu", "cpu"), "t.jsonl")


def test_unknown_field_names_the_layer(monkeypatch):
    monkeypatch.setattr(settings, "preset_overrides", lambda name: {"warp_drive": True})
    with pytest.raises(ConfigError, match="preset 'x': unknown setting"):
        settings.resolve_engine_config("x")


def test_validation_runs_on_the_result(monkeypatch):
    monkeypatch.setattr(settings, "preset_overrides", lambda name: {})
    with pytest.raises(ConfigError, match="--page-size: must be one of 16, 32, 64, got 8"):
        settings.resolve_engine_config("x", cli={"page_size": 8})


def test_every_problem_is_placed_at_the_highest_layer_that_set_it(monkeypatch):
    monkeypatch.setattr(settings, "preset_overrides", lambda name: {"device_buffer": 4096})
    with pytest.raises(settings.SettingsError) as info:
        settings.resolve_engine_config(
            "x", {"local_window": 64}, {"top_k": 8192, "page_size": 7, "max_batch": 0}
        )
    assert [str(p) for p in info.value.problems] == [
        "command line: --page-size: must be one of 16, 32, 64, got 7",
        "command line: --max-batch: must be a positive integer, got 0",
    ]  # the buffer check needs a valid page_size: not reported on top
    with pytest.raises(settings.SettingsError) as info:
        settings.resolve_engine_config("x", {"local_window": 64}, {"top_k": 8192})
    (problem,) = info.value.problems
    assert problem.field == "--top-k-tokens" and "raise device_buffer to at least" in problem.message
    with pytest.raises(settings.SettingsError) as info:
        settings.resolve_engine_config("x", {"top_k": 8192})
    (problem,) = info.value.problems
    assert (problem.file, problem.field) == ("manifest", "defaults.engine.top_k")
    monkeypatch.setattr(
        settings, "preset_overrides", lambda name: {"top_k": 8192, "device_buffer": 4096}
    )
    with pytest.raises(settings.SettingsError) as info:
        settings.resolve_engine_config("x")
    assert str(info.value.problems[0]).startswith("preset 'x': engine.device_buffer: ")


def test_a_problem_names_the_flag_the_user_typed(monkeypatch):
    """Fields whose flag is not ``--field-name`` are named by their flag: ``--hot-dtype``
    for ``hot_buffer_dtype`` (there is no ``--hot-buffer-dtype``)."""
    from hisparse_cli.options import HotBufferDtype

    monkeypatch.setattr(settings, "preset_overrides", lambda name: {})
    with pytest.raises(settings.SettingsError) as info:
        settings.resolve_engine_config("x", cli={"hot_buffer_dtype": "fp8", "kv_host_dtype": "bf16"})
    (problem,) = info.value.problems
    assert problem.field == "--hot-dtype" and "kv_host_dtype fp8" in problem.message
    assert HotBufferDtype.__metadata__[0].default == "--hot-dtype"  # typer: the first name


def test_missing_presets_module_means_empty(monkeypatch):
    monkeypatch.setitem(sys.modules, "engine.presets", None)  # import raises ModuleNotFoundError
    assert settings.preset_overrides("cpu") == {}


def test_preset_errors_become_config_errors(monkeypatch):
    import types

    def load_preset_full(name):
        raise KeyError(name)

    monkeypatch.setitem(
        sys.modules, "engine.presets", types.SimpleNamespace(load_preset_full=load_preset_full)
    )
    with pytest.raises(ConfigError, match="preset 'moon'"):
        settings.preset_overrides("moon")


def test_save_config_writes_json(tmp_path, monkeypatch):
    monkeypatch.setattr(settings, "preset_overrides", lambda name: {})
    config = settings.resolve_engine_config("cpu")
    path = settings.save_config(tmp_path, settings.config_document(config, "cpu", None))
    assert json.loads(path.read_text())["engine"]["top_k"] == config.top_k


def test_buffer_advice_names_the_window_when_it_dominates():
    """When sink + window pages exceed top_k, the advice is to shrink them or grow the
    buffer, not the misleading 'device_buffer must be >= top_k'."""
    (problem,) = EngineConfig(local_window=100_000).problems()
    assert "raise device_buffer to at least" in problem.message
    assert "or lower sink_tokens/local_window" in problem.message and ">= top_k" not in problem.message
    (problem,) = EngineConfig(top_k=8192, device_buffer=4096).problems()
    assert "(>= top_k)" in problem.message


def test_prefetch_needs_room_and_a_ranking():
    """``prefetch_pages`` beyond the hot buffer's spare pages, or with the dense indexer,
    is one problem naming the fix; within the room it is fine."""
    base = EngineConfig(top_k=256, page_size=16, sink_tokens=16, local_window=32, device_buffer=320)
    assert not base.replace(prefetch_pages=4).problems()  # 16 selected + 4 = 20 pages
    (problem,) = base.replace(prefetch_pages=5).problems()
    assert problem.fields[0] == "prefetch_pages"
    assert "needs 21 hot-buffer pages" in problem.message and "336 tokens" in problem.message
    (problem,) = base.replace(prefetch_pages=2, indexer="dense").problems()
    assert problem.fields == ("prefetch_pages", "indexer")
    (problem,) = EngineConfig(prefetch_pages=-1).problems()
    assert problem.fields == ("prefetch_pages",) and "integer >= 0" in problem.message
    assert not base.replace(prefetch_pages=64, hierarchical=False).problems()  # ignored there


def test_group_combine_is_checked_and_layered(monkeypatch):
    """``group_combine`` is an engine setting like the others: checked against the rules
    the kernels implement, set by a preset, a manifest or the CLI layer, and part of the
    resolved config that ``config.json`` records."""
    (problem,) = EngineConfig(group_combine="mean").problems()
    assert problem.fields == ("group_combine",)
    assert "sum, max, normmax, union" in problem.message
    monkeypatch.setattr(settings, "preset_overrides", lambda name: {"group_combine": "max"})
    assert settings.resolve_engine_config("x").group_combine == "max"
    config = settings.resolve_engine_config("x", {"group_combine": "union"})
    assert config.group_combine == "union"
    assert json.loads(json.dumps(config.to_dict()))["group_combine"] == "union"
    with pytest.raises(ConfigError, match="group_combine"):
        settings.resolve_engine_config("x", {"group_combine": "vote"})


def test_kv_host_dtype_is_checked_and_layered(monkeypatch):
    """``kv_host_dtype`` (bf16|fp8) is checked, layered like the others, and refuses the
    pool-reading oracle indexer when hierarchical."""
    (problem,) = EngineConfig(kv_host_dtype="fp4").problems()
    assert problem.fields == ("kv_host_dtype",) and "bf16, fp8" in problem.message
    (problem,) = EngineConfig(kv_host_dtype="fp8", indexer="oracle").problems()
    assert problem.fields == ("kv_host_dtype", "indexer")
    assert not EngineConfig(kv_host_dtype="fp8", indexer="oracle", hierarchical=False).problems()
    monkeypatch.setattr(settings, "preset_overrides", lambda name: {"kv_host_dtype": "fp8"})
    assert settings.resolve_engine_config("x").kv_host_dtype == "fp8"
    assert settings.resolve_engine_config("x", {"kv_host_dtype": "bf16"}).kv_host_dtype == "bf16"
