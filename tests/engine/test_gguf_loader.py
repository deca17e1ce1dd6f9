"""GGUF loader against transformers, on tiny random models written with gguf-py.

Each test saves a transformers model as a Hugging Face folder (the reference), writes the
same weights as a GGUF in llama.cpp's conventions (:mod:`tiny_models`), loads the GGUF
through :func:`engine.load.load_weights` and the engine's RoPE
(:func:`engine.load.context_limit_and_rope`) and compares logits with transformers.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from tiny_models import build_hf, patch_gguf_field, reference_logits, write_gguf  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.load import context_limit_and_rope, load_weights  # noqa: E402
from engine.model.llama import LlamaModel, prefill_attention  # noqa: E402

IDS = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3))
ATOL = 1e-4

from test_hf_loader import LLAMA3_ROPE  # noqa: E402 - one llama3 rope_scaling for both


def engine_logits(path, ids: torch.Tensor, fmt: str = "float") -> torch.Tensor:
    """Full-sequence forward of the model at ``path`` as the engine places it."""
    weights, _, _ = load_weights(str(path))
    return weights_logits(weights, ids, fmt)


def weights_logits(weights, ids: torch.Tensor, fmt: str = "float") -> torch.Tensor:
    """Full-sequence forward of loaded ``weights`` (``[T]`` ids -> ``[T, V]`` logits)."""
    cfg = weights.config
    _, rope = context_limit_and_rope(cfg, EngineConfig())
    model = LlamaModel(weights, torch.device("cpu"), torch.float32, fmt, rope)
    h = model.embed_tokens(ids)
    positions = torch.arange(len(ids))
    for i in range(cfg.num_layers):
        q, k, v = model.qkv(i, h, positions)
        h = model.finish_layer(i, h, prefill_attention(q, k, v, 0))
    return model.logits(h)


# ----------------------------------------------------------------------------- RoPE


@pytest.fixture(scope="module")
def llama31(tmp_path_factory):
    """A Llama-3.1-style model (``llama3`` RoPE scaling) and its GGUF with
    ``rope_freqs.weight`` as llama.cpp's converter writes it (no scaling metadata)."""
    folder = tmp_path_factory.mktemp("llama31")
    model = build_hf(folder, "llama", rope_parameters=LLAMA3_ROPE)
    d = model.config.head_dim
    unscaled = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaled = model.model.rotary_emb.inv_freq.double()  # transformers' _compute_llama3_parameters
    factors = (unscaled / scaled).float().numpy()
    path = write_gguf(folder / "m.gguf", model, "llama", rope_freqs=factors)
    return model, path, factors


def test_rope_freqs_factors_direction(llama31):
    """llama.cpp's factors are >= 1 (1 for short wavelengths, ``factor`` for long ones) and
    ggml divides each frequency by its factor; the loader keeps them as they are."""
    _, path, factors = llama31
    assert factors[0] == pytest.approx(1.0) and factors[-1] == pytest.approx(8.0)
    assert ((factors > 1) & (factors < 8)).any()  # the smooth band is exercised
    cfg = load_weights(str(path))[0].config
    assert cfg.rope_scaling is None
    np.testing.assert_array_equal(np.array(cfg.rope_freq_factors, dtype=np.float32), factors)


def test_rope_freqs_matches_transformers_llama3(llama31):
    model, path, _ = llama31
    torch.testing.assert_close(
        engine_logits(path, IDS), reference_logits(model, IDS), atol=ATOL, rtol=ATOL
    )


def test_rope_freqs_wrong_length_is_refused(tmp_path):
    model = build_hf(tmp_path, "llama")
    path = write_gguf(tmp_path / "m.gguf", model, "llama", rope_freqs=np.ones(5, np.float32))
    with pytest.raises(ValueError, match=r"m\.gguf.*rope_freqs\.weight.*8"):
        load_weights(str(path))


@pytest.mark.parametrize("vocab_size", [200, 320])
def test_a_token_list_past_the_embedding_is_refused(tmp_path, vocab_size):
    """A GGUF whose tokenizer lists more tokens (256) than ``token_embd.weight`` has rows
    is refused before any tensor data is read, naming the file and both counts (on the
    CPU such a job failed mid-prefill with "index 226 is out of bounds"); an embedding
    with more rows than tokens (padding) loads."""
    model = build_hf(tmp_path / "hf", "llama", vocab_size=vocab_size)
    path = write_gguf(tmp_path / "m.gguf", model, "llama")
    if vocab_size > 256:
        assert load_weights(str(path))[0].embed.shape[0] == vocab_size
        return
    with pytest.raises(ValueError, match=r"m\.gguf: the tokenizer .* 256 tokens but token_embd\.weight only 200 rows"):
        load_weights(str(path))


def test_an_lm_head_past_the_embedding_is_refused(tmp_path):
    """``output.weight`` with more rows than ``token_embd.weight``: a generated id could
    have no embedding, so the file is refused, naming both."""
    import gguf

    model = build_hf(tmp_path / "hf", "llama", vocab_size=256)
    head = np.zeros((320, model.config.hidden_size), np.float32).view(np.uint8)
    path = write_gguf(
        tmp_path / "m.gguf", model, "llama",
        raw_tensors={"output.weight": (gguf.GGMLQuantizationType.F32, head)},
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"output\.weight has 320 rows .* only 256"):
        load_weights(str(path))


# ----------------------------------------------------------------------------- K-quants

# A llama whose every K is a multiple of the 256-element K-quant super-block.
KQ_SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_hidden_layers=1,
)
# GGUF name -> type: Q4_K linears (kept 4-bit), other types decoded by gguf-py; a Q4_K
# token embedding must be dequantised for the lookup.
KQ_TYPES = {
    "blk.0.attn_q.weight": "Q4_K",
    "blk.0.attn_k.weight": "Q4_K",
    "blk.0.attn_v.weight": "Q6_K",
    "blk.0.attn_output.weight": "Q4_K",
    "blk.0.ffn_gate.weight": "Q4_K",
    "blk.0.ffn_up.weight": "Q5_K",
    "blk.0.ffn_down.weight": "Q4_K",
    "token_embd.weight": "Q4_K",
    "output.weight": "Q6_K",
}
HF_NAME = {
    "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
    "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
    "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
    "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
    "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
    "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
    "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
}


def quant_block_model(folder, types: dict[str, str]):
    """A tiny llama (:data:`KQ_SHAPE`) whose tensors named in ``types`` (GGUF name -> type)
    are random blocks of that type (decoded with gguf-py into the transformers reference),
    and its GGUF holding those blocks: ``(model, path, raw)``."""
    from tiny_models import dequantize_blocks, random_quant_blocks

    model = build_hf(folder, "llama", **KQ_SHAPE)
    params = dict(model.named_parameters())
    raw = {}
    with torch.no_grad():
        for seed, (name, kind) in enumerate(types.items()):
            p = params[HF_NAME[name]]
            raw[name] = random_quant_blocks(kind, p.shape[0], p.shape[1], seed)
            p.copy_(dequantize_blocks(*raw[name], p.shape[1]))
    model.save_pretrained(folder)
    path = write_gguf(folder / "kq.gguf", model, "llama", raw_tensors=raw)
    return model, path, raw


@pytest.fixture(scope="module")
def kquant(tmp_path_factory):
    """A tiny llama whose weights are random K-quant blocks of :data:`KQ_TYPES`."""
    return quant_block_model(tmp_path_factory.mktemp("kquant"), KQ_TYPES)


def test_q4_k_kept_exact_as_int4(kquant):
    from engine.weights.gguf import load_gguf
    from engine.weights.quant import Int4Weight

    model, path, _ = kquant
    weights = load_gguf(path)
    layer = weights.layers[0]
    for field in ("wq", "wk", "wo", "w_gate", "w_down"):
        w = getattr(layer, field)
        assert isinstance(w, Int4Weight) and w.group_size == 32, field
    ref = dict(model.named_parameters())
    # Bit-exact against gguf-py's dequantisation (Q/K after undoing llama.cpp's permutation).
    for field, hf in (("wq", "q_proj"), ("wk", "k_proj"), ("wo", "o_proj")):
        got = getattr(layer, field).dequantize()
        assert torch.equal(got, ref[f"model.layers.0.self_attn.{hf}.weight"]), field
    assert torch.equal(layer.w_down.dequantize(), ref["model.layers.0.mlp.down_proj.weight"])
    # Q5_K / Q6_K linears and the Q4_K embedding: decoded to float32 exactly.
    assert torch.equal(layer.wv, ref["model.layers.0.self_attn.v_proj.weight"])
    assert torch.equal(layer.w_up, ref["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(weights.embed, ref["model.embed_tokens.weight"])
    assert torch.equal(weights.lm_head, ref["lm_head.weight"])
    assert weights.formats["blk.0.attn_q.weight"] == "Q4_K"
    assert weights.formats["output.weight"] == "Q6_K"


def test_q4_k_int4_matmul_matches_dense(kquant):
    from engine.weights.gguf import load_gguf
    from engine.weights.quant import Int4Linear, make_linear

    _, path, _ = kquant
    w = load_gguf(path).layers[0].w_gate
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(0))
    lin = make_linear(w, None, "int4", torch.device("cpu"), torch.float32)
    assert isinstance(lin, Int4Linear) and lin.group_size == 32
    torch.testing.assert_close(lin(x), x @ w.dequantize().T, atol=1e-4, rtol=1e-4)


def test_k_quant_model_matches_transformers(kquant):
    model, path, _ = kquant
    ids = IDS % 256
    torch.testing.assert_close(
        engine_logits(path, ids), reference_logits(model, ids), atol=ATOL, rtol=ATOL
    )


# The other types of llama.cpp's K-quant files of the embedded model (its K = 576 rows are
# no whole super-blocks, so llama.cpp falls back to Q5_0/Q5_1/Q8_0/IQ4_NL for them) and of
# Q2_K / Q3_K_M / IQ4_XS files.
@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "IQ4_XS"])
def test_other_block_types_decode_like_gguf_py(tmp_path, kind):
    """A Q (permuted rows) and a down projection of ``kind``: decoded bit for bit as gguf-py
    does, and the model's logits match transformers on those values."""
    types = {"blk.0.attn_q.weight": kind, "blk.0.ffn_down.weight": kind}
    model, path, _ = quant_block_model(tmp_path, types)
    from engine.weights.gguf import load_gguf

    weights = load_gguf(path)
    ref = dict(model.named_parameters())
    assert torch.equal(weights.layers[0].wq, ref["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(weights.layers[0].w_down, ref["model.layers.0.mlp.down_proj.weight"])
    assert weights.formats["blk.0.ffn_down.weight"] == kind
    torch.testing.assert_close(
        engine_logits(path, IDS), reference_logits(model, IDS), atol=ATOL, rtol=ATOL
    )


def test_undecodable_type_names_tensor(tmp_path):
    """A type gguf-py cannot decode (Q8_1, an activation format) is an error naming the
    tensor and its type."""
    model = build_hf(tmp_path, "llama")
    n, k = model.model.layers[0].self_attn.q_proj.weight.shape
    blocks = np.random.default_rng(0).integers(0, 256, (n, k // 32 * 40), dtype=np.uint8)
    raw = {"blk.0.attn_q.weight": (gguf.GGMLQuantizationType.Q8_1, blocks)}
    path = write_gguf(tmp_path / "m.gguf", model, "llama", raw_tensors=raw)
    with pytest.raises(ValueError, match=r"m\.gguf: tensor blk\.0\.attn_q\.weight has type Q8_1"):
        load_weights(str(path))


def test_model_line_says_what_each_type_became(kquant):
    from engine.weights.gguf import load_gguf
    from engine.weights.types import describe_placement

    formats = load_gguf(kquant[1]).formats
    assert describe_placement(formats, "int4", "bfloat16") == (
        "linears: Q4_K x5 -> int4 as stored; Q5_K x1, Q6_K x1 -> re-quantised to int4; "
        "other: F32 x3, Q4_K x1, Q6_K x1 -> float"
    )
    assert describe_placement(formats, "float", "float32") == (
        "linears: Q4_K x5 -> dequantised to float32; Q5_K x1, Q6_K x1 -> float32 (exact "
        "decode); other: F32 x3, Q4_K x1, Q6_K x1 -> float"
    )


@pytest.mark.slow
def test_embedded_model_line_and_registry(smollm2_gguf_path, monkeypatch):
    """The real Q4_1 model loads through the registry (no unused tensor refused) and its
    model line names its tensor types; ``auto`` on a CPU with bf16 instructions (patched
    so on any machine) keeps the Q4_1 codes for the int4 kernel (bf16 products)."""
    import engine.weights.quant as quant
    from engine.load import load_engine

    config = EngineConfig(host_pool_gb=1.0, max_batch=1, weight_format="float")
    engine = load_engine(config, str(smollm2_gguf_path))
    assert type(engine.model).__name__ == "LlamaModel" and engine.model.config.arch == "llama"
    assert engine.weights_info == (
        "linears: Q4_1 x210 -> dequantised to float32; other: F32 x61, Q8_0 x1 -> float"
    )
    monkeypatch.setattr(quant, "cpu_fast_bf16", lambda: True)
    engine = load_engine(config.replace(weight_format="auto"), str(smollm2_gguf_path))
    assert isinstance(engine.model.layers[0].w_down, quant.Int4Linear)
    base = (
        "linears: Q4_1 x210 -> int4 as stored; other: F32 x61, Q8_0 x1 -> float; int4 kernel "
        "with bfloat16 activations; auto: CPU has AVX512-BF16/AMX"
    )
    # then the LM head this machine measured faster (engine.weights.quant.pick_cpu_lm_head),
    # now or, when another test of this worker measured it first, before
    head = (
        r"; LM head (fp16 \([\d.]+ vs [\d.]+ ms float32|float32 \(fp16 [\d.]+ vs [\d.]+ ms), "
        r"measured( on this machine before)?\)"
    )
    info = engine.weights_info
    assert info.startswith(base) and re.fullmatch(head, info[len(base) :]), info


def test_the_load_reuses_the_tokenizer_counted_before_it(llama31):
    """``load_tokenizer`` (the CLI's token count before the load) and ``load_weights`` of
    the same unchanged file share one tokenizer; a rewritten file builds its own."""
    import os

    from engine.load import load_tokenizer

    _, path, _ = llama31
    tokenizer, _ = load_tokenizer(str(path))
    assert load_weights(str(path))[1] is tokenizer
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # "rewritten"
    assert load_weights(str(path))[1] is not tokenizer


# ----------------------------------------------------------------------------- shape


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"llama.block_count": 0}, ["llama.block_count: must be a positive integer, got 0"]),
        (
            {"llama.attention.head_count_kv": 0, "llama.embedding_length": -96},
            [
                "llama.embedding_length: must be a positive integer, got -96",
                "llama.attention.head_count_kv: must be a positive integer, got 0",
            ],
        ),
        ({"llama.block_count": 2.5}, ["llama.block_count: must be a positive integer, got 2.5"]),
        (
            {"llama.feed_forward_length": 4_000_000_000},
            ["llama.feed_forward_length: must be at most 1,048,576, got 4000000000"],
        ),
        (
            {"llama.attention.head_count_kv": 4},
            ["llama.attention.head_count_kv: must divide llama.attention.head_count (6), got 4"],
        ),
    ],
)
def test_a_bad_gguf_shape_is_named_by_run_and_plan(tmp_path, changes, says):
    """The shape keys of a GGUF header get the check a config.json's get
    (:func:`engine.config.check_shape`): ``hisparse run`` (the loader) and ``hisparse
    plan`` (:func:`engine.capacity.shapes.get_model_shape`) refuse with the same lines,
    each naming the file and the key, before any tensor is read."""

    path = write_gguf(tmp_path / "m.gguf", build_hf(tmp_path / "hf", "llama"), "llama")
    for key, value in changes.items():
        patch_gguf_field(path, key, value)
    _run_and_plan_refuse_alike(path, says)


YARN = {
    "llama.rope.scaling.type": "yarn",
    "llama.rope.scaling.factor": 4.0,
    "llama.rope.scaling.original_context_length": 64,
}


def test_a_gguf_yarn_scaling_is_read(tmp_path):
    from engine.capacity.shapes import get_model_shape

    path = write_gguf(tmp_path / "m.gguf", build_hf(tmp_path / "hf", "llama"), "llama", metadata=YARN)
    scaling = get_model_shape(str(path)).rope_scaling
    assert (scaling.kind, scaling.factor, scaling.original_max_position) == ("yarn", 4.0, 64)


@pytest.mark.parametrize(
    ("patches", "metadata", "says"),
    [
        ({"llama.rope.freq_base": float("nan")}, {},
         ["llama.rope.freq_base: must be a finite number > 1, got nan"]),
        ({"llama.rope.freq_base": 1.0, "llama.attention.layer_norm_rms_epsilon": -1.0}, {},
         ["llama.rope.freq_base: must be a finite number > 1, got 1.0",
          "llama.attention.layer_norm_rms_epsilon: must be a finite number > 0, got -1.0"]),
        ({}, YARN | {"llama.rope.scaling.factor": "4x", "llama.rope.scaling.original_context_length": 0},
         ["llama.rope.scaling.factor: must be a finite number > 0, got '4x'",
          "llama.rope.scaling.original_context_length: must be a positive integer, got 0"]),
        ({}, YARN | {"llama.rope.scaling.factor": float("inf")},
         ["llama.rope.scaling.factor: must be a finite number > 0, got inf"]),
        ({}, YARN | {"llama.rope.scaling.factor": 0.0},
         ["llama.rope.scaling.factor: must be a finite number > 0, got 0.0"]),
        ({"llama.block_count": 0, "llama.rope.freq_base": -10000.0}, {},
         ["llama.block_count: must be a positive integer, got 0",
          "llama.rope.freq_base: must be a finite number > 1, got -10000.0"]),
    ],
)  # fmt: skip
def test_bad_gguf_rope_and_norm_numbers_are_named_by_run_and_plan(
    tmp_path, patches, metadata, says
):
    """Review finding: the RoPE base, norm epsilon, scaling factor and original context of a
    GGUF header were read with a bare float()/int(): NaN, a negative base or epsilon and a
    factor of 0 loaded a model that computes NaN, a factor "4x" ended in a ValueError
    naming no file or key. They get the check of a config.json's (check_numbers, and
    check_shape for the context), every problem with the shape's at once."""

    model = build_hf(tmp_path / "hf", "llama")
    path = write_gguf(tmp_path / "m.gguf", model, "llama", metadata=metadata)
    for key, value in patches.items():
        patch_gguf_field(path, key, value)
    _run_and_plan_refuse_alike(path, says)


def _run_and_plan_refuse_alike(path, says):
    """``run``'s load and ``plan``'s shape both refuse ``path`` with the lines ``says``."""
    from engine.capacity.shapes import get_model_shape
    from engine.config import ConfigError
    from engine.weights.gguf import GGUFError

    with pytest.raises(GGUFError) as info:
        load_weights(str(path))
    assert str(info.value).splitlines() == [f"{path}: {line}" for line in says]
    with pytest.raises(ConfigError) as planned:
        get_model_shape(str(path))
    assert str(planned.value) == str(info.value)
