"""Manifest parsing and validation: every problem, with file, line and field, at once."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from hisparse_cli.manifest import ManifestError, jobs_from_paths, load_manifest


@pytest.fixture
def docs(tmp_path):
    (tmp_path / "docs" / "a").mkdir(parents=True)
    (tmp_path / "docs" / "b").mkdir(parents=True)
    for name in ("docs/a/report.txt", "docs/b/report.txt", "docs/one.txt", "docs/two.txt"):
        (tmp_path / name).write_text(f"text of {name}\n")
    return tmp_path


def write_yaml(folder, text):
    path = folder / "jobs.yaml"
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def problems_of(path, overrides=None):
    with pytest.raises(ManifestError) as info:
        load_manifest(path, overrides)
    return info.value.problems


def find(problems, field):
    found = [p for p in problems if p.field == field]
    assert found, f"no problem for {field!r} in {[str(p) for p in problems]}"
    return found[0]


def test_valid_yaml_with_defaults(docs):
    path = write_yaml(
        docs,
        """
        defaults:
          task: answer
          question: What happened?
          max_new_tokens: 64
          stop: ["\\n\\n"]
          engine: {attention: dense, page_size: 32}
        jobs:
          - id: first
            input: docs/one.txt
          - input: [docs/two.txt, docs/a/report.txt]
            task: extract
            question: null
            fields: [name, date]
            temperature: 0.7
            output: second-result
        """,
    )
    manifest = load_manifest(path)
    first, second = manifest.jobs
    assert manifest.engine == {"attention": "dense", "page_size": 32}
    assert (
        first.id == "first"
        and first.task.task == "answer"
        and first.task.question == "What happened?"
    )
    assert first.sampling.max_tokens == 64 and first.sampling.stop == ("\n\n",)
    assert first.inputs == ((docs / "docs/one.txt").resolve(),)
    assert second.id == "two" and second.output == "second-result.txt"
    assert second.task.fields == ("name", "date") and second.task.question is None
    assert len(second.inputs) == 2 and second.sampling.temperature == 0.7


def test_yaml_reports_every_problem_with_line_and_field(docs):
    path = write_yaml(
        docs,
        """
        defaults:
          temprature: 0.5
          engine:
            page_sise: 16
            top_k: "many"
        jobs:
          - id: ok
            input: docs/one.txt
          - id: bad
            input: docs/missing.txt
            max_new_tokens: -3
            top_p: 2
          - id: ok
            input: "docs/*.md"
          - id: ../escape
            input: docs/two.txt
            task: answer
          - id: other
            input: docs/two.txt
            output: ok
        """,
    )
    problems = problems_of(path)
    assert all(p.file == str(path) for p in problems)
    assert find(problems, "defaults.temprature").line == 2
    assert "did you mean 'temperature'" in find(problems, "defaults.temprature").message
    assert find(problems, "defaults.engine.page_sise").line == 4
    assert find(problems, "defaults.engine.top_k").line == 5
    assert find(problems, "jobs[1].input").line == 10
    assert "file not found" in find(problems, "jobs[1].input").message
    assert find(problems, "jobs[1].max_new_tokens").line == 11
    assert find(problems, "jobs[1].top_p").line == 12
    assert "matches no files" in find(problems, "jobs[2].input").message
    assert find(problems, "jobs[3].id").line == 15
    assert (
        "'..'" in find(problems, "jobs[3].id").message
        or "separator" in find(problems, "jobs[3].id").message
    )
    assert find(problems, "jobs[3].question").line == 15
    assert "output file 'ok.txt'" in find(problems, "jobs[4].output").message
    assert find(problems, "jobs[4].output").line == 20


def test_duplicate_ids_reported_with_both_lines(docs):
    path = write_yaml(
        docs,
        """
        jobs:
          - id: same
            input: docs/one.txt
          - id: SAME
            input: docs/two.txt
        """,
    )
    problem = find(problems_of(path), "jobs[1].id")
    assert problem.line == 4
    assert "duplicate id 'SAME'" in problem.message and "line 2" in problem.message


def test_one_pass_reports_a_duplicate_id_beside_the_jobs_other_problems(docs):
    """A duplicate id whose job also has a missing input, and a custom prompt with an
    unknown variable and no ${document}: every problem in one pass (fresh-user finding:
    the second of each appeared only after the first was fixed)."""
    path = write_yaml(
        docs,
        """
        jobs:
          - id: a
            input: docs/one.txt
          - id: a
            input: docs/missing.txt
          - id: c
            input: docs/two.txt
            prompt: "no doc placeholder $foo"
        """,
    )
    problems = problems_of(path)
    assert "duplicate id 'a'" in find(problems, "jobs[1].id").message
    assert "file not found" in find(problems, "jobs[1].input").message
    prompt = find(problems, "jobs[2].prompt").message
    assert "$foo" in prompt and "${document}" in prompt


def test_wrong_types_and_unknown_fields(docs):
    path = write_yaml(
        docs,
        """
        jobs:
          - id: 12
            input: {path: docs/one.txt}
            task: translate
            seed: 1.5
            stop: [1, 2]
            colour: blue
            engine: {top_k: 5}
        """,
    )
    problems = problems_of(path)
    assert "must be a string" in find(problems, "jobs[0].id").message
    assert find(problems, "jobs[0].input").line == 3
    assert "one of summarize" in find(problems, "jobs[0].task").message
    assert "integer" in find(problems, "jobs[0].seed").message
    assert "bad item" in find(problems, "jobs[0].stop").message
    assert "unknown field" in find(problems, "jobs[0].colour").message
    assert "defaults.engine" in find(problems, "jobs[0].engine").message


@pytest.mark.parametrize("seed", [-1, 2**64, 99999999999999999999])
def test_a_seed_outside_64_bits_is_refused(docs, seed):
    """Fresh-user finding: --seed 99999999999999999999 passed validation and crashed the
    run at admission (torch's generator takes 0 .. 2**64 - 1); -1 is not "random" here."""
    path = write_yaml(docs, f"jobs:\n  - {{input: docs/one.txt, seed: {seed}}}\n")
    message = find(problems_of(path), "jobs[0].seed").message
    assert "must be an integer from 0 to 2**64 - 1 (18446744073709551615)" in message
    with pytest.raises(ManifestError, match="--seed: must be an integer from 0"):
        jobs_from_paths([str(docs / "docs/one.txt")], {"seed": seed})
    path = write_yaml(docs, f"jobs:\n  - {{input: docs/one.txt, seed: {2**64 - 1}}}\n")
    assert load_manifest(path).jobs[0].sampling.seed == 2**64 - 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "-1"),
        ("temperature", ".nan"),
        ("top_p", "2.5"),
        ("top_p", "0"),
        ("top_p", "'high'"),
        ("top_k", "-2"),
        ("top_k", "1.5"),
        ("seed", "-1"),
        ("max_tokens", "0"),
        ("max_tokens", "2.5"),
        ("stop", "['', 1]"),
        ("stop", "''"),
    ],
)
def test_a_sampling_value_is_refused_in_the_same_words_by_a_preset_and_a_manifest(
    docs, field, value
):
    """Review finding: the sampling rules were written twice, in a preset's sampling block
    (engine.config.sampling_problem) and a manifest's job fields, and said different
    things ("must be in (0, 1]" / "must be a number in (0, 1]"; a negative seed's hint in
    one only). One table (engine.config.SAMPLING_CHECKS) holds them now."""
    from engine.presets import PresetError, load_preset_full

    preset = docs / "mine.yaml"
    preset.write_text(
        "description: box\nhardware: {devices: [cpu]}\n"
        f"sampling:\n  {field}: {value}\n"
    )
    with pytest.raises(PresetError) as info:
        load_preset_full(preset)
    said_by_preset = str(info.value).split(f"sampling.{field}: ", 1)[1]
    job_field = "max_new_tokens" if field == "max_tokens" else field
    path = write_yaml(docs, f"jobs:\n  - {{input: docs/one.txt, {job_field}: {value}}}\n")
    said_by_manifest = find(problems_of(path), f"jobs[0].{job_field}").message
    assert said_by_manifest == said_by_preset


def test_a_stop_string_of_whitespace_is_taken_as_a_preset_takes_it(docs):
    """Review finding: `stop: "\\n"` (stop at a newline) was refused ("must be a non-empty
    string"), though `stop: ["\\n"]` and a preset's `stop: "\\n"` were taken."""
    path = write_yaml(docs, 'jobs:\n  - {input: docs/one.txt, stop: "\\n"}\n')
    assert load_manifest(path).jobs[0].sampling.stop == ("\n",)


def test_a_misspelt_task_gets_a_hint(docs):
    path = write_yaml(docs, "jobs:\n  - id: a\n    input: docs/one.txt\n    task: summarise\n")
    message = find(problems_of(path), "jobs[0].task").message
    assert "got 'summarise' (did you mean 'summarize'?)" in message
    assert "did you mean" not in find(problems_of(write_yaml(
        docs, "jobs:\n  - id: a\n    input: docs/one.txt\n    task: translate\n")),
        "jobs[0].task").message  # fmt: skip


def test_yaml_syntax_error_has_line(docs):
    path = docs / "jobs.yaml"
    path.write_text("jobs:\n  - id: a\n    input: [unclosed\n")
    (problem,) = problems_of(path)
    assert problem.line is not None and "not valid YAML" in problem.message


def test_yaml_alias_bomb_is_refused_without_expanding_it(docs):
    """Fresh-user finding: nine levels of ten aliases (the "billion laughs" file, 10**9
    values once expanded) as a job's stop list hung the validation. The manifest is now
    sized with each alias counted as what it names, and refused past a million values;
    a few aliases (a shared stop list) still work."""
    levels = ["a: &a [" + ", ".join(['"lol"'] * 10) + "]"]
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        levels.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 10) + "]")
    path = docs / "jobs.yaml"
    path.write_text("\n".join(levels) + "\njobs:\n  - {input: docs/one.txt, stop: *i}\n")
    (problem,) = problems_of(path)
    assert "expands to more than 1,000,000 values through YAML aliases" in problem.message
    path.write_text("x: &x [*x]\njobs:\n  - {input: docs/one.txt}\n")  # contains itself
    assert "through YAML aliases" in problems_of(path)[0].message
    shared = 'defaults:\n  stop: &s ["END", "STOP"]\njobs:\n  - {input: docs/one.txt, stop: *s}\n'
    path.write_text(shared)
    (job,) = load_manifest(path).jobs
    assert job.sampling.stop == ("END", "STOP")


def test_yaml_duplicate_key_is_reported(docs):
    path = write_yaml(docs, "jobs:\n  - id: a\n    input: docs/one.txt\n    id: b\n")
    problem = find(problems_of(path), "jobs[0].id")
    assert problem.line == 4 and "duplicate key" in problem.message


def test_yaml_merge_keys_work_as_safe_load_reads_them(docs):
    """Fresh-user finding: ``- <<: *q`` with ``id: q2`` beside it was refused as ``duplicate
    key`` and ``duplicate id 'q1'`` (the merged id kept): a key given beside a merge beats
    the merged one, as ``yaml.safe_load`` has it; of ``<<: [*a, *b]`` the first wins (the
    YAML merge spec); an
    ``x-`` top-level key holds anchors and is ignored; a merged field is reported on the
    line of its ``<<``."""
    import yaml

    path = write_yaml(
        docs,
        """
        x-common: &base {task: answer, max_new_tokens: 30, question: "Base?"}
        jobs:
          - &q {id: q1, input: docs/one.txt, task: answer, question: "What?"}
          - <<: *q
            id: q2
          - <<: [*q, *base]
            id: q3
            input: docs/two.txt
        """,
    )
    q1, q2, q3 = load_manifest(path).jobs
    assert (q1.id, q2.id, q3.id) == ("q1", "q2", "q3")
    assert q2.task.question == "What?" and q2.origin.endswith(":5")
    assert q3.task.question == "What?" and q3.sampling.max_tokens == 30  # *q first, then *base
    # safe_load agrees on the ids (PyYAML 6.0.4 lets the last of <<: [...] win, against
    # the merge spec, yaml.org/type/merge.html: "keys in mapping nodes earlier in the
    # sequence override keys specified in later mapping nodes")
    assert [j["id"] for j in yaml.safe_load(path.read_text())["jobs"]] == ["q1", "q2", "q3"]
    path.write_text("jobs:\n  - &q {id: q1, input: docs/one.txt}\n  - <<: *q\n")
    problem = find(problems_of(path), "jobs[1].id")  # the merged id: on the line of <<
    assert problem.line == 3 and "duplicate id 'q1'" in problem.message
    path.write_text("jobs:\n  - {input: docs/one.txt, <<: 3}\n")
    assert "a merge (<<) takes a mapping" in find(problems_of(path), "jobs[0].<<").message
    path.write_text("defaults_: &d {task: answer}\njobs:\n  - {input: docs/one.txt}\n")
    message = find(problems_of(path), "defaults_").message
    assert "unknown top-level key" in message and "starting with x-" in message


def test_two_merge_keys_in_one_mapping_are_a_duplicate_key(docs):
    """Fresh-user finding: ``{id: y, <<: *a, <<: {question: other}}`` was read with the
    first ``<<`` winning and no word; two ``<<`` keys are a duplicate key (a list merges
    several)."""
    path = write_yaml(
        docs,
        """
        x-a: &a {task: answer, question: "A?"}
        jobs:
          - {id: y, input: docs/one.txt, <<: *a,
             <<: {question: "other"}}
        """,
    )
    problem = find(problems_of(path), "jobs[0].<<")
    assert problem.line == 4 and "duplicate key (first given on line 3" in problem.message
    assert "<<: [*a, *b]" in problem.message
    path.write_text(path.read_text().replace('<<: *a,\n     <<: {question: "other"}', "<<: [*a]"))
    assert load_manifest(path).jobs[0].task.question == "A?"


def test_json_duplicate_keys_are_refused_at_any_depth(docs):
    """Fresh-user finding: a JSONL job with ``input`` twice ran on the last one, no word
    (YAML refuses a duplicate key). Every key given twice in one JSON object is a
    problem, on its line, named by its path."""
    lines = [
        '{"id": "j1", "input": "docs/one.txt", "max_new_tokens": 4, "input": "docs/two.txt"}',
        '{"defaults": {"task": "answer", "engine": {"top_k": 512, "top_k": 64}}}',
        json.dumps({"id": "ok", "input": "docs/one.txt"}),
        '{"id": "j3", "input": "docs/two.txt", "stop": ["x"], "id": "j4"}',
    ]
    path = docs / "jobs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    problems = [p for p in problems_of(path) if "duplicate key" in p.message]
    assert [(p.line, p.field) for p in problems] == [
        (1, "job.input"),
        (2, "defaults.engine.top_k"),
        (4, "job.id"),
    ]
    assert str(problems[0]).startswith(f"{path}:1: job.input: duplicate key")
    path.write_text(lines[2] + "\n")
    assert [j.id for j in load_manifest(path).jobs] == ["ok"]


def test_a_value_nested_past_the_recursion_limit_is_a_problem_not_a_traceback(docs):
    """A JSONL line, a batch line or a YAML value whose arrays nest 100,000 deep made
    ``json.loads`` / PyYAML raise RecursionError, a traceback; it is a problem of its own
    line (a batch line is rejected and the rest run), the other lines kept."""
    deep = "[" * 100_000 + "]" * 100_000
    ok = json.dumps({"id": "ok", "input": "docs/one.txt"})
    path = docs / "jobs.jsonl"
    path.write_text('{"id": "a", "input": "docs/one.txt", "x": ' + deep + "}\n" + ok + "\n")
    problems = problems_of(path)
    assert [(p.line, p.message) for p in problems] == [
        (1, "not readable: nested too deeply (past Python's recursion limit)")
    ]
    yaml_path = write_yaml(docs, "jobs:\n  - id: a\n    input: docs/one.txt\n    x: " + deep + "\n")
    assert any("nested too deeply" in p.message for p in problems_of(yaml_path))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    good = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": body}
    batch = docs / "batch.jsonl"
    batch.write_text(json.dumps(good) + "\n" + '{"custom_id": "r2", "x": ' + deep + "}\n")
    manifest = load_manifest(batch)
    assert [j.id for j in manifest.jobs] == ["r1"]
    assert [(r.line, "nested too deeply" in str(r)) for r in manifest.rejected] == [(2, True)]


def test_paths_are_relative_to_the_manifest(docs, monkeypatch, tmp_path_factory):
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    path = write_yaml(docs, "jobs:\n  - input: docs/one.txt\n")
    (job,) = load_manifest(path).jobs
    assert job.inputs == ((docs / "docs/one.txt").resolve(),)


def test_jsonl_manifest_lines_and_defaults(docs):
    lines = [
        json.dumps({"defaults": {"task": "summarize", "engine": {"top_k": 512}}}),
        json.dumps({"id": "a", "input": "docs/one.txt"}),
        "",
        json.dumps({"id": "b", "input": "docs/two.txt", "temperature": "hot"}),
        "{not json",
        json.dumps(["a", "list"]),
    ]
    path = docs / "jobs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    problems = problems_of(path)
    assert find(problems, "job.temperature").line == 4
    assert {p.line for p in problems if "not valid JSON" in p.message} == {5}
    assert {p.line for p in problems if "JSON object" in p.message} == {6}


def test_pretty_printed_json_named_jsonl_says_one_object_per_line(docs):
    """Fresh-user finding: a pretty-printed JSON manifest named ``.jsonl`` gave one "not
    valid JSON" per line (and a job of each line that parsed alone). When its first line
    is not JSON and the whole file is, one problem says a .jsonl takes one JSON object per
    line; the same file named .json reads whole."""
    jobs = [{"id": "a", "input": "docs/one.txt"}, {"id": "b", "input": "docs/two.txt"}]
    text = json.dumps({"jobs": jobs}, indent=2)
    pretty_b = '{\n      "id": "b",\n      "input": "docs/two.txt"\n    }'
    text = text.replace(pretty_b, json.dumps(jobs[1]))  # a line that parses alone
    (docs / "jobs.jsonl").write_text(text + "\n")
    (problem,) = problems_of(docs / "jobs.jsonl")
    assert problem.line == 1 and "one JSON object per line" in problem.message
    (docs / "jobs.json").write_text(text)
    assert [j.id for j in load_manifest(docs / "jobs.json").jobs] == ["a", "b"]
    (docs / "bad.jsonl").write_text('{"id": "a", "input": "docs/one.txt"}\n{not json\n')
    (problem,) = problems_of(docs / "bad.jsonl")  # the first line is JSON: no hint
    assert problem.line == 2 and "not valid JSON" in problem.message


def test_jsonl_valid(docs):
    path = docs / "jobs.jsonl"
    path.write_text(
        json.dumps({"defaults": {"max_new_tokens": 9, "engine": {"top_k": 512}}})
        + "\n"
        + json.dumps({"id": "a", "input": "docs/one.txt", "prompt": "Title of: ${document}"})
        + "\n"
    )
    manifest = load_manifest(path)
    assert manifest.engine == {"top_k": 512}
    assert manifest.jobs[0].task.task == "custom" and manifest.jobs[0].sampling.max_tokens == 9


def test_cli_overrides_beat_the_manifest(docs):
    path = write_yaml(
        docs, "defaults: {temperature: 0.2}\njobs:\n  - {input: docs/one.txt, temperature: 0.9}\n"
    )
    (job,) = load_manifest(path, {"temperature": 0.0, "max_new_tokens": 7, "seed": None}).jobs
    assert job.sampling.temperature == 0.0 and job.sampling.max_tokens == 7


def test_bad_cli_value_is_named_by_flag(docs):
    with pytest.raises(ManifestError) as info:
        jobs_from_paths([str(docs / "docs/one.txt")], {"top_p": 0.0, "task": "answer"})
    fields = {p.field for p in info.value.problems}
    assert fields == {"--top-p", "--question"}
    assert all(p.file == "command line" for p in info.value.problems)
    assert len(info.value.problems) == 2  # the missing question is reported once, not per document


def test_custom_template_problems(docs):
    path = write_yaml(
        docs,
        """
        jobs:
          - {id: a, input: docs/one.txt, task: custom, prompt: "Summarize {document}"}
          - {id: b, input: docs/one.txt, template: "Use $undefined with ${document}"}
          - {id: c, input: docs/one.txt, task: custom}
          - {id: d, input: docs/one.txt, prompt: "Q: $question F: ${fields} D: $document"}
          - {id: e, input: docs/one.txt, prompt: "Q: $question D: $document", question: "Who?"}
        """,
    )
    problems = problems_of(path)
    assert "${document}" in find(problems, "jobs[0].prompt").message
    assert "$undefined" in find(problems, "jobs[1].template").message
    assert "required for task 'custom'" in find(problems, "jobs[2].prompt").message
    # a variable the prompt uses but the job does not give would be replaced by nothing
    assert "the custom prompt uses $question" in find(problems, "jobs[3].question").message
    assert "the custom prompt uses $fields" in find(problems, "jobs[3].fields").message
    assert not [p for p in problems if p.field.startswith("jobs[4]")]


@pytest.mark.parametrize(
    "bad", ["../x", "/etc/passwd", "a/b", "a\\b", ".hidden", "", "con", "x" * 200, "sp ace"]
)
def test_path_traversal_in_id_and_output_is_refused(docs, bad):
    path = write_yaml(
        docs, f"jobs:\n  - id: ok\n    input: docs/one.txt\n    output: {json.dumps(bad)}\n"
    )
    assert find(problems_of(path), "jobs[0].output").line == 4
    path = write_yaml(docs, f"jobs:\n  - id: {json.dumps(bad)}\n    input: docs/one.txt\n")
    assert find(problems_of(path), "jobs[0].id").line == 2


def test_short_form_ids_never_collide(docs, monkeypatch):
    monkeypatch.chdir(docs)
    manifest = jobs_from_paths(
        ["docs/a/report.txt", "docs/b/report.txt", "docs/*.txt", "docs/one.txt"]
    )
    ids = [job.id for job in manifest.jobs]
    assert ids == ["a-report", "b-report", "one", "two"]


def test_short_form_missing_files_reported_together(docs, monkeypatch):
    monkeypatch.chdir(docs)
    with pytest.raises(ManifestError) as info:
        jobs_from_paths(["nope.txt", "docs/*.pdf", "docs"])
    messages = [p.message for p in info.value.problems]
    assert len(messages) == 3
    assert (
        "file not found" in messages[0]
        and "matches no files" in messages[1]
        and "directory" in messages[2]
    )
    assert {p.field for p in info.value.problems} == {"DOCS"}


def test_pipes_and_devices_are_named_not_missing(docs, monkeypatch):
    """A FIFO or a device is not "file not found" (fresh-user finding: `<(cat doc)` and
    `/dev/zero` read as missing): the problem says what it is and what to do (``-``, standard
    input, is a job of its own now: tests/cli/test_cli_stdin.py)."""
    monkeypatch.chdir(docs)
    fifo = docs / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ManifestError) as info:
        jobs_from_paths(["pipe", "/dev/null"])
    messages = [p.message for p in info.value.problems]
    assert len(messages) == 2
    assert all("file not found" not in m and "save the text to a file" in m for m in messages)
    assert all("pipe or a device" in m and "hisparse run -" in m for m in messages)


def test_missing_or_null_input_is_required(docs):
    path = write_yaml(docs, "jobs:\n  - id: a\n  - id: b\n    input: null\n")
    problems = problems_of(path)
    assert find(problems, "jobs[0].input").line == 2
    assert find(problems, "jobs[1].input").line == 4
    assert "required" in find(problems, "jobs[1].input").message


def test_defaults_cannot_hold_per_job_fields(docs):
    path = write_yaml(docs, "defaults: {output: x}\njobs:\n  - {input: docs/one.txt}\n")
    assert "per job" in find(problems_of(path), "defaults.output").message


def test_engine_setting_values_are_all_reported_with_lines(docs):
    """Bad values in defaults.engine (not only unknown names and wrong types) are found at
    load, every one with its line, together with the jobs' problems."""
    path = write_yaml(
        docs,
        """
        defaults:
          engine:
            attention: fuzzy
            page_size: 17
            top_k: -5
            host_pool_gb: 0
            num_threads: 0
            context_policy: squash
            cuda_graph: maybe
        jobs:
          - {input: docs/one.txt, temperature: -1}
        """,
    )
    problems = problems_of(path)
    expected = {
        "attention": (3, "one of dense, sparse"),
        "page_size": (4, "one of 16, 32, 64"),
        "top_k": (5, "positive integer"),
        "host_pool_gb": (6, "> 0"),
        "num_threads": (7, "positive integer"),
        "context_policy": (8, "one of refuse, extend, truncate"),
        "cuda_graph": (9, "must be true or false"),
    }
    for name, (line, phrase) in expected.items():
        problem = find(problems, f"defaults.engine.{name}")
        assert problem.line == line and phrase in problem.message, str(problem)
        assert str(problem).startswith(f"{path}:{line}: defaults.engine.{name}: ")
    assert find(problems, "jobs[0].temperature").line == 11


def test_jsonl_engine_setting_values_name_the_line(docs):
    path = docs / "jobs.jsonl"
    engine = {"indexer": "psychic", "local_window": -1}
    path.write_text(
        json.dumps({"id": "a", "input": "docs/one.txt"})
        + "\n"
        + json.dumps({"defaults": {"engine": engine}})
        + "\n"
    )
    problems = problems_of(path)
    assert find(problems, "defaults.engine.indexer").line == 2
    assert ">= 0" in find(problems, "defaults.engine.local_window").message


def test_group_combine_in_a_manifest_names_the_line(docs):
    path = docs / "jobs.yaml"
    path.write_text(
        "defaults:\n  engine:\n    group_combine: vote\njobs:\n  - id: a\n    input: docs/one.txt\n"
    )
    problem = find(problems_of(path), "defaults.engine.group_combine")
    assert problem.line == 3 and "sum, max, normmax, union" in problem.message


def test_every_engine_setting_has_a_value_check():
    """A new EngineConfig field needs an entry in SETTING_CHECKS, or bad values of it in a
    manifest would only surface later, one at a time."""
    import dataclasses

    from engine.config import SETTING_CHECKS, EngineConfig

    names = {f.name for f in dataclasses.fields(EngineConfig)}
    assert names - set(SETTING_CHECKS) == {"device"}  # checked by the runner
    assert EngineConfig().problems() == []


def _loop_tree(tmp_path):
    """``d/a.txt`` plus ``d/s/l -> ..`` (a link back to ``d``), the issue #19.3 tree."""
    (tmp_path / "d" / "s").mkdir(parents=True)
    (tmp_path / "d" / "a.txt").write_text("x\n")
    (tmp_path / "d" / "s" / "l").symlink_to("..")
    return tmp_path


def test_glob_through_a_symlink_loop_matches_each_file_once(tmp_path):
    path = write_yaml(_loop_tree(tmp_path), 'jobs:\n  - id: all\n    input: "d/**/*.txt"\n')
    manifest = load_manifest(path)
    (job,) = manifest.jobs
    assert job.inputs == (tmp_path / "d" / "a.txt",)
    (warning,) = manifest.warnings
    assert "jobs.yaml:3" in warning and "d/**/*.txt" in warning
    assert "d/s/l -> .." in warning and "already searched" in warning


def test_same_file_through_a_link_or_another_spelling_is_one_input(docs, monkeypatch):
    monkeypatch.chdir(docs)
    (docs / "alias.txt").symlink_to(docs / "docs" / "one.txt")
    manifest = jobs_from_paths(["docs/one.txt", "alias.txt", "docs/a/../one.txt", "docs/two.txt"])
    assert [job.inputs for job in manifest.jobs] == [
        (docs / "docs" / "one.txt",),
        (docs / "docs" / "two.txt",),
    ]
    path = write_yaml(docs, "jobs:\n  - id: j\n    input: [docs/one.txt, alias.txt, 'docs/*.txt']\n")
    (job,) = load_manifest(path).jobs
    assert job.inputs == (docs / "docs" / "one.txt", docs / "docs" / "two.txt")


def test_two_jobs_without_ids_over_one_file_are_a_problem_of_the_second(docs, monkeypatch):
    """Two manifest jobs without an id over the same file (directly or through a link)
    took the same derived id, refused as ``duplicate id 'one-1ced6f2f'`` (an id the
    manifest never wrote), or, beside an earlier result of that file, quietly ran twice
    under two ids. Now the second job's input is named, in every output folder; with ids
    of their own (two questions on one document) both run."""
    from hisparse_cli.naming import EarlierJob

    monkeypatch.chdir(docs)
    (docs / "alias.txt").symlink_to(docs / "docs" / "one.txt")
    path = write_yaml(
        docs,
        """
        jobs:
          - input: docs/one.txt
          - input: docs/two.txt
          - input: alias.txt
            task: answer
            question: Who?
        """,
    )
    (problem,) = problems_of(path)
    assert (problem.field, problem.line) == ("jobs[2].input", 4)
    same = "reads the same file(s) as jobs[0], line 2 (alias.txt and docs/one.txt are the same)"
    assert same in problem.message
    assert "neither job has an id" in problem.message and "duplicate id" not in problem.message
    earlier = [EarlierJob("one", ((docs / "docs" / "one.txt"),), "one.txt")]
    with pytest.raises(ManifestError) as info:
        load_manifest(path, earlier_jobs=earlier)
    assert [p.field for p in info.value.problems] == ["jobs[2].input"]
    with_id = path.read_text().replace("- input: alias.txt", "- id: who\n    input: alias.txt")
    path.write_text(with_id)
    assert [job.id for job in load_manifest(path).jobs] == ["one", "two", "who"]


def test_the_same_file_by_two_hard_links_is_one_input_and_one_job(docs, monkeypatch):
    """Fresh-user finding: two hard links to one file (``ln docs/one.txt copy.txt``: the
    same device and inode) counted as two files, as symbolic links no longer do: a job
    listing both read the document twice, and two jobs without an id over them ran it
    twice. They are one file now: one input, and the second job is a problem naming both
    paths."""
    monkeypatch.chdir(docs)
    os.link(docs / "docs" / "one.txt", docs / "copy.txt")
    manifest = jobs_from_paths(["docs/one.txt", "copy.txt", "docs/two.txt"])
    assert [job.inputs for job in manifest.jobs] == [
        (docs / "docs" / "one.txt",),
        (docs / "docs" / "two.txt",),
    ]
    assert any(
        "DOCS: docs/one.txt, copy.txt are the same file (hard links to one file" in w
        for w in manifest.warnings
    ), manifest.warnings
    path = write_yaml(docs, "jobs:\n  - id: j\n    input: [docs/one.txt, copy.txt]\n")
    (job,) = load_manifest(path).jobs
    assert job.inputs == (docs / "docs" / "one.txt",)
    path = write_yaml(docs, "jobs:\n  - input: docs/one.txt\n  - input: copy.txt\n")
    (problem,) = problems_of(path)
    assert (problem.field, problem.line) == ("jobs[1].input", 3)
    assert (
        "reads the same file(s) as jobs[0], line 2 (copy.txt and docs/one.txt are hard links "
        "to the same file(s))" in problem.message
    )


def test_a_glob_names_each_broken_link_it_matches_and_reads_the_rest(docs, monkeypatch):
    """Fresh-user finding: a glob that matched a broken symbolic link skipped it without a
    word (the same link named without a glob says it is broken and where it points). Each
    one a glob matches is now a warning naming the link and its target, at the manifest
    line (or the command line), and the other matches are read; a glob that matched only
    broken links is refused naming one."""
    monkeypatch.chdir(docs)
    (docs / "docs" / "dangling.txt").symlink_to("nowhere.txt")
    for pattern in ("docs/*.txt", "docs/**/*.txt"):
        path = write_yaml(docs, f"jobs:\n  - id: all\n    input: '{pattern}'\n")
        manifest = load_manifest(path)
        (job,) = manifest.jobs
        assert "dangling.txt" not in " ".join(str(p) for p in job.inputs)
        assert docs / "docs" / "one.txt" in job.inputs
        (warning,) = manifest.warnings
        assert warning.startswith(f"{path}:3: input glob {pattern!r}: docs/dangling.txt ")
        where = docs / "docs" / "nowhere.txt"
        assert f"is a broken symbolic link: it points to 'nowhere.txt' ({where})" in warning
        command_line = jobs_from_paths([pattern])
        assert {"one", "two"} <= {j.id for j in command_line.jobs}
        assert not any("dangling" in j.id for j in command_line.jobs)
        assert any(
            w.startswith(f"command line: input glob {pattern!r}: docs/dangling.txt is a broken")
            for w in command_line.warnings
        ), command_line.warnings
    path = write_yaml(docs, "jobs:\n  - id: none\n    input: docs/d*.txt\n")
    (problem,) = problems_of(path)
    assert problem.field == "jobs[0].input" and problem.line == 3
    assert "glob 'docs/d*.txt' matches no files" in problem.message
    assert "docs/dangling.txt is a broken symbolic link: it points to 'nowhere.txt'" in (
        problem.message
    )


def test_walk_glob_matches_glob_on_a_tree_without_links(tmp_path):
    import glob as globlib

    from hisparse_cli.manifest import walk_glob

    for name in ("a.txt", "b.md", ".hidden.txt", "x/c.txt", "x/y/d.txt", "x/.h/e.txt", ".g/f.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("t\n")
    for pattern in ("**/*.txt", "x/**/*.txt", "**/.*.txt", "x/**", "**/y/*.txt", "*/**/d.txt"):
        expected = sorted(p.rstrip("/") for p in globlib.glob(pattern, root_dir=tmp_path, recursive=True))
        assert walk_glob(pattern, tmp_path) == (expected, []), pattern
    absolute = f"{tmp_path}/x/**/*.txt"
    assert walk_glob(absolute, tmp_path)[0] == sorted(globlib.glob(absolute, recursive=True))


def test_duplicate_paths_are_found_without_comparing_every_pair(tmp_path, monkeypatch):
    """Issue #19.9: the duplicate check was quadratic (list membership; 10,000 files took
    25 s). Count path comparisons: linear means a few per path, not n^2 / 2."""
    import pathlib

    monkeypatch.chdir(tmp_path)
    names = [f"f{i}.txt" for i in range(2000)]
    for name in names:
        (tmp_path / name).write_text("t\n")
    calls = 0
    original = pathlib.PurePath.__eq__

    def counting(self, other):
        nonlocal calls
        calls += 1
        return original(self, other)

    monkeypatch.setattr(pathlib.PurePath, "__eq__", counting)
    manifest = jobs_from_paths([*names, *names[:10]])
    monkeypatch.undo()
    assert len(manifest.jobs) == 2000
    assert calls < 10 * len(names), calls


def test_a_broken_link_is_named_as_one_with_its_target(docs):
    """Fresh-user finding: ``dangling.txt -> nowhere.txt`` said "file not found"; a
    manifest's input that is a broken symbolic link says so and where it points."""
    (docs / "dangling.txt").symlink_to("nowhere.txt")
    path = write_yaml(docs, "jobs:\n  - input: dangling.txt\n")
    message = find(problems_of(path), "jobs[0].input").message
    assert "'dangling.txt' is a broken symbolic link" in message
    assert f"points to 'nowhere.txt' ({docs / 'nowhere.txt'}), which does not exist" in message


@pytest.mark.parametrize(
    "name", ["results.jsonl", "config.json", ".hisparse.lock", "batch_output.jsonl", "Results.JSONL"]
)
def test_an_output_named_as_a_file_the_run_writes_is_refused(docs, name):
    """Fresh-user finding: ``output: results.jsonl`` or ``config.json`` was written as
    ``results.jsonl.txt`` without a word, while ``.hisparse.lock`` was refused (for its
    leading dot). Each of the run's own file names is refused alike, with the manifest's
    file, line and field."""
    path = write_yaml(
        docs, f"jobs:\n  - id: ok\n    input: docs/one.txt\n    output: {json.dumps(name)}\n"
    )
    problem = find(problems_of(path), "jobs[0].output")
    assert problem.file.endswith("jobs.yaml") and str(problem).startswith(
        f"{problem.file}:4: jobs[0].output: "
    )
    assert f"{name!r} is a file the run writes in the output folder itself" in problem.message
    assert "results.jsonl, config.json, .hisparse.lock and batch_output.jsonl" in problem.message
