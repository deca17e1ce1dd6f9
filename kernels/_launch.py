"""Launcher helpers shared by the Triton kernels: argument checks and device facts.

Checks raise ``ValueError`` with the argument's name; they read only tensor metadata
(shape, dtype, stride, device), never tensor values, so a launcher never synchronises
with the device and can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import os

import torch

INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def require(cond: bool, msg: str) -> None:
    """Raise ``ValueError(msg)`` unless ``cond``."""
    if not cond:
        raise ValueError(msg)


def check_tensor(
    name: str,
    t: torch.Tensor,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    *,
    unit_last: bool = True,
) -> None:
    """Check rank, dtype and (optionally) a unit stride on the last dimension."""
    require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    require(t.dim() == ndim, f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    require(t.dtype in dtypes, f"{name} dtype must be one of {dtypes}, got {t.dtype}")
    if unit_last and t.numel() > 0 and t.shape[-1] > 1:
        require(
            t.stride(-1) == 1, f"{name} needs a unit stride on its last dimension, got {t.stride()}"
        )


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Check an exact shape."""
    require(
        tuple(t.shape) == tuple(shape),
        f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}",
    )


def check_device(device: torch.device, **tensors: torch.Tensor) -> None:
    """Every tensor on ``device``."""
    for name, t in tensors.items():
        require(t.device == device, f"{name} is on {t.device}, expected {device}")


def host_visible(t: torch.Tensor, device: torch.device) -> bool:
    """Whether a kernel on ``device`` can address ``t``: same device, or pinned host
    memory (mapped into the device's address space by unified virtual addressing)."""
    if t.device == device:
        return True
    return device.type == "cuda" and t.device.type == "cpu" and t.is_pinned()


def interpreted() -> bool:
    """Whether Triton kernels run under the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def require_runnable(device: torch.device) -> None:
    """Triton kernels run on CUDA devices, or on the CPU under the interpreter (which
    must be switched on before ``triton`` is first imported)."""
    require(
        device.type == "cuda" or (device.type == "cpu" and interpreted()),
        f"Triton kernels need a CUDA device or TRITON_INTERPRET=1 (set before triton is "
        f"imported) for CPU tensors; got device {device}",
    )


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@functools.cache
def _num_sms_cached(kind: str, index: int | None) -> int:
    if kind != "cuda":
        return 4
    return torch.cuda.get_device_properties(index or 0).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 elsewhere, for the interpreter)."""
    index = device.index if device.index is not None else None
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return _num_sms_cached(device.type, index)
