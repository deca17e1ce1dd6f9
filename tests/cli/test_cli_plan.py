"""``hisparse plan --preset auto`` (its default) and ``hisparse presets`` on auto: the same
resolution as ``hisparse run`` (:func:`hisparse_cli.runner.auto_preset`), said with its
reason."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from typer.testing import CliRunner

from hisparse_cli import runner as runner_module
from hisparse_cli.main import app

WIDE = {"COLUMNS": "200"}


@pytest.fixture
def devices(monkeypatch):
    """Fake this machine's CUDA devices: ``devices(47.4, 47.4)`` is two 48 GB cards."""

    def fake(*memories_gib):
        monkeypatch.setattr(runner_module, "cuda_device_count", lambda: len(memories_gib))
        monkeypatch.setattr(runner_module, "cuda_device_memory_gib", lambda i: memories_gib[i])

    fake()  # no CUDA unless a test says so
    return fake


def invoke(*args):
    return CliRunner().invoke(app, list(args), env=WIDE, catch_exceptions=False)


def test_plan_defaults_to_auto_and_says_what_it_resolved_to(devices):
    devices(47.4, 47.4)
    result = invoke("plan", "--model", "llama2-13b-gqa8", "--jobs", "8", "--context", "256K")
    assert result.exit_code == 0, result.output
    first = result.stdout.splitlines()[0]
    assert first == "preset dual4090 (auto: 2 CUDA device(s), smallest 47.4 GiB)"
    assert "on dual4090: 2 x" in result.stdout


def test_plan_auto_without_cuda_is_cpu_and_json_names_it(devices):
    result = invoke("plan", "-p", "auto", "-n", "1", "-c", "8K")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("preset cpu (auto: no CUDA device)\n")
    data = json.loads(invoke("plan", "-p", "auto", "-n", "1", "-c", "8K", "--json").stdout)
    assert data["preset"] == "cpu" and data["preset_auto"] == "no CUDA device"
    named = json.loads(invoke("plan", "-p", "h200", "-n", "1", "-c", "8K", "--json").stdout)
    assert named["preset"] == "h200" and "preset_auto" not in named


def test_plan_auto_is_runs_resolution(devices, monkeypatch):
    from hisparse_cli.auto_preset import AutoChoice

    asked = []

    def auto_preset(device_flags=()):
        asked.append(tuple(device_flags))
        return AutoChoice("h200x2", "faked")

    monkeypatch.setattr(runner_module, "auto_preset", auto_preset)
    result = invoke("plan", "-n", "1", "-c", "8K")
    assert result.exit_code == 0 and "preset h200x2 (auto: faked)" in result.stdout
    assert asked == [()]


def test_presets_list_and_show_explain_auto(devices):
    devices(139.8)
    listing = invoke("presets").stdout
    words = " ".join(listing.split())
    assert "here: h200 (1 CUDA device used, 139.8 GiB)" in words
    assert ">= 40 -> dual4090" in words and "`plan`" in words
    shown = invoke("presets", "show", "auto")
    assert shown.exit_code == 0, shown.output
    assert shown.stdout.startswith("# auto: h200 on this machine (1 CUDA device used, 139.8 GiB)")
    assert "\n# preset h200 (" in shown.stdout  # a comment: the output is a preset file
    assert yaml.safe_load(shown.stdout)["model"] == "llama3.1-8b"  # still YAML


def test_plan_uses_the_host_memory_run_uses_and_says_where_it_came_from(devices, monkeypatch):
    """HISPARSE_HOST_MEMORY_GB is the figure ``hisparse run`` checks its host pool against:
    ``plan`` takes it too (it used the preset's 32 GiB: fresh-user finding); --host-memory
    beats it; without either, the preset's figure, naming what run checks instead."""
    args = ("plan", "-p", "cpu", "-n", "1", "-c", "8K", "--json")
    monkeypatch.delenv("HISPARSE_HOST_MEMORY_GB", raising=False)
    preset = json.loads(invoke(*args).stdout)
    assert preset["hardware"]["host_memory_gb"] == 32
    assert preset["host_memory_source"].startswith("preset cpu's")
    monkeypatch.setenv("HISPARSE_HOST_MEMORY_GB", "48")
    declared = json.loads(invoke(*args).stdout)
    assert declared["hardware"]["host_memory_gb"] == 48
    assert declared["host_memory_source"].startswith("HISPARSE_HOST_MEMORY_GB")
    assert declared["host"]["usable_bytes"] > preset["host"]["usable_bytes"]
    flag = json.loads(invoke(*args, "--host-memory", "64").stdout)
    assert flag["hardware"]["host_memory_gb"] == 64
    assert flag["host_memory_source"] == "--host-memory"
    table = invoke(*args[:-1]).stdout
    assert re.search(r"│ host RAM +│ 48\.00 │ HISPARSE_HOST_MEMORY_GB, as hisparse run uses", table)


def test_plan_refuses_a_bad_host_memory_variable(devices, monkeypatch):
    monkeypatch.setenv("HISPARSE_HOST_MEMORY_GB", "lots")
    result = invoke("plan", "-p", "cpu", "-n", "1", "-c", "8K")
    assert result.exit_code == 2 and "HISPARSE_HOST_MEMORY_GB" in result.output


@pytest.mark.parametrize(
    "fast,gib,fmt,why",
    [
        (True, "0.24", "int4", "CPU has AVX512-BF16/AMX"),
        (False, "0.50", "float", "no AVX512-BF16/AMX"),
    ],
    ids=["bf16-cpu", "avx2-cpu"],
)
def test_plan_counts_the_embedded_model_as_run_places_it(
    devices, monkeypatch, fast, gib, fmt, why
):
    """A new user's CPU box (no CUDA: auto is the cpu preset): ``hisparse plan -n 1 -c 8K
    --memory-budget 2`` counts the embedded model's weights as ``hisparse run`` places
    them, int4 (0.24 GiB) where the CPU has bf16 instructions, float32 (0.50 GiB)
    elsewhere, with a 5 % reserve, and the job fits. Before, it counted float32 weights
    and a 1 GiB reserve everywhere: 0 jobs, exit 2, where run ran with the same budget."""
    monkeypatch.setattr("engine.weights.placement.cpu_fast_bf16", lambda: fast)
    # this machine measured its LM head: float32 kept (no fp16 copy)
    monkeypatch.setattr("engine.capacity.planner.recorded_cpu_lm_head_fp16", lambda shape: False)
    args = ("plan", "-n", "1", "-c", "8K", "--memory-budget", "2")
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    weights = rf"│ weights +│ +{gib} │ float32 / {fmt} weights \(auto: {why}\)"
    assert re.search(weights, result.stdout), result.stdout
    assert re.search(r"│ reserve +│ +0\.10 │ 5 % \(CPU\)", result.stdout)
    data = json.loads(invoke(*args, "--json").stdout)
    assert data["weight_format"] == fmt and data["capacity"]["max_jobs"] >= 1


def test_plan_under_a_small_cpu_budget_names_the_budget_that_fits(devices, monkeypatch):
    """``hisparse plan -n 1 -c 8K --memory-budget 0.5`` on the CPU: refused, naming the
    smallest ``--memory-budget`` with which the job fits; that command then plans it."""
    monkeypatch.setattr("engine.weights.placement.cpu_fast_bf16", lambda: True)
    monkeypatch.setattr("engine.capacity.planner.recorded_cpu_lm_head_fp16", lambda shape: False)
    refused = invoke("plan", "-n", "1", "-c", "8K", "--memory-budget", "0.5")
    assert refused.exit_code == 2
    found = re.search(r"a larger budget: --memory-budget ([\d.]+)\n", refused.output)
    assert found, refused.output
    assert invoke("plan", "-n", "1", "-c", "8K", "--memory-budget", found[1]).exit_code == 0
    less = f"{float(found[1]) - 0.01:.2f}"
    assert invoke("plan", "-n", "1", "-c", "8K", "--memory-budget", less).exit_code == 2
