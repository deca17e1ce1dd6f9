"""Source weights of a Llama-family model, as read from a checkpoint (before placement).

Linear weights are float ``[N, K]`` tensors or :class:`engine.weights.quant.Int4Weight`;
norms, biases and embeddings are float32 tensors. Names follow the Hugging Face layout
(``wq`` = ``q_proj`` ...). Q and K rows are in Hugging Face order (rotate-half RoPE).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from engine.config import ModelConfig
from engine.weights.placement import (
    INT4_SOURCE_FORMATS,  # noqa: F401 - re-exported
    linears_stored_int4,  # noqa: F401 - re-exported
)
from engine.weights.placement import LINEAR_NAME as _LINEAR_NAME
from engine.weights.placement import is_int4 as _is_int4
from engine.weights.quant import Int4Weight

WeightT = torch.Tensor | Int4Weight

LINEAR_NAMES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@dataclass
class LayerWeights:
    """One decoder layer. Shapes: wq ``[Hq*D, H]``, wk/wv ``[Hkv*D, H]``, wo ``[H, Hq*D]``,
    w_gate/w_up ``[F, H]``, w_down ``[H, F]``, norms ``[H]``, biases ``[N]``; q_norm /
    k_norm ``[D]`` per-head RMSNorm weights of q and k (Qwen3, Gemma 3), ``None``
    otherwise; post_attn_norm / post_ffn_norm ``[H]``: Gemma 2/3's norms of the attention
    and MLP outputs before their residual adds (``ffn_norm`` is then its
    ``pre_feedforward_layernorm``). Every norm weight is the multiplier itself: Gemma's
    ``1 + w`` is added by the loader (Hugging Face) or was by llama.cpp's converter (GGUF)."""

    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    wq: WeightT
    wk: WeightT
    wv: WeightT
    wo: WeightT
    w_gate: WeightT
    w_up: WeightT
    w_down: WeightT
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None


@dataclass
class ModelWeights:
    """A whole model: ``embed [V, H]`` (float32), ``lm_head`` (``None`` when tied),
    final ``norm [H]``, and the layers. ``formats`` records each tensor's source type
    (e.g. ``Q4_1``) for reporting."""

    config: ModelConfig
    embed: torch.Tensor
    norm: torch.Tensor
    layers: list[LayerWeights]
    lm_head: WeightT | None = None
    formats: dict[str, str] = field(default_factory=dict)


def unpermute_qk_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """Row index that undoes llama.cpp's Q/K permutation.

    ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) reorders each head's rows from the
    rotate-half layout to interleaved pairs: ``w.reshape(H, 2, D/2, ...).swapaxes(1, 2)``.
    Applying the returned index to GGUF rows gives back the Hugging Face order.
    """
    d = num_rows // num_heads
    hf = torch.arange(num_rows).view(num_heads, 2, d // 2)
    gguf_order = hf.transpose(1, 2).reshape(-1)  # gguf row r holds hf row gguf_order[r]
    inverse = torch.empty_like(gguf_order)
    inverse[gguf_order] = torch.arange(num_rows)
    return inverse


def split_rows(w: WeightT, sizes: list[int]) -> list[WeightT]:
    """Split a fused linear ``[sum(sizes), K]`` into ``[sizes[i], K]`` parts along N (Phi-3's
    ``qkv_proj`` into q, k, v and ``gate_up_proj`` into gate, up: transformers'
    ``Phi3Attention`` / ``Phi3MLP`` slice them that way). Exact for :class:`Int4Weight`
    too (rows are whole groups).

    Raises
    ------
    ValueError
        ``sum(sizes)`` is not the weight's row count.
    """
    n = w.shape[0]
    if sum(sizes) != n:
        raise ValueError(f"cannot split {n} rows into {sizes}")
    if isinstance(w, Int4Weight):
        bounds = [0]
        for size in sizes:
            bounds.append(bounds[-1] + size)
        return [w.permute_rows(torch.arange(a, b)) for a, b in zip(bounds, bounds[1:], strict=False)]
    return [part.contiguous() for part in w.split(sizes)]


def describe_placement(formats: dict[str, str], weight_format: str, dtype: str) -> str:
    """One line saying what each source tensor type became, for the run's model line.

    Parameters
    ----------
    formats : ``ModelWeights.formats`` (tensor or module name -> source type: ``Q4_K``,
        ``Q6_K``, ``F32``, ``BF16``, ``int4-g64`` ...)
    weight_format : the placement, ``int4`` or ``float``
    dtype : compute dtype name (``float32``, ``bfloat16``)

    Returns
    -------
    e.g. ``"linears: Q4_K x154 -> int4 as stored; Q6_K x14 -> re-quantised to int4;
    other: F32 x61, Q6_K x1 -> float"``
    """

    def counts(names: list[str]) -> str:
        c = Counter(formats[n] for n in names)
        return ", ".join(f"{k} x{v}" for k, v in sorted(c.items()))

    linears = [n for n in formats if _LINEAR_NAME.match(n)]
    other = [n for n in formats if n not in set(linears)]
    kept = [n for n in linears if _is_int4(formats[n])]
    rest = [n for n in linears if not _is_int4(formats[n])]
    parts = []
    if kept:
        to = "int4 as stored" if weight_format == "int4" else f"dequantised to {dtype}"
        parts.append(f"{counts(kept)} -> {to}")
    if rest:
        to = "re-quantised to int4" if weight_format == "int4" else f"{dtype} (exact decode)"
        parts.append(f"{counts(rest)} -> {to}")
    line = "linears: " + "; ".join(parts) if parts else ""
    if other:
        line += ("; " if line else "") + f"other: {counts(other)} -> float"
    return line
