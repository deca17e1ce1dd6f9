"""Selection bitmasks: 32 pages per 32-bit word, page ``i`` at word ``i // 32``, bit ``i % 32``.

Words are stored as ``torch.int32`` holding the uint32 bit pattern (torch's uint32 lacks
most ops); bit 31 is the sign bit.
"""

from __future__ import annotations

import torch

BITS = 32


def num_words(num_pages: int) -> int:
    """W = ceil(P / 32), words needed for ``num_pages`` pages."""
    return -(-num_pages // BITS)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a boolean page mask into words.

    Parameters
    ----------
    mask : bool tensor ``[..., P]``

    Returns
    -------
    int32 tensor ``[..., ceil(P/32)]``
    """
    p = mask.shape[-1]
    w = num_words(p)
    padded = torch.zeros(*mask.shape[:-1], w * BITS, dtype=torch.int64, device=mask.device)
    padded[..., :p] = mask.to(torch.int64)
    weights = torch.ones(BITS, dtype=torch.int64, device=mask.device) << torch.arange(
        BITS, device=mask.device
    )
    words = (padded.view(*mask.shape[:-1], w, BITS) * weights).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_bits(words: torch.Tensor, num_pages: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: int32 ``[..., W]`` -> bool ``[..., num_pages]``."""
    shifts = torch.arange(BITS, device=words.device, dtype=torch.int64)
    bits = (words.to(torch.int64).unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :num_pages].bool()


def selected_pages(words: torch.Tensor, num_pages: int, k_max: int) -> torch.Tensor:
    """Selected page indices in position order.

    Parameters
    ----------
    words : int32 ``[..., W]`` selection bitmask
    num_pages : P, width of the page axis
    k_max : K_max, padded output width (must be >= the most pages selected in any row)

    Returns
    -------
    int32 ``[..., K_max]``: ascending page indices, padded with -1.

    Raises
    ------
    ValueError
        If a row selects more than ``k_max`` pages.
    """
    mask = unpack_bits(words, num_pages)
    count = int(mask.sum(-1).max()) if mask.numel() else 0
    if count > k_max:
        raise ValueError(f"a selection holds {count} pages but k_max={k_max}")
    idx = torch.arange(num_pages, device=words.device, dtype=torch.int64)
    key = torch.where(mask, idx, idx + num_pages)
    width = min(k_max, num_pages)
    ordered = key.sort(dim=-1).values[..., :width]
    pages = torch.where(ordered < num_pages, ordered, torch.full_like(ordered, -1))
    if width < k_max:
        pad = torch.full((*pages.shape[:-1], k_max - width), -1, dtype=pages.dtype, device=pages.device)
        pages = torch.cat([pages, pad], dim=-1)
    return pages.to(torch.int32)
