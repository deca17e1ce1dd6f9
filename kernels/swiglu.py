"""SwiGLU's gate (Shazeer 2020, arXiv:2002.05202; Hugging Face ``LlamaMLP``):
``silu(gate) * up`` from the fused gate-up projection's output ``[..., 2F]`` (gate in the
first half, up in the second, as :meth:`engine.model.llama.LlamaModel.finish_layer` splits
it).

:func:`swiglu_ref` computes in float32 and rounds once to the activation dtype;
:func:`swiglu` is the Triton version, one launch instead of torch's two element-wise
kernels (SiLU, then the product, each rounding to the activation dtype). In float32 the two
agree exactly; in bf16/fp16 the single rounding differs from torch's two by at most one
unit in the last place of the output.

Shapes: ``R`` rows (tokens), ``F`` the FFN width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._launch import FLOAT_DTYPES, check_device, next_pow2, require, require_runnable


def swiglu_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [..., 2F]`` (``gate, up = gate_up.chunk(2, -1)``).

    Parameters
    ----------
    gate_up : ``[..., 2F]`` float32 / float16 / bfloat16

    Returns
    -------
    ``[..., F]`` in ``gate_up.dtype``, computed in float32 and rounded once.
    """
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


@triton.jit
def _swiglu_kernel(
    x_ptr,
    out_ptr,
    ffn,
    stride_x_r,
    stride_out_r,
    BLOCK_F: tl.constexpr,
):
    """One (row, block of ``BLOCK_F`` columns): ``out = silu(x[:F]) * x[F:]`` in float32."""
    row = tl.program_id(0).to(tl.int64)
    offs_f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask_f = offs_f < ffn
    gate = tl.load(x_ptr + row * stride_x_r + offs_f, mask=mask_f, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x_r + ffn + offs_f, mask=mask_f, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out_r + offs_f, out.to(out_ptr.dtype.element_ty), mask=mask_f)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton :func:`swiglu_ref`: same argument and result (to float32 rounding of
    ``exp``), one launch.

    Parameters
    ----------
    gate_up : ``[R, 2F]`` with a unit stride on the last dimension

    Returns
    -------
    ``[R, F]`` contiguous, in ``gate_up.dtype``

    Raises
    ------
    ValueError : a rank, odd width, dtype, stride or device that does not match the above
    """
    require(isinstance(gate_up, torch.Tensor) and gate_up.dim() == 2, "gate_up must be [R, 2F]")
    require(gate_up.dtype in FLOAT_DTYPES, f"gate_up dtype must be one of {FLOAT_DTYPES}")
    rows, width = gate_up.shape
    require(width % 2 == 0, f"gate_up's width must be even (gate and up halves), got {width}")
    require(gate_up.stride(-1) == 1 or width <= 1, "gate_up needs a unit stride on its last dim")
    check_device(gate_up.device)
    require_runnable(gate_up.device)
    ffn = width // 2
    out = torch.empty((rows, ffn), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    block = min(1024, next_pow2(ffn))
    _swiglu_kernel[(rows, triton.cdiv(ffn, block))](
        gate_up, out, ffn, gate_up.stride(0), out.stride(0), BLOCK_F=block, num_warps=4
    )
    return out
