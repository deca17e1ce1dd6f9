"""Progress state, the Rich dashboard, plain log lines and JSON lines."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from engine.events import (
    CacheStats,
    DecodeStep,
    FirstToken,
    JobAdmitted,
    JobFailed,
    JobFinished,
    JobQueued,
    JobResult,
    MemorySnapshot,
    PrefillProgress,
)
from hisparse_cli.dashboard import (
    LiveDashboard,
    render_dashboard,
    render_jobs,
    render_memory,
    render_summary,
)
from hisparse_cli.progress import (
    ProgressTracker,
    decode_tok_s_recent,
    decode_tok_s_run,
    h2d_gbps_recent,
    hit_rate,
    job_eta_s,
    prefill_tok_s_recent,
    summarize,
)
from hisparse_cli.reporters import JsonReporter, PlainReporter, finish_line, progress_line

GiB = 2**30


def render(renderable, width=140):
    console = Console(record=True, width=width, force_terminal=False, color_system=None)
    console.print(renderable)
    return console.export_text()


def scripted_tracker():
    """Two jobs: 'alpha' decoding, 'beta' failed; one memory snapshot; t in seconds."""
    tracker = ProgressTracker(started_t=100.0)
    events = [
        JobQueued(100.0, "alpha", 1000),
        JobQueued(100.0, "beta", 300),
        JobAdmitted(100.5, "alpha", 1000),
        PrefillProgress(101.0, "alpha", 1, 4, 250),
        PrefillProgress(102.0, "alpha", 4, 4, 1000),
        FirstToken(102.5, "alpha", 2.0),
        JobFailed(102.6, "beta", "prompt of 300000 tokens is too long"),
        MemorySnapshot(
            103.0, "cuda:0", 4 * GiB, 2 * GiB, GiB // 2, GiB // 2, 10 * GiB, 3 * GiB, 16 * GiB
        ),
    ]
    events += [
        DecodeStep(
            103.0 + 0.5 * i,
            i,
            1,
            0.5,
            {"alpha": 1 + i},
            {"alpha": 101},
            hits=9,
            misses=1,
            h2d_bytes=10**9,
        )
        for i in range(1, 11)
    ]
    for event in events:
        tracker.update(event)
    return tracker


def test_tracker_rates():
    state = scripted_tracker().state
    now = 108.0
    assert state.jobs["alpha"].generated == 11 and state.jobs["alpha"].phase == "decode"
    assert state.jobs["beta"].phase == "failed"
    # steps at 103.5 .. 108.0: the last 5 s hold 10 steps of 1 token each
    assert decode_tok_s_recent(state, now) == pytest.approx(10 / 5)
    assert decode_tok_s_run(state, now) == pytest.approx(10 / 5.0)
    assert state.prefill_tokens == pytest.approx(1000)
    assert hit_rate(state) == pytest.approx(0.9)
    assert h2d_gbps_recent(state, now) == pytest.approx(2.0)
    # alpha's own pace: 10 tokens since its first token at 102.5 -> 90 left take 49.5 s
    assert job_eta_s(state.jobs["alpha"], now) == pytest.approx(90 / (10 / 5.5))


def test_run_decode_rate_counts_decode_steps_not_prefills_between_them():
    """A long prefill between two decode steps does not dilute the run's decode rate."""
    tracker = scripted_tracker()
    tracker.update(PrefillProgress(109.0, "alpha", 5, 10, 500))  # then 30 s of prefill
    tracker.update(DecodeStep(139.0, 11, 1, 0.5, {"alpha": 12}, {"alpha": 101}))
    assert decode_tok_s_run(tracker.state, 139.0) == pytest.approx(11 / 5.5)


def test_prefill_rate_uses_share_of_prompt():
    tracker = ProgressTracker(started_t=0.0)
    tracker.update(JobAdmitted(0.0, "a", 1000))
    tracker.update(PrefillProgress(1.0, "a", 1, 4, 0))
    tracker.update(PrefillProgress(2.0, "a", 3, 4, 0))
    assert tracker.state.jobs["a"].prefill_fraction == 0.75
    assert prefill_tok_s_recent(tracker.state, 2.0) == pytest.approx(750 / 2.0)
    assert prefill_tok_s_recent(tracker.state, 6.5) == pytest.approx(
        500 / 5.0
    )  # t=1 left the window
    assert prefill_tok_s_recent(tracker.state, 7.5) == 0.0


def test_dashboard_shows_memory_throughput_and_jobs():
    text = render(render_dashboard(scripted_tracker().state, now=108.0))
    assert "cuda:0" in text
    for figure in (
        "4.00 GiB",
        "2.00 GiB",
        "512.0 MiB",
        "3.00 GiB",
    ):  # weights, hot KV, meta/act, free
        assert figure in text
    assert "host pool" in text and "16.00 GiB" in text
    assert "2.0 tok/s" in text  # decode over the last 5 s
    assert "90.0%" in text  # cache hit rate
    assert "2.00 GB/s" in text  # host -> device
    assert "alpha" in text and "decode" in text and "11/101" in text
    assert "beta" in text and "failed" in text and "too long" in text
    assert "2.00s" in text  # TTFT of alpha
    assert "1.8" in text and "50s" in text  # tok/s and ETA of alpha


def test_memory_columns_are_labelled():
    text = render(render_memory(scripted_tracker().state))
    for label in ("weights", "hot KV", "indexer meta", "activations", "free"):
        assert label in text


def memory_cells(table) -> dict[str, dict[str, str]]:
    """Render ``table`` into a string and map row label -> header -> cell text."""
    file = io.StringIO()
    Console(file=file, width=160, force_terminal=False, color_system=None).print(table)
    lines = file.getvalue().splitlines()
    header = next(line for line in lines if line.startswith("┃"))
    names = [cell.strip() for cell in header.strip("┃").split("┃")]
    rows = [line.strip("│").split("│") for line in lines if line.startswith("│")]
    return {c[0].strip(): dict(zip(names, (x.strip() for x in c), strict=True)) for c in rows}


def test_memory_values_sit_under_their_headers():
    cells = memory_cells(render_memory(scripted_tracker().state))
    device, pool = cells["cuda:0"], cells["host pool"]
    assert (device["weights"], device["hot KV"]) == ("4.00 GiB", "2.00 GiB")
    assert (device["indexer meta"], device["activations"]) == ("512.0 MiB", "512.0 MiB")
    assert (device["used"], device["free"]) == ("7.00 GiB", "3.00 GiB")
    assert device["total"] == "10.00 GiB"
    assert [pool[k] for k in ("weights", "hot KV", "indexer meta", "activations")] == [""] * 4
    assert (pool["used"], pool["free"], pool["total"]) == ("3.00 GiB", "13.00 GiB", "16.00 GiB")
    assert pool["use"].startswith("████░")


def test_job_table_caps_rows_and_says_how_many_are_hidden():
    tracker = ProgressTracker(0.0)
    for i in range(30):
        tracker.update(JobQueued(0.0, f"job-{i:02d}", 10))
    tracker.update(JobAdmitted(1.0, "job-29", 10))
    text = render(render_jobs(tracker.state, 2.0, max_rows=5))
    assert "job-29" in text  # running jobs come first
    assert "25 more job(s)" in text
    assert "job-10" not in text


def test_summary_table():
    tracker = scripted_tracker()
    tracker.add_job("gamma", "skipped")
    summary = summarize(tracker.state, 108.0, "out-dir")
    assert (summary.ok, summary.failed, summary.skipped, summary.not_run) == (0, 1, 1, 1)
    text = render(render_summary(summary))
    assert "out-dir" in text and "skipped" in text and "8.00s" in text


def test_live_dashboard_uses_one_live_and_prints_finish_lines():
    tracker = scripted_tracker()
    console = Console(record=True, width=140, force_terminal=True, color_system=None)
    clock = iter(range(200, 1000)).__next__
    result = JobResult("alpha", "x", (1,) * 11, 1000, "stop", 2.0, 500.0, 2.0, CacheStats())
    with LiveDashboard(console, tracker, clock=clock) as live:
        event = JobFinished(109.0, result)
        tracker.update(event)
        live.on_event(event)
    text = console.export_text()
    assert "✓ alpha: 11 tokens (stop)" in text
    assert "jobs" in text


def test_plain_progress_lines_end_with_newline_and_are_periodic():
    tracker = ProgressTracker(0.0)
    stream, now = io.StringIO(), [0.0]
    reporter = PlainReporter(stream, tracker, interval_s=10.0, clock=lambda: now[0])
    for t in range(25):
        now[0] = float(t)
        event = DecodeStep(float(t), t, 1, 0.1, {"a": t + 1}, {"a": 100})
        tracker.update(event)
        reporter.on_event(event)
    lines = stream.getvalue().splitlines(keepends=True)
    assert len(lines) == 2  # at t=10 and t=20
    assert all(line.endswith("\n") and "\r" not in line and "\x1b" not in line for line in lines)
    assert lines[0].startswith("[   10s] jobs 0/1 ended")


def test_plain_line_per_finish_and_failure():
    tracker = ProgressTracker(0.0)
    stream, err = io.StringIO(), io.StringIO()
    reporter = PlainReporter(stream, tracker, interval_s=1e9, clock=lambda: 0.0, err_stream=err)
    result = JobResult("a", "t", (1, 2), 7, "length", 0.25, 1.0, 3.0)
    for event in (JobFinished(1.0, result), JobFailed(1.0, "b", "bad input")):
        tracker.update(event)
        reporter.on_event(event)
    assert stream.getvalue() == "done a: 7 tokens in, 2 out (length), TTFT 0.25s, 3.0 tok/s\n"
    assert err.getvalue() == "FAILED b: bad input\n"  # a failure is an error: stderr


def test_progress_line_mentions_all_figures():
    line = progress_line(scripted_tracker().state, 108.0)
    for part in (
        "jobs 1/2 ended",
        "decode 2.0 tok/s",
        "cache hit 90.0%",
        "h2d 2.00 GB/s",
        "cuda:0",
    ):
        assert part in line
    assert finish_line(scripted_tracker().state.jobs["beta"]).startswith("FAILED beta")


def test_json_progress_one_object_per_line():
    tracker = ProgressTracker(0.0)
    stream, now = io.StringIO(), [0.0]
    reporter = JsonReporter(stream, tracker, interval_s=2.0, clock=lambda: now[0])
    result = JobResult("a", "text", (1, 2, 3), 5, "stop")
    events = [JobQueued(0.0, "a", 5), JobAdmitted(0.1, "a", 5)]
    events += [DecodeStep(0.5 * i, i, 1, 0.5, {"a": i}, {"a": 3}) for i in range(1, 7)]
    events += [JobFinished(3.1, result)]
    with reporter:
        for event in events:
            now[0] = event.t
            tracker.update(event)
            reporter.on_event(event)
    reporter.summary(summarize(tracker.state, 3.2, "out"))
    objects = [json.loads(line) for line in stream.getvalue().splitlines()]
    kinds = [o["event"] for o in objects]
    # decode steps are folded into progress objects: one at t=2, one flushed at the end
    assert kinds == [
        "job_queued",
        "job_admitted",
        "progress",
        "job_finished",
        "progress",
        "summary",
    ]
    finished = objects[3]
    assert finished["generated_tokens"] == 3 and "token_ids" not in finished
    assert objects[2]["jobs"]["decode"] == 1
    assert objects[-1]["ok"] == 1


NAMED = "/d/evil\nFAILED other: fake.txt\x1b[31m\r\x9b2J\u202etxt.exe"
"""A file name with a newline (a forged log line), an escape sequence, a carriage return,
the one-character CSI and a right-to-left override, as a failure names it."""
SHOWN = "/d/evil\\nFAILED other: fake.txt\\x1b[31m\\r\\x9b2J\\u202etxt.exe"


def test_display_escapes_control_characters_and_keeps_other_text():
    from hisparse_cli.display import escaped, terminal_text

    assert escaped(NAMED) == SHOWN
    assert escaped("naïve ☃ [bold] \\n tab\there") == "naïve ☃ [bold] \\n tab\\there"
    assert escaped(escaped(NAMED)) == SHOWN  # escaping an escaped message changes nothing
    assert terminal_text(f"one {NAMED}\ntwo") == f"one {SHOWN.replace(chr(92) + 'n', chr(10))}\ntwo"
    assert terminal_text("a\x1b[2Jb\nc\x07") == "a\\x1b[2Jb\nc\\x07"


def test_plain_and_live_output_show_a_names_control_characters_escaped():
    """Fresh-user finding: files named ``evil\\nFAILED other: fake.txt`` and
    ``esc\\x1b[31mred.txt`` printed raw forged a ``FAILED`` line on stderr and drove the
    terminal. A job's line stays one line, every message's escape sequences are shown
    escaped, and a name's Rich markup stays text (the summary's output folder)."""
    tracker = ProgressTracker(0.0)
    stream, err = io.StringIO(), io.StringIO()
    reporter = PlainReporter(stream, tracker, interval_s=1e9, clock=lambda: 0.0, err_stream=err)
    failed = JobFailed(1.0, "evil", f"{NAMED}: is empty or only whitespace")
    tracker.update(failed)
    reporter.on_event(failed)
    reporter.note("esc\x1b[31m\r.txt: read as text\nsecond line", "warning")
    assert err.getvalue().splitlines() == [
        f"FAILED evil: {SHOWN}: is empty or only whitespace",
        "warning: esc\\x1b[31m\\r.txt: read as text",  # names in messages come escaped
        "second line",  # (textio.shown_path); a message's own lines stay lines
    ]
    summary = summarize(tracker.state, 2.0, "[bold]out\x1b[2J")
    reporter.summary(summary)
    assert "[bold]out\\x1b[2J" in stream.getvalue() and "\x1b" not in stream.getvalue()
    console = Console(record=True, width=300, force_terminal=True, color_system=None)
    err_console = Console(record=True, width=300, force_terminal=True, color_system=None)
    with LiveDashboard(console, tracker, clock=lambda: 2.0, err_console=err_console) as live:
        live.on_event(failed)
        live.note("esc\x1b[31m\x9b.txt: noted", "warning")
        live.summary(summary)
    text, errors = console.export_text(), err_console.export_text()
    assert f"✗ evil: {SHOWN}: is empty" in errors and "esc\\x1b[31m\\x9b.txt: noted" in errors
    assert "\x1b" not in text + errors and "\x9b" not in text + errors
    assert "[bold]out\\x1b[2J" in text  # not a bold "out": the name as it is
    assert "evil\\nFAILED" in text  # the job table's error cell


def test_finish_line_of_a_failure_is_one_line():
    row_error = "x\ny"
    tracker = ProgressTracker(0.0)
    tracker.update(JobFailed(0.0, "a", row_error))
    assert finish_line(tracker.state.jobs["a"]) == "FAILED a: x\\ny"
