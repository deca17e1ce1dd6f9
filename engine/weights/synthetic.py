"""Synthetic models: deterministic random 4-bit weights of a published shape.

``--model synthetic:NAME`` runs the engine on a model of the shape ``NAME`` (a key of
:data:`engine.capacity.shapes.MODEL_SHAPES` or ``tiny``) without downloading weights, to
measure throughput, memory and the KV hierarchy at the sizes the presets are made for.
The weights are synthetic: attention patterns (hence selection locality, hit and miss
rates) and the generated text differ from those of a trained model; use them for speed
and memory figures only, never for quality.

Weights (all seeded per tensor and row block from a hash of ``NAME/tensor/block``):

* linears: normal, std 0.02, generated ``BLOCK_ELEMENTS`` at a time and quantised with
  :func:`engine.weights.quant.quantize_int4` (group 128, or 64/32 where K needs it) as they are
  made, so a 13B shape never exists in float32 at once (host memory ~4.5 bits/weight);
* embedding (float32 ``[V, H]``) and untied ``lm_head`` (4-bit): normal, std 0.02;
* norms: ones; q/k/v biases (Qwen2 shapes): normal, std 0.02.

The random numbers come from ``torch.Generator`` on ``device``: the same name gives the
same weights on the same device type (CPU and CUDA streams differ). Big shapes are meant
to be generated on the GPU machine (:func:`load_synthetic` uses CUDA when there is one);
the weights always land on the CPU, like a checkpoint read from disk.

Tokenizer: the embedded SmolLM2 one (vocabulary 49152). A shape keeps its published
vocabulary V: encoded ids are taken ``id % V`` (matters when V < 49152, e.g. Llama 2's
32000) and generated ids are decoded as ``id % 49152`` (when V > 49152). Where the
embedded model is not installed (a GPU machine without the GGUF), ``tokenizer="ids"``
(``EngineConfig.tokenizer``) puts an :class:`IdsTokenizer` in front instead:
jobs then come as token ids (a pre-tokenised corpus) and results are ids as text.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from engine.capacity.shapes import MODEL_SHAPES
from engine.config import ModelConfig
from engine.text.tokenizer import TextTokenizer
from engine.weights.hf import group_size_for
from engine.weights.quant import Int4Weight, quantize_int4
from engine.weights.types import LayerWeights, ModelWeights

PREFIX = "synthetic:"
LINEAR_STD = 0.02
EMBED_STD = 0.02
BIAS_STD = 0.02
GROUP_SIZE = 128
# Float elements generated (and quantised) at once; also the row block that seeds are
# tied to, so changing it changes the weights.
BLOCK_ELEMENTS = 1 << 22

# A two-layer model for tests, with the embedded tokenizer's vocabulary.
TINY = ModelConfig(
    arch="llama",
    num_layers=2,
    hidden_size=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    intermediate_size=256,
    vocab_size=49152,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position=8192,
    tie_word_embeddings=True,
    name="tiny",
)
SYNTHETIC_SHAPES: dict[str, ModelConfig] = {**MODEL_SHAPES, "tiny": TINY}


def synthetic_shape(name: str) -> ModelConfig:
    """The :class:`ModelConfig` of ``name`` (case-insensitive; ``synthetic:`` optional).

    Raises
    ------
    ValueError
        Unknown name; the message lists the known ones.
    """
    key = name.removeprefix(PREFIX).lower()
    if key not in SYNTHETIC_SHAPES:
        raise ValueError(
            f"unknown synthetic model {name!r}; known: {', '.join(sorted(SYNTHETIC_SHAPES))}"
        )
    return SYNTHETIC_SHAPES[key]


TOKENIZERS = ("embedded", "ids")


def load_synthetic(
    name: str,
    device: str | torch.device | None = None,
    group_size: int = GROUP_SIZE,
    tokenizer: str | None = None,
) -> tuple[ModelWeights, TextTokenizer | IdsTokenizer, str]:
    """Synthetic (random, 4-bit) weights of the shape ``name`` and the embedded tokenizer.

    The weights are synthetic: attention patterns, hence selection locality and miss
    rates, differ from a trained model's.

    Parameters
    ----------
    name : a key of :data:`SYNTHETIC_SHAPES` (``llama2-13b``, ``llama2-13b-gqa8``, ``llama3.1-8b``,
        ``qwen2.5-7b``, ``smollm2-135m``, ``tiny``), with or without ``synthetic:``
    device : where random numbers are drawn and quantised; None: ``cuda`` when available
        (big shapes), else ``cpu``. The weights depend on the device type.
    group_size : quantisation group along K
    tokenizer : ``embedded`` (default, ``None``) or ``ids`` (:func:`make_tokenizer`)

    Returns
    -------
    (weights, tokenizer, ``"synthetic:NAME"``)

    Raises
    ------
    ValueError
        Unknown name or tokenizer.
    FileNotFoundError
        The embedded model (for its tokenizer) is not installed.
    """
    cfg = synthetic_shape(name)
    tok = make_tokenizer(cfg.vocab_size, tokenizer)  # fails before the slow part
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    weights = synthetic_weights(cfg, device=device, group_size=group_size)
    return weights, tok, f"{PREFIX}{cfg.name}"


def synthetic_weights(
    cfg: ModelConfig, device: str | torch.device = "cpu", group_size: int = GROUP_SIZE
) -> ModelWeights:
    """Deterministic synthetic :class:`ModelWeights` of shape ``cfg`` (see module notes).

    Linears (and an untied ``lm_head``) are :class:`Int4Weight` with float32 scales;
    ``embed [V, H]``, norms and biases float32; everything on the CPU. The weights are
    synthetic: attention patterns differ from a trained model's.
    """
    cfg.validate()
    dev = torch.device(device)
    h, d = cfg.hidden_size, cfg.head_dim
    q_rows, kv_rows = cfg.num_heads * d, cfg.num_kv_heads * d
    f = cfg.intermediate_size
    shapes = {
        "wq": (q_rows, h),
        "wk": (kv_rows, h),
        "wv": (kv_rows, h),
        "wo": (h, q_rows),
        "w_gate": (f, h),
        "w_up": (f, h),
        "w_down": (h, f),
    }
    layers = []
    for i in range(cfg.num_layers):
        parts: dict[str, Any] = {
            field: synthetic_int4(f"{cfg.name}/layers.{i}.{field}", n, k, group_size, dev)
            for field, (n, k) in shapes.items()
        }
        parts["attn_norm"] = torch.ones(h)
        parts["ffn_norm"] = torch.ones(h)
        if cfg.qkv_bias:
            for field, rows in (("bq", q_rows), ("bk", kv_rows), ("bv", kv_rows)):
                parts[field] = synthetic_float(
                    f"{cfg.name}/layers.{i}.{field}", (rows,), BIAS_STD, dev
                )
        layers.append(LayerWeights(**parts))
    embed = synthetic_float(f"{cfg.name}/embed", (cfg.vocab_size, h), EMBED_STD, dev)
    lm_head = None
    if not cfg.tie_word_embeddings:
        lm_head = synthetic_int4(f"{cfg.name}/lm_head", cfg.vocab_size, h, group_size, dev)
    fmt = f"synthetic int4-g{group_size}"
    formats = {"linears": fmt, "embed": "synthetic F32"}
    return ModelWeights(cfg, embed, torch.ones(h), layers, lm_head, formats)


def tensor_seed(key: str) -> int:
    """A 63-bit seed from the SHA-256 of ``key`` (stable across runs and machines)."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def row_blocks(n: int, k: int) -> list[tuple[int, int]]:
    """``(start, stop)`` row ranges of at most :data:`BLOCK_ELEMENTS` elements (>= 1 row)."""
    rows = max(1, BLOCK_ELEMENTS // k)
    return [(start, min(start + rows, n)) for start in range(0, n, rows)]


def _normal_block(key: str, rows: int, k: int, std: float, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(tensor_seed(key))
    return torch.randn(rows, k, generator=gen, device=device) * std


def synthetic_int4(
    key: str, n: int, k: int, group_size: int = GROUP_SIZE, device: str | torch.device = "cpu"
) -> Int4Weight:
    """A random normal (std 0.02) ``[N, K]`` weight quantised to 4 bits, one row block at a
    time: peak float memory is one block of :data:`BLOCK_ELEMENTS`. Synthetic weights.

    Returns
    -------
    Int4Weight with ``q`` uint8 ``[N, K/2]`` and float32 ``[N, K/g]`` scale/offset, on CPU.

    ``group_size`` falls back to the largest of 64, 32 dividing K (as ``hisparse quantize``
    does; SmolLM2's K=576 gets 64).

    Raises
    ------
    ValueError
        K is not a multiple of 32.
    """
    device = torch.device(device)
    g = group_size_for(k, group_size)
    parts = []
    for b, (start, stop) in enumerate(row_blocks(n, k)):
        block = _normal_block(f"{key}#{b}", stop - start, k, LINEAR_STD, device)
        w = quantize_int4(block, g)
        parts.append((w.q.cpu(), w.scale.cpu(), w.offset.cpu()))
        del block, w
    q, scale, offset = (torch.cat(x) for x in zip(*parts, strict=True))
    return Int4Weight(q, scale, offset, g)


def synthetic_float(
    key: str, shape: Sequence[int], std: float, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """A random normal float32 tensor (1-D or 2-D), filled one row block at a time into a
    CPU tensor. Synthetic weights."""
    device = torch.device(device)
    if len(shape) == 1:
        return _normal_block(f"{key}#0", 1, shape[0], std, device)[0].cpu()
    n, k = shape
    out = torch.empty(n, k)
    for b, (start, stop) in enumerate(row_blocks(n, k)):
        out[start:stop] = _normal_block(f"{key}#{b}", stop - start, k, std, device).cpu()
    return out


# ----------------------------------------------------------------------------- tokenizer


class SyntheticTokenizer(TextTokenizer):
    """The embedded tokenizer in front of a synthetic model of vocabulary ``vocab_size``.

    Encoded ids are mapped ``id % vocab_size`` into the model's vocabulary; ids given to
    :meth:`decode` are mapped ``id % text_vocab_size`` into the tokenizer's.
    """

    def __init__(self, base: TextTokenizer, vocab_size: int):
        super().__init__(
            base.backend,
            bos_id=base.bos_id,
            eos_ids=[i % vocab_size for i in base.eos_ids],
            add_bos=base.add_bos,
            chat_template=base.chat_template,
            special_tokens=base.special_tokens,
            vocab_size=vocab_size,
        )
        self.text_vocab_size = base.vocab_size

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return [i % self.vocab_size for i in super().encode(text, add_bos)]

    def encode_batch(self, texts: Sequence[str], add_bos: bool = False) -> list[list[int]]:
        return [[i % self.vocab_size for i in ids] for ids in super().encode_batch(texts, add_bos)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        mapped = [int(i) % self.text_vocab_size for i in ids]
        return super().decode(mapped, skip_special_tokens)


@functools.lru_cache(maxsize=1)
def _embedded_tokenizer() -> TextTokenizer:
    from engine.weights.embedded import default_model_path

    return TextTokenizer.from_gguf(default_model_path())


class IdsTokenizer:
    """A tokenizer that knows no text: for runs whose jobs are token ids already.

    :meth:`decode` writes ids as space-separated numbers; there is no EOS (a job ends at
    ``max_tokens`` or a stop string made of ids); encoding text raises ``ValueError``.
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos_ids: frozenset[int] = frozenset()
        self.bos_id = None

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Raises ``ValueError``: this tokenizer has no vocabulary of text."""
        raise ValueError(
            "tokenizer 'ids' cannot encode text: give jobs as token ids (a pre-tokenised "
            "corpus), or install the embedded model for the synthetic tokenizer"
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Raises ``ValueError`` (see :meth:`encode`)."""
        return self.encode("")

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Raises ``ValueError`` (see :meth:`encode`)."""
        self.encode("")
        return ""

    def min_tokens(self, text: str) -> int | None:
        """No bound without a vocabulary (``None``)."""
        return None

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """``[5, 17]`` -> ``"5 17"``."""
        return " ".join(str(int(i)) for i in ids)


def make_tokenizer(vocab_size: int, kind: str | None = None) -> SyntheticTokenizer | IdsTokenizer:
    """The tokenizer of a synthetic model: ``embedded`` (``None``; the embedded SmolLM2
    tokenizer mapped onto ``vocab_size``) or ``ids`` (:class:`IdsTokenizer`).

    Raises
    ------
    ValueError
        Unknown ``kind``.
    FileNotFoundError
        ``embedded`` and the embedded model is not installed.
    """
    kind = kind or "embedded"
    if kind not in TOKENIZERS:
        raise ValueError(f"tokenizer {kind!r} is not one of {', '.join(TOKENIZERS)}")
    return IdsTokenizer(vocab_size) if kind == "ids" else synthetic_tokenizer(vocab_size)


def synthetic_tokenizer(vocab_size: int) -> SyntheticTokenizer:
    """The embedded SmolLM2 tokenizer mapped onto a vocabulary of ``vocab_size`` ids.

    Raises
    ------
    FileNotFoundError
        The embedded model is not installed.
    """
    return SyntheticTokenizer(_embedded_tokenizer(), vocab_size)
