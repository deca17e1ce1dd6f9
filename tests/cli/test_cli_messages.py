"""Wrong inputs as a new user types them: each refusal says what is wrong once, names the
choices (``auto`` among the presets), reads on one line, and lists a manifest's problems in
the file's order."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from hisparse_cli import runner as runner_module
from hisparse_cli.main import app

NARROW = {"COLUMNS": "80"}


@pytest.fixture
def no_load(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runner_module, "cuda_device_count", lambda: 0)
    monkeypatch.setattr(runner_module, "load_engine", lambda *a: pytest.fail("model loaded"))
    (tmp_path / "a.txt").write_text("A short document.\n")
    return tmp_path


def invoke(*args):
    return CliRunner().invoke(app, list(args), env=NARROW, catch_exceptions=False)


def test_an_unknown_preset_is_named_once_with_auto_among_the_choices(no_load):
    result = invoke("run", "--preset", "nonexistent", "a.txt")
    assert result.exit_code == 2
    assert result.stderr.count("'nonexistent'") == 1, result.stderr
    assert "known presets: auto (picks one for this machine), cpu, " in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("plan", "--preset", "nonexistent", "-n", "1", "-c", "8K"),
        ("presets", "show", "nonexistent"),
    ],
)
def test_plan_and_presets_refusals_are_one_line_with_auto_named(no_load, args):
    result = invoke(*args)
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1, result.stderr  # not wrapped at 80 columns
    assert "known presets: auto (picks one for this machine), cpu, " in result.stderr


def test_manifest_problems_are_listed_in_line_order(no_load):
    (no_load / "m.jsonl").write_text(
        '{"id": "x", "input": "a.txt"}\n{"id": "y", "inptu": "a.txt"}\nnot json\n'
    )
    result = invoke("run", "--manifest", "m.jsonl")
    assert result.exit_code == 2
    lines = [line.strip() for line in result.stderr.splitlines() if "m.jsonl:" in line]
    assert [line.split(":")[1] for line in lines] == ["2", "2", "3"], lines
    assert "did you mean 'input'?" in lines[0]


def test_a_host_pool_over_the_memory_is_refused_before_loading_is_announced(cli, docs, monkeypatch):
    monkeypatch.setenv("HISPARSE_HOST_MEMORY_GB", "24")
    result = cli("docs/alpha.txt", "--host-pool", "1000")
    assert result.exit_code == 2
    assert "host KV pool needs 1000.0 GiB but only 24.0 GiB" in result.stderr
    assert "loading model" not in result.stdout and cli.factory.engines == []


def test_a_preset_pool_over_the_memory_is_cut_to_fit_with_a_warning(cli, docs, monkeypatch):
    """The default 8 GiB cap on a machine with 4 GiB available: the run goes on with 3.5 GiB
    (90 % of 4, whole quarter GiB) and says so; a cap the user set is refused instead."""
    monkeypatch.setenv("HISPARSE_HOST_MEMORY_GB", "4")
    result = cli("docs/alpha.txt")
    assert result.exit_code == 0, result.output
    assert "the preset's 8 GiB cap is more than 90% of the 4.0 GiB" in result.stderr
    assert "using 3.5 GiB (--host-pool GB to choose)" in result.stderr
    [engine] = cli.factory.engines
    assert engine.config.host_pool_gb == 3.5
    chosen = cli("docs/beta.txt", "--host-pool", "8")
    assert chosen.exit_code == 2 and "host KV pool needs 8.0 GiB" in chosen.stderr


def test_a_refused_run_does_not_first_warn_that_it_replaces_an_earlier_answer(cli, docs):
    """Fresh-user finding: ``--host-pool 500`` over an earlier answer warned ``... this
    run replaces it``, then refused to run at all. The refusals come first now; the
    warning is for a run that goes ahead."""
    assert cli("docs/alpha.txt").exit_code == 0
    args = ("docs/alpha.txt", "--max-new-tokens", "7")  # another resume key: a replacement
    refused = cli(*args, "--host-pool", "1000")
    assert refused.exit_code == 2, refused.output
    assert "host KV pool needs 1000.0 GiB" in refused.stderr
    assert "replaces it" not in refused.stdout + refused.stderr
    ran = cli(*args)
    assert ran.exit_code == 0 and "this run replaces it" in " ".join(ran.stderr.split())


def test_a_preset_pool_cut_to_fit_is_accepted_again_after_the_model_loads(cli, docs, monkeypatch):
    """MemAvailable read 8.7 GiB at start-up and 8.0 GiB once the model has loaded (its
    weights on the CPU, torch): the start-up cut the preset's 8 GiB pool to 90% of 8.7
    (7.75 GiB), which the cache refused after the load (90% of 8.0 is 7.2), on every run.
    The cut now sets aside what the load takes, so the cache accepts it; memory that
    shrank further is refused saying so."""
    import engine.kv.sizing as sizing

    gib = 2**30
    memory = {"available": int(8.7 * gib)}
    monkeypatch.delenv("HISPARSE_HOST_MEMORY_GB")
    monkeypatch.setattr(sizing, "available_host_bytes", lambda declared=None: memory["available"])

    def load(config, model, **kwargs):  # the load lowers MemAvailable; the cache checks
        memory["available"] = after
        sizing.check_host_memory(int(config.host_pool_gb * gib), config.host_memory_gb)
        return cli.factory(config, model, **kwargs)

    after = int(8.0 * gib)
    result = cli("docs/alpha.txt", engine=load)
    assert result.exit_code == 0, result.output
    load_gib = runner_module.model_load_host_bytes(cli.factory.engines[0].config, None) / gib
    assert f"8.7 GiB of host memory available now less the {load_gib:.1f} GiB" in result.stderr
    assert cli.factory.engines[0].config.host_pool_gb <= 0.9 * (8.7 - load_gib)
    memory["available"], after = int(8.7 * gib), int(5.0 * gib)
    shrank = cli("docs/beta.txt", engine=load)
    assert shrank.exit_code == 2, shrank.output
    err = " ".join(shrank.stderr.split())
    assert "the memory available shrank while the model loaded: 8.7 GiB before it" in err
    assert "and 5.0 GiB after it" in err


def test_config_json_records_the_threads_chosen_from_the_free_cores(cli, docs, monkeypatch):
    """On a busy box the run picks its CPU threads itself; config.json ("the settings as
    they take effect") then says that count and why, not ``null``."""
    import json

    monkeypatch.setattr(runner_module, "free_cpu_threads", lambda config: 1)
    result = cli("docs/alpha.txt", "--output-dir", "out")
    assert result.exit_code == 0, result.output
    doc = json.loads((docs.parent / "out" / "config.json").read_text())
    assert doc["engine"]["num_threads"] == 1
    assert "using 1 of" in doc["effective"]["num_threads"]


def test_a_broken_link_among_the_documents_is_named_as_given_and_says_where_it_points(
    cli, docs
):
    """Fresh-user finding: ``dangling.txt -> nowhere.txt`` failed with "file not found" as
    job ``nowhere``, named after the missing target. The job is ``dangling``, the name the
    user gave, also on a re-run, and the message says the link is broken and where it
    points."""
    import json

    (docs / "dangling.txt").symlink_to("nowhere.txt")
    for _ in range(2):  # the re-run keeps the id
        result = cli("docs/alpha.txt", "docs/dangling.txt", "--output-dir", "out")
        assert result.exit_code == 1, result.output
        assert "'docs/dangling.txt' is a broken symbolic link" in result.stderr
        assert "nowhere" not in result.stderr.replace("nowhere.txt", "")
    lines = [json.loads(x) for x in (docs.parent / "out" / "results.jsonl").read_text().splitlines()]
    failed = [line for line in lines if not line["ok"]]
    assert {line["id"] for line in failed} == {"dangling"}
    assert all(
        f"points to 'nowhere.txt' ({docs / 'nowhere.txt'}), which does not exist" in line["error"]
        for line in failed
    )


def test_a_glob_warns_of_each_broken_link_it_matches_and_runs_the_rest(cli, docs):
    """Fresh-user finding: `hisparse run 'docs/*.txt'` where one match is a broken
    symbolic link skipped it without a word. It is a warning now, naming the link and
    where it points; the other documents run (exit 0), and the link gets no job."""
    import json

    (docs / "dangling.txt").symlink_to("nowhere.txt")
    result = cli("docs/*.txt", "--output-dir", "out")
    assert result.exit_code == 0, result.output
    err = " ".join(result.stderr.split())
    assert (
        "input glob 'docs/*.txt': docs/dangling.txt is a broken symbolic link: it points to "
        f"'nowhere.txt' ({docs / 'nowhere.txt'}), which does not exist; skipped" in err
    )
    lines = (docs.parent / "out" / "results.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["id"] for line in lines) == ["alpha", "beta"]
    alone = cli("docs/d*.txt", "--output-dir", "out2")
    assert alone.exit_code == 2
    assert "glob 'docs/d*.txt' matches no files" in " ".join(alone.stderr.split())
    assert "docs/dangling.txt is a broken symbolic link" in " ".join(alone.stderr.split())


def test_a_missing_file_or_folder_among_the_documents_fails_only_its_own_job(cli, docs):
    """`hisparse run a.txt missing.txt somedir`: a.txt runs; the missing file and the
    folder each get a failed results line naming the path (the brief: the rest of the
    batch carries on), a warning says so before the run, and the exit code is 1."""
    import json

    (docs / "sub").mkdir()
    result = cli("docs/alpha.txt", "docs/missing.txt", "docs/sub", "--output-dir", "out")
    assert result.exit_code == 1, result.output
    assert "file not found: 'docs/missing.txt'" in result.stderr
    assert "'docs/sub' is a directory" in result.stderr
    assert "that document's job fails, the others run" in result.stderr
    lines = [json.loads(x) for x in (docs.parent / "out" / "results.jsonl").read_text().splitlines()]
    by_ok = {line["id"]: line for line in lines}
    assert by_ok["alpha"]["ok"] is True
    failed = [line for line in lines if not line["ok"]]
    assert len(failed) == 2
    assert any("missing.txt" in line["error"] and "not found" in line["error"] for line in failed)
    assert any("sub" in line["error"] and "directory" in line["error"] for line in failed)
    alone = cli("docs/missing.txt")  # nothing else to run: refused as before
    assert alone.exit_code == 2 and "file not found" in alone.stderr


def test_file_names_with_control_characters_are_shown_escaped(cli, tmp_path):
    """Fresh-user finding: files named ``evil\\nFAILED other: fake.txt`` and
    ``esc\\x1b[31mred.txt`` were printed raw: stderr had a forged ``FAILED other:
    fake.txt: ...`` line, and the escape sequence reached the terminal. Every name in the
    human-readable output is escaped (``\\n``, ``\\x1b``), each job's line stays one line,
    Rich markup in a name stays text; results.jsonl keeps the real names (JSON escapes
    them)."""
    import json

    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "evil\nFAILED other: fake.txt").write_text("")
    (folder / "esc\x1b[31mred.txt").write_text("")
    (folder / "cr\rover.txt").write_bytes(b"\x00\x01\x02bin")
    (folder / "[bold]fine.txt").write_text("A short document.\n")
    result = cli("t/*", "-o", "[bold]out")
    assert result.exit_code == 1, result.output
    err = result.stderr.splitlines()
    assert sorted(line.split(":")[0] for line in err if line.startswith("FAILED")) == [
        "FAILED cr-over",
        "FAILED esc-31mred",
        "FAILED evil-failed-other-fake",
    ]  # no forged "FAILED other" line
    where = f"{folder}/"
    forged = f"FAILED evil-failed-other-fake: {where}evil\\nFAILED other: fake.txt: is empty"
    assert any(line.startswith(forged) for line in err), err
    assert f"{where}esc\\x1b[31mred.txt: is empty" in result.stderr
    assert f"{where}cr\\rover.txt: looks binary" in result.stderr
    for stream in (result.stdout, result.stderr):
        assert not any(c in stream for c in "\x1b\r\x00"), repr(stream)
    assert "[bold]out" in result.stdout  # the summary's output folder, markup as text
    results = (tmp_path / "[bold]out" / "results.jsonl").read_text()
    lines = [json.loads(x) for x in results.splitlines()]
    inputs = {line["id"]: line["input"] for line in lines}
    assert inputs["evil-failed-other-fake"] == [f"{where}evil\nFAILED other: fake.txt"]
    assert inputs["esc-31mred"] == [f"{where}esc\x1b[31mred.txt"]
    assert [line["ok"] for line in lines if line["id"] == "bold-fine"] == [True]


def test_control_characters_in_names_stay_escaped_in_every_message(cli, tmp_path):
    """File names holding a newline and an escape byte, met where messages built their
    text from raw paths: a manifest job's failing input, its earlier answer replaced after
    an edit, a glob's broken link (a manifest problem and a command-line warning), a hard
    link named twice, a link loop, ``--model`` and ``--manifest`` paths. No stderr line is
    forged (none starts with the name's second line) and no escape byte is written."""
    import glob
    import json
    import os

    name = "evil\nFORGED: line\x1b[31m"
    shown = "evil\\nFORGED: line\\x1b[31m"
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / f"{name}.txt").write_text("A short document.\n")
    (folder / f"{name}-empty.txt").write_text("")
    (folder / "plain.txt").write_text("Plain text.\n")
    os.link(folder / "plain.txt", folder / f"{name}-hard.txt")
    (folder / "loop").mkdir()
    os.symlink("..", folder / "loop" / name)
    jobs = [
        {"id": "ok", "input": glob.escape(f"d/{name}.txt")},
        {"id": "bad", "input": glob.escape(f"d/{name}-empty.txt")},
    ]
    manifest = tmp_path / "jobs.json"
    manifest.write_text(json.dumps({"jobs": jobs}))
    errors = [cli("--manifest", "jobs.json", "-o", "out").stderr]
    (folder / f"{name}.txt").write_text("A short document, edited.\n")
    errors.append(cli("--manifest", "jobs.json", "-o", "out").stderr)
    assert f"an earlier version of d/{shown}.txt; this run replaces it" in errors[-1]
    assert f"FAILED bad: {folder}/{shown}-empty.txt: is empty" in errors[0]
    os.symlink("nowhere", folder / f"{name}-link.txt")
    manifest.write_text(json.dumps({"jobs": [*jobs, {"id": "link", "input": "d/*-link.txt"}]}))
    errors.append(cli("--manifest", "jobs.json", "-o", "out").stderr)
    assert f"(in .): d/{shown}-link.txt is a broken symbolic link" in errors[-1]
    errors.append(cli("d/*", "d/**/*.txt", "-o", "out2").stderr)
    assert f"d/{shown}-link.txt is a broken symbolic link" in errors[-1]
    assert f"d/{shown}-hard.txt (glob 'd/*')" in errors[-1]
    assert f"skipped symbolic link d/loop/{shown} -> .." in errors[-1]
    errors.append(cli("plain.txt", "--model", f"{name}.gguf").stderr)
    errors.append(cli("--manifest", f"{name}.yaml").stderr)
    assert f"model not found: {shown}.gguf" in errors[-2]
    assert f"manifest not found: {shown}.yaml" in errors[-1]
    for stderr in errors:
        assert not [line for line in stderr.splitlines() if line.startswith("FORGED")], stderr
        assert "\x1b" not in stderr, repr(stderr)
