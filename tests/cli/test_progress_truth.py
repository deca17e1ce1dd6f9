"""Progress that tells the truth (issue #21): a live prefill rate and per-job prefill share,
steady lines without a terminal, the last frame equal to the summary, ``-`` for figures not
known yet, diagnostics on stderr, wall-clock times in JSON progress; and the dashboard at
80 x 24."""

from __future__ import annotations

import io
import json
import re
import time
from datetime import datetime, timedelta

import pytest
from rich.console import Console

from engine.events import (
    DecodeStep,
    FirstToken,
    JobAdmitted,
    JobFinished,
    JobQueued,
    JobResult,
    MemorySnapshot,
    PrefillProgress,
)
from hisparse_cli.dashboard import (
    LiveDashboard,
    fmt_rate,
    fmt_seconds,
    render_dashboard,
    render_summary,
    short_ids,
)
from hisparse_cli.progress import (
    ProgressTracker,
    prefill_tok_s_live,
    prefill_tok_s_recent,
    summarize,
)
from hisparse_cli.reporters import JsonReporter, PlainReporter, progress_json, progress_line

GiB = 2**30


def feed(tracker, *events):
    for event in events:
        tracker.update(event)
    return tracker


def test_live_prefill_rate_counts_a_long_prefill_between_sparse_events():
    tracker = feed(ProgressTracker(0.0), JobQueued(0.0, "a", 4000))
    assert prefill_tok_s_live(tracker.state, 1.0) is None  # nothing prefilled yet: unknown
    feed(tracker, JobAdmitted(0.0, "a", 4000), PrefillProgress(30.0, "a", 1, 4, 4000))
    # 1000 tokens in the 30 s since admission; at 36 s no event lies in the 5 s window,
    # yet the prefill still runs: the rate counts the 6 s since, it does not read 0
    assert prefill_tok_s_recent(tracker.state, 36.0) == 0.0
    assert prefill_tok_s_live(tracker.state, 36.0) == pytest.approx(1000 / 36)
    feed(tracker, PrefillProgress(40.0, "a", 2, 4, 4000))
    assert prefill_tok_s_live(tracker.state, 41.0) == pytest.approx(1000 / (41 - 30))
    line = progress_line(tracker.state, 41.0)
    assert "prefilling a 50%" in line and "prefill 90.9 tok/s" in line
    assert progress_json(tracker.state, 41.0)["prefill"] == {"a": 0.5}
    feed(tracker, PrefillProgress(50.0, "a", 4, 4, 4000), FirstToken(50.0, "a", 50.0))
    assert prefill_tok_s_live(tracker.state, 60.0) is None  # none running: not known


def test_the_live_prefill_rate_is_unknown_once_no_prefill_runs():
    """Fresh-user finding: after the prefill had ended, the dashboard's last frame read
    ``prefill (now) 51.0 tok/s``, JSON progress objects after the first token gave the
    prefill's last seconds' pace (153.6, then 134.7 tok/s) and the plain line ``prefill
    0.0 tok/s``. With no job prefilling the rate is not known now: ``-`` / ``null``."""
    tracker = feed(
        ProgressTracker(0.0),
        JobAdmitted(0.0, "a", 4000),
        PrefillProgress(1.0, "a", 1, 2, 4000),
    )
    assert prefill_tok_s_live(tracker.state, 1.5) == pytest.approx(2000 / 1.5)  # running
    feed(tracker, PrefillProgress(2.0, "a", 2, 2, 4000), FirstToken(2.0, "a", 2.0))
    for now in (2.5, 4.0, 30.0):  # the prefill's samples still in the window, then not
        assert prefill_tok_s_live(tracker.state, now) is None
        assert progress_json(tracker.state, now)["prefill_tok_s"] is None
        assert "prefill -" in progress_line(tracker.state, now)
    tracker.finish(3.0)
    assert re.search(r"prefill \(now\)\s+-", render(render_dashboard(tracker.state, 9.0), 120))


def test_values_not_known_yet_read_a_dash():
    tracker = feed(ProgressTracker(0.0), JobQueued(0.0, "a", 100))
    line = progress_line(tracker.state, 2.0)
    assert "decode - (5 s), - run" in line and "prefill -" in line
    assert "cache hit -" in line and "h2d -" in line
    obj = progress_json(tracker.state, 2.0)
    assert obj["decode_tok_s"] is None and obj["prefill_tok_s"] is None
    assert obj["h2d_gbps"] is None and obj["hit_rate"] is None
    text = render(render_dashboard(tracker.state, 2.0), 120)
    assert "0.0 tok/s" not in text and "- " in text
    summary = summarize(tracker.state, 2.0, "out")
    assert summary.decode_tok_s is None
    assert "(- decode)" in render(render_summary(summary), 80)


def test_plain_lines_come_at_a_steady_interval_without_events():
    tracker = feed(ProgressTracker(time.monotonic()), JobQueued(0.0, "a", 100))
    stream = io.StringIO()
    with PlainReporter(stream, tracker, interval_s=0.05):
        time.sleep(0.4)  # no event at all (a long prefill, a model load)
    lines = stream.getvalue().splitlines()
    assert len(lines) >= 3 and all("jobs 0/1 ended" in line for line in lines)


def test_json_progress_is_steady_and_every_object_has_a_wall_clock_time():
    tracker = feed(ProgressTracker(time.monotonic()), JobAdmitted(0.0, "a", 100))
    stream = io.StringIO()
    before = datetime.now().astimezone()
    with JsonReporter(stream, tracker, interval_s=0.05) as reporter:
        time.sleep(0.3)  # a prefill without events still gets its progress objects
        reporter.note("careful", "warning")
    objects = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [o["event"] for o in objects].count("progress") >= 2
    for obj in objects:
        stamp = datetime.fromisoformat(obj["time"])
        assert stamp.utcoffset() == timedelta(0)  # UTC, ISO 8601
        assert before - timedelta(seconds=1) <= stamp <= datetime.now().astimezone() + timedelta(seconds=1)


def test_warnings_and_errors_go_to_stderr_info_to_stdout():
    out, err = io.StringIO(), io.StringIO()
    reporter = PlainReporter(out, ProgressTracker(0.0), interval_s=1e9, clock=lambda: 0.0, err_stream=err)
    reporter.note("loading model m")
    reporter.note("document cut", "warning")
    reporter.note("cannot load", "error")
    assert out.getvalue() == "loading model m\n"
    assert err.getvalue() == "warning: document cut\nerror: cannot load\n"
    console = Console(file=io.StringIO(), force_terminal=True, width=80)
    err_console = Console(file=io.StringIO(), width=80)
    with LiveDashboard(console, ProgressTracker(0.0), clock=lambda: 0.0, err_console=err_console) as live:
        live.note("a warning", "warning")
    assert "a warning" in err_console.file.getvalue() and "a warning" not in console.file.getvalue()


def finished_run():
    tracker = ProgressTracker(0.0)
    feed(
        tracker,
        JobQueued(0.0, "a", 40),
        JobAdmitted(0.5, "a", 40),
        PrefillProgress(1.0, "a", 4, 4, 40),
        FirstToken(1.0, "a", 0.5),
        *[DecodeStep(1.0 + 0.25 * i, i, 1, 0.25, {"a": 1 + i}, {"a": 9}) for i in range(1, 9)],
        JobFinished(3.1, JobResult("a", "x", (1,) * 9, 40, "length", 0.5, 80.0, 4.0)),
    )
    return tracker


def test_last_dashboard_frame_shows_what_the_summary_shows():
    tracker = finished_run()
    tracker.finish(3.2)  # the run's end: later clocks do not move the figures
    summary = summarize(tracker.state, 99.0, "out")
    frame = render(render_dashboard(tracker.state, 99.0), 120)
    assert summary.wall_s == pytest.approx(3.2) and f"hisparse  {fmt_seconds(summary.wall_s)}" in frame
    assert fmt_rate(summary.decode_tok_s) in frame  # decode (run)
    assert f"{summary.generated_tokens:,} tok" in frame  # tokens out: first tokens included
    assert f"{summary.ok} done" in frame
    console = Console(record=True, width=120, force_terminal=True, color_system=None)
    clock = iter(range(200, 1000)).__next__  # the live display's clock runs on
    with LiveDashboard(console, tracker, clock=clock):
        pass
    assert f"hisparse  {fmt_seconds(summary.wall_s)}" in console.export_text()


# ----------------------------------------------------------------------------- 80 x 24


def render(renderable, width=80, height=None):
    console = Console(record=True, width=width, height=height, force_terminal=False, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_short_ids_stay_distinct():
    ids = [f"quarterly-financial-report-2023-q{i}" for i in range(1, 5)]
    ids += ["alpha-summary-of-the-meeting", "gamma-summary-of-the-meeting", "short"]
    shown = short_ids(ids, 14)
    assert len(set(shown.values())) == len(ids)
    assert all(len(s) <= 14 for s in shown.values()) and shown["short"] == "short"
    assert shown["quarterly-financial-report-2023-q3"].endswith("q3")
    assert shown["alpha-summary-of-the-meeting"].startswith("alp")


def crowded_state():
    tracker = ProgressTracker(0.0)
    for i in range(30):
        feed(tracker, JobQueued(0.0, f"quarterly-financial-report-2023-part-{i:02d}", 5000))
    for i in range(6):
        ident = f"quarterly-financial-report-2023-part-{i:02d}"
        feed(tracker, JobAdmitted(1.0, ident, 5000), PrefillProgress(2.0, ident, 1, 3, 5000))
    feed(
        tracker,
        MemorySnapshot(2.0, "cuda:0", 4 * GiB, 2 * GiB, GiB // 2, GiB // 2, 80 * GiB, 3 * GiB, 16 * GiB),
        MemorySnapshot(2.0, "cuda:1", 4 * GiB, 2 * GiB, GiB // 2, GiB // 2, 80 * GiB, 3 * GiB, 16 * GiB),
    )
    return tracker.state


def test_dashboard_fits_80_by_24_with_distinct_ids_and_a_more_line():
    state = crowded_state()
    text = render(render_dashboard(state, 3.0, width=80, height=24))
    lines = text.splitlines()
    assert len(lines) <= 24 and all(len(line) <= 80 for line in lines), text
    assert "█" not in text and "░" not in text  # bars dropped first
    job_lines = [line for line in lines if "prefill" in line and "│" in line]
    shown = [line.split("│")[1].strip() for line in job_lines]
    assert len(shown) >= 3 and len(set(shown)) == len(shown), shown  # never the same
    assert all(s.endswith(("-00", "-01", "-02", "-03", "-04", "-05")) for s in shown)
    more = [line for line in lines if line.lstrip().startswith("+")]
    assert more and f"+{30 - len(shown)} more" in more[0]
    for label in ("device", "weights", "hot KV", "meta", "act", "used", "free", "total", "pool"):
        assert label in text
    assert "4.0G" in text and "80.0G" in text


def test_wide_dashboard_keeps_bars_and_full_sizes():
    text = render(render_dashboard(crowded_state(), 3.0, width=160, height=60), 160)
    assert "█" in text and "4.00 GiB" in text
    assert "quarterly-financial-report-2023-part-00" in text


def test_summary_gives_the_steady_decode_rate_per_batch_size():
    """Steps that shared no turn with a prefill, by batch size, in the summary: the rate
    `scripts/bench_run.py` sets beside `hisparse bench` at the same number of jobs."""
    tracker = ProgressTracker(0.0)
    for i in range(4):  # two jobs decoding, a third prefilling meanwhile: not steady
        tracker.update(DecodeStep(0.1 * i, i, 2, 0.05, {"a": i, "b": i}, {}, with_prefill=True))
    # the first step of the 3-job batch captured its CUDA graph (0.2 s): not steady either
    tracker.update(DecodeStep(0.9, 9, 3, 0.2, {"a": 9, "b": 9, "c": 0}, {}, graph_capture=True))
    for i in range(6):
        gen = {"a": 10 + i, "b": 10 + i, "c": i}
        tracker.update(DecodeStep(1 + 0.01 * i, 10 + i, 3, 0.01, gen, {}))
    summary = summarize(tracker.state, 2.0, "out")
    assert set(summary.steady_decode) == {3}
    steady = summary.steady_decode[3]
    assert steady["steps"] == 6
    assert steady["step_ms"] == pytest.approx(10.0)
    assert steady["tok_s"] == pytest.approx(300.0)
