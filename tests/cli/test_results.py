"""results.jsonl and .txt outputs: atomic writes, appends, truncated lines, resume keys."""

from __future__ import annotations

import errno
import json
import os

import pytest

from engine.config import EngineConfig, SamplingParams
from engine.events import CacheStats, JobResult
from hisparse_cli import results
from hisparse_cli.keys import (
    job_key,
    model_fingerprint,
    record_hash,
    setting_changes,
    settings_hash,
    settings_record,
)
from hisparse_cli.results import (
    OutputDirBusy,
    ResultsLog,
    WriteFailed,
    failure_record,
    lock_output_dir,
    read_results,
    result_record,
    write_text_atomic,
)
from hisparse_cli.tasks import TaskSpec


def ok_line(job_id, key="k", text="t"):
    return {"id": job_id, "key": key, "finish_reason": "stop", "error": "", "text": text}


def test_write_text_atomic_replaces_and_leaves_no_temp(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    write_text_atomic(target, "new ünïcode\n")
    assert target.read_text(encoding="utf-8") == "new ünïcode\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_write_text_atomic_keeps_old_file_when_write_fails(tmp_path, monkeypatch):
    target = tmp_path / "out.txt"
    target.write_text("old")

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(results.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        write_text_atomic(target, "new")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_a_full_disk_names_the_file_meant_and_leaves_no_temp(tmp_path, monkeypatch):
    """ENOSPC in an atomic write: a :class:`WriteFailed` naming the target (not the
    temporary file) and the full disk, the old file as it was, no temporary file left."""
    target = tmp_path / "out.txt"
    target.write_text("old")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(results.os, "fsync", full)
    with pytest.raises(WriteFailed) as caught:
        write_text_atomic(target, "new")
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(target)
    message = f"cannot write {target} (No space left on device: the disk is full); free space"
    assert str(caught.value).startswith(message)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_an_append_cut_short_by_a_full_disk_is_taken_back(tmp_path, monkeypatch):
    """Half a line written, then ENOSPC: the bytes are cut off again (the file keeps only
    complete lines) and :class:`WriteFailed` names ``results.jsonl``."""
    with ResultsLog(tmp_path) as log:
        log.append(ok_line("a"))
    before = (tmp_path / "results.jsonl").read_bytes()
    real_write = os.write

    def full(fd, data):
        real_write(fd, bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(results.os, "write", full)
    with ResultsLog(tmp_path) as log, pytest.raises(WriteFailed) as caught:
        log.append(ok_line("b"))
    assert caught.value.filename == str(tmp_path / "results.jsonl")
    assert (tmp_path / "results.jsonl").read_bytes() == before


def test_append_is_one_write_per_line_with_fsync(tmp_path, monkeypatch):
    writes, syncs = [], []
    real_write, real_fsync = os.write, os.fsync
    monkeypatch.setattr(
        results.os, "write", lambda fd, data: writes.append(data) or real_write(fd, data)
    )
    monkeypatch.setattr(results.os, "fsync", lambda fd: syncs.append(fd) or real_fsync(fd))
    with ResultsLog(tmp_path) as log:
        log.append(ok_line("a"))
        log.append(ok_line("b"))
    assert len(writes) == 2 and len(syncs) == 2
    assert all(w.endswith(b"\n") and w.count(b"\n") == 1 for w in writes)
    flags, real_open = [], os.open
    monkeypatch.setattr(
        results.os, "open", lambda path, f, mode=0o777: flags.append(f) or real_open(path, f, mode)
    )
    with ResultsLog(tmp_path) as log:
        log.append(ok_line("c"))
    assert flags[0] & os.O_APPEND


def test_truncated_last_line_is_ignored_and_next_append_starts_a_new_line(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps(ok_line("a")) + "\n" + '{"id": "b", "key": "k", "fini')
    existing = read_results(path)
    assert list(existing.latest) == ["a"]
    assert any("truncated last line 2" in w for w in existing.warnings)
    with ResultsLog(tmp_path) as log:
        log.append(ok_line("b"))
    lines = path.read_text().split("\n")
    assert json.loads(lines[2])["id"] == "b"
    assert list(read_results(path).latest) == ["a", "b"]
    assert read_results(path).warnings[0].endswith("ignoring line 2: not a JSON object with an id")


def test_a_truncated_last_line_is_moved_to_a_partial_file(tmp_path):
    """Fresh-user finding: the half line stayed in results.jsonl for ever, the next line
    appended after it, so every later run warned about it and jq or pandas could not read
    the file. Its bytes go to a new results.jsonl.partial (never over an earlier one) and
    results.jsonl is cut back to its last complete line."""
    path = tmp_path / "results.jsonl"
    complete = json.dumps(ok_line("a")) + "\n"
    path.write_text(complete + '{"id": "half", "ok": tr')
    with ResultsLog(tmp_path) as log:
        assert log.existing.truncated_tail == b'{"id": "half", "ok": tr'
        note = log.set_aside_broken_lines()
        assert note == (
            f"{path}: truncated last line 2 (interrupted write): moved its 24 bytes to "
            f"{tmp_path / 'results.jsonl.partial'} (a new file); results.jsonl now holds only "
            "its complete lines"
        )
        assert log.existing.truncated_tail == b'{"id": "half", "ok": tr'  # its .txt: replaceable
        assert path.read_text() == complete
        log.append(ok_line("b"))
    assert (tmp_path / "results.jsonl.partial").read_bytes() == b'{"id": "half", "ok": tr\n'
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()] == ["a", "b"]
    assert read_results(path).warnings == ()
    with ResultsLog(tmp_path) as log:  # nothing to do: no new file
        assert log.set_aside_broken_lines() is None
    path.write_bytes(path.read_bytes() + b'{"id": "c", "te')  # cut short again
    with ResultsLog(tmp_path) as log:
        assert "results.jsonl.partial.2 (a new file)" in log.set_aside_broken_lines()
    assert (tmp_path / "results.jsonl.partial").read_bytes() == b'{"id": "half", "ok": tr\n'
    assert (tmp_path / "results.jsonl.partial.2").read_bytes() == b'{"id": "c", "te\n'
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()] == ["a", "b"]


def test_a_cut_line_in_the_middle_is_moved_too_and_other_lines_stay(tmp_path):
    """What earlier versions left (a half line, then the next run's lines after it): the
    half line goes to the .partial file; a JSON line that is not a record stays, warned
    about, as it is."""
    path = tmp_path / "results.jsonl"
    first, last = json.dumps(ok_line("a")), json.dumps(ok_line("b"))
    path.write_text(f'{first}\n{{"id": "half", "ok": tr\n["not", "a", "record"]\n{last}\n')
    with ResultsLog(tmp_path) as log:
        note = log.set_aside_broken_lines()
        assert "results.jsonl: line 2 (not JSON: a line cut short, with lines appended" in note
        assert list(log.latest) == ["a", "b"]
        assert log.existing.warnings == (f"{path}: ignoring line 2: not a JSON object with an id",)
    assert path.read_text() == f'{first}\n["not", "a", "record"]\n{last}\n'
    assert (tmp_path / "results.jsonl.partial").read_text() == '{"id": "half", "ok": tr\n'


def test_the_note_counts_the_bytes_the_partial_file_holds(tmp_path):
    """The note's byte count is what the .partial file holds: each moved line with the
    newline written after it (it gave the lines' bytes alone: 23 for a 24-byte file)."""
    path = tmp_path / "results.jsonl"
    first, last = json.dumps(ok_line("a")), json.dumps(ok_line("b"))
    path.write_text(f'{first}\n{{"id": "half", "ok": tr\n{last}\n{{"id": "c", "te')
    with ResultsLog(tmp_path) as log:
        note = log.set_aside_broken_lines()
    size = (tmp_path / "results.jsonl.partial").stat().st_size
    assert size == len('{"id": "half", "ok": tr\n{"id": "c", "te\n')
    assert f"moved their {size} bytes to " in note


def test_last_line_per_id_wins_and_done_needs_success_and_key(tmp_path):
    path = tmp_path / "results.jsonl"
    lines = [
        ok_line("a", key="old"),
        ok_line("a", key="new"),
        ok_line("b"),
        {**ok_line("b"), "finish_reason": "error", "error": "boom"},
        {**ok_line("c"), "finish_reason": "cancelled"},
        {**ok_line("d"), "finish_reason": "length"},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    log = ResultsLog(tmp_path)
    assert log.is_done("a", "new") and not log.is_done("a", "old")
    assert not log.is_done("b", "k")
    assert not log.is_done("c", "k")
    assert log.is_done("d", "k")
    assert not log.is_done("missing", "k")


def test_result_and_failure_records_have_all_fields():
    base = {
        "id": "j",
        "output": "j.txt",
        "input": ["/d/j.txt"],
        "input_sha256": ["ab"],
        "key": "k",
        "settings_hash": "s",
        "model": "m",
    }
    result = JobResult("j", "hi", (5, 6, 7), 40, "stop", 0.5, 80.0, 12.0, CacheStats(3, 1, 12288, 2))
    record = result_record(base, result)
    expected = {
        "id",
        "input",
        "input_sha256",
        "settings_hash",
        "prompt_tokens",
        "generated_tokens",
        "text",
        "finish_reason",
        "ttft_s",
        "prefill_tok_s",
        "decode_tok_s",
        "cache",
        "error",
        "model",
        "finished_at",
        "ok",
        "key",
        "output",
    }
    assert expected <= set(record)
    assert record["generated_tokens"] == 3 and record["ok"] is True
    assert record["cache"] == {
        "hits": 3,
        "misses": 1,
        "hit_rate": 0.75,
        "prefetched": 2,
        "h2d_bytes": 12288,
    }
    failed = failure_record(base, "too long")
    assert (
        failed["ok"] is False
        and failed["error"] == "too long"
        and failed["finish_reason"] == "error"
    )
    assert failed["prompt_tokens"] is None  # unknown: never tokenised
    assert failure_record({**base, "prompt_tokens": 812}, "too long")["prompt_tokens"] == 812
    json.dumps(record), json.dumps(failed)


def test_lock_refuses_a_second_holder(tmp_path):
    with lock_output_dir(tmp_path):
        other = os.open(tmp_path / results.LOCK_FILE, os.O_RDWR)
        import fcntl

        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(other)


def test_lock_reports_busy(tmp_path, monkeypatch):
    import fcntl

    def busy(fd, op):
        raise BlockingIOError

    monkeypatch.setattr(fcntl, "flock", busy)
    with pytest.raises(OutputDirBusy), lock_output_dir(tmp_path):
        pass


# ----------------------------------------------------------------------------- keys


def test_settings_hash_tracks_what_changes_output():
    task, sampling, config = TaskSpec(), SamplingParams(), EngineConfig()
    base = settings_hash(task, sampling, "m", config, {"encoding": "utf-8", "errors": "strict"})
    opts = {"encoding": "utf-8", "errors": "strict"}
    changed = [
        settings_hash(TaskSpec("answer", question="q"), sampling, "m", config, opts),
        settings_hash(task, SamplingParams(temperature=0.5), "m", config, opts),
        settings_hash(task, SamplingParams(seed=1), "m", config, opts),
        settings_hash(task, sampling, "other", config, opts),
        settings_hash(task, sampling, "m", config.replace(top_k=1024), opts),
        settings_hash(task, sampling, "m", config.replace(attention="dense"), opts),
        settings_hash(task, sampling, "m", config, {"encoding": "latin-1", "errors": "strict"}),
        settings_hash(
            task, sampling, "m", config.replace(kv_host_dtype="fp8", hot_buffer_dtype="fp8"), opts
        ),
    ]
    assert base not in changed and len(set(changed)) == len(changed)
    neutral = config.replace(max_batch=2, device_buffer=8192, trace_path="t")
    assert settings_hash(task, sampling, "m", neutral, opts) == base


def test_setting_changes_name_each_changed_setting_as_a_results_line_keeps_it():
    """A job's line keeps its settings record (what settings_hash hashes); read back from
    JSON it hashes the same and differs from the in-memory record in nothing, and a change
    is named with its old and new value."""
    opts = {"encoding": "utf-8", "errors": "strict"}
    task, sampling, config = TaskSpec(), SamplingParams(stop=("END",)), EngineConfig()
    record = settings_record(task, sampling, "m", config, opts)
    assert record_hash(record) == settings_hash(task, sampling, "m", config, opts)
    stored = json.loads(json.dumps(record))
    assert record_hash(stored) == record_hash(record) and setting_changes(stored, record) == []
    other = settings_record(
        TaskSpec("answer", question="Who signed?"),
        SamplingParams(max_tokens=64, top_k=40, stop=("END",)),
        "m",
        config.replace(top_k=1024, max_batch=2),  # max_batch: output-neutral, not named
        {"encoding": "latin-1", "errors": "strict"},
    )
    assert setting_changes(stored, other) == [
        "task summarize -> answer",
        'question unset -> "Who signed?"',
        "top_k (sampling) 0 -> 40",
        "max_new_tokens 256 -> 64",
        "top_k 2048 -> 1024",
        "encoding utf-8 -> latin-1",
    ]


def test_a_setting_added_later_keeps_earlier_keys_at_its_old_behaviour():
    """``hot_buffer_dtype`` (added after key version 1) enters the key only at fp8: a bf16
    run's key is the one it had before the setting existed, so finished jobs stay done."""
    from hisparse_cli.keys import output_settings

    config = EngineConfig(kv_host_dtype="fp8")
    assert "hot_buffer_dtype" not in output_settings(config)
    assert output_settings(config.replace(hot_buffer_dtype="fp8"))["hot_buffer_dtype"] == "fp8"
    assert set(output_settings(config)) | {"hot_buffer_dtype"} == set(
        output_settings(config.replace(hot_buffer_dtype="fp8"))
    )


def test_job_key_depends_on_inputs_in_order():
    assert job_key(["a", "b"], "s") != job_key(["b", "a"], "s")
    assert job_key(["a"], "s") != job_key(["a"], "t")
    assert job_key(["a"], "s") == job_key(["a"], "s")


def test_model_fingerprint_changes_when_file_changes(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"1234")
    first = model_fingerprint(str(model))
    model.write_bytes(b"123456")
    assert model_fingerprint(str(model)) != first
    assert model_fingerprint(None) == "embedded-default"


def test_done_needs_the_output_file(tmp_path):
    lines = [{**ok_line("a"), "output": "a.txt"}, {**ok_line("b"), "output": "b.txt"}]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "a.txt").write_text("t")
    log = ResultsLog(tmp_path)
    assert log.is_done("a", "k") and not log.is_done("b", "k")


def fail_line(job_id, key="k", error="boom", text="", final=None):
    return {
        "id": job_id, "key": key, "finish_reason": "error", "error": error, "text": text,
        "final": final,
    }


def test_compact_drops_only_superseded_failure_lines(tmp_path):
    """Issue #19.6: a job failing on every run appended a line each time; the superseded
    failure lines go, nothing with a result does. Issue #21: a cancelled job's partial text
    superseded by a later line goes too (Ctrl-C and resume piled them up)."""
    lines = [
        fail_line("a"),
        ok_line("a"),
        fail_line("b", error="first"),
        fail_line("b", error="second"),
        {**fail_line("c", text="partial"), "finish_reason": "cancelled"},
        ok_line("c"),
        ok_line("d", key="old"),
        ok_line("d", key="new"),
    ]
    path = tmp_path / "results.jsonl"
    body = "".join(json.dumps(x) + "\n" for x in lines) + "not json\n"
    path.write_text(body)
    log = ResultsLog(tmp_path)
    assert log.compact() == 3
    kept = path.read_text().splitlines()
    assert kept[-1] == "not json"
    assert [json.loads(x) for x in kept[:-1]] == [lines[1], lines[3], *lines[5:]]
    assert ResultsLog(tmp_path).compact() == 0
    assert read_results(path).latest == ResultsLog(tmp_path).existing.latest


def test_final_failure_needs_same_key_and_kind(tmp_path):
    path = tmp_path / "results.jsonl"
    rows = [fail_line("a", final="prompt"), fail_line("b"), fail_line("c", final="input")]
    path.write_text("".join(json.dumps(x) + "\n" for x in rows))
    log = ResultsLog(tmp_path)
    assert log.final_failure("a", "k", "prompt")["error"] == "boom"
    assert log.final_failure("a", "other", "prompt") is None
    assert log.final_failure("a", "k", "input") is None
    assert log.final_failure("b", "k", "prompt") is None  # a runtime error: retried
    assert log.final_failure("c", "k", "input") is not None
    assert failure_record({"id": "x", "final": "prompt"}, "e")["final"] == "prompt"
    assert failure_record({"id": "x"}, "e")["final"] is None
