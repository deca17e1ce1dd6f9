"""Fresh-user findings on the messages of the commands beside ``run`` (plan, quantize,
replay, eval, bench, presets) and of the preset loading every command shares: a file name's
control characters are escaped as ``run`` escapes them (``nl\\nname``, ``esc\\x1b[31m``),
every refusal is ``error:`` lines (one a problem) with exit 2, a flag is named as the flag,
and ``plan --model`` refuses a file that is no model in ``run``'s words."""

from __future__ import annotations

import os
import signal
import time

import pytest
from typer.testing import CliRunner

from hisparse_cli import runner as runner_module
from hisparse_cli.main import app

NAMES = {"nl\nname": "nl\\nname", "esc\x1b[31mred": "esc\\x1b[31mred"}
"""File names as a user may have them -> as every message shows them."""
PRESET = "description: a test preset\nhardware: {devices: [cpu], memory_gb: 8}\n"


@pytest.fixture
def here(tmp_path, monkeypatch):
    """Run in ``tmp_path`` on a machine without CUDA (``--preset auto`` is cpu)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runner_module, "cuda_device_count", lambda: 0)
    monkeypatch.setattr(runner_module, "free_cpu_threads", lambda config: None)
    return tmp_path


def invoke(*args):
    """``hisparse ARGS``; ``color=True`` keeps escape sequences in the output (CliRunner
    strips them otherwise), so a raw one is seen."""
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "80"}, color=True)


def errors(result, *words):
    """Exit 2, every stderr line an ``error:`` line, no raw control character, ``words``
    in it; the error lines."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert lines and all(line.startswith("error: ") for line in lines), result.stderr
    assert "\x1b" not in result.output and "\r" not in result.output, repr(result.output)
    for word in words:
        assert word in result.stderr, (word, result.stderr)
    return lines


def one_error(result, *words):
    lines = errors(result, *words)
    assert len(lines) == 1, result.stderr
    return lines[0]


# ----------------------------------------------------------------------------- names


def test_shown_message_escapes_the_names_given_where_a_message_holds_them_raw():
    from hisparse_cli.display import shown_message

    message = "nl\nx.yaml:3: foo: unknown key\nnl\nx.yaml:4: bar: \x1b[2J"
    assert shown_message(message, ["./nl\nx.yaml", None]) == (
        "nl\\nx.yaml:3: foo: unknown key\nnl\\nx.yaml:4: bar: \\x1b[2J"
    )  # its own newline kept; the name's escaped, as given or as a path; no raw ESC
    home = os.path.expanduser("~")
    assert shown_message(f"{home}/a\tb: gone", ["~/a\tb"]) == f"{home}/a\\tb: gone"


# ----------------------------------------------------------------------------- presets


@pytest.mark.parametrize("command", ["plan", "presets", "run"])
def test_a_preset_that_is_no_yaml_file_is_named_for_what_it_is(here, command):
    """``--preset d.yaml`` (a folder) said "does not exist"; a PNG as p.yaml gave "'utf-8'
    codec can't decode byte 0x89"; ``--preset model.txt`` said "unknown preset"; a YAML
    syntax error printed PyYAML's three lines, only the first with ``error:``."""
    (here / "d.yaml").mkdir()
    (here / "p.yaml").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(32)))
    (here / "model.txt").write_text("hello\n")
    (here / "bad.yaml").write_text("description: x\nhardware: [1,\n")
    (here / "a.txt").write_text("A short document.\n")

    def refusal(preset):
        args = {
            "plan": ("plan", "-n", "1", "-c", "8K", "--preset", preset),
            "presets": ("presets", "show", preset),
            "run": ("run", "--preset", preset, "a.txt"),
        }[command]
        return one_error(invoke(*args))

    assert refusal("d.yaml").startswith("error: preset file 'd.yaml' is a directory")
    png = refusal("p.yaml")
    assert png.startswith("error: p.yaml: not a YAML preset file: not UTF-8 text")
    assert "codec" not in png
    text = refusal("model.txt")
    assert text.startswith("error: preset file 'model.txt' is not a YAML preset file")
    assert "unknown preset" not in text
    syntax = refusal("bad.yaml")
    assert syntax.startswith("error: bad.yaml:3: not valid YAML: ")
    assert "stream end" in syntax
    assert refusal("./nothere.yaml") == "error: preset file './nothere.yaml' does not exist"


# ----------------------------------------------------------------------------- plan


@pytest.mark.parametrize("name", list(NAMES))
def test_plan_escapes_a_model_name_as_run_does(here, name):
    """``plan --model $'nl\\nname.gguf'`` split its error over two lines; an ``ESC`` went
    to the terminal raw. Missing, and a file that is no GGUF file."""
    shown = NAMES[name]
    missing = one_error(invoke("plan", "-n", "1", "-c", "8K", "--model", f"{name}.gguf"))
    assert missing == f"error: model not found: {shown}.gguf"
    (here / f"{name}.gguf").write_text("hello\n")
    found = one_error(invoke("plan", "-n", "1", "-c", "8K", "--model", f"{name}.gguf"))
    assert found.startswith(f"error: --model {shown}.gguf: not a GGUF file")


def test_plan_shows_a_preset_name_as_text(here):
    """A preset file named with an escape and Rich markup: the plan's first line shows it
    escaped and as it is spelt (``[red]`` was read as markup and vanished)."""
    name = "ok\x1b[31m[red]x"
    (here / f"{name}.yaml").write_text(PRESET)
    result = CliRunner().invoke(
        app, ["plan", "-n", "1", "-c", "8K", "--preset", f"{name}.yaml"], color=True,
        env={"COLUMNS": "200"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "on ok\\x1b[31m[red]x: 1 x" in result.stdout and "\x1b" not in result.stdout
    shown = invoke("presets", "show", f"{name}.yaml")
    assert shown.exit_code == 0, shown.output
    assert shown.stdout.startswith("# preset ok\\x1b[31m[red]x (ok\\x1b[31m[red]x.yaml),")


def test_plan_names_its_flags_not_the_fields_they_set(here):
    """``plan --host-memory -3`` said ``hardware.host_memory_gb: must be ...``; the engine
    flags said ``host_pool_gb:``, ``page_size:``: the flags, as run names them."""
    line = one_error(invoke("plan", "-n", "1", "-c", "8K", "--host-memory", "-3"))
    assert line.startswith("error: --host-memory: must be a number > 0")
    assert "host_memory_gb" not in line
    lines = errors(invoke("plan", "-n", "1", "-c", "8K", "--host-pool", "-3", "--page-size", "7"))
    assert sorted(line.split(":")[1] for line in lines) == [" --host-pool", " --page-size"]
    one_error(invoke("plan", "-n", "1", "-c", "8K", "--hot-dtype", "fp8"), "error: --hot-dtype: ")


@pytest.mark.parametrize(
    ("name", "data"),
    [("model.txt", b"hello, a text file\n"), ("pic.png", b"\x89PNG\r\n\x1a\n0000")],
)
def test_plan_refuses_a_file_that_is_no_model_in_runs_words(here, name, data):
    """``plan --model model.txt`` said "is a file but not a model", ``run --model`` "not a
    GGUF file (it starts with ...)": the same check, the same line."""
    (here / name).write_bytes(data)
    (here / "a.txt").write_text("A short document.\n")
    plan = one_error(invoke("plan", "-n", "1", "-c", "8K", "--model", name))
    run = invoke("run", "--model", name, "a.txt")
    assert run.exit_code == 2
    assert plan == run.stderr.strip()
    assert plan.startswith(f"error: --model {name}: not a GGUF file (it starts with b'")


# ----------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("name", list(NAMES))
def test_quantize_escapes_its_source_and_output_names(here, name):
    shown = NAMES[name]
    one_error(invoke("quantize", name, "out"), f"model folder not found: {shown}")
    (here / name).write_text("hello\n")
    one_error(invoke("quantize", name, "out"), f"{shown} is a file, not a model folder")


def test_quantize_into_a_file_or_over_its_output_says_what_to_do(here):
    """``quantize src out`` with ``out`` a file said "[Errno 17] File exists: 'out'" after
    the whole quantisation; over an earlier output, "pass overwrite / --force": an argument
    of the Python function the user never sees."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_models import build_hf

    build_hf(here / "hf", "llama")
    (here / "model.txt").write_text("hello\n")
    line = one_error(invoke("quantize", "-q", "hf", "model.txt"))
    assert line.startswith("error: model.txt: exists and is not a folder")
    assert "Errno" not in line
    one_error(invoke("quantize", "-q", "hf", "model.txt/sub"), "model.txt is not a folder")
    assert invoke("quantize", "-q", "hf", "out").exit_code == 0
    again = one_error(invoke("quantize", "-q", "hf", "out"))
    assert again.startswith("error: out/model.safetensors, out/config.json, ")
    assert again.endswith(
        " exist: quantize would replace them; --force replaces them, or choose another OUT"
    )
    assert invoke("quantize", "-q", "--force", "hf", "out").exit_code == 0


def test_quantize_refuses_an_out_holding_any_file_it_would_write(here):
    """Fresh-user finding: ``quantize SRC OUT`` with OUT holding the user's own config.json
    and tokenizer.json (no model.safetensors) replaced both without a word, rc 0: only
    model.safetensors was protected. Every file it writes is refused now, before any work."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_models import build_hf

    build_hf(here / "hf", "llama")
    (here / "hf" / "tokenizer.json").write_text('{"source": 1}')
    out = here / "out"
    out.mkdir()
    (out / "config.json").write_text("mine\n")
    (out / "tokenizer.json").write_text("my tokenizer\n")
    line = one_error(invoke("quantize", "-q", "hf", "out"))
    assert line == (
        "error: out/config.json, out/tokenizer.json exist: quantize would replace them; "
        "--force replaces them, or choose another OUT"
    )
    assert (out / "config.json").read_text() == "mine\n"
    assert (out / "tokenizer.json").read_text() == "my tokenizer\n"
    assert not (out / "model.safetensors").exists()  # refused before any work
    assert invoke("quantize", "-q", "--force", "hf", "out").exit_code == 0
    assert (out / "tokenizer.json").read_text() == '{"source": 1}'


# ----------------------------------------------------------------------------- replay


@pytest.mark.parametrize("name", list(NAMES))
def test_replay_escapes_a_trace_name(here, name):
    """``hisparse replay $'esc\\e[31mred.gguf'`` printed the ESC raw; a missing trace was a
    usage box, not an ``error:`` line."""
    shown = NAMES[name]
    one_error(invoke("replay", f"{name}.jsonl"), f"trace not found: {shown}.jsonl")
    (here / f"{name}.jsonl").write_text("hello\n")
    one_error(invoke("replay", f"{name}.jsonl"), f"{shown}.jsonl: not a hisparse selection trace")
    (here / "dir.jsonl").mkdir()
    one_error(invoke("replay", "dir.jsonl"), "dir.jsonl is a directory")


def test_quantize_names_its_group_size_flag(here):
    """Fresh-user finding: ``quantize -g 7`` said ``group_size=7 is not one of ...``, the
    Python argument's name; the flag, as the help shows it."""
    (here / "hf").mkdir()
    line = one_error(invoke("quantize", "-g", "7", "hf", "out"))
    assert line == "error: -g/--group-size 7 is not one of (32, 64, 128, 256)"
    assert not (here / "out").exists()


# ----------------------------------------------------------------------------- eval and bench


def test_eval_and_bench_escape_the_files_they_name(here):
    result = invoke("eval", "-o", "out", "--preset", "cpu", "nl\nmissing.txt")
    assert result.exit_code == 2 and "\x1b" not in result.output
    assert result.stderr.splitlines() == [
        "skipped haystack file nl\\nmissing.txt: file not found",
        "error: no readable haystack file among nl\\nmissing.txt",
    ]
    one_error(
        invoke("bench", "--memory-budget", "4", "--preset", "cpu", "--model", "esc\x1b[31m.gguf"),
        "model not found: esc\\x1b[31m.gguf",
    )


@pytest.mark.parametrize("name", list(NAMES))
def test_a_preset_name_is_escaped_in_every_commands_problems(here, name):
    """A preset file whose name holds a newline: each of its problems (``file:line: ...``)
    stays one ``error:`` line in plan, presets show, bench and eval; run names it escaped."""
    shown = NAMES[name]
    (here / f"{name}.yaml").write_text(PRESET + "foo: 1\nbar: 2\n")
    for args in (
        ("plan", "-n", "1", "-c", "8K"),
        ("presets", "show"),
        ("bench", "--memory-budget", "4"),
        ("eval", "-o", "out"),
    ):
        preset = [f"{name}.yaml"] if args[0] == "presets" else ["--preset", f"{name}.yaml"]
        lines = errors(invoke(*args, *preset))
        assert [line.split(": ")[1] for line in lines] == [f"{shown}.yaml:3", f"{shown}.yaml:4"]
    result = invoke("run", "--preset", f"{name}.yaml", "a.txt")
    assert result.exit_code == 2 and f"{shown}.yaml:3: foo: unknown key" in result.stderr
    assert "\x1b" not in result.output and f"\n{shown.split(chr(92))[1]}" not in result.stderr
    missing = one_error(invoke("plan", "-n", "1", "-c", "8K", "--preset", f"x{name}.yaml"))
    assert missing == f"error: preset file 'x{shown}.yaml' does not exist"


# ----------------------------------------------------------------------------- eval


def test_sigterm_stops_eval_with_the_words_of_ctrl_c(here, monkeypatch):
    """SIGTERM to ``hisparse eval`` exited 143 without a word; Ctrl-C says that no result
    was written. The test's own handler stands in for SIGTERM's default (the end of the
    process) until eval puts its own."""
    from hisparse_cli import eval_cmd

    class Terminated(Exception):
        pass

    def default(signum, frame):
        raise Terminated

    previous = signal.signal(signal.SIGTERM, default)
    try:

        def run(*args):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # the handler's exception ends it
            raise AssertionError("SIGTERM did not stop eval")

        monkeypatch.setattr(eval_cmd, "_run", run)
        result = CliRunner().invoke(app, ["eval", "--preset", "cpu", "-o", "out"])
        assert signal.getsignal(signal.SIGTERM) is default  # put back
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not isinstance(result.exception, Terminated), "eval left SIGTERM to its default"
    assert result.exit_code == 143, result.output
    err = " ".join(result.stderr.split())
    assert "interrupted (SIGTERM) before writing out/eval.json: no result was written" in err


def test_bench_names_its_flags_not_the_fields_they_set(here):
    """Fresh-user finding: ``bench --memory-budget -1`` said ``memory_budget_gb: must be
    ...``; the flags, as run names them. A preset's own bad value keeps its field name."""
    line = one_error(invoke("bench", "--preset", "cpu", "--memory-budget", "-1"))
    assert line.startswith("error: --memory-budget: must be a number > 0"), line
    lines = errors(invoke("bench", "--preset", "cpu", "--memory-budget", "4", "--page-size", "7"))
    assert lines == ["error: --page-size: must be one of 16, 32, 64, got 7"]
    (here / "p.yaml").write_text(PRESET + "engine: {page_size: 7}\n")
    lines = errors(invoke("bench", "--preset", "p.yaml", "--memory-budget", "4"))
    assert lines == ["error: p.yaml:3: engine.page_size: must be one of 16, 32, 64, got 7"]
