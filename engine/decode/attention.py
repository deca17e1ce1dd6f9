"""Decode attention through the KV hierarchy: plan once per step, run once per layer.

Per layer, for the whole batch (DESIGN.md data path):
append K/V (write-through, metadata) -> indexer scores -> top-k selection bitmask ->
resolve -> gather misses -> sparse attention over slots.

Modes (``EngineConfig``): ``attention=dense`` reads every page from the KV pool with an
independent SDPA implementation; ``attention=sparse`` with ``hierarchical=False`` reads
the selected records straight from a device-resident pool; with ``hierarchical=True``
(the default) it reads them from the hot buffer after resolve and gather. The two sparse
modes run the same attention op in the same page order, so they are bit-identical.
On a CPU device with ``cpu_direct_reads`` the hierarchical cache is read like the
resident pool (:attr:`DecodeAttention.direct`): the host pool is the compute device's
RAM there, so resolve and gather would only copy records the attention can read in place.

Sliding-window layers (Gemma 2/3: ``windows[layer]`` tokens) keep their window in both
modes: attention masks every position before ``seq_len - window`` (the kernels' ``window``
argument), and in sparse mode the indexer's scores of pages wholly before the window are
set to ``-inf``, no sink pages are forced and the pages before the window are cleared
from the selection (:meth:`DecodeAttention.in_window`), so only pages inside the window
are resolved, gathered and read (a context whose window pages fit the budget gets all
of them: dense over its window).
Attention logit soft-capping (Gemma 2, ``softcap``) is applied by the attention op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.decode import indexers
from engine.decode.cpu_direct import DirectTables, direct_layer
from engine.kv.cache import KVCache
from kernels.bitmask import pack_bits
from kernels.dispatch import PYTORCH_OPS, Ops
from kernels.quest_scores import quest_scores_matmul
from kernels.rope_append import RopeParams
from kernels.select_topk import select_topk_pages_ref
from kernels.slot_list import resident_slots_of_pages
from kernels.superpage_select import num_candidates


@dataclass
class StepPlan:
    """Per-step tensors shared by every layer (all on the compute device).

    block_table int32 ``[B, P_max]``; seq_lens int32 ``[B]`` (after this step's token);
    num_pages int32 ``[B]``; positions int64 ``[B]`` (the new token's position);
    slab_ids int32 ``[B, Hkv]`` (hierarchical only); hits, misses int64 ``[B]``: records
    found in / loaded into the hot buffer this step, summed over layers (filled by
    :meth:`DecodeAttention.run`); prefetched int64 ``[B]``: records loaded by prefetch this
    step (:meth:`DecodeAttention.prefetch`); row0: the first row of the cache's token
    staging buffer this plan's rows use (a micro-batch's offset in its step's batch);
    direct_tables: the CPU direct chain's shared index tensors
    (:class:`engine.decode.cpu_direct.DirectTables`), built by the step's first layer;
    link_turns: shared by a step's two micro-batches on two CUDA streams, so that their
    gathers take turns on the host link (:class:`LinkTurns`); ``None``: no ordering.
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
    prefetched: torch.Tensor | None = None
    row0: int = 0
    direct_tables: DirectTables | None = None
    link_turns: LinkTurns | None = None


class LinkTurns:
    """The host link taken in turns by the gathers of a step's micro-batches.

    With ``decode_overlap`` two micro-batches run the same chain of kernels on two CUDA
    streams, and the GPU runs them in near lockstep: their gathers of a layer start
    together, share the link, and each waits twice as long, while neither chain has other
    work to overlap. Issued layer by layer in alternation (:meth:`Engine.decode_batch`),
    each gather waits for the previously issued one (the other micro-batch's) to finish
    (a CUDA event; inside a captured graph, an edge), so one gather has the whole link
    while the other micro-batch computes. Only the order of the gathers changes: each
    reads and writes the same bytes, so results are bit-identical.
    """

    def __init__(self) -> None:
        self.last: torch.cuda.Event | None = None

    def wait(self) -> None:
        """Make the current stream wait for the last gather issued."""
        if self.last is not None:
            torch.cuda.current_stream().wait_event(self.last)

    def done(self) -> None:
        """Mark the gather just issued on the current stream as the last one."""
        event = torch.cuda.Event()
        event.record()
        self.last = event


@dataclass
class LayerStats:
    """Device-side counters for one step: per request hits and misses (records)."""

    hits: torch.Tensor
    misses: torch.Tensor


class DecodeAttention:
    """Runs decode attention for a batch; owns no state beyond the :class:`KVCache`.

    Write-through of the new token (DESIGN.md: the pool stays complete): with the cache's
    copy stream (``KVCache.late_stream``, a pinned host pool on CUDA and
    ``decode_write_stream``) a layer appends in three launches — metadata and a device
    staging row on the compute stream; the host-pool write on the copy stream, overlapping
    the rest of the step; the resident tail slot on the compute stream after the gather
    (a tail page the gather loaded before the host write landed gets the token there).
    :meth:`KVCache.join_late` ends the step. Without deferred writes
    (``KVCache.deferred_writes``), and for the ``oracle`` indexer (which reads the pool in
    the same layer), one launch writes all.

    Prefetch (``prefetch_pages`` = m > 0, hierarchical): after a layer's attention, the
    same layer's indexer scores rank ``K_max + m`` pages (:meth:`prefetch`); a second
    resolve of that wider selection with the same step stamp finds the ``K_max``
    selected pages resident (hits: no eviction can touch them) and loads the near misses
    that are not, evicting only least-recently-used slots outside the wider selection.
    Nothing else reads or writes this layer's hot buffer until the next step's same
    layer, so on CUDA the whole prefetch runs on the copy stream beside the following
    layers; the join at the step's end orders it before the next step. Attention always
    reads the records of the top-``K_max`` selection, from whichever slots hold them, so
    outputs are bit-identical with and without prefetch; only where records come from
    changes (fewer misses on the next step if the ranking holds, more host traffic if
    not). :attr:`prefetched` counts the records loaded this way, per request, like
    :attr:`misses`.

    Parameters
    ----------
    cache : the KV hierarchy; config : engine settings; ops : kernel set
    (:func:`kernels.dispatch.get_ops`); scale : softmax scale; tracer : optional callable
    ``(plan, layer, selection)`` recording selections (``layer`` is the model's layer
    index: a pipeline stage's cache index plus its ``layer_offset``); softcap : attention
    logit soft-cap (``None``: off); windows : per cache layer, the sliding window in tokens
    or ``None`` (a full-attention layer); ``None``: no window anywhere.
    """

    def __init__(
        self,
        cache: KVCache,
        config: EngineConfig,
        ops: Ops,
        scale: float,
        tracer=None,
        softcap: float | None = None,
        windows: list[int | None] | None = None,
    ):
        self.cache = cache
        self.config = config
        self.ops = ops
        self.scale = scale
        self.softcap = softcap
        self.windows = list(windows) if windows is not None else None
        self.tracer = tracer
        self.k_max = config.max_selected_pages
        self.hits: torch.Tensor | None = None
        self.misses: torch.Tensor | None = None
        self.indexer = indexers.get(config.indexer)
        self.num_candidates = num_candidates(
            config.top_k_pages, config.superpage_pages, config.superpage_oversample
        )
        self.direct = (
            cache.hierarchical
            and config.cpu_direct_reads
            and cache.device.type == "cpu"
            and not cache.host_fp8
        )
        """Read the selected records straight from the host pool (``cpu_direct_reads`` on a
        CPU device, bf16/kv_dtype records): no resolve, no gather, the hot buffer unused;
        every selected record counts as a hit."""
        self.prefetch_pages = (
            config.prefetch_pages
            if cache.hierarchical
            and config.attention == "sparse"
            and self.indexer.ranks
            and not self.direct
            else 0
        )
        # The direct path without bitmasks: a ranking indexer and the reference ops (a
        # run that forces Triton on the CPU keeps the kernels' bitmask path).
        self.fast_direct = self.direct and self.indexer.ranks and ops.name in PYTORCH_OPS
        # Its whole chain on the step's shared tables (engine.decode.cpu_direct): Quest
        # scored as the CPU ops' GEMM, records as stored (no fp8 rounding).
        self.chain_direct = (
            self.fast_direct
            and config.indexer == "quest"
            and ops.quest_scores is quest_scores_matmul
            and not cache.fp8
        )
        self.prefetched: torch.Tensor | None = None
        # Audit (engine.decode.audit): run() appends (cache layer, plan.row0, q [b, Hq, D],
        # selection [b, Hkv, W]) of every layer here — references, not copies; None: off.
        self.capture: list[tuple[int, int, torch.Tensor, torch.Tensor]] | None = None
        if self.prefetch_pages:
            cache.enable_late_stream()

    def fp8_args(self, layer: int) -> dict:
        """The append's fp8 keywords for ``layer``: rounding and the host pool's exponents
        (``kv_host_dtype=fp8``), and the hot buffer's (``hot_buffer_dtype=fp8``)."""
        c = self.cache
        if not c.fp8:
            return {}
        args = {"fp8": True, "pool_scale": c.pool_scale[layer]}
        if c.hot_fp8:
            args["slot_scale"] = c.slot_scale[layer]
        return args

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
        self.prefetched = torch.zeros(b, dtype=torch.int64, device=dev)
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
            prefetched=self.prefetched,
        )

    def run(
        self,
        plan: StepPlan,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: RopeParams | None = None,
    ) -> torch.Tensor:
        """Attention output ``[B, Hq, D]`` for queries ``q [B, Hq, D]``; ``k, v [B, Hkv, D]``
        are the new token's key and value, appended first. ``layer`` indexes the cache's
        layers (the model's layer less ``cache.layer_offset``). Without ``rope`` q and k
        are after RoPE; with it they are before, and the append rotates both
        (``ops.rope_append``: one kernel for the RoPE and the append)."""
        c = self.cache
        hier = c.hierarchical and not self.direct  # the hot buffer is read and written
        cfg = self.config
        if (
            self.chain_direct
            and rope is not None
            and cfg.attention == "sparse"
            and not self.window(layer)
            and not self.two_level(layer)
            and self.tracer is None
            and self.capture is None
        ):
            return self.run_chain(plan, layer, q, k, v, rope)
        if c.fp8:  # fp8 rounding starts from kv_dtype, as the prefill's does
            k, v = k.to(c.dtype), v.to(c.dtype)
        fp8 = self.fp8_args(layer)
        deferred = c.deferred_writes and cfg.decode_write_stream and not self.indexer.reads_pool
        if deferred:
            q, k = self.stage_and_write(plan, layer, k, v, q, rope)
        elif rope is not None:
            q, k = self.ops.rope_append(
                q,
                k,
                v,
                plan.positions,
                rope,
                plan.block_table,
                c.pool[layer],
                c.meta[layer],
                c.slots[layer] if hier else None,
                c.page_table[layer] if hier else None,
                plan.slab_ids if hier else None,
                **fp8,
            )
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
                **fp8,
            )
        window = self.window(layer)
        if self.config.attention == "dense":
            return self.ops.dense_decode_attention(
                q, c.pool[layer], plan.block_table, plan.seq_lens, self.scale,
                self.softcap, window,
            )  # fmt: skip
        if (
            self.fast_direct
            and not window
            and not self.two_level(layer)  # superpage selection keeps its bitmask route
            and self.tracer is None
            and self.capture is None
        ):
            return self.run_direct(plan, layer, q)
        scores = self.scores(plan, layer, q)
        selection = self.select(plan, layer, q, scores)
        if self.tracer is not None:
            self.tracer(plan, layer + c.layer_offset, selection)  # the model's layer index
        if self.capture is not None:  # kept alive: inside a CUDA graph, a static buffer
            self.capture.append((layer, plan.row0, q, selection))
        if not hier:
            pool = c.pool[layer]
            slot_list = self.ops.resident_slot_list(selection, plan.block_table, self.k_max)
            if self.direct and plan.hits is not None:
                plan.hits += (slot_list >= 0).sum((-1, -2))
            records = pool.view(-1, *pool.shape[2:])
            return self.ops.sparse_decode_attention(
                q, records, selection, slot_list, plan.seq_lens, self.scale, self.softcap, window
            )
        slot_list, _, _ = self.load(
            plan, layer, selection, self.k_max, count=True, turns=plan.link_turns
        )
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
                **fp8,
            )
        hot = {"slot_scale": c.slot_scale[layer], "kv_dtype": c.dtype} if c.hot_fp8 else {}
        out = self.ops.sparse_decode_attention(
            q, c.slots[layer], selection, slot_list, plan.seq_lens, self.scale, self.softcap,
            window, **hot,
        )  # fmt: skip
        if self.prefetch_pages and scores is not None:
            self.prefetch(plan, layer, scores)
        return out

    def run_chain(
        self, plan: StepPlan, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        rope: RopeParams,
    ) -> torch.Tensor:
        """:meth:`run` on the CPU direct path as one chain (:attr:`chain_direct`: Quest with
        the CPU ops, full-attention layers of flat metadata, RoPE fused, no tracer or audit
        capture): :func:`engine.decode.cpu_direct.direct_layer` over the step's
        :class:`~engine.decode.cpu_direct.DirectTables`, built by the plan's first layer.
        Bit-identical to the append + :meth:`run_direct` route it replaces."""
        c, cfg = self.cache, self.config
        if plan.direct_tables is None:
            plan.direct_tables = DirectTables(
                plan.block_table, plan.seq_lens, plan.num_pages, plan.positions, c.page_size,
                c.model.num_kv_heads, cfg.top_k_pages, cfg.sink_pages, cfg.window_pages,
                self.k_max,
            )  # fmt: skip
        return direct_layer(
            plan.direct_tables, q, k, v, rope, c.pool[layer], c.meta[layer], self.scale,
            cfg.group_combine, plan.hits,
        )  # fmt: skip

    def run_direct(self, plan: StepPlan, layer: int, q: torch.Tensor) -> torch.Tensor:
        """:meth:`run`'s selection and attention on the CPU direct path (:attr:`direct`,
        full-attention layers of flat page metadata, no tracer or audit capture; the other
        cases take the bitmask route over the same pool): the top-k pages as indices
        (:func:`kernels.select_topk.select_topk_pages_ref`, no bitmask), their records
        read in place from the host pool (slot ``pool_page * Hkv + h``). The same pages in
        the same order as the bitmask path, so the same bits; every selected record is
        counted as a hit."""
        c, cfg = self.cache, self.config
        scores = self.scores(plan, layer, q)
        pages = select_topk_pages_ref(
            scores, plan.num_pages, cfg.top_k_pages, self.sink_pages(layer),
            cfg.window_pages, self.k_max,
        )  # fmt: skip
        slots = resident_slots_of_pages(pages, plan.block_table)
        if plan.hits is not None:
            plan.hits += (pages >= 0).sum((-1, -2))
        pool = c.pool[layer]
        records = pool.view(-1, *pool.shape[2:])
        return self.ops.sparse_decode_attention(
            q, records, None, slots, plan.seq_lens, self.scale, self.softcap, pages=pages
        )

    def prefetch(self, plan: StepPlan, layer: int, scores: torch.Tensor) -> None:
        """Load the near misses of ``scores`` (float32 ``[B, Hkv, P_max]``, this step's
        ranking of ``layer``) into the hot buffer, late (:meth:`KVCache.run_late`: on the
        copy stream after the work issued so far, this layer's attention included): the
        top ``K_max + prefetch_pages`` selection is resolved with this step's stamp and its
        misses gathered. Adds the records loaded to ``plan.prefetched``."""
        cfg = self.config
        k_ext = self.k_max + self.prefetch_pages

        def work() -> None:
            wide = self.ops.select_topk(
                scores, plan.num_pages, k_ext, self.sink_pages(layer), cfg.window_pages
            )
            wide = self.in_window(plan, layer, wide)
            _, _, load_slots = self.load(plan, layer, wide, k_ext)
            if plan.prefetched is not None:
                plan.prefetched += (load_slots >= 0).sum((-1, -2))

        self.cache.run_late(work, keep=(scores,))

    def load(
        self, plan: StepPlan, layer: int, selection: torch.Tensor, k_max: int,
        count: bool = False, turns: LinkTurns | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Resolve ``selection`` (int32 ``[B, Hkv, W]``, at most ``k_max`` pages a row)
        against ``layer``'s hot buffer with this step's stamp, then gather its misses from
        the pool (skipped with ``skip_host_io``). Returns the resolve's ``slot_list`` and
        ``load_slots`` (int32 ``[B, Hkv, k_max]``) and ``hits`` (int32 ``[B, Hkv]``); see
        :func:`kernels.resolve.resolve_ref`. With ``count`` the resolve adds its hits and
        misses to ``plan.hits`` / ``plan.misses`` (in the same launch on the GPU). With
        ``turns`` the gather waits for the last one issued and becomes the last one
        (:class:`LinkTurns`)."""
        c = self.cache
        acc = {}
        if count and plan.hits is not None and plan.misses is not None:
            acc = {"hits_acc": plan.hits, "misses_acc": plan.misses}
        slot_list, load_pages, load_slots, hits = self.ops.resolve(
            selection,
            plan.slab_ids,
            c.page_table[layer],
            c.slot_page[layer],
            c.slot_last_use[layer],
            plan.step,
            c.slots_per_slab,
            k_max,
            **acc,
        )
        if not self.config.skip_host_io:
            scale = {"pool_scale": c.pool_scale[layer]} if c.host_fp8 else {}
            if c.hot_fp8:
                scale["slot_scale"] = c.slot_scale[layer]
            if turns is not None:
                turns.wait()
            self.ops.gather(
                c.pool[layer], c.slots[layer], plan.block_table, load_pages, load_slots, **scale
            )
            if turns is not None:
                turns.done()
        return slot_list, hits, load_slots

    def stage_and_write(
        self,
        plan: StepPlan,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        q: torch.Tensor | None = None,
        rope: RopeParams | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Update the page metadata and stage ``k, v [B, Hkv, D]`` in the cache's token
        staging rows ``plan.row0 : plan.row0 + B`` (compute stream), then write the staged
        records to the host pool late (:meth:`KVCache.run_late`: on the copy stream,
        after the staging). The write has landed once :meth:`KVCache.join_late` has run.
        With ``rope``, ``q [B, Hq, D]`` and ``k`` are rotated in the same launch. Returns
        ``(q, k)`` after RoPE."""
        c = self.cache
        b = k.shape[0]
        staging = c.token_staging[layer, plan.row0 : plan.row0 + b]
        pool, table, pos = c.pool[layer], plan.block_table, plan.positions
        fp8 = self.fp8_args(layer)
        if rope is None:
            self.ops.append_kv(
                k, v, pos, table, pool, c.meta[layer], write_pool=False, staging=staging, **fp8
            )
        else:
            q, k = self.ops.rope_append(
                q, k, v, pos, rope, table, pool, c.meta[layer], write_pool=False,
                staging=staging, **fp8,
            )
        k_st, v_st = staging[:, :, 0], staging[:, :, 1]
        c.run_late(lambda: self.ops.append_kv(k_st, v_st, pos, table, pool, None, **fp8))
        return q, k

    def scores(self, plan: StepPlan, layer: int, q: torch.Tensor) -> torch.Tensor | None:
        """Page scores float32 ``[B, Hkv, P_max]`` of the configured indexer (``None`` for
        the dense indexer, which ranks nothing)."""
        ix = self.indexer
        if not ix.ranks or self.two_level(layer):
            return None
        scores = ix.score(self.ops, self.cache, plan, layer, q, self.config, self.scale)
        window = self.window(layer)
        if window:  # pages wholly before the window never win the budget
            lo_page = (plan.seq_lens.long() - window).clamp(min=0) // self.cache.page_size
            pages = torch.arange(scores.shape[-1], device=scores.device)
            scores = scores.masked_fill(pages[None, None, :] < lo_page[:, None, None], float("-inf"))
        return scores

    def two_level(self, layer: int) -> bool:
        """Whether ``layer`` selects through superpages (``page_metadata=superpage``,
        :mod:`kernels.superpage_select`): full-attention layers of a cache that keeps
        superpage metadata; scores are then never computed for every page."""
        return self.cache.superpages and not self.window(layer)

    def window(self, layer: int) -> int | None:
        """The sliding window of cache layer ``layer`` in tokens, ``None`` for full attention."""
        return self.windows[layer] if self.windows is not None else None

    def sink_pages(self, layer: int) -> int:
        """Sink pages forced into ``layer``'s selection: none for a sliding-window layer
        (they lie outside its window once the context passes it)."""
        return 0 if self.window(layer) else self.config.sink_pages

    def select(
        self, plan: StepPlan, layer: int, q: torch.Tensor, scores: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Selection bitmask int32 ``[B, Hkv, W]`` from the configured indexer; ``scores``:
        :meth:`scores` when already computed."""
        cfg = self.config
        if not self.indexer.ranks:
            return self.ops.dense_selection(
                plan.num_pages, self.cache.model.num_kv_heads, plan.block_table.shape[1]
            )
        if self.two_level(layer):
            c = self.cache
            return self.ops.superpage_select(
                q, c.meta[layer], c.super_meta[layer], c.page_super, plan.block_table,
                plan.num_pages, cfg.top_k_pages, self.sink_pages(layer), cfg.window_pages,
                cfg.superpage_pages, self.num_candidates, cfg.group_combine, self.scale,
            )  # fmt: skip
        if scores is None:
            scores = self.scores(plan, layer, q)
        selection = self.ops.select_topk(
            scores, plan.num_pages, cfg.top_k_pages, self.sink_pages(layer), cfg.window_pages
        )
        return self.in_window(plan, layer, selection)

    def in_window(self, plan: StepPlan, layer: int, selection: torch.Tensor) -> torch.Tensor:
        """``selection`` (int32 ``[B, Hkv, W]``) without the pages wholly before ``layer``'s
        sliding window (the top-k fills its budget with ``-inf`` pages when the window
        has fewer pages than the budget); unchanged for a full-attention layer."""
        window = self.window(layer)
        if not window:
            return selection
        lo_page = (plan.seq_lens.long() - window).clamp(min=0) // self.cache.page_size
        pages = torch.arange(selection.shape[-1] * 32, device=selection.device)
        keep = pack_bits(pages[None, :] >= lo_page[:, None])  # [B, W]
        return selection & keep[:, None, :]
