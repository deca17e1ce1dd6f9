"""Next-token sampling per request: greedy at temperature 0, else temperature, top-k and
top-p (nucleus, Holtzman et al. 2019, arXiv:1904.09751) with a per-request seeded
``torch.Generator`` so a job's output depends only on its own seed."""

from __future__ import annotations

import torch

from engine.config import SamplingParams


def make_generator(params: SamplingParams, fallback_seed: int) -> torch.Generator:
    """CPU generator seeded with ``params.seed`` (or ``fallback_seed`` when unset)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(params.seed if params.seed is not None else fallback_seed)
    return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick one token from float32 ``logits [V]``.

    Greedy (argmax, lowest id on ties) when ``temperature == 0``; otherwise softmax of
    ``logits / temperature`` restricted to exactly the ``top_k`` most likely tokens (when
    > 0; among equal logits the lowest ids are kept, so ``top_k=1`` is greedy) and to the
    smallest set whose probability reaches ``top_p`` (ties again in id order).

    Runs on the CPU copy of ``logits`` with tensor operations only (a stable sort, no
    data-dependent Python branches); the CUDA-graph decode step never calls it (it takes
    the greedy argmax on the device), so it adds no device synchronisation there beyond
    the copy of one row of logits.

    Returns
    -------
    int
        The token id, in ``[0, V)``.
    """
    if params.temperature == 0:
        return int(torch.argmax(logits))
    x = logits.float().cpu() / params.temperature
    if params.top_k and 0 < params.top_k < x.numel():
        # stable: among tied logits the lower id comes first, and exactly top_k survive
        keep = torch.sort(x, descending=True, stable=True).indices[: params.top_k]
        x = torch.full_like(x, float("-inf")).scatter(0, keep, x[keep])
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=generator))
