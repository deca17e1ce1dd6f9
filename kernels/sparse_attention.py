"""Sparse decode attention over selected pages (GQA), and the dense reference.

One query token per request. The reduction runs over the selected pages in page-position
order, whatever slots hold them, so the result does not depend on slot placement.
"""

from __future__ import annotations

import torch

from kernels.bitmask import selected_pages


def sparse_decode_attention_ref(
    q: torch.Tensor,
    kv_slots: torch.Tensor,
    selection: torch.Tensor,
    slot_list: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of each request's query over the tokens of its selected pages.

    Parameters
    ----------
    q : ``[B, Hq, D]`` queries (bf16/fp16/fp32)
    kv_slots : ``[N, 2, S, D]`` record slots (``[:, 0]`` keys, ``[:, 1]`` values)
    selection : int32 ``[B, Hkv, W]`` bitmask; the j-th set bit (position order) is the
        page held by ``slot_list[b, h, j]``
    slot_list : int32 ``[B, Hkv, K_max]`` slot per selected page, -1 padded
    seq_lens : int32 ``[B]`` tokens in each context; positions >= seq_len (the unused
        part of the last page) are masked
    scale : softmax scale, usually ``D ** -0.5``

    Returns
    -------
    ``[B, Hq, D]`` in ``q.dtype``; fp32 accumulation, max-subtracted softmax.
    """
    b, hq, d = q.shape
    hkv, k_max = slot_list.shape[1], slot_list.shape[2]
    s = kv_slots.shape[2]
    p_max = selection.shape[-1] * 32
    pages = selected_pages(selection, p_max, k_max).long()  # [B, Hkv, K]
    rec = kv_slots[slot_list.clamp(min=0).long()].float()  # [B, Hkv, K, 2, S, D]
    keys = rec[:, :, :, 0].reshape(b, hkv, k_max * s, d)
    vals = rec[:, :, :, 1].reshape(b, hkv, k_max * s, d)
    pos = pages[..., None] * s + torch.arange(s, device=q.device)  # [B, Hkv, K, S]
    ok = (pages[..., None] >= 0) & (pos < seq_lens.to(q.device).long()[:, None, None, None])
    ok = ok.reshape(b, hkv, 1, k_max * s)
    qg = q.float().view(b, hkv, hq // hkv, d)
    logits = torch.einsum("bhgd,bhtd->bhgt", qg, keys) * scale
    logits = logits.masked_fill(~ok, float("-inf"))
    m = logits.amax(dim=-1, keepdim=True)
    p = torch.exp(logits - m)
    out = torch.einsum("bhgt,bhtd->bhgd", p, vals) / p.sum(dim=-1, keepdim=True)
    return out.reshape(b, hq, d).to(q.dtype)


def dense_decode_attention_ref(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention over every token of each context, read through the block table.

    Independent of the sparse path (uses ``torch.nn.functional.scaled_dot_product_attention``);
    the correctness ladder compares the two.

    Parameters
    ----------
    q : ``[B, Hq, D]``; kv_pool : ``[P_pool, Hkv, 2, S, D]``; block_table : int32
    ``[B, P_max]``; seq_lens : int32 ``[B]``.

    Returns
    -------
    ``[B, Hq, D]`` in ``q.dtype``.
    """
    b, hq, d = q.shape
    _, hkv, _, s, _ = kv_pool.shape
    p_used = int(-(-int(seq_lens.max()) // s))
    table = block_table[:, :p_used].clamp(min=0).long()
    rec = kv_pool[table]  # [B, P, Hkv, 2, S, D]
    keys = rec[:, :, :, 0].permute(0, 2, 1, 3, 4).reshape(b, hkv, p_used * s, d)
    vals = rec[:, :, :, 1].permute(0, 2, 1, 3, 4).reshape(b, hkv, p_used * s, d)
    pos = torch.arange(p_used * s, device=q.device)
    mask = (pos[None, :] < seq_lens.to(q.device).long()[:, None])[:, None, None, :]
    dt = torch.float32 if q.device.type == "cpu" else q.dtype
    out = torch.nn.functional.scaled_dot_product_attention(
        q.to(dt).view(b, hq, 1, d),
        keys.to(dt),
        vals.to(dt),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.view(b, hq, d).to(q.dtype)
