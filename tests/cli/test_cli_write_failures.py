"""Fresh-user findings: a ``results.jsonl`` that cannot be written, a full disk, and a
result file that ``results.jsonl`` does not record. As root, permission bits do not stop
a write, so the refusals are simulated by patching ``os.open``/``os.write``/``os.fsync``
(as ``test_cli_run.py`` does for an unwritable output folder)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path


def read_results(folder):
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def refuse_opening(monkeypatch, name, error=errno.EACCES):
    """``os.open`` of a file called ``name`` for writing raises ``error``."""
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):
        if Path(path).name == name and flags & (os.O_WRONLY | os.O_RDWR):
            raise OSError(error, os.strerror(error), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)


def test_an_unwritable_results_file_is_refused_before_loading(cli, docs, tmp_path, monkeypatch):
    """``chmod 444 o/results.jsonl``: the job ran, its text was written, the line was not
    (a traceback), yet the summary said ok 1, exit 0. The start-up checks refuse it."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "results.jsonl").write_text("")
    refuse_opening(monkeypatch, "results.jsonl")
    result = cli("docs/alpha.txt", "-o", "o")
    assert result.exit_code == 2, result.output
    err = " ".join(result.stderr.split())
    assert "o/results.jsonl cannot be opened for reading and writing (Permission denied)" in err, (
        err
    )
    assert "Traceback" not in result.output
    assert cli.factory.engines == [] and not (out / "alpha.txt").exists()
    printed = cli("docs/alpha.txt", "-o", "o", "--print-config")
    assert printed.exit_code == 0, printed.output
    problems = [" ".join(p.split()) for p in json.loads(printed.stdout)["problems"]]
    assert len(problems) == 1 and "o/results.jsonl cannot be opened" in problems[0]
