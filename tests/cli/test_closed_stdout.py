"""A closed stdout (``hisparse run docs/*.txt | head -1``) ends the output, not the run.

A new user's trial: once the reader of stdout exited, the next progress line raised
``BrokenPipeError``: the run stopped (exit 1) with no results, or printed a traceback and
"the engine stopped with an error". Every reporter now drops its writes once the pipe is
closed, says so once on stderr, and the batch carries on to its results.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from rich.console import Console

from engine.events import JobFailed, JobFinished, JobQueued, JobResult
from hisparse_cli.dashboard import LiveDashboard
from hisparse_cli.pipes import PipeGuard, guard
from hisparse_cli.progress import ProgressTracker, summarize
from hisparse_cli.reporters import JsonReporter, PlainReporter

ROOT = Path(__file__).resolve().parents[2]
NOTICE = "stdout was closed"


class ClosingStream(io.StringIO):
    """A pipe whose reader exits after ``keep`` writes: later writes and flushes raise
    ``BrokenPipeError``, as ``sys.stdout`` does then."""

    def __init__(self, keep: int = 1) -> None:
        super().__init__()
        self.keep = keep

    def write(self, text: str) -> int:
        if self.keep <= 0:
            raise BrokenPipeError(32, "Broken pipe")
        self.keep -= 1
        return super().write(text)

    def flush(self) -> None:
        if self.keep <= 0:
            raise BrokenPipeError(32, "Broken pipe")


def _drive(reporter, tracker: ProgressTracker) -> None:
    """Everything a run tells a reporter, after the pipe closed: notes, skips, lifecycle
    events, a finished and a failed job, the summary."""
    result = JobResult("a", "text", (1, 2, 3), 5, "length", 0.1, 10.0, 3.0)
    with reporter:
        reporter.note("loading model fake (2 job(s) to run; preset cpu)")
        reporter.note("model loaded in 0.1s")
        reporter.skipped(["old"])
        for event in (JobQueued(0.0, "a", 5), JobFinished(1.0, result), JobFailed(1.0, "b", "bad")):
            tracker.update(event)
            reporter.on_event(event)
        reporter.note("a warning after the close", "warning")
    reporter.summary(summarize(tracker.state, 2.0, "out"))


def test_plain_reporter_carries_on_after_stdout_closes():
    tracker, out, err = ProgressTracker(0.0), ClosingStream(keep=1), io.StringIO()
    _drive(PlainReporter(out, tracker, interval_s=1e9, clock=lambda: 0.0, err_stream=err), tracker)
    assert out.getvalue() == "loading model fake (2 job(s) to run; preset cpu)\n"
    lines = err.getvalue().splitlines()
    assert sum(NOTICE in line for line in lines) == 1, lines  # said once
    assert "FAILED b: bad" in lines and "warning: a warning after the close" in lines


def test_json_reporter_carries_on_after_stdout_closes(capsys):
    tracker, out = ProgressTracker(0.0), ClosingStream(keep=1)
    _drive(JsonReporter(out, tracker, interval_s=1e9, clock=lambda: 0.0), tracker)
    assert [json.loads(line)["event"] for line in out.getvalue().splitlines()] == ["info"]
    assert capsys.readouterr().err.count(NOTICE) == 1  # on stderr, once


def test_live_dashboard_carries_on_after_stdout_closes():
    """Rich itself exits (``SystemExit(1)``) on a broken pipe; the dashboard must not."""
    tracker, out, err = ProgressTracker(0.0), ClosingStream(keep=1), io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, height=30, color_system=None)
    err_console = Console(file=err, width=100)
    clock = iter(range(1000)).__next__
    _drive(LiveDashboard(console, tracker, clock=clock, err_console=err_console), tracker)
    assert err.getvalue().count(NOTICE) == 1
    assert "b: bad" in err.getvalue()  # the failure still reaches stderr


def test_a_closed_stderr_is_dropped_too():
    """``hisparse run ... 2>&1 | head``: both streams close; nothing raises."""
    tracker, out, err = ProgressTracker(0.0), ClosingStream(keep=0), ClosingStream(keep=0)
    _drive(PlainReporter(out, tracker, interval_s=1e9, clock=lambda: 0.0, err_stream=err), tracker)


def test_guard_points_a_closed_pipe_at_devnull():
    """The file descriptor of a closed pipe is pointed at ``os.devnull``: what Python still
    buffers for it (flushed at exit) goes nowhere, no "Exception ignored ... BrokenPipeError"."""
    read_fd, write_fd = os.pipe()
    os.close(read_fd)  # the reader exited
    stream = os.fdopen(write_fd, "w", encoding="utf-8")
    try:
        err = io.StringIO()
        guarded = guard(stream, "stdout was closed", err)
        assert isinstance(guarded, PipeGuard) and guard(guarded) is guarded
        guarded.write("a line\n")
        guarded.flush()  # raises nothing
        guarded.write("more\n")
        assert guarded.closed_pipe and err.getvalue() == "stdout was closed\n"
        assert os.path.samestat(os.fstat(write_fd), os.stat(os.devnull))
        stream.write("what Python still holds\n")
        stream.flush()  # as at exit: to os.devnull now
    finally:
        stream.close()


# A `hisparse run` process with the scripted fake engine (as the `cli` fixture sets up):
# its engine waits at the first decode step until the reader of stdout has gone (or a
# write found it gone), so what follows (the finish lines, the summary) meets a closed pipe.
DRIVER = textwrap.dedent(
    """
    import os, select, sys, time
    from hisparse_cli import runner, settings, testing
    from hisparse_cli.main import app

    def reader_gone(step):  # or a write found it gone already: stdout is os.devnull then
        if step == 0:
            poll, devnull = select.poll(), os.stat(os.devnull)
            poll.register(1, select.POLLERR)  # a pipe without a reader reports POLLERR
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not os.path.samestat(os.fstat(1), devnull):
                if poll.poll(50):
                    return

    def no_tokenizer(config, model):
        raise RuntimeError("no tokenizer before the load")

    settings.preset_overrides = lambda name: {}
    runner.cuda_device_count = lambda: 0
    runner.cuda_device_memory_gib = lambda index: 24.0
    runner.warm_cuda = lambda config, marks: None
    runner.import_engine_modules = lambda: None
    runner.free_cpu_threads = lambda config: None
    runner.load_tokenizer = no_tokenizer
    runner.load_engine = testing.fake_engine_factory(
        on_step=reader_gone, fail={"gamma": "bad input"} if "--fail" in sys.argv else {}
    )
    app(["run", *(a for a in sys.argv[1:] if a != "--fail")])
    """
)


@pytest.mark.parametrize(
    ("flags", "env", "code"),
    [
        ((), {}, 0),
        (("--json-progress",), {}, 0),
        ((), {"FORCE_COLOR": "1"}, 0),  # the Rich dashboard, into a pipe
        (("--fail",), {}, 1),  # a job failed: the exit code is still the batch's
    ],
    ids=["plain", "json", "dashboard", "a-job-fails"],
)
def test_run_piped_into_a_reader_that_exits_early_finishes_the_batch(tmp_path, flags, env, code):
    """``hisparse run ... | head -1``: every job runs and is recorded, no traceback or
    "Exception ignored" on stderr, a note that stdout was closed, the batch's exit code."""
    ids = ["alpha", "beta", "gamma"]
    for name in ids:
        (tmp_path / f"{name}.txt").write_text(f"The {name} document talks about sorting.\n")
    args = [sys.executable, "-c", DRIVER, *[f"{n}.txt" for n in ids], "--max-new-tokens", "3"]
    environment = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HISPARSE_HOST_MEMORY_GB": "256",
        "OMP_NUM_THREADS": "1",
        **env,
    }
    environment.pop("COLUMNS", None)
    proc = subprocess.Popen(
        [*args, *flags], cwd=tmp_path, env=environment, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        first = proc.stdout.readline()  # like `head -1`: one line, then exit
        proc.stdout.close()
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    stderr = err.decode()
    assert first, stderr
    assert proc.returncode == code, stderr
    for bad in ("Traceback", "Exception ignored", "BrokenPipeError", "Broken pipe"):
        assert bad not in stderr, stderr
    assert stderr.count(NOTICE) == 1, stderr
    records = [
        json.loads(line)
        for line in (tmp_path / "hisparse-out" / "results.jsonl").read_text().splitlines()
    ]
    assert sorted(r["id"] for r in records) == ids
    assert {r["id"] for r in records if r["ok"]} == ({"alpha", "beta"} if code else set(ids))
    for record in records:
        if record["ok"]:
            assert (tmp_path / "hisparse-out" / record["output"]).is_file()


def test_guard_std_streams_drops_a_closed_stdout_and_says_so_once(monkeypatch):
    import sys

    from hisparse_cli.pipes import guard_std_streams

    out, err = ClosingStream(keep=0), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr("hisparse_cli.pipes._to_devnull", lambda stream: None)  # no real fd
    guard_std_streams("stdout closed; results: X")
    print("a table row")
    print("another")
    sys.stdout.flush()
    guard_std_streams("a second guard changes nothing")
    print("more")
    assert err.getvalue().count("stdout closed; results: X") == 1
    assert "second guard" not in err.getvalue()


@pytest.mark.parametrize(
    "command,module",
    [
        (["eval", "--lengths", "bogus"], "hisparse_cli.eval_cmd"),
        (["bench", "--memory-budget", "1", "--concurrency", "0"], "hisparse_cli.bench_cmd"),
    ],
    ids=["eval", "bench"],
)
def test_eval_and_bench_guard_their_output_first(monkeypatch, tmp_path, command, module):
    """``hisparse eval`` / ``bench`` print through ``typer.echo`` and consoles made without
    a file: each guards ``sys.stdout`` itself before anything else (here, before refusing
    a bad argument), naming where its results go."""
    from typer.testing import CliRunner

    from hisparse_cli.main import app

    calls = []
    monkeypatch.setattr(f"{module}.guard_std_streams", lambda notice: calls.append(notice))
    result = CliRunner().invoke(
        app, [*command, "-o" if command[0] == "eval" else "--out", str(tmp_path)]
    )
    assert result.exit_code == 2, result.output
    assert len(calls) == 1 and str(tmp_path) in calls[0]


def test_plan_piped_into_a_reader_that_exits_early_ends_quietly(tmp_path):
    """Fresh-user finding: ``hisparse plan ... | head -1`` and ``presets show cpu | head
    -1`` exited 1. Every command's stdout is guarded by the app (quietly: no notice)."""
    import subprocess
    import sys

    for args in (["plan", "--jobs", "1", "--context", "8K"], ["presets", "show", "cpu"]):
        proc = subprocess.Popen(
            [sys.executable, "-m", "hisparse_cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        )
        proc.stdout.close()  # the reader exits before the first line
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 0, err
        assert "Traceback" not in err and "Broken pipe" not in err
        assert "stdout was closed" not in err  # quietly, as other tools end
