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


def outvoted_head_case() -> dict[str, torch.Tensor]:
    """Issue #18's small case: one KV head, two query heads, ``D = 2``, six pages of two
    tokens (all 12 positions in use).

    Head 0 (``q = (10, 0)``) has logit 10 on both tokens of page 3 and 0 elsewhere, so with
    scale 1 it puts ``2 e^10 / (2 e^10 + 10) = 99.98 %`` of its attention on page 3 and its
    own bound ranks page 3 first; head 1 (``q = (0, 5)``) has logit -10 there and 5
    elsewhere. Every page's keys are equal within the page, so the Quest bound is the logit
    and the group sums are ``[5, 5, 5, 0, 5, 5]``. Returns ``q [1, 2, 2]``, ``kv_pool
    [6, 1, 2, 2, 2]``, ``meta [6, 1, 2, 2]``, ``block_table [1, 6]``, ``num_pages [1]``,
    ``seq_lens [1]`` (CPU, float32 / int32).
    """
    keys = torch.zeros(6, 1, 2, 2)  # [P, Hkv, S, D]
    keys[:, 0, :, 1] = 1.0
    keys[3, 0, :] = torch.tensor([1.0, -2.0])
    return {
        "q": torch.tensor([[[10.0, 0.0], [0.0, 5.0]]]),
        "kv_pool": torch.stack([keys, keys], dim=2),
        "meta": torch.stack([keys.amin(2), keys.amax(2)], dim=2),
        "block_table": torch.arange(6, dtype=torch.int32)[None],
        "num_pages": torch.tensor([6], dtype=torch.int32),
        "seq_lens": torch.tensor([12], dtype=torch.int32),
    }


def quest_inputs(
    b: int, hq: int, hkv: int, d: int, p_max: int, dtype: torch.dtype, seed: int, integer: bool
) -> dict[str, torch.Tensor]:
    """Random ``quest_scores`` arguments: ``q [B, Hq, D]``, sorted ``meta [P_pool, Hkv, 2, D]``,
    a shuffled ``block_table [B, P_max]`` with an unused (-1) tail entry in row 0 and
    ``num_pages [B]`` below ``P_max`` in row 0 (so every case has ``-inf`` pages). With
    ``integer`` the values are small integers, so every fp32 sum is exact in any order and
    many pages tie (the tie-breaks are then compared exactly)."""
    gen = torch.Generator().manual_seed(seed)
    p_pool = b * p_max + 4
    if integer:
        q = torch.randint(-3, 4, (b, hq, d), generator=gen).float()
        meta = torch.randint(-4, 5, (p_pool, hkv, 2, d), generator=gen).float()
    else:
        q = torch.randn(b, hq, d, generator=gen)
        meta = torch.randn(p_pool, hkv, 2, d, generator=gen)
    meta = meta.sort(dim=2).values
    block_table = torch.randperm(p_pool, generator=gen)[: b * p_max].view(b, p_max).int()
    block_table[0, -1] = -1
    num_pages = torch.randint(1, p_max + 1, (b,), generator=gen, dtype=torch.int32)
    num_pages[0] = min(int(num_pages[0]), p_max - 1)
    return {
        "q": q.to(dtype),
        "meta": meta.to(dtype),
        "block_table": block_table,
        "num_pages": num_pages,
    }
