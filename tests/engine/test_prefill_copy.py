"""Chunked prefill writes (:meth:`KVCache.write_prefill_chunk`, the copy-stream path)
against the blocking whole-layer write (:meth:`KVCache.write_prefill`).

On the CPU the chunked path runs synchronously, so these tests pin down its logic: page
alignment of the chunks, the zero-padded last page, staging, one copy per run of
consecutive pool pages in a fragmented pool, metadata. Expected: the same pool bytes and
metadata bit for bit, nothing written outside the request's pages, and the same engine
tokens with ``prefill_copy_stream`` on and off. The ``cuda`` tests check the overlapped
copy (copy stream, pinned pool, double-buffered staging) against the blocking copy.
"""

from __future__ import annotations

import pytest
import torch
from test_kv_cache import TINY

from engine.config import ConfigError, EngineConfig, SamplingParams
from engine.events import Job
from engine.kv.cache import KVCache, page_runs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SENTINEL = 7.0  # pool and metadata fill: a write outside the request's pages shows up


def _config(**kw) -> EngineConfig:
    base = dict(page_size=16, top_k=32, device_buffer=64, sink_tokens=16, local_window=16)
    return EngineConfig(**{**base, **kw})


def _cache(cfg: EngineConfig, device: str = "cpu", pages: int = 48) -> KVCache:
    cache = KVCache(TINY, cfg, torch.device(device), pages, num_pool_pages=pages)
    for t in (*cache.pool, *cache.meta):
        t.fill_(SENTINEL)
    return cache


def _fragment(cache: KVCache) -> None:
    """Allocate and release other requests so the next allocation gets non-contiguous,
    out-of-order pool pages: pages 5-8, then 0-2, then 10 on (three runs)."""
    for sid, n in ((100, 3), (101, 2), (102, 4), (103, 1)):
        cache.allocate(sid, n * cache.page_size)
    cache.release(100)
    cache.release(102)


def _write_like_engine(cache, seq_id, layer, k, v, chunk):
    """The engine's schedule (:meth:`Engine.prefill_hidden`): after each chunk, the whole
    pages not yet written; the partial last page with the last chunk."""
    t, s, written = k.shape[0], cache.page_size, 0
    for a in range(0, t, chunk):
        e = min(a + chunk, t)
        end = e if e == t else e - e % s
        if end > written:
            cache.write_prefill_chunk(seq_id, layer, k[written:end], v[written:end], written)
            written = end
    cache.finish_prefill(seq_id)


def _same_bytes(a: KVCache, b: KVCache) -> None:
    a.synchronize()
    b.synchronize()
    for layer in range(a.num_layers):
        pa, pb = a.pool[layer], b.pool[layer]
        assert torch.equal(pa.view(torch.uint8), pb.view(torch.uint8)), f"layer {layer}: pool"
        ma, mb = a.meta[layer].cpu(), b.meta[layer].cpu()
        assert torch.equal(ma.view(torch.uint8), mb.view(torch.uint8)), f"layer {layer}: meta"


def test_page_runs_split_a_fragmented_page_list():
    assert page_runs([]) == []
    assert page_runs([4]) == [(0, 4, 1)]
    assert page_runs([5, 6, 7, 8, 0, 1, 2, 10, 11]) == [(0, 5, 4), (4, 0, 3), (7, 10, 2)]
    assert page_runs([3, 2, 1]) == [(0, 3, 1), (1, 2, 1), (2, 1, 1)]


def test_fragmented_pool_gives_non_contiguous_pages():
    cache = _cache(_config())
    _fragment(cache)
    seq = cache.allocate(0, 150)
    assert seq.pages == [5, 6, 7, 8, 0, 1, 2, 10, 11, 12]
    assert len(page_runs(seq.pages)) == 3


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("hierarchical", [True, False])
@pytest.mark.parametrize(
    ("t", "chunk"),
    [(1, 16), (15, 7), (16, 16), (37, 24), (150, 40), (150, 1024), (149, 16), (163, 33)],
)
def test_chunked_write_equals_whole_layer_write(t, chunk, hierarchical, kv_dtype):
    cfg = _config(prefill_chunk=chunk, kv_dtype=kv_dtype, hierarchical=hierarchical)
    chunked, whole = _cache(cfg), _cache(cfg.replace(prefill_copy_stream=False))
    gen = torch.Generator().manual_seed(t * 1000 + chunk)
    for cache in (chunked, whole):
        _fragment(cache)
        cache.allocate(0, t + 20)
    assert chunked.seqs[0].pages == whole.seqs[0].pages
    for layer in range(TINY.num_layers):
        k = torch.randn(t, TINY.num_kv_heads, TINY.head_dim, generator=gen)
        v = torch.randn(t, TINY.num_kv_heads, TINY.head_dim, generator=gen)
        _write_like_engine(chunked, 0, layer, k, v, chunk)
        whole.write_prefill(0, layer, k, v, 0)
    _same_bytes(chunked, whole)
    n = chunked.pages_for(t)
    untouched = sorted(set(range(chunked.num_pool_pages)) - set(chunked.seqs[0].pages[:n]))
    assert bool((chunked.pool[0][untouched] == SENTINEL).all()), "wrote outside the request"
    tail = t % cfg.page_size
    if tail:  # the partial last page is zero past the prompt
        last = chunked.pool[1][chunked.seqs[0].pages[n - 1]]
        assert bool((last[:, :, tail:] == 0).all())


@pytest.mark.parametrize(("t", "chunk"), [(37, 24), (149, 16)])
def test_fp8_chunked_write_equals_whole_layer_write(t, chunk):
    """fp8 host pages: the staged chunked write and the whole-layer write leave the same
    fp8 records, exponents and metadata; the records dequantise to the fp8-rounded K/V and
    the metadata bounds the rounded keys (what attention reads)."""
    from kernels.fp8_kv import FP8, fp8_dequantize_ref, fp8_round_ref

    cfg = _config(prefill_chunk=chunk, kv_host_dtype="fp8")
    chunked, whole = _cache(cfg), _cache(cfg.replace(prefill_copy_stream=False))
    assert chunked.pool[0].dtype == FP8 and chunked.record_bytes == 2 * 16 * (TINY.head_dim + 1)
    gen = torch.Generator().manual_seed(t)
    for cache in (chunked, whole):
        _fragment(cache)
        cache.allocate(0, t + 20)
    keys = []
    for layer in range(TINY.num_layers):
        k = torch.randn(t, TINY.num_kv_heads, TINY.head_dim, generator=gen) * 20
        v = torch.randn(t, TINY.num_kv_heads, TINY.head_dim, generator=gen)
        keys.append((k, v))
        _write_like_engine(chunked, 0, layer, k, v, chunk)
        whole.write_prefill(0, layer, k, v, 0)
    _same_bytes(chunked, whole)
    pages = torch.tensor(chunked.seqs[0].pages[: chunked.pages_for(t)])
    for layer, (k, v) in enumerate(keys):
        assert torch.equal(chunked.pool_scale[layer][pages], whole.pool_scale[layer][pages])
        rec = fp8_dequantize_ref(
            chunked.pool[layer][pages], chunked.pool_scale[layer][pages], torch.float32
        )  # [n, Hkv, 2, S, D]
        tokens = rec.permute(0, 3, 1, 2, 4).reshape(-1, TINY.num_kv_heads, 2, TINY.head_dim)
        assert torch.equal(tokens[:t, :, 0], fp8_round_ref(k))
        assert torch.equal(tokens[:t, :, 1], fp8_round_ref(v))
        assert not torch.equal(tokens[:t, :, 0], k)
        meta = chunked.meta[layer][pages[0]]  # first page: tokens 0..15
        assert torch.equal(meta[:, 0], fp8_round_ref(k)[:16].amin(0))
        assert torch.equal(meta[:, 1], fp8_round_ref(k)[:16].amax(0))


def test_one_call_larger_than_the_staging_buffers_is_split():
    cfg = _config(prefill_chunk=16)  # staging holds 2 pages
    chunked, whole = _cache(cfg), _cache(cfg)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(150, TINY.num_kv_heads, TINY.head_dim, generator=gen)
    v = torch.randn(150, TINY.num_kv_heads, TINY.head_dim, generator=gen)
    for cache in (chunked, whole):
        _fragment(cache)
        cache.allocate(0, 150)
    chunked.write_prefill_chunk(0, 0, k, v, 0)
    whole.write_prefill(0, 0, k, v, 0)
    _same_bytes(chunked, whole)
    assert chunked.staging_pages == 2
    record = 2 * 16 * TINY.head_dim * 4
    assert chunked.staging_bytes == 2 * chunked.staging_pages * TINY.num_kv_heads * record


def test_staging_buffers_alternate_and_are_reused():
    cache = _cache(_config(prefill_chunk=32))
    cache.allocate(0, 128)
    k = torch.randn(128, TINY.num_kv_heads, TINY.head_dim)
    cache.write_prefill_chunk(0, 0, k[:32], k[:32], 0)
    ptrs = [t.data_ptr() for t in cache._staging]
    assert cache._next_staging == 1
    for a in range(32, 128, 32):
        cache.write_prefill_chunk(0, 0, k[a : a + 32], k[a : a + 32], a)
    assert [t.data_ptr() for t in cache._staging] == ptrs, "staging reallocated"
    assert cache._next_staging == 0


def test_prefill_write_errors():
    cache = _cache(_config())
    cache.allocate(0, 40)  # 3 pages
    k = torch.zeros(16, TINY.num_kv_heads, TINY.head_dim)
    for write in (cache.write_prefill, cache.write_prefill_chunk):
        with pytest.raises(ValueError, match="page-aligned"):
            write(0, 0, k, k, 8)
        with pytest.raises(ValueError, match="has 3"):
            write(0, 0, torch.zeros(40, 2, 8), torch.zeros(40, 2, 8), 16)


def test_close_frees_the_pool_and_refuses_new_requests():
    cache = _cache(_config())
    cache.allocate(0, 40)
    cache.write_prefill_chunk(0, 0, torch.ones(40, 2, 8), torch.ones(40, 2, 8), 0)
    cache.close()
    cache.close()  # idempotent
    assert cache.closed and cache.pool == [] and cache.meta == [] and cache.staging_bytes == 0
    with pytest.raises(RuntimeError, match="closed"):
        cache.allocate(1, 16)


def test_prefill_copy_stream_is_validated():
    with pytest.raises(ConfigError, match="prefill_copy_stream"):
        EngineConfig(prefill_copy_stream="yes").validate()
    EngineConfig(prefill_copy_stream=False).validate()


# ----- the engine: prefill_copy_stream on and off --------------------------------------


def _engine(device: str, dtype: torch.dtype, **kw):
    from engine.model.llama import LlamaModel
    from engine.model.rope import Rope
    from engine.serve.engine import Engine
    from engine.weights.synthetic import TINY as SHAPE
    from engine.weights.synthetic import synthetic_weights
    from kernels.dispatch import get_ops

    cfg = EngineConfig(
        device=device,
        dtype=str(dtype).removeprefix("torch."),
        kv_dtype=str(dtype).removeprefix("torch."),
        page_size=16,
        top_k=32,
        device_buffer=48,  # 3 pages: decode misses
        sink_tokens=16,
        local_window=16,
        max_batch=4,  # the requests of _fragment hold slabs too
        host_pool_gb=0.01,
        **kw,
    )
    cfg.validate()
    weights = synthetic_weights(SHAPE)
    rope = Rope(SHAPE.head_dim, SHAPE.rope_theta)
    model = LlamaModel(weights, torch.device(device), dtype, "float", rope)
    eng = Engine(model, None, cfg, get_ops(device, cfg.use_triton), 4096)
    eng.keep_logits = True
    return eng


def _run(eng, ids, steps: int):
    """Fragment the pool, prefill ``ids``, decode ``steps`` greedy tokens; returns the
    tokens, the logits of every step and the request's pool pages and metadata per layer."""
    c = eng.cache
    _fragment(c)
    req = eng.open_request(Job("x", tuple(ids), SamplingParams(max_tokens=steps + 1)))
    assert len(page_runs(c.seqs[req.seq_id].pages)) > 1
    eng.prefill(req)
    c.synchronize()
    n = c.pages_for(len(ids))
    idx = torch.tensor(c.seqs[req.seq_id].pages[:n])
    kv = [(p[idx].clone(), m[idx.to(m.device)].cpu()) for p, m in zip(c.pool, c.meta, strict=True)]
    logits = [req.logits.float().cpu()]
    while len(req.generated) < steps:
        req.generated.append(eng.decode_step([req])[0])
        logits.append(req.logits.float().cpu())
    c.check_integrity()
    eng.close_request(req)
    return req.generated, torch.stack(logits), kv


@pytest.mark.parametrize(("t", "chunk"), [(203, 48), (190, 1024), (64, 32)])
def test_engine_tokens_and_pool_unchanged_by_the_chunked_write(t, chunk):
    ids = torch.randint(0, 49152, (t,), generator=torch.Generator().manual_seed(t)).tolist()
    on = _engine("cpu", torch.float32, prefill_chunk=chunk, prefill_copy_stream=True)
    off = _engine("cpu", torch.float32, prefill_chunk=chunk, prefill_copy_stream=False)
    tok_on, log_on, kv_on = _run(on, ids, 12)
    tok_off, log_off, kv_off = _run(off, ids, 12)
    assert tok_on == tok_off
    assert torch.equal(log_on, log_off)
    for layer, ((p1, m1), (p2, m2)) in enumerate(zip(kv_on, kv_off, strict=True)):
        assert torch.equal(p1, p2) and torch.equal(m1, m2), f"layer {layer}"
    on.close()
    assert on.cache.closed


# ----- CUDA: the copy stream ------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize(("t", "chunk"), [(4099, 256), (1000, 1024), (777, 100)])
def test_cuda_overlapped_copy_equals_blocking_copy(t, chunk):
    """Many chunks in flight (staging reuse guarded by events), a fragmented pinned pool,
    bf16: the pool bytes equal a blocking copy, and a compute-stream read ordered only by
    :meth:`KVCache.finish_prefill` (no host sync) already sees them."""
    cfg = _config(prefill_chunk=chunk, kv_dtype="bfloat16")
    pages = 400
    fast = _cache(cfg, "cuda", pages)
    slow = _cache(cfg.replace(prefill_copy_stream=False), "cuda", pages)
    assert fast.copy_stream is not None and slow.copy_stream is None
    assert fast.pool[0].is_pinned()
    for cache in (fast, slow):
        _fragment(cache)
        cache.allocate(0, t + 1)
    gen = torch.Generator(device="cuda").manual_seed(t)
    shape = (t, TINY.num_kv_heads, TINY.head_dim)
    seen = []
    for layer in range(TINY.num_layers):
        with torch.cuda.stream(fast.copy_stream):  # a slow copy stream: staging reuse waits
            torch.cuda._sleep(50_000_000)
        k = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
        slow.write_prefill(0, layer, k, v, 0)
        _write_like_engine(fast, 0, layer, k, v, chunk)  # ends with finish_prefill
        k.fill_(float("nan"))  # the copies read staging, never the caller's tensors
        v.fill_(float("nan"))
        seen.append(fast.pool[layer].to("cuda", non_blocking=True))  # compute-stream read
    torch.cuda.synchronize()
    for layer in range(TINY.num_layers):
        assert torch.equal(seen[layer].cpu().view(torch.uint8), slow.pool[layer].view(torch.uint8))
    _same_bytes(fast, slow)
    fast.release(0)
    fast.close()
    slow.close()


@pytest.mark.cuda
@cuda
def test_cuda_engine_tokens_with_and_without_the_copy_stream():
    ids = torch.randint(0, 49152, (1500,), generator=torch.Generator().manual_seed(1)).tolist()
    on = _engine("cuda", torch.bfloat16, prefill_chunk=256, prefill_copy_stream=True)
    off = _engine("cuda", torch.bfloat16, prefill_chunk=256, prefill_copy_stream=False)
    assert on.cache.copy_stream is not None
    tok_on, log_on, kv_on = _run(on, ids, 16)
    tok_off, log_off, kv_off = _run(off, ids, 16)
    assert tok_on == tok_off
    assert torch.equal(log_on, log_off)
    for layer, ((p1, m1), (p2, m2)) in enumerate(zip(kv_on, kv_off, strict=True)):
        assert torch.equal(p1, p2) and torch.equal(m1, m2), f"layer {layer}"
    on.close()
    off.close()


@pytest.mark.cuda
@cuda
def test_cuda_pool_pinned_in_chunks_gives_the_same_tokens(monkeypatch):
    """A host pool page-locked a few pages at a time, as jobs are given pages
    (:mod:`engine.kv.host_pool`), reads and writes exactly what a pool locked whole does:
    prefill copies, gathers through unified addressing, and the decoded tokens."""
    from engine.kv import host_pool

    whole = _engine("cuda", torch.bfloat16, prefill_chunk=256)
    tok_whole, log_whole, kv_whole = _run(whole, list(range(7, 1507)), 16)
    assert whole.cache.pool_bytes_pinned == whole.cache.pool_bytes_total  # one chunk holds it
    whole.close()
    monkeypatch.setattr(host_pool, "PIN_CHUNK_BYTES", 3 * 4096)  # a few pages per layer
    lazy = _engine("cuda", torch.bfloat16, prefill_chunk=256)
    c = lazy.cache
    assert c.pool[0].is_pinned() and c.pool_bytes_pinned < c.pool_bytes_total
    tok_lazy, log_lazy, kv_lazy = _run(lazy, list(range(7, 1507)), 16)
    pages_used = max(p for seq in c.seqs.values() for p in seq.pages) + 1 if c.seqs else 0
    assert c.host.pinned_pages >= pages_used and c.pool_bytes_pinned < c.pool_bytes_total
    assert tok_lazy == tok_whole and torch.equal(log_lazy, log_whole)
    for (p1, m1), (p2, m2) in zip(kv_lazy, kv_whole, strict=True):
        assert torch.equal(p1, p2) and torch.equal(m1, m2)
    lazy.close()


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, cuda])]
)
def test_fp8_host_pages_equal_a_rounded_resident_pool(monkeypatch, device):
    """fp8 host pages (on CUDA: Triton append and dequantising gather, a pool pinned in
    chunks, the copy stream) give the same logits and tokens as an all-resident pool
    holding the same fp8-rounded KV, bit for bit, with decode misses; and not those of a
    bf16 pool (the rounding is real)."""
    from engine.kv import host_pool

    monkeypatch.setattr(host_pool, "PIN_CHUNK_BYTES", 3 * 4096)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ids = list(range(7, 1507)) if device == "cuda" else list(range(7, 200))
    steps = 16 if device == "cuda" else 6

    def run(**kw):
        eng = _engine(device, dtype, prefill_chunk=256, **kw)
        out = _run(eng, ids, steps)
        eng.close()
        return eng, out

    hier, (tok_h, log_h, _) = run(kv_host_dtype="fp8")
    _, (tok_r, log_r, _) = run(kv_host_dtype="fp8", hierarchical=False)
    _, (_, log_b, _) = run(kv_host_dtype="bf16", hierarchical=False)
    assert tok_h == tok_r and torch.equal(log_h, log_r)
    assert not torch.equal(log_b[1:], log_r[1:])  # decode reads the rounded KV
    if device == "cuda":
        assert hier.cache.host_fp8 and hier.cache.host.pinned_pages < hier.cache.num_pool_pages


def test_host_pool_without_pinning_is_whole_and_grows_nothing():
    """On CPU (or a pool not pinned) every page counts as usable: nothing to lock."""
    from engine.kv.host_pool import HostPool

    pool = HostPool(2, (10, 2, 2, 16, 8), torch.float32, pin=False)
    assert pool.pinned_pages == 10 and pool.pinned_bytes == pool.capacity_bytes == 2 * 10 * 2048
    pool.ensure_pinned(10)  # a no-op
    assert [tuple(t.shape) for t in pool.layers] == [(10, 2, 2, 16, 8)] * 2
    fp8 = HostPool(2, (10, 2, 2, 16, 8), torch.float8_e4m3fn, pin=False, scale_shape=(10, 2, 2, 16))
    assert fp8.layer_page_bytes == 2 * 2 * 16 * (8 + 1) and len(fp8.scales) == 2
    assert fp8.capacity_bytes == 2 * 10 * fp8.layer_page_bytes


def test_page_runs_split_at_registration_chunks():
    """A lazily pinned pool registers aligned chunks; no copy run may cross one."""
    pages = [0, 1, 2, 3, 4, 9, 10, 11, 12]
    assert page_runs(pages) == [(0, 0, 5), (5, 9, 4)]
    assert page_runs(pages, 4) == [(0, 0, 4), (4, 4, 1), (5, 9, 3), (8, 12, 1)]
