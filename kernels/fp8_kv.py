"""fp8 KV records: float8 e4m3 values with one power-of-two scale per row.

A *row* is one token's key or value of one KV head, ``D`` elements. Its scale is
``2**e`` with the int8 exponent ``e = floor(log2(amax)) - 7`` (``amax``: the row's largest
magnitude; ``e`` clamped to ``[-120, 120]``), so the scaled row's largest magnitude lies in
``[128, 256)``, inside e4m3's finite range (448, OCP 8-bit floating point spec, "E4M3").
Scaling by a power of two is exact, and so is dequantising (3 mantissa bits fit bfloat16's
7), so quantise and dequantise give the same bits in PyTorch and in Triton (both cast
fp32 -> e4m3 round-to-nearest-even): what the gather writes into the hot buffer equals
:func:`fp8_round_ref` of the record, bit for bit.

Why per row (one scale per token, layer, KV head, K|V) and not per record (page x KV
head) or per KV head: a decode token appended to a half-full page needs no rescaling of
the page, and it measured the lowest reconstruction error on the embedded model's keys
and values (``scripts/measure_fp8_kv.py``, docs/bench/fp8_kv_error.json). The exponent is
one byte per ``D`` bytes of fp8 (3 % at ``D = 128``).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
"""The fp8 record dtype (OCP E4M3, finite: no infinities, max 448)."""

EXP_MIN, EXP_MAX = -120, 120
"""Range of the int8 scale exponent: ``2**e`` and ``2**-e`` are normal fp32 numbers."""

HEADROOM_BITS = 7
"""``e = floor(log2(amax)) - 7``: the scaled row's magnitude stays below 256 < 448."""


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """``2.0**e`` as fp32 for integer ``e`` in [-126, 127], built from its exponent bits."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def fp8_exponent_ref(x: torch.Tensor) -> torch.Tensor:
    """int8 scale exponents of the rows of ``x [..., D]`` (any float dtype): ``[...]``.

    A row of zeros (or of magnitudes below 2**-113) gets ``EXP_MIN``.
    """
    amax = x.detach().float().abs().amax(-1)
    biased = (amax.view(torch.int32) >> 23) & 0xFF
    return (biased - 127 - HEADROOM_BITS).clamp(EXP_MIN, EXP_MAX).to(torch.int8)


def fp8_quantize_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x [..., D]`` as fp8: ``(q [..., D] float8_e4m3fn, e [...] int8)`` with
    ``x ~= q * 2**e`` (see the module docstring)."""
    e = fp8_exponent_ref(x)
    q = (x.float() * _pow2(-e.to(torch.int32))[..., None]).to(FP8)
    return q, e


def fp8_dequantize_ref(q: torch.Tensor, e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q [..., D]`` fp8 and exponents ``e [...]`` int8 back to ``dtype`` (exact for
    bfloat16, float16 and float32 outside their subnormal ranges)."""
    return (q.float() * _pow2(e.to(torch.int32))[..., None]).to(dtype)


def fp8_round_ref(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """What attention reads of ``x [..., D]`` stored as fp8: quantise then dequantise, in
    ``dtype`` (default ``x``'s)."""
    q, e = fp8_quantize_ref(x)
    return fp8_dequantize_ref(q, e, x.dtype if dtype is None else dtype)
