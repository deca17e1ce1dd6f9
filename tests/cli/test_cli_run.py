"""``hisparse run`` end to end through Typer's CliRunner, with a scripted fake engine."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from engine.config import ConfigError, job_seed
from hisparse_cli import runner as runner_module
from hisparse_cli import settings, testing
from hisparse_cli.main import app
from hisparse_cli.tasks import SUMMARIZE_INSTRUCTION, SYSTEM_PROMPT
from hisparse_cli.testing import FakeTokenizer

REAL_LOAD_ENGINE = runner_module.load_engine  # before any fixture replaces it


def read_results(folder):
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def test_help_lists_commands_and_is_typer_only():
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("run", "presets", "plan"):
        assert command in result.stdout
    run_help = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"})
    assert "--top-k-tokens" in run_help.stdout and "--top-k " in run_help.stdout
    assert "--manifest" in run_help.stdout and "--json-progress" in run_help.stdout


def test_help_does_not_import_the_engine_runtime():
    code = (
        "import sys, hisparse_cli.main; print('engine.load' in sys.modules, 'torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=os.getcwd()
    )
    assert done.stdout.strip() == "False False", done.stderr


def test_run_writes_results_texts_and_config(cli, docs, tmp_path):
    result = cli(
        "docs/alpha.txt", "docs/beta.txt", "--max-new-tokens", "4", "--top-k-tokens", "512"
    )
    assert result.exit_code == 0, result.output
    out = tmp_path / "hisparse-out"
    records = read_results(out)
    assert [r["id"] for r in records] == ["alpha", "beta"]
    assert all(
        r["ok"] and r["generated_tokens"] == 4 and r["finish_reason"] == "length" for r in records
    )
    assert (out / "alpha.txt").read_text() == "output of alpha: 4 tokens"
    config = json.loads((out / "config.json").read_text())
    assert config["engine"]["top_k"] == 512 and config["preset"] == "cpu"
    assert "done alpha" in result.stdout and "jobs ok" in result.stdout


def test_superpage_metadata_on_the_cpu_says_it_is_slower(cli, docs):
    """A fresh user found ``--page-metadata superpage`` decoding slower on the CPU with
    nothing saying why; the run now says so (and only where it applies)."""
    result = cli("docs/alpha.txt", "--max-new-tokens", "2", "--page-metadata", "superpage")
    assert result.exit_code == 0, result.output
    assert "superpage on the CPU decodes slower than exact" in " ".join(result.stderr.split())
    result = cli("docs/beta.txt", "--max-new-tokens", "2")
    assert "superpage" not in result.stderr
    # --print-config says it too: on stderr and under "warnings"
    shown = cli("docs/alpha.txt", "--page-metadata", "superpage", "--print-config")
    assert shown.exit_code == 0, shown.output
    assert "superpage on the CPU decodes slower than exact" in " ".join(shown.stderr.split())
    assert "decodes slower than exact" in json.loads(shown.stdout)["warnings"][0]
    assert "warnings" not in json.loads(cli("docs/alpha.txt", "--print-config").stdout)


def test_engine_receives_rendered_prompt_and_sampling(cli, docs):
    result = cli(
        "docs/alpha.txt", "--temperature", "0.5", "--seed", "3", "--stop", "END", "--stop", "###"
    )
    assert result.exit_code == 0, result.output
    (engine,) = cli.factory.engines
    (job,) = engine.seen
    tokenizer = testing.FakeTokenizer()
    document = (docs / "alpha.txt").read_text()
    expected = tokenizer.encode_chat(
        [
            {"role": "system", "content": SYSTEM_PROMPT},
            {
                "role": "user",
                "content": f"<document>\n{document}\n</document>\n\n{SUMMARIZE_INSTRUCTION}",
            },
        ]
    )
    assert list(job.prompt_ids) == expected
    assert (
        job.sampling.temperature == 0.5
        and job.sampling.seed == 3
        and job.sampling.stop == ("END", "###")
    )
    assert job.meta["key"] and job.input_path.endswith("alpha.txt")


def test_failed_job_gives_exit_1_and_batch_continues(cli, docs, tmp_path):
    engine = testing.fake_engine_factory(fail={"alpha": "prompt of 9999 tokens is too long"})
    result = cli("docs/alpha.txt", "docs/beta.txt", engine=engine)
    assert result.exit_code == 1
    records = {r["id"]: r for r in read_results(tmp_path / "hisparse-out")}
    assert (
        records["alpha"]["error"] == "prompt of 9999 tokens is too long"
        and not records["alpha"]["ok"]
    )
    assert records["beta"]["ok"]
    assert not (tmp_path / "hisparse-out" / "alpha.txt").exists()
    assert "FAILED alpha" in result.stderr and "FAILED" not in result.stdout  # an error


def test_failed_records_carry_the_prompt_tokens_when_known(cli, docs, tmp_path):
    (docs / "long.txt").write_text(" ".join(f"word{i}" for i in range(400)) + "\n")
    (docs / "blob.txt").write_bytes(b"\x00\x01\x02\x00" * 64)
    engine = testing.fake_engine_factory(limit=300)
    result = cli(
        "docs/long.txt", "docs/blob.txt", "docs/beta.txt", "--max-new-tokens", "4", engine=engine
    )
    assert result.exit_code == 1
    records = {r["id"]: r for r in read_results(tmp_path / "hisparse-out")}
    (long_job,) = [j for j in engine.engines[0].seen if j.id == "long"]
    assert "exceeds the context limit" in records["long"]["error"]
    assert records["long"]["prompt_tokens"] == len(long_job.prompt_ids) > 400
    assert records["blob"]["prompt_tokens"] is None  # never tokenised
    assert records["beta"]["ok"] and records["beta"]["prompt_tokens"] > 0


def test_bad_document_fails_its_job_only(cli, docs, tmp_path):
    (docs / "blob.txt").write_bytes(b"\x00\x01\x02\x00" * 64)
    (docs / "bad-utf8.txt").write_bytes(b"fine\n\xff")
    result = cli("docs/blob.txt", "docs/bad-utf8.txt", "docs/beta.txt")
    assert result.exit_code == 1
    records = {r["id"]: r for r in read_results(tmp_path / "hisparse-out")}
    assert "looks binary" in records["blob"]["error"]
    assert "byte offset 5" in records["bad-utf8"]["error"]
    assert records["beta"]["ok"]


def test_encoding_utf16_does_not_garble_the_other_files_of_the_batch(cli, docs, tmp_path):
    """Fresh-user finding: following the hint ``--encoding utf-16`` for a UTF-16 file in a
    mixed batch decoded the ASCII file beside it as CJK gibberish, which ran "ok". A
    byte-order mark now chooses the encoding by itself; a file without one that reads as
    UTF-8 is refused under ``--encoding utf-16``, naming why, and the rest runs."""
    (docs / "utf16.txt").write_bytes("Hello from a UTF-16 file.\n".encode("utf-16"))
    (docs / "even.txt").write_bytes(b"Dogs bark loudly at night!!\n")
    result = cli("--encoding", "utf-16", "-o", "out", "docs/utf16.txt", "docs/even.txt")
    assert result.exit_code == 1, result.output
    records = {r["id"]: r for r in read_results(tmp_path / "out")}
    assert records["utf16"]["ok"]
    assert not records["even"]["ok"] and records["even"]["final"] == "input"
    assert "even.txt: is not utf-16 text" in records["even"]["error"]
    assert "even.txt: is not utf-16 text" in " ".join(result.stderr.split())
    plain = cli("-o", "plain", "docs/utf16.txt", "docs/even.txt")  # no --encoding needed
    assert plain.exit_code == 0, plain.output
    assert all(r["ok"] for r in read_results(tmp_path / "plain"))


def test_allow_binary_reads_a_document_with_a_nul_and_warns(cli, docs, tmp_path):
    (docs / "note.txt").write_bytes(b"Notes\x00 on sorting.\n")
    refused = cli("docs/note.txt")
    assert refused.exit_code == 1
    (record,) = read_results(tmp_path / "hisparse-out")
    assert "note.txt" in record["error"] and "byte offset 5" in record["error"]
    assert "--allow-binary" in record["error"]
    result = cli("docs/note.txt", "--allow-binary")
    assert result.exit_code == 0, result.output
    assert "note.txt" in result.stderr and "read as text because of --allow-binary" in result.stderr
    assert read_results(tmp_path / "hisparse-out")[-1]["ok"]


def test_allow_binary_warnings_agree_and_an_all_nul_file_says_so(cli, docs, tmp_path):
    """Fresh-user findings: the binary warning gave the first NUL's offset and the removal
    warning the first control byte's, unnamed, so they seemed to disagree; an all-NUL file
    read with --allow-binary failed as ``empty or only whitespace``."""
    (docs / "mixed.txt").write_bytes(
        b"Status report: \x1b[1mbold\x1b[0m x\x00\x00\x00 more \x00\x00 ok\n"
    )
    (docs / "zeros.txt").write_bytes(b"\x00" * 64)
    result = cli("--allow-binary", "docs/mixed.txt", "docs/zeros.txt")
    assert result.exit_code == 1, result.output
    err = " ".join(result.stderr.split())
    assert "looks binary: 5 NUL bytes in the first 44 bytes (the first at byte offset 29)" in err
    assert "5 of them NUL bytes, the first at byte offset 29 (line 1)" in err
    records = {r["id"]: r for r in read_results(tmp_path / "hisparse-out")}
    assert records["mixed"]["ok"]
    assert records["zeros"]["error"] == (
        f"{docs / 'zeros.txt'}: has no text: only NUL/control bytes, which are removed "
        "(64 control character(s), 64 of them NUL)"
    )


def test_errors_replace_lets_invalid_utf8_through(cli, docs, tmp_path):
    (docs / "bad-utf8.txt").write_bytes(b"fine\n\xff")
    assert cli("docs/bad-utf8.txt", "--errors", "replace").exit_code == 0


def test_manifest_problems_exit_2_and_nothing_runs(cli, docs, tmp_path):
    (tmp_path / "jobs.yaml").write_text(
        textwrap.dedent(
            """
            jobs:
              - id: a
                input: docs/alpha.txt
                temperature: -1
              - id: a
                input: docs/nope.txt
            """
        ).lstrip()
    )
    result = cli("--manifest", "jobs.yaml")
    assert result.exit_code == 2
    assert "jobs.yaml:4: jobs[0].temperature" in result.stderr
    assert "jobs.yaml:6: jobs[1].input: file not found" in result.stderr
    assert not (tmp_path / "hisparse-out").exists()
    assert cli.factory.engines == []


def test_manifest_run_uses_its_settings(cli, docs, tmp_path):
    (tmp_path / "jobs.yaml").write_text(
        textwrap.dedent(
            """
            defaults:
              task: answer
              max_new_tokens: 3
              engine: {top_k: 1024}
            jobs:
              - {id: q1, input: docs/alpha.txt, question: "What is it about?", output: answer-one}
            """
        ).lstrip()
    )
    result = cli("--manifest", "jobs.yaml", "--output-dir", "out")
    assert result.exit_code == 0, result.output
    (record,) = read_results(tmp_path / "out")
    assert record["output"] == "answer-one.txt" and record["generated_tokens"] == 3
    assert (tmp_path / "out" / "answer-one.txt").exists()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["engine"]["top_k"] == 1024


def test_engine_setting_problems_are_reported_together_where_they_were_set(cli, docs, tmp_path):
    """Settings that clash only once manifest, preset and flags meet are all reported in
    one go: a manifest setting by file:line:field, a flag by its name."""
    (tmp_path / "jobs.yaml").write_text(
        textwrap.dedent(
            """
            defaults:
              engine:
                top_k: 4096
                device_buffer: 1000
            jobs:
              - {input: docs/alpha.txt}
            """
        ).lstrip()
    )
    result = cli("--manifest", "jobs.yaml", "--max-batch", "0")
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert lines[0] == "3 problem(s) in the engine settings; nothing was run:"
    assert "  command line: --max-batch: must be a positive integer, got 0" in lines
    located = [
        line for line in lines if line.startswith("  jobs.yaml:4: defaults.engine.device_buffer: ")
    ]
    assert len(located) == 2
    assert (
        "not a multiple of page_size=16" in located[0]
        and "raise device_buffer to at least" in located[1]
    )
    assert not (tmp_path / "hisparse-out").exists() and cli.factory.engines == []


def test_job_and_engine_setting_problems_come_in_one_report(cli, docs, tmp_path):
    """A bad job and settings that clash once combined are listed in the same report (the
    clash used to appear only after the job problems were fixed)."""
    (tmp_path / "jobs.yaml").write_text(
        textwrap.dedent(
            """
            defaults:
              engine:
                device_buffer: 512
            jobs:
              - {input: docs/alpha.txt}
              - {input: docs/missing.txt}
            """
        ).lstrip()
    )
    result = cli("--manifest", "jobs.yaml")  # the default top_k (2048) needs 128 pages
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert lines[0] == "2 problem(s) in the jobs; nothing was run:"
    assert any("jobs.yaml:6" in line and "missing.txt" in line for line in lines[1:])
    assert any(
        line.startswith("  jobs.yaml:3: defaults.engine.device_buffer: ")
        and "raise device_buffer to at least 2048 tokens (>= top_k)" in line
        for line in lines[1:]
    ), lines
    assert cli.factory.engines == []


def test_a_manifests_problems_and_clashes_come_in_line_order(cli, docs, tmp_path):
    """The clash of line 3's setting came after line 4's bad value and line 6's missing
    file: the clashes of the combined settings were appended to the sorted list."""
    (tmp_path / "jobs.yaml").write_text(
        "defaults:\n  engine:\n    device_buffer: 100\n    prefill_chunk: -3\n"
        "jobs:\n  - {input: docs/missing.txt}\n"
    )
    result = cli("--manifest", "jobs.yaml")
    assert result.exit_code == 2
    where = [line.split(": ")[0].strip() for line in result.stderr.splitlines()[1:]]
    assert where == ["jobs.yaml:3", "jobs.yaml:3", "jobs.yaml:4", "jobs.yaml:6"], result.stderr


@pytest.mark.parametrize(
    "args, phrase",
    [
        ([], "nothing to run"),
        (["docs/alpha.txt", "--manifest", "jobs.yaml"], "not both"),
        (["docs/alpha.txt", "--page-size", "7"], "--page-size: must be one of 16, 32, 64"),
        # 0 also broke a cross-field check's arithmetic (ZeroDivisionError, exit 1)
        (["docs/alpha.txt", "--page-size", "0"], "--page-size: must be one of 16, 32, 64"),
        (["docs/alpha.txt", "--top-k-tokens", "4096", "--device-buffer", "1024"], "device_buffer"),
        (["docs/alpha.txt", "--encoding", "klingon"], "unknown --encoding"),
        (["docs/alpha.txt", "--model", "missing.gguf"], "model not found"),
        (["docs/missing.txt"], "file not found"),
        (["docs/alpha.txt", "--task", "answer"], "--question"),
        (["docs/alpha.txt", "--trace", "docs/alpha.txt"], "already exists; a trace never replaces"),
        (["docs/alpha.txt", "--trace", "docs/alpha.txt/sel.jsonl"], "docs/alpha.txt is not a folder"),
        (["docs/alpha.txt", "--trace", "docs"], "is a directory"),
        # /proc takes no new files, though os.access says yes to root (fresh-user finding:
        # the run loaded the model, then failed every job)
        *([(["docs/alpha.txt", "--trace", "/proc/sel.jsonl"], "not writable")]
          if os.path.isdir("/proc/self") else []),
        (["docs/alpha.txt", "-o", "new", "--trace", "new/results.jsonl"], "would replace the run's results.jsonl"),
        (["docs/alpha.txt", "-o", "new", "--trace", "new/alpha.txt"], "would replace job 'alpha''s result file"),
        (["docs/alpha.txt", "-o", ""], "'--output-dir' / '-o': is empty"),
        (["docs/alpha.txt", "--trace", " "], "'--trace': is empty"),
        (["--manifest", ""], "'--manifest' / '-m': is empty"),
        (["docs/alpha.txt", "--model", ""], "'--model': is empty"),
    ],
)
def test_usage_errors_exit_2(cli, docs, args, phrase):
    result = cli(*args)
    assert result.exit_code == 2
    assert phrase in result.stderr


def test_typer_rejects_bad_choice_with_exit_2(cli, docs):
    result = cli("docs/alpha.txt", "--attention", "fuzzy")
    assert result.exit_code == 2


def test_print_config_precedence(cli, docs, tmp_path, monkeypatch):
    monkeypatch.setattr(
        settings, "preset_overrides", lambda name: {"top_k": 512, "page_size": 32, "max_batch": 2}
    )
    (tmp_path / "jobs.yaml").write_text(
        "defaults:\n  engine: {top_k: 1024, max_batch: 4}\njobs:\n  - {input: docs/alpha.txt}\n"
    )
    result = cli(
        "--manifest", "jobs.yaml", "--max-batch", "16", "--trace", "t.json", "--print-config"
    )
    assert result.exit_code == 0, result.output
    engine = json.loads(result.stdout)["engine"]
    assert engine["page_size"] == 32  # preset
    assert engine["top_k"] == 1024  # manifest beats preset
    assert engine["max_batch"] == 16  # flag beats manifest
    assert engine["trace_path"] == "t.json"
    assert not (tmp_path / "hisparse-out").exists()


def test_a_presets_sampling_block_is_each_jobs_default(cli, docs, tmp_path):
    """A fresh user's preset file set max_tokens 3 and a temperature, and run generated
    the built-in 256 greedy tokens: the block was checked, then ignored. It is the lowest
    layer of every job's sampling: manifest defaults, the job and flags beat it."""
    preset = yaml.safe_load((Path(__file__).parents[2] / "presets" / "cpu.yaml").read_text())
    preset["sampling"] = {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 7,
                          "stop": ["END"], "max_tokens": 3}  # fmt: skip
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(preset))
    args = ("--preset", "mine.yaml", "--print-config")
    (job,) = json.loads(cli("docs/alpha.txt", *args).stdout)["jobs"]
    assert job["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 7,
                               "stop": ["END"], "max_tokens": 3}  # fmt: skip
    (job,) = json.loads(cli("docs/alpha.txt", *args, "--max-new-tokens", "9").stdout)["jobs"]
    assert job["sampling"]["max_tokens"] == 9 and job["sampling"]["top_k"] == 5
    (tmp_path / "jobs.yaml").write_text(
        "defaults: {temperature: 0.0}\njobs:\n  - {input: docs/alpha.txt, top_k: 2}\n"
    )
    (job,) = json.loads(cli("--manifest", "jobs.yaml", *args).stdout)["jobs"]
    assert job["sampling"]["temperature"] == 0.0 and job["sampling"]["top_k"] == 2
    assert job["sampling"]["max_tokens"] == 3 and job["sampling"]["stop"] == ["END"]
    (tmp_path / "clear.yaml").write_text("jobs:\n  - {input: docs/alpha.txt, stop: []}\n")
    (job,) = json.loads(cli("--manifest", "clear.yaml", *args).stdout)["jobs"]
    assert job["sampling"]["stop"] == []  # a job can clear the preset's stop strings
    engine = testing.fake_engine_factory()
    result = cli("docs/alpha.txt", "--preset", "mine.yaml", "--device", "cpu", engine=engine)
    assert result.exit_code == 0, result.output
    (seen,) = engine.engines[0].seen
    assert seen.sampling.max_tokens == 3 and seen.sampling.temperature == 0.7


def test_print_config_lists_each_jobs_task_and_sampling(cli, docs, tmp_path):
    (tmp_path / "jobs.yaml").write_text(
        "defaults: {temperature: 0.5, max_new_tokens: 40, top_p: 0.9}\n"
        "jobs:\n"
        "  - {id: a, input: docs/alpha.txt, temperature: 0.9, seed: 7}\n"
        "  - {id: b, input: docs/beta.txt, task: answer, question: 'Why?'}\n"
    )
    result = cli("--manifest", "jobs.yaml", "--max-new-tokens", "12", "--print-config")
    assert result.exit_code == 0, result.output
    a, b = json.loads(result.stdout)["jobs"]
    assert (a["id"], a["task"], a["origin"]) == ("a", "summarize", "jobs.yaml:3")
    assert a["sampling"] == {
        "temperature": 0.9, "top_p": 0.9, "top_k": 0, "seed": 7, "stop": [], "max_tokens": 12
    }  # fmt: skip
    assert (b["task"], b["question"], b["output"]) == ("answer", "Why?", "b.txt")
    assert b["inputs"] == [str(tmp_path / "docs" / "beta.txt")]
    assert b["sampling"]["temperature"] == 0.5 and b["sampling"]["max_tokens"] == 12
    # no seed given: the one the engine derives from the job id, and where it came from
    assert (b["sampling"]["seed"], b["sampling"]["seed_from"]) == (job_seed("b"), "job id")
    assert job_seed("b") != job_seed("a")
    assert not (tmp_path / "hisparse-out").exists()


def test_print_config_names_where_each_sampling_value_was_set(cli, docs, tmp_path):
    """``sampling_from`` gives each sampling value's source truthfully: the flag, the
    manifest line (a job's own or its defaults), the preset's sampling block, or the
    default; before, a preset's default was only seen beside ``origin: command line``."""
    (tmp_path / "jobs.yaml").write_text(
        "defaults: {temperature: 0.5}\njobs:\n  - {id: a, input: docs/alpha.txt, top_k: 3}\n"
    )
    args = ("--preset", "cpu", "--device", "cpu", "--top-p", "0.9", "--print-config")
    (job,) = json.loads(cli("--manifest", "jobs.yaml", *args).stdout)["jobs"]
    assert job["sampling_from"] == {
        "max_tokens": "preset cpu's sampling.max_tokens",
        "temperature": "jobs.yaml:1 defaults.temperature",
        "top_k": "jobs.yaml:3 jobs[0].top_k",
        "top_p": "command line (--top-p)",
        "seed": "job id",
        "stop": "default",
    }
    (job,) = json.loads(cli("docs/alpha.txt", "--max-new-tokens", "9", *args).stdout)["jobs"]
    assert job["origin"] == "command line" and job["sampling"]["max_tokens"] == 9
    assert job["sampling_from"]["max_tokens"] == "command line (--max-new-tokens)"
    assert job["sampling_from"]["temperature"] == "preset cpu's sampling.temperature"


@pytest.mark.parametrize(
    "memories, flags, name",
    [
        ([], [], "cpu"),
        ([139.8], [], "h200"),
        ([139.8, 139.8], [], "h200x2"),
        ([47.4, 47.4], [], "dual4090"),
        ([23.6, 23.6], [], "dual4090-24"),
        ([47.4, 23.6], [], "dual4090-24"),  # the smaller card decides
        ([23.6, 23.6, 23.6, 23.6], [], "dual4090-24"),
        ([23.6], [], "h200"),  # one smaller card: the single-GPU preset
        ([10.0, 10.0], [], "h200"),
        ([139.8, 139.8], ["cuda:1"], "h200"),  # one device asked for
        ([139.8, 139.8], ["cpu"], "cpu"),
        ([47.4, 47.4], ["cuda:0", "cuda:1"], "dual4090"),
    ],
)
def test_auto_preset_matches_the_devices(memories, flags, name):
    from hisparse_cli.auto_preset import choose_preset

    assert choose_preset(memories, flags).name == name


def test_auto_preset_for_a_small_single_card_says_what_to_do():
    from hisparse_cli.auto_preset import choose_preset

    choice = choose_preset([23.6])
    assert "--memory-budget 23" in choice.reason and "h200" in choice.reason


def fake_cuda(monkeypatch, *memories):
    monkeypatch.setattr(runner_module, "cuda_device_count", lambda: len(memories))
    monkeypatch.setattr(runner_module, "cuda_device_memory_gib", lambda i: memories[i])


@pytest.mark.parametrize(
    "memories, name, devices",
    [
        ((), "cpu", []),
        ((139.8,), "h200", []),
        ((139.8, 139.8), "h200x2", ["cuda:0", "cuda:1"]),
        ((23.6, 23.6), "dual4090-24", ["cuda:0", "cuda:1"]),
    ],
)
def test_auto_is_the_default_preset_and_print_config_names_it(
    cli, docs, monkeypatch, memories, name, devices
):
    fake_cuda(monkeypatch, *memories)
    result = cli("docs/alpha.txt", "--print-config")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["preset"] == name and document["preset_auto"]
    assert document["engine"]["devices"] == devices


def test_auto_preset_is_recorded_in_config_json_and_shown_in_the_summary(cli, docs, tmp_path):
    result = cli("docs/alpha.txt")
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "hisparse-out" / "config.json").read_text())
    assert config["preset"] == "cpu" and config["preset_auto"] == "no CUDA device"
    assert "preset cpu (auto: no CUDA device)" in result.stdout  # loading line
    summary = result.stdout[result.stdout.index("summary") :]
    assert "cpu (auto: no CUDA device)" in summary
    progress = cli("docs/beta.txt", "--json-progress").stdout.splitlines()
    assert json.loads(progress[-1])["preset"] == "cpu (auto: no CUDA device)"


def test_an_explicit_preset_is_not_probed(cli, docs, monkeypatch):
    monkeypatch.setattr(runner_module, "cuda_device_count", lambda: pytest.fail("probed"))
    result = cli("docs/alpha.txt", "--preset", "cpu", "--print-config")
    assert result.exit_code == 0 and "preset_auto" not in json.loads(result.stdout)


@pytest.fixture
def policy_preset(monkeypatch):
    """A preset that sets truncate_keep and extend_method (as defaults)."""
    monkeypatch.setattr(
        settings,
        "preset_overrides",
        lambda name: {"truncate_keep": "tail", "extend_method": "linear"},
    )


def test_truncate_keep_and_extend_method_flags_follow_precedence(
    cli, docs, tmp_path, policy_preset
):
    (tmp_path / "jobs.yaml").write_text(
        "defaults:\n  engine: {truncate_keep: middle}\njobs:\n  - {input: docs/alpha.txt}\n"
    )

    def engine_of(*flags):
        result = cli("--manifest", "jobs.yaml", "--print-config", *flags)
        assert result.exit_code == 0, result.output
        engine = json.loads(result.stdout)["engine"]
        return engine["truncate_keep"], engine["extend_method"]

    assert engine_of() == ("middle", "linear")  # manifest beats preset
    # flags beat manifest and preset (each flag with the policy that uses it)
    assert engine_of("--truncate-keep", "head", "--context-policy", "truncate") == (
        "head",
        "linear",
    )
    assert engine_of("--extend-method", "dynamic", "--context-policy", "extend") == (
        "middle",
        "dynamic",
    )


@pytest.mark.parametrize(
    "args, flag, policy",
    [
        (["--truncate-keep", "tail"], "--truncate-keep", "'refuse' (the default)"),
        (["--extend-method", "linear"], "--extend-method", "'refuse' (the default)"),
        (
            ["--truncate-keep", "tail", "--context-policy", "extend"],
            "--truncate-keep",
            "'extend' (--context-policy)",
        ),
        (
            ["--extend-method", "dynamic", "--context-policy", "truncate"],
            "--extend-method",
            "'truncate' (--context-policy)",
        ),
    ],
)
def test_policy_flag_without_its_policy_exits_2(cli, docs, tmp_path, args, flag, policy):
    """--truncate-keep / --extend-method given where the context policy ignores them: a
    one-line error naming the flag, the policy in force and the one that would use it."""
    result = cli("docs/alpha.txt", *args)
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    needs = "truncate" if flag == "--truncate-keep" else "extend"
    assert line.startswith(f"error: {flag} ") and f"--context-policy {needs}" in line
    assert f"the context policy is {policy}" in line
    assert not (tmp_path / "hisparse-out").exists() and cli.factory.engines == []


def test_policy_keys_from_a_preset_or_manifest_are_defaults_not_errors(
    cli, docs, tmp_path, policy_preset, monkeypatch
):
    (tmp_path / "jobs.yaml").write_text(
        "defaults:\n  engine: {context_policy: truncate}\njobs:\n  - {input: docs/alpha.txt}\n"
    )
    assert cli("docs/alpha.txt").exit_code == 0  # preset keys, policy refuse: fine
    result = cli("--manifest", "jobs.yaml", "--truncate-keep", "middle", "--force")
    assert result.exit_code == 0, result.output  # the manifest's policy uses the flag
    monkeypatch.setattr(settings, "preset_overrides", lambda name: {"context_policy": "extend"})
    result = cli("docs/alpha.txt", "--truncate-keep", "tail")
    assert (
        result.exit_code == 2 and "the context policy is 'extend' (preset 'cpu')" in result.stderr
    )


@pytest.mark.parametrize("flag", ["--truncate-keep", "--extend-method"])
def test_truncate_keep_and_extend_method_reject_unknown_values(cli, docs, flag):
    result = cli("docs/alpha.txt", flag, "sideways")
    assert result.exit_code == 2 and "sideways" in result.output


def test_truncate_keep_flag_reaches_the_prompt_cut(cli, docs, tmp_path):
    (docs / "long.txt").write_text(" ".join(f"word{i}" for i in range(400)) + "\n")
    engine = testing.fake_engine_factory(limit=200)
    result = cli(
        "docs/long.txt",
        "--max-new-tokens",
        "4",
        "--context-policy",
        "truncate",
        "--truncate-keep",
        "tail",
        engine=engine,
    )
    assert result.exit_code == 0, result.output
    assert "(kept the tail)" in result.stderr
    (job,) = engine.engines[0].seen
    assert len(job.prompt_ids) <= 200 - 4


@pytest.mark.parametrize("keep", ["head", "tail", "middle"])
def test_truncated_jobs_say_so_in_results(cli, docs, tmp_path, keep):
    """A job whose document was cut records the part kept and the document's token
    counts before and after the cut; a job that fit records ``truncated: null``."""
    (docs / "long.txt").write_text(" ".join(f"word{i}" for i in range(400)) + "\n")
    engine = testing.fake_engine_factory(limit=200)
    args = ["--max-new-tokens", "4", "--context-policy", "truncate", "--truncate-keep", keep]
    result = cli("docs/long.txt", "docs/alpha.txt", *args, engine=engine)
    assert result.exit_code == 0, result.output
    records = {r["id"]: r for r in read_results(tmp_path / "hisparse-out")}
    cut = records["long"]["truncated"]
    assert cut["keep"] == keep and cut["original_tokens"] == 400  # one token per word
    assert 0 < cut["kept_tokens"] < 400
    words = {
        "head": "kept the head",
        "tail": "kept the tail",
        "middle": "kept both ends, cut the middle",
    }
    assert f"cut by {400 - cut['kept_tokens']} tokens ({words[keep]})" in result.stderr
    assert records["long"]["prompt_tokens"] <= 200 - 4
    # the warning gives the room and the prompt's own size, which the results line records
    assert "to fit the 196 prompt tokens the context leaves beside max_tokens 4" in result.stderr
    assert f"the prompt is now {records['long']['prompt_tokens']} tokens" in result.stderr
    assert records["alpha"]["truncated"] is None


class ChunkTokenizer(testing.FakeTokenizer):
    """One token per 4 bytes of UTF-8: a prompt of P bytes has exactly ceil(P / 4) tokens,
    which is also its ``min_tokens`` bound; ``encoded`` records the size in bytes of every
    text it tokenised."""

    def __init__(self) -> None:
        self.encoded: list[int] = []

    def encode(self, text: str) -> list[int]:
        size = len(text.encode("utf-8"))
        self.encoded.append(size)
        return [4] * -(-size // 4)

    def min_tokens(self, text: str) -> int:
        return -(-len(text.encode("utf-8")) // 4)


def test_a_prompt_that_cannot_fit_is_refused_without_tokenising(cli, docs, tmp_path):
    """Under the refuse policy a prompt whose token count must exceed the limit (bytes /
    longest token) fails without being tokenised; one that fits exactly still runs, and a
    prompt one token over the limit is refused (the bound is exact here)."""
    (docs / "doc.txt").write_text("x" * 400 + "\n")

    def run(*args, limit):
        tokenizer = ChunkTokenizer()
        engine = testing.fake_engine_factory(limit=limit, tokenizer=tokenizer)
        result = cli(*args, "--max-new-tokens", "4", "--force", engine=engine)
        return result, tokenizer, engine.engines[0]

    _, _, probe = run("docs/doc.txt", limit=100_000)
    tokens = len(probe.seen[0].prompt_ids)  # prompt tokens of doc.txt
    result, tokenizer, engine = run("docs/doc.txt", limit=tokens + 4)  # prompt + 4 == limit
    assert result.exit_code == 0, result.output
    assert len(engine.seen) == 1 and tokenizer.encoded  # tokenised and run

    (docs / "doc.txt").write_text("x" * 404 + "\n")  # 4 bytes more: one token over
    result, tokenizer, engine = run("docs/doc.txt", limit=tokens + 4)
    assert result.exit_code == 1
    assert tokenizer.encoded == [] and engine.seen == []  # never tokenised, never queued
    (record,) = read_results(tmp_path / "hisparse-out")[-1:]
    assert record["id"] == "doc" and record["ok"] is False and record["prompt_tokens"] is None
    assert f"doc.txt: prompt of at least {tokens + 1} tokens" in record["error"]
    assert f"exceeds the context limit of {tokens + 4} tokens" in record["error"]
    assert "--context-policy truncate" in record["error"]

    (docs / "big.txt").write_text("y" * 1_000_000)
    result, tokenizer, engine = run("docs/big.txt", "--context-policy", "extend", limit=100_000)
    assert result.exit_code == 1 and tokenizer.encoded == [] and engine.seen == []
    assert "--max-context" in read_results(tmp_path / "hisparse-out")[-1]["error"]


def test_truncate_still_tokenises_a_long_document(cli, docs, tmp_path):
    (docs / "doc.txt").write_text("x" * 4000 + "\n")
    tokenizer = ChunkTokenizer()
    engine = testing.fake_engine_factory(limit=200, tokenizer=tokenizer)
    result = cli(
        "docs/doc.txt", "--max-new-tokens", "4", "--context-policy", "truncate", engine=engine
    )
    assert result.exit_code == 0, result.output
    assert read_results(tmp_path / "hisparse-out")[0]["truncated"]["original_tokens"] == 1001


def test_unknown_preset_is_a_usage_error(cli, docs, monkeypatch):
    from engine.config import ConfigError

    def unknown(name):
        raise ConfigError(f"preset {name!r}: unknown preset")

    monkeypatch.setattr(settings, "preset_overrides", unknown)
    result = cli("docs/alpha.txt", "--preset", "moon")
    assert result.exit_code == 2 and "unknown preset" in result.stderr


@pytest.mark.parametrize(
    "args, cuda_devices, phrases",
    [
        (["--preset", "h200"], 0, ["preset 'h200' asks for cuda", "use --preset cpu"]),
        (["--preset", "h200x2"], 0, ["preset 'h200x2'", "cuda:0, cuda:1", "--preset cpu"]),
        (["--device", "cuda:1"], 0, ["--device asks for cuda:1", "use --device cpu"]),
        (["--devices", "cuda:0,cuda:1"], 1, ["asks for cuda:1", "use --devices cuda:0"]),
    ],
)
def test_cuda_device_without_cuda_is_a_config_error(
    cli, docs, tmp_path, monkeypatch, args, cuda_devices, phrases
):
    monkeypatch.setattr(
        settings, "preset_overrides", lambda name: {} if name == "cpu" else {"device": "cuda"}
    )
    monkeypatch.setattr(runner_module, "cuda_device_count", lambda: cuda_devices)
    result = cli("docs/alpha.txt", *args)
    assert result.exit_code == 2, result.output
    assert "error:" in result.stderr and "CUDA" in result.stderr
    for phrase in phrases:
        assert phrase in result.stderr
    assert not (tmp_path / "hisparse-out").exists() and cli.factory.engines == []


def test_cuda_preset_is_fine_where_cuda_is_present_or_for_print_config(cli, docs, monkeypatch):
    monkeypatch.setattr(settings, "preset_overrides", lambda name: {"device": "cuda"})
    monkeypatch.setattr(runner_module, "cuda_device_count", lambda: 0)
    assert cli("docs/alpha.txt", "--preset", "h200", "--print-config").exit_code == 0
    monkeypatch.setattr(runner_module, "cuda_device_count", lambda: 1)
    assert cli("docs/alpha.txt", "--preset", "h200").exit_code == 0


def test_json_progress_stdout_is_only_json(cli, docs):
    result = cli("docs/alpha.txt", "docs/beta.txt", "--json-progress")
    assert result.exit_code == 0
    objects = [json.loads(line) for line in result.stdout.splitlines()]
    kinds = [o["event"] for o in objects]
    assert kinds.count("job_finished") == 2 and kinds[-1] == "summary"
    assert objects[-1]["ok"] == 2
    # every object: the run's clock `t` and the wall-clock `time` (notes and summary too)
    assert all(isinstance(o["t"], float) and o["time"].endswith("+00:00") for o in objects)
    assert "info" in kinds


def test_non_tty_output_is_plain_lines(cli, docs):
    result = cli("docs/alpha.txt")
    assert "\x1b[" not in result.stdout and "\r" not in result.stdout
    lines = result.stdout.splitlines()
    assert lines[0].startswith("loading model") and lines[2].startswith("done alpha:")


def test_engine_load_failure_exits_1(cli, docs):
    def broken(config, model):
        raise RuntimeError("weights are corrupt")

    result = cli("docs/alpha.txt", engine=broken)
    assert result.exit_code == 1
    assert "cannot load the model: weights are corrupt" in result.stderr


def test_busy_output_dir_exits_2(cli, docs, tmp_path):
    import fcntl

    out = tmp_path / "hisparse-out"
    out.mkdir()
    fd = os.open(out / ".hisparse.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"4242\n")  # as a holding run writes its process id
    try:
        result = cli("docs/alpha.txt")
    finally:
        os.close(fd)
    err = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "another hisparse run (process 4242) is using" in err
    assert ".hisparse.lock" in err and "choose another --output-dir" in err
    # once free, a run takes the lock and writes its own process id there
    assert cli("docs/alpha.txt").exit_code == 0
    assert (out / ".hisparse.lock").read_text().strip() == str(os.getpid())


def test_ctrl_c_cancels_running_jobs_and_exits_130(cli, docs, tmp_path):
    def interrupt(step):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    engine = testing.fake_engine_factory(on_step=interrupt)
    # the handler the run must put back: Python's default, unless something else in this
    # test process (an xdist worker runs many tests) installed another one before
    previous = signal.getsignal(signal.SIGINT)
    try:
        result = cli("docs/alpha.txt", "docs/beta.txt", "--max-batch", "1", engine=engine)
    except KeyboardInterrupt:
        pytest.fail("SIGINT was not handled by the run command")
    assert result.exit_code == 130
    (fake,) = engine.engines
    assert fake.cancelled
    records = read_results(tmp_path / "hisparse-out")
    # beta was queued, never admitted: counted cancelled, so it has its cancelled line too
    assert [(r["id"], r["finish_reason"]) for r in records] == [
        ("alpha", "cancelled"),
        ("beta", "cancelled"),
    ]
    assert records[1]["error"] == "cancelled before admission"
    assert "cancelling" in result.stderr and "interrupted" in result.stdout
    assert "cancelled beta after 0 tokens" in result.stdout
    assert "│ 2 / 0" in result.stdout  # cancelled / not run
    assert signal.getsignal(signal.SIGINT) is previous
    again = testing.fake_engine_factory()
    assert cli("docs/alpha.txt", "docs/beta.txt", "--max-batch", "1", engine=again).exit_code == 0
    assert [job.id for job in again.engines[0].seen] == ["alpha", "beta"]  # both redone


def test_second_ctrl_c_stops_at_once(cli, docs):
    def interrupt_twice(step):
        if step == 1:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    try:
        result = cli("docs/alpha.txt", engine=testing.fake_engine_factory(on_step=interrupt_twice))
    except KeyboardInterrupt:
        pytest.fail("second SIGINT escaped the run command")
    assert result.exit_code == 130


LATE_CTRL_C_DRIVER = textwrap.dedent(
    """
    import atexit, os, signal, sys, time
    from hisparse_cli import runner, settings, testing
    from hisparse_cli.main import app

    def slow_exit():  # as torch's finalizers: registered on import, run at the exit
        print("exiting", file=sys.stderr, flush=True)
        time.sleep(60)

    def ctrl_c(step):
        if step == 1:
            os.kill(os.getpid(), signal.SIGINT)

    def no_tokenizer(config, model):
        raise RuntimeError("no tokenizer before the load")

    atexit.register(slow_exit)
    settings.preset_overrides = lambda name: {}
    runner.cuda_device_count = lambda: 0
    runner.warm_cuda = lambda config, marks: None
    runner.import_engine_modules = lambda: None
    runner.free_cpu_threads = lambda config: None
    runner.load_tokenizer = no_tokenizer
    runner.load_engine = testing.fake_engine_factory(on_step=ctrl_c)
    app(["run", *sys.argv[1:]])
    """
)


def test_a_second_ctrl_c_while_the_process_exits_ends_it_quietly(tmp_path):
    """Found by pressing Ctrl-C twice on a real run: the second one, as the summary
    printed, met torch's atexit finalizers (``torch/library.py``, ``_del_library``) and
    printed "Exception ignored in atexit callback" and a ``KeyboardInterrupt`` traceback.
    The run's results are written by then: the process ends at once, exit 130, one line."""
    (tmp_path / "a.txt").write_text("A short document about sorting.\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env |= {"HISPARSE_HOST_MEMORY_GB": "256", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", LATE_CTRL_C_DRIVER, "a.txt", "--max-new-tokens", "50"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        lines = []
        while not lines or lines[-1] != "exiting\n":  # the run is over; the exit is not
            lines.append(proc.stderr.readline())
            assert lines[-1], "".join(lines)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    stderr = "".join(lines) + err
    assert "interrupted" in out and "cancelling" in stderr  # the first Ctrl-C's run
    assert proc.returncode == 130, stderr
    assert err == f"{runner_module.LATE_INTERRUPT}\n", stderr


@pytest.mark.parametrize(
    "error",
    [
        FileNotFoundError("HISPARSE_EMBEDDED_MODEL=/nope.gguf: no such file"),
        ValueError("some.png: not a readable GGUF file (bad magic)"),
        ConfigError("memory_budget_gb=0.01 holds no weights"),
    ],
)
def test_config_errors_at_model_load_exit_2_without_traceback(cli, docs, error):
    def broken(config, model):
        raise error

    result = cli("docs/alpha.txt", engine=broken)
    assert result.exit_code == 2
    assert f"cannot load the model: {error}" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_a_model_that_is_a_fifo_exits_2_instead_of_hanging(cli, docs, tmp_path):
    os.mkfifo(tmp_path / "pipe.gguf")
    load = lambda config, model: pytest.fail("model was loaded")  # noqa: E731
    result = cli("docs/alpha.txt", "--model", str(tmp_path / "pipe.gguf"), engine=load)
    assert result.exit_code == 2
    assert "not a regular file or a model folder" in " ".join(result.stderr.split())


def test_a_model_that_is_not_gguf_exits_2_before_the_model_line(cli, docs, tmp_path):
    (tmp_path / "notes.txt").write_text("not a model\n")
    (tmp_path / "empty.gguf").write_bytes(b"")
    for name, starts in (("notes.txt", "b'not '"), ("empty.gguf", "b''")):
        load = lambda config, model: pytest.fail("model was loaded")  # noqa: E731
        result = cli("docs/alpha.txt", "--model", str(tmp_path / name), engine=load)
        assert result.exit_code == 2, result.output
        err = " ".join(result.stderr.split())
        assert f"--model {tmp_path / name}: not a GGUF file (it starts with {starts}" in err
        assert "loading model" not in result.stdout + result.stderr


def test_host_pool_larger_than_memory_exits_2_before_loading(cli, docs, monkeypatch):
    import engine.load

    monkeypatch.setenv("HISPARSE_HOST_MEMORY_GB", "24")
    monkeypatch.setattr(engine.load, "load_engine", lambda *a: pytest.fail("model was loaded"))
    result = cli("docs/alpha.txt", "--host-pool", "1000", engine=REAL_LOAD_ENGINE)
    assert result.exit_code == 2
    assert "host KV pool needs 1000.0 GiB but only 24.0 GiB" in result.stderr


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cpu:0"])
def test_unknown_device_exits_2_before_loading(cli, docs, device):
    result = cli("docs/alpha.txt", "--device", device, engine=lambda *a: pytest.fail("loaded"))
    assert result.exit_code == 2
    assert f"unknown device {device!r}" in result.stderr
    assert "Traceback" not in result.stderr


def test_documents_named_like_windows_devices_run(cli, tmp_path):
    (tmp_path / "d").mkdir()
    for name in ("nul.txt", "con.txt", "aux.txt", "com1.txt", "ok.txt"):
        (tmp_path / "d" / name).write_text(f"text of {name}\n")
    result = cli("d/nul.txt", "d/con.txt", "d/aux.txt", "d/com1.txt", "d/ok.txt")
    assert result.exit_code == 0, result.stderr
    ids = sorted(r["id"] for r in read_results(tmp_path / "hisparse-out"))
    assert ids == ["aux_", "com1_", "con_", "nul_", "ok"]
    assert (tmp_path / "hisparse-out" / "nul_.txt").is_file()


def test_unicode_case_and_non_utf8_file_names_each_keep_their_result(cli, tmp_path):
    """A fresh user's ``résumé 日本.txt``, ``Report.txt`` beside ``report.txt``, and a
    Latin-1 name (``caf\\xe9.txt``: not UTF-8; hashing it for its id, then writing its
    results line, stopped the run with a UnicodeEncodeError, its text file written
    without a line, so the next run refused to overwrite it): every job its own ASCII id
    and file, every results line written (a non-UTF-8 name with ``\\u`` escapes), and
    the next run skips them all."""
    folder = tmp_path / "d"
    folder.mkdir()
    names = [n.encode() for n in ("résumé 日本.txt", "Report.txt", "report.txt", "café.txt")]
    for name in [*names, b"caf\xe9.txt"]:
        (Path(os.fsdecode(os.fsencode(folder) + b"/" + name))).write_text(f"text of {name}\n")
    docs = sorted(os.fsdecode(b"d/" + name) for name in os.listdir(os.fsencode(folder)))
    result = cli(*docs, "--json-progress")
    assert result.exit_code == 0, result.output
    records = read_results(tmp_path / "hisparse-out")
    assert sorted(r["input"][0] for r in records) == sorted(str(tmp_path / d) for d in docs)
    ids = [r["id"] for r in records]
    assert len(set(ids)) == 5 and all(i.isascii() for i in ids), ids
    for record in records:
        text = (tmp_path / "hisparse-out" / record["output"]).read_text()
        assert text == record["text"]
    assert b"\\udce9" in (tmp_path / "hisparse-out" / "results.jsonl").read_bytes()
    again = cli(*docs)
    assert again.exit_code == 0 and "skipping 5 job(s) already done" in again.stdout


def test_reserved_id_written_in_a_manifest_is_still_an_error(cli, docs, tmp_path):
    (tmp_path / "jobs.yaml").write_text("jobs:\n  - id: nul\n    input: docs/alpha.txt\n")
    result = cli("--manifest", "jobs.yaml")
    assert result.exit_code == 2
    assert "jobs.yaml:2: jobs[0].id: is a reserved device name on Windows: 'nul'" in result.stderr


def test_sigterm_cancels_running_jobs_records_them_and_exits_143(cli, docs, tmp_path):
    def terminate(step):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    engine = testing.fake_engine_factory(on_step=terminate)
    result = cli("docs/alpha.txt", "docs/beta.txt", "--max-batch", "1", engine=engine)
    assert result.exit_code == 143
    assert engine.engines[0].cancelled
    records = read_results(tmp_path / "hisparse-out")
    assert [(r["id"], r["finish_reason"]) for r in records] == [
        ("alpha", "cancelled"),
        ("beta", "cancelled"),  # queued, never admitted
    ]
    assert "SIGTERM: cancelling" in result.stderr and "interrupted" in result.stdout
    assert signal.getsignal(signal.SIGTERM) is previous


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_while_a_prompt_is_prepared_records_the_job_cancelled(
    cli, docs, tmp_path, monkeypatch, signum
):
    """A fresh user's SIGTERM while a long document was tokenised before admission: the
    run printed `cancelled h60 after 0 tokens` and counted it cancelled, but wrote no
    results line. Every job the summary counts as cancelled has its `cancelled` line, and
    the next run redoes it."""
    prompt_ids = runner_module.BatchRun._prompt_ids

    def signal_while_preparing(self, engine, spec, document):
        os.kill(os.getpid(), signum)
        return prompt_ids(self, engine, spec, document)

    monkeypatch.setattr(runner_module.BatchRun, "_prompt_ids", signal_while_preparing)
    result = cli("docs/alpha.txt", "docs/beta.txt")
    assert result.exit_code == (143 if signum == signal.SIGTERM else 130), result.output
    assert "cancelled alpha after 0 tokens" in result.stdout
    assert "│ 1 / 1" in result.stdout  # cancelled / not run: beta was never prepared
    records = read_results(tmp_path / "hisparse-out")
    assert [(r["id"], r["finish_reason"], r["ok"]) for r in records] == [
        ("alpha", "cancelled", False)
    ]
    assert records[0]["error"] == "cancelled before admission" and not records[0]["final"]
    assert records[0]["prompt_tokens"] > 0 and records[0]["generated_tokens"] == 0
    monkeypatch.setattr(runner_module.BatchRun, "_prompt_ids", prompt_ids)
    again = testing.fake_engine_factory()
    assert cli("docs/alpha.txt", "docs/beta.txt", engine=again).exit_code == 0
    assert [job.id for job in again.engines[0].seen] == ["alpha", "beta"]  # alpha redone


def test_sigterm_while_loading_the_model_prints_the_summary_and_exits_143(cli, docs):
    def slow_load(config, model):
        os.kill(os.getpid(), signal.SIGTERM)
        pytest.fail("SIGTERM did not stop the load")

    result = cli("docs/alpha.txt", engine=slow_load)
    assert result.exit_code == 143
    assert "interrupted" in result.stdout


def test_ctrl_c_while_loading_the_model_keeps_every_earlier_file(cli, docs, tmp_path):
    """Ctrl-C during the load stops it there, as elsewhere: exit 130 with the summary; the
    output folder is left as it was (an earlier run's results line, text file and
    config.json: nothing written, replaced or half-written), and the next run does the
    jobs."""
    assert cli("docs/alpha.txt").exit_code == 0
    out = tmp_path / "hisparse-out"
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".hisparse.lock"}

    def interrupted_load(config, model, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        pytest.fail("Ctrl-C did not stop the load")

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own
    try:
        result = cli("docs/alpha.txt", "docs/beta.txt", "--force", engine=interrupted_load)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert result.exit_code == 130, result.output
    assert "interrupted" in result.stdout and "Traceback" not in result.output
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".hisparse.lock"}
    assert after == before
    again = testing.fake_engine_factory()
    assert cli("docs/alpha.txt", "docs/beta.txt", "--force", engine=again).exit_code == 0
    assert [job.id for job in again.engines[0].seen] == ["alpha", "beta"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_while_loading_removes_the_output_folder_the_run_created(
    cli, docs, tmp_path, signum
):
    """A fresh user's Ctrl-C during the model load left the new output folder behind,
    holding only `.hisparse.lock`: the README says the folder is left as it was. A folder
    (and the folders above it) that the run created and wrote nothing in but the lock is
    removed; one that was there before is kept."""

    def interrupted_load(config, model, **kwargs):
        os.kill(os.getpid(), signum)
        pytest.fail("the signal did not stop the load")

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own
    try:
        result = cli("docs/alpha.txt", "-o", "new/out", engine=interrupted_load)
        (tmp_path / "mine").mkdir()
        kept = cli("docs/alpha.txt", "-o", "mine", engine=interrupted_load)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert result.exit_code == (130 if signum == signal.SIGINT else 143), result.output
    assert "interrupted" in result.stdout and "removed: nothing written" in result.stdout
    assert not (tmp_path / "new").exists()
    assert kept.exit_code == result.exit_code and (tmp_path / "mine").is_dir()
    assert "removed" not in kept.stdout
    again = testing.fake_engine_factory()
    assert cli("docs/alpha.txt", "-o", "new/out", engine=again).exit_code == 0
    assert [r["id"] for r in read_results(tmp_path / "new" / "out")] == ["alpha"]


@pytest.mark.parametrize("when", ["winding-up", "removing-the-folder"])
@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
def test_a_second_stop_signal_after_the_load_was_stopped_still_removes_the_new_folder(
    cli, docs, tmp_path, monkeypatch, second, when
):
    """Fresh-user finding: Ctrl-C twice during the model load (the second a few ms after
    the first, as the run wound up) left the new output folder behind holding only
    `.hisparse.lock`: the second stopped the run at once, before the folder was removed.
    It still stops at once (no summary, exit 130 or 143), but the folder the run made, and
    the folders above it, are removed first (a signal during the removal waits for it); a
    folder that was there keeps every file; the next run works."""
    from hisparse_cli.progress import ProgressTracker

    def interrupted_load(config, model, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        pytest.fail("Ctrl-C did not stop the load")

    assert cli("docs/beta.txt", "-o", "mine").exit_code == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "mine").iterdir()}
    owner, name = {
        "winding-up": (ProgressTracker, "finish"),
        "removing-the-folder": (runner_module, "_remove_folders"),
    }[when]
    real = getattr(owner, name)

    def second_signal(*args):  # the run winds up after the first: the second comes
        os.kill(os.getpid(), second)
        return real(*args)

    monkeypatch.setattr(owner, name, second_signal)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own
    try:
        result = cli("docs/alpha.txt", "-o", "new/out", engine=interrupted_load)
        kept = cli("docs/alpha.txt", "-o", "mine", engine=interrupted_load)
    finally:
        signal.signal(signal.SIGINT, previous)
    monkeypatch.setattr(owner, name, real)
    assert result.exit_code == (130 if second == signal.SIGINT else 143), result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "new").exists()
    # a folder that was there is not removed: no second signal there, only the first
    assert kept.exit_code == (result.exit_code if when == "winding-up" else 130)
    assert {p.name: p.read_bytes() for p in (tmp_path / "mine").iterdir()} == before
    again = testing.fake_engine_factory()
    assert cli("docs/alpha.txt", "-o", "new/out", engine=again).exit_code == 0
    assert [r["id"] for r in read_results(tmp_path / "new" / "out")] == ["alpha"]


def test_a_lock_file_left_by_a_dead_run_does_not_block_the_next(cli, docs, tmp_path):
    """A run killed outright (SIGKILL, a power cut) leaves `.hisparse.lock` with its
    process id in it. The lock is the kernel's (flock), released with the process, so the
    file alone never blocks: the next run takes it and writes its own id."""
    out = tmp_path / "out"
    out.mkdir()
    (out / ".hisparse.lock").write_text("999999999\n")  # no such process holds it
    result = cli("docs/alpha.txt", "-o", "out")
    assert result.exit_code == 0, result.output
    assert (out / ".hisparse.lock").read_text().strip() == str(os.getpid())
    assert [r["id"] for r in read_results(out)] == ["alpha"]


def test_a_stop_signal_during_the_engine_imports_waits_for_them(cli, docs, monkeypatch):
    """SIGTERM 3 s into a run, while triton was imported, aborted the process (exit 134,
    a C++ terminate, no summary): during the imports a stop signal is only recorded, and
    the run stops, exit 143 with its summary, once they are done, before the load."""
    done = []

    def imports():
        os.kill(os.getpid(), signal.SIGTERM)
        done.append("imports finished")  # a KeyboardInterrupt here is what aborted

    monkeypatch.setattr(runner_module, "import_engine_modules", imports)
    previous = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    result = cli("docs/alpha.txt", engine=lambda config, model: pytest.fail("loaded"))
    assert result.exit_code == 143 and done == ["imports finished"]
    assert "interrupted" in result.stdout
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == previous


@pytest.fixture
def sigint_ignored():
    """SIGINT ignored as a background job of a non-interactive shell inherits it
    (``hisparse run ... &`` in a script): what the run must keep."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_inherited_ignored_sigint_stays_ignored_at_every_stage(
    cli, docs, tmp_path, monkeypatch, sigint_ignored
):
    """A fresh user's `hisparse run ... &` from a script, `kill -INT` during the imports
    (1 s) or after the load cancelled it (exit 130), during the load (2.5 s) it was ignored
    (exit 0): the run put its own handler over the inherited SIG_IGN at some stages only.
    The POSIX convention is kept throughout: an ignored SIGINT stays ignored."""
    stages = []

    def imports():
        os.kill(os.getpid(), signal.SIGINT)
        stages.append("imports")

    def load(config, model):
        os.kill(os.getpid(), signal.SIGINT)
        stages.append("load")
        return factory(config, model)

    def interrupt(step):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)
            stages.append("decode")

    factory = testing.fake_engine_factory(on_step=interrupt)
    monkeypatch.setattr(runner_module, "import_engine_modules", imports)
    result = cli("docs/alpha.txt", "--max-new-tokens", "4", engine=load)
    assert result.exit_code == 0, result.output
    assert stages == ["imports", "load", "decode"]
    assert not factory.engines[0].cancelled and "cancelling" not in result.stderr
    assert [r["finish_reason"] for r in read_results(tmp_path / "hisparse-out")] == ["length"]
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_sigterm_stops_a_run_whose_sigint_is_ignored(cli, docs, monkeypatch, sigint_ignored):
    def imports():
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(runner_module, "import_engine_modules", imports)
    result = cli("docs/alpha.txt", engine=lambda config, model: pytest.fail("loaded"))
    assert result.exit_code == 143 and "interrupted" in result.stdout
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    monkeypatch.setattr(runner_module, "import_engine_modules", lambda: None)

    def terminate(step):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    engine = testing.fake_engine_factory(on_step=terminate)
    result = cli("docs/alpha.txt", "--force", engine=engine)
    assert result.exit_code == 143 and engine.engines[0].cancelled
    assert "SIGTERM: cancelling" in result.stderr


def test_a_background_job_of_a_script_ignores_sigint(tmp_path):
    """The real case: a non-interactive shell starts `cmd &` with SIGINT ignored."""
    (tmp_path / "doc.txt").write_text("some text to summarise\n")
    driver = textwrap.dedent(
        """
        import os, signal, sys
        from hisparse_cli import runner, testing
        from hisparse_cli.main import app

        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN, "not inherited"
        runner.import_engine_modules = lambda: os.kill(os.getpid(), signal.SIGINT)
        runner.load_engine = testing.fake_engine_factory()
        runner.cuda_device_count = lambda: 0
        runner.free_cpu_threads = lambda config: None
        def no_tokenizer(config, model):
            raise RuntimeError("no tokenizer")
        runner.load_tokenizer = no_tokenizer
        sys.argv = ["hisparse", "run", "--preset", "cpu", "doc.txt", "--max-new-tokens", "4"]
        app()
        """
    )
    (tmp_path / "driver.py").write_text(driver)
    script = f"{sys.executable} driver.py & wait $!"
    env = {**os.environ, "HISPARSE_HOST_MEMORY_GB": "256"}  # not this box's memory
    done = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "hisparse-out" / "doc.txt").is_file()


def test_threads_flag_sets_num_threads(cli, docs, monkeypatch):
    monkeypatch.setattr(settings, "preset_overrides", lambda name: {"num_threads": 4})
    result = cli("docs/alpha.txt", "--threads", "1", "--print-config")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["engine"]["num_threads"] == 1
    assert cli("docs/alpha.txt", "--threads", "0", "--print-config").exit_code == 2


def test_unwritable_output_dir_exits_2_before_loading(cli, docs, tmp_path, monkeypatch):
    """A folder that exists but cannot be written (e.g. a read-only file system; root
    ignores permission bits, so the check is os.access) is a usage error, not a traceback."""
    out = tmp_path / "ro"
    out.mkdir()
    real_access = runner_module.os.access

    def access(path, mode):
        if Path(path) == Path("ro") and mode & os.W_OK:
            return False
        return real_access(path, mode)

    monkeypatch.setattr(runner_module.os, "access", access)
    result = cli("docs/alpha.txt", "--output-dir", "ro")
    assert result.exit_code == 2 and "ro is not writable" in result.stderr
    assert cli.factory.engines == [] and not (out / "results.jsonl").exists()
    printed = cli("docs/alpha.txt", "--output-dir", "ro", "--print-config")  # chmod 555 ro
    assert printed.exit_code == 0, printed.output
    assert json.loads(printed.stdout)["problems"] == ["--output-dir ro is not writable"]


def test_output_dir_where_no_lock_file_can_be_made_exits_2_before_loading(
    cli, docs, tmp_path, monkeypatch
):
    """Fresh-user finding: ``run -o /sys/kernel`` (root: os.access says writable, yet no
    file can be made there) gave a PermissionError traceback creating ``.hisparse.lock``,
    exit 1. The run refuses it naming the folder, exit 2; --print-config lists it among
    the problems and prints the config (a later trial: it exited 2 with the message)."""
    out = tmp_path / "locked"
    out.mkdir()
    real_open = os.open

    def no_files_here(path, flags, *args):
        if Path(path).absolute().parent == out and flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_files_here)
    message = "--output-dir locked is not writable: cannot create its lock file"
    refusal = f"{message} locked/.hisparse.lock (Permission denied)"
    result = cli("docs/alpha.txt", "--output-dir", "locked")
    assert result.exit_code == 2, result.output
    assert f"error: {refusal}" in " ".join(result.stderr.split())
    assert "Traceback" not in result.output
    printed = cli("docs/alpha.txt", "--output-dir", "locked", "--print-config")
    assert printed.exit_code == 0, printed.output
    shown = json.loads(printed.stdout)
    assert [" ".join(p.split()) for p in shown["problems"]] == [refusal]
    assert [job["id"] for job in shown["jobs"]] == ["alpha"]
    assert f"a run would be refused here: {refusal}" in " ".join(printed.stderr.split())
    assert cli.factory.engines == [] and list(out.iterdir()) == []


@pytest.mark.skipif(
    not (Path("/sys/kernel").is_dir() and os.access("/sys/kernel", os.W_OK)),
    reason="needs /sys/kernel as root (os.access says writable, no file can be made)",
)
def test_sys_kernel_as_output_dir_is_refused(cli, docs):
    result = cli("docs/alpha.txt", "--output-dir", "/sys/kernel")
    assert result.exit_code == 2, result.output
    assert "--output-dir /sys/kernel is not writable" in " ".join(result.stderr.split())
    assert cli.factory.engines == []


def test_glob_over_two_symlink_loops_returns_and_warns(tmp_path):
    """Issue #19.3: with ``d/s/l -> ..`` and ``d/t -> ../d`` even ``--print-config`` never
    returned (glob followed the loops). It must return at once, run one input, and say
    which links it skipped."""
    (tmp_path / "d" / "s").mkdir(parents=True)
    (tmp_path / "d" / "a.txt").write_text("x\n")
    (tmp_path / "d" / "s" / "l").symlink_to("..")
    (tmp_path / "d" / "t").symlink_to("../d")
    (tmp_path / "jobs.yaml").write_text('jobs:\n  - id: all\n    input: "d/**/*.txt"\n')
    env = {**os.environ, "PYTHONPATH": str(Path(runner_module.__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-m", "hisparse_cli", "run", "--manifest", "jobs.yaml", "--print-config"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "skipped symbolic link d/s/l -> .." in done.stderr
    assert "skipped symbolic link d/t -> ../d" in done.stderr


def test_output_that_is_an_input_is_refused_and_the_input_kept(cli, tmp_path):
    """Issue #19.1: ``--output-dir o o/n.txt`` replaced the input with the summary, exit 0."""
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "n.txt").write_text("some text\n")
    (tmp_path / "other.txt").write_text("other text\n")
    result = cli("--output-dir", "o", "o/n.txt", "other.txt")
    assert result.exit_code == 1, result.output
    assert (tmp_path / "o" / "n.txt").read_text() == "some text\n"
    records = {r["id"]: r for r in read_results(tmp_path / "o")}
    error = records["n"]["error"]
    assert "output " + str(Path("o") / "n.txt") in error and str(tmp_path / "o" / "n.txt") in error
    assert "earlier_output" not in records["n"]
    assert records["other"]["ok"]
    assert [job.id for job in cli.factory.engines[0].seen] == ["other"]


def test_manifest_output_over_an_input_is_refused_before_loading(cli, tmp_path):
    """Issue #19.1: ``output: doc`` over ``out/doc.txt``; and two jobs each writing the
    other's input."""
    (tmp_path / "out").mkdir()
    for name in ("doc", "x", "y"):
        (tmp_path / "out" / f"{name}.txt").write_text(f"the document {name}\n")
    (tmp_path / "jobs.yaml").write_text(
        "jobs:\n  - id: own\n    input: out/doc.txt\n    output: doc\n"
        "  - id: xy\n    input: out/x.txt\n    output: y\n"
        "  - id: yx\n    input: out/y.txt\n    output: x\n"
    )
    result = cli(
        "--manifest", "jobs.yaml", "--output-dir", "out", engine=lambda *a: pytest.fail("loaded")
    )
    assert result.exit_code == 1, result.output
    for name in ("doc", "x", "y"):
        assert (tmp_path / "out" / f"{name}.txt").read_text() == f"the document {name}\n"
    records = {r["id"]: r for r in read_results(tmp_path / "out")}
    assert "is its own input" in records["own"]["error"]
    assert "an input of job 'yx'" in records["xy"]["error"]
    assert str(tmp_path / "out" / "y.txt") in records["xy"]["error"]
    assert "an input of job 'xy'" in records["yx"]["error"]


def test_run_files_as_inputs_exit_2_before_anything_is_written(cli, tmp_path):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "config.json").write_text('{"my": "config"}\n')
    result = cli("--output-dir", "o", "o/config.json", engine=lambda *a: pytest.fail("loaded"))
    assert result.exit_code == 2
    assert "config.json" in result.stderr and "'config'" in result.stderr
    assert (tmp_path / "o" / "config.json").read_text() == '{"my": "config"}\n'
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["config.json"]


def test_removed_control_characters_name_the_file_and_offset(cli, tmp_path):
    """Issue #19.8: the warning named neither the file nor where; in a job over several
    files the user could not tell which."""
    (tmp_path / "a.txt").write_text("clean text\n")
    (tmp_path / "b.txt").write_bytes(b"line one\nsome \x1b[1mbold\x1b[0m\x00 text\n")
    (tmp_path / "jobs.yaml").write_text("jobs:\n  - id: both\n    input: [a.txt, b.txt]\n")
    result = cli("--manifest", "jobs.yaml", "--allow-binary")
    assert result.exit_code == 0, result.output
    out = " ".join(result.stderr.split())
    assert f"removed 3 control character(s) from {tmp_path / 'b.txt'}" in out
    assert "(the first at byte offset 14, line 2)" in out
    assert str(tmp_path / "a.txt") not in out.split("removed")[1]


def _small_gguf(path, q8_row=192):
    """A two-tensor GGUF (a Q8_0 ``token_embd.weight`` of 4 rows, an F32 norm) written with
    gguf-py's GGUFWriter; ``q8_row`` other than a multiple of 32 is patched into the
    tensor's ``ne0`` afterwards (GGUFWriter itself refuses to write it)."""
    import struct

    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    q8 = np.zeros((4, 34 * 6), dtype=np.uint8)  # 6 blocks of 32 = 192 elements a row
    writer.add_tensor(
        "token_embd.weight", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0
    )
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if q8_row != 192:
        data = bytearray(path.read_bytes())
        at = data.index(b"token_embd.weight") + len(b"token_embd.weight") + 4  # after n_dims
        assert struct.unpack_from("<Q", data, at)[0] == 192
        struct.pack_into("<Q", data, at, q8_row)
        path.write_bytes(bytes(data))
    return path


def test_a_model_folder_with_a_bad_shape_is_refused_with_exit_2(cli, docs, tmp_path):
    """Fresh-user finding (with `hisparse plan`'s ZeroDivisionError): a config.json with 0
    layers and 0 KV heads loaded as 0 layers of 6 KV heads and failed on the first unused
    tensor. The run names the file and each field, exit 2, before any tensor is read."""
    from tiny_models import save_tokenizer

    from engine.load import load_engine

    folder = tmp_path / "model"
    folder.mkdir()
    save_tokenizer(folder)
    shape = dict(num_hidden_layers=0, hidden_size=96, num_attention_heads=6,
                 num_key_value_heads=0, intermediate_size=160, vocab_size=256)  # fmt: skip
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"} | shape
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")  # never read: the shape is refused first
    result = cli("--model", str(folder), "docs/alpha.txt", engine=load_engine)
    assert result.exit_code == 2, result.output
    where = folder / "config.json"
    assert f"error: cannot load the model: {where}: num_hidden_layers: must be a positive " \
        "integer, got 0\n" in result.stderr
    assert f"{where}: num_key_value_heads: must be a positive integer, got 0" in result.stderr
    assert "Traceback" not in result.output


def test_broken_gguf_tensors_are_named_before_reading_data(tmp_path):
    """Issue #19.7: a Q8_0 row of 172 gave "not a readable GGUF file" naming no tensor; a
    truncated file gave a numpy reshape error."""
    from engine.weights.gguf import GGUFError, load_gguf

    bad_row = _small_gguf(tmp_path / "row.gguf", q8_row=172)
    with pytest.raises(GGUFError) as info:
        load_gguf(bad_row)
    message = str(info.value)
    assert "tensor token_embd.weight (Q8_0, shape [172, 4]" in message
    assert "row length 172 is not a multiple of the Q8_0 block size 32" in message
    whole = _small_gguf(tmp_path / "whole.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[:-16])  # half of the last tensor
    with pytest.raises(GGUFError) as info:
        load_gguf(tmp_path / "cut.gguf")
    message = str(info.value)
    assert "tensor output_norm.weight (F32, shape [8]" in message and "truncated" in message
    assert "reshape" not in message
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        load_gguf(tmp_path / "junk.gguf")
    (tmp_path / "head.gguf").write_bytes(whole[:64])  # the trial's `head -c 64`
    with pytest.raises(GGUFError) as info:
        load_gguf(tmp_path / "head.gguf")
    message = str(info.value)
    assert "head.gguf: not a valid GGUF file: truncated" in message and "64 bytes" in message
    assert "out of bounds" not in message
    (tmp_path / "ten.gguf").write_bytes(whole[:10])  # a fresh user's `head -c 10`
    with pytest.raises(GGUFError) as info:
        load_gguf(tmp_path / "ten.gguf")
    message = str(info.value)
    assert "ten.gguf: not a valid GGUF file: truncated, 10 bytes is less than the 24" in message
    assert "dtype" not in message  # numpy's "When changing to a larger dtype ..."
    (tmp_path / "hundred.gguf").write_bytes(whole[:100])
    with pytest.raises(GGUFError) as info:
        load_gguf(tmp_path / "hundred.gguf")
    message = str(info.value)
    assert "hundred.gguf: not a valid GGUF file: truncated" in message and "dtype" not in message


def test_broken_gguf_model_exits_2_naming_the_tensor(cli, docs, tmp_path):
    model = _small_gguf(tmp_path / "m.gguf", q8_row=172)
    result = cli("docs/alpha.txt", "--model", str(model), engine=REAL_LOAD_ENGINE)
    assert result.exit_code == 2, result.output
    assert "tensor token_embd.weight (Q8_0" in " ".join(result.stderr.split())


def test_cold_triton_cache_is_named(tmp_path, monkeypatch):
    from hisparse_cli.runner import triton_cache_is_cold

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "none"))
    assert triton_cache_is_cold() == str(tmp_path / "none")
    (tmp_path / "warm").mkdir()
    (tmp_path / "warm" / "k").write_text("x")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "warm"))
    assert triton_cache_is_cold() == ""


def test_cpu_threads_follow_the_free_cores(monkeypatch):
    from engine.config import EngineConfig
    from hisparse_cli.runner import free_cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("os.getloadavg", lambda: (1.2, 1.0, 1.0))
    assert free_cpu_threads(EngineConfig()) == 1  # one core busy elsewhere
    assert free_cpu_threads(EngineConfig(num_threads=2)) is None  # the user chose
    assert free_cpu_threads(EngineConfig(device="cuda")) is None
    monkeypatch.setattr("os.getloadavg", lambda: (0.1, 0.1, 0.1))
    assert free_cpu_threads(EngineConfig()) is None  # idle: torch's default
    monkeypatch.setattr("os.getloadavg", lambda: (9.0, 9.0, 9.0))
    assert free_cpu_threads(EngineConfig()) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert free_cpu_threads(EngineConfig()) is None  # the user chose


def test_threads_above_the_cpu_count_are_cut_with_a_note(monkeypatch):
    """``--threads 999`` on a 2-core box ran ~4x slower (fresh-user finding): the count is
    cut to the CPUs, and a line says so; a count that fits is kept as chosen."""
    from engine.config import EngineConfig
    from hisparse_cli.runner import with_free_threads

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("os.getloadavg", lambda: (0.1, 0.1, 0.1))
    config, note = with_free_threads(EngineConfig(num_threads=999))
    assert config.num_threads == 2 and "--threads 999" in note and "using 2" in note
    config, note = with_free_threads(EngineConfig(num_threads=2))
    assert config.num_threads == 2 and note is None


def test_print_config_shows_the_thread_count_the_run_would_use(cli, docs, monkeypatch):
    """``--print-config --threads 999`` showed ``num_threads: 999`` with no note, while the
    run cuts it to the CPUs and says so: it shows the count the run would use, the note
    under ``effective`` (as config.json records it) and on stderr."""
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    result = cli("docs/alpha.txt", "--threads", "999", "--print-config")
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["engine"]["num_threads"] == 2
    assert "--threads 999 is more than the 2 CPU threads here" in shown["effective"]["num_threads"]
    assert "note: --threads 999 is more than the 2 CPU threads here: using 2" in result.stderr
    kept = json.loads(cli("docs/alpha.txt", "--threads", "1", "--print-config").stdout)
    assert kept["engine"]["num_threads"] == 1 and "num_threads" not in kept.get("effective", {})


def test_json_progress_reports_the_startup_steps_in_order(cli, docs):
    """The ``startup_times`` object: the CLI's steps, then the engine's (a fake engine
    records none: ``engine`` is when the load returned), on the monotonic clock."""
    before = time.monotonic()
    result = cli("docs/alpha.txt", "--json-progress")
    objects = [json.loads(line) for line in result.stdout.splitlines()]
    startup = [o for o in objects if o["event"] == "startup_times"]
    assert len(startup) == 1
    marks = startup[0]["marks"]
    assert list(marks) == ["cli_ready", "config_resolved", "load_started", "engine"]
    times = list(marks.values())
    assert before <= times[0] and times == sorted(times) and times[-1] <= startup[0]["t"]
    kinds = [o["event"] for o in objects]
    assert kinds.index("startup_times") < kinds.index("job_queued")


def test_plain_output_has_no_startup_line(cli, docs):
    assert "startup" not in cli("docs/alpha.txt").stdout


@pytest.mark.parametrize("error", [ValueError("not a GGUF file"), KeyboardInterrupt()])
def test_a_run_that_fails_to_load_keeps_the_earlier_config_json(cli, docs, tmp_path, error):
    """config.json describes the last run that ran or recorded a job: a model that does
    not load (or Ctrl-C during the load) leaves the earlier run's file in place, and a
    first run in a fresh folder that loads nothing writes none."""
    assert cli("docs/alpha.txt").exit_code == 0
    config = tmp_path / "hisparse-out" / "config.json"
    before = config.read_text()

    def broken(config, model):
        raise error

    result = cli("docs/alpha.txt", "--max-new-tokens", "7", "--threads", "1",
                 engine=broken)  # fmt: skip
    assert result.exit_code in (2, 130), result.output
    assert config.read_text() == before
    fresh = cli("docs/alpha.txt", "--output-dir", "fresh", engine=broken)
    assert fresh.exit_code in (2, 130) and not (tmp_path / "fresh" / "config.json").exists()
    ran = cli("docs/alpha.txt", "--max-new-tokens", "7", "--threads", "1", engine=cli.factory)
    assert ran.exit_code == 0 and config.read_text() != before


def test_a_document_named_twice_is_one_job_with_a_note(cli, docs, tmp_path):
    (tmp_path / "link.txt").symlink_to(docs / "alpha.txt")
    result = cli("docs/alpha.txt", "./docs/alpha.txt", "link.txt", "docs/beta.txt")
    assert result.exit_code == 0, result.output
    assert len(read_results(tmp_path / "hisparse-out")) == 2
    err = " ".join(result.stderr.split())
    assert "docs/alpha.txt, ./docs/alpha.txt, link.txt are the same file: one job" in err
    assert "beta" not in err
    piped = cli("-", "-", "--output-dir", "o2", input="text from a pipe\n")
    assert piped.exit_code == 0 and len(read_results(tmp_path / "o2")) == 1
    assert "'-' (standard input) is named 2 times: one job" in " ".join(piped.stderr.split())


def test_a_document_by_two_hard_links_runs_once_with_a_note_naming_both(cli, docs, tmp_path):
    """Fresh-user finding: `hisparse run docs/alpha.txt copy.txt`, where copy.txt is a hard
    link to docs/alpha.txt (one file, two names), ran the document twice, as `alpha` and
    `copy`. It is one job now (named after the first path given), as for a symbolic
    link, and the note names both paths; a glob meeting both does the same."""
    os.link(docs / "alpha.txt", tmp_path / "copy.txt")
    result = cli("docs/alpha.txt", "copy.txt", "docs/beta.txt")
    assert result.exit_code == 0, result.output
    assert sorted(r["id"] for r in read_results(tmp_path / "hisparse-out")) == ["alpha", "beta"]
    err = " ".join(result.stderr.split())
    assert "DOCS: docs/alpha.txt, copy.txt are the same file (hard links to one file" in err
    glob = cli("*.txt", "docs/*.txt", "-o", "globbed")
    assert glob.exit_code == 0, glob.output
    assert len(read_results(tmp_path / "globbed")) == 2
    assert "copy.txt (glob '*.txt'), docs/alpha.txt (glob 'docs/*.txt') are the same file" in (
        " ".join(glob.stderr.split())
    )


def test_the_same_file_given_twice_is_named_as_given(cli, docs, tmp_path, monkeypatch):
    """Fresh-user finding: the note on a file given twice named it by its resolved,
    absolute path (``/tmp/.../docs/alpha.txt, /tmp/.../docs/alpha.txt``), not as typed.
    It now shows each path as given (a glob's match with its glob), and the file they
    lead to only where no path given names it (two links)."""
    (tmp_path / "l1.txt").symlink_to(docs / "beta.txt")
    (tmp_path / "l2.txt").symlink_to(docs / "beta.txt")
    monkeypatch.chdir(docs)
    result = cli("../docs/alpha.txt", "alpha.txt", "*.txt", "../l1.txt", "../l2.txt",
                 "--output-dir", "../out")  # fmt: skip
    assert result.exit_code == 0, result.output
    err = " ".join(result.stderr.split())
    assert "DOCS: ../docs/alpha.txt, alpha.txt, alpha.txt (glob '*.txt') are the same file" in err
    assert "DOCS: beta.txt (glob '*.txt'), ../l1.txt, ../l2.txt are the same file" in err
    assert str(tmp_path) not in err
    result = cli("../l1.txt", "../l2.txt", "--output-dir", "../out2")
    err = " ".join(result.stderr.split())
    assert "DOCS: ../l1.txt, ../l2.txt are the same file (beta.txt): one job" in err


def test_manifest_that_is_a_directory_is_named_as_one(cli, docs, tmp_path):
    result = cli("--manifest", "docs")
    assert result.exit_code == 2
    assert "--manifest docs is a directory" in " ".join(result.stderr.split())
    missing = cli("--manifest", "nope.yaml")
    assert missing.exit_code == 2 and "manifest not found: nope.yaml" in missing.stderr


def test_config_json_records_the_embedded_models_path(cli, docs, tmp_path, smollm2_gguf_path):
    assert cli("docs/alpha.txt").exit_code == 0
    config = json.loads((tmp_path / "hisparse-out" / "config.json").read_text())
    assert config["model"] == str(smollm2_gguf_path)
    again = cli("docs/alpha.txt")  # resume: the done job is skipped
    assert again.exit_code == 0 and "skipped" in again.output
    assert len(read_results(tmp_path / "hisparse-out")) == 1


def test_an_empty_reply_is_ok_with_a_warning_naming_the_job(cli, docs, tmp_path):
    factory = testing.fake_engine_factory(texts={"alpha": ""})
    result = cli("docs/alpha.txt", "docs/beta.txt", engine=factory)
    assert result.exit_code == 0, result.output
    by_id = {r["id"]: r for r in read_results(tmp_path / "hisparse-out")}
    assert by_id["alpha"]["ok"] and (tmp_path / "hisparse-out" / "alpha.txt").read_text() == ""
    err = " ".join(result.stderr.split())
    assert "alpha: the reply is empty" in err and "beta: the reply is empty" not in err


def test_a_document_over_the_context_fails_before_the_model_loads(cli, docs, tmp_path, monkeypatch):
    """Documents whose size says they may not fit are tokenised with the model's tokenizer
    before the load: one over the limit fails then, with the exact count and the choices,
    and the others run; one that the size flagged but that fits runs; a batch of only
    over-limit documents loads no model at all."""
    from hisparse_cli import preflight

    monkeypatch.setattr(preflight, "trained_context", lambda model: 400)
    monkeypatch.setattr(runner_module, "load_tokenizer", lambda config, model: FakeTokenizer())
    (docs / "long.txt").write_text(" ".join(f"w{i}" for i in range(600)) + "\n")  # > 400 tokens
    # 2,000 bytes: over the size estimate's 400 tokens, but one word: it fits
    (docs / "wide.txt").write_text("x" * 2000 + "\n")
    result = cli(
        "docs/long.txt", "docs/wide.txt", "docs/beta.txt", "--max-new-tokens", "4",
        engine=(factory := testing.fake_engine_factory(limit=400)),
    )  # fmt: skip
    assert result.exit_code == 1
    err = " ".join(result.stderr.split())
    assert f"FAILED long: {docs / 'long.txt'}: prompt of " in err  # names the file
    assert "exceeds the context limit of 400 tokens" in result.stderr
    assert "--context-policy extend" in result.stderr  # the choices
    assert "counted the tokens of 2 document(s) that could exceed the context" in result.stdout
    assert "1 over the context limit of 400 tokens; the other jobs run" in result.stdout
    assert [j.id for j in factory.engines[0].seen] == ["wide", "beta"]
    records = {r["id"]: r for r in read_results(tmp_path / "hisparse-out")}
    assert not records["long"]["ok"] and records["long"]["final"] == "prompt"
    assert records["long"]["prompt_tokens"] > 600  # counted before the load, and recorded
    assert f"prompt of {records['long']['prompt_tokens']} tokens" in records["long"]["error"]
    assert records["wide"]["ok"] and records["beta"]["ok"]

    factory = testing.fake_engine_factory(limit=400)
    result = cli("docs/long.txt", "--max-new-tokens", "4", "--force", engine=factory)
    assert result.exit_code == 1 and factory.engines == []  # no model loaded
    assert "FAILED long" in result.stderr and "loading model" not in result.stdout
    result = cli("docs/wide.txt", "--max-new-tokens", "4", "--force")  # counted, and fits
    assert result.exit_code == 0 and "counted the tokens" not in result.output


def test_a_too_long_failure_names_max_context_when_it_set_the_limit(cli, docs, monkeypatch):
    """Fresh-user finding: with ``--max-context 100`` a too-long document's failure offered
    only extend, truncate or chunk, as if the model's context were the limit. Where
    ``max_context`` (a flag, the manifest's or the preset's) set the limit, the failure
    says so and that raising it is a fix too; with the model's own limit it does not."""
    from hisparse_cli import preflight

    monkeypatch.setattr(preflight, "trained_context", lambda model: 400)
    monkeypatch.setattr(runner_module, "load_tokenizer", lambda config, model: FakeTokenizer())
    (docs / "long.txt").write_text(" ".join(f"w{i}" for i in range(290)) + "\n")  # 300 < it < 400
    result = cli("docs/long.txt", "--max-new-tokens", "4", "--max-context", "300")
    err = " ".join(result.stderr.split())
    assert result.exit_code == 1, result.output
    assert "exceeds the context limit of 300 tokens (set by --max-context); raise it (up to " in err
    (docs / "jobs.yaml").write_text(
        "defaults: {engine: {max_context: 300}}\njobs:\n  - {input: long.txt}\n"
    )
    result = cli("--manifest", "docs/jobs.yaml", "--max-new-tokens", "4", "--force")
    err = " ".join(result.stderr.split())
    assert "(set by the manifest's defaults.engine.max_context); raise it" in err, err
    (docs / "long.txt").write_text(" ".join(f"w{i}" for i in range(600)) + "\n")  # > 400
    result = cli("docs/long.txt", "--max-new-tokens", "4", "--force")
    assert "exceeds the context limit of 400 tokens; use --context-policy" in result.stderr
    result = cli("docs/beta.txt", "--max-new-tokens", "299", "--max-context", "300")
    err = " ".join(result.stderr.split())  # no room even for an empty document
    assert result.exit_code == 2 and "the context limit of 300 tokens (set by --max-context)" in err
    assert "or raise --max-context (up to the model's trained context)" in err, err


def test_a_huge_document_is_refused_by_its_size_without_being_tokenised(
    cli, docs, tmp_path, monkeypatch, smollm2_tokenizer
):
    """Fresh-user finding: a document far over the context was tokenised in full before
    the load to be refused (a 20 MB file took 37 s, a few hundred MB minutes and
    gigabytes). Its first bytes already hold more than the context's tokens (the
    tokenizer's longest token, 81 bytes for SmolLM2, per token): it fails before the load
    with the engine's "judged from its size" message, neither re-read whole nor tokenised,
    and the other documents run; one read whole (few enough bytes) is counted exactly."""
    from hisparse_cli import preflight

    monkeypatch.setattr(preflight, "trained_context", lambda model: 2048)

    class NoHugeTexts:  # the embedded model's tokenizer, refusing to tokenise huge.txt
        def __getattr__(self, name):
            return getattr(smollm2_tokenizer, name)

        def encode_chat(self, messages):
            assert all(len(m["content"]) < 100_000 for m in messages), "huge.txt tokenised"
            return smollm2_tokenizer.encode_chat(messages)

    monkeypatch.setattr(runner_module, "load_tokenizer", lambda config, model: NoHugeTexts())
    huge = docs / "huge.txt"  # 1.3 MB: 2 x 81 x 2048 bytes are read first, 332 KB
    huge.write_text("Sorting algorithms compare and swap the items of a list.\n" * 24_000)
    (docs / "long.txt").write_text("A line of prose about sorting things.\n" * 300)  # 11 KB
    reads = []
    job_document = runner_module.job_document

    def read_whole(spec, request):
        reads.append(Path(spec.inputs[0]).name)
        return job_document(spec, request)

    monkeypatch.setattr(runner_module, "job_document", read_whole)
    factory = testing.fake_engine_factory(limit=2048)
    args = ("docs/huge.txt", "docs/alpha.txt", "docs/long.txt", "--max-new-tokens", "8")
    result = cli(*args, engine=factory)
    assert result.exit_code == 1, result.output
    err = " ".join(result.stderr.split())
    message = re.search(r"FAILED huge: \S+huge.txt: prompt of at least (\d+) tokens", err)
    assert message and int(message[1]) > 2048, err
    assert "(judged from its size; not tokenised) + max_tokens 8 exceeds the context" in err
    assert "--context-policy chunk" in err  # the choices
    assert re.search(r"FAILED long: \S+long.txt: prompt of \d+ tokens \+ max_tokens 8", err)
    assert "huge.txt" not in reads and "long.txt" in reads  # read whole: counted exactly
    assert [job.id for job in factory.engines[0].seen] == ["alpha"]
    records = {r["id"]: r for r in read_results(tmp_path / "hisparse-out")}
    assert records["huge"]["final"] == "prompt" and records["huge"]["prompt_tokens"] is None
    assert records["alpha"]["ok"]
    unused = testing.fake_engine_factory()
    again = cli("docs/huge.txt", "--max-new-tokens", "8", engine=unused)  # the same key
    assert again.exit_code == 1 and unused.engines == []
    assert "huge: not tried again" in " ".join(again.output.split())


def test_a_glob_matching_nothing_is_refused_and_the_rest_run(cli, docs, tmp_path):
    """A command-line glob with no match among real documents: an error naming the
    pattern, counted as a refused input, exit 1; the named documents still run. Alone it
    still stops the run (exit 2)."""
    result = cli("nodocs/*.md", "docs/alpha.txt")
    assert result.exit_code == 1
    assert "glob 'nodocs/*.md' matches no files" in result.stderr
    assert "nothing from it runs, the other documents do" in result.stderr
    assert re.search(r"refused inputs\s+│ 1 \(not run\)", result.stdout), result.stdout
    (record,) = read_results(tmp_path / "hisparse-out")
    assert record["id"] == "alpha" and record["ok"]
    result = cli("nodocs/*.md")
    assert result.exit_code == 2 and "matches no files" in result.output


def test_an_empty_document_argument_is_refused_and_the_rest_run(cli, docs, tmp_path):
    """Fresh-user finding: `hisparse run "$DOC"` with DOC unset read "" as the current
    folder ("'' is a directory"). Now an empty argument is refused by name like a glob
    that matches nothing: no job, exit 1, the named documents run; alone, exit 2."""
    result = cli("", "docs/alpha.txt")
    assert result.exit_code == 1, result.output
    assert "DOCS: '' is empty (an unset shell variable?)" in result.stderr
    (record,) = read_results(tmp_path / "hisparse-out")
    assert record["id"] == "alpha" and record["ok"]
    result = cli(" ")
    assert result.exit_code == 2 and "is empty" in result.output


@pytest.mark.parametrize("name", ["results.jsonl", "config.json", ".hisparse.lock"])
def test_a_folder_where_the_run_writes_its_files_is_a_usage_error(cli, docs, tmp_path, name):
    """Fresh-user finding: results.jsonl or config.json as a folder in the output dir
    ended in an IsADirectoryError traceback (exit 1). --print-config lists it (exit 0)."""
    (tmp_path / "hisparse-out" / name).mkdir(parents=True)
    result = cli("docs/alpha.txt")
    assert result.exit_code == 2, result.output
    err = " ".join(result.stderr.split())
    assert f"{name} is not a regular file (a folder?)" in err and "choose another --output-dir" in err
    assert cli.factory.engines == []
    printed = cli("docs/alpha.txt", "--print-config")
    assert printed.exit_code == 0, printed.output
    (problem,) = json.loads(printed.stdout)["problems"]
    assert f"{name} is not a regular file (a folder?)" in problem
    assert "a run would be refused here" in printed.stderr


def test_a_second_manifest_is_refused_not_dropped(cli, docs, tmp_path):
    """Fresh-user finding: ``--manifest a.yaml --manifest b.yaml`` ran only b.yaml, saying
    nothing of a.yaml's jobs. A run takes one manifest: two are refused (exit 2), naming
    both, before anything runs."""
    for name in ("a", "b"):
        job = f"{{id: {name}, input: docs/alpha.txt}}"
        (tmp_path / f"{name}.yaml").write_text(f"jobs:\n  - {job}\n")
    result = cli("--manifest", "a.yaml", "-m", "b.yaml")
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.replace("│", " ").split())
    assert "given 2 times (a.yaml, b.yaml): a run takes one manifest" in said, said
    assert cli.factory.engines == [] and not (tmp_path / "hisparse-out").exists()
    assert cli("--manifest", "b.yaml").exit_code == 0


def test_output_dir_has_the_short_flag_o(cli, docs, tmp_path):
    """``-o`` is ``--output-dir`` (as in ``hisparse eval``)."""
    result = cli("docs/alpha.txt", "-o", "elsewhere")
    assert result.exit_code == 0, result.output
    (record,) = read_results(tmp_path / "elsewhere")
    assert record["id"] == "alpha" and record["ok"]
    assert not (tmp_path / "hisparse-out").exists()


@pytest.mark.parametrize("flag", [("-o", "-"), ("--output-dir=-",)])
def test_output_dir_dash_is_refused_and_says_how_to_stream(cli, docs, tmp_path, flag):
    """Fresh-user finding: ``-o -`` (a user expecting stdout) made a folder named ``-``.
    It is refused (exit 2, nothing made), naming the flag, where results go and how to
    stream them; ``./-`` still names a folder called ``-``."""
    result = cli("docs/alpha.txt", *flag)
    assert result.exit_code == 2, result.output
    err = " ".join(result.stderr.replace("│", " ").split())
    assert "Invalid value for '--output-dir' / '-o': '-' is not standard output here" in err
    assert "results go to a folder" in err and "--json-progress" in err and "./-" in err
    assert cli.factory.engines == [] and sorted(p.name for p in tmp_path.iterdir()) == ["docs"]
    streamed = cli("docs/alpha.txt", "--json-progress")  # what the message promises
    finished = [json.loads(line) for line in streamed.stdout.splitlines()]
    (done,) = [e for e in finished if e["event"] == "job_finished"]
    assert done["job_id"] == "alpha" and done["text"]
    named = cli("docs/beta.txt", "-o", "./-")
    assert named.exit_code == 0, named.output
    assert [r["id"] for r in read_results(tmp_path / "-")] == ["beta"]


def test_job_where_names_the_document_standard_input_or_the_manifest_line():
    from types import SimpleNamespace

    where = runner_module.job_where
    assert where(SimpleNamespace(inputs=(Path("/d/a.txt"),), origin="command line")) == "/d/a.txt"
    assert where(SimpleNamespace(inputs=(Path("-"),), origin="command line")) == "standard input"
    two = SimpleNamespace(inputs=(Path("a.txt"), Path("b.txt")), origin="m.yaml:3")
    assert where(two) == "a.txt and 1 more"
    assert where(SimpleNamespace(inputs=(), origin="batch.jsonl:4")) == "batch.jsonl:4"


def test_an_empty_file_among_a_jobs_inputs_is_left_out_with_a_warning(cli, docs, tmp_path):
    """Fresh-user finding: a manifest job over ``**/*.txt`` failed for good (``final:
    input``) because one of its six files was empty, though the joined text was not. An
    empty file adds nothing, so it is left out with a warning naming it; a job whose every
    file is empty still fails as empty."""
    (docs / "empty.txt").write_text("  \n")
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "a.txt").write_text("")
    (tmp_path / "none" / "b.txt").write_text("\n")
    (tmp_path / "jobs.yaml").write_text(
        "jobs:\n  - id: all\n    input: 'docs/*.txt'\n  - id: none\n    input: 'none/*.txt'\n"
    )
    result = cli("--manifest", "jobs.yaml")
    assert result.exit_code == 1, result.output
    shown = " ".join(result.output.split())
    assert f"all: left out 1 empty file(s) of the job's inputs: {docs / 'empty.txt'}" in shown
    records = {r["id"]: r for r in read_results(tmp_path / "hisparse-out")}
    assert records["all"]["ok"] and len(records["all"]["input_sha256"]) == 2
    assert not records["none"]["ok"] and "is empty or only whitespace" in records["none"]["error"]


def test_a_document_of_only_invisible_characters_fails_as_empty(cli, docs, tmp_path):
    """Fresh-user finding: a file of only zero-width and other invisible characters ran
    and got a made-up summary. It fails its job as empty, naming them; among a job's
    several files it is left out, its line saying why."""
    (docs / "invisible.txt").write_bytes("\u200b\ufeff\u00a0\u2028\u3000".encode())
    (tmp_path / "jobs.yaml").write_text(
        "jobs:\n  - id: both\n    input: [docs/alpha.txt, docs/invisible.txt]\n"
    )
    result = cli("docs/invisible.txt", "docs/beta.txt")
    assert result.exit_code == 1, result.output
    records = {r["id"]: r for r in read_results(tmp_path / "hisparse-out")}
    assert records["beta"]["ok"] and not records["invisible"]["ok"]
    error = records["invisible"]["error"]
    assert error.startswith(f"{docs / 'invisible.txt'}: is empty or only whitespace or invisible")
    assert "U+200B ZERO WIDTH SPACE" in error and records["invisible"]["final"] == "input"
    several = cli("--manifest", "jobs.yaml", "-o", "several")
    assert several.exit_code == 0, several.output
    (record,) = read_results(tmp_path / "several")
    assert record["input"] == [str(docs / "alpha.txt")]
    (left_out,) = record["input_left_out"]
    assert left_out["path"] == str(docs / "invisible.txt") and left_out["index"] == 1
    assert left_out["reason"].startswith("is empty or only whitespace or invisible characters")


def test_a_left_out_empty_file_is_not_listed_as_an_input_of_the_job(cli, docs, tmp_path):
    """Fresh-user finding: the empty file a job left out (with a warning) was still in
    its ``input`` list in ``results.jsonl``, beside an ``input_sha256`` of the other files
    only. ``input`` now lists the files the job read, aligned with ``input_sha256``, and
    ``input_left_out`` the one left out (where it stood among the inputs, and why). The
    job keeps its derived id on a re-run, is skipped while the file stays empty, and runs
    again under the same id once the file has text."""
    (docs / "empty.txt").write_text("\n")
    (tmp_path / "jobs.yaml").write_text(
        "jobs:\n  - input: [docs/alpha.txt, docs/empty.txt, docs/beta.txt]\n"
    )
    result = cli("--manifest", "jobs.yaml")
    assert result.exit_code == 0, result.output
    (record,) = read_results(tmp_path / "hisparse-out")
    assert record["input"] == [str(docs / "alpha.txt"), str(docs / "beta.txt")]
    assert len(record["input_sha256"]) == 2
    assert record["input_left_out"] == [
        {"path": str(docs / "empty.txt"), "index": 1, "reason": "is empty or only whitespace"}
    ]
    again = cli("--manifest", "jobs.yaml")
    assert again.exit_code == 0, again.output
    assert len(read_results(tmp_path / "hisparse-out")) == 1  # skipped: done
    (docs / "empty.txt").write_text("Now it has text.\n")
    third = cli("--manifest", "jobs.yaml")
    assert third.exit_code == 0, third.output
    records = read_results(tmp_path / "hisparse-out")
    assert [r["id"] for r in records] == [record["id"], record["id"]]
    assert records[1]["input"] == [str(docs / n) for n in ("alpha.txt", "empty.txt", "beta.txt")]
    assert "input_left_out" not in records[1]
    assert "holds earlier job" not in third.stderr  # the same job, with other content
