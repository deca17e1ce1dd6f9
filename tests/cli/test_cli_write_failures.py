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


def fd_name(fd):
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}")).name
    except OSError:
        return ""


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


def test_a_results_line_that_cannot_be_written_stops_the_run(cli, docs, tmp_path, monkeypatch):
    """The file became unwritable after the checks: one error line naming it (no
    traceback), exit 1, the job not counted ok, and no ``alpha.txt`` left that the next
    run would refuse to overwrite."""
    refuse_opening(monkeypatch, "results.jsonl")
    result = cli("docs/alpha.txt", "docs/beta.txt", "--threads", "1", "--json-progress")
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    events = [json.loads(line) for line in result.stdout.splitlines()]
    failed = [e for e in events if e["event"] == "job_failed"]
    assert [e["job_id"] for e in failed] == ["alpha"] and not any(
        e["event"] == "job_finished" for e in events
    )
    error = failed[0]["error"]
    assert error == (
        "the run stopped: cannot write hisparse-out/results.jsonl (Permission denied); "
        "hisparse-out/alpha.txt, written just before, was removed: no results.jsonl line "
        "records it"
    )
    summary = events[-1]
    assert summary["event"] == "summary" and summary["ok"] == 0 and summary["failed"] == 1
    out = tmp_path / "hisparse-out"
    assert not (out / "alpha.txt").exists() and not (out / "beta.txt").exists()
    monkeypatch.undo()  # writable again: the next run does every job
    monkeypatch.chdir(tmp_path)
    again = cli("docs/alpha.txt", "docs/beta.txt", "--threads", "1")
    assert again.exit_code == 0, again.output
    assert {r["id"] for r in read_results(out) if r["ok"]} == {"alpha", "beta"}


def test_a_full_disk_at_config_json_is_one_clean_error(cli, docs, tmp_path, monkeypatch):
    """ENOSPC writing ``config.json`` (the first write once the model loaded) gave two
    chained tracebacks: now one error naming the file and the full disk, exit 1, and no
    temporary file left."""
    real_fsync = os.fsync

    def full(fd):
        if fd_name(fd).startswith(".config.json"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    result = cli("docs/alpha.txt", "docs/beta.txt")
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    err = " ".join(result.stderr.split())
    assert (
        "error: the run stopped: cannot write hisparse-out/config.json (No space left on "
        "device: the disk is full); free space on that disk (or choose an --output-dir on "
        "another disk) and run again: jobs already recorded in results.jsonl are skipped"
    ) in err, err
    out = tmp_path / "hisparse-out"
    assert not out.exists()  # it held only its lock file: removed, as on a failed load
    assert "(removed: nothing written)" in result.stdout


def test_a_full_disk_mid_line_keeps_results_whole(cli, docs, tmp_path, monkeypatch):
    """ENOSPC part-way through a ``results.jsonl`` line: the earlier lines stay as they
    were (the cut line's bytes are taken back), the job's text file is removed (no line
    records it), exit 1; the next run redoes only that job."""
    out = tmp_path / "hisparse-out"
    assert cli("docs/alpha.txt").exit_code == 0
    before = (out / "results.jsonl").read_bytes()
    real_write = os.write

    def full(fd, data):
        if fd_name(fd) == "results.jsonl":
            real_write(fd, bytes(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    result = cli("docs/alpha.txt", "docs/beta.txt")
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    err = " ".join(result.stderr.split())
    assert (
        "FAILED beta: the run stopped: cannot write hisparse-out/results.jsonl (No space left "
        "on device: the disk is full); hisparse-out/beta.txt, written just before, was "
        "removed: no results.jsonl line records it; free space on that disk"
    ) in err, err
    assert (out / "results.jsonl").read_bytes() == before
    assert not (out / "beta.txt").exists() and (out / "alpha.txt").is_file()
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    again = cli("docs/alpha.txt", "docs/beta.txt")
    assert again.exit_code == 0, again.output
    assert [r["id"] for r in read_results(out)] == ["alpha", "beta"]


def test_an_output_results_jsonl_does_not_record_is_refused_truthfully(cli, docs, tmp_path):
    """``rm o/results.jsonl`` after a run: ``--force`` still refuses to replace the text
    files (nothing shows hisparse wrote them), but the message no longer claims hisparse
    did not write them, and says how to go on."""
    assert cli("docs/alpha.txt", "-o", "o").exit_code == 0
    (tmp_path / "o" / "results.jsonl").unlink()
    before = (tmp_path / "o" / "alpha.txt").read_text()
    result = cli("docs/alpha.txt", "-o", "o", "--force")
    assert result.exit_code == 1, result.output
    error = " ".join(read_results(tmp_path / "o")[0]["error"].split())
    assert "hisparse did not write it" not in error
    assert (
        "no o/results.jsonl records it as hisparse's (there is none: never written here, or deleted)"
        in error
    ), error
    assert "(--force does not change that): delete or move it" in error
    assert (tmp_path / "o" / "alpha.txt").read_text() == before
