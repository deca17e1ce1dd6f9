"""Fresh-user findings on the messages of the commands beside ``run`` (plan, quantize,
replay, eval, bench, presets) and of the preset loading every command shares: a file name's
control characters are escaped as ``run`` escapes them (``nl\\nname``, ``esc\\x1b[31m``),
every refusal is ``error:`` lines (one a problem) with exit 2, a flag is named as the flag,
and ``plan --model`` refuses a file that is no model in ``run``'s words."""

from __future__ import annotations

import os

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
