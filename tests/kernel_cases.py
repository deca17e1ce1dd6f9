"""Random inputs for the kernel tests (shared by ``test_kernels.py`` and
``test_kernels_cuda.py``): selections, slot placements, pools and a poisoning helper.

Shape symbols as in :mod:`kernels`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kernels.bitmask import pack_bits

POISON_BYTE = 0x7F


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with NaN (floats) or the byte ``0x7f`` (integers), in place."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.view(torch.uint8).fill_(POISON_BYTE).view(t.dtype) if t.numel() else t


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Make ``torch.empty`` / ``torch.empty_like`` return poisoned memory, so an output
    or workspace element that a kernel forgets to write shows up as NaN or 0x7f7f7f7f."""
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned_empty(*args, **kwargs):
        return poison_(empty(*args, **kwargs))

    def poisoned_empty_like(*args, **kwargs):
        return poison_(empty_like(*args, **kwargs))

    torch.empty, torch.empty_like = poisoned_empty, poisoned_empty_like
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-for-byte equality (NaN payloads included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def random_seq_lens(b: int, p_max: int, s: int, gen: torch.Generator) -> torch.Tensor:
    """int32 ``[B]`` context lengths in ``[1, P_max * S]``, some with a partial last page."""
    return torch.randint(1, p_max * s + 1, (b,), generator=gen, dtype=torch.int32)


def random_selection_mask(
    num_pages: torch.Tensor, hkv: int, p_max: int, k: int, gen: torch.Generator
) -> torch.Tensor:
    """bool ``[B, Hkv, P_max]``: up to ``k`` random used pages per row, the last page always."""
    b = num_pages.shape[0]
    mask = torch.zeros(b, hkv, p_max, dtype=torch.bool)
    for i in range(b):
        n = int(num_pages[i])
        for h in range(hkv):
            take = torch.randperm(n, generator=gen)[: max(k - 1, 0)]
            mask[i, h, take] = True
            mask[i, h, n - 1] = True
    return mask


def scattered_slot_list(
    mask: torch.Tensor, k_max: int, n_slots: int, gen: torch.Generator
) -> torch.Tensor:
    """int32 ``[B, Hkv, K_max]``: distinct random slots for the selected pages, -1 padded."""
    b, hkv, _ = mask.shape
    perm = torch.randperm(n_slots, generator=gen)[: b * hkv * k_max].view(b, hkv, k_max)
    count = mask.sum(-1, keepdim=True)
    return torch.where(torch.arange(k_max) < count, perm, -1).to(torch.int32)


def attention_inputs(
    b: int,
    hq: int,
    hkv: int,
    d: int,
    s: int,
    p_max: int,
    k: int,
    dtype: torch.dtype,
    seed: int,
) -> dict[str, torch.Tensor | float]:
    """Random arguments of ``sparse_decode_attention`` (CPU tensors)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = random_seq_lens(b, p_max, s, gen)
    mask = random_selection_mask(-(-seq_lens // s), hkv, p_max, k, gen)
    k_max = int(mask.sum(-1).max()) + 1
    n_slots = b * hkv * k_max + 3
    return {
        "q": torch.randn(b, hq, d, generator=gen).to(dtype),
        "kv_slots": torch.randn(n_slots, 2, s, d, generator=gen).to(dtype),
        "selection": pack_bits(mask),
        "slot_list": scattered_slot_list(mask, k_max, n_slots, gen),
        "seq_lens": seq_lens,
        "scale": d**-0.5,
    }


def to_device(args: dict, device: str | torch.device) -> dict:
    """Copy every tensor value of ``args`` to ``device`` (a copy even on the same device)."""
    return {
        k: v.to(device, copy=True) if isinstance(v, torch.Tensor) else v for k, v in args.items()
    }
