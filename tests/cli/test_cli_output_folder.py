"""Globs never read the run's own output folder: ``results.jsonl``, ``<id>.txt``,
``config.json`` and the lock file there are outputs, not inputs (a fresh user's manifest
with ``input: "**/*.txt"`` and ``-o`` under its folder failed on the second run, "output
... is its own input", exit 1). Files named explicitly keep their checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import pytest
import yaml


def read_results(folder):
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def never_load(*args):
    pytest.fail("the model was loaded")


def write_manifest(tmp_path, pattern):
    (tmp_path / "jobs.yaml").write_text(f'jobs:\n  - id: all\n    input: "{pattern}"\n')


@pytest.mark.parametrize("pattern", ["**/*.txt", "**/*"])
def test_a_manifest_glob_skips_the_output_folder_on_the_second_run(cli, docs, tmp_path, pattern):
    write_manifest(tmp_path, pattern)
    first = cli("--manifest", "jobs.yaml", "-o", "out")
    assert first.exit_code == 0, first.output
    assert "output folder" not in first.stderr  # nothing there yet: nothing skipped
    (record,) = read_results(tmp_path / "out")
    inputs = [str(docs / "alpha.txt"), str(docs / "beta.txt")]
    assert record["input"] == inputs + ([str(tmp_path / "jobs.yaml")] if pattern == "**/*" else [])
    assert (tmp_path / "out" / "all.txt").is_file()

    second = cli("--manifest", "jobs.yaml", "-o", "out", engine=never_load)
    assert second.exit_code == 0, second.output  # the job is done: resume skips it
    err = " ".join(second.stderr.split())
    assert "is its own input" not in second.output
    assert err.count("in the output folder out") == 1  # one note, not one per file
    assert "out/all.txt" in err and "is ever read by a glob" in err
    assert "choose another --output-dir" in err
    assert read_results(tmp_path / "out") == [record]

    printed = cli("--manifest", "jobs.yaml", "-o", "out", "--print-config")
    assert printed.exit_code == 0, printed.output
    (job,) = json.loads(printed.stdout)["jobs"]
    assert job["inputs"] == record["input"]
    assert "problems" not in json.loads(printed.stdout)
    assert "in the output folder out" in " ".join(printed.stderr.split())


def test_a_command_line_glob_skips_the_output_folder(cli, docs, tmp_path):
    """A quoted glob hisparse expands itself: the second run finds only the documents."""
    assert cli("**/*.txt", "-o", "out").exit_code == 0
    assert sorted(r["id"] for r in read_results(tmp_path / "out")) == ["alpha", "beta"]
    again = cli("**/*.txt", "-o", "out", engine=never_load)
    assert again.exit_code == 0, again.output  # both done; out/alpha.txt is no document
    assert sorted(r["id"] for r in read_results(tmp_path / "out")) == ["alpha", "beta"]
    assert "in the output folder out" in " ".join(again.stderr.split())


def test_a_glob_through_a_link_into_the_output_folder_skips_it(cli, docs, tmp_path):
    """Symbolic links are resolved: a link to a result file, and an output folder named
    through a link, are the output folder's files."""
    write_manifest(tmp_path, "docs/*.txt")
    assert cli("--manifest", "jobs.yaml", "-o", "out").exit_code == 0
    (docs / "result-link.txt").symlink_to(tmp_path / "out" / "all.txt")
    (tmp_path / "out-link").symlink_to(tmp_path / "out")
    for out in ("out", "out-link"):
        result = cli("--manifest", "jobs.yaml", "-o", out, engine=never_load)
        assert result.exit_code == 0, result.output
        assert "result-link.txt" in result.stderr  # named in the note
        assert len(read_results(tmp_path / "out")) == 1


def test_a_glob_that_matches_only_the_output_folder_is_refused(cli, docs, tmp_path):
    """Documents inside the output folder are never read through a glob; the run says so
    (exit 2, nothing written) rather than finding "no files"."""
    before = sorted(p.name for p in docs.iterdir())
    result = cli("docs/*.txt", "--output-dir", "docs", engine=never_load)
    assert result.exit_code == 2, result.output
    err = " ".join(result.stderr.split())
    assert "glob 'docs/*.txt' matches only files in the output folder docs" in err
    assert "choose another --output-dir" in err
    assert sorted(p.name for p in docs.iterdir()) == before
    write_manifest(tmp_path, "docs/*.txt")
    result = cli("--manifest", "jobs.yaml", "-o", "docs", engine=never_load)
    assert result.exit_code == 2, result.output
    assert "matches only files in the output folder docs" in " ".join(result.stderr.split())


def test_subfolders_of_the_output_folder_are_searched(cli, docs, tmp_path):
    """Only the folder's own files are the run's: with ``-o .`` a glob still finds the
    documents in folders below it."""
    write_manifest(tmp_path, "**/*.txt")
    (tmp_path / "notes.txt").write_text("in the output folder itself\n")
    result = cli("--manifest", "jobs.yaml", "-o", ".")
    assert result.exit_code == 0, result.output
    (record,) = read_results(tmp_path)
    assert record["input"] == [str(docs / "alpha.txt"), str(docs / "beta.txt")]
    assert "notes.txt" in result.stderr


def test_files_named_in_the_output_folder_keep_their_checks(cli, docs, tmp_path):
    """Not through a glob: the run's own files are refused in a manifest (exit 2) and
    skipped with a warning on the command line (the shell's glob), a result file that is
    its job's own input fails that job (exit 1), another file there is read."""
    assert cli("docs/alpha.txt", "-o", "out").exit_code == 0
    skipped = cli("docs/alpha.txt", "out/results.jsonl", "-o", "out", engine=never_load)
    assert skipped.exit_code == 0, skipped.output
    assert "results.jsonl: the run's own files" in " ".join(skipped.stderr.split())
    (tmp_path / "own.yaml").write_text("jobs:\n  - {id: r, input: out/results.jsonl}\n")
    refused = cli("--manifest", "own.yaml", "-o", "out", engine=never_load)
    assert refused.exit_code == 2 and "the run's own results.jsonl" in refused.stderr
    (tmp_path / "out" / "mine.txt").write_text("a document kept in the output folder\n")
    (tmp_path / "jobs.yaml").write_text(
        "jobs:\n  - id: mine2\n    input: out/mine.txt\n"
        "  - id: own\n    input: out/alpha.txt\n    output: alpha\n"
    )
    result = cli("--manifest", "jobs.yaml", "-o", "out", "--force", engine=cli.factory)
    assert result.exit_code == 1, result.output
    records = {r["id"]: r for r in read_results(tmp_path / "out")}
    assert records["mine2"]["ok"] and records["mine2"]["input"] == [str(tmp_path / "out/mine.txt")]
    assert "is its own input" in records["own"]["error"]
    assert "output folder" not in result.stderr  # no glob: nothing skipped
    assert os.path.isfile(tmp_path / "out" / "alpha.txt")


def test_a_config_json_hisparse_did_not_write_is_refused(cli, docs, tmp_path):
    """A fresh user's ``-o userdir`` replaced their own config.json without a word (and
    appended to their results.jsonl): a folder whose config.json is not hisparse's is
    refused (exit 2) before anything is written, naming the file; --print-config lists it."""
    user = tmp_path / "userdir"
    user.mkdir()
    (user / "config.json").write_text('{"my": "precious settings"}\n')
    result = cli("docs/alpha.txt", "-o", "userdir", engine=never_load)
    assert result.exit_code == 2, result.output
    err = " ".join(result.stderr.split())
    assert "userdir/config.json" in err and "hisparse did not write it" in err
    assert "choose another --output-dir" in err and "move it" in err
    assert (user / "config.json").read_text() == '{"my": "precious settings"}\n'
    assert sorted(p.name for p in user.iterdir()) == ["config.json"]
    printed = cli("docs/alpha.txt", "-o", "userdir", "--print-config")
    assert printed.exit_code == 0, printed.output
    (problem,) = json.loads(printed.stdout)["problems"]
    assert "userdir/config.json" in problem


def test_a_results_jsonl_hisparse_did_not_write_is_refused(cli, docs, tmp_path):
    """Content but no line hisparse could have written: refused, naming the file, and it
    is left as it was; an empty results.jsonl is fine."""
    user = tmp_path / "userdir"
    user.mkdir()
    (user / "results.jsonl").write_text('{"name": "row1"}\n{"id": "x", "text": "mine"}\n')
    result = cli("docs/alpha.txt", "-o", "userdir", engine=never_load)
    assert result.exit_code == 2, result.output
    err = " ".join(result.stderr.split())
    assert "userdir/results.jsonl" in err and "hisparse did not write it" in err
    assert (user / "results.jsonl").read_text() == '{"name": "row1"}\n{"id": "x", "text": "mine"}\n'
    assert sorted(p.name for p in user.iterdir()) == ["results.jsonl"]
    (user / "results.jsonl").write_text("")
    assert cli("docs/alpha.txt", "-o", "userdir", engine=cli.factory).exit_code == 0
    assert [r["id"] for r in read_results(user)] == ["alpha"]


def test_hisparse_files_of_earlier_versions_and_cut_lines_are_its_own(cli, docs, tmp_path):
    """config.json without the marker (earlier versions wrote preset, model and engine
    only) is hisparse's; so is a results.jsonl holding only a line a kill cut short (it is
    set aside to results.jsonl.partial as before); the config.json written now has the
    marker."""
    assert cli("docs/alpha.txt", "-o", "out").exit_code == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["written_by"] == "hisparse"
    old = {k: v for k, v in config.items() if k in ("preset", "model", "engine")}
    (tmp_path / "out" / "config.json").write_text(json.dumps(old))
    line = (tmp_path / "out" / "results.jsonl").read_text()
    (tmp_path / "out" / "results.jsonl").write_text(line[:40])  # no newline: cut short
    result = cli("docs/alpha.txt", "-o", "out")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "results.jsonl.partial").read_text() == line[:40] + "\n"
    assert [r["id"] for r in read_results(tmp_path / "out")] == ["alpha"]


def test_earlier_outputs_named_on_the_command_line_are_no_documents(cli, tmp_path):
    """``hisparse run docs/*.txt -o docs`` three times: the shell's glob gives the earlier
    run's docs/my-doc.txt too; it is skipped with one warning (not summarised as job
    docs-my-doc, which made job my-doc fail as "an input of job 'docs-my-doc'")."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("A document whose result would be itself.\n")
    (docs / "My Doc.txt").write_text("My document talks about sorting.\n")

    def run():
        names = sorted(str(p.relative_to(tmp_path)) for p in docs.glob("*.txt"))
        return cli(*names, "-o", "docs")

    first = run()
    assert first.exit_code == 1, first.output  # a.txt: its own input
    summary = (docs / "my-doc.txt").read_text()
    for _ in range(2):
        again = run()
        err = " ".join(again.stderr.split())
        assert err.count("docs/my-doc.txt") == 1, err
        assert "an earlier run wrote in the output folder docs" in err
        latest = {r["id"]: r for r in read_results(docs)}
        assert sorted(latest) == ["a", "my-doc"]
        assert latest["my-doc"]["ok"], latest["my-doc"]
        assert (docs / "my-doc.txt").read_text() == summary
        assert not (docs / "docs-my-doc.txt").exists()
    printed = cli("docs/my-doc.txt", "-o", "docs", "--print-config")
    assert printed.exit_code == 2 and "docs/my-doc.txt" in printed.stderr


def test_the_runs_own_files_named_on_the_command_line_are_no_documents(cli, tmp_path):
    """Fresh-user finding: ``hisparse run d2/* -o d2`` ran once, then every rerun exited
    2: the shell's ``*`` gave d2/config.json (and results.jsonl), "the run's own
    config.json". The run's own files in the output folder named on the command line are
    skipped with the earlier results' warning; a manifest naming one is still refused."""
    d2 = tmp_path / "d2"
    d2.mkdir()
    (d2 / "a.md").write_text("A is about sorting.\n")
    (d2 / "b.md").write_text("B is about graphs.\n")

    def run():
        names = sorted(str(p.relative_to(tmp_path)) for p in d2.glob("[!.]*"))  # as sh's *
        return cli(*names, "-o", "d2")

    assert run().exit_code == 0
    (d2 / "results.jsonl.partial").write_text("{cut short\n")
    for _ in range(2):
        again = run()
        assert again.exit_code == 0, again.output
        err = " ".join(again.stderr.split())
        assert "an earlier run wrote in the output folder d2" in err, err
        assert "config.json, results.jsonl, results.jsonl.partial: the run's own files" in err
        assert sorted(r["id"] for r in read_results(d2)) == ["a", "b"]
    only = cli("d2/config.json", "d2/.hisparse.lock", "-o", "d2")
    assert only.exit_code == 2 and "no other document is left to run" in only.stderr
    (tmp_path / "jobs.yaml").write_text("jobs:\n  - {id: c, input: d2/config.json}\n")
    refused = cli("--manifest", "jobs.yaml", "-o", "d2")
    assert refused.exit_code == 2 and "the run's own config.json" in refused.stderr


def test_a_done_job_is_not_failed_when_another_job_reads_its_output(cli, docs, tmp_path):
    """A manifest job may read an earlier result by naming it (no glob); the job that
    wrote it is done and writes nothing, so it stays done rather than being recorded as
    failed over its own earlier output."""
    (tmp_path / "jobs.yaml").write_text("jobs:\n  - id: first\n    input: docs/alpha.txt\n")
    assert cli("--manifest", "jobs.yaml", "-o", "out").exit_code == 0
    (tmp_path / "jobs.yaml").write_text(
        "jobs:\n  - id: first\n    input: docs/alpha.txt\n"
        "  - id: second\n    input: out/first.txt\n"
    )
    result = cli("--manifest", "jobs.yaml", "-o", "out")
    assert result.exit_code == 0, result.output
    lines = read_results(tmp_path / "out")
    assert [r["id"] for r in lines] == ["first", "second"]
    assert all(r["ok"] for r in lines)


def test_a_quoted_tilde_is_the_home_folder_for_every_path_option(cli, docs, tmp_path, monkeypatch):
    """Fresh-user finding: ``-o "~/hs-out"`` made a folder named ``~`` in the current one
    (the summary said ``output ~/hs-out``) and ``--manifest "~/m.yaml"`` was not found,
    while a quoted ``~`` in a document path was the home folder. Every path option takes a
    leading ``~`` as the home folder now: -o, --manifest, --model, --trace, --preset."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    (home / "m.yaml").write_text(f"jobs:\n  - {{id: a, input: {docs / 'alpha.txt'}}}\n")
    result = cli("--manifest", "~/m.yaml", "-o", "~/hs-out")
    assert result.exit_code == 0, result.output
    assert read_results(home / "hs-out")[0]["id"] == "a"
    assert not (tmp_path / "~").exists()
    preset = yaml.safe_load((Path(__file__).parents[2] / "presets" / "cpu.yaml").read_text())
    (home / "p.yaml").write_text(yaml.safe_dump(preset))
    model = home / "m.gguf"  # a header only: --print-config reads no weights
    writer = gguf.GGUFWriter(str(model), "llama")
    writer.add_context_length(2048)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    args = ("--model", "~/m.gguf", "--trace", "~/t.jsonl", "--preset", "~/p.yaml")
    shown = cli("docs/alpha.txt", *args, "-o", "~/out2", "--print-config")
    assert shown.exit_code == 0, shown.output
    printed = json.loads(shown.stdout)
    assert printed["model"] == str(model) and printed["preset"] == str(home / "p.yaml")
    assert printed["engine"]["trace_path"] == str(home / "t.jsonl")
