"""``page_metadata=superpage`` in the engine (tiny synthetic model, CPU): the cache's
superpage rows follow prefill and decode, every superpage a candidate decodes exactly as
flat Quest, the hierarchical path equals the all-resident one bit for bit, and the
settings it cannot serve are refused."""

from __future__ import annotations

import pytest
import torch

from engine import events as ev
from engine.config import ConfigError, EngineConfig, SamplingParams
from kernels.superpage_select import superpage_meta_ref

# 16-token pages, superpages of 2 pages (32 tokens): a 300-token prompt holds 10 of them
# and 40 decode steps cross superpage boundaries.
BASE = dict(
    host_pool_gb=0.25, max_batch=2, page_size=16, top_k=64, sink_tokens=16,
    local_window=16, device_buffer=128, prefill_chunk=96, tokenizer="ids",
    group_combine="max", superpage_pages=2,
)  # fmt: skip
STEPS = 40


def make(**overrides):
    from engine.load import load_engine

    engine = load_engine(EngineConfig(**{**BASE, **overrides}), "synthetic:tiny")
    engine.keep_logits = True
    return engine


def prompt(n=300, seed=3):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(5, 40000, (n,), generator=g).tolist())


def decode(engine, ids, steps=STEPS, check=None):
    """Greedy tokens and per-step logits of one job; ``check(engine, req)`` after each step."""
    req = engine.open_request(ev.Job("j", ids, SamplingParams(max_tokens=steps + 1)))
    logits = []
    try:
        engine.prefill(req)
        while len(req.generated) < steps:
            req.generated.append(engine.decode_step([req])[0])
            logits.append(req.logits.clone())
            if check is not None:
                check(engine, req)
        return list(req.generated), logits
    finally:
        engine.close_request(req)


def superpages_follow_pages(engine, req):
    """Every superpage row of the job equals the bounds of its pages' metadata."""
    c = engine.cache
    seq = c.seqs[req.seq_id]
    used = c.pages_for(seq.num_tokens)
    pages = torch.tensor(seq.pages[:used])
    rows = torch.tensor(seq.superpages[: -(-used // c.superpage_pages)])
    for layer in range(c.num_layers):
        want = superpage_meta_ref(c.meta[layer], pages, c.superpage_pages)
        assert torch.equal(c.super_meta[layer][rows], want), f"layer {layer}"
    c.check_integrity()


def test_superpage_rows_follow_prefill_and_decode():
    engine = make(page_metadata="superpage", hierarchical=False)
    decode(engine, prompt(), check=superpages_follow_pages)
    c = engine.cache
    assert not c.seqs and len(c.free_superpages) == c.super_meta[0].shape[0]
    c.check_integrity()


def test_every_superpage_a_candidate_decodes_as_flat_quest():
    """An oversample whose candidates cover the whole context scores every page: the
    same selections as exact metadata, so the same logits and tokens (the ``max`` rule's
    sums run in the same order)."""
    ids = prompt()
    exact_tokens, exact_logits = decode(make(hierarchical=False), ids)
    wide = make(page_metadata="superpage", superpage_oversample=8.0, hierarchical=False)
    tokens, logits = decode(wide, ids)
    assert tokens == exact_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, exact_logits, strict=True))


def test_hierarchical_superpage_is_bit_identical_to_resident():
    ids = prompt(seed=5)
    narrow = dict(page_metadata="superpage", superpage_oversample=2.0)  # 8 of ~22 pages
    resident_tokens, resident_logits = decode(make(hierarchical=False, **narrow), ids)
    hier = make(hierarchical=True, **narrow)
    misses = []
    tokens, logits = decode(hier, ids, check=lambda e, r: misses.append(int(e.attn.misses.sum())))
    assert tokens == resident_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, resident_logits, strict=True))
    assert sum(misses) > 0


def test_two_level_selection_reads_fewer_pages_and_keeps_the_budget():
    """The narrow setting (C = 4 superpages = 8 candidate pages for a 4-page budget) still
    selects the sinks, the window and exactly ``top_k`` pages."""
    engine = make(page_metadata="superpage", superpage_oversample=2.0, hierarchical=False)
    seen = []
    engine.attn.tracer = lambda plan, layer, sel: seen.append(sel.clone())
    decode(engine, prompt(), steps=4)
    from kernels.bitmask import unpack_bits

    for sel in seen:
        assert (unpack_bits(sel, sel.shape[-1] * 32).sum(-1) == 4).all()


@pytest.mark.parametrize(
    "changes,fields",
    [
        (dict(indexer="oracle"), "indexer"),
        (dict(group_combine="union"), "group_combine"),
        (dict(prefetch_pages=2, device_buffer=256), "prefetch_pages"),
    ],
)
def test_settings_superpages_cannot_serve_are_refused(changes, fields):
    cfg = EngineConfig(**{**BASE, "page_metadata": "superpage", **changes})
    with pytest.raises(ConfigError, match=fields):
        cfg.validate()
    assert EngineConfig(**{**BASE, **changes}).problems() == []


@pytest.mark.parametrize("bad", [0.5, "2", True])
def test_oversample_below_one_is_refused(bad):
    with pytest.raises(ConfigError, match="superpage_oversample"):
        EngineConfig(superpage_oversample=bad).validate()


@pytest.mark.parametrize("hierarchical", [False, True])
def test_sizing_counts_the_superpage_rows(hierarchical):
    from engine.kv import sizing

    engine = make(page_metadata="superpage", hierarchical=hierarchical)
    c, mc, cfg = engine.cache, engine.model_config, engine.config
    supers = sum(t.nbytes for t in c.super_meta) + c.page_super.nbytes
    assert supers == sizing.superpage_bytes(mc, cfg, c.num_pool_pages) > 0
    assert sizing.superpage_bytes(mc, cfg.replace(page_metadata="exact"), c.num_pool_pages) == 0
    if hierarchical:
        assert c.metadata_bytes == sizing.shared_device_bytes(mc, cfg, c.num_pool_pages)
