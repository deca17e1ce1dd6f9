"""Every command's ``--help`` reads well at 80 columns: nothing cut (no ``…``), argument
placeholders in capitals, one-line command summaries, choices shown as choices and defaults
shown as ``[default: ...]`` (on the typer of this machine; the GPU machine's 0.27 renders the
same tables)."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from hisparse_cli.main import app


def _commands(command, path=()):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


PATHS = [path for path, _ in _commands(typer.main.get_command(app))]


def help_text(path, columns):
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "hisparse")
def test_help_at_80_columns_cuts_nothing_and_names_arguments_in_capitals(path):
    text = help_text(path, 80)
    assert "…" not in text, text  # an option name or a default cut short
    assert all(len(line) <= 80 for line in text.splitlines())
    usage = next(line for line in text.splitlines() if "Usage:" in line)
    assert not re.search(r"\{[a-z]", usage), usage  # {src}: the parameter's name, not SRC
    assert "(default:" not in " ".join(text.split()), text  # defaults read [default: ...]


def test_command_summaries_fit_one_line():
    text = help_text((), 200)
    panel = text[text.index("Commands") :]
    rows = [line.strip("│ ") for line in panel.splitlines()[1:] if line.startswith("│")]
    assert rows and all(row.split()[0] in PATHS_TOP for row in rows), rows


PATHS_TOP = {path[0] for path in PATHS if len(path) == 1}


def test_plan_shows_choices_as_run_does():
    text = " ".join(help_text(("plan",), 200).split())
    for choices in ("<dense|sparse>", "<data|pipeline>", "<bf16|fp8>", "<float32|bfloat16|float16>"):
        assert choices in text
    assert "--preset -p NAME|FILE" in text and "[default: auto]" in text
    run = " ".join(help_text(("run",), 200).split())
    assert "--preset NAME|FILE" in run and "--task NAME" in run


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "hisparse")
def test_every_flag_is_lower_case(path):
    """typer 0.27 turns a metavar equal to the option's name into its flag (``--TASK``)."""
    flags = re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", help_text(path, 200))
    assert flags and all(f == f.lower() for f in flags if not f.startswith("--no-")), flags


def test_threads_help_and_readme_say_what_free_cpu_threads_does():
    """runner.free_cpu_threads: unset -> the cores less the 1-minute load average (at least
    1; None = all on an idle box); OMP_NUM_THREADS counts as chosen; several CPU devices
    split the cores (engine/serve/workers.py)."""
    from pathlib import Path

    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    root = typer.main.get_command(app)
    for name in ("run", "eval"):
        row = next(p.help for p in root.commands[name].params if p.name == "threads")
        path = name
        for words in ("1-minute load average", "at least 1", "OMP_NUM_THREADS", "split the cores"):
            assert words in row, (path, row)
        assert "torch's default" not in row
    section = readme[readme.index("**CPU threads**") :][:700]
    for words in ("1-minute load average", "`hisparse eval`", "split the cores", "OMP_NUM_THREADS"):
        assert words in section, section
