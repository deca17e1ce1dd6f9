"""The Llama-family decoder as per-layer steps, so prefill and decode can drive attention
through the KV hierarchy (``engine.decode.attention``) between the projections.

Shapes: T tokens, H hidden, Hq/Hkv heads, D head dim, F FFN width, V vocab.
Math as in Hugging Face ``LlamaForCausalLM`` (RMSNorm, SwiGLU MLP, rotate-half RoPE);
Qwen2 adds q/k/v biases, Qwen3 a per-head RMSNorm of q and k before RoPE
(``Qwen3Attention``: ``q_norm`` / ``k_norm`` over D). Built through
:func:`engine.model.registry.build_model`, which maps architectures to this family.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.model.rope import Rope, apply_rope
from engine.weights.quant import DenseLinear, Linear, make_linear
from engine.weights.types import ModelWeights
from kernels.rmsnorm import rms_norm_ref
from kernels.rope_append import RopeParams


@dataclass
class Layer:
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    wqkv: Linear
    wo: Linear
    w_gate_up: Linear
    w_down: Linear
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) computed in float32, returned in ``x.dtype``
    (:func:`kernels.rmsnorm.rms_norm_ref` without a residual)."""
    return rms_norm_ref(x, weight, eps)[0]


def _swiglu_unfused(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` as torch's two element-wise ops (the CPU path; in float32 equal
    to :func:`kernels.swiglu.swiglu_ref`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _cat_weights(ws, dtype_like):
    """Concatenate linear weights along N (fused qkv / gate-up). Int4 kept as Int4."""
    from engine.weights.quant import Int4Weight

    if all(isinstance(w, Int4Weight) for w in ws) and len({w.group_size for w in ws}) == 1:
        return Int4Weight(
            torch.cat([w.q for w in ws]),
            torch.cat([w.scale for w in ws]),
            torch.cat([w.offset for w in ws]),
            ws[0].group_size,
        )
    return torch.cat([w.dequantize() if isinstance(w, Int4Weight) else w.float() for w in ws])


def _norm_on(w: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if w is None else w.to(device, torch.float32)


class LlamaModel:
    """Weights placed on ``device`` in compute ``dtype`` and the per-layer math.

    Parameters
    ----------
    weights : source weights (consumed)
    device : compute device; dtype : activation dtype (float32 on CPU, bfloat16 on CUDA)
    weight_format : ``float`` or ``int4`` (see :func:`engine.weights.quant.make_linear`)
    rope : the RoPE table (carries any context-extension scaling)
    layers : the decoder layers to place (a pipeline stage), default all. The token
        embedding is placed only with layer 0, the final norm and LM head only with the
        last layer (``None`` otherwise). Methods take global layer indices.
    int4_triton_min_rows : for ``int4`` on CUDA, the fewest decode rows run by the Triton
        kernels; below it torch's tinygemm, whose packed copy of every weight is kept only
        then (:class:`engine.weights.quant.Int4Linear`); ``None``: its default
    use_triton : the norms (residual add fused) as :func:`kernels.rmsnorm.rms_norm`;
        ``None`` picks Triton exactly on CUDA (as :func:`kernels.dispatch.get_ops`), the
        reference :func:`kernels.rmsnorm.rms_norm_ref` (the unfused ops) elsewhere

    Attributes
    ----------
    rope_params : the RoPE table as :class:`kernels.rope_append.RopeParams` on ``device``,
        for the decode step's fused RoPE + append (``qkv(..., rotate=False)``)
    """

    fused_rope = True
    """Whether :meth:`qkv` takes ``rotate=False`` (the decode step then rotates q and k in
    its append, :func:`kernels.rope_append.rope_append`, with :attr:`rope_params`)."""

    def __init__(
        self,
        weights: ModelWeights,
        device: torch.device,
        dtype: torch.dtype,
        weight_format: str,
        rope: Rope,
        layers: range | None = None,
        use_triton: bool | None = None,
        int4_triton_min_rows: int | None = None,
    ):
        self.config: ModelConfig = weights.config
        self.device = device
        self.dtype = dtype
        self.rope = rope
        self.rope_params = RopeParams(
            rope.inv_freq.to(device), rope.position_divisor, rope.attention_factor
        )
        if use_triton is None:
            use_triton = torch.device(device).type == "cuda"
        if use_triton:
            from kernels.rmsnorm import rms_norm as norm
            from kernels.swiglu import swiglu

            self._swiglu = swiglu
        else:
            norm = rms_norm_ref
            self._swiglu = _swiglu_unfused
        self._norm = norm
        cfg = self.config
        self.layer_range = layers if layers is not None else range(cfg.num_layers)
        first = self.layer_range.start == 0
        last = self.layer_range.stop == cfg.num_layers
        self.embed = weights.embed.to(device, dtype) if first else None
        self.norm = weights.norm.to(device, torch.float32) if last else None
        head = weights.lm_head if weights.lm_head is not None else weights.embed
        if last and weights.lm_head is None and self.embed is not None:
            # tied: the head reads the placed embedding (one device copy, not two)
            self.lm_head = DenseLinear(self.embed)
        else:
            self.lm_head = make_linear(head, None, "float", device, dtype) if last else None
        self.layers: list[Layer] = []
        int4 = {} if int4_triton_min_rows is None else {"triton_min_rows": int4_triton_min_rows}
        for lw in weights.layers[self.layer_range.start : self.layer_range.stop]:
            bias = None
            if lw.bq is not None:
                bias = torch.cat([lw.bq, lw.bk, lw.bv]).float()
            self.layers.append(
                Layer(
                    attn_norm=lw.attn_norm.to(device, torch.float32),
                    ffn_norm=lw.ffn_norm.to(device, torch.float32),
                    wqkv=make_linear(
                        _cat_weights([lw.wq, lw.wk, lw.wv], dtype), bias, weight_format, device, dtype, **int4
                    ),
                    wo=make_linear(lw.wo, None, weight_format, device, dtype, **int4),
                    w_gate_up=make_linear(
                        _cat_weights([lw.w_gate, lw.w_up], dtype), None, weight_format, device, dtype, **int4
                    ),
                    w_down=make_linear(lw.w_down, None, weight_format, device, dtype, **int4),
                    q_norm=_norm_on(lw.q_norm, device),
                    k_norm=_norm_on(lw.k_norm, device),
                )
            )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.attn_softcap: float | None = None  # attention logit soft-cap (Gemma 2)

    def attn_window(self, i: int) -> int | None:
        """Layer ``i``'s sliding window in tokens, ``None`` for full causal attention."""
        return None

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights on the compute device."""
        total = sum(t.nbytes for t in (self.embed, self.norm) if t is not None)
        embed_ptr = self.embed.data_ptr() if self.embed is not None else None
        if self.lm_head is not None and self.lm_head.weight.data_ptr() != embed_ptr:
            total += self.lm_head.nbytes
        for layer in self.layers:
            total += layer.attn_norm.nbytes + layer.ffn_norm.nbytes
            total += sum(n.nbytes for n in (layer.q_norm, layer.k_norm) if n is not None)
            total += sum(x.nbytes for x in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down))
        return total

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[T]`` -> ``[T, H]``."""
        return self.embed[ids.to(self.device)]

    def qkv(
        self, i: int, h: torch.Tensor, positions: torch.Tensor, rotate: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``i``'s attention inputs for hidden ``h [T, H]`` at ``positions [T]``.

        Returns q ``[T, Hq, D]``, k ``[T, Hkv, D]`` (both after RoPE), v ``[T, Hkv, D]``.
        With ``rotate=False`` q and k are returned before RoPE, as views of the fused qkv
        projection (the decode step rotates them in its append:
        :func:`kernels.rope_append.rope_append` with :attr:`rope_params`).
        """
        cfg = self.config
        layer = self.layers[i - self.layer_range.start]
        x, _ = self._norm(h, layer.attn_norm, cfg.rms_norm_eps)
        qkv = layer.wqkv(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = h.shape[0]
        q = q.reshape(t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        if layer.q_norm is not None:  # Qwen3: per-head RMSNorm over D before RoPE
            q, _ = self._norm(q, layer.q_norm, cfg.rms_norm_eps)
            k, _ = self._norm(k, layer.k_norm, cfg.rms_norm_eps)
        if not rotate:
            return q, k, v
        cos, sin = self.rope.cos_sin(positions.to(self.device), h.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish_layer(self, i: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection, residual and MLP: ``h [T, H]``, ``attn [T, Hq, D]`` -> ``[T, H]``."""
        layer = self.layers[i - self.layer_range.start]
        o = layer.wo(attn.reshape(h.shape[0], -1).to(h.dtype))
        x, h = self._norm(o, layer.ffn_norm, self.config.rms_norm_eps, h)  # h + o, fused
        return h + layer.w_down(self._swiglu(layer.w_gate_up(x)))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: ``[B, H]`` -> float32 ``[B, V]``."""
        return self.lm_head(self._norm(h, self.norm, self.config.rms_norm_eps)[0]).float()


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of a chunk over its prefix (torch SDPA).

    The first chunk is plain causal attention. A later chunk's queries see every key up
    to their own position: causal attention aligned to the bottom right of the
    ``[Tc, start + Tc]`` score matrix. On CUDA that runs in the flash kernel
    (``torch.nn.attention.bias.causal_lower_right``) instead of the memory-efficient one
    over a materialised ``[Tc, start + Tc]`` boolean mask (:func:`_flash_lower_right`);
    elsewhere, and should the kernel refuse the inputs, with the explicit mask.

    Parameters
    ----------
    q : ``[Tc, Hq, D]`` queries at positions ``start .. start + Tc - 1``
    k, v : ``[start + Tc, Hkv, D]`` keys/values of positions ``0 .. start + Tc - 1``
    scale : softmax scale (``None``: ``D ** -0.5``)
    softcap : attention logits become ``softcap * tanh(logits / softcap)`` (Gemma 2;
        computed by :func:`_masked_attention`, not SDPA)
    window : sliding window: a query at position ``p`` sees keys ``p - window < j <= p``
        (transformers ``sliding_window_overlay``); ``None``: all earlier keys

    Returns
    -------
    ``[Tc, Hq, D]``
    """
    if softcap or window:
        return _masked_attention(q, k, v, start, scale, softcap, window)
    tc = q.shape[0]
    # 4-D [1, H, T, D] inputs: torch's CPU flash kernel only takes batched inputs.
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if start == 0:
        out = F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, enable_gqa=True, scale=scale
        )
        return out[0].transpose(0, 1)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _LOWER_RIGHT_FLASH[0]:
        try:
            out = _flash_lower_right(qh, kh, vh, scale)
            return out[0].transpose(0, 1)
        except RuntimeError:  # shapes or dtypes the flash kernel refuses: the mask below
            _LOWER_RIGHT_FLASH[0] = False
    pos_q = torch.arange(start, start + tc, device=q.device)
    pos_k = torch.arange(start + tc, device=q.device)
    mask = pos_k[None, :] <= pos_q[:, None]
    out = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, enable_gqa=True, scale=scale
    )
    return out[0].transpose(0, 1)


_LOWER_RIGHT_FLASH = [True]
"""Whether :func:`prefill_attention` still tries the flash kernel for later chunks (set
False once the library refused it in this process)."""


def _flash_lower_right(
    qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """``[1, Hq, Lq, D]`` bottom-right-aligned causal attention of ``qh`` over
    ``kh, vh [1, Hkv, Lk, D]`` (``Hq`` a multiple of ``Hkv``), in the flash kernel.

    Calls the op that ``torch.nn.attention.bias.causal_lower_right`` dispatches to
    (``aten._scaled_dot_product_flash_attention``, whose ``is_causal`` means lower right
    when ``Lq < Lk``) directly: the public path checks GQA inputs against
    ``enable_gqa``, which it does not pass on, and would fall back to a materialised mask
    or repeated K/V heads. The flash kernel takes ``Hkv`` dividing ``Hq`` natively.

    Raises
    ------
    RuntimeError
        From the kernel when it does not take the inputs (dtype, head size, device).
    """
    return torch.ops.aten._scaled_dot_product_flash_attention(
        qh, kh, vh, 0.0, is_causal=True, return_debug_mask=False, scale=scale
    )[0]


# Query rows per block of the soft-capped path: Hq x rows x keys fp32 logits stay ~256 MiB.
_LOGIT_ELEMENTS = 1 << 26


def _masked_attention(q, k, v, start, scale, softcap, window) -> torch.Tensor:
    """:func:`prefill_attention` with a sliding window and/or soft-capped logits: keys
    before the chunk's first window are dropped, then SDPA with a boolean mask (window
    only) or an explicit fp32 softmax over query blocks (soft-cap; as transformers'
    ``eager_attention_forward``: scale, cap, mask, softmax)."""
    tc, hq, d = q.shape
    hkv = k.shape[1]
    scale = d**-0.5 if scale is None else scale
    k0 = max(0, start - window + 1) if window else 0
    k, v = k[k0:], v[k0:]
    pos_k = torch.arange(k0, k0 + k.shape[0], device=q.device)
    pos_q = torch.arange(start, start + tc, device=q.device)
    mask = pos_k[None, :] <= pos_q[:, None]
    if window:
        mask &= pos_k[None, :] > pos_q[:, None] - window
    if not softcap:
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, enable_gqa=True, scale=scale
        )
        return out[0].transpose(0, 1)
    g = hq // hkv
    kf = k.float().permute(1, 0, 2)  # [Hkv, Tk, D]
    vf = v.float().permute(1, 0, 2)
    out = torch.empty(tc, hq, d, dtype=q.dtype, device=q.device)
    rows = max(1, _LOGIT_ELEMENTS // max(1, hq * k.shape[0]))
    for r in range(0, tc, rows):
        qb = q[r : r + rows].float().reshape(-1, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv,G,R,D]
        logits = torch.einsum("hgrd,htd->hgrt", qb, kf) * scale
        logits = softcap * torch.tanh(logits / softcap)
        logits = logits.masked_fill(~mask[r : r + rows][None, None], float("-inf"))
        o = torch.einsum("hgrt,htd->hgrd", logits.softmax(dim=-1), vf)
        out[r : r + rows] = o.permute(2, 0, 1, 3).reshape(-1, hq, d).to(q.dtype)
    return out
