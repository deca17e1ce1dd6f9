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

Pinning in chunks also avoids the very large single registrations that fail ("invalid
argument", sglang #7666). Registered ranges are unregistered when their layer tensor is
garbage-collected. Where the runtime offers no ``cudaHostRegister``, each layer is pinned
whole at start with ``pin_memory()`` (torch's allocator, power-of-two blocks).
"""

from __future__ import annotations

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
        cudart = torch.cuda.cudart()
        while self.pinned_pages < num_pages:  # whole, aligned chunks: [i*C, (i+1)*C)
            start = self.pinned_pages
            end = min(self.num_pages, start + self.chunk_pages)
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


def _page_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of one pool page (dims ``1:`` of ``shape``) in ``dtype``."""
    n = 1
    for d in shape[1:]:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


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
