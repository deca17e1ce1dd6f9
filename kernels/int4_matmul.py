"""W4A16 linear layers over GGUF-style 4-bit weights (blocks of 32 along ``K``).

Formats (llama.cpp ``ggml-common.h``): a ``Q4_0`` block is an fp16 scale ``d`` and 16
bytes of nibbles, value ``d * (q - 8)``; a ``Q4_1`` block adds an fp16 minimum ``m``,
value ``d * q + m``; ``q`` in 0..15. Byte ``i`` of a block holds element ``i`` in its low
nibble and element ``i + 16`` in its high nibble. Here the blocks of a ``[N, K]`` weight
are kept as three arrays: ``qs`` uint8 ``[N, K/2]`` (each block's 16 bytes in order),
``d`` fp16 ``[N, K/32]`` and ``m`` fp16 ``[N, K/32]`` (``None`` for ``Q4_0``);
:func:`split_gguf_blocks` makes them from the raw block bytes.

Two CUDA paths, both measured by ``scripts/bench_kernels.py``:

* :func:`int4_linear` — a Triton dequant-matmul that reads the blocks directly
  (nibbles and scales unpacked in registers, fp32 accumulation, split-K for small M);
* :func:`group_int4_linear` — the same kernel reading :class:`engine.weights.quant.Int4Weight`
  (interleaved nibbles, group ``g``, float scales and minimums) in place;
* :func:`int4pack_linear` — torch's tinygemm kernel ``aten._weight_int4pack_mm`` on
  weights converted by :func:`to_int4pack` (bf16 scales and zeros, group 32, so
  ``Q4_1`` minimums are rounded to bf16 there).

:func:`int4_linear_ref` and :func:`group_int4_linear_ref` dequantise to fp32 and multiply:
the CPU path and the oracles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._launch import (
    FLOAT_DTYPES,
    check_device,
    check_tensor,
    num_sms,
    require,
    require_runnable,
)

QK = 32  # elements per block
_BLOCK_BYTES = {"q4_0": 18, "q4_1": 20}


def split_gguf_blocks(
    raw: torch.Tensor, kind: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Split raw GGUF block bytes into ``(qs, d, m)``.

    Parameters
    ----------
    raw : uint8 ``[N, K/32 * block_bytes]`` (18 bytes a block for ``q4_0``, 20 for ``q4_1``)
    kind : ``"q4_0"`` or ``"q4_1"``

    Returns
    -------
    qs : uint8 ``[N, K/2]``; d : fp16 ``[N, K/32]``; m : fp16 ``[N, K/32]`` or ``None``.
    """
    require(kind in _BLOCK_BYTES, f"kind must be q4_0 or q4_1, got {kind!r}")
    nbytes = _BLOCK_BYTES[kind]
    require(raw.dtype == torch.uint8 and raw.dim() == 2, "raw must be uint8 [N, bytes]")
    require(raw.shape[1] % nbytes == 0, f"row of {raw.shape[1]} bytes is not whole {kind} blocks")
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, nbytes)
    d = blocks[:, :, 0:2].contiguous().view(torch.float16).reshape(n, -1)
    head = 2 if kind == "q4_0" else 4
    m = (
        blocks[:, :, 2:4].contiguous().view(torch.float16).reshape(n, -1)
        if kind == "q4_1"
        else None
    )
    qs = blocks[:, :, head:].reshape(n, -1).contiguous()
    return qs, d, m


def quantize_q4(
    w: torch.Tensor, kind: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantise a float ``[N, K]`` weight to ``Q4_0``/``Q4_1`` blocks (llama.cpp's rules:
    ``Q4_0`` scale ``d = x_absmax_signed / -8``; ``Q4_1`` ``d = (max - min) / 15``, ``m = min``).

    Returns
    -------
    ``(qs, d, m)`` as in :func:`split_gguf_blocks`.
    """
    require(kind in _BLOCK_BYTES, f"kind must be q4_0 or q4_1, got {kind!r}")
    n, k = w.shape
    require(k % QK == 0, f"K={k} is not a multiple of {QK}")
    x = w.float().reshape(n, k // QK, QK)
    if kind == "q4_0":
        idx = x.abs().argmax(-1, keepdim=True)
        d = (torch.gather(x, -1, idx) / -8).squeeze(-1)
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = torch.clamp(torch.floor(x * inv[..., None] + 8.5), 0, 15)
        m = None
    else:
        lo, hi = x.amin(-1), x.amax(-1)
        d = (hi - lo) / 15
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = torch.clamp(torch.floor((x - lo[..., None]) * inv[..., None] + 0.5), 0, 15)
        m = lo.half()
    q = q.to(torch.uint8)
    qs = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2)
    return qs, d.half(), m


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K/2]`` blocks -> uint8 ``[N, K]`` values 0..15 in ``K`` order."""
    n = qs.shape[0]
    b = qs.reshape(n, -1, 16)
    return torch.cat([b & 15, b >> 4], dim=-1).reshape(n, -1)


def dequantize_q4(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """float32 ``[N, K]`` weight of ``Q4_0`` (``m is None``) or ``Q4_1`` blocks."""
    n = qs.shape[0]
    q = _nibbles(qs).float().reshape(n, -1, QK)
    scale = d.float()[..., None]
    w = (q - 8) * scale if m is None else q * scale + m.float()[..., None]
    return w.reshape(n, -1)


def int4_linear_ref(
    x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T`` for a 4-bit block-quantised ``W``, by dequantising to fp32.

    Parameters
    ----------
    x : ``[..., K]`` activations
    qs, d, m : ``[N, K/2]`` uint8, ``[N, K/32]`` fp16, ``[N, K/32]`` fp16 or ``None``

    Returns
    -------
    ``[..., N]`` in ``x.dtype`` (fp32 product).
    """
    w = dequantize_q4(qs, d, m).to(x.device)
    return (x.float() @ w.T).to(x.dtype)


@triton.jit
def _load_repeated(rows, idx, mask, BLOCK_N: tl.constexpr, N: tl.constexpr, REP: tl.constexpr):
    """Per-row values ``rows[:, idx]`` (``rows`` ``[BLOCK_N, 1]`` pointers, ``idx`` ``[N]``,
    0 where ``mask`` is false) as float32, each repeated ``REP`` times along the row:
    ``[BLOCK_N, N * REP]`` (a scale or minimum per block or group, spread over its bytes
    in registers)."""
    v = tl.load(rows + idx[None, :], mask=mask, other=0.0).to(tl.float32)
    return tl.reshape(tl.broadcast_to(v[:, :, None], [BLOCK_N, N, REP]), [BLOCK_N, N * REP])


@triton.jit
def _q4_linear_kernel(
    x_ptr,
    qs_ptr,
    d_ptr,
    m_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_x_m,
    stride_qs_n,
    stride_d_n,
    stride_m_n,
    stride_y_s,
    stride_y_m,
    split_k,
    HAS_MIN: tl.constexpr,
    FP32: tl.constexpr,
    GATHER_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERLEAVED: tl.constexpr = False,
    GROUP: tl.constexpr = 32,
):
    """One (M tile, N tile, K split): acc += x[:, k] @ W[n, k].T over the split's tiles.

    A tile's ``BLOCK_K / 2`` bytes per row unpack to two halves: the low nibbles are
    elements ``32*blk + i`` and the high nibbles ``32*blk + 16 + i`` (``i < 16``), so the
    activations are loaded with the matching column order and two ``tl.dot`` run per tile.
    ``INTERLEAVED`` (the :class:`engine.weights.quant.Int4Weight` layout): byte ``j`` holds
    elements ``2j`` (low) and ``2j + 1`` (high), one scale and minimum per ``GROUP``
    elements (``GROUP`` and ``BLOCK_K`` powers of two).
    """
    pid_mn = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid_mn // grid_n
    pid_n = pid_mn % grid_n
    HALF: tl.constexpr = BLOCK_K // 2
    NB: tl.constexpr = BLOCK_K // 32
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_i = tl.arange(0, HALF)
    offs_b = tl.arange(0, NB)
    mask_m = offs_m < M
    mask_n = offs_n < N
    num_blocks = K // 32
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kt in range(pid_k, tl.cdiv(K, BLOCK_K), split_k):
        blk = kt * NB + offs_b  # [NB]
        byte_i = kt * HALF + offs_i  # [HALF]
        if INTERLEAVED:
            blk_i = byte_i  # (unused: scales are loaded per group below)
            mask_bi = byte_i < K // 2
        else:
            blk_i = kt * NB + offs_i // 16
            mask_bi = blk_i < num_blocks
        mask_b = blk < num_blocks
        qb = tl.load(
            qs_ptr + offs_n[:, None] * stride_qs_n + (kt * HALF + offs_i)[None, :],
            mask=mask_n[:, None] & mask_bi[None, :],
            other=0,
        )
        mask_nb = mask_n[:, None] & mask_b[None, :]
        mask_ni = mask_n[:, None] & mask_bi[None, :]
        d_rows = d_ptr + offs_n[:, None] * stride_d_n
        m_rows = m_ptr + offs_n[:, None] * stride_m_n
        if INTERLEAVED:
            # Whole groups per tile (both powers of two): one scale per row, or NG per row
            # broadcast over their GROUP / 2 bytes in registers.
            if GROUP >= BLOCK_K:
                col = (kt * BLOCK_K) // GROUP
                mask_c = mask_n & ((offs_n * 0 + col) < K // GROUP)
                scale = tl.load(d_ptr + offs_n * stride_d_n + col, mask=mask_c, other=0.0)
                scale = scale.to(tl.float32)[:, None]
                low = tl.load(m_ptr + offs_n * stride_m_n + col, mask=mask_c, other=0.0)
                low = low.to(tl.float32)[:, None]
            else:
                NG: tl.constexpr = BLOCK_K // GROUP
                cols = kt * NG + tl.arange(0, NG)
                mask_c = mask_n[:, None] & (cols < K // GROUP)[None, :]
                scale = _load_repeated(d_rows, cols, mask_c, BLOCK_N, NG, GROUP // 2)
                low = _load_repeated(m_rows, cols, mask_c, BLOCK_N, NG, GROUP // 2)
            w_lo = (qb & 15).to(tl.float32) * scale + low
            w_hi = (qb >> 4).to(tl.float32) * scale + low
            # Elements 2j and 2j + 1 of the tile: one contiguous load, split in registers.
            offs_k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
            x_tile = tl.load(
                x_ptr + offs_m[:, None] * stride_x_m + offs_k[None, :],
                mask=mask_m[:, None] & (offs_k < K)[None, :],
                other=0.0,
            )
            x_lo, x_hi = tl.split(tl.reshape(x_tile, [BLOCK_M, HALF, 2]))
        else:
            if GATHER_SCALES:
                # One scale per byte, gathered (the repeats hit L1): no register reshuffle.
                scale = tl.load(d_rows + blk_i[None, :], mask=mask_ni, other=0.0).to(tl.float32)
            else:
                scale = _load_repeated(d_rows, blk, mask_nb, BLOCK_N, NB, 16)
            lo = (qb & 15).to(tl.float32)
            hi = (qb >> 4).to(tl.float32)
            if HAS_MIN:
                if GATHER_SCALES:
                    low = tl.load(m_rows + blk_i[None, :], mask=mask_ni, other=0.0).to(tl.float32)
                else:
                    low = _load_repeated(m_rows, blk, mask_nb, BLOCK_N, NB, 16)
                w_lo = lo * scale + low
                w_hi = hi * scale + low
            else:
                w_lo = (lo - 8.0) * scale
                w_hi = (hi - 8.0) * scale
            k_lo = blk_i * 32 + offs_i % 16
            mask_x = mask_m[:, None] & mask_bi[None, :]
            x_rows = x_ptr + offs_m[:, None] * stride_x_m
            x_lo = tl.load(x_rows + k_lo[None, :], mask=mask_x, other=0.0)
            x_hi = tl.load(x_rows + (k_lo + 16)[None, :], mask=mask_x, other=0.0)
        if FP32:
            acc += tl.dot(x_lo.to(tl.float32), tl.trans(w_lo), input_precision="ieee")
            acc += tl.dot(x_hi.to(tl.float32), tl.trans(w_hi), input_precision="ieee")
        else:
            acc += tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)))
            acc += tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)))
    y = y_ptr + pid_k * stride_y_s + offs_m[:, None] * stride_y_m + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@dataclass(frozen=True)
class Q4Config:
    """Tile shape of :func:`int4_linear` (``BLOCK_K`` a multiple of 32); ``gather_scales``
    loads one scale per weight byte instead of broadcasting one per block in registers."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    gather_scales: bool = False


def q4_config(m: int, n: int, k: int, device: torch.device) -> Q4Config:
    """Default tiles: thin M tiles and split-K so that small-M products fill the device."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    block_n = 64 if m <= 64 else 128
    block_k = 128 if k % 128 == 0 else 64 if k % 64 == 0 else 32
    tiles = -(-m // block_m) * -(-n // block_n)
    k_tiles = -(-k // block_k)
    split_k = max(1, min(k_tiles, 16, (2 * num_sms(device)) // max(tiles, 1)))
    return Q4Config(block_m, block_n, block_k, split_k, num_warps=4 if m <= 64 else 8)


def int4_linear(
    x: torch.Tensor,
    qs: torch.Tensor,
    d: torch.Tensor,
    m: torch.Tensor | None = None,
    *,
    config: Q4Config | None = None,
) -> torch.Tensor:
    """Triton :func:`int4_linear_ref`: reads ``Q4_0``/``Q4_1`` blocks directly.

    Parameters
    ----------
    x : ``[..., K]`` bf16/fp16/fp32, unit stride on ``K``
    qs : uint8 ``[N, K/2]``; d : fp16 ``[N, K/32]``; m : fp16 ``[N, K/32]`` or ``None``
    config : tile shape; ``None`` uses :func:`q4_config`

    Returns
    -------
    ``[..., N]`` in ``x.dtype``; fp32 accumulation over weights rounded to ``x.dtype``.
    """
    require(x.dim() >= 1 and x.dtype in FLOAT_DTYPES, f"x must be float [..., K], got {x.dtype}")
    check_tensor("qs", qs, 2, (torch.uint8,))
    check_tensor("d", d, 2, (torch.float16,))
    n, k = qs.shape[0], 2 * qs.shape[1]
    require(k % QK == 0, f"K={k} is not a multiple of {QK}")
    require(x.shape[-1] == k, f"x has K={x.shape[-1]}, weight K={k}")
    require(tuple(d.shape) == (n, k // QK), f"d must be [{n}, {k // QK}], got {tuple(d.shape)}")
    if m is not None:
        check_tensor("m", m, 2, (torch.float16,))
        require(tuple(m.shape) == (n, k // QK), f"m must be [{n}, {k // QK}], got {tuple(m.shape)}")
    check_device(x.device, qs=qs, d=d, **({"m": m} if m is not None else {}))
    return _launch(x, qs, d, m, config, interleaved=False, group=QK)


def _launch(x, qs, d, m, config, *, interleaved: bool, group: int) -> torch.Tensor:
    """Run :func:`_q4_linear_kernel` on checked arguments (see the two wrappers)."""
    require_runnable(x.device)
    n, k = qs.shape[0], 2 * qs.shape[1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    cfg = config or q4_config(rows, n, k, x.device)
    require(cfg.block_k % 32 == 0, f"block_k={cfg.block_k} must be a multiple of 32")
    require(
        not interleaved or cfg.block_k & (cfg.block_k - 1) == 0,
        f"block_k={cfg.block_k} must be a power of two for the interleaved layout",
    )
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out.reshape(*x.shape[:-1], n)
    split = cfg.split_k
    y = out if split == 1 else torch.empty((split, rows, n), dtype=torch.float32, device=x.device)
    grid = (-(-rows // cfg.block_m) * -(-n // cfg.block_n), split)
    _q4_linear_kernel[grid](
        x2,
        qs,
        d,
        d if m is None else m,
        y,
        rows,
        n,
        k,
        x2.stride(0),
        qs.stride(0),
        d.stride(0),
        d.stride(0) if m is None else m.stride(0),
        0 if split == 1 else y.stride(0),
        y.stride(-2),
        split,
        HAS_MIN=m is not None,
        FP32=x.dtype == torch.float32,
        GATHER_SCALES=cfg.gather_scales,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        INTERLEAVED=interleaved,
        GROUP=group,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split > 1:
        out = y.sum(0).to(x.dtype)
    return out.reshape(*x.shape[:-1], n)


def group_int4_linear_ref(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``x @ W.T`` for the :class:`engine.weights.quant.Int4Weight` layout, dequantising to fp32:
    ``W[n, k] = scale[n, k // g] * q[n, k] + offset[n, k // g]``, element ``2j`` in the
    low nibble of byte ``j`` and ``2j + 1`` in its high nibble.

    Parameters
    ----------
    x : ``[..., K]`` activations
    q : uint8 ``[N, K/2]``; scale, offset : float ``[N, K/g]``; group_size : g

    Returns
    -------
    ``[..., N]`` in ``x.dtype`` (fp32 product).
    """
    n, k = q.shape[0], 2 * q.shape[1]
    vals = torch.stack([q & 15, q >> 4], dim=-1).reshape(n, k // group_size, group_size)
    w = vals.float() * scale.float()[..., None] + offset.float()[..., None]
    return (x.float() @ w.reshape(n, k).to(x.device).T).to(x.dtype)


def group_int4_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    group_size: int,
    *,
    config: Q4Config | None = None,
) -> torch.Tensor:
    """Triton :func:`group_int4_linear_ref`: the dequant-matmul of :func:`int4_linear`
    reading the :class:`engine.weights.quant.Int4Weight` layout (interleaved nibbles, any group
    size, float scales and minimums) in place — no repacking, so the engine can run the
    same device copy of a weight through this kernel or dequantise it for prefill.

    Parameters
    ----------
    x : ``[..., K]`` bf16/fp16/fp32, unit stride on ``K``
    q : uint8 ``[N, K/2]``; scale, offset : float ``[N, K/g]``; group_size : g, a power of
        two dividing ``K``
    config : tile shape; ``None`` uses :func:`q4_config`

    Returns
    -------
    ``[..., N]`` in ``x.dtype``; fp32 accumulation over weights rounded to ``x.dtype``.

    Raises
    ------
    ValueError : shapes, dtypes or devices that do not match the above
    """
    require(x.dim() >= 1 and x.dtype in FLOAT_DTYPES, f"x must be float [..., K], got {x.dtype}")
    check_tensor("q", q, 2, (torch.uint8,))
    n, k = q.shape[0], 2 * q.shape[1]
    g = group_size
    require(
        g >= 2 and g & (g - 1) == 0 and k % g == 0,
        f"group_size={g} must be a power of two dividing K={k}",
    )
    require(x.shape[-1] == k, f"x has K={x.shape[-1]}, weight K={k}")
    for name, t in (("scale", scale), ("offset", offset)):
        check_tensor(name, t, 2, FLOAT_DTYPES)
        require(tuple(t.shape) == (n, k // g), f"{name} must be [{n}, {k // g}], got {tuple(t.shape)}")
    check_device(x.device, q=q, scale=scale, offset=offset)
    return _launch(x, q, scale, offset, config, interleaved=True, group=g)


def to_int4pack(
    qs: torch.Tensor,
    d: torch.Tensor,
    m: torch.Tensor | None,
    device: torch.device | str,
    *,
    even_high: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert ``Q4_0``/``Q4_1`` blocks to torch's tinygemm layout (group size 32).

    tinygemm computes ``w = (q - 8) * scale + zero``; so ``scale = d`` and
    ``zero = m + 8 d`` (``Q4_1``) or ``0`` (``Q4_0``), both rounded to bf16. The packer
    takes uint8 ``[N, K/2]`` with element ``2i`` in the high nibble (``even_high``), as
    gpt-fast and torchao pack for CUDA.

    Returns
    -------
    w_packed : int32, the opaque result of ``aten._convert_weight_to_int4pack``
    scales_and_zeros : bf16 ``[K/32, N, 2]``
    """
    k = 2 * qs.shape[1]
    vals = _nibbles(qs).to(torch.int32)
    hi, lo = (vals[:, ::2], vals[:, 1::2]) if even_high else (vals[:, 1::2], vals[:, ::2])
    packed = ((hi << 4) | lo).to(torch.uint8).to(device)
    inner = next(t for t in (8, 4, 2) if k % (t * 16) == 0)
    w_packed = torch.ops.aten._convert_weight_to_int4pack(packed, inner)
    scale = d.float()
    zero = torch.zeros_like(scale) if m is None else m.float() + 8 * scale
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return w_packed, sz.to(device=device, dtype=torch.bfloat16)


def int4pack_linear(
    x: torch.Tensor, w_packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int = QK
) -> torch.Tensor:
    """``x @ W.T`` through ``aten._weight_int4pack_mm`` (bf16 activations, CUDA).

    Parameters
    ----------
    x : bf16 ``[..., K]``; w_packed, scales_and_zeros : from :func:`to_int4pack`

    Returns
    -------
    bf16 ``[..., N]``.
    """
    k = x.shape[-1]
    y = torch.ops.aten._weight_int4pack_mm(x.reshape(-1, k), w_packed, group_size, scales_and_zeros)
    return y.reshape(*x.shape[:-1], y.shape[-1])
