"""Checks ``hisparse run`` makes before the model loads: ``--max-context`` against the
model's trained context (read from its header), documents too long for the context, and
what ``--print-config`` reports about this machine."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import gguf
import pytest

from engine.weights.header import GGUFHeaderError, read_gguf_fields
from hisparse_cli import preflight, testing
from hisparse_cli import runner as runner_module

REAL_LOAD_TOKENIZER = runner_module.load_tokenizer  # before the cli fixture replaces it


def tiny_gguf(path, context=2048, arch="llama"):
    """A GGUF file holding only metadata (no tensors): enough for the header checks."""
    writer = gguf.GGUFWriter(str(path), arch)
    if context is not None:
        writer.add_context_length(context)
    writer.add_token_list(["a", "bb", "ccc"])  # an array of strings to skip
    writer.add_array("tokenizer.ggml.scores", [0.0, 1.0, 2.0])  # an array of floats
    writer.add_string("general.name", "tiny")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def never_load(*args):
    pytest.fail("the model was loaded")


def test_header_reader_reads_scalars_past_arrays(tmp_path):
    path = tiny_gguf(tmp_path / "m.gguf")
    keys = {"general.architecture", "llama.context_length", "general.name", "absent"}
    assert read_gguf_fields(path, keys) == {
        "general.architecture": "llama",
        "llama.context_length": 2048,
        "general.name": "tiny",
    }


def test_header_reader_refuses_what_is_not_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(32))
    with pytest.raises(GGUFHeaderError, match="not a GGUF file"):
        read_gguf_fields(tmp_path / "x.gguf", {"general.architecture"})
    whole = tiny_gguf(tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[:40])
    with pytest.raises(GGUFHeaderError, match="cut-off"):
        read_gguf_fields(tmp_path / "cut.gguf", {"llama.context_length"})
    (tmp_path / "v9.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 9, 0, 0))
    with pytest.raises(GGUFHeaderError, match="version 9"):
        read_gguf_fields(tmp_path / "v9.gguf", {"general.architecture"})


def test_trained_context_of_each_kind_of_model(tmp_path):
    assert preflight.trained_context(str(tiny_gguf(tmp_path / "m.gguf", 3000))) == 3000
    assert preflight.trained_context(str(tiny_gguf(tmp_path / "d.gguf", None))) == 4096
    assert preflight.trained_context(str(tiny_gguf(tmp_path / "g.gguf", arch="gpt2"))) is None
    assert preflight.trained_context(str(tmp_path / "missing.gguf")) is None
    assert preflight.trained_context("synthetic:tiny") > 0
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100,
                "max_position_embeddings": 1536, "rms_norm_eps": 1e-5,
            }
        )
    )  # fmt: skip
    assert preflight.trained_context(str(folder)) == 1536


def test_embedded_model_context_is_read_from_its_header():
    from engine.weights.embedded import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    assert preflight.trained_context(None) == 8192


@pytest.mark.parametrize(
    "extra, source",
    [
        (["--max-context", "4096"], "--max-context 4096 is above"),
        (["--max-context", "4096", "--context-policy", "truncate"], "--max-context 4096 is above"),
    ],
)
def test_max_context_above_training_exits_2_before_loading(cli, docs, tmp_path, extra, source):
    model = tiny_gguf(tmp_path / "m.gguf")
    result = cli("docs/alpha.txt", "--model", str(model), *extra, engine=never_load)
    assert result.exit_code == 2, result.output
    assert source in result.stderr and "trained context of 2048 tokens" in result.stderr
    assert "--context-policy extend" in result.stderr
    assert not (tmp_path / "hisparse-out").exists()


def test_max_context_from_a_manifest_is_named_there(cli, docs, tmp_path):
    model = tiny_gguf(tmp_path / "m.gguf")
    (tmp_path / "jobs.yaml").write_text(
        "defaults:\n  engine: {max_context: 9000}\njobs:\n  - {input: docs/alpha.txt}\n"
    )
    result = cli("--manifest", "jobs.yaml", "--model", str(model), engine=never_load)
    assert result.exit_code == 2
    assert "the manifest's defaults.engine.max_context 9000 is above" in result.stderr


def test_max_context_within_training_or_with_extend_runs(cli, docs, tmp_path):
    model = str(tiny_gguf(tmp_path / "m.gguf"))
    assert cli("docs/alpha.txt", "--model", model, "--max-context", "2048").exit_code == 0
    extend = ("--context-policy", "extend", "--max-context", "8192")
    assert cli("docs/beta.txt", "--model", model, *extend).exit_code == 0


def test_documents_longer_than_the_context_are_named_before_the_model_loads(cli, docs, tmp_path):
    model = str(tiny_gguf(tmp_path / "m.gguf"))
    (docs / "big.txt").write_text("A long line of prose about sorting things.\n" * 400)  # 17.2 KB
    result = cli("docs/big.txt", "docs/alpha.txt", "--model", model, "--max-new-tokens", "8")
    assert "may be longer" in result.stderr  # a warning: stderr; output interleaves both
    out = result.output
    statement = "1 document(s) may be longer than the model's context of 2,048 tokens"
    assert statement in out
    line = out[out.index(statement) :].splitlines()[0]
    assert "big (~6,143 tokens)" in line and "alpha" not in line  # 17200 bytes / 2.8
    assert "--context-policy extend" in out and "--context-policy truncate" in out
    assert "--context-policy chunk" in out  # every policy that lets it run
    assert "--max-new-tokens" not in line  # the document is the problem
    assert out.index(statement) < out.index("loading model")
    truncate = cli("docs/big.txt", "--model", model, "--context-policy", "truncate", "--force")
    assert "may be longer" not in truncate.output


def test_print_config_reports_what_would_refuse_the_run(cli, docs, tmp_path, monkeypatch):
    model = str(tiny_gguf(tmp_path / "m.gguf"))
    monkeypatch.setenv("HISPARSE_HOST_MEMORY_GB", "24")
    monkeypatch.setattr(runner_module, "cuda_device_count", lambda: 0)
    args = ("--model", model, "--max-context", "4096", "--host-pool", "1000", "--device", "cuda")
    result = cli("docs/alpha.txt", *args, "--print-config")
    assert result.exit_code == 0, result.output
    problems = json.loads(result.stdout)["problems"]
    assert len(problems) == 3, problems
    assert any("--device asks for cuda" in p for p in problems)
    assert any("--max-context 4096 is above" in p for p in problems)
    assert any("--host-pool" in p and "1000.0 GiB" in p for p in problems)
    assert result.stderr.count("a run would be refused here") == 3
    clean = cli("docs/alpha.txt", "--model", model, "--print-config")
    assert "problems" not in json.loads(clean.stdout)


def test_print_config_reports_a_max_new_tokens_that_cannot_fit(cli, docs, tmp_path):
    """The run refuses it (exit 2, below); --print-config says so under ``problems``."""
    model = str(tiny_gguf(tmp_path / "m.gguf"))
    args = ("docs/alpha.txt", "--model", model, "--max-new-tokens", "100000")
    result = cli(*args, "--print-config")
    assert result.exit_code == 0, result.output
    (problem,) = json.loads(result.stdout)["problems"]
    assert "--max-new-tokens 100,000 cannot fit the model's context of 2,048" in problem
    assert "a run would be refused here: --max-new-tokens 100,000" in result.stderr
    assert cli(*args, engine=never_load).exit_code == 2


def test_print_config_reports_the_output_folder_refusals(cli, docs, tmp_path):
    """What the run refuses about its files (exit 2, nothing written) --print-config lists
    under ``problems``, in the run's words; before, it said nothing and exited 0."""
    cases = [
        (("docs/alpha.txt", "docs/beta.txt", "-o", "docs"), "would overwrite the documents"),
        (("docs/alpha.txt", "--trace", "hisparse-out/alpha.txt"), "would replace job 'alpha'"),
    ]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "results.jsonl").write_text("")
    (tmp_path / "jobs.yaml").write_text("jobs:\n  - id: log\n    input: out/results.jsonl\n")
    cases.append((("--manifest", "jobs.yaml", "-o", "out"), "the run's own results.jsonl"))
    for args, words in cases:
        before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
        printed = cli(*args, "--print-config")
        assert printed.exit_code == 0, printed.output
        (problem,) = json.loads(printed.stdout)["problems"]
        assert words in problem, problem
        err = " ".join(printed.stderr.split())
        assert f"a run would be refused here: {' '.join(problem.split())}" in err
        run = cli(*args, engine=never_load)
        assert run.exit_code == 2, run.output
        assert " ".join(problem.split()) in " ".join(run.stderr.split())  # the same words
        assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_an_output_dir_that_cannot_be_made_is_refused_by_print_config_too(cli, docs):
    """The run refused it when it made the folder (exit 2); --print-config said nothing.
    Now the run refuses it up front and --print-config lists it among its problems."""
    words = f"cannot create output dir docs/alpha.txt/out: {docs / 'alpha.txt'} is not a folder"
    result = cli("docs/beta.txt", "-o", "docs/alpha.txt/out", engine=never_load)
    assert result.exit_code == 2, result.output
    assert words in " ".join(result.stderr.split())
    printed = cli("docs/beta.txt", "-o", "docs/alpha.txt/out", "--print-config")
    assert printed.exit_code == 0, printed.output
    (problem,) = json.loads(printed.stdout)["problems"]
    assert words in " ".join(problem.split())


def test_an_output_dir_in_a_folder_that_takes_no_new_folders_is_refused_by_print_config(
    cli, docs, tmp_path, monkeypatch
):
    """Fresh-user finding: ``--print-config -o /proc/foo`` (root: os.access says yes to
    /proc) printed no problem, exit 0, while the run refused it when it made the folder.
    The check makes a probe folder in the nearest existing one, removed at once; here a
    folder whose mkdir fails as /proc's does."""
    (tmp_path / "proc").mkdir()
    real_mkdir = os.mkdir

    def no_folders_here(path, *args, **kwargs):
        if Path(path).absolute().parent == tmp_path / "proc":
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", no_folders_here)
    words = f"cannot create output dir proc/foo: {tmp_path / 'proc'} takes no new folders"
    printed = cli("docs/beta.txt", "-o", "proc/foo", "--print-config")
    assert printed.exit_code == 0, printed.output
    (problem,) = json.loads(printed.stdout)["problems"]
    assert f"{words} (No such file or directory)" in " ".join(problem.split())
    run = cli("docs/beta.txt", "-o", "proc/foo", engine=never_load)
    assert run.exit_code == 2, run.output
    assert words in " ".join(run.stderr.split()) and "Traceback" not in run.output
    monkeypatch.setattr(os, "mkdir", real_mkdir)
    clean = cli("docs/beta.txt", "-o", "fine/out", "--print-config")  # the probe: removed
    assert "problems" not in json.loads(clean.stdout)
    assert not (tmp_path / "fine").exists() and list((tmp_path / "proc").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs", "proc"]


@pytest.mark.skipif(
    not (Path("/proc/self").is_dir() and os.access("/proc", os.W_OK)),
    reason="needs /proc as root (os.access says writable, no folder can be made)",
)
def test_proc_foo_as_output_dir_is_refused_by_print_config(cli, docs):
    printed = cli("docs/beta.txt", "-o", "/proc/foo", "--print-config")
    (problem,) = json.loads(printed.stdout)["problems"]
    assert "cannot create output dir /proc/foo: /proc takes no new folders" in problem


def test_device_cuda_without_cuda_exits_2_before_loading(cli, docs, tmp_path, monkeypatch):
    monkeypatch.setattr(runner_module, "cuda_device_count", lambda: 0)
    result = cli("docs/alpha.txt", "--device", "cuda", engine=never_load)
    assert result.exit_code == 2 and "--device asks for cuda" in result.stderr


def test_extend_far_past_the_trained_context_warns(cli, docs, tmp_path):
    """`extend` to 10M tokens on a 2K model runs, with a warning naming the factor; 32x
    (the published extensions' reach) does not warn."""
    model = str(tiny_gguf(tmp_path / "m.gguf"))
    far = cli("docs/alpha.txt", "--model", model, "--context-policy", "extend",
              "--max-context", "10000000")  # fmt: skip
    assert far.exit_code == 0, far.output
    assert "--max-context 10000000 is 4883x the model's trained context of 2048" in far.stderr
    near = cli("docs/beta.txt", "--model", model, "--context-policy", "extend",
               "--max-context", str(32 * 2048))  # fmt: skip
    assert near.exit_code == 0 and "trained context" not in near.stderr


@pytest.mark.parametrize("policy", ["refuse", "truncate", "chunk", "extend"])
def test_max_new_tokens_over_the_context_exits_2_before_loading(cli, docs, tmp_path, policy):
    """Truncating or chunking does not help a max_new_tokens that does not fit even an
    empty document: refused before the load, naming the flag, the largest value that
    fits, and the larger context that would hold it."""
    model = str(tiny_gguf(tmp_path / "m.gguf"))
    extra = ("--max-context", "2048") if policy == "extend" else ()
    result = cli("docs/alpha.txt", "--model", model, "--max-new-tokens", "100000",
                 "--context-policy", policy, *extra, engine=never_load)  # fmt: skip
    assert result.exit_code == 2, result.output
    err = " ".join(result.stderr.split())
    context = "the model's context of 2,048 tokens"
    if policy == "extend":  # --max-context set the limit
        context = "the context limit of 2,048 tokens (set by --max-context)"
    assert f"--max-new-tokens 100,000 cannot fit {context}" in err
    fits = re.search(r"largest --max-new-tokens that could fit is below ([\d,]+)", err)[1]
    fits = int(fits.replace(",", ""))
    assert 1900 < fits < 2048  # the context less the prompt around an empty document
    assert "may be longer" not in err and not (tmp_path / "hisparse-out").exists()
    # what does help: a larger context (fresh-user finding: it said no policy helps)
    if policy == "extend":
        assert "or raise --max-context" in err
    else:
        assert "or --context-policy extend with a --max-context above it" in err
    engine = testing.fake_engine_factory()
    ok = cli("docs/alpha.txt", "--model", model, "--max-new-tokens", str(fits - 100), engine=engine)
    assert ok.exit_code == 0, ok.output


def test_max_context_too_small_for_the_prompt_names_max_context(cli, docs, tmp_path):
    model = str(tiny_gguf(tmp_path / "m.gguf"))
    result = cli("docs/alpha.txt", "--model", model, "--max-context", "10", engine=never_load)
    assert result.exit_code == 2, result.output
    err = " ".join(result.stderr.split())
    assert "--max-context 10 is too small for the prompt" in err
    assert "below 0" not in err


def test_max_new_tokens_of_a_manifest_job_is_named_there(cli, docs, tmp_path):
    model = str(tiny_gguf(tmp_path / "m.gguf"))
    (tmp_path / "jobs.yaml").write_text(
        "jobs:\n  - {input: docs/alpha.txt, max_new_tokens: 5000}\n"
    )
    result = cli("--manifest", "jobs.yaml", "--model", model, engine=never_load)
    assert result.exit_code == 2
    assert "max_new_tokens 5,000 of job 'alpha' (from jobs.yaml:2 jobs[0].max_new_tokens)" \
        in " ".join(result.stderr.split())


def test_a_presets_max_new_tokens_is_named_as_the_presets(cli, docs, tmp_path):
    """Fresh-user finding: ``hisparse run --print-config`` said the cpu preset's default
    ``max_new_tokens`` (256) over a 200-token context came from the "(command line)", the
    place the job was given; it now names the preset's sampling block, and the run too."""
    model = str(tiny_gguf(tmp_path / "m.gguf", context=200))
    args = ("docs/alpha.txt", "--model", model, "--preset", "cpu", "--device", "cpu")
    result = cli(*args, "--print-config")
    named = "max_new_tokens 256 of job 'alpha' (from preset cpu's sampling.max_tokens) cannot"
    assert named in " ".join(result.stderr.split()) and "command line" not in result.stderr
    assert named in " ".join(cli(*args, engine=never_load).stderr.split())


def test_a_document_that_fits_alone_names_the_max_new_tokens_that_fits(cli, docs, tmp_path):
    model = str(tiny_gguf(tmp_path / "m.gguf"))
    (docs / "mid.txt").write_text("A long line of prose about sorting things.\n" * 100)  # 4.3 KB
    result = cli("docs/mid.txt", "--model", model, "--max-new-tokens", "1500")
    out = " ".join(result.output.split())
    statement = "1 document(s) may not fit beside --max-new-tokens in the model's context of"
    assert statement in out and "mid (~1,536 tokens)" in out  # 4300 bytes / 2.8
    room = re.search(r"lower --max-new-tokens to at most ~([\d,]+) \(a cautious estimate\)", out)
    room = int(room[1].replace(",", ""))
    assert 2048 - 1536 - 300 < room < 2048 - 1536 - preflight.CHAT_TEMPLATE_TOKENS
    assert "--context-policy chunk" in out
    assert out.index(statement) < out.index("loading model")


def test_the_trial_document_near_the_context_gets_advice_safe_to_follow(tmp_path):
    """The fresh-user trial: 28,000 bytes of the Python tutorial took 7,397 tokens with the
    embedded model's chat prompt (3.8 bytes per token), so --max-new-tokens 2000 does not
    fit 8,192 and at most 795 does; the warning fires and advises no more than 795 (here:
    the cautious estimate cannot tell it fits alone, so it names the context policies)."""
    doc = tmp_path / "near.txt"
    doc.write_bytes(b"x" * 28_000)
    found = preflight.oversized_documents([("near", [doc], 2000, 40)], 8192)
    assert [o.job_id for o in found] == ["near"] and found[0].room <= 8192 - 7397
    statement = preflight.oversized_statement(found, 8192, "refuse")
    assert "--max-new-tokens" not in statement and "--context-policy chunk" in statement
    assert "may be longer" in statement and "estimated" in statement


def test_a_short_document_flagged_for_a_tiny_context_is_told_the_prompt_counts(cli, docs, tmp_path):
    """Fresh-user finding: a GGUF declaring a 128-token context gave ``1 document(s) may
    be longer than the model's context of 128 tokens ... even (~10 tokens)``: 10 against
    128, the prompt around the document left unsaid. The warning says what it counts:
    the prompt around the documents, with its estimate, beside each document's own."""
    model = str(tiny_gguf(tmp_path / "m.gguf", context=128))
    (docs / "even.txt").write_text("Even short text here, ten tokens or so.\n")  # 41 bytes
    result = cli("docs/even.txt", "--model", model, "--max-new-tokens", "4")
    out = " ".join(result.output.split())
    statement = "1 document(s) may be longer than the model's context of 128 tokens"
    assert statement in out and "even (~15 tokens)" in out  # 41 bytes / 2.8
    line = out[out.index(statement) :]
    prompt = re.search(r"with the prompt around them \(the task's instruction and the chat "
                       r"template: ~([\d,]+) tokens, counted high\), estimated", line)  # fmt: skip
    assert prompt, line
    assert int(prompt[1]) + 15 > 128 > 15 and int(prompt[1]) >= preflight.CHAT_TEMPLATE_TOKENS
    room = preflight.oversized_statement(
        [preflight.Oversized("a", 10, 4, 30, 50), preflight.Oversized("b", 10, 4, 20, 60)],
        128,
        "refuse",
    )  # a document that fits alone: beside --max-new-tokens; prompts that differ
    assert "may not fit beside --max-new-tokens in the model's context of 128 tokens with " in room
    assert "chat template: up to ~60 tokens, counted high" in room


def test_safe_estimate_is_above_the_real_token_count(smollm2_tokenizer):
    """The safe bytes-per-token bound overestimates the embedded tokenizer's count on
    ordinary text: every 16 KB stretch of this repository's README."""
    from pathlib import Path

    data = (Path(__file__).parents[2] / "README.md").read_bytes()
    for start in range(0, len(data) - 16_000, 4_000):
        text = data[start : start + 16_000].decode("utf-8", "ignore")
        real = len(smollm2_tokenizer.encode(text))
        assert preflight.safe_tokens(len(text.encode())) >= real, start


def test_too_long_advice_names_max_new_tokens_only_when_the_prompt_fits():
    from engine.text.context import too_long_message

    alone = too_long_message(340, 100000, 8192, "refuse")
    assert "lower --max-new-tokens to at most 7,852" in alone
    assert "--context-policy chunk" in alone
    long = too_long_message(9000, 100, 8192, "refuse")
    assert "--max-new-tokens" not in long and "--context-policy truncate" in long
    extend = too_long_message(9000, 100, 8192, "extend")
    assert "raise --max-context to at least 9100" in extend and "chunk" in extend


@pytest.mark.parametrize("fast_bf16, budget", [(True, "0.38"), (False, "0.6")])
def test_a_dense_budget_too_small_for_a_job_is_refused_before_the_load(
    cli, docs, tmp_path, monkeypatch, fast_bf16, budget
):
    """Fresh-user finding: ``hisparse run --attention dense --memory-budget 0.3`` on a CPU
    loaded the model, then failed the job with ``needs 44 KV pool pages but the pool has 17
    (host_pool_gb=8)``, naming a setting that does not size a pool on the compute device.
    It is now refused just before the load (the job's prompt counted with the model's
    tokenizer, the budget split as the load splits it), naming --memory-budget and a
    budget that fits; that budget runs. A budget with no room for a page is refused
    before the load too, and --print-config lists the refusal.

    The weights placed on a CPU depend on its instructions (int4, 0.24 GiB, with
    AVX512-BF16/AMX; float, 0.50 GiB, without: ``engine.weights.placement``), so the
    feature is pinned and each kind gets a budget with room for some pages, not the job."""
    import engine.weights.placement as placement
    import engine.weights.quant as quant

    monkeypatch.setattr(quant, "cpu_fast_bf16", lambda: fast_bf16)
    monkeypatch.setattr(placement, "cpu_fast_bf16", lambda: fast_bf16)
    monkeypatch.setattr(runner_module, "load_tokenizer", REAL_LOAD_TOKENIZER)
    (docs / "long.txt").write_text("Sorting lists of records by key, stably. " * 300)
    args = ("docs/long.txt", "--attention", "dense", "--max-new-tokens", "4")
    result = cli(*args, "--memory-budget", budget, engine=never_load)
    assert result.exit_code == 2, result.output
    err = " ".join(result.stderr.split())
    room = rf"--memory-budget {budget} leaves room for \d+ KV pages \(\d+ tokens\) on"
    assert re.search(room, err)
    assert "attention dense keeps the KV pool on the compute device" in err
    assert re.search(r"job 'long' needs \d+ \(a \d+-token prompt \+ max_new_tokens 4", err)
    assert "host_pool_gb" not in err.replace("not host_pool_gb", "")
    fits = re.search(r"--memory-budget ([\d.]+) fits it", err)[1]
    assert float(fits) > float(budget)
    assert not (tmp_path / "hisparse-out" / "results.jsonl").exists()
    assert not (tmp_path / "hisparse-out" / "config.json").exists()
    ok = cli(*args, "--memory-budget", fits, engine=testing.fake_engine_factory())
    assert ok.exit_code == 0, ok.output
    done = cli(*args, "--memory-budget", budget, engine=never_load)  # skipped: not checked
    assert done.exit_code == 0, done.output
    none = cli(*args, "--memory-budget", "0.2", "-o", "none", engine=never_load)
    assert none.exit_code == 2 and "leave no room for a KV page" in none.stderr
    shown = cli(*args, "--memory-budget", budget, "--print-config")
    assert shown.exit_code == 0
    assert any("leaves room for" in p for p in json.loads(shown.stdout)["problems"])
    sparse = cli("docs/long.txt", "--max-new-tokens", "4", "--memory-budget", budget,
                 "-o", "sparse", engine=testing.fake_engine_factory())  # fmt: skip
    assert "leaves room for" not in sparse.stderr  # the host pool: not the budget's


def test_a_budget_with_no_room_beside_the_weights_is_refused_before_the_load(cli, docs):
    """Fresh-user finding: ``--memory-budget 0.1`` (the hierarchical default) was refused
    only after ``loading model`` (~6 s in): the weights and the host pool's page metadata
    leave no room for one job's hot buffer, which the engine's budget split found after
    the load, though README says such a budget is refused before it, and --print-config
    listed no problem. The same split now runs before the load (the weights counted from
    the model's header), in the load's words, and --print-config lists it."""
    args = ("docs/alpha.txt", "--max-new-tokens", "4", "--memory-budget", "0.1")
    result = cli(*args, engine=never_load)
    assert result.exit_code == 2, result.output
    err = " ".join(result.stderr.split())
    assert "memory_budget_gb=0.1: weights " in err
    assert "leave no room for the hot buffer of one request" in err
    assert "loading model" not in result.stdout + result.stderr
    shown = cli(*args, "--print-config")
    assert shown.exit_code == 0, shown.output
    problems = json.loads(shown.stdout).get("problems", [])
    assert any("leave no room for the hot buffer" in p for p in problems), problems


def test_a_host_pool_too_small_for_a_job_is_refused_before_the_load(cli, docs, monkeypatch):
    """Fresh-user finding: ``hisparse run --host-pool 0.0001`` listed no problem under
    --print-config; the run loaded the model, then failed the job "needs 26 KV pool pages
    but the pool has 1 (host_pool_gb=0.0001)", exit 1, with no --host-pool that fits. The
    pool's pages (host_pool_gb over a page of the model's shape) are now checked before the
    load against the longest job (its prompt counted with the model's tokenizer), naming
    the job and the --host-pool that fits it; --print-config lists it; that value runs."""
    monkeypatch.setattr(runner_module, "load_tokenizer", REAL_LOAD_TOKENIZER)
    (docs / "long.txt").write_text("Sorting lists of records by key, stably. " * 40)
    args = ("docs/alpha.txt", "docs/long.txt", "--max-new-tokens", "4")
    result = cli(*args, "--host-pool", "0.0001", engine=never_load)
    assert result.exit_code == 2, result.output
    err = " ".join(result.stderr.split())
    pages = re.search(r"--host-pool 0.0001 holds (\d+) KV pool pages \(\d+ tokens\)", err)
    assert pages, err
    need = re.search(r"job 'long' \(and 1 more\) needs (\d+) \(a \d+-token prompt \+ "
                     r"max_new_tokens 4, counted with the model's tokenizer", err)  # fmt: skip
    assert need and int(need[1]) > int(pages[1]), err
    fits = re.search(r"--host-pool ([\d.]+) fits it", err)[1]
    assert 0.0001 < float(fits) <= 0.1, fits  # rounded up to few digits, not a round GiB
    assert "loading model" not in result.stdout + result.stderr
    shown = cli(*args, "--host-pool", "0.0001", "--print-config")
    assert shown.exit_code == 0
    assert any("fits it" in p for p in json.loads(shown.stdout)["problems"]), shown.stdout
    ok = cli(*args, "--host-pool", fits, "--print-config")
    assert "problems" not in json.loads(ok.stdout), ok.stdout
    ran = cli(*args, "--host-pool", fits, engine=testing.fake_engine_factory())
    assert ran.exit_code == 0, ran.output


def test_a_run_with_several_problems_reports_each_as_print_config_lists_them(
    cli, docs, tmp_path, monkeypatch
):
    """Fresh-user finding: a run with an existing --trace file, a foreign config.json in
    its output folder, --max-context above the model's, --host-pool 1000 and
    --memory-budget 0.3 said only the --trace error; --print-config listed them all. The
    run now says each, one error line, in --print-config's order, and exits 2. The
    --memory-budget hint suggested a budget built on the refused 1000 GiB pool's page
    metadata: it is now judged with the pool that fits (the cap cut to 90% of the memory,
    as a preset's is), and says so."""
    monkeypatch.setenv("HISPARSE_HOST_MEMORY_GB", "24")
    (tmp_path / "existing_trace.jsonl").write_text("x\n")
    (tmp_path / "o3").mkdir()
    (tmp_path / "o3" / "config.json").write_text('{"mine": 1}\n')
    args = ("--memory-budget", "0.3", "--trace", "existing_trace.jsonl",
            "--max-context", "100000", "docs/alpha.txt", "-o", "o3")  # fmt: skip
    shown = cli(*args, "--host-pool", "1000", "--print-config")
    problems = json.loads(shown.stdout)["problems"]
    assert len(problems) == 5, problems
    result = cli(*args, "--host-pool", "1000", engine=never_load)
    assert result.exit_code == 2, result.output
    said = [" ".join(line.split()) for line in result.stderr.split("error: ")[1:]]
    assert said == [" ".join(p.split()) for p in problems], result.stderr
    (budget,) = [p for p in problems if p.startswith("memory_budget_gb=0.3")]
    judged = " (judged with host_pool_gb 21.5, the largest pool that fits, in place of the "
    assert budget.endswith(f"{judged}refused 1000)"), budget  # 90% of 24, 0.25 GiB steps
    fitted = cli(*args, "--host-pool", "21.5", "--print-config")
    assert budget.removesuffix(f"{judged}refused 1000)") in json.loads(fitted.stdout)["problems"]
    assert not (tmp_path / "o3" / "results.jsonl").exists()


def test_truncate_with_no_room_for_the_document_is_refused_before_the_load(
    cli, docs, tmp_path, monkeypatch
):
    """Fresh-user finding: under ``--context-policy truncate``, ``--max-new-tokens 8141``
    passed the check before the load (the prompt around the document judged from its
    bytes: at least ~50 tokens) and failed the job after it (the instruction needs 68).
    The check now cuts the document as the engine does, with the model's tokenizer
    (built from its header, no weights), and refuses the run naming the value that
    leaves room; that value runs."""
    monkeypatch.setattr(runner_module, "load_tokenizer", REAL_LOAD_TOKENIZER)
    (docs / "long.txt").write_text("Sorting lists of records by key, stably. " * 1500)
    args = ("docs/long.txt", "--context-policy", "truncate")
    request = runner_module.RunRequest(
        docs=("docs/long.txt",), job_overrides={"max_new_tokens": 8141}, preset="cpu",
        print_config=True,
    )
    (spec,) = runner_module.prepare(request)[0].jobs
    assert preflight.max_new_tokens_problem([spec], 8192, "truncate", True) is None  # it was
    result = cli(*args, "--max-new-tokens", "8141", engine=never_load)
    assert result.exit_code == 2, result.output
    err = " ".join(result.stderr.split())
    assert "--max-new-tokens 8,141 leaves no room for the document of job 'long'" in err
    assert "counted with the model's tokenizer before loading it" in err
    fits = int(re.search(r"max_new_tokens (\d+) or less leaves room", err)[1])
    assert 8000 < fits < 8141 and not (tmp_path / "hisparse-out").exists()
    ok = cli(*args, "--max-new-tokens", str(fits), engine=testing.fake_engine_factory())
    assert ok.exit_code == 0, ok.output
    shown = cli(*args, "--max-new-tokens", str(fits + 1), "--print-config")
    assert any("leaves no room" in p for p in json.loads(shown.stdout)["problems"])


def test_the_size_floor_is_a_lower_bound_of_the_prompts_tokens(
    tmp_path, monkeypatch, smollm2_tokenizer
):
    """:func:`runner.size_floor`, which refuses a document before the load from its first
    bytes only, never says more tokens than the prompt the engine builds has: CRLF
    becoming LF, a BOM, characters of several bytes cut at the end of what was read,
    whitespace at the ends, and a job of several files (one empty: left out) whose join
    adds headers. A document read whole gets no floor (it is counted exactly)."""
    from hisparse_cli import textio
    from hisparse_cli.manifest import load_manifest

    monkeypatch.setattr(textio, "SAMPLE_BYTES", 64)  # read as little as the limit needs
    files = {
        "crlf.txt": b"word, other\r\n" * 6000,
        "utf8.txt": ("é日本 text\t" * 6000).encode(),
        "bom.txt": b"\xef\xbb\xbf  plain words here " * 6000,
        "spaced.txt": b"x" * 100 + b" " * 90_000 + b"y\n",
        "empty.txt": b"\n",
        "small.txt": b"a few words\n",
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    jobs = ["crlf.txt", "utf8.txt", "bom.txt", "spaced.txt", "small.txt",
            ["empty.txt", "utf8.txt", "crlf.txt"], ["small.txt", "spaced.txt"]]  # fmt: skip
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text(
        "jobs:\n" + "".join(f"  - id: j{i}\n    input: {json.dumps(j)}\n" for i, j in enumerate(jobs))
    )
    request = runner_module.RunRequest()
    floors = {}
    for spec in load_manifest(manifest).jobs:
        floor = runner_module.size_floor(spec, request, smollm2_tokenizer, 300)
        _, text = runner_module.job_document(spec, request)
        exact = len(smollm2_tokenizer.encode_chat(runner_module.job_messages(spec)(text)))
        assert floor is None or 300 < floor <= exact, (spec.id, floor, exact)
        floors[spec.id] = floor
    assert [j for j, f in floors.items() if f is None] == ["j3", "j4", "j6"]  # read whole
