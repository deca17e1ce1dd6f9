"""Globs never read the run's own output folder: ``results.jsonl``, ``<id>.txt``,
``config.json`` and the lock file there are outputs, not inputs (a fresh user's manifest
with ``input: "**/*.txt"`` and ``-o`` under its folder failed on the second run, "output
... is its own input", exit 1). Files named explicitly keep their checks."""

from __future__ import annotations

import json
import os

import pytest


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
    """Not through a glob: the run's own files are refused (exit 2), a result file that is
    its job's own input fails that job (exit 1), another file there is read."""
    assert cli("docs/alpha.txt", "-o", "out").exit_code == 0
    refused = cli("docs/beta.txt", "out/results.jsonl", "-o", "out", engine=never_load)
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
