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
    ``logits / temperature`` restricted to the ``top_k`` most likely tokens (when > 0) and
    to the smallest set whose probability reaches ``top_p``.
    """
    if params.temperature == 0:
        return int(torch.argmax(logits))
    x = logits.float().cpu() / params.temperature
    if params.top_k and params.top_k > 0:
        kth = torch.topk(x, min(params.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=generator))
