"""``hisparse eval``'s arguments, checked before any model loads: duplicates are refused
naming the option and the duplicate, only the context policies eval uses are taken, and
the CPU threads are chosen as ``hisparse run`` chooses them."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import engine.load
from engine.config import ConfigError
from hisparse_cli import runner as runner_module
from hisparse_cli.main import app


@pytest.fixture
def placed(monkeypatch, tmp_path):
    """Replace ``place_model``: record the config eval would load with, then stop (exit 2).
    The tests' ``--model none.gguf`` is a file that starts as a GGUF file does, which
    eval's check of ``--model`` before the load (as ``hisparse run``'s) lets through."""
    (tmp_path / "none.gguf").write_bytes(b"GGUF")
    seen = []

    def place_model(config, model):
        seen.append(config)
        raise ConfigError("stopped before loading (test)")

    monkeypatch.setattr(engine.load, "place_model", place_model)
    monkeypatch.setattr(runner_module, "free_cpu_threads", lambda config: None)
    return seen


def run_eval(tmp_path, *extra):
    args = ["eval", "--model", str(tmp_path / "none.gguf"), "--preset", "cpu", "-o", str(tmp_path)]
    return CliRunner().invoke(app, [*args, *extra], catch_exceptions=False)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--tasks", "niah_single,vt,niah_single"), "--tasks: 'niah_single' is given twice"),
        (("--lengths", "2K,4K,2K"), "--lengths: '2K' is given twice"),
        (("--lengths", "2K,4K,2048"), "--lengths: '2K' and '2048' are both 2048 tokens"),
        (("--depths", "0.5,.5"), "--depths: '0.5' and '.5' are the same value"),
        (("--configs", "dense,sparse,dense"), "--configs: config 'dense' given twice"),
        (
            ("--configs", "dense,top_k=512:page=32,page=32:top_k=512"),
            "--configs: 'top_k=512:page=32' and 'page=32:top_k=512' are the same settings",
        ),
    ],
)
def test_duplicates_are_refused_before_the_model_loads(tmp_path, placed, args, message):
    result = run_eval(tmp_path, *args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert placed == []  # refused before place_model


def test_every_options_problem_is_reported_at_once(tmp_path, placed):
    """Fresh users' findings: only the first of several bad options (or of several bad
    values of one option) was named; a depth outside [0, 1] only after the preset line."""
    result = run_eval(
        tmp_path, "--lengths", "2K,2K,3X", "--depths", "0.5,.5,1.5", "--tasks", "nope",
        "--configs", "dense,dense,top_k=abc,top_k=256:oversample=2",
    )  # fmt: skip
    out = " ".join(result.output.split())
    assert result.exit_code == 2 and placed == []
    for message in ("--lengths: '2K' is given twice", "--lengths: context '3X' is not",
                    "--depths: '0.5' and '.5'", "--depths: '1.5' is outside [0, 1]", "nope",
                    "--configs: config 'dense' given twice", "top_k='abc' is not an integer",
                    "oversample works only with meta=superpage"):  # fmt: skip
        assert message in out, out
    assert "preset" not in out  # refused before the preset is resolved


def test_distinct_values_reach_the_model_load(tmp_path, placed):
    result = run_eval(tmp_path, "--lengths", "2K,4K", "--tasks", "niah_single,vt")
    assert result.exit_code == 2 and "stopped before loading (test)" in result.output
    assert len(placed) == 1


@pytest.mark.parametrize("policy", ["truncate", "chunk"])
def test_context_policies_eval_never_uses_are_refused(tmp_path, placed, policy):
    result = run_eval(tmp_path, "--context-policy", policy)
    assert result.exit_code == 2 and "'refuse', 'extend'" in result.output, result.output
    assert placed == []
    help_text = CliRunner().invoke(app, ["eval", "--help"], env={"COLUMNS": "200"}).stdout
    assert "<refuse|extend>" in help_text and "Not truncate or chunk" in help_text


def test_a_presets_chunk_policy_is_read_as_refuse_with_a_warning(tmp_path, placed):
    preset = tmp_path / "chunky.yaml"
    source = Path(__file__).resolve().parents[2] / "presets" / "cpu.yaml"
    preset.write_text(
        source.read_text().replace("engine:\n", "engine:\n  context_policy: chunk\n", 1)
    )
    args = ["eval", "--model", str(tmp_path / "none.gguf"), "--preset", str(preset)]
    result = CliRunner().invoke(app, [*args, "-o", str(tmp_path)], catch_exceptions=False)
    assert "context_policy 'chunk' (from the preset) does not apply to eval" in result.output
    assert placed and placed[0].context_policy == "refuse"


def test_eval_takes_the_free_cpu_threads_as_run_does(tmp_path, placed, monkeypatch):
    monkeypatch.setattr(runner_module, "free_cpu_threads", lambda config: 1)
    result = run_eval(tmp_path)
    assert "using 1 of" in result.output and "--threads N overrides" in result.output
    assert placed[0].num_threads == 1


def test_eval_globs_skip_its_output_folder_as_run_globs_do(tmp_path, placed, monkeypatch):
    """Fresh-user finding: ``hisparse eval 'docs/**/*' -o docs/ev`` read the folder's own
    ``eval.json`` of an earlier run into the haystack (so the prompts changed from run to
    run), where a ``hisparse run`` glob never reads its output folder. Eval's documents
    are now found by run's code (``manifest.expand_documents``): the output folder's files
    are skipped with a note, a glob that matches only them is refused before the model
    loads, a file named without a glob is read."""
    import hisparse_cli.eval_cmd as eval_cmd

    read: list[list[str]] = []
    real = eval_cmd._read_haystack
    monkeypatch.setattr(
        eval_cmd, "_read_haystack", lambda *a, **k: read.append(real(*a, **k)) or read[-1]
    )
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs" / "ev").mkdir(parents=True)
    (tmp_path / "docs" / "ev" / "eval.json").write_text('{"format": "hisparse-eval"}\n')
    (tmp_path / "docs" / "doc.txt").write_text("A haystack document.\n")

    def run(*docs):
        args = ["eval", "--model", "none.gguf", "--preset", "cpu", "-o", "docs/ev", "--force"]
        args += docs  # --force: docs/ev holds an earlier eval's eval.json
        return CliRunner().invoke(app, args, catch_exceptions=False)

    result = run("docs/**/*")
    assert read == [["A haystack document.\n"]] and len(placed) == 1, result.output
    out = " ".join(result.output.split())
    assert "input globs skipped 1 file(s) in the output folder docs/ev (docs/ev/eval.json)" in out
    result = run("docs/ev/*")
    out = " ".join(result.output.split())
    assert result.exit_code == 2 and len(placed) == 1, out
    assert "glob 'docs/ev/*' matches only files in the output folder docs/ev" in out
    assert "(the default is hisparse-eval)" in out
    result = run("docs/ev/eval.json")
    assert read[-1] == ['{"format": "hisparse-eval"}\n'] and len(placed) == 2
