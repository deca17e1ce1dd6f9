"""The CPU direct decode path's per-layer chain, with the step's index tensors built once.

On a CPU with ``cpu_direct_reads`` (:attr:`engine.decode.attention.DecodeAttention.direct`)
every layer of a decode step runs RoPE + append, the Quest scores, the top-k, the slots
and the sparse attention over the same block table, sequence lengths and positions. The
reference ops that chain is made of — :func:`kernels.rope_append.rope_append_ref`,
:func:`kernels.quest_scores.quest_scores_matmul`,
:func:`kernels.select_topk.select_topk_pages_ref`,
:func:`kernels.slot_list.resident_slots_of_pages` and
:func:`kernels.sparse_attention.sparse_decode_attention_ref` — each rebuild the index
tensors those inputs imply (page validity, forced pages, budgets, pool pages of the new
token, position masks), each a dispatched ATen call of a few microseconds on a 2-core CPU.

:class:`DirectTables` builds them once a step; :func:`direct_layer` runs the chain's
arithmetic — the same ops on the same values in the same order — on them. On the embedded
model at 8K the profiler's ATen calls per decode step fell from 18,446 to 10,540 and the
profiled step from 39.0 to 30.0 ms (``scripts/bench_cpu_llamacpp.py --profile-steps 8``;
docs/performance.md, "CPU decode: one chain a layer, fp16 LM head"). Its outputs, the pool and the
metadata it writes are bit-identical to the reference chain's
(``tests/engine/test_cpu_direct_chain.py``), which stays the oracle. Rewrites that keep
the values but not the ops one for one: q and k are rotated in one pass of the same
element-wise ops (cos and sin from the first layer); the new token is written by row with
Python ints (a CPU read costs nothing) instead of advanced indexing; a padded selection
entry reads some record instead of record 0 (both are masked: logits to ``-inf`` and values
to 0 either way); the final ``-inf`` fill of invalid pages' scores is left to the top-k's
own override, which writes the same ``-inf`` there; casts to the dtype a tensor already
has are skipped; and a single request on consecutive pool pages reads its metadata in
place (a slice with the strides of the gathered copy).

This is plain PyTorch, not a kernel: the GPU runs the Triton kernels of each op, which
this module does not touch.
"""

from __future__ import annotations

import math

import torch

from kernels.quest_scores import combine_group_ref
from kernels.rope_append import RopeParams, _step_cos_sin


class DirectTables:
    """The index tensors of one decode step that every layer's chain shares.

    Parameters
    ----------
    block_table : int32 ``[B, P_max]`` pool page of each request page (-1 unused)
    seq_lens : int32 ``[B]`` tokens in each context, the new token included
    num_pages : int32 ``[B]`` pages in use
    positions : int64 ``[B]`` the new token's position
    page_size : S, tokens per page; num_kv_heads : Hkv
    top_k_pages, sink_pages, window_pages, k_max : the top-k rule's settings, as
        :func:`kernels.select_topk.select_topk_pages_ref`

    Raises
    ------
    ValueError
        If a row would select more than ``k_max`` pages (the reference's error).
    """

    def __init__(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        num_pages: torch.Tensor,
        positions: torch.Tensor,
        page_size: int,
        num_kv_heads: int,
        top_k_pages: int,
        sink_pages: int,
        window_pages: int,
        k_max: int,
    ):
        b, p_max = block_table.shape
        dev = block_table.device
        self.b, self.p_max, self.s, self.hkv, self.k_max = b, p_max, page_size, num_kv_heads, k_max
        self.positions = positions
        self.num_pages = num_pages
        pos = positions.long()
        page = pos // page_size
        self.bt_long = block_table.long()
        pool_page = self.bt_long[torch.arange(b, device=dev), page]
        # (pool page, offset in page) of each row's new token, as Python ints
        self.rows = list(zip(pool_page.tolist(), (pos % page_size).tolist(), strict=True))
        idx = torch.arange(p_max, device=dev)[None, :]
        n = num_pages.long()[:, None]
        valid = idx < n
        forced = valid & ((idx < sink_pages) | (idx >= n - window_pages))
        budget = torch.maximum(torch.clamp(n, max=top_k_pages), forced.sum(-1, keepdim=True))
        self.invalid = (~valid)[:, None, :]  # [B, 1, P_max]
        self.override = (forced | ~valid)[:, None, :]
        inf = torch.tensor(math.inf, device=dev)
        self.override_value = torch.where(forced, inf, -inf)[:, None, :]
        k = min(max(top_k_pages, sink_pages + window_pages), p_max)
        if k > k_max and b and int(budget.max()) > k_max:
            raise ValueError(f"a selection holds {int(budget.max())} pages but k_max={k_max}")
        self.k = min(k, k_max)
        self.drop = torch.arange(self.k, device=dev)[None, None, :] >= budget[:, :, None]
        self.pool_pages = block_table.clamp(min=0).long()  # -1 (unused) read as page 0
        self.meta_index = self.pool_pages.reshape(-1)
        # One request on consecutive pool pages (a fresh pool's layout): the metadata of
        # its pages is a slice of the pool's, read in place instead of gathered.
        self.meta_start: int | None = None
        if b == 1 and p_max:
            first = int(self.bt_long[0, 0])
            consecutive = self.bt_long[0] == torch.arange(first, first + p_max, device=dev)
            if first >= 0 and bool(consecutive.all()):
                self.meta_start = first
        self.heads = torch.arange(num_kv_heads, device=dev)[None, :, None]
        self.offsets = torch.arange(page_size, device=dev)
        self.lens = seq_lens.long()[:, None, None, None]
        self._rope: tuple | None = None

    def rope_rows(self, rope: RopeParams, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[B, 1, D]`` in ``dtype`` at the step's positions
        (:func:`kernels.rope_append.rope_cos_sin_ref`), computed by the first layer."""
        if self._rope is None or self._rope[0] is not rope or self._rope[1] != dtype:
            cos, sin = _step_cos_sin(self.positions, rope, dtype)
            self._rope = (rope, dtype, cos[:, None, :], sin[:, None, :])
        return self._rope[2], self._rope[3]


def _f32(x: torch.Tensor) -> torch.Tensor:
    """``x.float()`` without the call when ``x`` is float32 already (the same tensor)."""
    return x if x.dtype == torch.float32 else x.float()


def _append(
    tables: DirectTables,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_pool: torch.Tensor,
    meta: torch.Tensor,
) -> None:
    """:func:`kernels.append_kv.append_kv_ref` without a hot buffer, staging or fp8: row
    by row into the pool page and metadata the tables name."""
    kn = k.to(meta.dtype)
    for i, (pp, off) in enumerate(tables.rows):
        kv_pool[pp, :, :, off] = torch.stack([k[i], v[i]], dim=1)
        mm = meta[pp]  # [Hkv, 2, D]
        if off == 0:  # a page's first token initialises its min and max
            mm.copy_(kn[i][:, None, :].expand_as(mm))
        else:
            lo, hi = mm[:, 0], mm[:, 1]
            torch.minimum(lo, kn[i], out=lo)
            torch.maximum(hi, kn[i], out=hi)


def direct_layer(
    tables: DirectTables,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: RopeParams,
    kv_pool: torch.Tensor,
    meta: torch.Tensor,
    scale: float,
    combine: str,
    hits: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer of the CPU direct chain: RoPE of ``q`` and ``k``, append of the new token,
    Quest scores (the CPU's GEMM form), top-k pages, and sparse attention over their
    records read in place from the pool.

    Parameters
    ----------
    tables : the step's :class:`DirectTables`
    q : ``[B, Hq, D]`` queries before RoPE; k, v : ``[B, Hkv, D]`` the new key (before
        RoPE) and value (any strides)
    rope : the RoPE table
    kv_pool : ``[P_pool, Hkv, 2, S, D]`` this layer's pool (float32 / bf16 records)
    meta : ``[P_pool, Hkv, 2, D]`` this layer's page metadata (key min, max)
    scale : softmax scale; combine : the Quest group rule (``GROUP_COMBINES``)
    hits : int64 ``[B]``, when given, gains the records each row read

    Returns
    -------
    ``[B, Hq, D]`` in ``q.dtype``: bit-identical to ``rope_append_ref`` (pool and metadata
    too), ``quest_scores_matmul``, ``select_topk_pages_ref``, ``resident_slots_of_pages``
    and ``sparse_decode_attention_ref`` in a row.
    """
    t = tables
    b, hq, d = q.shape
    hkv, s, p_max = t.hkv, t.s, t.p_max
    g = hq // hkv
    # RoPE of q and k in one pass (rotate_half_ref's element-wise ops on both at once)
    cos, sin = t.rope_rows(rope, q.dtype)
    qk = torch.cat([q, k], dim=1)
    half = d // 2
    qk = qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * sin
    q, k = qk[:, :hq], qk[:, hq:]
    _append(t, k, v, kv_pool, meta)
    # Quest bounds as one GEMM (quest_head_bounds_matmul), then the group rule
    qf = _f32(q).view(b, hkv, g, d)
    q_pm = torch.cat([qf.clamp(max=0), qf.clamp(min=0)], dim=-1)
    flat_meta = meta.reshape(meta.shape[0], hkv, 2 * d)
    if t.meta_start is not None:  # the same values, with the gathered copy's strides
        pages_meta = _f32(flat_meta[t.meta_start : t.meta_start + p_max])
    else:
        pages_meta = _f32(flat_meta.index_select(0, t.meta_index))
    pages_meta = pages_meta.view(b, p_max, hkv, 2 * d).permute(0, 2, 3, 1)
    bounds = torch.matmul(q_pm, pages_meta).view(b, hq, p_max).masked_fill_(t.invalid, -math.inf)
    if combine == "normmax":
        x = bounds.view(b, hkv, g, p_max) * scale
        scores = x.sub_(torch.logsumexp(x, dim=-1, keepdim=True)).amax(dim=2)
    else:
        scores = combine_group_ref(bounds, t.num_pages, hkv, combine, scale)
    # top-k: forced pages first, then by score (stable), the budget kept, position order
    key = torch.where(t.override, t.override_value, scores)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., : t.k]
    pages = order.masked_fill_(t.drop, p_max).sort(dim=-1).values  # padding: P_max
    if t.k < t.k_max:
        pages = torch.nn.functional.pad(pages, (0, t.k_max - t.k), value=p_max)
    if hits is not None:
        hits += (pages < p_max).sum((-1, -2))
    kk = pages.shape[-1]
    pool_page = t.pool_pages.gather(1, pages.clamp(max=p_max - 1).view(b, hkv * kk))
    idx = (pool_page.view(b, hkv, kk) * hkv + t.heads).view(-1)
    # sparse attention over the selected records (sparse_decode_attention_ref)
    flat = kv_pool.view(-1, 2, s * d)
    keys = _f32(flat[:, 0].index_select(0, idx)).view(b, hkv, kk * s, d)
    logits = torch.matmul(qf, keys.transpose(-1, -2)) * scale
    bad = ((pages[..., None] * s + t.offsets) >= t.lens).reshape(b, hkv, 1, kk * s)
    logits.masked_fill_(bad, float("-inf"))
    m = logits.amax(dim=-1, keepdim=True)
    p = logits.sub_(m).exp_()
    vals = _f32(flat[:, 1].index_select(0, idx)).view(b, hkv, kk * s, d)
    vals.view(-1, d).index_fill_(0, bad.reshape(-1).nonzero().squeeze(1), 0.0)
    out = torch.matmul(p, vals) / p.sum(dim=-1, keepdim=True)
    out = out.reshape(b, hq, d)
    return out if out.dtype == q.dtype else out.to(q.dtype)
