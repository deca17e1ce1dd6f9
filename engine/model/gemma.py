"""The Gemma 2 / Gemma 3 (text) decoder: the Llama-family steps of :mod:`engine.model.llama`
with Gemma's differences, as in transformers ``modeling_gemma2`` / ``modeling_gemma3``:

* RMSNorm weights are ``1 + w`` (the loaders hand over the multiplier itself), and a layer
  has four of them: ``input_layernorm`` (``attn_norm``), ``post_attention_layernorm`` on
  the attention output (``post_attn_norm``), ``pre_feedforward_layernorm``
  (``ffn_norm``) and ``post_feedforward_layernorm`` on the MLP output
  (``post_ffn_norm``), each output norm applied before its residual add;
* the token embedding is multiplied by ``sqrt(H)`` (in the activation dtype, as
  ``Gemma2TextScaledWordEmbedding`` does);
* GeGLU MLP: ``down(gelu_tanh(gate(x)) * up(x))`` (``hidden_activation:
  gelu_pytorch_tanh``);
* softmax scale ``query_pre_attn_scalar ** -0.5``;
* Gemma 2: attention logits soft-capped (``attn_logit_softcapping``, applied by the
  attention ops) and output logits soft-capped (``final_logit_softcapping``), both as
  ``c * tanh(x / c)``;
* Gemma 3: per-head q/k RMSNorm (``1 + w``) before RoPE; sliding-window layers use RoPE
  base ``rope_local_theta`` (10 000) without scaling, the global layers ``rope_theta``
  with the model's scaling;
* sliding-window layers (``ModelConfig.sliding_layers``) attend to the last
  ``sliding_window`` positions only (:meth:`GemmaModel.attn_window`; prefill through
  :func:`engine.model.llama.prefill_attention`, decode through
  :class:`engine.decode.attention.DecodeAttention`).

Shapes as in :mod:`engine.model.llama`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.model.llama import LlamaModel, rms_norm
from engine.model.rope import Rope, apply_rope
from engine.weights.types import ModelWeights


class GemmaModel(LlamaModel):
    """Gemma 2 / 3 weights placed on ``device`` and their per-layer math (parameters as
    :class:`engine.model.llama.LlamaModel`).

    Raises
    ------
    ValueError
        A layer without its post-attention / post-feedforward norm.
    """

    fused_rope = False  # a sliding layer rotates with its local base: the unfused RoPE

    def __init__(
        self,
        weights: ModelWeights,
        device: torch.device,
        dtype: torch.dtype,
        weight_format: str,
        rope: Rope,
        layers: range | None = None,
        int4_triton_min_rows: int | None = None,
    ):
        cfg = weights.config
        start = (layers if layers is not None else range(cfg.num_layers)).start
        stop = (layers if layers is not None else range(cfg.num_layers)).stop
        post = []
        for i, lw in enumerate(weights.layers[start:stop], start):
            if lw.post_attn_norm is None or lw.post_ffn_norm is None:
                raise ValueError(f"{cfg.arch} layer {i}: missing post-attention/feedforward norm")
            post.append(
                (
                    lw.post_attn_norm.to(device, torch.float32),
                    lw.post_ffn_norm.to(device, torch.float32),
                )
            )
        super().__init__(
            weights, device, dtype, weight_format, rope, layers=layers,
            int4_triton_min_rows=int4_triton_min_rows,
        )
        self.post_norms = post
        self.scale = float(cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.attn_softcap = cfg.attn_softcap
        # on the device: no host->device copy per step (CUDA graph capture)
        self.embed_scale = torch.tensor(math.sqrt(cfg.hidden_size), dtype=dtype, device=device)
        self.sliding = frozenset(cfg.sliding_layers)
        self.local_rope = (
            Rope(cfg.head_dim, cfg.rope_local_theta) if cfg.rope_local_theta is not None else None
        )

    @property
    def weight_bytes(self) -> int:
        return super().weight_bytes + sum(a.nbytes + b.nbytes for a, b in self.post_norms)

    def attn_window(self, i: int) -> int | None:
        """``sliding_window`` for a sliding-window layer, ``None`` for a global one."""
        return self.config.sliding_window if i in self.sliding else None

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[T]`` -> ``[T, H]``, scaled by ``sqrt(H)``."""
        return self.embed[ids.to(self.device)] * self.embed_scale

    def qkv(
        self, i: int, h: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As :meth:`LlamaModel.qkv`; a Gemma 3 sliding-window layer rotates with its
        local RoPE base."""
        cfg = self.config
        layer = self.layers[i - self.layer_range.start]
        x = rms_norm(h, layer.attn_norm, cfg.rms_norm_eps)
        q, k, v = layer.wqkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = h.shape[0]
        q = q.reshape(t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        rope = self.local_rope if self.local_rope is not None and i in self.sliding else self.rope
        cos, sin = rope.cos_sin(positions.to(self.device), h.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish_layer(self, i: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection, post-attention norm, residual; pre-norm, GeGLU MLP,
        post-feedforward norm, residual: ``h [T, H]``, ``attn [T, Hq, D]`` -> ``[T, H]``."""
        eps = self.config.rms_norm_eps
        local = i - self.layer_range.start
        layer = self.layers[local]
        post_attn, post_ffn = self.post_norms[local]
        a = layer.wo(attn.reshape(h.shape[0], -1).to(h.dtype))
        h = h + rms_norm(a, post_attn, eps)
        x = rms_norm(h, layer.ffn_norm, eps)
        gate, up = layer.w_gate_up(x).chunk(2, dim=-1)
        m = layer.w_down(F.gelu(gate, approximate="tanh") * up)
        return h + rms_norm(m, post_ffn, eps)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head and the final soft-cap: ``[B, H]`` -> float32 ``[B, V]``."""
        out = super().logits(h)
        cap = self.config.final_softcap
        return cap * torch.tanh(out / cap) if cap else out
