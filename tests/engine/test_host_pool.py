"""The host pool's page-locking in chunks (:mod:`engine.kv.host_pool`), on the CPU with a
recording stand-in for ``cudaHostRegister``: which ranges are registered, that the next
chunk is backed ahead of need, and that backing memory never changes what it holds. The
real registration is covered on CUDA by ``test_prefill_copy.py``
(``test_cuda_pool_pinned_in_chunks_gives_the_same_tokens``)."""

from __future__ import annotations

import sys

import pytest
import torch

from engine.kv import host_pool
from engine.kv.host_pool import HostPool, advise_hugepages, populate

LINUX = sys.platform.startswith("linux")


class _Cudart:
    """Records ``cudaHostRegister(ptr, size, flags)`` calls; always succeeds."""

    def __init__(self):
        self.registered: list[tuple[int, int]] = []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - the CUDA runtime's name
        assert flags == 3
        self.registered.append((ptr, size))
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        return 0


@pytest.fixture
def cudart(monkeypatch):
    fake = _Cudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


@pytest.mark.skipif(not LINUX, reason="madvise is Linux-only")
def test_populate_and_hugepage_advice_keep_the_contents():
    t = torch.arange(3 << 20, dtype=torch.int32)  # 12 MiB, already written
    want = t.clone()
    assert populate(t.data_ptr() + 4100, 5 << 20)  # unaligned start: widened to OS pages
    advise_hugepages(t)  # a hint; may be refused (THP off), must not fail or change data
    assert torch.equal(t, want)
    fresh = torch.empty(1 << 22, dtype=torch.uint8)  # untouched: populate backs it
    assert populate(fresh.data_ptr(), fresh.numel())


def test_chunks_are_registered_in_order_and_the_next_is_backed_ahead(cudart, monkeypatch):
    backed: list[tuple[int, int]] = []
    real = host_pool.populate

    def spy(addr, size):
        backed.append((addr, size))
        return real(addr, size) if LINUX else False

    monkeypatch.setattr(host_pool, "populate", spy)
    monkeypatch.setattr(host_pool, "_has_host_register", lambda: True)
    layers, shape = 3, (10, 2, 2, 4, 8)  # 10 pages of 2*2*4*8*2 = 256 bytes per layer
    pool = HostPool(layers, shape, torch.bfloat16, pin=True, chunk_bytes=4 * 256)
    assert pool.lazy and pool.chunk_pages == 4 and pool.pinned_pages == 4
    page = pool.layer_page_bytes
    assert cudart.registered == [(t.data_ptr(), 4 * page) for t in pool.layers]
    pool._join_prefault()
    assert pool._faulted_pages == 8  # chunk [4, 8) backed before anyone asked for it
    assert [(a - t.data_ptr(), n) for (a, n), t in zip(backed[-3:], pool.layers, strict=True)] == [
        (4 * page, 4 * page)
    ] * layers
    pool.layers[0][5].fill_(1.5)  # the pages the background thread backed are usable
    n_backed = len(backed)
    pool.ensure_pinned(9)  # chunks [4, 8) and [8, 10)
    assert pool.pinned_pages == 10
    regs = [(a - t.data_ptr(), n) for (a, n), t in zip(cudart.registered[3:], pool.layers * 2, strict=True)]
    assert regs == [(4 * page, 4 * page)] * layers + [(8 * page, 2 * page)] * layers
    # [4, 8) was not backed again; [8, 10) was, on this thread; nothing is left to back
    assert [(a - pool.layers[i % 3].data_ptr()) // page for i, (a, _) in enumerate(backed[n_backed:])] == [8] * layers
    assert pool._prefault_thread is None
    assert bool((pool.layers[0][5] == 1.5).all())
    pool.ensure_pinned(10)  # already pinned: nothing registered
    assert len(cudart.registered) == 3 * layers


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((3, 5), torch.float32), ((300, 3, 2, 64), torch.float32), ((1 << 19, 3), torch.bfloat16)],
)
def test_zeros_equal_torch_zeros_and_are_writable(shape, dtype):
    """Small tensors (torch.zeros) and large ones (a lazily zeroed mapping) alike."""
    t = host_pool.zeros(shape, dtype, "cpu")
    want = torch.zeros(shape, dtype=dtype)
    assert t.shape == want.shape and t.dtype == dtype and t.is_contiguous()
    assert torch.equal(t, want)
    t.view(-1)[-1] = 2
    t[0] = 1
    assert t.view(-1)[-1] == 2 and bool((t[0] == 1).all()) and t.sum() == 2 + t[0].numel()
