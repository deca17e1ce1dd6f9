"""``hisparse eval`` end to end on a tiny random Llama (tests/tiny_models.py): the table and
heatmap are written, and every configuration's answers equal what ``Engine.run`` (its own
prefill, the normal job path) gives for the same prompts."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from engine import events as ev
from engine.config import SamplingParams
from engine.load import load_engine, load_tokenizer
from engine.measure import fidelity, ruler
from engine.presets import resolve_config
from hisparse_cli.main import app

CONFIGS = "dense,top_k=64:page=16,top_k=96:page=32:hierarchical=false:combine=sum"
ARGS = ["--lengths", "600,900", "--depths", "0.2,0.8", "--tasks", "niah_single,vt"]
ARGS += ["--configs", CONFIGS, "--max-new-tokens", "5", "--seed", "3", "--threads", "1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import build_hf  # imports transformers: only where needed

    folder = tmp_path_factory.mktemp("tiny_llama")
    build_hf(folder, "llama", max_position_embeddings=1024)
    return folder


def test_eval_table_and_answers_equal_engine_runs(tiny, tmp_path):
    out = tmp_path / "out"
    args = ["eval", "--model", str(tiny), "--preset", "cpu", *ARGS, "-o", str(out)]
    result = CliRunner().invoke(app, [*args, "--max-batch", "3"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "eval.json").read_text())
    names = [c["name"] for c in report["configs"]]
    assert names == CONFIGS.split(",")
    assert (out / "eval.png").stat().st_size > 0
    cells = {(c["task"], c["length"], c["config"]) for c in report["table"]}
    assert cells == {(t, n, c) for t in ("niah_single", "vt") for n in (600, 900) for c in names}
    assert "niah_single" in result.output and "top_k=64:page=16" in result.output
    assert "every page is selected" not in result.stderr  # both budgets below 600 tokens

    # the same prompts through Engine.run, one engine per configuration
    tok, _ = load_tokenizer(str(tiny))
    suite = ruler.SuiteBuilder(tok, ruler.Haystack.noise(tok), 3).suite(
        ["niah_single", "vt"], [600, 900], [0.2, 0.8], 1, 5
    )
    assert [r["id"] for r in report["samples"]] == [s.id for s in suite]
    assert [r["prompt_tokens"] for r in report["samples"]] == [len(s.prompt_ids) for s in suite]
    base = resolve_config("cpu", {}, {"max_batch": 3, "num_threads": 1})
    for c in fidelity.parse_configs(CONFIGS):
        engine = load_engine(c.engine_config(base), str(tiny))
        jobs = [ev.Job(s.id, s.prompt_ids, SamplingParams(max_tokens=5)) for s in suite]
        texts = {
            e.result.job_id: e.result.text
            for e in engine.run(jobs)
            if isinstance(e, ev.JobFinished)
        }
        engine.close()
        for row in report["samples"]:
            answer = row["answers"][c.name]
            assert answer["text"] == texts[row["id"]], (c.name, row["id"])
            assert answer["score"] == ruler.score(row["expected"], answer["text"])

    r = CliRunner().invoke(app, [*args, "--lengths", "4K", "--force"], catch_exceptions=False)
    assert r.exit_code == 2 and "no length fits" in r.output and "extend" in r.output


def test_eval_records_page_metadata_and_says_when_the_budget_holds_every_page(tiny, tmp_path):
    """``meta=superpage`` is told apart from ``sparse`` in eval.json (fresh-user finding:
    both showed the same settings), and a budget that covers the whole prompt is named."""
    out = tmp_path / "out"
    args = ["eval", "--model", str(tiny), "--preset", "cpu", "--lengths", "600", "--depths",
            "0.5", "--tasks", "niah_single", "--max-new-tokens", "3", "--threads", "1",
            "--configs", "top_k=2048,top_k=256:meta=superpage:oversample=2", "-o", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    settings = {
        c["name"]: c["settings"] for c in json.loads((out / "eval.json").read_text())["configs"]
    }
    assert settings["top_k=2048"]["page_metadata"] == "exact"
    sp = settings["top_k=256:meta=superpage:oversample=2"]
    assert sp["page_metadata"] == "superpage" and sp["superpage_oversample"] == 2.0
    err = " ".join(result.stderr.split())
    assert "note: top_k=2048 keeps top_k 2048 tokens, the whole prompt at length(s) 600" in err
    assert "note: top_k=256" not in err and "Warning" not in err  # matplotlib's too


def test_eval_table_never_cuts_config_names():
    """Two long names sharing a prefix stayed apart only in eval.json (a fresh user's
    finding at 80 columns: both columns read ``top_k=256:met…``)."""
    from rich.console import Console

    from hisparse_cli.eval_report import accuracy_table

    names = ["dense", "top_k=256:meta=superpage", "top_k=256:meta=superpage:oversample=2"]
    report = {"model": "m", "configs": [{"name": n} for n in names], "table": [
        {"task": "niah_single", "length": 2048, "config": n, "accuracy": 50.0, "samples": 1}
        for n in names]}  # fmt: skip
    console = Console(width=80, record=True, force_terminal=False)
    console.print(accuracy_table(report))
    text = console.export_text()
    assert "…" not in text and "..." not in text  # wrapped inside its column instead
    assert "oversam" in text and text.count("uperpage") == 2


def test_eval_refuses_bad_arguments_before_loading(tmp_path):
    def run(*extra):
        args = ["eval", "--model", str(tmp_path / "none"), "--preset", "cpu", "-o", str(tmp_path)]
        return CliRunner().invoke(app, [*args, *extra], catch_exceptions=False)

    r = run("--tasks", "niah_triple")
    assert r.exit_code == 2 and "unknown task" in r.output
    r = run("--configs", "dense,pages=3")
    assert r.exit_code == 2 and "not key=value" in r.output
    r = run("--configs", "page=17")
    assert r.exit_code == 2 and "config 'page=17'" in r.output
    r = run("--depths", "0.5,x")
    assert r.exit_code == 2
    r = run(str(tmp_path / "missing.txt"))
    assert r.exit_code == 2 and "no readable haystack file" in r.output
