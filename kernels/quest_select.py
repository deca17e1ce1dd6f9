"""Page scoring and top-k page selection (Quest).

Quest (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference", arXiv:2406.10774) bounds a page's attention logit from above by
``sum_d max(q_d * min_d, q_d * max_d)`` using the element-wise key min and max of the page.
For GQA the bound is summed over the G query heads that share a KV head, so one selection
serves the whole group.
"""

from __future__ import annotations

import torch

from kernels.bitmask import pack_bits


def quest_scores_ref(
    q: torch.Tensor,
    meta: torch.Tensor,
    block_table: torch.Tensor,
    num_pages: torch.Tensor,
) -> torch.Tensor:
    """Quest upper bound per (request, KV head, page).

    Parameters
    ----------
    q : ``[B, Hq, D]`` queries (after RoPE), any float dtype
    meta : ``[P_pool, Hkv, 2, D]`` page metadata (``[:, :, 0]`` key min, ``[:, :, 1]`` key max)
    block_table : int32 ``[B, P_max]`` pool page of each request page (-1 unused)
    num_pages : int32 ``[B]`` pages in use per request

    Returns
    -------
    float32 ``[B, Hkv, P_max]``; ``-inf`` on pages >= ``num_pages``.
    """
    b, hq, d = q.shape
    hkv = meta.shape[1]
    p_max = block_table.shape[1]
    qg = q.float().view(b, hkv, hq // hkv, d)
    pages = meta[block_table.clamp(min=0).long()].float()  # [B, P_max, Hkv, 2, D]
    kmin = pages[:, :, :, 0].permute(0, 2, 1, 3)  # [B, Hkv, P_max, D]
    kmax = pages[:, :, :, 1].permute(0, 2, 1, 3)
    lo = torch.einsum("bhgd,bhpd->bhgpd", qg, kmin)
    hi = torch.einsum("bhgd,bhpd->bhgpd", qg, kmax)
    scores = torch.maximum(lo, hi).sum(dim=(2, 4))  # [B, Hkv, P_max]
    valid = torch.arange(p_max, device=q.device)[None, :] < num_pages.to(q.device)[:, None]
    return scores.masked_fill(~valid[:, None, :], float("-inf"))


def oracle_scores_ref(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Exact page scores for the ``oracle`` indexer: the attention mass of each page.

    Softmax over all valid positions of the true logits ``q.k * scale`` (per query head),
    summed over the page's tokens and the G heads of the group.

    Parameters
    ----------
    q : ``[B, Hq, D]``; kv_pool : ``[P_pool, Hkv, 2, S, D]``; block_table : int32 ``[B, P_max]``;
    seq_lens : int32 ``[B]`` tokens in each context.

    Returns
    -------
    float32 ``[B, Hkv, P_max]``, ``-inf`` on unused pages.
    """
    b, hq, d = q.shape
    _, hkv, _, s, _ = kv_pool.shape
    p_max = block_table.shape[1]
    keys = kv_pool[block_table.clamp(min=0).long(), :, 0].float()  # [B, P_max, Hkv, S, D]
    keys = keys.permute(0, 2, 1, 3, 4).reshape(b, hkv, p_max * s, d)
    qg = q.float().view(b, hkv, hq // hkv, d)
    logits = torch.einsum("bhgd,bhtd->bhgt", qg, keys) * scale
    pos = torch.arange(p_max * s, device=q.device)
    valid_tok = pos[None, :] < seq_lens.to(q.device)[:, None]  # [B, T]
    logits = logits.masked_fill(~valid_tok[:, None, None, :], float("-inf"))
    mass = torch.softmax(logits, dim=-1).view(b, hkv, -1, p_max, s).sum(dim=(2, 4))
    num_pages = -(-seq_lens.to(q.device) // s)
    valid = torch.arange(p_max, device=q.device)[None, :] < num_pages[:, None]
    return mass.masked_fill(~valid[:, None, :], float("-inf"))


def select_topk_ref(
    scores: torch.Tensor,
    num_pages: torch.Tensor,
    top_k_pages: int,
    sink_pages: int,
    window_pages: int,
) -> torch.Tensor:
    """Top-k pages per (request, KV head) as a selection bitmask.

    The sink pages (the first ``sink_pages``) and the local window (the last
    ``window_pages``, tail page included) are always selected; the rest of the budget of
    ``top_k_pages`` goes to the highest-scoring other pages. When a context has no more
    than ``top_k_pages`` pages every page is selected, so no page is lost to rounding.
    Ties are broken towards the lower page index (``torch.topk`` over a stable key).

    Parameters
    ----------
    scores : float32 ``[B, Hkv, P_max]`` (``-inf`` on unused pages)
    num_pages : int32 ``[B]``

    Returns
    -------
    int32 ``[B, Hkv, ceil(P_max/32)]`` bitmask.
    """
    b, hkv, p_max = scores.shape
    idx = torch.arange(p_max, device=scores.device)[None, :]
    n = num_pages.to(scores.device).long()[:, None]
    valid = idx < n
    forced = valid & ((idx < sink_pages) | (idx >= n - window_pages))
    budget = torch.maximum(torch.clamp(n, max=top_k_pages), forced.sum(-1, keepdim=True))
    key = scores.float().masked_fill(forced[:, None, :], float("inf"))
    key = key.masked_fill(~valid[:, None, :], float("-inf"))
    k = min(max(top_k_pages, sink_pages + window_pages), p_max)
    # Stable order: sort descending by score, ascending by index on ties.
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :k]
    rank = torch.arange(k, device=scores.device)[None, None, :]
    keep = (rank < budget[:, :, None]).expand(b, hkv, k)
    mask = torch.zeros(b, hkv, p_max, dtype=torch.bool, device=scores.device)
    mask.scatter_(-1, order, keep)
    return pack_bits(mask & valid[:, None, :])


def dense_selection(num_pages: torch.Tensor, num_kv_heads: int, p_max: int) -> torch.Tensor:
    """Bitmask selecting every used page (the ``dense`` indexer): int32 ``[B, Hkv, W]``."""
    idx = torch.arange(p_max, device=num_pages.device)[None, :]
    mask = idx < num_pages.long()[:, None]
    return pack_bits(mask[:, None, :].expand(-1, num_kv_heads, -1))
