"""``--task extract`` as data: ``--fields a,b`` and the parsed reply on the results line."""

from __future__ import annotations

import json
import os
import signal

import pytest
from test_cli_run import read_results

from hisparse_cli import testing
from hisparse_cli.extract import parse_extracted
from hisparse_cli.tasks import TaskSpec, build_messages


@pytest.mark.parametrize(
    "text, fields, data",
    [
        ('{"title": "Sorting", "year": 2024}', ("title", "year"), {"title": "Sorting", "year": 2024}),
        ('Here it is:\n```json\n{"title": "A {b}", "year": null}\n```', ("title", "year"),
         {"title": "A {b}", "year": None}),
        ('{"title": "x", "extra": 1}', ("title",), {"title": "x", "extra": 1}),
        ('{bad} then {"a": 1}', None, {"a": 1}),
        ('[1, 2] {"a": [1]}', "schema text", {"a": [1]}),
    ],
)  # fmt: skip
def test_replies_that_hold_the_object(text, fields, data):
    assert parse_extracted(text, fields) == (data, None)


@pytest.mark.parametrize(
    "text, fields, phrase",
    [
        ("I cannot find that.", ("title",), "no JSON object in the reply"),
        ('{"title": "cut', ("title",), "invalid JSON: Unterminated string starting at character 10"),
        ('{"title" "x"}', ("title",), "invalid JSON: Expecting ':' delimiter at character 9"),
        ('{"title": "x"}', ("title", "date"), "lacks field(s) 'date'"),
        ("[1, 2]", None, "no JSON object"),
    ],
)
def test_replies_without_the_object_name_the_reason(text, fields, phrase):
    data, error = parse_extracted(text, fields)
    assert data is None and phrase in error


def test_fields_flag_reaches_the_prompt_and_the_data_reaches_the_results(cli, docs, tmp_path):
    replies = {"alpha": '```json\n{"topic": "sorting", "year": null}\n```', "beta": "No idea."}
    factory = testing.fake_engine_factory(texts=replies)
    result = cli(
        "docs/alpha.txt", "docs/beta.txt", "--task", "extract", "--fields", "topic, year",
        engine=factory,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    spec = TaskSpec(task="extract", fields=("topic", "year"))
    document = (docs / "alpha.txt").read_text()
    messages = build_messages(spec, document, "alpha", "alpha.txt")
    assert "fields from the document above: topic, year." in messages[-1]["content"]
    expected = testing.FakeTokenizer().encode_chat(messages)
    assert list(factory.engines[0].seen[0].prompt_ids) == expected
    by_id = {r["id"]: r for r in read_results(tmp_path / "hisparse-out")}
    assert by_id["alpha"]["data"] == {"topic": "sorting", "year": None}
    assert by_id["alpha"]["data_error"] is None
    assert by_id["beta"]["data"] is None and "no JSON object" in by_id["beta"]["data_error"]
    assert by_id["beta"]["ok"]  # the text is still the job's result
    assert "beta: no data extracted: no JSON object in the reply" in result.stderr


def test_other_tasks_have_no_data_field(cli, docs, tmp_path):
    assert cli("docs/alpha.txt").exit_code == 0
    assert "data" not in read_results(tmp_path / "hisparse-out")[0]


def test_fields_flag_without_extract_is_refused_naming_the_flag(cli, docs, tmp_path):
    result = cli("docs/alpha.txt", "--fields", "a,b")
    assert result.exit_code == 2 and "--fields" in result.stderr
    assert "only used with tasks 'extract' and 'custom'" in result.stderr
    empty = cli("docs/alpha.txt", "--task", "extract", "--fields", ",")
    assert empty.exit_code == 2 and "--fields" in empty.stderr
    gap = cli("docs/alpha.txt", "--task", "extract", "--fields", "a,,b")
    assert gap.exit_code == 2 and "--fields: has an empty field name" in gap.stderr


def test_field_lists_constrain_the_reply_other_jobs_stay_free(cli, docs, tmp_path):
    factory = testing.fake_engine_factory(texts={"alpha": '{"topic": "sorting", "year": 2024}'})
    args = ["docs/alpha.txt", "--task", "extract", "--fields", "topic,year", "--output-dir", "a"]
    assert cli(*args, engine=factory).exit_code == 0
    assert factory.engines[0].seen[0].json_keys == ("topic", "year")
    schema = testing.fake_engine_factory()
    assert cli("docs/alpha.txt", "--task", "extract", "--output-dir", "b", engine=schema).exit_code == 0
    plain = testing.fake_engine_factory()
    assert cli("docs/alpha.txt", "--output-dir", "c", engine=plain).exit_code == 0
    assert schema.engines[0].seen[0].json_keys is None
    assert plain.engines[0].seen[0].json_keys is None


def test_constrained_replies_get_their_own_resume_key():
    from engine.config import EngineConfig, SamplingParams
    from hisparse_cli.keys import settings_hash

    def key(fields):
        spec = TaskSpec(task="extract", fields=fields)
        return settings_hash(spec, SamplingParams(), "m", EngineConfig(), {})

    assert key(("a",)) != key("a") and key(("a",)) != key(("b",))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tiny_models import build_hf  # imports transformers: only where needed

    folder = tmp_path_factory.mktemp("tiny_llama")
    build_hf(folder, "llama", max_position_embeddings=1024)
    return folder


def test_fields_run_end_to_end_gives_the_parsed_object(cli, docs, tmp_path, tiny_llama):
    """``hisparse run --fields title,summary`` through the real engine on a tiny random
    Llama (tests/tiny_models.py, a 256-token byte-level vocabulary): the reply is decoded
    under the JSON constraint, so the results line has the parsed object with both keys
    even from random weights; the same run without ``--fields`` gives no object."""
    from engine.load import load_engine

    def tiny(config, model):
        return load_engine(config, str(tiny_llama))

    args = ["docs/alpha.txt", "--task", "extract", "--max-new-tokens", "40", "--threads", "1"]
    result = cli(*args, "--fields", "title,summary", engine=tiny)
    assert result.exit_code == 0, result.output
    (line,) = read_results(tmp_path / "hisparse-out")
    assert line["ok"] and line["data_error"] is None, line
    assert list(line["data"]) == ["title", "summary"]
    assert line["data"] == json.loads(line["text"])
    assert line["generated_tokens"] <= 40 and line["finish_reason"] == "stop"
    free = cli(*args, "--output-dir", "free", engine=tiny)
    assert free.exit_code == 0, free.output
    (line,) = read_results(tmp_path / "free")
    assert line["data"] is None and line["data_error"]  # random weights: no object unaided


def test_manifest_field_lists_are_constrained_and_repeats_refused(cli, docs, tmp_path):
    (tmp_path / "jobs.yaml").write_text(
        "jobs:\n  - {id: a, input: docs/alpha.txt, task: extract, fields: [topic, year]}\n"
        "  - {id: b, input: docs/beta.txt, task: extract, fields: 'topic and year as JSON'}\n"
    )
    factory = testing.fake_engine_factory()
    assert cli("--manifest", "jobs.yaml", engine=factory).exit_code == 0
    keys = {job.id: job.json_keys for job in factory.engines[0].seen}
    assert keys == {"a": ("topic", "year"), "b": None}
    result = cli("docs/alpha.txt", "--task", "extract", "--fields", "topic,year,topic")
    assert result.exit_code == 2 and "--fields" in result.stderr
    assert "repeats field name(s) 'topic'" in result.stderr


def test_a_cancelled_extract_reply_has_no_data_error(cli, docs, tmp_path):
    """Fresh-user finding: a job cut off by Ctrl-C got a data_error for its (naturally)
    incomplete JSON, noise on a line that already says cancelled."""

    def interrupt(step):
        if step == 1:
            os.kill(os.getpid(), signal.SIGINT)

    factory = testing.fake_engine_factory(texts={"alpha": '{"topic": "sor'}, on_step=interrupt)
    result = cli("docs/alpha.txt", "--task", "extract", "--fields", "topic", engine=factory)
    assert result.exit_code == 130, result.output
    (record,) = [json.loads(x) for x in (tmp_path / "hisparse-out" / "results.jsonl").open()]
    assert record["finish_reason"] == "cancelled"
    assert record["data"] is None and record["data_error"] is None
