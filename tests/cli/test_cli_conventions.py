"""Command-line conventions: --version, shell completion, a tidy --help, and a presets
list that reads at 80 columns."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib
from typer.testing import CliRunner

from engine.presets import list_presets
from hisparse_cli.main import app

WIDE = {"COLUMNS": "200"}


def test_version_prints_the_package_version():
    result = CliRunner().invoke(app, ["--version"])
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    expected = tomllib.loads(pyproject.read_text())["project"]["version"]
    assert result.exit_code == 0 and result.stdout.strip() == f"hisparse {expected}"


def test_shell_completion_is_offered():
    result = CliRunner().invoke(app, ["--help"], env=WIDE)
    assert "--install-completion" in result.stdout and "--show-completion" in result.stdout


def _option_rows(help_text: str) -> dict[str, str]:
    """``--flag`` -> the text of its help row (first line)."""
    rows = {}
    for line in help_text.splitlines():
        match = re.match(r"│\s+(--[a-z0-9-]+)", line)
        if match:
            rows[match.group(1)] = line
    return rows


def test_run_flags_have_no_bool_placeholder_and_pair_with_no():
    text = CliRunner().invoke(app, ["run", "--help"], env=WIDE).stdout
    rows = _option_rows(text)
    for flag in ("--json-progress", "--print-config", "--force", "--allow-binary"):
        assert f"--no-{flag[2:]}" in rows[flag], rows[flag]
        assert "<bool>" not in rows[flag] and "[default: no-" not in text


def test_run_defaults_are_shown_as_values():
    text = CliRunner().invoke(app, ["run", "--help"], env=WIDE).stdout
    assert "[default: (" not in text
    defaults = (
        "[default: the preset's sampling.max_tokens: 256 on cpu, 512 on the GPU presets]",
        "[default: auto]",
        "[default: 2 x --top-k-tokens]",
    )
    for default in defaults:
        assert default in text


def test_presets_list_reads_at_80_columns():
    result = CliRunner().invoke(app, ["presets"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert "…" not in result.stdout  # nothing cut
    names = [line.split()[0] for line in lines if line[:2].strip() and line[1:2] != " "]
    assert set(list_presets()) | {"auto"} <= set(names) | {"presets"}
    words = " ".join(result.stdout.split())
    assert "2 x NVIDIA GeForce RTX 4090, 23 GiB each" in words  # dual4090-24, unbroken


def _commands(command, path=()):
    """(argv path, click command) of every command and sub-command of the app."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def test_no_help_of_any_command_shows_bool_and_flags_pair_with_no():
    import typer

    root = typer.main.get_command(app)
    seen = 0
    for path, command in _commands(root):
        text = CliRunner().invoke(app, [*path, "--help"], env=WIDE).stdout
        assert "Usage" in text, path
        assert "<bool>" not in text and "[default: no-" not in text, (path, text)
        for param in command.params:
            eager = getattr(param, "is_eager", False)  # --version: a plain action, then exit
            if getattr(param, "is_flag", False) and not eager and param.expose_value:
                assert param.secondary_opts, f"{' '.join(path)} {param.opts}: no --no- form"
        seen += 1
    assert seen >= 7  # the app, run, plan, quantize, bench, replay, presets
