"""The CPU direct path (``cpu_direct_reads``, :attr:`DecodeAttention.direct`): attention reads
the selected records straight from the host pool instead of resolving them into the hot
buffer and gathering misses. On the tiny synthetic model (CPU) it must give the hierarchical
path's logits and tokens bit for bit, batch rows of different lengths included, and count
every selected record as a hit and none as a miss. The real-model version is the ladder's
``test_cpu_direct_reads_bit_identical_to_hierarchical``."""

from __future__ import annotations

import torch

from engine import events as ev
from engine.config import EngineConfig, SamplingParams

# Small pages and budget over ~200-300-token prompts; a hot buffer that forces misses.
SPARSE = dict(
    host_pool_gb=0.25, max_batch=2, page_size=16, top_k=48, sink_tokens=16,
    local_window=16, device_buffer=96, prefill_chunk=128, tokenizer="ids",
)


def make(**overrides):
    from engine.load import load_engine

    engine = load_engine(EngineConfig(**{**SPARSE, **overrides}), "synthetic:tiny")
    engine.keep_logits = True
    return engine


def prompts():
    g = torch.Generator().manual_seed(5)
    return [tuple(torch.randint(5, 40000, (n,), generator=g).tolist()) for n in (300, 203)]


def decode(engine, steps):
    """Greedy batch decode of both prompts: per step the logits ``[B, V]``, then the tokens
    and the step's (hits, misses) summed over the batch."""
    reqs = [
        engine.open_request(ev.Job(f"j{i}", ids, SamplingParams(max_tokens=steps + 1)))
        for i, ids in enumerate(prompts())
    ]
    for r in reqs:
        engine.prefill(r)
    logits, counts = [], []
    for _ in range(steps):
        tokens = engine.decode_step(reqs)
        logits.append(torch.stack([r.logits for r in reqs]))
        counts.append((int(engine.attn.hits.sum()), int(engine.attn.misses.sum())))
        for r, t in zip(reqs, tokens, strict=True):
            r.generated.append(t)
    out = [list(r.generated) for r in reqs]
    for r in reqs:
        engine.close_request(r)
    return logits, out, counts


def test_direct_reads_equal_the_hierarchy_bit_for_bit():
    hier = make(cpu_direct_reads=False)
    direct = make(cpu_direct_reads=True)
    assert direct.attn.direct and direct.attn.fast_direct and not hier.attn.direct
    logits_h, tokens_h, counts_h = decode(hier, 12)
    logits_d, tokens_d, counts_d = decode(direct, 12)
    assert tokens_d == tokens_h
    for step, (a, b) in enumerate(zip(logits_d, logits_h, strict=True)):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"step {step}"
    # the hierarchy had real misses; the direct path reads the same records in place
    assert sum(m for _, m in counts_h) > 0
    assert all(m == 0 for _, m in counts_d)
    assert [h for h, _ in counts_d] == [h + m for h, m in counts_h]  # the selected records
    direct.cache.check_integrity()


def test_direct_reads_need_the_cpu_and_host_records():
    """fp8 host records keep the hierarchy (its gather dequantises into the hot buffer);
    so does a run that forces the Triton kernels' bitmask path off the fast route."""
    assert not make(cpu_direct_reads=True, kv_host_dtype="fp8").attn.direct
    assert not make(cpu_direct_reads=True, hierarchical=False).attn.direct
    assert make(cpu_direct_reads=True, prefetch_pages=2, device_buffer=128).attn.prefetch_pages == 0


def test_direct_reads_with_superpages_equal_the_hierarchy():
    """Superpage selection (``page_metadata=superpage``) keeps its bitmask route on the
    direct path (its own kernels pick the pages): still the hierarchy's bits."""
    common = dict(page_metadata="superpage", superpage_oversample=2.0)
    logits_h, tokens_h, _ = decode(make(cpu_direct_reads=False, **common), 6)
    direct = make(cpu_direct_reads=True, **common)
    assert direct.attn.direct and direct.attn.two_level(0)
    logits_d, tokens_d, counts_d = decode(direct, 6)
    assert tokens_d == tokens_h
    assert all(torch.equal(a, b) for a, b in zip(logits_d, logits_h, strict=True))
    assert all(m == 0 for _, m in counts_d)
