"""The host pool: every record of every admitted request, in host memory, page-locked in
chunks as its pages are handed out.

One tensor per layer, ``[P_pool, Hkv, 2, S, D]`` (with fp8 records, ``kv_host_dtype=fp8``,
a second one of their int8 scale exponents, ``[P_pool, Hkv, 2, S]``), reserved whole at start as ordinary
virtual memory (``torch.empty`` touches nothing, so the OS backs a page only when it is
first written). What the GPU must reach is page-locked with ``cudaHostRegister``
(portable, mapped: every device addresses it through unified virtual addressing, at the
host pointer) — but only the prefix of pool pages handed out so far, grown by
:meth:`HostPool.ensure_pinned` in chunks of :data:`PIN_CHUNK_BYTES` (all layers together,
rounded to whole pages) when a request is given pages beyond it. The free list hands out the lowest
free pages first, so the pinned prefix follows the peak of pages in use: a 4 GB batch
never page-locks a 96 GiB cap (``host_pool_gb`` stays the cap and the admission limit).

Registering memory the OS has not backed yet is slow: ``cudaHostRegister`` faults in and
zeroes every 4 KiB page itself (1.7 GB/s on the H200 host, 2026-12-01,
``scripts/measure_pinning.py``; ``docs/performance.md``, "Pinning the host pool"). So the
pool asks for transparent huge pages (``madvise(MADV_HUGEPAGE)``), backs each chunk with
``MADV_POPULATE_WRITE`` before registering it (registration then runs at 16 GB/s), and
backs the *next* chunk on a background thread as soon as one is pinned, so the next
admission finds it ready: growing a 6 GiB pool over 8 admissions spent 0.2 s in
:meth:`HostPool.ensure_pinned` instead of 1.8–2.1 s. Both ``madvise`` calls are Linux-only hints: where they
fail (another OS, a kernel before 5.14), registration faults the pages in as before.

Pinning in chunks also avoids the very large single registrations that fail ("invalid
argument", sglang #7666). Registered ranges are unregistered when their layer tensor is
garbage-collected. Where the runtime offers no ``cudaHostRegister``, each layer is pinned
whole at start with ``pin_memory()`` (torch's allocator, power-of-two blocks).
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
import weakref

import torch

from engine.config import CacheFullError

PIN_CHUNK_BYTES = 1 << 30
"""Bytes page-locked at a time, all layers together (at least one page per layer)."""


class HostPool:
    """Per-layer host tensors of the KV pool, page-locked on demand.

    Parameters
    ----------
    num_layers : layers held (a pipeline stage's)
    shape : one layer's ``(P_pool, Hkv, 2, S, D)``
    dtype : KV dtype of the records (``torch.float8_e4m3fn`` for fp8 records)
    scale_shape : one layer's ``(P_pool, Hkv, 2, S)`` int8 scale exponents of fp8 records
        (:mod:`kernels.fp8_kv`), or ``None`` (no scales); pinned with the records
    pin : page-lock for a CUDA device (hierarchical on CUDA); ``False``: plain memory
    chunk_bytes : per-layer bytes registered at a time (default :data:`PIN_CHUNK_BYTES`
        over the layers, read at construction; tests use small chunks)

    Attributes
    ----------
    layers : list of ``num_layers`` tensors ``[P_pool, Hkv, 2, S, D]``
    scales : list of ``num_layers`` int8 tensors ``[P_pool, Hkv, 2, S]``, or ``[]``
    pinned_pages : pool pages ``[0, pinned_pages)`` page-locked in every layer (all of
        them when not pinning)

    Raises
    ------
    CacheFullError
        The first chunk could not be page-locked (names the size and the setting).
    """

    def __init__(
        self,
        num_layers: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        pin: bool,
        chunk_bytes: int | None = None,
        scale_shape: tuple[int, ...] | None = None,
    ):
        self.layers = [torch.empty(shape, dtype=dtype) for _ in range(num_layers)]
        self.scales = (
            [torch.empty(scale_shape, dtype=torch.int8) for _ in range(num_layers)]
            if scale_shape is not None
            else []
        )
        self.num_pages = shape[0]
        # per layer and page: (tensor list, bytes of one page in it)
        self._parts = [(self.layers, _page_bytes(shape, dtype))]
        if self.scales:
            self._parts.append((self.scales, _page_bytes(scale_shape, torch.int8)))
        self.layer_page_bytes = sum(b for _, b in self._parts)
        chunk = PIN_CHUNK_BYTES // max(num_layers, 1) if chunk_bytes is None else chunk_bytes
        self.chunk_pages = max(1, chunk // max(self.layer_page_bytes, 1))
        self.pin = pin
        self.lazy = pin and _has_host_register()
        self.pinned_pages = 0 if pin else self.num_pages
        if pin and not self.lazy:  # no cudaHostRegister: torch's pinned allocator, whole
            self.layers = [_pin_whole(t) for t in self.layers]
            self.scales = [_pin_whole(t) for t in self.scales]
            self.pinned_pages = self.num_pages
        elif self.lazy:
            for t in (*self.layers, *self.scales):
                advise_hugepages(t)
            self.ensure_pinned(1)  # the tensors report is_pinned() from the start

    @property
    def pinned_bytes(self) -> int:
        """Bytes page-locked now, all layers."""
        return len(self.layers) * self.pinned_pages * self.layer_page_bytes

    @property
    def capacity_bytes(self) -> int:
        """Bytes of the whole pool (the cap), all layers."""
        return len(self.layers) * self.num_pages * self.layer_page_bytes

    def ensure_pinned(self, num_pages: int) -> None:
        """Page-lock pages ``[0, num_pages)`` of every layer (a no-op when they are).

        Grows the pinned prefix by whole chunks, each its own registration starting at a
        multiple of :attr:`chunk_pages` (so a host<->device copy must not cross one:
        :func:`engine.kv.cache.page_runs` splits runs there; kernels reading through
        unified addressing may). Call on the host before handing those pages to a request
        (never inside a CUDA-graph capture).

        Raises
        ------
        CacheFullError
            ``cudaHostRegister`` failed: the memory could not be page-locked.
        """
        if num_pages <= self.pinned_pages:
            return
        self._join_prefault()
        cudart = torch.cuda.cudart()
        while self.pinned_pages < num_pages:  # whole, aligned chunks: [i*C, (i+1)*C)
            start = self.pinned_pages
            end = min(self.num_pages, start + self.chunk_pages)
            if self._faulted_pages < end:
                self._prefault(start, end)
            for tensors, page_bytes in self._parts:
                offset = start * page_bytes
                size = (end - start) * page_bytes
                for t in tensors:
                    ptr = t.data_ptr() + offset
                    err = cudart.cudaHostRegister(ptr, size, 1 | 2)  # Portable | Mapped
                    if getattr(err, "value", err) != 0:
                        raise CacheFullError(
                            f"could not page-lock {size / 2**30:.2f} GiB more of the host KV "
                            f"pool (cudaHostRegister returned {err}; "
                            f"{self.pinned_bytes / 2**30:.2f} GiB locked so far); lower "
                            "host_pool_gb (--host-pool) or run fewer jobs"
                        )
                    weakref.finalize(t, cudart.cudaHostUnregister, ptr)
            self.pinned_pages = end
        if self.pinned_pages < self.num_pages:  # back the next chunk while the GPU works
            start = self.pinned_pages
            end = min(self.num_pages, start + self.chunk_pages)
            self._prefault_thread = threading.Thread(
                target=self._prefault, args=(start, end), name="hisparse-prefault", daemon=True
            )
            self._prefault_thread.start()

    _faulted_pages = 0  # pages [0, n) backed by the OS (populated), every layer
    _prefault_thread: threading.Thread | None = None

    def _prefault(self, start: int, end: int) -> None:
        """Back pool pages ``[start, end)`` of every layer with memory (``MADV_POPULATE_WRITE``)."""
        for tensors, page_bytes in self._parts:
            for t in tensors:
                populate(t.data_ptr() + start * page_bytes, (end - start) * page_bytes)
        self._faulted_pages = max(self._faulted_pages, end)

    def _join_prefault(self) -> None:
        if self._prefault_thread is not None:
            self._prefault_thread.join()
            self._prefault_thread = None


LAZY_ZEROS_MIN_BYTES = 1 << 20
"""CPU tensors from this size on are zeroed lazily by :func:`zeros`."""


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``, without writing the zeros of a
    large CPU tensor up front.

    On the CPU a tensor of at least :data:`LAZY_ZEROS_MIN_BYTES` is a fresh anonymous
    mapping (``mmap(MAP_ANONYMOUS)``, whose pages POSIX and Linux hand out zero-filled on
    first touch), viewed with ``torch.frombuffer``: ``torch.zeros`` writes every byte at
    once, 1-2 GB for the CPU preset's page metadata and hot buffer (0.7-5 s of its
    start-up on the development box, docs/performance.md, "Start-up"), and commits
    memory the run may never use. The mapping is unmapped when the tensor is freed.
    Other devices and small tensors: ``torch.zeros``.
    """
    device = torch.device(device)
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < LAZY_ZEROS_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


def _page_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of one pool page (dims ``1:`` of ``shape``) in ``dtype``."""
    n = 1
    for d in shape[1:]:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


_MADV_HUGEPAGE = 14  # <linux/mman.h>
_MADV_POPULATE_WRITE = 23  # Linux 5.14
_OS_PAGE = 4096
_HUGE_PAGE = 2 << 20


def _madvise(addr: int, size: int, advice: int) -> bool:
    """``madvise(2)`` on ``[addr, addr + size)`` (``addr`` page-aligned); False where it
    fails or the OS has none."""
    libc = _libc()
    if libc is None or size <= 0:
        return False
    return libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(size), ctypes.c_int(advice)) == 0


_LIBC: list = []


def _libc():
    if not _LIBC:
        lib = None
        if sys.platform.startswith("linux"):
            try:
                lib = ctypes.CDLL(None, use_errno=True)
                lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                lib.madvise.restype = ctypes.c_int
            except (OSError, AttributeError):
                lib = None
        _LIBC.append(lib)
    return _LIBC[0]


def advise_hugepages(t: torch.Tensor) -> bool:
    """Ask for transparent huge pages (``MADV_HUGEPAGE``) on the 2 MiB-aligned interior of
    a CPU tensor's memory. A hint: returns whether the OS took it."""
    ptr, size = t.data_ptr(), t.numel() * t.element_size()
    start = (ptr + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
    return _madvise(start, (ptr + size - start) // _HUGE_PAGE * _HUGE_PAGE, _MADV_HUGEPAGE)


def populate(addr: int, size: int) -> bool:
    """Back ``[addr, addr + size)`` with memory now (``MADV_POPULATE_WRITE``: write-faults
    every page, contents unchanged where already backed). Returns whether the OS did; the
    range is widened to whole OS pages."""
    start = addr // _OS_PAGE * _OS_PAGE
    return _madvise(start, addr + size - start, _MADV_POPULATE_WRITE)


def _has_host_register() -> bool:
    try:
        return hasattr(torch.cuda.cudart(), "cudaHostRegister")
    except (AssertionError, RuntimeError, AttributeError):
        return False


def _pin_whole(t: torch.Tensor) -> torch.Tensor:
    try:
        return t.pin_memory()
    except RuntimeError as e:
        raise CacheFullError(
            f"could not pin {t.nbytes / 2**30:.2f} GiB of host memory for the KV pool ({e}); "
            "lower host_pool_gb"
        ) from e
