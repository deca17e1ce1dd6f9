"""Fresh-user findings on the files ``replay``, ``eval`` and ``bench`` write: none replaces a
file or an earlier run's results without ``--force``, ``replay --json`` never replaces one
of its traces, an output path that cannot be written is refused before any work (exit 2,
one line naming it, as ``hisparse run`` refuses its ``--output-dir``), and ``bench
--replot`` of a ``bench.json`` of another shape is one error line, not a traceback."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from hisparse_cli import runner as runner_module
from hisparse_cli.main import app
from hisparse_cli.testing import one_line_error

UNWRITABLE = "/proc/evx"  # os.access says yes to root there, yet no file can be made


def invoke(*args):
    return CliRunner().invoke(app, list(args))


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


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_replay_json_never_replaces_a_device_or_fifo(tmp_path, trace):
    """Fresh-user finding: ``replay ... --json /dev/null --force`` renamed a new file over
    ``/dev/null`` (and ``/dev/full``, a FIFO). Anything there that is neither a regular
    file nor a link is refused, ``--force`` or not; a FIFO stands in for the device."""
    import stat

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for extra in ([], ["--force"]):
        result = invoke("replay", str(trace), "--json", str(fifo), *extra)
        one_line_error(result, f"--json {fifo} is not a regular file", "never replaced")
        assert "belady" not in result.stdout
        assert stat.S_ISFIFO(fifo.lstat().st_mode)
    link = tmp_path / "link.json"  # a link is replaced, never its target
    link.symlink_to(fifo)
    result = invoke("replay", str(trace), "--json", str(link), "--force")
    assert result.exit_code == 0, result.output
    assert link.is_file() and not link.is_symlink() and stat.S_ISFIFO(fifo.lstat().st_mode)


def test_replay_json_dash_is_refused_and_dot_slash_dash_is_a_file(tmp_path, trace, monkeypatch):
    """Fresh-user finding: ``--json -`` wrote a file named ``-``; it is refused as ``run -o -``
    is (the table already goes to stdout), and ``./-`` still names a file ``-``."""
    monkeypatch.chdir(tmp_path)
    result = invoke("replay", str(trace), "--json", "-")
    assert result.exit_code == 2 and not (tmp_path / "-").exists()
    assert "is not standard output here" in " ".join(result.stderr.split())
    result = invoke("replay", str(trace), "--json", "./-")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "-").read_text())["results"]


def test_replay_json_names_are_escaped(tmp_path, trace):
    """A control character in the name is shown as an escape, not written raw."""
    name = tmp_path / "evil\x1b[2J.json"
    name.write_text("{}")
    result = invoke("replay", str(trace), "--json", str(name))
    one_line_error(result, "evil\\x1b[2J.json")
    assert "\x1b[2J" not in result.stderr


def test_replay_of_a_trace_without_selections_says_so(tmp_path, trace):
    """Fresh-user finding: replaying a trace with only its header (what a run killed before
    any decode step leaves) reported a 0.0 % miss rate over "0 streams", rc 0. Refused now
    (exit 2, naming it); beside a trace that holds selections it is named and skipped."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text(trace.read_text().splitlines(keepends=True)[0])  # the header line only
    one_line_error(
        invoke("replay", str(empty)), f"nothing to replay: {empty} holds only the header"
    )
    result = invoke("replay", str(trace), str(empty))
    assert result.exit_code == 0, result.output
    assert f"warning: {empty} holds only the header" in " ".join(result.stderr.split())
    assert "1 streams" in result.stdout or "2 streams" in result.stdout


# ------------------------------------------------------------------------------ eval


@pytest.fixture
def no_eval_model(monkeypatch):
    """Eval's model load (``_run``) fails the test if reached; this box's CPU load is not
    sampled."""
    from hisparse_cli import eval_cmd

    def run(*args):
        raise AssertionError("eval reached the model load")

    monkeypatch.setattr(eval_cmd, "_run", run)
    monkeypatch.setattr(runner_module, "free_cpu_threads", lambda config: None)


def run_eval(out, *args):
    return invoke("eval", "--preset", "cpu", "-o", str(out), *args)


def test_eval_refuses_an_output_path_it_cannot_write_before_the_model(tmp_path, no_eval_model):
    """Fresh-user finding: ``eval -o FILE`` or ``-o /proc/evx`` ran every configuration,
    then a FileExistsError / FileNotFoundError traceback, exit 1."""
    file = tmp_path / "a file"
    file.write_text("mine\n")
    one_line_error(run_eval(file), f"--output-dir {file} exists and is not a directory")
    assert file.read_text() == "mine\n"
    (tmp_path / "o" / "eval.json").mkdir(parents=True)
    one_line_error(run_eval(tmp_path / "o"), f"{tmp_path / 'o' / 'eval.json'} is not a regular")
    if os.path.isdir("/proc"):
        one_line_error(run_eval(UNWRITABLE), f"cannot create output dir {UNWRITABLE}")


def test_eval_refuses_an_earlier_evals_folder_unless_force(tmp_path, monkeypatch):
    """Fresh-user finding: a second eval into the same folder silently replaced the first
    one's eval.json. Refused now (the message says how to go on); with --force the new
    results replace it, and an eval.png the new run does not draw is removed."""
    from hisparse_cli import eval_cmd, eval_report

    report = {
        "model": "m",
        "configs": [{"name": "dense"}],
        "table": [
            {"task": "vt", "length": 600, "config": "dense", "accuracy": 100.0, "samples": 1}
        ],
    }
    monkeypatch.setattr(eval_cmd, "_run", lambda *args: report)
    monkeypatch.setattr(runner_module, "free_cpu_threads", lambda config: None)
    monkeypatch.setattr(eval_report, "heatmap", lambda report, path: "no heatmap: test")
    out = tmp_path / "out"
    out.mkdir()
    earlier = {"format": "hisparse-eval", "model": "earlier"}
    (out / "eval.json").write_text(json.dumps(earlier))
    (out / "eval.png").write_bytes(b"earlier heatmap")
    result = run_eval(out)
    one_line_error(result, f"{out / 'eval.json'} holds the results of an earlier eval", "--force")
    assert json.loads((out / "eval.json").read_text()) == earlier
    result = run_eval(out, "--force")
    assert result.exit_code == 0, result.output
    assert json.loads((out / "eval.json").read_text())["model"] == "m"
    assert json.loads((out / "eval.json").read_text())["format"] == "hisparse-eval"
    assert not (out / "eval.png").exists()  # the earlier heatmap would disagree


# ------------------------------------------------------------------------------ bench


def bench(out, *args):
    return invoke(
        "bench", "--contexts", "2K", "--concurrency", "1", "--memory-budget", "2",
        "--preset", "cpu", "--out", str(out), *args,
    )  # fmt: skip


@pytest.fixture
def fake_bench(monkeypatch):
    """``run_bench`` replaced by one that writes a small report of one 2K context (no model);
    the calls are kept."""
    from engine.measure import bench as bench_module
    from engine.measure.report import write_report

    calls = []

    def run_bench(spec, log):
        calls.append(spec)
        row = {"context": 2048, "admitted": 1, "mode": "dense", "decode_tok_s": 10.0,
               "concurrency": 1, "status": "ok"}  # fmt: skip
        report = {"model": "synthetic:test", "synthetic": True, "memory_budget_gb": 2.0,
                  "contexts_requested": [2048], "modes": ["dense"], "runs": [row],
                  "notes": [], "soak": None, "plots": []}  # fmt: skip
        log(f"wrote {write_report(report, spec.out_dir)}")  # as run_bench says it
        return report

    monkeypatch.setattr(bench_module, "run_bench", run_bench)
    return calls


def test_bench_refuses_an_output_path_it_cannot_write_before_the_model(tmp_path, fake_bench):
    """Fresh-user finding: ``bench --out FILE`` or ``--out /proc/evx`` ran the whole sweep,
    then a traceback, exit 1."""
    file = tmp_path / "a file"
    file.write_text("mine\n")
    one_line_error(bench(file), f"--out {file} exists and is not a directory")
    assert file.read_text() == "mine\n"
    if os.path.isdir("/proc"):
        one_line_error(bench(UNWRITABLE), f"cannot create output dir {UNWRITABLE}")
    assert fake_bench == []


def test_bench_refuses_an_earlier_benchs_folder_and_force_drops_its_stale_plots(
    tmp_path, fake_bench
):
    """Fresh-user finding: a second bench into the same folder replaced bench.json and left
    throughput_1K.png of the first beside it. Refused now; with --force the earlier plots
    are removed, so the folder holds only what the new bench.json names."""
    out = tmp_path / "bench-out"
    out.mkdir()
    (out / "bench.json").write_text('{"format": "hisparse-bench", "model": "earlier"}')
    for name in ("throughput_1K.png", "soak_step_latency.png", "notes.png"):
        (out / name).write_bytes(b"earlier")
    result = bench(out)
    one_line_error(result, f"{out / 'bench.json'} holds the results of an earlier bench", "--force")
    assert fake_bench == [] and (out / "throughput_1K.png").exists()
    result = bench(out, "--force")
    assert result.exit_code == 0, result.output
    report = json.loads((out / "bench.json").read_text())
    assert report["plots"] == ["throughput_2K.png"]
    names = sorted(p.name for p in out.iterdir())  # and the lock file, as a run leaves it
    assert names == [".hisparse.lock", "bench.json", "notes.png", "throughput_2K.png"]


# ------------------------------------------------------------------- eval and bench: folder


def fake_eval(monkeypatch, run=None):
    """Eval without a model: ``_run`` returns a one-cell report (or calls ``run``)."""
    from hisparse_cli import eval_cmd, eval_report

    report = {
        "model": "m",
        "configs": [{"name": "dense"}],
        "table": [
            {"task": "vt", "length": 600, "config": "dense", "accuracy": 100.0, "samples": 1}
        ],
    }

    def fake_run(*args):
        if run is not None:
            run()
        return report

    monkeypatch.setattr(eval_cmd, "_run", fake_run)
    monkeypatch.setattr(runner_module, "free_cpu_threads", lambda config: None)
    monkeypatch.setattr(eval_report, "heatmap", lambda report, path: "no heatmap: test")


def test_a_second_eval_or_bench_into_a_folder_in_use_is_refused(tmp_path, monkeypatch, fake_bench):
    """Fresh-user finding: two ``eval -o same`` (or ``bench --out same``) started together
    both exited 0, the last one's report silently replacing the other's (the earlier-results
    check only ran at start-up). Each takes the lock ``hisparse run`` takes: the second is
    refused, exit 2, naming the process and the lock file, and writes nothing."""
    from hisparse_cli.results import lock_output_dir

    fake_eval(monkeypatch)
    out = tmp_path / "same"
    out.mkdir()
    lock = out / ".hisparse.lock"
    with lock_output_dir(out):  # the first eval / bench / run, still going
        busy = f"(process {os.getpid()}) is using {out}: it holds the lock on {lock}"
        one_line_error(run_eval(out), busy, "choose another --output-dir")
        one_line_error(bench(out), busy, "choose another --out")
    assert sorted(p.name for p in out.iterdir()) == [".hisparse.lock"]
    assert fake_bench == []
    assert run_eval(out).exit_code == 0  # once it has ended
    assert bench(out).exit_code == 0


def test_an_eval_that_ended_meanwhile_is_not_replaced(tmp_path, monkeypatch):
    """The earlier-results check is made again under the lock: an eval into the same folder
    that wrote its report while this one started (before its lock) is not replaced."""
    out = tmp_path / "out"

    def other_eval_ends():  # another eval wrote its report meanwhile
        (out / "eval.json").write_text('{"format": "hisparse-eval", "model": "other"}')

    fake_eval(monkeypatch)
    from hisparse_cli import runner

    real = runner.lock_output_dir

    def lock_after_other(folder, option="--output-dir"):
        other_eval_ends()
        return real(folder, option)

    monkeypatch.setattr(runner, "lock_output_dir", lock_after_other)
    one_line_error(run_eval(out), f"{out / 'eval.json'} holds the results of an earlier eval")
    assert json.loads((out / "eval.json").read_text())["model"] == "other"


def test_eval_and_bench_never_replace_a_report_they_did_not_write(
    tmp_path, monkeypatch, fake_bench
):
    """Fresh-user finding: eval and bench took any eval.json / bench.json for their own: a
    ``{"mine":1}`` was "the results of an earlier eval", and --force replaced it, and with
    it a user's PNG named like a bench plot. Their reports carry a marker (``format``) now,
    as run's config.json carries ``written_by``: a file without it is refused, --force or
    not, and no plot is removed."""
    fake_eval(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    (out / "eval.json").write_text('{"mine":1}')
    for args in ((), ("--force",)):
        one_line_error(run_eval(out, *args), f"{out / 'eval.json'}: not written by hisparse eval")
    assert (out / "eval.json").read_text() == '{"mine":1}'
    (out / "bench.json").write_text('{"mine":1}')
    (out / "throughput_1K.png").write_bytes(b"my plot")
    for args in ((), ("--force",)):
        one_line_error(bench(out, *args), f"{out / 'bench.json'}: not written by hisparse bench")
    assert (out / "bench.json").read_text() == '{"mine":1}'
    assert (out / "throughput_1K.png").read_bytes() == b"my plot"
    assert fake_bench == []


def test_bench_never_replaces_a_png_named_as_its_plot_without_its_bench_json(tmp_path, fake_bench):
    """With no bench.json nothing says a throughput_2K.png there is an earlier bench's: a
    bench of 2K would draw over it. Refused, --force or not; --force removes plots only
    beside a bench.json bench wrote."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "throughput_2K.png").write_bytes(b"my plot")
    (out / "throughput_1K.png").write_bytes(b"my other plot")
    for args in ((), ("--force",)):
        one_line_error(bench(out, *args), f"{out / 'throughput_2K.png'}: not drawn by hisparse")
    assert fake_bench == []
    (out / "throughput_2K.png").unlink()
    result = bench(out, "--force")
    assert result.exit_code == 0, result.output
    assert (out / "throughput_1K.png").read_bytes() == b"my other plot"  # not this bench's


def test_eval_and_bench_wrote_lines_escape_the_folder_name(tmp_path, monkeypatch, fake_bench):
    """Fresh-user finding: ``-o $'ev \xe9\\nx'`` printed bench's and eval's "wrote ..." lines
    over two lines (a raw newline, an ESC): escaped now, as run's lines are."""
    from hisparse_cli import eval_report

    fake_eval(monkeypatch)
    monkeypatch.setattr(eval_report, "heatmap", lambda report, path: "")
    out = tmp_path / "ev \u00e9\nx\x1b[2J"
    shown = str(tmp_path / "ev \u00e9\\nx\\x1b[2J")
    result = run_eval(out)
    assert result.exit_code == 0, result.output
    assert f"wrote {shown}/eval.json, {shown}/eval.png" in result.stdout
    assert "\x1b" not in result.stdout
    out2 = tmp_path / "be \u00e9\nx\x1b[2J"
    shown2 = str(tmp_path / "be \u00e9\\nx\\x1b[2J")
    result = bench(out2)
    assert result.exit_code == 0, result.output
    assert f"wrote {shown2}/bench.json" in result.stdout
    assert "\x1b" not in result.stdout and "\nx" not in result.stdout


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        "3",
        '"bench"',
        "{}",
        '{"contexts_requested": [2048], "modes": [], "runs": [1], "notes": []}',
    ],
)
def test_bench_replot_of_a_json_of_another_shape_is_one_error(tmp_path, text):
    """Fresh-user finding: ``bench --replot`` of a bench.json holding ``[]`` gave a TypeError
    traceback (a cut-off one was refused already)."""
    (tmp_path / "bench.json").write_text(text)
    result = invoke("bench", "--out", str(tmp_path), "--replot")
    one_line_error(result, f"cannot replot {tmp_path / 'bench.json'}", "not a bench report")
    assert (tmp_path / "bench.json").read_text() == text


# ------------------------------------------------------------------- bench: Ctrl-C, SIGTERM


def test_an_interrupted_bench_says_so_and_its_report_says_it_is_partial(tmp_path, monkeypatch):
    """Fresh-user finding: bench stopped silently on Ctrl-C / SIGTERM (exit 130/143, no
    line), and its bench.json had no mark that the sweep was incomplete. One line now says
    it was interrupted and what was written; bench.json's status is ``interrupted``."""
    import signal

    from engine.measure import bench as bench_module
    from engine.measure.report import write_report

    def interrupted_sweep(spec, log):  # what run_bench does on Ctrl-C after one run
        report = {"format": "hisparse-bench", "status": "interrupted", "runs": [{}]}
        raise bench_module.BenchInterrupted(write_report(report, spec.out_dir), 1)

    monkeypatch.setattr(bench_module, "run_bench", interrupted_sweep)
    out = tmp_path / "out"
    result = bench(out)
    assert result.exit_code == 130, result.output
    text = " ".join(result.stderr.split())
    assert text.startswith(f"interrupted (Ctrl-C) after 1 run(s): wrote {out / 'bench.json'}")
    assert '"status": "interrupted" (the sweep is incomplete)' in text
    assert json.loads((out / "bench.json").read_text())["status"] == "interrupted"

    def terminated_during_load(spec, log):
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(bench_module, "run_bench", terminated_during_load)
    result = bench(tmp_path / "new")
    assert result.exit_code == 143, result.output
    assert result.stderr.strip() == (
        f"interrupted (SIGTERM) before the sweep: nothing written in {tmp_path / 'new'}"
    )
    assert not (tmp_path / "new").exists()  # made for the lock only: removed, as run does
