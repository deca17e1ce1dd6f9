"""CUDA-graph replay of the engine's decode step.

A decode step launches some fifteen kernels per layer (norms, projections, RoPE, append,
Quest scores, top-k, resolve, gather, sparse attention, MLP); at small batch the GPU then
waits on the host between launches. :class:`DecodeGraphs` captures the whole step —
embedding lookup, every layer of :meth:`engine.serve.engine.Engine.decode_layers`, the final
norm, LM head and greedy argmax — once per *(batch size B, page-table width bucket W)*
and replays it (PyTorch's ``torch.cuda.CUDAGraph``; NVIDIA, "CUDA Graphs", CUDA C++
Programming Guide).

Static inputs (per captured key, on the device):

* ``step_ints`` int64 ``[2B + 1]``: the tokens fed ``[B]``, the sequence lengths after
  this step ``[B]`` and the decode step number (resolve's LRU clock) — one host->device
  copy per step from a pinned staging buffer;
* ``batch_ints`` int64 ``[B*W + B*Hkv]``: block table ``[B, W]`` (-1 padded) and slab ids
  ``[B, Hkv]`` — copied only when the batch's requests change (a request's pool pages are
  reserved at admission, so its block-table row never changes while it runs).

Positions, page counts and int32 casts are computed inside the graph. The width bucket
covers every page reserved by the batch's requests (prompt + max_tokens), rounded up to a
power of two (at least 32 pages), so a batch replays one graph for its whole life; the
kernels mask pages past each request's length, so the padding changes no result.

The first step of a new key runs the same static-buffer function eagerly (the warm-up
that also compiles any new Triton specialisation), then captures it; replays start with
the next step. Every kernel on the path is free of host synchronisation; the K/V pool,
hot buffer and LRU tensors are captured by address (they are never reallocated). Graphs
share one memory pool (they never run concurrently); at most ``max_graphs`` are kept,
least recently used first out.

With the fidelity audit on (``audit_steps``), each captured step also keeps a reference
to every layer's query and selection (:attr:`engine.decode.attention.DecodeAttention.capture`):
their memory then stays allocated in the graphs' pool, so each replay leaves its values
there for the audit to copy (:attr:`DecodeGraphs.last_capture`) — no extra kernel, and
the same kernels as a graph without the audit.

Not captured (the engine falls back to eager launches): CPU devices, the PyTorch
reference kernels, the ``oracle`` indexer (it synchronises), a selection tracer, and
``config.cuda_graph=False``. A capture that fails disables graphs for the engine with
a warning rather than failing the batch.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from engine.decode import indexers
from engine.decode.attention import StepPlan


def width_bucket(pages: int, limit: int) -> int:
    """Page-table width for a batch whose requests reserve at most ``pages`` pages:
    the next power of two, at least 32 (one selection word), at most ``limit`` (the
    cache's page-table width)."""
    w = 32
    while w < pages:
        w *= 2
    return max(min(w, limit), pages)


def split_plan(plan: StepPlan, parts: int) -> list[StepPlan]:
    """``plan`` as ``parts`` plans over contiguous row groups, the first ones one row
    larger where ``B`` does not divide (``B = 5, parts = 2``: rows ``[:3]`` and ``[3:]``);
    fewer when ``B < parts`` (one row each). Views: each group's counters are written
    through into ``plan``'s."""
    b = len(plan.seq_ids)
    parts = max(1, min(parts, b))
    bounds = [(i * b + parts - 1) // parts for i in range(parts)]  # ceil(i * B / parts)
    bounds.append(b)

    def rows(sl: slice) -> StepPlan:
        return StepPlan(
            seq_ids=plan.seq_ids[sl],
            block_table=plan.block_table[sl],
            seq_lens=plan.seq_lens[sl],
            num_pages=plan.num_pages[sl],
            positions=plan.positions[sl],
            slab_ids=plan.slab_ids[sl] if plan.slab_ids is not None else None,
            step=plan.step,
            hits=plan.hits[sl] if plan.hits is not None else None,
            misses=plan.misses[sl] if plan.misses is not None else None,
            prefetched=plan.prefetched[sl] if plan.prefetched is not None else None,
            row0=plan.row0 + sl.start,
        )

    return [rows(slice(lo, hi)) for lo, hi in zip(bounds, bounds[1:], strict=False)]


def table_width(cache, seq_ids: list[int]) -> int:
    """The padded page-table width of a batch (:func:`width_bucket` of the most pages any
    of its requests reserved); fixed for the batch's life."""
    reserved = max(len(cache.seqs[s].pages) for s in seq_ids)
    return width_bucket(reserved, cache.max_pages_per_seq)


@dataclass
class _Entry:
    """Static buffers, graph and outputs of one (B, W) key."""

    batch: int
    width: int
    host_step: torch.Tensor  # pinned int64 [2B + 1]
    step_ints: torch.Tensor  # device int64 [2B + 1]
    host_batch: torch.Tensor  # pinned int64 [B*W + B*Hkv]
    batch_ints: torch.Tensor  # device int64 [B*W + B*Hkv]
    hits: torch.Tensor  # device int64 [B]
    misses: torch.Tensor  # device int64 [B]
    prefetched: torch.Tensor  # device int64 [B]
    seq_ids: tuple[int, ...] = ()
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # float32 [B, V]
    greedy: torch.Tensor | None = None  # int64 [B]
    next: tuple = ()  # (seq_ids, step) the static inputs hold after the last launch
    capture: list = field(default_factory=list)  # the replay's per-layer q and selection (audit)
    uploaded: torch.cuda.Event | None = None  # after the last copy out of the staging buffers


class DecodeGraphs:
    """Captured decode steps of one :class:`engine.serve.engine.Engine`.

    Parameters
    ----------
    engine : the engine whose model, cache and attention the graphs replay
    max_graphs : captured keys kept (each holds its static buffers; intermediates share
        one memory pool)
    capture : False runs the static-buffer step eagerly every time, without CUDA (tests
        check on the CPU that it computes exactly what the engine's eager step does)
    split : micro-batch split (:attr:`overlap`) even without capture (CPU tests of the
        split; the two halves then run one after the other)
    """

    def __init__(self, engine, max_graphs: int = 8, capture: bool = True, split: bool = False):
        self.engine = engine
        self.max_graphs = max_graphs
        self.capture = capture
        self.split = split
        self.entries: OrderedDict[tuple[int, int], _Entry] = OrderedDict()
        self.pool = None
        self.disabled_reason = ""
        self.captures = 0
        self.replays = 0
        self._sides: list[torch.cuda.Stream] = []
        self._capture_stream: torch.cuda.Stream | None = None
        self.keep_capture = bool(engine.config.audit_steps)
        # The last launch's (cache layer, row0, q, selection) per layer (keep_capture):
        # valid until the next launch overwrites them.
        self.last_capture: list = []

    @staticmethod
    def supported(engine) -> str:
        """Why graphs cannot be used for ``engine`` (empty string when they can)."""
        cfg = engine.config
        if not cfg.cuda_graph:
            return "cuda_graph is off"
        if engine.model.device.type != "cuda":
            return "not a CUDA device"
        if engine.ops.name != "triton":
            return f"kernel set {engine.ops.name!r} is not graph-safe"
        if cfg.attention == "sparse" and not indexers.get(cfg.indexer).graph_safe:
            return f"the {cfg.indexer} indexer synchronises with the host"
        if engine.tracer is not None:
            return "a selection tracer is attached"
        return ""

    # ----- public ------------------------------------------------------------------
    def launch(
        self,
        seq_ids: list[int],
        tokens: list[int] | None,
        seq_lens: list[int],
        step: int,
        prev_greedy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]] | None:
        """Launch one decode step without waiting for it; ``None`` if graphs are (now)
        disabled — the caller then runs the eager step.

        Parameters
        ----------
        seq_ids : the batch's cache sequence ids, ``B`` of them
        tokens : the token each request feeds this step; ``None`` to feed the greedy
            tokens of the step launched just before for the same batch (``prev_greedy``,
            device int64 ``[B]``): each replay leaves its argmax, lengths + 1 and step + 1
            in the static inputs, so a chained step uploads nothing
        seq_lens : tokens per request after this step (prompt + fed tokens)
        step : decode step number (LRU clock of resolve)

        Returns
        -------
        (logits float32 ``[B, V]`` — a static buffer overwritten by the next step —,
        the greedy token of every row, device int64 ``[B]``, and the hits, misses and
        prefetched counters, device int64 ``[B]`` each, also overwritten by the next step).
        """
        if self.disabled_reason:
            return None
        cache = self.engine.cache
        b = len(seq_ids)
        entry = self._entry(b, table_width(cache, seq_ids))
        chained = tokens is None and entry.next == (tuple(seq_ids), step)
        if not chained:
            if tokens is None:  # the device's inputs are not this step's: read them
                tokens = prev_greedy.tolist()
            self._upload(entry, seq_ids, tokens, seq_lens, step)
        entry.next = (tuple(seq_ids), step + 1)
        attn = self.engine.attn
        attn.hits, attn.misses, attn.prefetched = entry.hits, entry.misses, entry.prefetched
        counters = [entry.hits, entry.misses, entry.prefetched]
        if not self.capture:
            logits, greedy, self.last_capture = self._forward(entry)
            return logits, greedy, counters
        if entry.graph is None:
            try:
                logits, greedy, self.last_capture = self._warm_and_capture(entry)
                return logits, greedy, counters
            except Exception as e:  # noqa: BLE001 - keep the batch running eagerly
                self.disabled_reason = f"capture failed: {e!r}"
                self.entries.clear()
                warnings.warn(f"CUDA graphs disabled ({self.disabled_reason})", stacklevel=2)
                torch.cuda.synchronize()
                return None
        entry.graph.replay()
        self.replays += 1
        self.last_capture = entry.capture
        return entry.logits, entry.greedy, counters

    def _capture(self, graph: torch.cuda.CUDAGraph, e: _Entry) -> tuple[torch.Tensor, torch.Tensor, list]:
        """Capture :meth:`_forward` into ``graph`` on a side stream.

        Not ``torch.cuda.graph``: its ``__enter__`` synchronises the device, may run
        ``gc.collect()`` and empties the device and pinned-host caching allocators before
        every capture — about 0.11 s per capture on an H200 (cProfile of a `hisparse run`,
        2026-12-01), paid once per batch shape, mid-run, while the batch waits. Nothing
        here needs it: the warm-up step is queued on the device (capture records work, it
        does not run it), no other thread launches CUDA work, and the graphs share one
        memory pool that the caching allocator keeps."""
        stream = self._capture_stream
        if stream is None:
            stream = self._capture_stream = torch.cuda.Stream(device=self.engine.model.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self.pool)
            try:
                out = self._forward(e)
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def clear(self) -> None:
        """Drop every captured graph and its buffers."""
        self.entries.clear()

    # ----- internals ---------------------------------------------------------------
    def _entry(self, b: int, width: int) -> _Entry:
        key = (b, width)
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            return entry
        while len(self.entries) >= self.max_graphs:
            self.entries.popitem(last=False)
        dev = self.engine.model.device
        hkv = self.engine.model_config.num_kv_heads
        n_batch = b * width + b * hkv

        def pinned(n: int) -> torch.Tensor:
            t = torch.zeros(n, dtype=torch.int64)
            return t.pin_memory() if dev.type == "cuda" else t

        entry = _Entry(
            batch=b,
            width=width,
            host_step=pinned(2 * b + 1),
            step_ints=torch.zeros(2 * b + 1, dtype=torch.int64, device=dev),
            host_batch=pinned(n_batch),
            batch_ints=torch.zeros(n_batch, dtype=torch.int64, device=dev),
            hits=torch.zeros(b, dtype=torch.int64, device=dev),
            misses=torch.zeros(b, dtype=torch.int64, device=dev),
            prefetched=torch.zeros(b, dtype=torch.int64, device=dev),
        )
        self.entries[key] = entry
        return entry

    def _upload(self, e: _Entry, seq_ids, tokens, seq_lens, step: int) -> None:
        """Fill the pinned staging buffers and copy them to the static inputs."""
        b, w = e.batch, e.width
        if e.uploaded is not None:  # the last copy out of the staging buffers has run
            e.uploaded.synchronize()
        hs = e.host_step
        hs[:b] = torch.tensor(tokens, dtype=torch.int64)
        hs[b : 2 * b] = torch.tensor(seq_lens, dtype=torch.int64)
        hs[2 * b] = step
        e.step_ints.copy_(hs, non_blocking=True)
        key = tuple(seq_ids)
        if key != e.seq_ids:
            cache = self.engine.cache
            hb = e.host_batch
            table = hb[: b * w].view(b, w)
            table.fill_(-1)
            for i, sid in enumerate(seq_ids):
                pages = cache.seqs[sid].pages
                table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int64)
            if cache.hierarchical:
                slabs = [cache.seqs[s].slab_ids for s in seq_ids]
                hb[b * w :] = torch.tensor(slabs, dtype=torch.int64).flatten()
            e.batch_ints.copy_(hb, non_blocking=True)
            e.seq_ids = key
        if hs.is_pinned():
            e.uploaded = torch.cuda.Event()
            e.uploaded.record()

    def _forward(self, e: _Entry) -> tuple[torch.Tensor, torch.Tensor, list]:
        """The decode step as a function of the static inputs only (captured as is):
        logits, greedy tokens and, with :attr:`keep_capture`, the per-layer queries and
        selections (:attr:`engine.decode.attention.DecodeAttention.capture`; else ``[]``).

        With :attr:`overlap` the batch runs as ``decode_micro_batches`` micro-batches,
        each after the first on a side stream of its own
        (:meth:`engine.serve.engine.Engine.decode_batch`).
        """
        eng = self.engine
        m, cache = eng.model, eng.cache
        b, w, s = e.batch, e.width, cache.page_size
        hkv = eng.model_config.num_kv_heads
        ints = e.step_ints
        tokens = ints[:b]
        lens64 = ints[b : 2 * b]
        lens = lens64.to(torch.int32)
        plan = StepPlan(
            seq_ids=list(e.seq_ids),
            block_table=e.batch_ints[: b * w].view(b, w).to(torch.int32),
            seq_lens=lens,
            num_pages=torch.div(lens + (s - 1), s, rounding_mode="floor"),
            positions=lens64 - 1,
            slab_ids=(
                e.batch_ints[b * w :].view(b, hkv).to(torch.int32) if cache.hierarchical else None
            ),
            step=ints[2 * b :],
            hits=e.hits,
            misses=e.misses,
            prefetched=e.prefetched,
        )
        e.hits.zero_()
        e.misses.zero_()
        e.prefetched.zero_()
        sides = self._side_streams() if m.device.type == "cuda" and self.overlap else None
        eng.attn.capture = [] if self.keep_capture else None
        try:
            h = eng.decode_batch(plan, m.embed_tokens(tokens), self.overlap, sides)
            refs = eng.attn.capture or []
        finally:
            eng.attn.capture = None
        logits = m.logits(h)
        greedy = logits.argmax(dim=-1)
        # The inputs of a chained next step (Engine.launch_step with the same batch):
        # this step's argmax, every length + 1 and the step number + 1.
        ints[:b].copy_(greedy)
        ints[b:].add_(1)
        return logits, greedy, refs

    @property
    def overlap(self) -> bool:
        """Whether steps run as overlapping micro-batches (see :meth:`_forward`)."""
        eng = self.engine
        return self.split or (self.capture and eng.split_batches)

    def _side_streams(self) -> list[torch.cuda.Stream]:
        """One side stream per micro-batch after the first, made once."""
        want = self.engine.config.decode_micro_batches - 1
        while len(self._sides) < want:
            self._sides.append(torch.cuda.Stream(device=self.engine.model.device))
        return self._sides[:want]

    def _warm_and_capture(self, e: _Entry) -> tuple[torch.Tensor, torch.Tensor, list]:
        """Run the step eagerly on a side stream (its results are this step's), then
        capture the same function for the following steps."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits, greedy, refs = self._forward(e)
        torch.cuda.current_stream().wait_stream(side)
        logits, greedy = logits.clone(), greedy.clone()
        ints = e.step_ints.clone()  # the chained inputs the eager step left
        # Counters of this (eager) step survive the capture below, which does not run.
        counters = [t.clone() for t in (e.hits, e.misses, e.prefetched)]
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        e.logits, e.greedy, e.capture = self._capture(graph, e)
        for t, saved in zip((e.hits, e.misses, e.prefetched), counters, strict=True):
            t.copy_(saved)
        e.step_ints.copy_(ints)
        e.graph = graph
        self.captures += 1
        return logits, greedy, refs
