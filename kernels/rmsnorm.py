"""RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467), optionally fused with the residual add
before it: ``s = x + residual; out = weight * (s * rsqrt(mean(s^2) + eps))``.

The arithmetic is the model's (:func:`engine.model.llama.rms_norm`, Hugging Face
``LlamaRMSNorm``): the sum ``s`` is rounded to the activation dtype (it is the new residual
stream), the norm is computed in float32 from that rounded ``s``, multiplied by the
float32 weight and rounded once to the activation dtype. :func:`rms_norm` is the Triton
version, one program per row, one launch instead of the reference's ~8 element-wise and
reduction kernels; the only difference is the order of the float32 sum of squares (and
the device's ``rsqrt``), so results agree with the reference to float32 rounding before
the final cast.

Shapes: ``R`` rows (any leading dimensions), ``H`` the normalised width (the hidden size,
or the head dim ``D`` for Qwen3's per-head q/k norms).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import (
    FLOAT_DTYPES,
    check_device,
    interpreted,
    next_pow2,
    require,
    require_runnable,
)


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x + residual`` (or of ``x``), and that sum.

    Parameters
    ----------
    x : ``[..., H]`` activations (float32 / float16 / bfloat16)
    weight : float32 ``[H]`` the norm's gain
    eps : added to the mean square (``rms_norm_eps``)
    residual : ``[..., H]`` in ``x``'s dtype, or ``None`` (no add)

    Returns
    -------
    ``(out, s)``: ``out [..., H]`` in ``x.dtype``; ``s = x + residual`` in ``x.dtype`` (``x``
    itself when ``residual`` is ``None``), the new residual stream
    """
    s = x if residual is None else x + residual
    sf = s.float()
    sf = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * sf).to(s.dtype), s


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    inner,
    stride_x_a,
    stride_x_b,
    stride_r_a,
    stride_r_b,
    stride_o_a,
    stride_o_b,
    stride_s_a,
    stride_s_b,
    eps,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """One row ``(a, b)`` of a ``[A, B, H]`` view: the add (rounded to the activation
    dtype and stored), the float32 mean square, the scaled and weighted row."""
    row = tl.program_id(0)
    a = row // inner
    b = row % inner
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x = tl.load(x_ptr + a * stride_x_a + b * stride_x_b + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + a * stride_r_a + b * stride_r_b + offs, mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + a * stride_s_a + b * stride_s_b + offs, s, mask=mask)
        sf = s.to(tl.float32)
    else:
        sf = x.to(tl.float32)
    mean_sq = tl.sum(sf * sf, axis=0) / H
    sf = sf * tl.rsqrt(mean_sq + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + a * stride_o_a + b * stride_o_b + offs,
        (w * sf).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    """``[H]`` / ``[R, H]`` / ``[A, B, H]`` as a ``[A, B, H]`` view (no copy)."""
    if t.dim() == 1:
        return t[None, None]
    if t.dim() == 2:
        return t[:, None]
    return t


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`rms_norm_ref`: same arguments and results (to float32 rounding of the
    mean square), one launch; inputs are read through their strides (no copies).

    Parameters
    ----------
    x : ``[H]``, ``[R, H]`` or ``[A, B, H]`` (e.g. the q heads of a fused qkv output),
        unit stride on ``H``
    weight : ``[H]`` contiguous, on ``x``'s device
    eps : float
    residual : like ``x`` (same shape and dtype, any strides with a unit last one) or ``None``

    Returns
    -------
    ``(out, s)`` as :func:`rms_norm_ref`; ``out`` and ``s`` are new contiguous tensors
    (``s`` is ``x`` when ``residual`` is ``None``)

    Raises
    ------
    ValueError : a rank, shape, dtype, stride or device that does not match the above
    """
    require(isinstance(x, torch.Tensor) and 1 <= x.dim() <= 3, "x must be a 1- to 3-D tensor")
    require(x.dtype in FLOAT_DTYPES, f"x dtype must be one of {FLOAT_DTYPES}, got {x.dtype}")
    h = x.shape[-1]
    require(
        x.stride(-1) == 1 or h <= 1,
        f"x needs a unit stride on its last dimension, got {x.stride()}",
    )
    require(
        weight.dim() == 1 and weight.shape[0] == h and weight.is_contiguous(),
        f"weight must be contiguous [{h}], got shape {tuple(weight.shape)}",
    )
    check_device(x.device, weight=weight)
    if residual is not None:
        require(
            residual.shape == x.shape and residual.dtype == x.dtype,
            f"residual must be {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} {residual.dtype}",
        )
        require(
            residual.stride(-1) == 1 or h <= 1, "residual needs a unit stride on its last dimension"
        )
        check_device(x.device, residual=residual)
    require_runnable(x.device)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = x if residual is None else torch.empty_like(out)
    x3, o3, s3 = _as_3d(x), _as_3d(out), _as_3d(s)
    r3 = _as_3d(residual) if residual is not None else x3
    rows = x3.shape[0] * x3.shape[1]
    if rows == 0 or h == 0:
        return out, s
    block = next_pow2(h)
    _rms_norm_kernel[(rows,)](
        x3,
        r3,
        weight,
        o3,
        s3,
        x3.shape[1],
        x3.stride(0),
        x3.stride(1),
        r3.stride(0),
        r3.stride(1),
        o3.stride(0),
        o3.stride(1),
        s3.stride(0),
        s3.stride(1),
        float(eps),
        H=h,
        BLOCK_H=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=1 if interpreted() else min(max(block // 256, 1), 8),
    )
    return out, s
