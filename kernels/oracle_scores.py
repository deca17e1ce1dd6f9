"""Exact page scores of the ``oracle`` indexer (evaluation only, no Triton twin: it reads
every key of the context, which is what the sparse path exists to avoid)."""

from __future__ import annotations

import torch


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
