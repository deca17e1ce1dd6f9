"""4-bit weights and the linear layers that use them.

One representation covers every 4-bit source: :class:`Int4Weight` holds, for a weight
``W [N, K]``, nibbles ``q`` in 0..15 and per-group ``scale`` and ``offset`` such that

    W[n, k] = scale[n, k // g] * q[n, k] + offset[n, k // g]

* GGUF Q4_1 (blocks of 32: fp16 ``d``, fp16 ``m``, 16 bytes of nibbles): scale = d, offset = m.
* GGUF Q4_0 (blocks of 32: fp16 ``d``, 16 bytes): scale = d, offset = -8 d.
* GGUF Q4_K (super-blocks of 256: fp16 ``d``, fp16 ``dmin``, 12 bytes of eight 6-bit
  scales ``sc`` and mins ``m``, 128 bytes of nibbles): each 32-element sub-block ``s`` is
  ``d * sc[s] * q - dmin * m[s]``, so group 32 with scale = d * sc[s] and
  offset = -(dmin * m[s]) (both computed in float32, as gguf-py does: exact).
* Float checkpoints: asymmetric min/max group quantisation, scale = (max - min) / 15,
  offset = min, q = round((W - min) / scale) (group 128 by default, as gpt-fast does).

Block layouts: ggml ``ggml-common.h`` (``block_q4_0``, ``block_q4_1``): element ``j`` of a
block is the low nibble of byte ``j`` for j < 16 and the high nibble of byte ``j - 16``.
``block_q4_K`` (``dequantize_row_q4_K`` in ``ggml-quants.c``): element ``64 c + l`` of a
super-block is the low nibble of byte ``32 c + l`` and element ``64 c + 32 + l`` its high
nibble (c < 4, l < 32); the 6-bit scale/min unpacking is gguf-py's
``gguf.quants.Q4_K.get_scale_min`` (``get_scale_min_k4``).

Compute formats (:func:`make_linear`):
* ``float``: dequantise once to the compute dtype (exact values of the 4-bit blocks;
  fastest on CPUs without a fast int4 GEMM).
* ``int4``: torch's own int4 kernels (``aten._weight_int4pack_mm`` on CUDA,
  ``aten._weight_int4pack_mm_for_cpu`` on CPU) with ``scales_and_zeros[K/g, N, 2]`` where
  ``W = (q - 8) * scale + zero``, i.e. ``zero = offset + 8 * scale``; on CUDA, decode
  batches of 8-63 rows use a Triton dequant-matmul and prefill a dense GEMM
  (:class:`Int4Linear`). On a CPU with bf16 instructions (:func:`cpu_fast_bf16`) the
  engine runs the CPU kernel with bf16 activations whatever the compute dtype
  (:meth:`Int4Linear.set_activation_dtype` from :func:`engine.load.place_model`): the
  input is rounded to bf16
  at the product only (as llama.cpp rounds activations to 8 bits for its Q4_1 dot
  products); the residual stream, norms and attention stay in the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.weights.placement import (
    cpu_fast_bf16,
    cpu_int4_dtype_name,
    lm_head_key,
    read_lm_head_records,
    requant_group_size,
    write_lm_head_record,
)


@dataclass(frozen=True)
class Int4Weight:
    """A group-quantised 4-bit weight.

    q : uint8 ``[N, K // 2]``, two nibbles per byte: element ``2i`` low, ``2i + 1`` high
    scale, offset : float32 ``[N, K // g]``
    group_size : g (32 for GGUF blocks)
    """

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * 2

    def nibbles(self) -> torch.Tensor:
        """int32 ``[N, K]`` values 0..15."""
        lo = (self.q & 0x0F).to(torch.int32)
        hi = (self.q >> 4).to(torch.int32)
        return torch.stack([lo, hi], dim=-1).reshape(self.q.shape[0], -1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[N, K]`` float weight, computed in float32 then cast."""
        n, k = self.shape
        g = self.group_size
        w = self.nibbles().float().view(n, k // g, g)
        w = w * self.scale[:, :, None] + self.offset[:, :, None]
        return w.view(n, k).to(dtype)

    def permute_rows(self, index: torch.Tensor) -> Int4Weight:
        """Reorder output rows (exact: rows are whole groups)."""
        return Int4Weight(self.q[index], self.scale[index], self.offset[index], self.group_size)


def _nibbles_to_bytes(values: torch.Tensor) -> torch.Tensor:
    """int ``[N, K]`` in 0..15 -> uint8 ``[N, K // 2]`` (element 2i low nibble)."""
    v = values.to(torch.uint8).view(values.shape[0], -1, 2)
    return v[..., 0] | (v[..., 1] << 4)


def int4_from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Int4Weight:
    """Read GGUF Q4_0 / Q4_1 / Q4_K blocks without re-quantising (group size 32).

    Parameters
    ----------
    raw : uint8 ``[N, (K/32) * block_bytes]`` as ``gguf.GGUFReader`` returns it
        (Q4_K: ``[N, (K/256) * 144]``)
    type_name : ``"Q4_0"`` (18-byte blocks), ``"Q4_1"`` (20-byte blocks) or ``"Q4_K"``
        (144-byte super-blocks of 256)
    shape : ``(N, K)``

    Raises
    ------
    ValueError
        For another type or a shape that is not whole blocks.
    """
    n, k = shape
    if type_name == "Q4_K":
        return _int4_from_q4_k(raw, shape)
    if k % 32:
        raise ValueError(f"{type_name} tensor with K={k} is not a multiple of 32")
    head = {"Q4_0": 2, "Q4_1": 4}.get(type_name)
    if head is None:
        raise ValueError(f"not a 4-bit GGUF type: {type_name}")
    blocks = np.ascontiguousarray(raw).reshape(n, k // 32, head + 16)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q4_1":
        m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        m = -8.0 * d
    qs = torch.from_numpy(blocks[:, :, head:].copy())  # [N, K/32, 16]
    vals = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, k)  # element order j, j+16
    return Int4Weight(
        _nibbles_to_bytes(vals), torch.from_numpy(d), torch.from_numpy(m), group_size=32
    )


Q4_K_BLOCK, Q4_K_BYTES = 256, 144


def _int4_from_q4_k(raw: np.ndarray, shape: tuple[int, int]) -> Int4Weight:
    """GGUF ``block_q4_K`` super-blocks -> :class:`Int4Weight` of group 32 (exact; see the
    module docstring). Kept here rather than through ``gguf.quants.dequantize`` because
    that returns floats, and the 4-bit codes and per-group scale/offset are what the int4
    kernels need."""
    import gguf

    n, k = shape
    if k % Q4_K_BLOCK:
        raise ValueError(f"Q4_K tensor with K={k} is not a multiple of {Q4_K_BLOCK}")
    nb = k // Q4_K_BLOCK
    blocks = np.ascontiguousarray(raw).reshape(n * nb, Q4_K_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n*nb, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [n*nb, 8] each
    scale = d * sc.astype(np.float32)
    offset = -(dmin * m.astype(np.float32))
    qs = torch.from_numpy(blocks[:, 16:].copy()).view(n * nb, 4, 32)  # [.., chunk, byte]
    vals = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(n, k)  # chunk: 32 low, 32 high
    return Int4Weight(
        _nibbles_to_bytes(vals),
        torch.from_numpy(scale.reshape(n, k // 32)),
        torch.from_numpy(offset.reshape(n, k // 32)),
        group_size=32,
    )


def quantize_int4(weight: torch.Tensor, group_size: int = 128) -> Int4Weight:
    """Asymmetric min/max group quantisation of a float weight ``[N, K]`` to 4 bits.

    Raises
    ------
    ValueError
        If K is not a multiple of ``group_size``.
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of group_size={group_size}")
    w = weight.float().view(n, k // group_size, group_size)
    lo = w.amin(-1)
    hi = w.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).view(n, k)
    return Int4Weight(_nibbles_to_bytes(q), scale, lo, group_size)


INT4_GROUP_SIZES = (32, 64, 128, 256)  # group sizes torch's int4 kernels accept (Int4Linear)
DEQUANT_MIN_ROWS = 64
# Decode batches of TRITON_MIN_ROWS..DEQUANT_MIN_ROWS-1 rows on CUDA run the Triton kernels
# over the source weight (kernels.int4_matmul.group_int4_linear), fewer rows torch's
# tinygemm over a second, packed copy of the weight. Default 1: Triton for every decode
# batch and no packed copy, 0.53-0.625 B/param less device memory (45 % of a GGUF model's
# int4 weight bytes at group 32). The cost is speed below 8 rows, where tinygemm is faster
# (1 x H200, 2026-12-02, qwen2.5-7b's four decode linears at group 128, mean µs per linear,
# tinygemm / Triton: 20.8 / 29.1 at one row (the "gemv" kernel), 28.8 / 32.0 at four;
# 45.4 / 32.1 at eight): in the engine 12-14 % slower steps at 1 and 4 jobs of 256K
# (scripts/bench_kernels.py --sections int4_decode and the qwen2.5-7b bench,
# docs/performance.md "One int4 copy on the GPU"). EngineConfig.int4_triton_min_rows
# (presets, environment HISPARSE_INT4_TRITON_MIN_ROWS) sets it; the h200 presets, with
# memory to spare, set 8.
TRITON_MIN_ROWS = 1


def cpu_int4_dtype(dtype: torch.dtype) -> torch.dtype:
    """Activation dtype of torch's CPU int4 kernel for a model computing in ``dtype``:
    bf16 where :func:`cpu_fast_bf16`, else ``dtype``
    (:func:`engine.weights.placement.cpu_int4_dtype_name`)."""
    name = cpu_int4_dtype_name(str(dtype).removeprefix("torch."), cpu_fast_bf16())
    return getattr(torch, name)


class Linear:
    """``y = x @ W.T (+ b)`` for ``x [M, K]`` -> ``[M, N]``; subclasses choose the format."""

    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        raise NotImplementedError


class DenseLinear(Linear):
    """Float weight ``[N, K]`` (and bias ``[N]``) in the compute dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        extra = self.bias.nbytes if self.bias is not None else 0
        return self.weight.nbytes + extra


class CastLinear(DenseLinear):
    """A float weight ``[N, K]`` stored in a narrower ``dtype`` (bf16 / fp16) than the
    compute dtype: ``x`` is rounded to ``dtype`` for the product and the output, computed in
    ``dtype`` (float32 accumulation inside the GEMM) and returned in ``x.dtype``.

    The CPU LM head's option (:func:`engine.load.place_model`): a one-row GEMV over the
    49152 x 576 tied embedding reads half the bytes of float32. Its cost is the rounding
    of the weights, the activations and the logits to ``dtype`` (fp16: 11-bit significand,
    bf16: 8), measured against llama.cpp by ``scripts/check_cpu_fidelity.py --heads``.
    """

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        super().__init__(weight.to(dtype).contiguous())
        self.dtype = dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.dtype), self.weight).to(x.dtype)


def pick_cpu_lm_head(head: DenseLinear, repeats: int = 3, gain: float = 0.8) -> tuple[Linear, str]:
    """The CPU LM head of a model whose linears already run with bf16 products: ``head``
    (float32 ``[V, H]``) kept, or an fp16 copy (:class:`CastLinear`) where this machine
    runs the one-row product in fp16 faster.

    Why fp16 and not bf16 or int8: on the embedded model's tied Q8_0 embedding
    (``scripts/check_cpu_fidelity.py --heads engine float32 bf16 fp16``; docs/performance.md,
    "CPU decode: one chain a layer, fp16 LM head") fp16 left KL to llama.cpp's logits within
    1% of the float32 head's (KL between the two 7e-6 nats), where bf16 added 19% and an
    int8 per-row head 85% (an earlier run of the same script). Why timed: the fp16 head's
    speed was measured on one CPU only (an AVX512-BF16 EPYC without AVX512-FP16: 1.4 vs
    7.5 ms a step, ``scripts/bench_cpu_llamacpp.py --profile-steps``), torch's CPU fp16 GEMV
    speed on other CPUs is not something a feature flag reports, so the load measures
    instead of assuming. The two heads' outputs differ by that 7e-6 nats, so a probe that
    flips on a noisy box changes speed, not answers measurably.

    Returns ``(linear, note)``: the head to use and a model-line note of what was measured
    (best of ``repeats`` one-row products each, fp16 kept when at most ``gain`` of the
    float32 time). The choice is measured once per machine, torch version and head shape,
    and kept in :func:`engine.weights.placement.lm_head_record_path` (and per process in
    :data:`_LM_HEAD_CHOICES`):
    the fp16 head's logits differ from float32's by about 0.01, enough to flip a near tie of
    greedy decoding, so a choice timed anew at every load would let the same command answer
    differently on a busy and on an idle machine (two engines loaded side by side on a busy
    box did measure differently). Raises nothing: a head that is not float32 is returned as
    it is; a record that cannot be read or written is measured again or not kept.
    """
    import time

    w = head.weight
    if w.dtype != torch.float32 or w.device.type != "cpu" or head.bias is not None:
        return head, ""
    half = CastLinear(w, torch.float16)
    known = _LM_HEAD_CHOICES.get(tuple(w.shape))
    key = _lm_head_key(tuple(w.shape))
    if known is None:
        recorded = _read_lm_head_records().get(key)
        if isinstance(recorded, dict) and isinstance(recorded.get("fp16"), bool):
            known = (recorded["fp16"], f"{recorded.get('note', '')} on this machine before)")
            _LM_HEAD_CHOICES[tuple(w.shape)] = known
    if known is not None:
        use_half, note = known
        return (half if use_half else head), note
    x = torch.randn(1, w.shape[1], dtype=torch.float32)

    def best_ms(lin: Linear) -> float:
        lin(x)  # warm-up (first-call allocations and kernel selection)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            lin(x)
            times.append(time.perf_counter() - t0)
        return min(times) * 1e3

    with torch.inference_mode():
        t32, t16 = best_ms(head), best_ms(half)
    if t16 <= gain * t32:
        note = f"; LM head fp16 ({t16:.1f} vs {t32:.1f} ms float32, measured)"
    else:
        note = f"; LM head float32 (fp16 {t16:.1f} vs {t32:.1f} ms, measured)"
    _LM_HEAD_CHOICES[tuple(w.shape)] = (t16 <= gain * t32, note)
    _write_lm_head_record(key, {"fp16": t16 <= gain * t32, "note": note.rstrip(")")})
    return (half if t16 <= gain * t32 else head), note


_LM_HEAD_CHOICES: dict[tuple[int, ...], tuple[bool, str]] = {}
""":func:`pick_cpu_lm_head`'s measured choice per head shape ``(V, H)``: fp16 or not, and
its note."""


def _lm_head_key(shape: tuple[int, ...]) -> str:
    """The record's key (:func:`engine.weights.placement.lm_head_key`) under this torch."""
    return lm_head_key(shape, torch.__version__)


_read_lm_head_records = read_lm_head_records
_write_lm_head_record = write_lm_head_record


class Int4Linear(Linear):
    """4-bit weight run by torch's int4 kernels (``_weight_int4pack_mm[_for_cpu]``).

    On CUDA by the number of rows ``M`` of ``x``: ``M < triton_min_rows`` tinygemm (over a
    packed copy kept only when ``triton_min_rows > 1``); ``triton_min_rows <= M <
    DEQUANT_MIN_ROWS`` the Triton dequant-matmul over the source weight kept on the device
    (:func:`kernels.int4_matmul.group_int4_linear`); larger ``M`` (prefill) dequantises the
    source to the compute dtype and runs the dense GEMM. ``triton_min_rows``: see
    :data:`TRITON_MIN_ROWS` (default 1: no tinygemm, one copy of the weight). On CPU
    ``_weight_int4pack_mm_for_cpu`` in ``dtype`` below ``DEQUANT_MIN_ROWS`` rows
    (decode; bf16 where the CPU has bf16 instructions, :func:`cpu_int4_dtype`: with fp32
    activations that kernel was 4-30x slower, see docs/performance.md, "CPU decode path"),
    the dense GEMM over the weight dequantised to ``dtype`` from there on (prefill: the
    int4 kernel was ~2x slower than the GEMM there).

    Supported group sizes: 32, 64, 128, 256. ``dtype``: the kernels' activation dtype
    (bf16 on CUDA; bf16 or fp32 on CPU); ``x`` of another dtype is cast to it for the
    product and the output cast back: the output has the dtype of ``x``.
    """

    def __init__(
        self,
        w: Int4Weight,
        bias: torch.Tensor | None,
        device: torch.device,
        dtype,
        triton_min_rows: int = TRITON_MIN_ROWS,
    ):
        self.out_features, self.in_features = w.shape
        self.group_size = w.group_size
        self.device = device
        self.dtype = dtype
        zero = w.offset + 8 * w.scale
        sz = torch.stack([w.scale, zero], dim=-1).transpose(0, 1).contiguous()  # [K/g, N, 2]
        if triton_min_rows < 1:
            raise ValueError(f"triton_min_rows must be at least 1, got {triton_min_rows}")
        self.triton_min_rows = triton_min_rows  # EngineConfig.int4_triton_min_rows
        if device.type == "cuda":
            self.packed = None  # tinygemm's copy, only where it runs (rows < triton_min_rows)
            if triton_min_rows > 1:
                # CUDA packer: uint8 [N, K/2], element 2i in the high nibble (gpt-fast/torchao).
                nib = w.nibbles().to(device)
                hi_lo = ((nib[:, ::2] << 4) | nib[:, 1::2]).to(torch.uint8)
                k = self.in_features
                inner = next(t for t in (8, 4, 2) if k % (t * 16) == 0)
                self.packed = torch.ops.aten._convert_weight_to_int4pack(hi_lo, inner)
            # Large-M calls (prefill) dequantise to bf16 and use the dense GEMM, which beats
            # the int4 kernel from M ~ 64 (docs/performance.md, int4 verdict).
            self.source = Int4Weight(  # the Triton kernel reads rows with a unit stride
                *(t.to(device).contiguous() for t in (w.q, w.scale, w.offset)), w.group_size
            )
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.nibbles(), 1)
            self.source = w  # prefill (M >= DEQUANT_MIN_ROWS): the dense GEMM
        self.scales_and_zeros = sz.to(device, dtype) if self.packed is not None else None
        self.bias = bias.to(dtype) if bias is not None else None

    def set_activation_dtype(self, dtype: torch.dtype) -> None:
        """Run the kernels with ``dtype`` activations from now on: the scales, zeros and
        bias are cast from their current dtype (from float32, what the constructor with
        ``dtype`` gives). Inputs and outputs keep the caller's dtype."""
        if dtype == self.dtype:
            return
        if self.scales_and_zeros is not None:
            self.scales_and_zeros = self.scales_and_zeros.float().to(dtype)
        self.bias = self.bias.float().to(dtype) if self.bias is not None else None
        self.dtype = dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(self.dtype)
        rows = x2.shape[0]
        cuda = self.device.type == "cuda"
        if self.source is not None and rows >= DEQUANT_MIN_ROWS:
            y = F.linear(x2, self.source.dequantize(self.dtype), self.bias)
            return y.view(*shape[:-1], self.out_features).to(x.dtype)
        if cuda and rows >= self.triton_min_rows:
            from kernels.int4_matmul import group_int4_linear

            w = self.source
            y = group_int4_linear(x2, w.q, w.scale, w.offset, w.group_size)
        elif self.device.type == "cuda":
            y = torch.ops.aten._weight_int4pack_mm(
                x2, self.packed, self.group_size, self.scales_and_zeros
            )
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2, self.packed, self.group_size, self.scales_and_zeros
            )
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features).to(x.dtype)

    @property
    def nbytes(self) -> int:
        extra = 0
        if self.source is not None:
            extra = sum(t.nbytes for t in (self.source.q, self.source.scale, self.source.offset))
        if self.packed is not None:
            extra += self.packed.nbytes + self.scales_and_zeros.nbytes
        return extra


class Q8Int4Linear(Linear):
    """A weight of int8 codes with one scale per 32 elements along K (GGUF ``Q8_0``:
    ``W = d * q``, ``q`` in -127..127), run on the CPU as two products of torch's int4
    kernel with bf16 activations. Measured for the embedded model's tied LM head
    (``scripts/check_cpu_fidelity.py --heads q8int4``; docs/performance.md, "CPU decode:
    int4 products"): 3.6 vs 7.7 ms a step in float32, but KL to llama.cpp's logits +40% on
    every prompt, so the engine keeps the float head; not used by the engine.

    With ``u = q + 128`` (0..255) and its nibbles ``hi = u >> 4``, ``lo = u & 15``:
    ``W = 16 d hi - 128 d + d lo``. The int4 kernel computes ``(nib - 8) * scale + zero``,
    so ``hi`` with ``(scale, zero) = (16 d, 0)`` and ``lo`` with ``(d, 8 d)`` sum to ``W``:
    the weight values are exact; the activations, the scales (bf16 of fp16 ``d``) and each
    product's output are rounded to bf16, the sum is float32.

    Build with :meth:`from_float`, which refuses weights that are not such codes.
    """

    GROUP = 32

    def __init__(self, q: torch.Tensor, d: torch.Tensor):
        """``q`` int ``[N, K]`` in -128..127, ``d`` float32 ``[N, K / 32]``."""
        self.out_features, self.in_features = q.shape
        u = (q.to(torch.int32) + 128).contiguous()
        zero = torch.zeros_like(d)
        self.parts = [
            self._pack(u >> 4, 16 * d, zero),
            self._pack(u & 15, d, 8 * d),
        ]

    @staticmethod
    def _pack(nibbles, scale, zero):
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1)
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [K/g, N, 2]
        return packed, sz.to(torch.bfloat16)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Q8Int4Linear | None:
        """The codes of a float ``[N, K]`` weight that holds ``Q8_0`` values exactly (per
        32-element block ``d = max|W| / 127`` and ``W / d`` integers: how ``Q8_0`` blocks
        dequantise), else ``None`` (another source, or K not whole blocks)."""
        n, k = weight.shape
        if k % cls.GROUP:
            return None
        blocks = weight.float().view(n, k // cls.GROUP, cls.GROUP)
        d = blocks.abs().amax(dim=-1) / 127
        q = torch.round(blocks / d.clamp(min=torch.finfo(torch.float32).tiny)[..., None])
        if q.abs().max() > 127 or not torch.equal(q * d[..., None], blocks):
            return None
        return cls(q.view(n, k).to(torch.int8), d)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = None
        for packed, sz in self.parts:
            part = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, self.GROUP, sz).float()
            y = part if y is None else y.add_(part)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes + sz.nbytes for p, sz in self.parts)


def make_linear(
    weight: torch.Tensor | Int4Weight,
    bias: torch.Tensor | None,
    weight_format: str,
    device: torch.device,
    dtype: torch.dtype,
    triton_min_rows: int | None = None,
) -> Linear:
    """Build the compute-side linear layer.

    Parameters
    ----------
    weight : float ``[N, K]`` or :class:`Int4Weight`
    weight_format : ``float`` (dequantise to ``dtype``) or ``int4`` (torch int4 kernel;
        a float weight is quantised with :func:`quantize_int4` first)
    dtype : the compute dtype: the int4 kernels' activations on a CPU (bf16 on CUDA;
        :meth:`Int4Linear.set_activation_dtype` changes it)
    triton_min_rows : :class:`Int4Linear`'s (``None``: :data:`TRITON_MIN_ROWS`)
    """
    b = bias.to(device, dtype) if bias is not None else None
    if weight_format == "float":
        w = weight.dequantize(dtype) if isinstance(weight, Int4Weight) else weight.to(dtype)
        return DenseLinear(w.to(device), b)
    if weight_format != "int4":
        raise ValueError(f"unknown weight_format {weight_format!r}")
    if not isinstance(weight, Int4Weight):
        weight = quantize_int4(weight, requant_group_size(weight.shape[1]))
    int4_dtype = torch.bfloat16 if device.type == "cuda" else dtype
    rows = TRITON_MIN_ROWS if triton_min_rows is None else triton_min_rows
    return Int4Linear(weight, b, device, int4_dtype, triton_min_rows=rows)
