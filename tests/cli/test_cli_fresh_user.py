"""Fresh-user findings of issue #21: an output dir that is the documents' folder, cancelled
lines on Ctrl-C and resume, the effective ``cuda_graph`` in ``config.json``, and the text
file without the reply's leading blank line."""

from __future__ import annotations

import json
import os
import signal

import pytest

from hisparse_cli import testing


def read_results(folder):
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("named", [("docs/alpha.txt", "docs/beta.txt"), ("docs/*.txt",)])
def test_output_dir_equal_to_the_documents_folder_is_refused_before_writing(cli, docs, named):
    """Named documents (the shell's expansion of docs/*.txt) would be overwritten; a glob
    hisparse expands never reads the output folder, so it has no document left."""
    before = sorted(p.name for p in docs.iterdir())
    result = cli(*named, "--output-dir", "docs", engine=lambda *a: pytest.fail("loaded"))
    assert result.exit_code == 2, result.output
    err = " ".join(result.stderr.split())
    if len(named) > 1:
        assert "would overwrite the documents" in err and "nothing was written" in err
    else:
        assert "matches only files in the output folder docs" in err and "nothing was run" in err
    assert sorted(p.name for p in docs.iterdir()) == before  # no results.jsonl, config.json
    assert (docs / "alpha.txt").read_text() == "The alpha document talks about sorting.\n"


def test_an_output_dir_beside_the_documents_still_runs(cli, docs, tmp_path):
    result = cli("docs/*.txt", "--output-dir", "docs/out")
    assert result.exit_code == 0, result.output
    assert {r["id"] for r in read_results(docs / "out")} == {"alpha", "beta"}


def test_repeated_ctrl_c_and_resume_keep_one_line_per_job(cli, docs, tmp_path):
    def interrupt(step):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    out = tmp_path / "hisparse-out"
    for _ in range(3):
        engine = testing.fake_engine_factory(on_step=interrupt)
        assert cli("docs/alpha.txt", "--max-new-tokens", "8", engine=engine).exit_code == 130
    records = read_results(out)  # each run drops the line the next one supersedes
    assert [(r["id"], r["finish_reason"]) for r in records] == [("alpha", "cancelled")]
    plain = testing.fake_engine_factory()
    assert cli("docs/alpha.txt", "--max-new-tokens", "8", engine=plain).exit_code == 0
    assert [(r["id"], r["finish_reason"]) for r in read_results(out)] == [("alpha", "length")]
    assert cli("docs/alpha.txt", "--max-new-tokens", "8").exit_code == 0  # resume: skipped
    assert [r["finish_reason"] for r in read_results(out)] == ["length"]


def test_config_json_shows_cuda_graph_off_on_a_cpu_run(cli, docs, tmp_path):
    assert cli("docs/alpha.txt", "--max-new-tokens", "2").exit_code == 0
    document = json.loads((tmp_path / "hisparse-out" / "config.json").read_text())
    assert document["engine"]["device"] == "cpu" and document["engine"]["cuda_graph"] is False
    assert "CPU run" in document["effective"]["cuda_graph"]
    printed = json.loads(cli("docs/alpha.txt", "--print-config").stdout)
    assert printed["engine"]["cuda_graph"] is False


def test_text_file_drops_the_reply_leading_blank_line_and_jsonl_keeps_it(cli, docs, tmp_path):
    engine = testing.fake_engine_factory(texts={"alpha": "\n\n  Sorting, in short.\n"})
    assert cli("docs/alpha.txt", engine=engine).exit_code == 0
    out = tmp_path / "hisparse-out"
    assert (out / "alpha.txt").read_text() == "Sorting, in short.\n"
    assert read_results(out)[0]["text"] == "\n\n  Sorting, in short.\n"


def test_a_file_hisparse_did_not_write_is_never_overwritten(cli, docs, tmp_path):
    """A user's own file where a job's output would go (the output folder holds their
    documents too): that job fails naming the file, which stays as it was; the rest run."""
    out = tmp_path / "mixed"
    out.mkdir()
    mine = out / "alpha.txt"
    mine.write_text("my own notes, not a result\n")
    result = cli("docs/alpha.txt", "docs/beta.txt", "--output-dir", "mixed")
    assert result.exit_code == 1, result.output
    assert mine.read_text() == "my own notes, not a result\n"
    records = {r["id"]: r for r in read_results(out)}
    assert records["beta"]["ok"] and (out / "beta.txt").is_file()
    error = " ".join(records["alpha"]["error"].split())
    assert not records["alpha"]["ok"] and "no mixed/results.jsonl records it" in error
    assert "refusing to overwrite a file hisparse cannot show it wrote" in error
    assert "earlier run's output" not in result.stderr  # it is the user's, not a run's
    # the same command again: the failure line wrote no text, so the file is still theirs
    again = cli("docs/alpha.txt", "docs/beta.txt", "--output-dir", "mixed")
    assert again.exit_code == 1, again.output
    assert mine.read_text() == "my own notes, not a result\n"
    # a file an earlier run wrote (named by its results line) is replaced as before
    assert cli("docs/beta.txt", "--output-dir", "mixed", "--force").exit_code == 0


def test_a_cancelled_run_with_other_settings_keeps_earlier_results_done(cli, docs, tmp_path):
    """Done with settings A; a run with settings B is cancelled (its cancelled line wrote no
    text); the command with settings A again skips the job: its output is A's result."""
    out = tmp_path / "hisparse-out"
    assert cli("docs/alpha.txt", "--max-new-tokens", "8").exit_code == 0
    text = (out / "alpha.txt").read_text()

    def interrupt(step):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    engine = testing.fake_engine_factory(on_step=interrupt)
    assert cli("docs/alpha.txt", "--max-new-tokens", "9", engine=engine).exit_code == 130
    again = cli("docs/alpha.txt", "--max-new-tokens", "8", engine=lambda *a: pytest.fail("loaded"))
    assert again.exit_code == 0, again.output
    assert "already done" in again.output
    assert (out / "alpha.txt").read_text() == text
