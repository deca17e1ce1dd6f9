"""Every registered architecture against transformers, from a Hugging Face folder and a GGUF.

For each family of :data:`tiny_models.FAMILIES` (one per :mod:`engine.model.registry`
entry): a tiny random transformers model (its own config class, GQA, sizes that are not
powers of two, randomised norms and biases) is saved as a folder and written as a GGUF in
llama.cpp's conventions; the engine loads either through :func:`engine.load.load_weights`
and places it with :func:`engine.model.registry.build_model`. Logits on a teacher-forced
sequence must match transformers' within fp32 summation-order tolerance, and greedy
continuations must be identical. The GGUF writer itself is checked against transformers'
own GGUF reader (an independent implementation of llama.cpp's Q/K permutation).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from tiny_models import FAMILIES, build_hf, greedy_reference, reference_logits, write_gguf  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.load import context_limit_and_rope, load_weights  # noqa: E402
from engine.model import registry  # noqa: E402
from engine.model.llama import prefill_attention  # noqa: E402

IDS = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(4))
ATOL = 1e-4
STEPS = 12
GGUF_ARCH = {"llama": "llama", "mistral": "llama"} | {
    n: n for n in ("qwen2", "qwen3", "phi3", "gemma2", "gemma3")
}


class Placed:
    """A checkpoint loaded and placed as the engine does (CPU, fp32)."""

    def __init__(self, path, fmt: str = "float", config: EngineConfig | None = None):
        weights, self.tokenizer, _ = load_weights(str(path))
        self.config = weights.config
        _, rope = context_limit_and_rope(self.config, config or EngineConfig())
        self.model = registry.build_model(weights, torch.device("cpu"), torch.float32, fmt, rope)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        m = self.model
        h = m.embed_tokens(ids)
        positions = torch.arange(len(ids))
        for i in range(self.config.num_layers):
            q, k, v = m.qkv(i, h, positions)
            a = prefill_attention(q, k, v, 0, m.scale, m.attn_softcap, m.attn_window(i))
            h = m.finish_layer(i, h, a)
        return m.logits(h)

    def greedy(self, ids: torch.Tensor, steps: int) -> list[int]:
        seq = ids.clone()
        out = []
        for _ in range(steps):
            nxt = int(self.logits(seq)[-1].argmax())
            out.append(nxt)
            seq = torch.cat([seq, torch.tensor([nxt])])
        return out


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    folder = tmp_path_factory.mktemp(name)
    model = build_hf(folder, name)
    gguf_path = write_gguf(folder / f"{name}.gguf", model, GGUF_ARCH[name])
    return name, folder, gguf_path, model


def test_every_registered_architecture_is_tested():
    assert set(FAMILIES) == set(registry.ARCHITECTURES)


def test_hf_folder_matches_transformers(family):
    name, folder, _, model = family
    placed = Placed(folder)
    entry = registry.get(name)
    assert placed.config.arch == name
    assert (placed.config.qkv_bias, placed.config.qk_norm) == (entry.qkv_bias, entry.qk_norm)
    torch.testing.assert_close(
        placed.logits(IDS), reference_logits(model, IDS), atol=ATOL, rtol=ATOL
    )
    assert placed.greedy(IDS, STEPS) == greedy_reference(model, IDS, STEPS)


def test_gguf_matches_transformers(family):
    name, _, gguf_path, model = family
    placed = Placed(gguf_path)
    assert placed.config.arch == ("llama" if name == "mistral" else name)
    assert placed.config.qk_norm == registry.get(name).qk_norm
    torch.testing.assert_close(
        placed.logits(IDS), reference_logits(model, IDS), atol=ATOL, rtol=ATOL
    )
    assert placed.greedy(IDS, STEPS) == greedy_reference(model, IDS, STEPS)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_gguf_writer_agrees_with_transformers_gguf_reader(tmp_path, name):
    """transformers' GGUF reader (its own Q/K un-permutation) gives back the same logits
    from the written file, so the files follow llama.cpp's layout, not just ours."""
    pytest.importorskip("accelerate")
    model = build_hf(tmp_path, name)
    path = write_gguf(tmp_path / "m.gguf", model, name)
    reread = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    ).eval()
    torch.testing.assert_close(
        reference_logits(reread, IDS), reference_logits(model, IDS), atol=ATOL, rtol=ATOL
    )


def test_gguf_arch_mistral_name(tmp_path):
    """``general.architecture = mistral`` (transformers' GGUF naming) reads as Mistral."""
    model = build_hf(tmp_path, "mistral")
    path = write_gguf(tmp_path / "m.gguf", model, "mistral")
    placed = Placed(path)
    assert placed.config.arch == "mistral"
    torch.testing.assert_close(
        placed.logits(IDS), reference_logits(model, IDS), atol=ATOL, rtol=ATOL
    )


def test_gguf_f16_weights_and_int4_placement(tmp_path):
    """F16 linear/embedding tensors decode exactly; ``int4`` placement stays close."""
    model = build_hf(tmp_path, "qwen3")
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(p.half().float())
    path = write_gguf(tmp_path / "m.gguf", model, "qwen3", linear_dtype=np.float16)
    placed = Placed(path)
    ref = reference_logits(model, IDS)
    torch.testing.assert_close(placed.logits(IDS), ref, atol=ATOL, rtol=ATOL)
    int4 = Placed(path, fmt="int4").logits(IDS)
    assert (int4 - ref).abs().max() < 0.25 * ref.abs().max()


# ----------------------------------------------------------------------------- refusals


def test_unknown_architectures_list_the_supported_ones(tmp_path):
    with pytest.raises(registry.UnsupportedArchitecture, match="llama, mistral, qwen2, qwen3"):
        registry.get("falcon")
    with pytest.raises(ValueError, match=r"general\.architecture='falcon'.*gemma3"):
        registry.for_gguf("falcon")
    # Gemma 3's multimodal checkpoints (4B and up) are not the text-only Gemma3ForCausalLM
    with pytest.raises(ValueError, match=r"Gemma3ForConditionalGeneration.*Gemma3ForCausalLM"):
        registry.for_hf(["Gemma3ForConditionalGeneration"], "gemma3")
    assert registry.for_hf(None, "qwen3").name == "qwen3"
    model = build_hf(tmp_path, "llama")
    path = write_gguf(tmp_path / "m.gguf", model, "falcon")
    with pytest.raises(ValueError, match=r"m\.gguf: general\.architecture='falcon'.*llama"):
        load_weights(str(path))


def test_gguf_unused_tensor_is_refused(tmp_path):
    """A tensor the architecture does not use (here Qwen3's q/k norms in a ``llama`` file)
    is an error naming it, never silently dropped."""
    model = build_hf(tmp_path, "qwen3")
    path = write_gguf(tmp_path / "m.gguf", model, "llama", permute=False)
    with pytest.raises(ValueError, match=r"m\.gguf: tensor\(s\) blk\.0\.attn_k_norm\.weight"):
        load_weights(str(path))


def test_gguf_qwen2_missing_bias_is_refused(tmp_path):
    model = build_hf(tmp_path, "llama")
    path = write_gguf(tmp_path / "m.gguf", model, "qwen2", permute=False)
    with pytest.raises(ValueError, match=r"m\.gguf: missing tensor blk\.0\.attn_q\.bias"):
        load_weights(str(path))


# ----------------------------------------------------------------------------- phi3 longrope


def test_phi3_longrope_short_and_long_factors(tmp_path):
    """Phi-3.5's ``longrope`` (trained context 32 here, extended to 256): a run limited to
    the original context uses the short factors, a longer one the long factors and the
    attention factor; each matches transformers on a sequence on its side of 32 tokens
    (transformers switches per length), from the folder and from the GGUF."""
    from tiny_models import longrope

    model = build_hf(
        tmp_path, "phi3", rope_scaling=longrope(16, 32), original_max_position_embeddings=32
    )
    path = write_gguf(tmp_path / "m.gguf", model, "phi3")
    short_ids, long_ids = IDS[:30], torch.cat([IDS, IDS[:8]])
    for source in (tmp_path, path):
        short = Placed(source, config=EngineConfig(max_context=32))
        torch.testing.assert_close(
            short.logits(short_ids), reference_logits(model, short_ids), atol=ATOL, rtol=ATOL
        )
        long = Placed(source)
        assert long.config.rope_scaling.kind == "longrope"
        assert short.model.rope.attention_factor == long.model.rope.attention_factor
        assert long.model.rope.attention_factor == pytest.approx(
            (1 + np.log(256 / 32) / np.log(32)) ** 0.5
        )
        ref = reference_logits(model, long_ids)
        torch.testing.assert_close(long.logits(long_ids), ref, atol=ATOL, rtol=ATOL)
        # the two tables differ, so each comparison above can tell them apart
        assert (short.logits(long_ids) - ref).abs().max() > 100 * ATOL


def test_phi3_int4_on_load_splits_fused_rows(tmp_path):
    """The fused ``qkv_proj`` / ``gate_up_proj`` quantised on load are split as 4-bit
    rows; the placed model stays close to transformers."""
    from engine.weights.hf import load_hf_folder
    from engine.weights.quant import Int4Weight

    model = build_hf(tmp_path, "phi3")
    weights = load_hf_folder(tmp_path, int4_group_size=32)
    layer = weights.layers[0]
    assert isinstance(layer.wk, Int4Weight) and layer.wk.shape == (32, 96)
    assert layer.w_up.shape == (160, 96)
    assert weights.formats["model.layers.0.self_attn.qkv_proj"] == "int4-g32"
    fused = model.model.layers[0].self_attn.qkv_proj.weight.detach()
    torch.testing.assert_close(layer.wk.dequantize(), fused[96:128], atol=0.02, rtol=0)


def test_phi3_partial_rotary_is_refused(tmp_path):
    """Phi-4-mini rotates 3/4 of each head; refused naming the field, not run wrongly."""
    from engine.weights.hf import HFModelError, read_hf_config

    build_hf(tmp_path, "phi3", partial_rotary_factor=0.75, rope_scaling=None)
    with pytest.raises(HFModelError, match="partial_rotary_factor=0.75"):
        read_hf_config(tmp_path)


# ----------------------------------------------------------------------------- gemma


def test_gemma_query_pre_attn_scalar_from_the_folder(tmp_path):
    """Gemma 2 27B's ``query_pre_attn_scalar`` (hidden / heads, not head_dim) sets the
    softmax scale; the default one would not match."""
    model = build_hf(tmp_path, "gemma2", query_pre_attn_scalar=40)
    placed = Placed(tmp_path)
    assert placed.model.scale == pytest.approx(40**-0.5)
    ref = reference_logits(model, IDS)
    torch.testing.assert_close(placed.logits(IDS), ref, atol=ATOL, rtol=ATOL)
    placed.model.scale = 16**-0.5
    assert (placed.logits(IDS) - ref).abs().max() > 100 * ATOL


def test_gemma_norms_are_one_plus_w(tmp_path):
    """Hugging Face Gemma norms store ``w`` of ``x * (1 + w)``; the loader hands over
    ``1 + w`` (llama.cpp's GGUF already holds it), every norm of the layer included."""
    from engine.weights.hf import load_hf_folder

    model = build_hf(tmp_path, "gemma3")
    weights = load_hf_folder(tmp_path)
    layer, src = weights.layers[1], model.model.layers[1]
    pairs = [
        (layer.attn_norm, src.input_layernorm),
        (layer.post_attn_norm, src.post_attention_layernorm),
        (layer.ffn_norm, src.pre_feedforward_layernorm),
        (layer.post_ffn_norm, src.post_feedforward_layernorm),
        (layer.q_norm, src.self_attn.q_norm),
        (weights.norm, model.model.norm),
    ]
    for ours, theirs in pairs:
        torch.testing.assert_close(ours, theirs.weight.detach() + 1)
    cfg = weights.config
    assert (cfg.sliding_layers, cfg.sliding_window, cfg.rope_local_theta) == ((0,), 8, 10000.0)


def test_tied_head_shares_the_placed_embedding(tmp_path):
    """A tied model's LM head reads the placed embedding: one copy of the ``[V, H]`` matrix
    in the compute dtype (bf16 here, where placing the head separately made a second
    one), counted once by ``weight_bytes``; the logits are the embedding's product."""
    model = build_hf(tmp_path, "qwen2")
    assert model.config.tie_word_embeddings
    weights, _, _ = load_weights(str(tmp_path))
    _, rope = context_limit_and_rope(weights.config, EngineConfig())
    placed = registry.build_model(weights, torch.device("cpu"), torch.bfloat16, "float", rope)
    assert placed.lm_head.weight.data_ptr() == placed.embed.data_ptr()
    layers = sum(
        x.nbytes
        for layer in placed.layers
        for x in (layer.attn_norm, layer.ffn_norm, layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)
    )
    assert placed.weight_bytes == placed.embed.nbytes + placed.norm.nbytes + layers
    h = torch.randn(3, placed.config.hidden_size).bfloat16()
    torch.testing.assert_close(placed.lm_head(h), h @ placed.embed.T)


def test_plan_reads_a_gguf_shape(tmp_path):
    """``hisparse plan --model FILE.gguf``: the shape from the file's header (no tensor
    data), its 4-bit blocks' group (32) for the weight bytes; a file that is not a GGUF is
    refused with its name."""
    from engine.capacity.shapes import get_model_shape
    from engine.config import ConfigError

    model = build_hf(tmp_path / "hf", "llama")
    path = write_gguf(tmp_path / "tiny.gguf", model, "llama")
    shape = get_model_shape(str(path))
    assert (shape.num_layers, shape.hidden_size, shape.num_kv_heads) == (
        model.config.num_hidden_layers,
        model.config.hidden_size,
        model.config.num_key_value_heads,
    )
    assert shape.int4_group_size == 128  # F32 linears: re-quantised by quantize_int4
    bad = tmp_path / "notes.gguf"
    bad.write_text("not a model")
    with pytest.raises(ConfigError, match="notes.gguf"):
        get_model_shape(str(bad))
