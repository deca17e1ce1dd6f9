"""W4A16 linear layer over the :class:`engine.weights.quant.Int4Weight` layout.

The weight ``W [N, K]`` is ``q`` uint8 ``[N, K/2]`` (element ``2j`` in the low nibble of
byte ``j``, ``2j + 1`` in its high nibble) with one float scale and offset per group of
``g`` elements along ``K`` (``g`` a power of two): ``W[n, k] = scale[n, k // g] * q[n, k]
+ offset[n, k // g]``. GGUF ``Q4_0``/``Q4_1``/``Q4_K`` weights are converted to this layout
when they are loaded (:func:`engine.weights.quant.int4_from_gguf_blocks`).

* :func:`group_int4_linear` — a Triton dequant-matmul that reads that layout in place
  (nibbles, scales and offsets unpacked in registers, fp32 accumulation, split-K for
  small M); :class:`engine.weights.quant.Int4Linear` runs it for mid-sized decode batches
  on CUDA (``scripts/bench_kernels.py`` times it against tinygemm and bf16);
* :func:`group_int4_linear_ref` dequantises to fp32 and multiplies: the oracle.
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
    next_pow2,
    num_sms,
    require,
    require_runnable,
)


@triton.jit
def _load_repeated(rows, idx, mask, BLOCK_N: tl.constexpr, N: tl.constexpr, REP: tl.constexpr):
    """Per-row values ``rows[:, idx]`` (``rows`` ``[BLOCK_N, 1]`` pointers, ``idx`` ``[N]``,
    0 where ``mask`` is false) as float32, each repeated ``REP`` times along the row:
    ``[BLOCK_N, N * REP]`` (a scale or offset per group, spread over its bytes
    in registers)."""
    v = tl.load(rows + idx[None, :], mask=mask, other=0.0).to(tl.float32)
    return tl.reshape(tl.broadcast_to(v[:, :, None], [BLOCK_N, N, REP]), [BLOCK_N, N * REP])


@triton.jit
def _dequant_tile(
    q_ptr, scale_ptr, offset_ptr, offs_n, mask_n, kt, K,
    stride_q_n, stride_scale_n, stride_offset_n,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):
    """K tile ``kt`` of the weight rows ``offs_n`` as float32 ``(w_lo, w_hi)``, each
    ``[BLOCK_N, BLOCK_K / 2]``: the elements ``2j`` (low nibbles) and ``2j + 1`` (high
    nibbles) of byte ``j``, times their group's scale plus its offset (0 past ``K`` or
    ``N``). Whole groups per tile (both powers of two): one scale per row, or
    ``BLOCK_K / GROUP`` per row broadcast over their ``GROUP / 2`` bytes in registers."""
    HALF: tl.constexpr = BLOCK_K // 2
    byte_i = kt * HALF + tl.arange(0, HALF)
    qb = tl.load(
        q_ptr + offs_n[:, None] * stride_q_n + byte_i[None, :],
        mask=mask_n[:, None] & (byte_i < K // 2)[None, :],
        other=0,
    )
    if GROUP >= BLOCK_K:
        col = (kt * BLOCK_K) // GROUP
        mask_c = mask_n & ((offs_n * 0 + col) < K // GROUP)
        scale = tl.load(scale_ptr + offs_n * stride_scale_n + col, mask=mask_c, other=0.0)
        scale = scale.to(tl.float32)[:, None]
        low = tl.load(offset_ptr + offs_n * stride_offset_n + col, mask=mask_c, other=0.0)
        low = low.to(tl.float32)[:, None]
    else:
        NG: tl.constexpr = BLOCK_K // GROUP
        cols = kt * NG + tl.arange(0, NG)
        mask_c = mask_n[:, None] & (cols < K // GROUP)[None, :]
        scale = _load_repeated(
            scale_ptr + offs_n[:, None] * stride_scale_n, cols, mask_c, BLOCK_N, NG, GROUP // 2
        )
        low = _load_repeated(
            offset_ptr + offs_n[:, None] * stride_offset_n, cols, mask_c, BLOCK_N, NG, GROUP // 2
        )
    w_lo = (qb & 15).to(tl.float32) * scale + low
    w_hi = (qb >> 4).to(tl.float32) * scale + low
    return w_lo, w_hi


@triton.jit
def _group_int4_linear_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    offset_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_x_m,
    stride_q_n,
    stride_scale_n,
    stride_offset_n,
    stride_y_s,
    stride_y_m,
    split_k,
    FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):
    """One (M tile, N tile, K split): acc += x[:, k] @ W[n, k].T over the split's tiles.

    A tile's ``BLOCK_K / 2`` bytes per row unpack to two halves: the low nibbles are
    elements ``2j`` and the high nibbles ``2j + 1``, so one contiguous activation load is
    split into even and odd columns in registers and two ``tl.dot`` run per tile. One scale
    and offset per ``GROUP`` elements (``GROUP`` and ``BLOCK_K`` powers of two).
    """
    pid_mn = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid_mn // grid_n
    pid_n = pid_mn % grid_n
    HALF: tl.constexpr = BLOCK_K // 2
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kt in range(pid_k, tl.cdiv(K, BLOCK_K), split_k):
        w_lo, w_hi = _dequant_tile(
            q_ptr, scale_ptr, offset_ptr, offs_n, mask_n, kt, K,
            stride_q_n, stride_scale_n, stride_offset_n, BLOCK_N, BLOCK_K, GROUP,
        )
        # Elements 2j and 2j + 1 of the tile: one contiguous load, split in registers.
        offs_k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
        x_tile = tl.load(
            x_ptr + offs_m[:, None] * stride_x_m + offs_k[None, :],
            mask=mask_m[:, None] & (offs_k < K)[None, :],
            other=0.0,
        )
        x_lo, x_hi = tl.split(tl.reshape(x_tile, [BLOCK_M, HALF, 2]))
        if FP32:
            acc += tl.dot(x_lo.to(tl.float32), tl.trans(w_lo), input_precision="ieee")
            acc += tl.dot(x_hi.to(tl.float32), tl.trans(w_hi), input_precision="ieee")
        else:
            acc += tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)))
            acc += tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)))
    y = y_ptr + pid_k * stride_y_s + offs_m[:, None] * stride_y_m + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _group_int4_gemv_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    offset_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_x_m,
    stride_q_n,
    stride_scale_n,
    stride_offset_n,
    stride_y_s,
    stride_y_m,
    split_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):
    """One (M tile, N tile, K split) without tensor cores, for the fewest rows: the tile's
    weights are dequantised to float32 once and each of the ``BLOCK_M`` activation rows
    is multiplied and summed along K in registers (``BLOCK_M`` is unrolled). Same layout,
    masks and split-K partials as :func:`_group_int4_linear_kernel`; the products and sums
    are float32 throughout (the weights are not rounded to the activations' dtype).
    Kept over a variant that accumulated the products element-wise over the K tiles and
    summed once at the end: one row of qwen2.5-7b's four linears at group 128, default
    tiles, mean µs a linear (``scripts/bench_kernels.py --sections int4_decode``, H100
    80GB, 2026-12-02): this version 29.2, the variant 37.9, tinygemm 20.0
    (docs/performance.md, "One int4 copy on the GPU")."""
    pid_mn = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid_mn // grid_n
    pid_n = pid_mn % grid_n
    HALF: tl.constexpr = BLOCK_K // 2
    offs_mt = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = pid_m * BLOCK_M + offs_mt
    mask_m = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kt in range(pid_k, tl.cdiv(K, BLOCK_K), split_k):
        w_lo, w_hi = _dequant_tile(
            q_ptr, scale_ptr, offset_ptr, offs_n, mask_n, kt, K,
            stride_q_n, stride_scale_n, stride_offset_n, BLOCK_N, BLOCK_K, GROUP,
        )
        offs_k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
        for mi in tl.static_range(BLOCK_M):
            row = pid_m * BLOCK_M + mi
            xr = tl.load(
                x_ptr + row * stride_x_m + offs_k,
                mask=(offs_k < K) & ((offs_k * 0 + row) < M),
                other=0.0,
            ).to(tl.float32)
            x_lo, x_hi = tl.split(tl.reshape(xr, [HALF, 2]))
            part = tl.sum(w_lo * x_lo[None, :] + w_hi * x_hi[None, :], axis=1)
            acc = tl.where(offs_mt[:, None] == mi, acc + part[None, :], acc)
    y = y_ptr + pid_k * stride_y_s + offs_m[:, None] * stride_y_m + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@dataclass(frozen=True)
class Q4Config:
    """Tile shape of :func:`group_int4_linear` (``block_k`` a power of two, at least 32).

    ``kind``: ``"dot"`` runs :func:`_group_int4_linear_kernel` (tensor cores; ``block_m``
    at least 16), ``"gemv"`` runs :func:`_group_int4_gemv_kernel` (float32 multiply-adds;
    any power-of-two ``block_m``, for the fewest rows)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    kind: str = "dot"


def q4_config(m: int, n: int, k: int, device: torch.device) -> Q4Config:
    """Default tiles: thin M tiles and split-K so that small-M products fill the device.

    One row runs the ``gemv`` kernel (32 rows of W by 256 of K a program, 8 warps, split-K
    to about four programs per SM), more rows the tensor-core kernel. From the tile sweep
    of ``scripts/bench_kernels.py --sections int4_tune`` (H100, 2026-12-02,
    docs/performance.md "One int4 copy on the GPU"): at one row the best ``gemv`` tile
    beat the ``dot`` default by 10-17 % a layer on qwen2.5-7b and lost from two rows
    (the float32 products of every row grow with M); across the ``dot`` tiles and
    split-K values swept, the defaults below were within 6 % of the best tile on 29 of
    the 32 (linear, group, rows) cases from 4 to 32 rows, 12 % at worst."""
    if m == 1:
        block_k = 256
        tiles = -(-n // 32)
        split_k = max(1, min(-(-k // block_k), 16, -(-4 * num_sms(device) // tiles)))
        return Q4Config(1, 32, block_k, split_k, num_warps=8, num_stages=3, kind="gemv")
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    block_n = 64 if m <= 64 else 128
    block_k = 128 if k % 128 == 0 else 64 if k % 64 == 0 else 32
    tiles = -(-m // block_m) * -(-n // block_n)
    k_tiles = -(-k // block_k)
    split_k = max(1, min(k_tiles, 16, (2 * num_sms(device)) // max(tiles, 1)))
    return Q4Config(block_m, block_n, block_k, split_k, num_warps=4 if m <= 64 else 8)


def _launch(x, q, scale, offset, group: int, config: Q4Config | None) -> torch.Tensor:
    """Run :func:`_group_int4_linear_kernel` on arguments :func:`group_int4_linear` checked."""
    require_runnable(x.device)
    n, k = q.shape[0], 2 * q.shape[1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    cfg = config or q4_config(rows, n, k, x.device)
    require(
        cfg.block_k >= 32 and cfg.block_k & (cfg.block_k - 1) == 0,
        f"block_k={cfg.block_k} must be a power of two of at least 32",
    )
    require(cfg.kind in ("dot", "gemv"), f"kind={cfg.kind!r} must be 'dot' or 'gemv'")
    require(
        cfg.block_m >= 1 and cfg.block_m & (cfg.block_m - 1) == 0 and cfg.block_n >= 16
        and cfg.block_n & (cfg.block_n - 1) == 0 and (cfg.kind == "gemv" or cfg.block_m >= 16),
        f"block_m={cfg.block_m}, block_n={cfg.block_n}: powers of two, block_n >= 16 "
        "(block_m >= 16 for kind 'dot')",
    )
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out.reshape(*x.shape[:-1], n)
    split = cfg.split_k
    y = out if split == 1 else torch.empty((split, rows, n), dtype=torch.float32, device=x.device)
    grid = (-(-rows // cfg.block_m) * -(-n // cfg.block_n), split)
    if cfg.kind == "gemv":
        _group_int4_gemv_kernel[grid](
            x2,
            q,
            scale,
            offset,
            y,
            rows,
            n,
            k,
            x2.stride(0),
            q.stride(0),
            scale.stride(0),
            offset.stride(0),
            0 if split == 1 else y.stride(0),
            y.stride(-2),
            split,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            GROUP=group,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        return _finish_split(y, out, rows, n, split, x.shape)
    _group_int4_linear_kernel[grid](
        x2,
        q,
        scale,
        offset,
        y,
        rows,
        n,
        k,
        x2.stride(0),
        q.stride(0),
        scale.stride(0),
        offset.stride(0),
        0 if split == 1 else y.stride(0),
        y.stride(-2),
        split,
        FP32=x.dtype == torch.float32,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP=group,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return _finish_split(y, out, rows, n, split, x.shape)


def _finish_split(y, out, rows: int, n: int, split: int, shape) -> torch.Tensor:
    """Sum the split-K partials ``y [split, rows, n]`` into ``out`` (nothing when ``split``
    is 1: the kernel wrote ``out``) and give it the activations' leading shape."""
    if split > 1:
        block = min(1024, next_pow2(n))
        _int4_split_sum_kernel[(rows, -(-n // block))](
            y, out, n, split, y.stride(0), y.stride(1), out.stride(0), BLOCK_N=block
        )
    return out.reshape(*shape[:-1], n)


@triton.jit
def _int4_split_sum_kernel(
    part_ptr, out_ptr, n, split, stride_part_s, stride_part_m, stride_out_m, BLOCK_N: tl.constexpr
):
    """One (row, block of columns) of the split-K partials ``[S, M, N]`` (float32) summed in
    split order and rounded once to ``out``'s dtype: the reduction and the cast of the
    split-K product in one launch (instead of torch's sum and copy)."""
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    acc = tl.zeros([BLOCK_N], tl.float32)
    for s in range(split):
        acc += tl.load(part_ptr + s * stride_part_s + row * stride_part_m + offs_n, mask=mask_n)
    tl.store(out_ptr + row * stride_out_m + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


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
    """Triton :func:`group_int4_linear_ref`: a dequant-matmul reading the
    :class:`engine.weights.quant.Int4Weight` layout (interleaved nibbles, any power-of-two
    group size, float scales and offsets) in place — no repacking, so the engine can run the
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
    return _launch(x, q, scale, offset, g, config)
