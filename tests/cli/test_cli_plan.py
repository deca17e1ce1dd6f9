"""``hisparse plan --preset auto`` (its default) and ``hisparse presets`` on auto: the same
resolution as ``hisparse run`` (:func:`hisparse_cli.runner.auto_preset`), said with its
reason."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from typer.testing import CliRunner

from hisparse_cli import runner as runner_module
from hisparse_cli.main import app

WIDE = {"COLUMNS": "200"}


@pytest.fixture
def devices(monkeypatch):
    """Fake this machine's CUDA devices: ``devices(47.4, 47.4)`` is two 48 GB cards."""

    def fake(*memories_gib):
        monkeypatch.setattr(runner_module, "cuda_device_count", lambda: len(memories_gib))
        monkeypatch.setattr(runner_module, "cuda_device_memory_gib", lambda i: memories_gib[i])

    fake()  # no CUDA unless a test says so
    return fake


def invoke(*args):
    return CliRunner().invoke(app, list(args), env=WIDE, catch_exceptions=False)


def test_plan_defaults_to_auto_and_says_what_it_resolved_to(devices):
    devices(47.4, 47.4)
    result = invoke("plan", "--model", "llama2-13b-gqa8", "--jobs", "8", "--context", "256K")
    assert result.exit_code == 0, result.output
    first = result.stdout.splitlines()[0]
    assert first == "preset dual4090 (auto: 2 CUDA device(s), smallest 47.4 GiB)"
    assert "on dual4090: 2 x" in result.stdout


def test_plan_auto_without_cuda_is_cpu_and_json_names_it(devices):
    result = invoke("plan", "-p", "auto", "-n", "1", "-c", "8K")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("preset cpu (auto: no CUDA device)\n")
    data = json.loads(invoke("plan", "-p", "auto", "-n", "1", "-c", "8K", "--json").stdout)
    assert data["preset"] == "cpu" and data["preset_auto"] == "no CUDA device"
    named = json.loads(invoke("plan", "-p", "h200", "-n", "1", "-c", "8K", "--json").stdout)
    assert named["preset"] == "h200" and "preset_auto" not in named


def test_plan_auto_is_runs_resolution(devices, monkeypatch):
    from hisparse_cli.auto_preset import AutoChoice

    asked = []

    def auto_preset(device_flags=()):
        asked.append(tuple(device_flags))
        return AutoChoice("h200x2", "faked")

    monkeypatch.setattr(runner_module, "auto_preset", auto_preset)
    result = invoke("plan", "-n", "1", "-c", "8K")
    assert result.exit_code == 0 and "preset h200x2 (auto: faked)" in result.stdout
    assert asked == [()]


def test_presets_list_and_show_explain_auto(devices):
    devices(139.8)
    listing = invoke("presets").stdout
    words = " ".join(listing.split())
    assert "here: h200 (1 CUDA device used, 139.8 GiB)" in words
    assert ">= 40 -> dual4090" in words and "`plan`" in words
    shown = invoke("presets", "show", "auto")
    assert shown.exit_code == 0, shown.output
    assert shown.stdout.startswith("# auto: h200 on this machine (1 CUDA device used, 139.8 GiB)")
    assert "\n# preset h200 (" in shown.stdout  # a comment: the output is a preset file
    assert yaml.safe_load(shown.stdout)["model"] == "llama3.1-8b"  # still YAML


def test_plan_uses_the_host_memory_run_uses_and_says_where_it_came_from(devices, monkeypatch):
    """HISPARSE_HOST_MEMORY_GB is the figure ``hisparse run`` checks its host pool against:
    ``plan`` takes it too (it used the preset's 32 GiB: fresh-user finding); --host-memory
    beats it; without either, the preset's figure, naming what run checks instead."""
    args = ("plan", "-p", "cpu", "-n", "1", "-c", "8K", "--json")
    monkeypatch.delenv("HISPARSE_HOST_MEMORY_GB", raising=False)
    preset = json.loads(invoke(*args).stdout)
    assert preset["hardware"]["host_memory_gb"] == 32
    assert preset["host_memory_source"].startswith("preset cpu's")
    monkeypatch.setenv("HISPARSE_HOST_MEMORY_GB", "48")
    declared = json.loads(invoke(*args).stdout)
    assert declared["hardware"]["host_memory_gb"] == 48
    assert declared["host_memory_source"].startswith("HISPARSE_HOST_MEMORY_GB")
    assert declared["host"]["usable_bytes"] > preset["host"]["usable_bytes"]
    flag = json.loads(invoke(*args, "--host-memory", "64").stdout)
    assert flag["hardware"]["host_memory_gb"] == 64
    assert flag["host_memory_source"] == "--host-memory"
    table = invoke(*args[:-1]).stdout
    assert re.search(r"│ host RAM +│ 48\.00 │ HISPARSE_HOST_MEMORY_GB, as hisparse run uses", table)


def test_plan_refuses_a_bad_host_memory_variable(devices, monkeypatch):
    monkeypatch.setenv("HISPARSE_HOST_MEMORY_GB", "lots")
    result = invoke("plan", "-p", "cpu", "-n", "1", "-c", "8K")
    assert result.exit_code == 2 and "HISPARSE_HOST_MEMORY_GB" in result.output


@pytest.mark.parametrize(
    "fast,gib,fmt,why",
    [
        (True, "0.24", "int4", "CPU has AVX512-BF16/AMX"),
        (False, "0.50", "float", "no AVX512-BF16/AMX"),
    ],
    ids=["bf16-cpu", "avx2-cpu"],
)
def test_plan_counts_the_embedded_model_as_run_places_it(
    devices, monkeypatch, fast, gib, fmt, why
):
    """A new user's CPU box (no CUDA: auto is the cpu preset): ``hisparse plan -n 1 -c 8K
    --memory-budget 2`` counts the embedded model's weights as ``hisparse run`` places
    them, int4 (0.24 GiB) where the CPU has bf16 instructions, float32 (0.50 GiB)
    elsewhere, with a 5 % reserve, and the job fits. Before, it counted float32 weights
    and a 1 GiB reserve everywhere: 0 jobs, exit 2, where run ran with the same budget."""
    monkeypatch.setattr("engine.weights.placement.cpu_fast_bf16", lambda: fast)
    # this machine measured its LM head: float32 kept (no fp16 copy)
    monkeypatch.setattr("engine.capacity.planner.recorded_cpu_lm_head_fp16", lambda shape: False)
    args = ("plan", "-n", "1", "-c", "8K", "--memory-budget", "2")
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    weights = rf"│ weights +│ +{gib} │ float32 / {fmt} weights \(auto: {why}\)"
    assert re.search(weights, result.stdout), result.stdout
    assert re.search(r"│ reserve +│ +0\.10 │ 5 % \(CPU\)", result.stdout)
    data = json.loads(invoke(*args, "--json").stdout)
    assert data["weight_format"] == fmt and data["capacity"]["max_jobs"] >= 1


def test_plan_under_a_small_cpu_budget_names_the_budget_that_fits(devices, monkeypatch):
    """``hisparse plan -n 1 -c 8K --memory-budget 0.5`` on the CPU: refused, naming the
    smallest ``--memory-budget`` with which the job fits; that command then plans it."""
    monkeypatch.setattr("engine.weights.placement.cpu_fast_bf16", lambda: True)
    monkeypatch.setattr("engine.capacity.planner.recorded_cpu_lm_head_fp16", lambda shape: False)
    refused = invoke("plan", "-n", "1", "-c", "8K", "--memory-budget", "0.5")
    assert refused.exit_code == 2
    found = re.search(r"a larger budget: --memory-budget ([\d.]+)\n", refused.output)
    assert found, refused.output
    assert invoke("plan", "-n", "1", "-c", "8K", "--memory-budget", found[1]).exit_code == 0
    less = f"{float(found[1]) - 0.01:.2f}"
    assert invoke("plan", "-n", "1", "-c", "8K", "--memory-budget", less).exit_code == 2


def _tiny_llama(folder, context):
    """A 2-layer random Llama folder (Hugging Face layout, a 256-token byte-level
    vocabulary) trained, its config says, on ``context`` positions; written with
    safetensors and tokenizers only (no transformers: it imports in seconds)."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from engine.text.tokenizer import bytes_to_unicode

    h, f, kv, vocab = 96, 160, 32, 256
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,),
              "lm_head.weight": (vocab, h)}  # fmt: skip
    for i in range(2):
        at = f"model.layers.{i}."
        shapes |= {at + "input_layernorm.weight": (h,), at + "post_attention_layernorm.weight": (h,),
                   at + "self_attn.q_proj.weight": (h, h), at + "self_attn.k_proj.weight": (kv, h),
                   at + "self_attn.v_proj.weight": (kv, h), at + "self_attn.o_proj.weight": (h, h),
                   at + "mlp.gate_proj.weight": (f, h), at + "mlp.up_proj.weight": (f, h),
                   at + "mlp.down_proj.weight": (h, f)}  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    folder.mkdir()
    save_file({k: 0.1 * torch.randn(v, generator=gen) for k, v in shapes.items()},
              str(folder / "model.safetensors"))  # fmt: skip
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": f, "num_hidden_layers": 2, "num_attention_heads": 6,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": vocab,
              "max_position_embeddings": context, "rms_norm_eps": 1e-6, "rope_theta": 1e4,
              "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    bytes_vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=bytes_vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    return folder


def test_a_job_plan_admits_runs_under_the_same_budget(devices, monkeypatch, tmp_path):
    """``hisparse plan -n 1 -c N`` (N: a job's prompt tokens + ``--max-new-tokens``, as its
    results line counts them) at the smallest ``--memory-budget`` it admits; ``hisparse
    run`` of that job with the same settings and budget runs it. Before, run sized each
    request for the model's whole trained context (here 32K) and refused the budget that
    plan had admitted ("what fits one 32768-token request: --memory-budget 0.03")."""
    monkeypatch.setenv("HISPARSE_HOST_MEMORY_GB", "256")
    model = _tiny_llama(tmp_path / "tiny", 32768)
    (tmp_path / "doc.txt").write_text("A short document about sorting lists.\n")
    same = ["--preset", "cpu", "--model", str(model), "--host-pool", "0.05"]
    run = ["run", *same, "--threads", "1", "--max-new-tokens", "8", "-o", str(tmp_path / "out")]
    assert invoke(*run, str(tmp_path / "doc.txt")).exit_code == 0
    line = json.loads((tmp_path / "out" / "results.jsonl").read_text().splitlines()[-1])
    context = str(line["prompt_tokens"] + 8)
    refused = invoke("plan", *same, "-n", "1", "-c", context, "--memory-budget", "0.001")
    budget = re.search(r"a larger budget: --memory-budget ([\d.]+)\n", refused.output)[1]
    planned = invoke("plan", *same, "-n", "1", "-c", context, "--memory-budget", budget)
    assert planned.exit_code == 0, planned.output
    result = invoke(*run, "--memory-budget", budget, "--force", str(tmp_path / "doc.txt"))
    assert result.exit_code == 0, result.output
    line = json.loads((tmp_path / "out" / "results.jsonl").read_text().splitlines()[-1])
    assert line["ok"] and line["generated_tokens"] == 8, line


def test_config_json_records_the_max_batch_the_budget_allows(devices, monkeypatch, tmp_path):
    """Under ``--memory-budget`` the run's ``config.json`` gives the ``max_batch`` its cache
    holds, the jobs ``hisparse plan`` finds the device allows for the same settings, and
    keeps the request (the cpu preset's 4) in ``effective``. Before, it recorded 4 while
    the budget held fewer jobs' hot buffers."""
    monkeypatch.setenv("HISPARSE_HOST_MEMORY_GB", "256")
    model = _tiny_llama(tmp_path / "tiny", 32768)
    (tmp_path / "doc.txt").write_text("A short document about sorting lists.\n")
    same = ["--preset", "cpu", "--model", str(model), "--host-pool", "0.05"]
    run = ["run", *same, "--threads", "1", "--max-new-tokens", "8", str(tmp_path / "doc.txt")]
    assert invoke(*run, "-o", str(tmp_path / "count")).exit_code == 0
    line = json.loads((tmp_path / "count" / "results.jsonl").read_text())
    context = str(line["prompt_tokens"] + 8)
    planned = invoke("plan", *same, "-n", "1", "-c", context, "--memory-budget", "0.012", "--json")
    allowed = json.loads(planned.stdout)["capacity"]["device_limit"]
    assert 1 <= allowed < 4
    result = invoke(*run, "--memory-budget", "0.012", "-o", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "out" / "config.json").read_text())
    assert document["engine"]["max_batch"] == allowed
    assert document["effective"]["max_batch"] == (
        f"requested 4; memory_budget_gb 0.012 holds the hot buffers of {allowed} job(s) at once"
    )


GPT2_CONFIG = {  # a tiny GPT2Config(...).save_pretrained(): GPT-2 names its shape its own way
    "architectures": ["GPT2LMHeadModel"],
    "model_type": "gpt2",
    "n_layer": 2,
    "n_embd": 32,
    "n_head": 2,
    "n_positions": 128,
    "vocab_size": 100,
    "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-05,
}


def test_plan_names_an_unsupported_architecture_as_run_does(devices, tmp_path):
    """Fresh-user finding: ``plan --model`` on a GPT-2 folder listed the Llama fields its
    config.json lacks (``num_hidden_layers: missing`` ...) while ``run`` said GPT-2 is not
    supported. Plan checks the architecture first, as the loader does, in its words; a
    GGUF file of another ``general.architecture`` already was."""
    import gguf
    import numpy as np

    from engine.weights.hf import HFModelError, read_hf_config

    folder = tmp_path / "hf-gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(GPT2_CONFIG))
    result = invoke("plan", "--model", str(folder), "--jobs", "1", "--context", "4K")
    assert result.exit_code == 2, result.output
    err = " ".join(result.stderr.split())
    said = f"{folder / 'config.json'}: architectures=['GPT2LMHeadModel'] (model_type='gpt2')"
    assert f"{said} is not supported; supported: LlamaForCausalLM" in err
    assert "missing" not in err and "Traceback" not in result.output
    with pytest.raises(HFModelError) as loader:  # what run says when it loads the folder
        read_hf_config(folder)
    assert " ".join(str(loader.value).split()) in err
    writer = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    writer.add_context_length(128)
    writer.add_tensor("token_embd.weight", np.zeros((100, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = invoke("plan", "--model", str(tmp_path / "gpt2.gguf"), "-n", "1", "-c", "4K")
    assert result.exit_code == 2, result.output
    err = " ".join(result.stderr.split())
    assert "gpt2.gguf: general.architecture='gpt2' is not supported (supported: llama" in err
