"""``hisparse run -``: one document from standard input, validated, resumed and never
written over an earlier result (fresh-user finding: pipes were refused)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hisparse_cli import runner as runner_module
from hisparse_cli import textio
from hisparse_cli.main import app
from hisparse_cli.manifest import ManifestError, jobs_from_paths, load_manifest
from hisparse_cli.naming import EarlierJob, stdin_job_id
from hisparse_cli.runner import RunRequest, UsageError, with_stdin
from hisparse_cli.textio import STDIN, DocumentError, read_document

TEXT = "The stdin document is about merge sort and its stable order.\n"


def lines(out):
    return [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]


def seen(cli):
    return [job for engine in cli.factory.engines for job in engine.seen]


def test_stdin_is_one_job_named_stdin(cli, tmp_path):
    result = cli("--max-new-tokens", "3", "-", input=TEXT)
    assert result.exit_code == 0, result.output
    (line,) = lines(tmp_path / "hisparse-out")
    assert line["id"] == "stdin" and line["ok"] and line["input"] == ["-"]
    assert (tmp_path / "hisparse-out" / "stdin.txt").is_file()
    assert [job.id for job in seen(cli)] == ["stdin"]


def test_stdin_prompt_equals_the_same_text_from_a_file(cli, tmp_path):
    """The engine gets the same prompt for the text piped in as for it in a file."""
    (tmp_path / "doc.txt").write_text(TEXT)
    assert cli("--max-new-tokens", "3", "--output-dir", "a", "doc.txt").exit_code == 0
    assert cli("--max-new-tokens", "3", "--output-dir", "b", "-", input=TEXT).exit_code == 0
    from_file, from_stdin = seen(cli)
    assert from_stdin.prompt_ids == from_file.prompt_ids and from_stdin.input_path == "-"
    file_line, stdin_line = lines(tmp_path / "a")[0], lines(tmp_path / "b")[0]
    assert stdin_line["input_sha256"] == file_line["input_sha256"]


def test_stdin_beside_files_runs_after_them(cli, docs):
    result = cli("--max-new-tokens", "3", "docs/*.txt", "-", input=TEXT)
    assert result.exit_code == 0, result.output
    assert [job.id for job in seen(cli)] == ["alpha", "beta", "stdin"]


def test_same_text_again_is_skipped_other_text_gets_its_own_job(cli, tmp_path):
    out = tmp_path / "hisparse-out"
    cli("--max-new-tokens", "3", "-", input=TEXT)
    first = (out / "stdin.txt").read_bytes()
    again = cli("--max-new-tokens", "3", "-", input=TEXT)
    assert again.exit_code == 0 and "skipping 1 job(s) already done" in again.stdout
    other = cli("--max-new-tokens", "3", "-", input="A different text about heaps.\n")
    assert other.exit_code == 0, other.output
    ids = [line["id"] for line in lines(out)]
    assert ids[0] == "stdin" and len(ids) == 2 and ids[1].startswith("stdin-")
    assert (out / "stdin.txt").read_bytes() == first  # not written over
    assert (out / f"{ids[1]}.txt").is_file()
    # each text keeps its own id: both are done now
    for text in (TEXT, "A different text about heaps.\n"):
        assert "skipping 1 job(s)" in cli("--max-new-tokens", "3", "-", input=text).stdout
    assert len(lines(out)) == 2


def test_force_redoes_the_stdin_job(cli, tmp_path):
    cli("--max-new-tokens", "3", "-", input=TEXT)
    assert cli("--max-new-tokens", "3", "--force", "-", input=TEXT).exit_code == 0
    assert [line["id"] for line in lines(tmp_path / "hisparse-out")] == ["stdin", "stdin"]


def test_empty_stdin_fails_naming_standard_input(cli, tmp_path):
    result = cli("--max-new-tokens", "3", "-", input="  \n\n")
    assert result.exit_code == 1
    (line,) = lines(tmp_path / "hisparse-out")
    assert not line["ok"] and line["error"] == "standard input: is empty or only whitespace"
    assert seen(cli) == []
    again = cli("--max-new-tokens", "3", "-", input="  \n\n")  # the same bytes: not retried
    assert again.exit_code == 1 and "not tried again" in again.output


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"%PDF-1.7\n...", "looks like a PDF file"),
        (b"caf\xe9 au lait\n", "invalid utf-8 at byte offset 3"),
        (b"\x00" * 64 + b"text", "looks binary: 64 NUL bytes"),
    ],
)
def test_binary_or_undecodable_stdin_fails_with_the_files_message(cli, tmp_path, data, says):
    result = cli("--max-new-tokens", "3", "-", input=data)
    assert result.exit_code == 1
    (line,) = lines(tmp_path / "hisparse-out")
    assert line["error"].startswith("standard input: ") and says in line["error"]


def test_encoding_applies_to_stdin(cli, tmp_path):
    result = cli("--max-new-tokens", "3", "--encoding", "latin-1", "-", input=b"caf\xe9\n")
    assert result.exit_code == 0, result.output


def test_a_terminal_is_refused_before_anything_runs(tmp_path):
    class Terminal:
        def isatty(self):
            return True

    with pytest.raises(UsageError, match="standard input is a terminal"):
        with_stdin(RunRequest(docs=("-",)), Terminal())


def test_stdin_is_read_once_and_only_for_dash():
    class Stream:
        reads = 0

        def isatty(self):
            return False

        def read(self, size=-1):  # as io.BufferedReader.read
            Stream.reads += 1
            return b"text"[:size] if size >= 0 else b"text"

    assert with_stdin(RunRequest(docs=("a.txt",)), Stream()).stdin is None
    request = with_stdin(RunRequest(docs=("-",)), Stream())
    assert request.stdin == b"text" and with_stdin(request, Stream()) is request
    assert Stream.reads == 1


def test_endless_stdin_fails_its_job_and_the_rest_run(cli, docs, monkeypatch, tmp_path):
    """Fresh-user finding: `hisparse run - < /dev/zero` read until the memory ran out.
    Standard input is read up to one byte past the document cap; past it, the stdin job
    fails by name and the other documents run."""
    cap = (tmp_path / "docs" / "alpha.txt").stat().st_size  # alpha fits exactly
    monkeypatch.setattr(textio, "MAX_DOCUMENT_BYTES", cap)
    result = cli("--max-new-tokens", "3", "docs/alpha.txt", "-", input="x" * (cap + 1))
    assert result.exit_code == 1, result.output
    records = {r["id"]: r for r in lines(tmp_path / "hisparse-out")}
    assert records["alpha"]["ok"]
    assert not records["stdin"]["ok"] and "goes on past" in records["stdin"]["error"]
    assert [job.id for job in seen(cli)] == ["alpha"]


def test_print_config_with_stdin_runs_nothing(cli, tmp_path):
    result = cli("--print-config", "-", input=TEXT)
    assert result.exit_code == 0 and not (tmp_path / "hisparse-out").exists()


def test_read_document_without_stdin_bytes_names_it():
    with pytest.raises(DocumentError, match="standard input: was not read"):
        read_document(STDIN)
    assert read_document(STDIN, stdin=b"hello\r\n").text == "hello\n"


def test_stdin_job_id_rules():
    sha, other = "ab" * 32, "cd" * 32
    stdin = (STDIN,)
    assert stdin_job_id(sha) == "stdin"
    done = [EarlierJob("stdin", stdin, "stdin.txt", (sha,))]
    assert stdin_job_id(sha, done) == "stdin"
    assert stdin_job_id(other, done) == "stdin-cdcdcdcd"
    both = [*done, EarlierJob("stdin-cdcdcdcd", stdin, "stdin-cdcdcdcd.txt", (other,))]
    assert stdin_job_id(other, both) == "stdin-cdcdcdcd"
    # a file's job called stdin (docs/stdin.txt) is no stdin job: its id stays its own
    file_job = [EarlierJob("stdin", (STDIN.resolve(),), "stdin.txt", (sha,))]
    assert stdin_job_id(sha, file_job) == "stdin-abababab"
    # a taken hash prefix grows
    clash = [*done, EarlierJob("stdin-cdcdcdcd", (), "x.txt")]
    assert stdin_job_id(other, clash) == "stdin-cdcdcdcdcdcd"


def test_a_file_named_stdin_beside_dash_gets_another_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "stdin.txt").write_text("a file named stdin\n")
    manifest = jobs_from_paths(["stdin.txt", "-"], stdin_sha256="ab" * 32)
    ids = [job.id for job in manifest.jobs]
    assert ids[1] == "stdin" and ids[0] != "stdin" and ids[0].endswith("stdin")
    assert manifest.jobs[1].inputs == (STDIN,)


def test_stdin_alone_with_a_missing_file_still_runs(tmp_path, monkeypatch):
    """As with two named files: a missing one fails its own job, standard input runs."""
    monkeypatch.chdir(tmp_path)
    manifest = jobs_from_paths(["missing.txt", "-"], stdin_sha256="ab" * 32)
    assert [job.id for job in manifest.jobs] == ["missing", "stdin"]
    assert any("file not found" in w for w in manifest.warnings)


def test_dash_in_a_manifest_is_refused_pointing_at_run_dash(tmp_path):
    (tmp_path / "jobs.yaml").write_text("jobs:\n  - id: a\n    input: '-'\n")
    with pytest.raises(ManifestError) as info:
        load_manifest(tmp_path / "jobs.yaml")
    (problem,) = info.value.problems
    assert "standard input" in problem.message and "hisparse run -" in problem.message


def test_run_help_names_dash():
    result = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"})
    assert "one job per file; - reads one from stdin." in result.output


def test_stdin_run_through_execute_records_it(tmp_path, monkeypatch):
    """``execute`` with the bytes given (as a library caller would) reads no stream."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runner_module.settings, "preset_overrides", lambda name: {})
    monkeypatch.setattr(runner_module, "cuda_device_count", lambda: 0)
    monkeypatch.setenv("HISPARSE_HOST_MEMORY_GB", "256")
    monkeypatch.setattr(runner_module, "free_cpu_threads", lambda config: None)
    from hisparse_cli import testing

    monkeypatch.setattr(runner_module, "load_engine", testing.fake_engine_factory())
    monkeypatch.setattr("sys.stdin", None)
    request = RunRequest(docs=("-",), stdin=TEXT.encode(), job_overrides={"max_new_tokens": 3})
    assert runner_module.execute(request) == 0
    assert lines(tmp_path / "hisparse-out")[0]["id"] == "stdin"
