"""The KV hierarchy: KV pool (host pool), page metadata, hot buffer (slab pool), page
tables and LRU state. Names follow DESIGN.md.

* **KV pool** — per layer ``[P_pool, Hkv, 2, S, D]``; a *record* is ``pool[l][p, h]``
  (``[2, S, D]``: keys then values of one page, one layer, one KV head). Pool pages are
  handed out from a free list; a request's pages are listed in its block table. With
  the hierarchical path the pool lives in (pinned, when CUDA is present) host memory and
  is the authoritative copy; otherwise it lives on the compute device.
* **fp8 records** (``kv_host_dtype=fp8``) — hierarchical: the host pool holds
  ``float8_e4m3fn`` records and, per layer, ``pool_scale [P_pool, Hkv, 2, S]`` int8 scale
  exponents (one per token row, :mod:`kernels.fp8_kv`); the gather dequantises into the
  hot buffer. All-resident: the device pool keeps ``kv_dtype`` but holds every record
  rounded through fp8 the same way. Either way the metadata bounds the rounded keys, so
  both paths read the same KV.
* **Page metadata** — per layer ``[P_pool, Hkv, 2, D]`` key min / max, on the compute device.
* **Superpage metadata** (``page_metadata=superpage``) — per layer
  ``super_meta [P_sp_pool, Hkv, 2, D]``: the key min / max of each run of
  ``superpage_pages`` request pages (:mod:`kernels.superpage_select`); superpage rows are
  handed out with the pages (``SeqCache.superpages``) and ``page_super [P_pool]`` int32
  names the row of each pool page that starts a superpage. Prefill writes them with the
  page metadata; the decode selection refreshes the newest one from its pages.
* **Hot buffer** — per layer ``[N, 2, S, D]`` record slots, ``N = num_slabs * C``. Each
  (request, KV head) owns one slab (the same slab id in every layer) of ``C`` slots. With
  ``hot_buffer_dtype=fp8`` the slots are ``float8_e4m3fn`` with ``slot_scale [N, 2, S]``
  int8 exponents per layer, the records as the fp8 host pool stores them.
* **Page table** — per layer ``[num_slabs, P_max]`` int32: request page -> slot or -1.
* **LRU state** — per layer ``slot_page [N]`` int32 and ``slot_last_use [N]`` int64.

Prefill writes and stream ordering (pinned host pool on CUDA, ``prefill_copy_stream``):

1. :meth:`KVCache.write_prefill_chunk` sets the page metadata and stages the chunk's
   records contiguously ``[n, Hkv, 2, S, D]`` into one of two device staging buffers, both
   on the compute stream (first waiting, on the device, until the copy that last used that
   buffer has finished);
2. the copy stream waits for the compute stream, then copies each run of consecutive pool
   pages with one ``copy_(non_blocking=True)`` into the pinned pool and records an event;
3. :meth:`KVCache.finish_prefill` makes the compute stream wait for the request's last
   copy: decode (append, gather through unified addressing) and anything else on the
   compute stream then sees the records. The engine calls it after a request's last prefill
   layer of this cache;
4. :meth:`KVCache.release` and :meth:`KVCache.close` wait on the host for pending copies, so
   freed pages and staging buffers are never handed out while a copy may still write them.

The staging buffers live as long as the cache (freed by :meth:`KVCache.close` after a
synchronisation), so the caching allocator never hands their memory to another tensor while
a copy reads it; the caller's ``k``/``v`` are only read on the compute stream. Without a
copy stream (CPU, a device-resident pool, or ``prefill_copy_stream=False``) the same
chunked path copies synchronously on the current stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.config import CacheFullError, EngineConfig, ModelConfig
from engine.kv import sizing
from engine.kv.host_pool import HostPool, zeros
from engine.kv.sizing import check_host_memory
from kernels.fp8_kv import FP8, fp8_quantize_ref, fp8_round_ref
from kernels.superpage_select import superpage_meta_ref


@dataclass
class SeqCache:
    """Cache bookkeeping of one request: ``pages`` (pool page per request page),
    ``slab_ids`` (one per KV head, hierarchical only), ``superpages`` (superpage metadata row
    per ``superpage_pages`` request pages, ``page_metadata=superpage`` only) and
    ``num_tokens`` stored."""

    seq_id: int
    pages: list[int] = field(default_factory=list)
    slab_ids: list[int] = field(default_factory=list)
    superpages: list[int] = field(default_factory=list)
    num_tokens: int = 0


def release_pinned_cache() -> None:
    """Return the pinned blocks torch's caching host allocator holds but no tensor uses to
    the system (``torch._C._host_emptyCache``; a no-op where torch lacks it or on CPU)."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available():
        empty()


def page_runs(pages: Sequence[int], chunk_pages: int = 0) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive pool pages: ``(index in pages, first page, length)``.

    ``[0, 1, 2, 7, 8, 3]`` -> ``[(0, 0, 3), (3, 7, 2), (5, 3, 1)]``; each run is one
    contiguous block of a pool layer ``[P_pool, Hkv, 2, S, D]``, so one copy. With
    ``chunk_pages`` no run crosses a multiple of it: a copy must stay inside one
    ``cudaHostRegister`` range of a lazily pinned pool (:mod:`engine.kv.host_pool`).
    """
    runs: list[tuple[int, int, int]] = []
    for i, p in enumerate(pages):
        joins = runs and runs[-1][1] + runs[-1][2] == p
        if joins and chunk_pages and p % chunk_pages == 0:
            joins = False
        if joins:
            start, first, n = runs[-1]
            runs[-1] = (start, first, n + 1)
        else:
            runs.append((i, p, 1))
    return runs


class KVCache:
    """Owns the KV pool, metadata and (when hierarchical) the hot buffer.

    Parameters
    ----------
    model : model shape; config : engine settings (page_size, kv_dtype, host_pool_gb,
    max_batch, hierarchical, device_buffer); device : compute device;
    max_pages_per_seq : P_max, the page-table width.
    num_pool_pages : pool pages; default: as many whole-model pages (every layer of the
        model) as ``host_pool_gb`` holds, so every pipeline stage gets the same count.
    layers : the model layers this cache holds (a pipeline stage), default all. The
        per-layer lists and every ``layer`` argument are local: index ``i`` is model
        layer ``layers.start + i`` (``layer_offset``).

    Raises
    ------
    CacheFullError
        If pinned host memory cannot be allocated (layers pinned so far are released).

    Call :meth:`close` when done with the cache: it waits for pending copies and frees the
    pinned host pool at once instead of leaving it to the garbage collector.
    """

    def __init__(
        self,
        model: ModelConfig,
        config: EngineConfig,
        device: torch.device,
        max_pages_per_seq: int,
        num_pool_pages: int | None = None,
        layers: range | None = None,
    ):
        self.model = model
        self.config = config
        self.device = device
        self.page_size = s = config.page_size
        self.dtype = getattr(torch, config.kv_dtype)
        self.hierarchical = config.attention == "sparse" and config.hierarchical
        self.superpages = config.page_metadata == "superpage" and config.attention == "sparse"
        layers = layers if layers is not None else range(model.num_layers)
        self.layer_offset, self.num_layers = layers.start, len(layers)
        hkv, d, nl = model.num_kv_heads, model.head_dim, self.num_layers
        self.fp8 = config.kv_host_dtype == "fp8"  # every record rounded through fp8
        self.host_fp8 = sizing.host_fp8(config)  # ... and stored as fp8 in the host pool
        self.record_bytes = sizing.host_record_bytes(model, config)  # one miss over the link
        self.page_bytes = sizing.pool_page_bytes(model, config, nl)
        if num_pool_pages is None:  # whole-model pages, as the planner counts them
            num_pool_pages = sizing.default_pool_pages(model, config)
        self.num_pool_pages = num_pool_pages
        self.max_pages_per_seq = max_pages_per_seq
        pool_dev = torch.device("cpu") if self.hierarchical else device
        if pool_dev.type == "cpu":
            check_host_memory(num_pool_pages * self.page_bytes, config.host_memory_gb)
        self.pinned = pin = self.hierarchical and device.type == "cuda"
        shape = (num_pool_pages, hkv, 2, s, d)
        self.host: HostPool | None = None
        self.pool_dtype = FP8 if self.host_fp8 else self.dtype
        self.pool_scale: list[torch.Tensor | None] = [None] * nl  # fp8 exponents per layer
        if pool_dev.type == "cpu":
            scale_shape = shape[:4] if self.host_fp8 else None
            try:
                self.host = HostPool(nl, shape, self.pool_dtype, pin, scale_shape=scale_shape)
            except CacheFullError:
                release_pinned_cache()
                raise
            self.pool = self.host.layers
            if self.host_fp8:
                self.pool_scale = list(self.host.scales)
        else:
            self.pool = [torch.empty(shape, dtype=self.dtype, device=pool_dev) for _ in range(nl)]
        lazy = self.host is not None and self.host.lazy
        self.copy_chunk_pages = self.host.chunk_pages if lazy else 0  # page_runs split there
        self.meta = [zeros((num_pool_pages, hkv, 2, d), self.dtype, device) for _ in range(nl)]
        self.free_pages: list[int] = list(range(num_pool_pages - 1, -1, -1))
        self.superpage_pages = config.superpage_pages
        num_super = sizing.superpage_rows(config, num_pool_pages)
        self.super_meta = [
            torch.zeros(num_super, hkv, 2, d, dtype=self.dtype, device=device) for _ in range(nl)
        ] if self.superpages else []  # fmt: skip
        self.page_super = torch.full(
            (num_pool_pages if self.superpages else 0,), -1, dtype=torch.int32, device=device
        )
        self.free_superpages: list[int] = list(range(num_super - 1, -1, -1))
        self.slots_per_slab = config.buffer_pages
        self.num_slabs = config.max_batch * hkv if self.hierarchical else 0
        n = self.num_slabs * self.slots_per_slab
        self.hot_fp8 = sizing.hot_fp8(config)
        self.slots = [
            zeros((n, 2, s, d), FP8 if self.hot_fp8 else self.dtype, device) for _ in range(nl)
        ]
        self.slot_scale: list[torch.Tensor | None] = [
            zeros((n, 2, s), torch.int8, device) if self.hot_fp8 else None for _ in range(nl)
        ]
        self.page_table = [
            torch.full((self.num_slabs, max_pages_per_seq), -1, dtype=torch.int32, device=device)
            for _ in range(nl)
        ]
        self.slot_page = [torch.full((n,), -1, dtype=torch.int32, device=device) for _ in range(nl)]
        self.slot_last_use = [torch.full((n,), -1, dtype=torch.int64, device=device) for _ in range(nl)]
        self.free_slabs: list[int] = list(range(self.num_slabs - 1, -1, -1))
        self.seqs: dict[int, SeqCache] = {}
        # Chunked prefill writes (see the module docstring): a copy stream only where the
        # records cross from the device to pinned host memory.
        use_stream = pin and config.prefill_copy_stream
        self.copy_stream = torch.cuda.Stream(device) if use_stream else None
        self.staging_pages = self.pages_for(config.prefill_chunk) + 1
        self._staging: list[torch.Tensor] = []  # two [staging_pages, Hkv, 2, S, D], lazily
        self._staging_done: list = [None, None]  # per buffer: event of its last copy
        self._next_staging = 0
        self._pending: dict[int, torch.cuda.Event] = {}  # seq_id -> event of its last copy
        # Late work of a decode step on a copy stream (``late_stream``): decode
        # write-through (``decode_write_stream``; new tokens staged on the device, one row
        # per batch row) and prefetch (``prefetch_pages``).
        self.deferred_writes = False
        self.late_stream: torch.cuda.Stream | None = None
        self.token_staging: torch.Tensor | None = None
        self._queued: list = []  # without a stream: late work run at the join
        self._keep: list = []  # tensors late work reads, alive until the join
        self._forked = False  # run_late put work on late_stream since the last join
        if pin and config.decode_write_stream:
            self.defer_decode_writes()
        self.closed = False

    # ----- sizes -------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        """Pages holding ``num_tokens`` positions (:func:`engine.kv.sizing.pages_for`)."""
        return sizing.pages_for(num_tokens, self.page_size)

    @property
    def pool_bytes_total(self) -> int:
        return self.num_pool_pages * self.page_bytes

    @property
    def pool_bytes_pinned(self) -> int:
        """Host pool bytes page-locked now (:class:`engine.kv.host_pool.HostPool`); the
        whole pool when it is not pinned lazily."""
        return self.host.pinned_bytes if self.host is not None and self.pinned else self.pool_bytes_total

    @property
    def pool_bytes_used(self) -> int:
        return (self.num_pool_pages - len(self.free_pages)) * self.page_bytes

    @property
    def hot_buffer_bytes(self) -> int:
        """The slab pool on the device: slots, page tables and LRU state (what
        :func:`engine.kv.sizing.per_request_device_bytes` counts per request)."""
        scales = [t for t in self.slot_scale if t is not None]
        tensors = (*self.slots, *scales, *self.page_table, *self.slot_page, *self.slot_last_use)
        return sum(t.nbytes for t in tensors)

    @property
    def metadata_bytes(self) -> int:
        """Page metadata (with superpage metadata and its map) plus the decode token
        staging buffer (all on the device)."""
        staging = self.token_staging.nbytes if self.token_staging is not None else 0
        supers = sum(t.nbytes for t in self.super_meta) + self.page_super.nbytes
        return sum(t.nbytes for t in self.meta) + supers + staging

    def enable_late_stream(self) -> None:
        """Create :attr:`late_stream`, the copy stream of :meth:`run_late`, where the pool
        is pinned host memory on CUDA (idempotent; elsewhere late work is queued on the host
        and run by :meth:`join_late`). Call outside a CUDA-graph capture."""
        if self.pinned and self.late_stream is None:
            self.late_stream = torch.cuda.Stream(self.device)

    def defer_decode_writes(self) -> None:
        """Write decode tokens to the pool late (:meth:`run_late`): from
        :attr:`late_stream` on CUDA; elsewhere (CPU tests) queued on the host and run by
        :meth:`join_late`, the latest a copy stream's write may land. Allocates the token
        staging buffer ``[L, max_batch, Hkv, 2, D]`` (``kv_dtype``, on the compute device)."""
        hkv, d = self.model.num_kv_heads, self.model.head_dim
        self.deferred_writes = True
        self.enable_late_stream()
        self.token_staging = torch.zeros(
            self.num_layers, self.config.max_batch, hkv, 2, d, dtype=self.dtype, device=self.device
        )

    def run_late(self, work, keep: Sequence[torch.Tensor] = ()) -> None:
        """Run ``work()`` (a decode step's pool write-through or prefetch) on
        :attr:`late_stream`, after the work queued so far on the current stream; without a
        stream, at the next :meth:`join_late`. ``keep``: tensors of the current stream that
        ``work`` reads, kept alive until the join so the caching allocator cannot hand
        their memory to the current stream while the copy stream may still read it."""
        self._keep.extend(keep)
        if self.late_stream is None:
            self._queued.append(work)
            return
        self.late_stream.wait_stream(torch.cuda.current_stream(self.device))
        self._forked = True
        with torch.cuda.stream(self.late_stream):
            work()

    def join_late(self) -> None:
        """Make the current stream wait, on the device, for every piece of late work issued
        by :meth:`run_late` (without a stream: run the queued work now). Called at the end
        of each decode step, so the next step's resolve and gathers, a prefill reusing a
        freed page and host reads after a device synchronisation all see its results;
        inside a captured step it is the join that ends the copy stream's fork."""
        # Only after a fork: inside a graph capture, waiting on a stream that took no part
        # in the capture would invalidate it (a step that wrote inline).
        if self.late_stream is not None and self._forked:
            torch.cuda.current_stream(self.device).wait_stream(self.late_stream)
            self._forked = False
        while self._queued:
            self._queued.pop(0)()
        self._keep.clear()

    def can_admit(self, num_tokens: int) -> bool:
        """Whether a request that will hold ``num_tokens`` tokens fits now."""
        need = self.pages_for(num_tokens)
        slabs = self.model.num_kv_heads if self.hierarchical else 0
        return (
            need <= len(self.free_pages)
            and slabs <= len(self.free_slabs)
            and need <= self.max_pages_per_seq
            and self._superpages_for(need) <= len(self.free_superpages)
        )

    def _superpages_for(self, num_pages: int) -> int:
        """Superpage rows a request of ``num_pages`` pages takes (0 without superpages)."""
        return -(-num_pages // self.superpage_pages) if self.superpages else 0

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` could fit in an empty cache."""
        need = self.pages_for(num_tokens)
        return need <= self.num_pool_pages and need <= self.max_pages_per_seq

    # ----- lifecycle ---------------------------------------------------------------
    def allocate(self, seq_id: int, reserve_tokens: int) -> SeqCache:
        """Reserve pool pages for ``reserve_tokens`` and, when hierarchical, one slab per
        KV head. Raises :class:`CacheFullError` when they are not free, ``RuntimeError``
        after :meth:`close`."""
        if self.closed:
            raise RuntimeError("the KV cache is closed")
        if not self.can_admit(reserve_tokens):
            raise CacheFullError(f"no room for {reserve_tokens} tokens")
        seq = SeqCache(seq_id)
        seq.pages = [self.free_pages.pop() for _ in range(self.pages_for(reserve_tokens))]
        if self.host is not None and seq.pages:
            try:  # page-lock the pool up to the highest page handed out
                self.host.ensure_pinned(max(seq.pages) + 1)
            except CacheFullError:
                self.free_pages.extend(reversed(seq.pages))
                raise
        if self.hierarchical:
            seq.slab_ids = [self.free_slabs.pop() for _ in range(self.model.num_kv_heads)]
        if self.superpages and seq.pages:
            n = self._superpages_for(len(seq.pages))
            seq.superpages = [self.free_superpages.pop() for _ in range(n)]
            firsts = torch.tensor(seq.pages[:: self.superpage_pages], device=self.device)
            self.page_super[firsts] = torch.tensor(seq.superpages, dtype=torch.int32).to(self.device)
        self.seqs[seq_id] = seq
        return seq

    def release(self, seq_id: int) -> None:
        """Return a request's pages and slabs; its slots are emptied in every layer.

        Waits (on the host) for the request's pending prefill copies first, so its pages
        are never handed to another request, or written by the host, while a copy may still
        land in them.
        """
        self._sync_copies(seq_id)
        seq = self.seqs.pop(seq_id)
        self.free_pages.extend(reversed(seq.pages))
        c = self.slots_per_slab
        for slab in seq.slab_ids:
            for layer in range(self.num_layers):
                self.page_table[layer][slab].fill_(-1)
                self.slot_page[layer][slab * c : (slab + 1) * c] = -1
                self.slot_last_use[layer][slab * c : (slab + 1) * c] = -1
        self.free_slabs.extend(reversed(seq.slab_ids))
        self.free_superpages.extend(reversed(seq.superpages))

    def block_table(self, seq_ids: list[int], width: int | None = None) -> torch.Tensor:
        """int32 ``[B, width]`` pool pages of each request (-1 padded), on the compute device."""
        rows = [self.seqs[i].pages for i in seq_ids]
        width = width or max(len(r) for r in rows)
        out = torch.full((len(rows), width), -1, dtype=torch.int32)
        for b, r in enumerate(rows):
            r = r[:width]
            out[b, : len(r)] = torch.tensor(r, dtype=torch.int32)
        return out.to(self.device)

    def slab_table(self, seq_ids: list[int]) -> torch.Tensor:
        """int32 ``[B, Hkv]`` slab ids, on the compute device."""
        return torch.tensor([self.seqs[i].slab_ids for i in seq_ids], dtype=torch.int32).to(
            self.device
        )

    # ----- prefill -----------------------------------------------------------------
    def write_prefill(
        self, seq_id: int, layer: int, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> None:
        """Store K/V of positions ``start .. start + T - 1`` of one layer into the pool and
        set those pages' metadata; blocking: the pool holds the records on return.

        The whole-layer write (``prefill_copy_stream=False`` and tools such as
        :mod:`engine.measure.bench_kv`); :meth:`write_prefill_chunk` is the overlapped one. Both
        leave the same bytes in the pool and metadata.

        Parameters
        ----------
        seq_id : an allocated request
        layer : local layer index
        k, v : ``[T, Hkv, D]`` keys (after RoPE) and values, on the compute device, any
            float dtype (stored as ``kv_dtype``); a partial last page is zero-padded
        start : first position, a multiple of ``page_size``

        Raises
        ------
        ValueError
            If ``start`` is not page-aligned or the request has too few pages.
        """
        pages = self._prefill_pages(seq_id, k, start)
        self._sync_copies(seq_id)  # the host writes below must not race a pending copy
        pool = self.pool[layer]
        index = torch.tensor(pages, dtype=torch.long, device=pool.device)
        if self.host_fp8:  # quantised from kv_dtype (never from rounded values)
            q, e = fp8_quantize_ref(_records(k.to(self.dtype), v.to(self.dtype), self.page_size))
            pool.view(torch.uint8)[index] = q.to(pool.device).view(torch.uint8)
            self.pool_scale[layer][index] = e.to(pool.device)
        else:
            rec = _records(self._rounded(k), self._rounded(v), self.page_size)
            pool[index] = rec.to(pool.device, self.dtype)
        self._write_meta(layer, pages, self._rounded(k))
        self._write_super_meta(layer, seq_id, start, k.shape[0])

    def write_prefill_chunk(
        self, seq_id: int, layer: int, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> None:
        """Store K/V of positions ``start .. start + T - 1`` of one layer, overlapped with
        the caller's next work where a copy stream exists (see the module docstring).

        Per piece of at most ``staging_pages`` pages: metadata and staging on the current
        (compute) stream, then one copy per run of consecutive pool pages (on the copy
        stream, asynchronous, when the pool is pinned host memory on CUDA; otherwise
        synchronous on the current stream). Before the compute stream reads this request's
        pool pages, call :meth:`finish_prefill`. ``k``/``v`` may be reused as soon as this
        returns: only the staging buffers are read by the copy stream.

        Parameters
        ----------
        seq_id : an allocated request
        layer : local layer index
        k, v : ``[T, Hkv, D]`` on the compute device, any float dtype (stored as
            ``kv_dtype``). ``T`` should be a multiple of ``page_size`` except for the
            prompt's last chunk: a partial last page is zero-padded, and a later write of
            that page would need an unaligned ``start``.
        start : first position, a multiple of ``page_size``

        Raises
        ------
        ValueError
            If ``start`` is not page-aligned or the request has too few pages.
        """
        self._prefill_pages(seq_id, k, start)
        step = self.staging_pages * self.page_size
        for a in range(0, k.shape[0], step):
            b = min(a + step, k.shape[0])
            self._write_piece(seq_id, layer, k[a:b], v[a:b], start + a)

    def finish_prefill(self, seq_id: int) -> None:
        """Make the current (compute) stream wait, on the device, for every prefill copy of
        ``seq_id`` issued so far (no host synchronisation; a no-op without a copy stream).

        Call after the request's last prefill layer of this cache, before decode reads or
        appends to its pool pages.
        """
        done = self._pending.get(seq_id)
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    def synchronize(self) -> None:
        """Wait on the host until every prefill copy and decode write-through has landed in
        the pool (a no-op without copy streams). Host code reading the pool after chunked
        writes calls it."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
        if self.late_stream is not None:
            self.late_stream.synchronize()
        self._pending.clear()

    def close(self) -> None:
        """Wait for the device (pending copies, and kernels that read the pinned pool through
        unified addressing, which torch's host allocator does not track), then free the KV
        pool, metadata, hot buffer and staging buffers and return the cached pinned blocks
        to the system. Idempotent; the cache admits nothing afterwards. Tensors taken from
        the cache elsewhere keep their memory until dropped."""
        if self.closed:
            return
        self.synchronize()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.closed = True
        self.seqs.clear()
        self.free_pages, self.free_slabs, self.free_superpages = [], [], []
        for name in ("pool", "pool_scale", "meta", "super_meta", "slots", "page_table", "slot_page", "slot_last_use"):
            setattr(self, name, [])
        self._staging, self._staging_done = [], [None, None]
        self.token_staging = None
        if self.pinned:
            release_pinned_cache()

    @property
    def staging_bytes(self) -> int:
        """Bytes of the two staging buffers on the compute device (0 until first used)."""
        return sum(t.nbytes for t in self._staging)

    def _prefill_pages(self, seq_id: int, k: torch.Tensor, start: int) -> list[int]:
        """The pool pages a prefill write of ``k [T, Hkv, D]`` at ``start`` covers."""
        if start % self.page_size:
            raise ValueError(f"prefill write start={start} is not page-aligned")
        first = start // self.page_size
        n = self.pages_for(k.shape[0])
        pages = self.seqs[seq_id].pages[first : first + n]
        if len(pages) != n:
            raise ValueError(
                f"prefill write of {k.shape[0]} tokens at {start} needs pages {first}.."
                f"{first + n - 1} but request {seq_id} has {len(self.seqs[seq_id].pages)}"
            )
        return pages

    def _rounded(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, Hkv, D]`` in ``kv_dtype``, rounded through fp8 (per token row) when
        ``kv_host_dtype=fp8``: what attention will read of it."""
        return fp8_round_ref(x.to(self.dtype)) if self.fp8 else x

    def _write_meta(self, layer: int, pages: list[int], k: torch.Tensor) -> None:
        """Key min / max of ``k [T, Hkv, D]``'s pages into ``pages``' metadata, one
        assignment per run of consecutive pages (current stream); ``k`` already
        :meth:`_rounded`."""
        bounds = _key_bounds(k, self.page_size).to(self.dtype)
        meta = self.meta[layer]
        for i, first, n in page_runs(pages):
            meta[first : first + n] = bounds[i : i + n]

    def _write_super_meta(self, layer: int, seq_id: int, start: int, num_tokens: int) -> None:
        """Recompute, from the page metadata, the superpages a prefill write of
        ``num_tokens`` tokens at ``start`` touched (their pages written so far)."""
        if not self.superpages:
            return
        seq, sp = self.seqs[seq_id], self.superpage_pages
        written = self.pages_for(start + num_tokens)
        first = (start // self.page_size) // sp
        pages = torch.tensor(seq.pages[first * sp : written], device=self.device)
        bounds = superpage_meta_ref(self.meta[layer], pages, sp)
        rows = torch.tensor(seq.superpages[first : first + bounds.shape[0]], device=self.device)
        self.super_meta[layer][rows] = bounds

    def _write_piece(
        self, seq_id: int, layer: int, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> None:
        """One staged write of at most ``staging_pages`` pages."""
        pages = self._prefill_pages(seq_id, k, start)
        self._write_meta(layer, pages, self._rounded(k))
        self._write_super_meta(layer, seq_id, start, k.shape[0])
        if not self.host_fp8:  # fp8 records: _stage quantises from kv_dtype
            k, v = self._rounded(k), self._rounded(v)
        slot = self._next_staging
        self._next_staging ^= 1
        buf, ebuf = self._stage(slot, k, v)
        pairs = [(self.pool[layer], buf)]
        if ebuf is not None:
            pairs.append((self.pool_scale[layer], ebuf))
        stream = self.copy_stream
        if stream is None:
            for i, first, n in page_runs(pages, self.copy_chunk_pages):
                for dst, src in pairs:
                    _copy_pages(dst[first : first + n], src[i : i + n])
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))  # staged records exist
        with torch.cuda.stream(stream):
            for i, first, n in page_runs(pages, self.copy_chunk_pages):
                for dst, src in pairs:
                    _copy_pages(dst[first : first + n], src[i : i + n], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self._staging_done[slot] = done
        self._pending[seq_id] = done

    def _stage(
        self, slot: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Staging buffer ``slot`` filled with the records of ``k``/``v`` ``[T, Hkv, D]``:
        ``[n, Hkv, 2, S, D]`` contiguous, the pool's dtype, zero past ``T``; with an fp8
        host pool also their exponents ``[n, Hkv, 2, S]`` int8 (else ``None``). The current
        stream first waits for the copy that last read this buffer (issued two writes ago)."""
        if not self._staging:
            shape = (self.staging_pages, self.model.num_kv_heads, 2, self.page_size)
            self._staging = [
                torch.empty(*shape, self.model.head_dim, dtype=self.pool_dtype, device=self.device)
                for _ in range(2)
            ]
            if self.host_fp8:
                self._staging += [
                    torch.empty(shape, dtype=torch.int8, device=self.device) for _ in range(2)
                ]
        done = self._staging_done[slot]
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        n = self.pages_for(k.shape[0])
        buf = self._staging[slot][:n]
        if not self.host_fp8:
            _fill_records(buf, k, v)
            return buf, None
        q, e = fp8_quantize_ref(_records(k.to(self.dtype), v.to(self.dtype), self.page_size))
        buf.view(torch.uint8).copy_(q.view(torch.uint8))
        ebuf = self._staging[2 + slot][:n]
        ebuf.copy_(e)
        return buf, ebuf

    def _sync_copies(self, seq_id: int) -> None:
        """Wait on the host for ``seq_id``'s pending prefill copies."""
        done = self._pending.pop(seq_id, None)
        if done is not None:
            done.synchronize()

    # ----- checks ------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert the invariants tests rely on; raises ``AssertionError`` naming the breach.

        * pool pages: every page is either free or owned by exactly one request;
        * slabs: every slab is either free or owned by exactly one (request, KV head);
        * per layer: no page in two slots; page table and slot owners agree; free slabs
          hold no pages; last-use is -1 exactly for empty slots;
        * superpage rows (``page_metadata=superpage``): free or owned once, and
          ``page_super`` names each request's row at the first page of its superpage.
        """
        owned = [p for s in self.seqs.values() for p in s.pages]
        assert len(owned) == len(set(owned)), "a pool page is owned twice"
        assert not set(owned) & set(self.free_pages), "a pool page is both free and owned"
        assert len(owned) + len(self.free_pages) == self.num_pool_pages, "pool pages leaked"
        slabs = [x for s in self.seqs.values() for x in s.slab_ids]
        assert len(slabs) == len(set(slabs)), "a slab is owned twice"
        assert len(slabs) + len(self.free_slabs) == self.num_slabs, "slabs leaked"
        supers = [x for s in self.seqs.values() for x in s.superpages]
        assert len(supers) == len(set(supers)), "a superpage row is owned twice"
        assert len(supers) + len(self.free_superpages) == len(
            self.super_meta[0] if self.super_meta else []
        ), "superpage rows leaked"
        for s in self.seqs.values():
            if s.superpages:
                firsts = self.page_super[torch.tensor(s.pages[:: self.superpage_pages])]
                assert firsts.tolist() == s.superpages, f"request {s.seq_id}: page_super stale"
        if self.hierarchical:
            for layer in range(self.num_layers):
                self._check_layer(layer)

    def _check_layer(self, layer: int) -> None:
        c = self.slots_per_slab
        pt = self.page_table[layer].cpu()
        sp = self.slot_page[layer].cpu()
        lu = self.slot_last_use[layer].cpu()
        assert torch.equal(sp < 0, lu < 0), f"layer {layer}: last-use set on an empty slot"
        for slab in range(self.num_slabs):
            row = pt[slab]
            mapped = torch.nonzero(row >= 0).flatten()
            slots = row[mapped].long()
            assert len(set(slots.tolist())) == len(slots), f"layer {layer}: two pages share a slot"
            lo, hi = slab * c, (slab + 1) * c
            assert bool(((slots >= lo) & (slots < hi)).all()), f"layer {layer}: slot outside slab"
            assert torch.equal(sp[slots], mapped.to(sp.dtype)), f"layer {layer}: page table/slot owner mismatch"
            held = int((sp[lo:hi] >= 0).sum())
            assert held == len(mapped), f"layer {layer}: slab {slab} slot holds an unmapped page"
        free = set(self.free_slabs)
        for slab in free:
            assert bool((sp[slab * c : (slab + 1) * c] < 0).all()), f"layer {layer}: free slab holds pages"


def _copy_pages(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """``dst.copy_(src)`` of a run of pages (through uint8 views for fp8 records, which
    not every backend copies)."""
    if dst.dtype == FP8:
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    dst.copy_(src, non_blocking=non_blocking)


def _records(k: torch.Tensor, v: torch.Tensor, page_size: int) -> torch.Tensor:
    """Records ``[n, Hkv, 2, S, D]`` (a permuted view, zero-padded past ``T``) of
    ``k, v [T, Hkv, D]``, ``n = ceil(T / S)``."""
    kp, vp = (_pages(x, page_size) for x in (k, v))
    return torch.stack([kp, vp], dim=2).permute(0, 3, 2, 1, 4)


def _pages(x: torch.Tensor, page_size: int) -> torch.Tensor:
    """``x [T, Hkv, D]`` zero-padded to whole pages: ``[n, S, Hkv, D]``."""
    t, hkv, d = x.shape
    n = -(-t // page_size)
    padded = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, n * page_size - t))
    return padded.view(n, page_size, hkv, d)


def _key_bounds(k: torch.Tensor, page_size: int) -> torch.Tensor:
    """Per page the element-wise key min and max over its valid positions:
    ``k [T, Hkv, D]`` -> ``[n, Hkv, 2, D]`` in ``k``'s dtype."""
    kp = _pages(k, page_size)
    n, t = kp.shape[0], k.shape[0]
    valid = (torch.arange(n * page_size, device=k.device) < t).view(n, page_size, 1, 1)
    kmin = torch.where(valid, kp, torch.full_like(kp, float("inf"))).amin(1)
    kmax = torch.where(valid, kp, torch.full_like(kp, float("-inf"))).amax(1)
    return torch.stack([kmin, kmax], dim=2)


def _fill_records(buf: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write the records of ``k, v [T, Hkv, D]`` into ``buf [n, Hkv, 2, S, D]``,
    ``n = ceil(T / S)``, converting to ``buf``'s dtype; positions past ``T`` are zero."""
    n, hkv, _, s, d = buf.shape
    t = k.shape[0]
    full, rest = divmod(t, s)
    for j, x in enumerate((k, v)):
        if full:
            buf[:full, :, j].copy_(x[: full * s].reshape(full, s, hkv, d).transpose(1, 2))
        if rest:
            buf[full, :, j, :rest].copy_(x[full * s :].transpose(0, 1))
            buf[full, :, j, rest:].zero_()
