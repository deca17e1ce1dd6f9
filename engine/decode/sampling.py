"""Next-token sampling per request: greedy at temperature 0, else temperature, top-k and
top-p (nucleus, Holtzman et al. 2019, arXiv:1904.09751) with a per-request seeded
``torch.Generator`` so a job's output depends only on its own seed. A request held to a
grammar (:mod:`engine.decode.json_constraint`) passes its allowed-token mask: the other
tokens' logits become ``-inf`` before any of that (as llama.cpp's grammar sampler and
vLLM's structured outputs mask the logits first)."""

from __future__ import annotations

import torch

from engine.config import SamplingParams

GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily (as vLLM's ``_SAMPLING_EPS``): dividing float32
logits by a smaller one (1e-300 is 0 in float32) overflows to inf and nan."""


def make_generator(params: SamplingParams, fallback_seed: int) -> torch.Generator:
    """CPU generator seeded with ``params.seed`` (or ``fallback_seed`` when unset)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(params.seed if params.seed is not None else fallback_seed)
    return g


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``logits [..., V]`` with ``-inf`` where bool ``allowed [..., V]`` is false (a new
    tensor on ``logits``' device; ``allowed`` may live on the host)."""
    keep = allowed.to(logits.device, non_blocking=True)
    return logits.masked_fill(~keep, float("-inf"))


def masked_greedy(
    logits: torch.Tensor, greedy: torch.Tensor, allowed: dict[int, torch.Tensor]
) -> torch.Tensor:
    """``greedy`` int64 ``[B]`` (the argmax of float ``logits [B, V]``) with each row ``i``
    of ``allowed`` (row -> bool ``[V]``) replaced by the argmax over its allowed tokens
    (lowest id on ties, as ``torch.argmax``). Other rows keep their token. Returns a new
    tensor on ``greedy``'s device.

    On the CPU a row whose unmasked argmax is allowed keeps it (the same token: the lowest
    id of the row's maximum is then also the lowest allowed one), so only rows the mask
    overrules pay for a masked argmax over ``V``. On a GPU the rows' masks go up in one
    ``[len(allowed), V]`` copy and one masked argmax runs on the device (no sync)."""
    if logits.device.type == "cpu":
        out = greedy.clone()
        for i, keep in allowed.items():
            if not bool(keep[int(greedy[i])]):
                out[i] = mask_logits(logits[i], keep).argmax()
        return out
    rows = sorted(allowed)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    mask = torch.stack([allowed[i] for i in rows])
    picked = mask_logits(logits.index_select(0, index), mask).argmax(dim=-1)
    return greedy.index_copy(0, index, picked.to(greedy.dtype))


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    allowed: torch.Tensor | None = None,
) -> int:
    """Pick one token from float32 ``logits [V]`` (among bool ``allowed [V]`` when given:
    the others' logits are ``-inf`` first).

    Greedy (argmax, lowest id on ties) when ``temperature`` is under
    :data:`GREEDY_BELOW` (0 included); otherwise softmax of
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
    if allowed is not None:
        logits = mask_logits(logits, allowed)
    if params.temperature < GREEDY_BELOW:  # the limit of sampling as temperature -> 0
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
        keep[0] = True  # the most likely token always (a top_p under float32's least is 0)
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=generator))
