"""The KV hierarchy: KV pool (host pool), page metadata, hot buffer (slab pool), page
tables and LRU state. Names follow DESIGN.md.

* **KV pool** — per layer ``[P_pool, Hkv, 2, S, D]``; a *record* is ``pool[l][p, h]``
  (``[2, S, D]``: keys then values of one page, one layer, one KV head). Pool pages are
  handed out from a free list; a request's pages are listed in its block table. With
  the hierarchical path the pool lives in (pinned, when CUDA is present) host memory and
  is the authoritative copy; otherwise it lives on the compute device.
* **Page metadata** — per layer ``[P_pool, Hkv, 2, D]`` key min / max, on the compute device.
* **Hot buffer** — per layer ``[N, 2, S, D]`` record slots, ``N = num_slabs * C``. Each
  (request, KV head) owns one slab (the same slab id in every layer) of ``C`` slots.
* **Page table** — per layer ``[num_slabs, P_max]`` int32: request page -> slot or -1.
* **LRU state** — per layer ``slot_page [N]`` int32 and ``slot_last_use [N]`` int64.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig, ModelConfig


class CacheFullError(RuntimeError):
    """Not enough free pool pages or slabs for a request."""


@dataclass
class SeqCache:
    """Cache bookkeeping of one request: ``pages`` (pool page per request page),
    ``slab_ids`` (one per KV head, hierarchical only) and ``num_tokens`` stored."""

    seq_id: int
    pages: list[int] = field(default_factory=list)
    slab_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0


def available_host_bytes() -> int | None:
    """Host memory available for the KV pool, in bytes: ``$HISPARSE_HOST_MEMORY_GB`` (GiB)
    when set — for virtual machines whose memory grows on demand, where ``MemAvailable``
    reads far below what can be used — else ``MemAvailable`` of ``/proc/meminfo``
    (``None`` where it cannot be read).

    Raises
    ------
    ValueError
        ``HISPARSE_HOST_MEMORY_GB`` is not a positive number.
    """
    declared = os.environ.get("HISPARSE_HOST_MEMORY_GB")
    if declared:
        try:
            gib = float(declared)
        except ValueError:
            gib = -1.0
        if gib <= 0:
            raise ValueError(f"HISPARSE_HOST_MEMORY_GB={declared!r} is not a positive number")
        return int(gib * 2**30)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_memory(pool_bytes: int) -> None:
    """Refuse a host pool larger than 90% of the memory available now.

    Raises
    ------
    CacheFullError
        Naming the pool size, what is available and the setting to lower.
    """
    avail = available_host_bytes()
    if avail is not None and pool_bytes > 0.9 * avail:
        raise CacheFullError(
            f"the host KV pool needs {pool_bytes / 2**30:.1f} GiB but only "
            f"{avail / 2**30:.1f} GiB of host memory is available; lower host_pool_gb "
            "(--host-pool GB, shared by all workers)"
        )


def _pin_chunked(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Allocate one layer of the pool; page-locked when ``pin``.

    Pinning registers an exactly-sized pageable allocation with ``cudaHostRegister``
    (portable and mapped, so every device can address it through unified virtual
    addressing): torch's pinned allocator (``Tensor.pin_memory``) rounds every block up
    to a power of two, which can nearly double a large pool. Registered layers are
    unregistered when the tensor is garbage-collected. Where the runtime offers no
    ``cudaHostRegister``, ``pin_memory()`` is used instead.

    Raises
    ------
    CacheFullError
        The memory could not be page-locked; names the size and the setting to lower.
    """
    t = torch.empty(shape, dtype=dtype)
    if not pin:
        return t
    nbytes = t.numel() * t.element_size()
    try:
        cudart = torch.cuda.cudart()
        flags = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
        err = cudart.cudaHostRegister(t.data_ptr(), nbytes, flags)
        if getattr(err, "value", err) == 0 and t.is_pinned():
            weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
            return t
        if getattr(err, "value", err) == 0:
            cudart.cudaHostUnregister(t.data_ptr())
        reason = f"cudaHostRegister returned {err}"
    except (AttributeError, RuntimeError) as e:
        reason = repr(e)
    try:
        return t.pin_memory()
    except RuntimeError as e:
        raise CacheFullError(
            f"could not pin {nbytes / 2**30:.2f} GiB of host memory for the KV pool ({reason}; "
            f"{e}); lower host_pool_gb"
        ) from e


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
        If pinned host memory cannot be allocated.
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
        layers = layers if layers is not None else range(model.num_layers)
        self.layer_offset, self.num_layers = layers.start, len(layers)
        hkv, d, nl = model.num_kv_heads, model.head_dim, self.num_layers
        self.record_bytes = 2 * s * d * self.dtype.itemsize
        self.page_bytes = nl * hkv * self.record_bytes
        if num_pool_pages is None:
            model_page_bytes = model.num_layers * hkv * self.record_bytes
            num_pool_pages = max(1, int(config.host_pool_gb * 2**30) // model_page_bytes)
        self.num_pool_pages = num_pool_pages
        self.max_pages_per_seq = max_pages_per_seq
        pool_dev = torch.device("cpu") if self.hierarchical else device
        if pool_dev.type == "cpu":
            check_host_memory(num_pool_pages * self.page_bytes)
        pin = self.hierarchical and device.type == "cuda"
        shape = (num_pool_pages, hkv, 2, s, d)
        if pool_dev.type == "cpu":
            self.pool = [_pin_chunked(shape, self.dtype, pin) for _ in range(nl)]
        else:
            self.pool = [torch.empty(shape, dtype=self.dtype, device=pool_dev) for _ in range(nl)]
        self.meta = [
            torch.zeros(num_pool_pages, hkv, 2, d, dtype=self.dtype, device=device) for _ in range(nl)
        ]
        self.free_pages: list[int] = list(range(num_pool_pages - 1, -1, -1))
        self.slots_per_slab = config.buffer_pages
        self.num_slabs = config.max_batch * hkv if self.hierarchical else 0
        n = self.num_slabs * self.slots_per_slab
        self.slots = [torch.zeros(n, 2, s, d, dtype=self.dtype, device=device) for _ in range(nl)]
        self.page_table = [
            torch.full((self.num_slabs, max_pages_per_seq), -1, dtype=torch.int32, device=device)
            for _ in range(nl)
        ]
        self.slot_page = [torch.full((n,), -1, dtype=torch.int32, device=device) for _ in range(nl)]
        self.slot_last_use = [torch.full((n,), -1, dtype=torch.int64, device=device) for _ in range(nl)]
        self.free_slabs: list[int] = list(range(self.num_slabs - 1, -1, -1))
        self.seqs: dict[int, SeqCache] = {}

    # ----- sizes -------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def pool_bytes_total(self) -> int:
        return self.num_pool_pages * self.page_bytes

    @property
    def pool_bytes_used(self) -> int:
        return (self.num_pool_pages - len(self.free_pages)) * self.page_bytes

    @property
    def hot_buffer_bytes(self) -> int:
        return sum(t.nbytes for t in self.slots)

    @property
    def metadata_bytes(self) -> int:
        return sum(t.nbytes for t in self.meta)

    def can_admit(self, num_tokens: int) -> bool:
        """Whether a request that will hold ``num_tokens`` tokens fits now."""
        need = self.pages_for(num_tokens)
        slabs = self.model.num_kv_heads if self.hierarchical else 0
        return (
            need <= len(self.free_pages)
            and slabs <= len(self.free_slabs)
            and need <= self.max_pages_per_seq
        )

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` could fit in an empty cache."""
        need = self.pages_for(num_tokens)
        return need <= self.num_pool_pages and need <= self.max_pages_per_seq

    # ----- lifecycle ---------------------------------------------------------------
    def allocate(self, seq_id: int, reserve_tokens: int) -> SeqCache:
        """Reserve pool pages for ``reserve_tokens`` and, when hierarchical, one slab per
        KV head. Raises :class:`CacheFullError` when they are not free."""
        if not self.can_admit(reserve_tokens):
            raise CacheFullError(f"no room for {reserve_tokens} tokens")
        seq = SeqCache(seq_id)
        seq.pages = [self.free_pages.pop() for _ in range(self.pages_for(reserve_tokens))]
        if self.hierarchical:
            seq.slab_ids = [self.free_slabs.pop() for _ in range(self.model.num_kv_heads)]
        self.seqs[seq_id] = seq
        return seq

    def release(self, seq_id: int) -> None:
        """Return a request's pages and slabs; its slots are emptied in every layer."""
        seq = self.seqs.pop(seq_id)
        self.free_pages.extend(reversed(seq.pages))
        c = self.slots_per_slab
        for slab in seq.slab_ids:
            for layer in range(self.num_layers):
                self.page_table[layer][slab].fill_(-1)
                self.slot_page[layer][slab * c : (slab + 1) * c] = -1
                self.slot_last_use[layer][slab * c : (slab + 1) * c] = -1
        self.free_slabs.extend(reversed(seq.slab_ids))

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
    def write_prefill(self, seq_id: int, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Store K/V of positions ``start .. start + T - 1`` (``start`` page-aligned) of one
        layer into the pool and set those pages' metadata.

        k, v : ``[T, Hkv, D]`` on the compute device.
        """
        s = self.page_size
        t, hkv, d = k.shape
        if start % s:
            raise ValueError(f"prefill write start={start} is not page-aligned")
        n_pages = self.pages_for(t)
        pad = n_pages * s - t
        kp = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)).view(n_pages, s, hkv, d)
        vp = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).view(n_pages, s, hkv, d)
        rec = torch.stack([kp, vp], dim=2).permute(0, 3, 2, 1, 4)  # [n, Hkv, 2, S, D]
        first = start // s
        pages = torch.tensor(self.seqs[seq_id].pages[first : first + n_pages], dtype=torch.long)
        pool = self.pool[layer]
        pool[pages.to(pool.device)] = rec.to(pool.device, self.dtype)
        valid = (torch.arange(n_pages * s, device=k.device) < t).view(n_pages, s, 1, 1)
        kmin = torch.where(valid, kp, torch.full_like(kp, float("inf"))).amin(1)
        kmax = torch.where(valid, kp, torch.full_like(kp, float("-inf"))).amax(1)
        self.meta[layer][pages.to(self.device)] = torch.stack([kmin, kmax], dim=2).to(self.dtype)

    # ----- checks ------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert the invariants tests rely on; raises ``AssertionError`` naming the breach.

        * pool pages: every page is either free or owned by exactly one request;
        * slabs: every slab is either free or owned by exactly one (request, KV head);
        * per layer: no page in two slots; page table and slot owners agree; free slabs
          hold no pages; last-use is -1 exactly for empty slots.
        """
        owned = [p for s in self.seqs.values() for p in s.pages]
        assert len(owned) == len(set(owned)), "a pool page is owned twice"
        assert not set(owned) & set(self.free_pages), "a pool page is both free and owned"
        assert len(owned) + len(self.free_pages) == self.num_pool_pages, "pool pages leaked"
        slabs = [x for s in self.seqs.values() for x in s.slab_ids]
        assert len(slabs) == len(set(slabs)), "a slab is owned twice"
        assert len(slabs) + len(self.free_slabs) == self.num_slabs, "slabs leaked"
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
