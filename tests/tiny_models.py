"""Tiny random checkpoints of each supported family, for the loader and architecture tests.

:func:`build_hf` makes a transformers model from its own config class (few layers, GQA,
sizes that are not powers of two), randomises norms and biases (transformers initialises
them to ones / zeros, which would hide a missing norm or bias) and saves it as a Hugging
Face folder with a 256-token byte-level tokenizer. :func:`write_gguf` writes the same
weights as a GGUF file with gguf-py's ``GGUFWriter`` in llama.cpp's conventions
(``convert_hf_to_gguf.py``: tensor names ``blk.<i>.attn_q.weight`` ..., metadata keys
``<arch>.block_count`` ..., Q/K rows permuted for ``llama`` (``LlamaModel.permute``) and
left in Hugging Face order for ``qwen2`` / ``qwen3`` (``Qwen2Model`` does not permute),
Qwen3's per-head norms as ``attn_q_norm`` / ``attn_k_norm``; ``Phi3MiniModel``: fused
``attn_qkv`` and ``ffn_up`` = gate|up, ``longrope`` as ``rope_factors_short`` /
``rope_factors_long`` with ``rope.scaling.attn_factor`` / ``original_context_length``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers

VOCAB = 256
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=96,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def longrope(head_dim: int, original: int) -> dict:
    """A ``longrope`` ``rope_scaling`` (Phi-3.5's layout) with distinct short and long
    per-frequency factors for ``head_dim``, trained context ``original`` (Phi3Config
    overrides it with its own ``original_max_position_embeddings``: pass both)."""
    half = head_dim // 2
    return dict(
        rope_type="longrope",
        short_factor=[1.0 + 0.15 * i for i in range(half)],
        long_factor=[1.5 + 0.9 * i for i in range(half)],
        original_max_position_embeddings=original,
    )


# Phi3Config's default special ids (32000...) lie outside the tiny vocabulary.
PHI3_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Gemma: layer 0 slides over 8 tokens, layer 1 is global; weights large enough (and caps
# small enough) that the soft-caps bend the logits; query_pre_attn_scalar = head_dim, the
# value llama.cpp assumes for a GGUF (test_architectures checks another one on folders).
GEMMA = dict(
    head_dim=16,
    query_pre_attn_scalar=16,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"],
    initializer_range=0.15,
    **PHI3_TOKENS,
)
# family -> (config class, model class, extra config fields)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=16)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=16, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, rope_theta=1e6)),
    # longrope at its trained context: the short factors, attention factor 1
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            sliding_window=None,
            rope_scaling=longrope(16, 256),
            original_max_position_embeddings=256,
            **PHI3_TOKENS,
        ),
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(attn_logit_softcapping=4.0, final_logit_softcapping=3.0, **GEMMA),
    ),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(final_logit_softcapping=3.0, **GEMMA)),
}


def randomise(model, seed: int = 1) -> None:
    """Norm weights near 1 and biases of scale 0.5, drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))


def save_tokenizer(folder: Path) -> None:
    """A 256-token byte-level BPE (no merges), enough for ``TextTokenizer.from_folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from engine.text.tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))


def build_hf(folder: Path, family: str, seed: int = 0, **overrides):
    """Save a tiny random ``family`` model to ``folder``; return the float32 model (eval).

    The reference runs transformers' ``eager`` attention: the one that implements every
    family's attention in full (its ``sdpa`` path drops Gemma 2's attention-logit
    soft-cap, and which path is the default differs between transformers versions)."""
    cfg_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(**(BASE | extra | overrides))
    cfg._attn_implementation = "eager"
    model = getattr(transformers, model_name)(cfg)
    randomise(model, seed + 1)
    model.eval()
    model.save_pretrained(folder)
    save_tokenizer(folder)
    return model


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (``convert_hf_to_gguf.py`` ``LlamaModel.permute``):
    per head, rotate-half rows ``[x0..x_{D/2-1}, y0..]`` become interleaved pairs."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",  # phi3 (fused, not permuted)
    "mlp.gate_up_proj.weight": "ffn_up.weight",  # phi3: gate rows then up rows
}
# Gemma 2/3 norms (tensor_mapping.py): post_attention_layernorm is on the attention output.
_GEMMA_NORMS = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def write_gguf(
    path: Path,
    model,
    arch: str,
    *,
    linear_dtype=np.float32,
    rope_freqs: np.ndarray | None = None,
    permute: bool | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    raw_tensors: dict[str, tuple] | None = None,
    merges: list[str] | None = None,
    metadata: dict[str, str | int | float] | None = None,
) -> Path:
    """Write ``model``'s weights as a GGUF of ``general.architecture = arch``.

    Parameters
    ----------
    linear_dtype : numpy dtype of the 2-D weights (float32 -> F32, float16 -> F16)
    rope_freqs : optional ``[D/2]`` float32 written as ``rope_freqs.weight``
    permute : permute Q/K rows as llama.cpp does; default: only for ``llama``/``mistral``
    extra_tensors : more tensors to write as they are (to test refusals)
    raw_tensors : GGUF name -> ``(GGMLQuantizationType, uint8 [N, bytes])`` quantised
        blocks written instead of the model's float tensor (rows in Hugging Face order;
        Q/K rows are permuted like the float ones). The model's weight should hold their
        dequantised values.
    merges : BPE merges (default none; llama.cpp refuses a ``gpt2`` vocabulary without any)
    metadata : more keys written as they are (to test refusals), each a string, a UINT32
        (an int >= 0), an INT32 (a negative int) or a FLOAT32
    """
    import gguf

    from engine.text.tokenizer import bytes_to_unicode

    cfg = model.config
    if permute is None:
        permute = arch in ("llama", "mistral")
    gemma = arch in ("gemma2", "gemma3")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-" + arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = cfg.rope_parameters
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' base
    w.add_rope_freq_base(float(rope["rope_theta"]))
    gemma = arch in ("gemma2", "gemma3")
    if gemma:  # Gemma2Model / Gemma3Model.set_gguf_parameters
        if cfg.attn_logit_softcapping:
            w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        if cfg.final_logit_softcapping:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
        if arch == "gemma3":
            w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(list(bytes_to_unicode().values()))
    w.add_token_types([1] * VOCAB)
    w.add_token_merges(merges or [])
    w.add_add_bos_token(False)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            (w.add_uint32 if value >= 0 else w.add_int32)(key, value)
    if rope.get("rope_type") == "longrope":  # Phi3MiniModel.set_gguf_parameters / extra tensors
        import math

        original = rope["original_max_position_embeddings"]
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        )
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    layer_names = _LAYER
    if gemma:  # llama.cpp adds Gemma's RMSNorm 1 to every norm weight
        sd = {k: v + 1 if k.endswith("norm.weight") else v for k, v in sd.items()}
        layer_names = {k: v for k, v in _LAYER.items() if k != "post_attention_layernorm.weight"}
        layer_names |= _GEMMA_NORMS

    raw_tensors = raw_tensors or {}

    def put(name: str, a: np.ndarray) -> None:
        if name in raw_tensors:
            qtype, blocks = raw_tensors[name]
            if permute and ".attn_q." in name:
                blocks = permute_qk(blocks, cfg.num_attention_heads)
            elif permute and ".attn_k." in name:
                blocks = permute_qk(blocks, cfg.num_key_value_heads)
            w.add_tensor(name, np.ascontiguousarray(blocks), raw_dtype=qtype)
            return
        a = np.ascontiguousarray(a)
        w.add_tensor(name, a.astype(linear_dtype) if a.ndim == 2 else a.astype(np.float32))

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings and not gemma:  # Gemma2Model skips lm_head
        put("output.weight", sd["lm_head.weight"])
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    for i in range(cfg.num_hidden_layers):
        for hf, gg in layer_names.items():
            a = sd.get(f"model.layers.{i}.{hf}")
            if a is None:
                continue
            if f"blk.{i}.{gg}" in raw_tensors:
                pass  # put() permutes the blocks
            elif permute and gg.startswith("attn_q."):
                a = permute_qk(a, cfg.num_attention_heads)
            elif permute and gg.startswith("attn_k."):
                a = permute_qk(a, cfg.num_key_value_heads)
            put(f"blk.{i}.{gg}", a)
    for name, a in (extra_tensors or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def patch_gguf_field(path: Path, key: str, value: int | float) -> None:
    """Rewrite the 4-byte scalar metadata value ``key`` of a GGUF file in place, as a bad
    file would hold it (GGUFWriter's typed adders refuse some): an int >= 0 as UINT32, a
    negative one as INT32, a float as FLOAT32."""
    import struct

    data = bytearray(path.read_bytes())
    name = key.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    assert struct.unpack_from("<I", data, at)[0] in (4, 5, 6), f"{key}: not a 4-byte scalar"
    if isinstance(value, float):
        struct.pack_into("<If", data, at, 6, value)
    else:
        struct.pack_into("<Ii" if value < 0 else "<II", data, at, 5 if value < 0 else 4, value)
    path.write_bytes(bytes(data))


# Byte offsets of the fp16 super-block scales (``d`` / ``dmin``) in ggml's block structs
# (ggml-common.h) and a value range for them keeping weights near 0.05.
_F16_FIELDS = {
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q2_K": (80, 82),  # block_q2_K: scales[16], qs[64], d, dmin
    "Q3_K": (108,),  # block_q3_K: hmask[32], qs[64], scales[12], d
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),  # block_iq4_xs: d, scales_h, scales_l[4], qs[128]
}
_F16_SCALE = {
    "Q4_K": 1e-4,
    "Q5_K": 5e-5,
    "Q6_K": 1e-5,
    "Q8_0": 3e-4,
    "Q4_0": 5e-3,
    "Q2_K": 1e-3,
    "Q3_K": 4e-4,
    "Q5_0": 3e-3,
    "Q5_1": 2e-3,
    "IQ4_NL": 4e-4,
    "IQ4_XS": 1e-5,
}


def random_quant_blocks(type_name: str, n: int, k: int, seed: int) -> tuple:
    """Random but valid GGUF blocks of ``type_name`` for an ``[n, k]`` tensor: random
    bytes for codes and packed sub-scales, finite positive fp16 super-block scales.

    Returns ``(GGMLQuantizationType, uint8 [n, k / block * type_size])``."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for off in _F16_FIELDS[type_name]:
        d = (_F16_SCALE[type_name] * rng.uniform(0.5, 1.5, size=(n, k // block))).astype(np.float16)
        raw[:, :, off : off + 2] = d.view(np.uint8).reshape(n, k // block, 2)
    return qtype, raw.reshape(n, -1)


def dequantize_blocks(qtype, blocks: np.ndarray, k: int) -> torch.Tensor:
    """gguf-py's decoding of ``blocks`` as float32 ``[n, k]`` (the independent reference)."""
    import gguf

    return torch.from_numpy(np.array(gguf.quants.dequantize(blocks, qtype), np.float32)).reshape(
        -1, k
    )


def reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """transformers' float32 logits ``[T, V]`` for one sequence ``ids [T]``."""
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


def greedy_reference(model, ids: torch.Tensor, steps: int) -> list[int]:
    """transformers' greedy continuation of ``ids`` (``steps`` new tokens), each step the
    argmax of a full forward over the sequence so far."""
    seq = ids.clone()
    out: list[int] = []
    for _ in range(steps):
        nxt = int(reference_logits(model, seq)[-1].argmax())
        out.append(nxt)
        seq = torch.cat([seq, torch.tensor([nxt])])
    return out
