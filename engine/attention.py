"""Decode attention through the KV hierarchy: plan once per step, run once per layer.

Per layer, for the whole batch (DESIGN.md data path):
append K/V (write-through, metadata) -> indexer scores -> top-k selection bitmask ->
resolve -> gather misses -> sparse attention over slots.

Modes (``EngineConfig``): ``attention=dense`` reads every page from the KV pool with an
independent SDPA implementation; ``attention=sparse`` with ``hierarchical=False`` reads
the selected records straight from a device-resident pool; with ``hierarchical=True``
(the default) it reads them from the hot buffer after resolve and gather. The two sparse
modes run the same attention op in the same page order, so they are bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.kv_cache import KVCache
from kernels.dispatch import Ops


@dataclass
class StepPlan:
    """Per-step tensors shared by every layer (all on the compute device).

    block_table int32 ``[B, P_max]``; seq_lens int32 ``[B]`` (after this step's token);
    num_pages int32 ``[B]``; positions int64 ``[B]`` (the new token's position);
    slab_ids int32 ``[B, Hkv]`` (hierarchical only); hits, misses int64 ``[B]``: records
    found in / loaded into the hot buffer this step, summed over layers (filled by
    :meth:`DecodeAttention.run`); row0: the first row of the cache's token staging buffer
    this plan's rows use (a micro-batch's offset in its step's batch).
    """

    seq_ids: list[int]
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    num_pages: torch.Tensor
    positions: torch.Tensor
    slab_ids: torch.Tensor | None
    step: int | torch.Tensor
    hits: torch.Tensor | None = None
    misses: torch.Tensor | None = None
    row0: int = 0


@dataclass
class LayerStats:
    """Device-side counters for one step: per request hits and misses (records)."""

    hits: torch.Tensor
    misses: torch.Tensor


class DecodeAttention:
    """Runs decode attention for a batch; owns no state beyond the :class:`KVCache`.

    Write-through of the new token (DESIGN.md: the pool stays complete): with the cache's
    decode copy stream (``KVCache.write_stream``, a pinned host pool on CUDA and
    ``decode_write_stream``) a layer appends in three launches — metadata and a device
    staging row on the compute stream; the host-pool write on the copy stream, overlapping
    the rest of the step; the resident tail slot on the compute stream after the gather
    (a tail page the gather loaded before the host write landed gets the token there).
    :meth:`KVCache.join_decode_writes` ends the step. Without deferred writes
    (``KVCache.deferred_writes``), and for the ``oracle`` indexer (which reads the pool in
    the same layer), one launch writes all.

    Parameters
    ----------
    cache : the KV hierarchy; config : engine settings; ops : kernel set
    (:func:`kernels.dispatch.get_ops`); scale : softmax scale; tracer : optional callable
    ``(plan, layer, selection)`` recording selections (``layer`` is the model's layer
    index: a pipeline stage's cache index plus its ``layer_offset``).
    """

    def __init__(self, cache: KVCache, config: EngineConfig, ops: Ops, scale: float, tracer=None):
        self.cache = cache
        self.config = config
        self.ops = ops
        self.scale = scale
        self.tracer = tracer
        self.k_max = config.max_selected_pages
        self.hits: torch.Tensor | None = None
        self.misses: torch.Tensor | None = None

    def plan(
        self, seq_ids: list[int], seq_lens: list[int], step: int, width: int | None = None
    ) -> StepPlan:
        """Build the step's tables. ``seq_lens`` count tokens including the new one;
        ``width`` is the block-table width (default: the batch's most pages), wider
        tables are -1 padded and change no result."""
        dev = self.cache.device
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        num_pages = (lens + self.cache.page_size - 1) // self.cache.page_size
        width = width or int(num_pages.max())
        slabs = self.cache.slab_table(seq_ids) if self.cache.hierarchical else None
        b = len(seq_ids)
        self.hits = torch.zeros(b, dtype=torch.int64, device=dev)
        self.misses = torch.zeros(b, dtype=torch.int64, device=dev)
        return StepPlan(
            seq_ids=seq_ids,
            block_table=self.cache.block_table(seq_ids, width),
            seq_lens=lens.to(dev),
            num_pages=num_pages.to(dev),
            positions=(lens - 1).to(torch.int64).to(dev),
            slab_ids=slabs,
            step=step,
            hits=self.hits,
            misses=self.misses,
        )

    def run(
        self, plan: StepPlan, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Attention output ``[B, Hq, D]`` for queries ``q [B, Hq, D]``; ``k, v [B, Hkv, D]``
        are the new token's key (after RoPE) and value, appended first. ``layer`` indexes
        the cache's layers (the model's layer less ``cache.layer_offset``)."""
        c = self.cache
        hier = c.hierarchical
        cfg = self.config
        deferred = c.deferred_writes and cfg.decode_write_stream and cfg.indexer != "oracle"
        if deferred:
            self.stage_and_write(plan, layer, k, v)
        else:
            self.ops.append_kv(
                k,
                v,
                plan.positions,
                plan.block_table,
                c.pool[layer],
                c.meta[layer],
                c.slots[layer] if hier else None,
                c.page_table[layer] if hier else None,
                plan.slab_ids if hier else None,
            )
        if self.config.attention == "dense":
            return self.ops.dense_decode_attention(
                q, c.pool[layer], plan.block_table, plan.seq_lens, self.scale
            )
        selection = self.select(plan, layer, q)
        if self.tracer is not None:
            self.tracer(plan, layer + c.layer_offset, selection)  # the model's layer index
        if not hier:
            pool = c.pool[layer]
            slot_list = self.ops.resident_slot_list(selection, plan.block_table, self.k_max)
            records = pool.view(-1, *pool.shape[2:])
            return self.ops.sparse_decode_attention(
                q, records, selection, slot_list, plan.seq_lens, self.scale
            )
        slot_list, load_pages, load_slots, hits = self.ops.resolve(
            selection,
            plan.slab_ids,
            c.page_table[layer],
            c.slot_page[layer],
            c.slot_last_use[layer],
            plan.step,
            c.slots_per_slab,
            self.k_max,
        )
        if plan.hits is not None and plan.misses is not None:
            plan.hits += hits.sum(-1)
            plan.misses += (load_slots >= 0).sum((-1, -2))
        if not self.config.skip_host_io:
            self.ops.gather(c.pool[layer], c.slots[layer], plan.block_table, load_pages, load_slots)
        if deferred:  # the token into its resident tail slot, after the gather
            self.ops.append_kv(
                k,
                v,
                plan.positions,
                plan.block_table,
                c.pool[layer],
                None,
                c.slots[layer],
                c.page_table[layer],
                plan.slab_ids,
                write_pool=False,
            )
        return self.ops.sparse_decode_attention(
            q, c.slots[layer], selection, slot_list, plan.seq_lens, self.scale
        )

    def stage_and_write(self, plan: StepPlan, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Update the page metadata and stage ``k, v [B, Hkv, D]`` in the cache's token
        staging rows ``plan.row0 : plan.row0 + B`` (compute stream), then write the staged
        records to the host pool late (:meth:`KVCache.write_late`: on the copy stream,
        after the staging). The write has landed once :meth:`KVCache.join_decode_writes`
        has run."""
        c = self.cache
        b = k.shape[0]
        staging = c.token_staging[layer, plan.row0 : plan.row0 + b]
        pool, table, pos = c.pool[layer], plan.block_table, plan.positions
        self.ops.append_kv(k, v, pos, table, pool, c.meta[layer], write_pool=False, staging=staging)
        k_st, v_st = staging[:, :, 0], staging[:, :, 1]
        c.write_late(lambda: self.ops.append_kv(k_st, v_st, pos, table, pool, None))

    def select(self, plan: StepPlan, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Selection bitmask int32 ``[B, Hkv, W]`` from the configured indexer."""
        cfg = self.config
        c = self.cache
        if cfg.indexer == "dense":
            return self.ops.dense_selection(
                plan.num_pages, c.model.num_kv_heads, plan.block_table.shape[1]
            )
        if cfg.indexer == "oracle":
            scores = self.ops.oracle_scores(
                q, c.pool[layer], plan.block_table, plan.seq_lens, self.scale
            )
        else:
            scores = self.ops.quest_scores(q, c.meta[layer], plan.block_table, plan.num_pages)
        return self.ops.select_topk(
            scores, plan.num_pages, cfg.top_k_pages, cfg.sink_pages, cfg.window_pages
        )
