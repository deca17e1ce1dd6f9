"""Resume: skip jobs done with the same key, redo changed or failed ones, survive kill -9."""

from __future__ import annotations

import codecs
import json

import pytest
from typer.testing import CliRunner

from hisparse_cli import runner as runner_module
from hisparse_cli import settings, testing
from hisparse_cli.main import app


@pytest.fixture
def run(tmp_path, monkeypatch):
    """``run(*args) -> (result, ids the engine was given)``."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(settings, "preset_overrides", lambda name: {})
    (tmp_path / "docs").mkdir()
    for name in ("a", "b", "c"):
        (tmp_path / "docs" / f"{name}.txt").write_text(f"document {name}\n")

    def invoke(*args, engine_kwargs=None):
        factory = testing.fake_engine_factory(**(engine_kwargs or {}))
        monkeypatch.setattr(runner_module, "load_engine", factory)
        result = CliRunner().invoke(app, ["run", "docs/*.txt", "--max-new-tokens", "3", *args])
        seen = [job.id for engine in factory.engines for job in engine.seen]
        return result, seen

    return invoke


def lines(tmp_path):
    return [
        json.loads(x)
        for x in (tmp_path / "hisparse-out" / "results.jsonl").read_text().splitlines()
    ]


def test_second_run_skips_everything_and_loads_no_engine(run, tmp_path):
    assert run()[1] == ["a", "b", "c"]
    result, seen = run()
    assert result.exit_code == 0 and seen == []
    assert "skipping 3 job(s) already done" in result.stdout
    assert len(lines(tmp_path)) == 3


def test_changed_input_redoes_only_that_job(run, tmp_path):
    run()
    (tmp_path / "docs" / "b.txt").write_text("document b, edited\n")
    result, seen = run()
    assert seen == ["b"]
    assert (
        "b: hisparse-out/b.txt holds this job's earlier answer, made with an earlier version "
        "of docs/b.txt; this run replaces it"
    ) in " ".join(result.stderr.split())
    assert [r["id"] for r in lines(tmp_path)] == ["a", "b", "c", "b"]
    assert "holds" not in run("--force")[0].stderr  # the same keys, redone on purpose


def test_adding_a_same_named_document_keeps_earlier_ids(run, tmp_path):
    """Without the earlier run's names, ``docs/a.txt`` would become ``docs-a`` beside
    ``other-a`` and be redone; it keeps ``a`` and is skipped."""
    run()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "a.txt").write_text("another document a\n")
    result, seen = run("other/a.txt")
    assert result.exit_code == 0 and seen == ["other-a"]
    assert [r["id"] for r in lines(tmp_path)] == ["a", "b", "c", "other-a"]
    assert {p.name for p in (tmp_path / "hisparse-out").glob("*.txt")} == {
        "a.txt", "b.txt", "c.txt", "other-a.txt"
    }
    assert run("other/a.txt")[1] == []


def test_a_new_document_never_takes_an_earlier_documents_id(tmp_path, monkeypatch):
    """``hisparse run docs/a.txt`` then ``hisparse run other/a.txt``: the second must not
    overwrite ``a.txt``; an explicit id that does replace another document's output warns."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(settings, "preset_overrides", lambda name: {})
    for folder in ("docs", "other"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "a.txt").write_text(f"document in {folder}\n")

    def invoke(*args):
        monkeypatch.setattr(runner_module, "load_engine", testing.fake_engine_factory())
        return CliRunner().invoke(app, ["run", "--max-new-tokens", "3", *args])

    out = tmp_path / "hisparse-out"
    assert invoke("docs/a.txt").exit_code == 0
    first = (out / "a.txt").read_text()
    assert invoke("other/a.txt").exit_code == 0
    assert (out / "a.txt").read_text() == first
    assert [r["id"] for r in lines(tmp_path)] == ["a", "other-a"]
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text("jobs:\n  - id: a\n    input: other/a.txt\n")
    result = invoke("--manifest", str(manifest))
    assert result.exit_code == 0
    assert "a.txt holds earlier job a's result" in " ".join(result.stderr.split())
    # A document moved away leaves its id and a.txt behind: a new document still avoids it.
    (tmp_path / "moved").mkdir()
    (tmp_path / "docs" / "a.txt").rename(tmp_path / "moved" / "a.txt")
    (tmp_path / "third").mkdir()
    (tmp_path / "third" / "a.txt").write_text("a third document\n")
    assert invoke("third/a.txt").exit_code == 0
    assert lines(tmp_path)[-1]["id"] == "third-a"
    (tmp_path / "moved" / "a.txt").rename(tmp_path / "docs" / "a.txt")
    # Another id writing the same file (an explicit output) warns too.
    manifest.write_text("jobs:\n  - id: z\n    input: docs/a.txt\n    output: other-a\n")
    result = invoke("--manifest", str(manifest))
    assert result.exit_code == 0
    assert "other-a.txt holds earlier job other-a's result" in " ".join(result.stderr.split())


def test_changed_settings_redo_all(run):
    run()
    result, seen = run("--temperature", "0.3")
    assert seen == ["a", "b", "c"]
    stderr = " ".join(result.stderr.split())  # the earlier answers' files are replaced: said
    for name in ("a", "b", "c"):
        assert f"{name}: hisparse-out/{name}.txt holds this job's earlier answer" in stderr
    assert run("--temperature", "0.3", "--top-k-tokens", "1024")[1] == ["a", "b", "c"]
    assert run("--temperature", "0.3", "--top-k-tokens", "1024", "--max-batch", "2")[1] == []


def test_the_replaced_answer_warning_names_the_settings_that_changed(run, tmp_path):
    """Fresh-user finding: a re-run with other settings said the earlier answers were
    made "with other settings or document content", not which. It names each changed
    setting with its old and new value (the line keeps its settings), the first three and
    how many more, and an edited document by name; a change common to several jobs is named
    in full once, the other jobs referring to the first."""
    run()
    result, seen = run("--top-k-tokens", "1024", "--temperature", "0.3")
    assert seen == ["a", "b", "c"]
    stderr = " ".join(result.stderr.split())
    assert (
        "a: hisparse-out/a.txt holds this job's earlier answer, made with other "
        "settings (temperature 0.0 -> 0.3, top_k 2048 -> 1024); this run replaces it"
    ) in stderr, stderr
    for name in ("b", "c"):  # the same change of a whole batch: named once
        assert (
            f"{name}: hisparse-out/{name}.txt holds this job's earlier answer, made with other "
            "settings (as for a); this run replaces it"
        ) in stderr, stderr
    assert stderr.count("temperature 0.0 -> 0.3") == 1, stderr
    (tmp_path / "docs" / "b.txt").write_text("document b, edited\n")
    args = ("--top-k-tokens", "512", "--temperature", "0.5", "--top-p", "0.9", "--top-k", "40")
    result, seen = run(*args, "--max-new-tokens", "4")
    stderr = " ".join(result.stderr.split())
    assert (  # the job's top_k beside the engine's: told apart
        "b: hisparse-out/b.txt holds this job's earlier answer, made with other settings "
        "(temperature 0.3 -> 0.5, top_p 1.0 -> 0.9, top_k (sampling) 0 -> 40 and 2 more) "
        "and an earlier version of docs/b.txt; this run replaces it"
    ) in stderr, stderr
    assert all(line["settings_hash"] for line in lines(tmp_path))


def test_another_encoding_keeps_the_jobs_whose_byte_order_mark_decides(run, tmp_path):
    """A file that starts with a byte-order mark is read in the mark's encoding whatever
    ``--encoding`` says: another ``--encoding`` does not redo its job (its key records the
    mark's codec), nor one refused for its content; a file without a mark, whose text it
    changes, is redone and the warning names the change."""
    docs = tmp_path / "docs"
    (docs / "a.txt").write_bytes(codecs.BOM_UTF16_LE + "document a\n".encode("utf-16-le"))
    (docs / "b.txt").write_bytes(codecs.BOM_UTF8 + "document b \u00e9\n".encode())
    (docs / "c.txt").write_bytes("document c \u00e9\n".encode())
    (docs / "d.txt").write_bytes(codecs.BOM_UTF8 + b"\xff invalid\n")  # fails for its content
    result, seen = run()
    assert result.exit_code == 1 and seen == ["a", "b", "c"]
    encodings = {r["id"]: r["settings"]["text"]["encoding"] for r in lines(tmp_path)}
    assert encodings == {"a": "utf-16-le", "b": "utf-8", "c": "utf-8", "d": "utf-8"}
    result, seen = run("--encoding", "latin-1")
    assert result.exit_code == 1 and seen == ["c"]
    stderr = " ".join(result.stderr.split())
    assert "made with other settings (encoding utf-8 -> latin-1)" in stderr, stderr
    assert "d: " in stderr and "not tried again" in stderr, stderr
    assert "a: " not in stderr and "b: " not in stderr, stderr
    result, seen = run("--encoding", "utf-16")  # c.txt is not UTF-16: refused
    assert seen == [] and [r["id"] for r in lines(tmp_path)].count("a") == 1


def test_a_line_without_its_settings_names_engine_changes_from_config_json(run, tmp_path):
    """Lines written before lines kept their settings have only their hash: where
    config.json's engine settings give that hash (only they changed), those are named;
    else the warning says the line does not record which."""
    run()
    results = tmp_path / "hisparse-out" / "results.jsonl"
    old = [{k: v for k, v in line.items() if k != "settings"} for line in lines(tmp_path)]
    results.write_text("".join(json.dumps(line) + "\n" for line in old))
    result, _ = run("--top-k-tokens", "1024")
    stderr = " ".join(result.stderr.split())
    words = "a.txt holds this job's earlier answer, made with other settings (top_k 2048 -> 1024)"
    assert words in stderr, stderr
    old = [{k: v for k, v in line.items() if k != "settings"} for line in lines(tmp_path)]
    results.write_text("".join(json.dumps(line) + "\n" for line in old))
    result, _ = run("--top-k-tokens", "1024", "--temperature", "0.3")  # not in config.json
    stderr = " ".join(result.stderr.split())
    assert (
        "a.txt holds this job's earlier answer, made with other settings (which: not recorded "
        "on its results.jsonl line)"
    ) in stderr, stderr


def test_all_skipped_run_keeps_the_config_of_the_run_that_wrote_the_results(run, tmp_path):
    config = tmp_path / "hisparse-out" / "config.json"
    run()
    first = config.read_text()
    assert run("--max-batch", "2")[1] == []  # output-neutral: every job skipped
    assert config.read_text() == first
    assert run("--temperature", "0.3", "--max-batch", "2")[1] == ["a", "b", "c"]
    assert json.loads(config.read_text())["engine"]["max_batch"] == 2


def test_failed_jobs_are_redone(run):
    result, _ = run(engine_kwargs={"fail": {"b": "boom"}})
    assert result.exit_code == 1
    result, seen = run()
    assert result.exit_code == 0 and seen == ["b"]


def test_failed_rerun_flags_the_earlier_output(run, tmp_path):
    run()
    before = (tmp_path / "hisparse-out" / "b.txt").read_text()
    result, _ = run("--temperature", "0.3", engine_kwargs={"fail": {"b": "boom"}})
    assert result.exit_code == 1
    last = lines(tmp_path)[-3:]
    assert {r["id"]: r.get("earlier_output") for r in last} == {"a": None, "b": True, "c": None}
    assert (tmp_path / "hisparse-out" / "b.txt").read_text() == before  # nothing lost
    assert "b.txt is an earlier run's output" in " ".join(result.stderr.split())


def test_force_redoes_everything(run):
    run()
    assert run("--force")[1] == ["a", "b", "c"]


def test_truncated_last_line_is_ignored_with_warning(run, tmp_path):
    run()
    path = tmp_path / "hisparse-out" / "results.jsonl"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])  # kill -9 in the middle of writing c's line
    result, seen = run()
    assert seen == ["c"]
    assert "truncated last line 3" in result.stderr
    records = lines_tolerant(path)
    assert [r["id"] for r in records] == ["a", "b", "c"]
    assert path.read_bytes().endswith(b"\n")


def test_a_half_written_last_line_is_set_aside_and_the_file_stays_json_lines(run, tmp_path):
    """Fresh-user finding: after ``{"id": "half", "ok": tr`` (no newline) the run warned,
    then appended a newline and its lines after the half line, and every later run said
    ``ignoring line N: not a JSON object with an id``. The half line now goes to
    results.jsonl.partial, said on stderr, and every line of results.jsonl is JSON."""
    run()
    path = tmp_path / "hisparse-out" / "results.jsonl"
    before = path.read_bytes()
    path.write_bytes(before + b'{"id": "half", "ok": tr')
    result, seen = run("--force")
    assert result.exit_code == 0, result.output
    assert seen == ["a", "b", "c"]
    partial = tmp_path / "hisparse-out" / "results.jsonl.partial"
    err = " ".join(result.stderr.split())
    assert "warning: hisparse-out/results.jsonl: truncated last line 4 (interrupted write): " in err
    assert "moved its 24 bytes to hisparse-out/results.jsonl.partial (a new file)" in err
    assert partial.read_bytes() == b'{"id": "half", "ok": tr\n'
    assert path.read_bytes().startswith(before)
    assert [r["id"] for r in lines(tmp_path)] == ["a", "b", "c", "a", "b", "c"]  # all JSON
    again, seen = run()
    assert again.exit_code == 0 and seen == []
    assert "results.jsonl" not in again.stderr
    assert partial.read_bytes() == b'{"id": "half", "ok": tr\n'


def lines_tolerant(path):
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def test_results_txt_written_before_line(run, tmp_path):
    run()
    for record in lines(tmp_path):
        assert (tmp_path / "hisparse-out" / record["output"]).read_text() == record["text"]


def test_deleted_output_file_is_redone(run, tmp_path):
    run()
    (tmp_path / "hisparse-out" / "b.txt").unlink()
    result, seen = run()
    assert result.exit_code == 0 and seen == ["b"]
    assert (tmp_path / "hisparse-out" / "b.txt").is_file()
    assert run()[1] == []


def test_prompt_too_long_is_final_and_not_retried(run, tmp_path):
    """Issue #19.6: a job refused for its length was re-attempted on every resume (model
    reloaded, one more line each time). Now it is recorded as final for its key, shown
    as failed without a new line, and retried only with --retry-failed or --force."""
    result, seen = run(engine_kwargs={"limit": 6})  # prompts are longer than 6 - 3 words
    assert result.exit_code == 1 and seen == ["a", "b", "c"]
    first = lines(tmp_path)
    assert [r["final"] for r in first] == ["prompt"] * 3
    result, seen = run(engine_kwargs={"limit": 6})
    assert result.exit_code == 1, result.output
    assert seen == [] and "loading model" not in result.stdout
    assert "not tried again" in result.stderr and "--retry-failed" in result.stderr
    assert lines(tmp_path) == first
    result, seen = run("--retry-failed")  # a longer context: they run now
    assert result.exit_code == 0 and seen == ["a", "b", "c"]
    assert [r["ok"] for r in lines(tmp_path)] == [True] * 3  # superseded failures compacted
    result, seen = run("--max-new-tokens", "4")  # earlier successful lines stay
    assert seen == ["a", "b", "c"]
    assert [r["ok"] for r in lines(tmp_path)] == [True] * 6


def test_runtime_errors_stay_retryable(run, tmp_path):
    result, seen = run(engine_kwargs={"fail": {"b": "device lost"}})
    assert result.exit_code == 1
    assert [r.get("final") for r in lines(tmp_path) if r["id"] == "b"] == [None]
    result, seen = run()
    assert result.exit_code == 0 and seen == ["b"]


def test_document_refused_for_its_content_is_final_until_it_changes(run, tmp_path):
    (tmp_path / "docs" / "b.txt").write_text("   \n")
    result, seen = run()
    assert result.exit_code == 1 and seen == ["a", "c"]
    (failed,) = [r for r in lines(tmp_path) if not r["ok"]]
    assert failed["id"] == "b" and failed["final"] == "input" and failed["key"]
    result, seen = run()
    assert result.exit_code == 1 and seen == [] and len(lines(tmp_path)) == 3
    assert "only whitespace" in result.stderr and "not tried again" in result.stderr
    result, seen = run("--force")  # fails again: its new line replaces the old one
    b_lines = [r for r in lines(tmp_path) if r["id"] == "b"]
    assert result.exit_code == 1 and len(b_lines) == 1 and b_lines[0]["final"] == "input"
    (tmp_path / "docs" / "b.txt").write_text("document b, now with text\n")
    result, seen = run()
    assert result.exit_code == 0 and seen == ["b"]
    b_lines = [r for r in lines(tmp_path) if r["id"] == "b"]  # the failure compacted
    assert [r["ok"] for r in b_lines] == [True]
