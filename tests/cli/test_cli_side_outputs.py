"""Fresh-user findings on the files ``replay`` writes: ``--json`` replaces no file without
``--force`` and never one of its traces; an output path that cannot be written is refused
before any work (exit 2, one line naming it, as ``hisparse run`` refuses its
``--output-dir``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from hisparse_cli.main import app

UNWRITABLE = "/proc/evx"  # os.access says yes to root there, yet no file can be made


def invoke(*args):
    return CliRunner().invoke(app, list(args))


def one_line_error(result, *words):
    """Exit 2, one ``error:`` line naming ``words``, no traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    text = " ".join(result.stderr.split())
    assert "Traceback" not in result.output and "Traceback" not in text
    for word in words:
        assert word in text, text


def write_trace(path: Path) -> Path:
    """A small selection trace (one job, one layer, 2 KV heads, 6 steps)."""
    import torch

    from engine.measure.trace import TraceHeader, TraceWriter
    from kernels.bitmask import pack_bits

    header = TraceHeader(
        model="m", page_size=16, top_k=64, top_k_pages=4, num_layers=1, num_kv_heads=2
    )
    writer = TraceWriter(path, header)
    for step, page in enumerate([0, 1, 2, 0, 3, 1]):
        mask = torch.zeros(1, 2, 8, dtype=torch.bool)
        mask[0, :, page] = True
        plan = SimpleNamespace(
            seq_ids=[0], num_pages=torch.tensor([8], dtype=torch.int32), step=step
        )
        writer(plan, 0, pack_bits(mask))
    writer.close()
    return path


# ------------------------------------------------------------------------------ replay


@pytest.fixture
def trace(tmp_path):
    return write_trace(tmp_path / "sel2.jsonl")


def test_replay_json_never_replaces_its_own_trace(tmp_path, trace):
    """Fresh-user finding: ``replay sel2.jsonl --json sel2.jsonl`` destroyed the trace."""
    before = trace.read_bytes()
    for extra in ([], ["--force"]):
        result = invoke("replay", str(trace), "--json", str(trace), *extra)
        one_line_error(result, f"--json {trace}", "is one of the traces replayed")
        assert "belady" not in result.stdout  # refused before anything was replayed
        assert trace.read_bytes() == before
    os.link(trace, tmp_path / "hard.jsonl")  # the same file by another name
    result = invoke("replay", str(trace), "--json", str(tmp_path / "hard.jsonl"), "--force")
    one_line_error(result, "is one of the traces replayed")
    assert trace.read_bytes() == before


def test_replay_json_refuses_an_existing_file_unless_force(tmp_path, trace):
    """Fresh-user finding: ``--json`` replaced any file (a run's ``results.jsonl``)."""
    results = tmp_path / "results.jsonl"
    results.write_text('{"job": "a"}\n')
    result = invoke("replay", str(trace), "--json", str(results))
    one_line_error(result, f"--json {results} already exists", "--force")
    assert "belady" not in result.stdout
    assert results.read_text() == '{"job": "a"}\n'
    result = invoke("replay", str(trace), "--json", str(results), "--force")
    assert result.exit_code == 0, result.output
    assert json.loads(results.read_text())["results"]
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_replay_json_refuses_a_folder_or_an_unwritable_place_before_replaying(tmp_path, trace):
    """Fresh-user finding: ``--json "dir with space"`` replayed, then an IsADirectoryError
    traceback."""
    folder = tmp_path / "dir with space"
    folder.mkdir()
    result = invoke("replay", str(trace), "--json", str(folder))
    one_line_error(result, f"--json {folder} is a directory")
    assert "belady" not in result.stdout
    result = invoke("replay", str(trace), "--json", str(tmp_path / "a\nb" / "r.json"))
    assert result.exit_code == 0, result.output  # missing folders are made
    assert (tmp_path / "a\nb" / "r.json").is_file()
    if os.path.isdir("/proc"):
        result = invoke("replay", str(trace), "--json", f"{UNWRITABLE}/r.json")
        one_line_error(result, f"--json {UNWRITABLE}/r.json", "not")
        assert "belady" not in result.stdout


def test_replay_json_names_are_escaped(tmp_path, trace):
    """A control character in the name is shown as an escape, not written raw."""
    name = tmp_path / "evil\x1b[2J.json"
    name.write_text("{}")
    result = invoke("replay", str(trace), "--json", str(name))
    one_line_error(result, "evil\\x1b[2J.json")
    assert "\x1b[2J" not in result.stderr
