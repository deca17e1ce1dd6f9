"""Source weights of a Llama-family model, as read from a checkpoint (before placement).

Linear weights are float ``[N, K]`` tensors or :class:`engine.weights.quant.Int4Weight`;
norms, biases and embeddings are float32 tensors. Names follow the Hugging Face layout
(``wq`` = ``q_proj`` ...). Q and K rows are in Hugging Face order (rotate-half RoPE).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.config import ModelConfig
from engine.weights.quant import Int4Weight

WeightT = torch.Tensor | Int4Weight

LINEAR_NAMES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@dataclass
class LayerWeights:
    """One decoder layer. Shapes: wq ``[Hq*D, H]``, wk/wv ``[Hkv*D, H]``, wo ``[H, Hq*D]``,
    w_gate/w_up ``[F, H]``, w_down ``[H, F]``, norms ``[H]``, biases ``[N]``; q_norm /
    k_norm ``[D]`` per-head RMSNorm weights of q and k (Qwen3), ``None`` otherwise."""

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
