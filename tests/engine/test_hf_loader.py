"""Hugging Face folder loader and ``hisparse quantize``, against transformers.

Tiny random Llama / Qwen2 / Mistral models are built with transformers, saved as
safetensors, loaded with :func:`engine.weights.hf.load_hf_folder` and run through
:class:`engine.model.llama.LlamaModel`; the logits must match ``model(ids).logits`` at fp32.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import randomise, save_tokenizer

from engine.model.llama import LlamaModel, prefill_attention
from engine.model.rope import Rope
from engine.weights.hf import (
    HFModelError,
    load_hf_folder,
    read_hf_config,
    rope_from_hf,
)
from engine.weights.quant import Int4Weight, quantize_int4
from engine.weights.types import LINEAR_NAMES, ModelWeights

transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # puts D=16's wavelengths in all three bands
    "rope_theta": 10000.0,
}




YARN_ROPE = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}


def _build(folder: Path, kind: str, dtype=torch.float32, rope=LLAMA3_ROPE, **save_kwargs):
    """Save a tiny random model of ``kind`` to ``folder``; return the transformers model."""
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**TINY, head_dim=16, rope_scaling=rope)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**TINY, tie_word_embeddings=True, rope_theta=1e6)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.MistralConfig(**TINY, head_dim=16, sliding_window=128)
        model = transformers.MistralForCausalLM(cfg)
    randomise(model)
    model.eval()
    model.to(dtype).save_pretrained(folder, **save_kwargs)
    save_tokenizer(folder)
    return model.float()


def our_logits(weights: ModelWeights, ids: torch.Tensor, fmt: str = "float") -> torch.Tensor:
    """Full-sequence forward: embed -> per layer (qkv, causal attention, MLP) -> logits."""
    cfg = weights.config
    rope = Rope(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    model = LlamaModel(weights, torch.device("cpu"), torch.float32, fmt, rope)
    h = model.embed_tokens(ids)
    positions = torch.arange(len(ids))
    for i in range(cfg.num_layers):
        q, k, v = model.qkv(i, h, positions)
        h = model.finish_layer(i, h, prefill_attention(q, k, v, 0))
    return model.logits(h)


def _reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


IDS = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    return folder, _build(folder, "llama")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2")
    return folder, _build(folder, "qwen2")


def test_llama_llama3_rope_matches_transformers(llama):
    folder, model = llama
    weights = load_hf_folder(folder)
    cfg = weights.config
    assert (cfg.arch, cfg.head_dim, cfg.num_kv_heads, cfg.max_position) == ("llama", 16, 2, 256)
    assert cfg.rope_scaling.kind == "llama3" and cfg.rope_scaling.original_max_position == 64
    assert weights.lm_head is not None and not cfg.tie_word_embeddings
    assert all(w.dtype == torch.float32 for w in (weights.embed, weights.layers[0].wq))
    torch.testing.assert_close(
        our_logits(weights, IDS), _reference_logits(model, IDS), atol=1e-4, rtol=1e-4
    )


def test_qwen2_biases_and_tied_embeddings_match_transformers(qwen2):
    folder, model = qwen2
    weights = load_hf_folder(folder)
    assert weights.config.qkv_bias and weights.config.tie_word_embeddings
    assert weights.lm_head is None and weights.layers[1].bk.abs().sum() > 0
    assert weights.config.rope_theta == 1e6
    torch.testing.assert_close(
        our_logits(weights, IDS), _reference_logits(model, IDS), atol=1e-4, rtol=1e-4
    )


def test_llama_yarn_matches_transformers(tmp_path):
    model = _build(tmp_path, "llama", rope=YARN_ROPE)
    weights = load_hf_folder(tmp_path)
    assert weights.config.rope_scaling.kind == "yarn" and weights.config.max_position == 256
    torch.testing.assert_close(
        our_logits(weights, IDS), _reference_logits(model, IDS), atol=1e-4, rtol=1e-4
    )


def test_mistral_sliding_window_caps_context(tmp_path):
    model = _build(tmp_path, "mistral")
    weights = load_hf_folder(tmp_path)
    assert weights.config.arch == "mistral"
    assert weights.config.max_position == 128  # sliding_window, not max_position_embeddings
    torch.testing.assert_close(
        our_logits(weights, IDS), _reference_logits(model, IDS), atol=1e-4, rtol=1e-4
    )


def test_sharded_bf16_checkpoint(tmp_path):
    model = _build(tmp_path, "llama", dtype=torch.bfloat16, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    weights = load_hf_folder(tmp_path)
    assert weights.formats["model.embed_tokens.weight"] == "BF16"
    ref = model.model.layers[1].mlp.down_proj.weight.to(torch.bfloat16).float()
    assert torch.equal(weights.layers[1].w_down, ref)


def test_load_weights_through_api(llama):
    from engine.load import load_weights

    folder, _ = llama
    weights, tokenizer, name = load_weights(str(folder))
    assert name == folder.name and weights.config.num_layers == 2
    assert tokenizer.decode(tokenizer.encode("hi there")) == "hi there"


def test_int4_on_load(llama):
    folder, _ = llama
    weights = load_hf_folder(folder, int4_group_size=128)
    wq = weights.layers[0].wq
    assert isinstance(wq, Int4Weight) and wq.group_size == 64  # K=64 < 128
    assert weights.formats["model.layers.0.self_attn.q_proj"] == "int4-g64"


# ----------------------------------------------------------------------------- errors


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def _rewrite(folder: Path, name: str, tensor: torch.Tensor | None) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    if tensor is None:
        del tensors[name]
    else:
        tensors[name] = tensor
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture
def llama_copy(llama, tmp_path):
    import shutil

    shutil.copytree(llama[0], tmp_path, dirs_exist_ok=True)
    return tmp_path


def test_a_bad_shape_is_named_as_plan_names_it(llama_copy):
    """Fresh-user finding: 0 KV heads were read as the query heads' count, "64" as 64 and
    2.5 layers as 2; 0 layers loaded nothing and failed on the first unused tensor. The
    loader and ``hisparse plan`` (:func:`engine.capacity.shapes.get_model_shape`) make one
    check and say the same, every problem at once."""
    from engine.capacity.shapes import get_model_shape
    from engine.config import ConfigError

    _edit_config(llama_copy, num_hidden_layers=2.5, hidden_size="64", num_key_value_heads=0)
    where = llama_copy / "config.json"
    with pytest.raises(HFModelError) as info:
        read_hf_config(llama_copy)
    assert str(info.value).splitlines() == [
        f"{where}: num_hidden_layers: must be a positive integer, got 2.5",
        f"{where}: hidden_size: must be a positive integer, got '64'",
        f"{where}: num_key_value_heads: must be a positive integer, got 0",
    ]
    with pytest.raises(ConfigError) as planned:
        get_model_shape(str(llama_copy))
    assert str(planned.value) == str(info.value)
    _edit_config(llama_copy, num_hidden_layers=0, hidden_size=64, num_key_value_heads=3)
    with pytest.raises(HFModelError) as info:
        load_hf_folder(llama_copy)
    assert str(info.value).splitlines() == [
        f"{where}: num_hidden_layers: must be a positive integer, got 0",
        f"{where}: num_key_value_heads: must divide num_attention_heads (4), got 3",
    ]


def test_unsupported_architecture(llama_copy):
    _edit_config(llama_copy, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match=r"config\.json.*GPT2LMHeadModel"):
        load_hf_folder(llama_copy)


def test_unsupported_rope_kind(llama_copy):
    _edit_config(llama_copy, rope_parameters={"rope_type": "mrope", "factor": 2.0})
    with pytest.raises(HFModelError, match="rope_type='mrope'"):
        load_hf_folder(llama_copy)


def test_longrope_without_its_factors_is_refused(llama_copy):
    _edit_config(llama_copy, rope_parameters={"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(HFModelError, match="missing field 'short_factor'"):
        load_hf_folder(llama_copy)


def test_wrong_shape_names_file_and_tensor(llama_copy):
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite(llama_copy, name, torch.zeros(16, 64))
    with pytest.raises(
        ValueError, match=r"model\.safetensors: tensor .*k_proj\.weight.*\(16, 64\)"
    ):
        load_hf_folder(llama_copy)


def test_unsupported_dtype(llama_copy):
    name = "model.layers.0.mlp.up_proj.weight"
    _rewrite(llama_copy, name, torch.zeros(128, 64, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"up_proj\.weight has dtype I8"):
        load_hf_folder(llama_copy)


def test_missing_and_unexpected_tensors(llama_copy):
    _rewrite(llama_copy, "model.layers.0.self_attn.o_proj.bias", torch.zeros(64))
    with pytest.raises(ValueError, match=r"o_proj\.bias is not used"):
        load_hf_folder(llama_copy)
    _rewrite(llama_copy, "model.layers.0.self_attn.o_proj.bias", None)
    _rewrite(llama_copy, "lm_head.weight", None)
    with pytest.raises(ValueError, match=r"missing tensor lm_head\.weight"):
        load_hf_folder(llama_copy)


@pytest.mark.parametrize(
    ("raw", "kind", "factor", "original"),
    [
        (
            {
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 32768,
                }
            },
            "yarn",
            4.0,
            32768,
        ),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic", 2.0, 4096),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "linear", 2.0, 4096),
        ({"rope_theta": 5e5, "rope_scaling": None}, None, None, None),
    ],
)
def test_rope_from_hf_legacy_fields(raw, kind, factor, original):
    theta, scaling = rope_from_hf({"max_position_embeddings": 4096, **raw})
    if kind is None:
        assert scaling is None and theta == 5e5
    else:
        assert (scaling.kind, scaling.factor, scaling.original_max_position) == (
            kind,
            factor,
            original,
        )


@pytest.mark.parametrize(
    ("scaling", "says"),
    [
        ({"rope_type": "yarn", "factor": float("inf")},
         "rope_parameters.factor: must be a finite number > 0, got inf"),
        ({"rope_type": "linear", "factor": "2"},
         "rope_parameters.factor: must be a finite number > 0, got '2'"),
        ({"rope_type": "dynamic", "factor": 0},
         "rope_parameters.factor: must be a finite number > 0, got 0"),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": -64},
         "rope_parameters.original_max_position_embeddings: must be a positive integer, got -64"),
    ],
)  # fmt: skip
def test_a_bad_rope_scaling_factor_is_named(llama_copy, scaling, says):
    """A yarn factor of 1e400 (infinity in JSON) ended in an OverflowError traceback (the
    trained context is original x factor); "2" in a ValueError naming no file."""
    _edit_config(llama_copy, rope_parameters={"rope_theta": 1e4} | scaling)
    with pytest.raises(HFModelError) as info:
        read_hf_config(llama_copy)
    assert str(info.value) == f"{llama_copy / 'config.json'}: {says}"


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"rope_parameters": {"rope_theta": "abc"}},
         ["rope_parameters.rope_theta: must be a finite number > 1, got 'abc'"]),
        ({"rope_parameters": None, "rope_theta": 1},
         ["rope_theta: must be a finite number > 1, got 1"]),
        ({"rms_norm_eps": "1e-6", "rope_parameters": LLAMA3_ROPE | {"low_freq_factor": "1"}},
         ["rms_norm_eps: must be a finite number > 0, got '1e-6'",
          "rope_parameters.low_freq_factor: must be a finite number > 0, got '1'"]),
        ({"rope_parameters": LLAMA3_ROPE | {"high_freq_factor": 1.0}},
         ["rope_parameters.high_freq_factor: must be above rope_parameters.low_freq_factor "
          "(1), got 1"]),
        ({"rope_parameters": YARN_ROPE | {"beta_fast": -32, "beta_slow": [1]}},
         ["rope_parameters.beta_fast: must be a finite number > 0, got -32",
          "rope_parameters.beta_slow: must be a finite number > 0, got [1]"]),
        ({"rope_parameters": None,
          "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                           "long_factor": [2.0] * 8, "attention_factor": 0},
          "original_max_position_embeddings": 64},
         ["rope_scaling.attention_factor: must be a finite number > 0, got 0"]),
        ({"num_hidden_layers": 0, "rms_norm_eps": -1, "rope_parameters": {"rope_theta": True}},
         ["num_hidden_layers: must be a positive integer, got 0",
          "rms_norm_eps: must be a finite number > 0, got -1",
          "rope_parameters.rope_theta: must be a finite number > 1, got true"]),
    ],
)  # fmt: skip
def test_a_bad_number_in_config_json_is_named_with_its_field(llama_copy, changes, says):
    """Review finding: rope_theta, rms_norm_eps, low/high_freq_factor, beta_fast/slow and
    attention_factor went through a bare float(): a string exited 2 with "could not convert
    string to float: 'abc'", naming neither the file nor the field, and a negative or 0
    value (beta_fast 0 read as 32) loaded. They get the check the RoPE factor had
    (engine.config.check_numbers), every problem of the file at once."""
    _edit_config(llama_copy, **changes)
    where = llama_copy / "config.json"
    with pytest.raises(HFModelError) as info:
        read_hf_config(llama_copy)
    assert str(info.value).splitlines() == [f"{where}: {line}" for line in says]


def test_a_bad_gemma3_number_is_named_with_the_others(tmp_path):
    """Gemma's soft-caps and query scale were passed on unchecked (a string reached the
    attention kernels) and its local RoPE base went through a bare float(); they are
    checked with the norm epsilon and the global layers' RoPE, named where they sit."""
    from tiny_models import build_hf

    build_hf(tmp_path, "gemma3")
    raw = json.loads((tmp_path / "config.json").read_text())
    rope = raw["rope_parameters"]
    _edit_config(
        tmp_path,
        final_logit_softcapping="3",
        query_pre_attn_scalar=-16,
        rope_parameters={
            "full_attention": rope["full_attention"] | {"rope_theta": 0.5},
            "sliding_attention": rope["sliding_attention"] | {"rope_theta": None},
        },
    )
    with pytest.raises(HFModelError) as info:
        read_hf_config(tmp_path)
    assert str(info.value).splitlines() == [
        f"{tmp_path / 'config.json'}: {line}"
        for line in (
            "final_logit_softcapping: must be a finite number > 0, got '3'",
            "query_pre_attn_scalar: must be a finite number > 0, got -16",
            "rope_parameters.full_attention.rope_theta: must be a finite number > 1, got 0.5",
        )
    ]
    _edit_config(tmp_path, final_logit_softcapping=0, query_pre_attn_scalar=16,
                 rope_parameters=rope)  # fmt: skip
    cfg = read_hf_config(tmp_path)  # 0: no soft-cap, as the engine reads it
    local = rope["sliding_attention"]["rope_theta"]
    assert cfg.final_softcap is None and cfg.rope_local_theta == local


def test_plan_names_a_bad_norm_epsilon_and_rope_base_as_the_loader(llama_copy):
    from engine.capacity.shapes import get_model_shape
    from engine.config import ConfigError

    _edit_config(
        llama_copy, num_hidden_layers=0, rms_norm_eps="small", rope_parameters={"rope_theta": -1}
    )
    with pytest.raises(HFModelError) as info:
        read_hf_config(llama_copy)
    with pytest.raises(ConfigError) as planned:
        get_model_shape(str(llama_copy / "config.json"))
    assert str(planned.value) == str(info.value)
    assert len(str(info.value).splitlines()) == 3


def test_yarn_raises_trained_context(llama_copy):
    _edit_config(
        llama_copy,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4},
        max_position_embeddings=256,
    )
    assert read_hf_config(llama_copy).max_position == 1024


# ----------------------------------------------------------------------------- quantize


def test_quantize_round_trip(llama, tmp_path):
    from engine.weights.quantize import quantize_folder

    src, model = llama
    out = tmp_path / "q"
    report = quantize_folder(src, out, group_size=32)
    assert report.num_quantized == 2 * len(LINEAR_NAMES) and report.out_bytes < report.src_bytes
    assert {"config.json", "tokenizer.json", "generation_config.json"} <= set(report.copied_files)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata()["hisparse_format"] == "int4-g32"
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"  # as stored

    quantized, source = load_hf_folder(out), load_hf_folder(src)
    for layer_q, layer_f in zip(quantized.layers, source.layers, strict=True):
        for name in LINEAR_NAMES:
            wq = getattr(layer_q, name)
            assert isinstance(wq, Int4Weight) and wq.group_size == 32
            expected = quantize_int4(getattr(layer_f, name), 32).dequantize()
            assert torch.equal(wq.dequantize(), expected)
        assert torch.equal(layer_q.attn_norm, layer_f.attn_norm)
    assert torch.equal(quantized.lm_head, source.lm_head)

    ref = _reference_logits(model, IDS)
    q_logits = our_logits(load_hf_folder(out), IDS)
    assert (q_logits - ref).abs().max() < 0.1 * ref.abs().max()
    assert (q_logits.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8
    int4_logits = our_logits(load_hf_folder(out), IDS, fmt="int4")  # torch's int4 kernel
    torch.testing.assert_close(int4_logits, q_logits, atol=1e-3, rtol=1e-3)


def test_quantize_refuses_existing_and_requantising(llama, tmp_path):
    from engine.weights.quantize import quantize_folder

    quantize_folder(llama[0], tmp_path / "q", group_size=64)
    with pytest.raises(FileExistsError):
        quantize_folder(llama[0], tmp_path / "q", group_size=64)
    with pytest.raises(HFModelError, match="already quantised"):
        quantize_folder(tmp_path / "q", tmp_path / "qq")
    with pytest.raises(HFModelError, match="group_size=48"):
        quantize_folder(llama[0], tmp_path / "q3", group_size=48)


def test_quantize_cli(qwen2, tmp_path):
    import typer
    from typer.testing import CliRunner

    from hisparse_cli.quantize_cmd import register

    app = typer.Typer()
    register(app)

    @app.callback()
    def main() -> None:
        """Keep ``quantize`` a named sub-command."""

    folder, model = qwen2
    out = tmp_path / "q"
    result = CliRunner().invoke(
        app, ["quantize", str(folder), str(out), "--group-size", "64", "-q"]
    )
    assert result.exit_code == 0, result.output
    assert "bytes" in result.output and "unquantised" in result.output
    weights = load_hf_folder(out)
    assert weights.layers[0].bq is not None and isinstance(weights.layers[0].wv, Int4Weight)
    ref = _reference_logits(model, IDS)
    assert (our_logits(weights, IDS) - ref).abs().max() < 0.1 * ref.abs().max()

    again = CliRunner().invoke(app, ["quantize", str(folder), str(out)])
    assert again.exit_code == 2 and "model.safetensors" in again.output
    assert "--force replaces them" in again.output
    empty = CliRunner().invoke(app, ["quantize", "", ""])  # was read as "." and "."
    assert empty.exit_code == 2 and "is empty" in empty.output


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_prequantised_config_over_float_weights_is_refused(llama_copy, method):
    """AWQ/GPTQ folders are read (tests/engine/test_prequant.py); one whose linears are
    float ``.weight`` tensors is refused naming the missing ``qweight``, not run float."""
    _edit_config(llama_copy, quantization_config={"quant_method": method, "bits": 4})
    want = rf"q_proj\.qweight is missing: config\.json quantization_config declares {method.upper()}"
    with pytest.raises(HFModelError, match=want):
        load_hf_folder(llama_copy)


@pytest.mark.parametrize("vocab_size", [200, 320])
def test_a_tokenizer_with_ids_past_the_embedding_is_refused(tmp_path, vocab_size):
    """A folder whose tokenizer.json gives ids the embedding has no row for (256 tokens,
    ``vocab_size`` 200) was loaded without a word: those ids index past the embedding. It
    is refused, naming the folder and both sizes, by the weights' load and by the
    tokenizer's alone (what the CLI builds before the load); a tokenizer smaller than the
    embedding (rows padded to 320) loads."""
    from engine.load import load_tokenizer, load_weights

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**(TINY | {"vocab_size": vocab_size}), head_dim=16)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    save_tokenizer(tmp_path)
    if vocab_size > 256:
        weights, tokenizer, _ = load_weights(str(tmp_path))
        assert weights.embed.shape[0] == 320 and load_tokenizer(str(tmp_path))[0]
        return
    for load in (load_weights, load_tokenizer):
        with pytest.raises(HFModelError) as info:
            load(str(tmp_path))
        assert str(info.value).startswith(
            f"{tmp_path}: the tokenizer's vocabulary (tokenizer.json: 256 tokens, ids up to "
            "255) is larger than the model's vocab_size 200 (config.json, the embedding's rows)"
        ), info.value
