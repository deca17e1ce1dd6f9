"""Synthetic models: deterministic, 4-bit, memory-bounded generation; tiny shape runs.

Big shapes are never generated here (they are meant for the GPU machine).
"""

from __future__ import annotations

import pytest
import torch

import engine.weights.synthetic as syn
from engine.model.llama import LlamaModel, prefill_attention
from engine.model.rope import Rope
from engine.weights.quant import Int4Weight
from engine.weights.types import LINEAR_NAMES


def test_unknown_name_lists_known():
    with pytest.raises(ValueError, match="llama3.1-8b.*tiny"):
        syn.synthetic_shape("synthetic:gpt-5")


def test_published_shapes_are_kept():
    assert syn.synthetic_shape("synthetic:llama2-13b").vocab_size == 32000
    assert syn.synthetic_shape("Qwen2.5-7B").qkv_bias
    assert syn.TINY.vocab_size == 49152


def test_deterministic_and_name_dependent():
    a = syn.synthetic_int4("tiny/layers.0.wq", 64, 256)
    b = syn.synthetic_int4("tiny/layers.0.wq", 64, 256)
    c = syn.synthetic_int4("tiny/layers.0.wk", 64, 256)
    assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale)
    assert not torch.equal(a.q, c.q)
    w = a.dequantize()
    assert abs(w.std().item() - syn.LINEAR_STD) < 0.002 and abs(w.mean().item()) < 0.002


def test_generation_is_chunked(monkeypatch):
    """Each block handed to the quantiser is at most BLOCK_ELEMENTS, the float weight is
    never whole, and the result does not depend on the block size used for memory."""
    monkeypatch.setattr(syn, "BLOCK_ELEMENTS", 1 << 14)
    sizes = []
    real = syn.quantize_int4

    def spy(w, g):
        sizes.append(w.numel())
        return real(w, g)

    monkeypatch.setattr(syn, "quantize_int4", spy)
    w = syn.synthetic_int4("x", 300, 512)
    assert isinstance(w, Int4Weight) and w.shape == (300, 512) and w.group_size == 128
    assert len(sizes) == 10 and max(sizes) <= 1 << 14 and sum(sizes) == 300 * 512
    e = syn.synthetic_float("e", (300, 512), 0.02)
    assert e.shape == (300, 512) and e.dtype == torch.float32
    assert not torch.equal(e[:32], e[32:64])  # blocks are seeded apart


def test_group_size_falls_back_for_smollm_hidden():
    w = syn.synthetic_int4("k576", 8, 576)
    assert w.group_size == 64


@pytest.fixture(scope="module")
def tiny(smollm2_gguf_path):
    return syn.load_synthetic("tiny")


def test_tiny_forward(tiny):
    weights, tokenizer, name = tiny
    assert name == "synthetic:tiny"
    cfg = weights.config
    assert all(isinstance(getattr(weights.layers[0], n), Int4Weight) for n in LINEAR_NAMES)
    again = syn.synthetic_weights(cfg)
    assert torch.equal(again.embed, weights.embed)
    assert torch.equal(again.layers[1].w_down.q, weights.layers[1].w_down.q)

    ids = torch.tensor(tokenizer.encode("The capital of France is"))
    model = LlamaModel(
        weights, torch.device("cpu"), torch.float32, "float", Rope(cfg.head_dim, cfg.rope_theta)
    )
    h = model.embed_tokens(ids)
    positions = torch.arange(len(ids))
    for i in range(cfg.num_layers):
        q, k, v = model.qkv(i, h, positions)
        h = model.finish_layer(i, h, prefill_attention(q, k, v, 0))
    logits = model.logits(h)
    assert logits.shape == (len(ids), 49152) and torch.isfinite(logits).all()


def test_tokenizer_maps_ids_into_vocabularies(tiny):
    base = tiny[1]
    small = syn.SyntheticTokenizer(base, 1000)
    ids = base.encode("hello synthetic world")
    assert small.encode("hello synthetic world") == [i % 1000 for i in ids]
    assert small.vocab_size == 1000
    big = syn.SyntheticTokenizer(base, 128256)
    assert big.decode([i + 49152 for i in ids]) == base.decode(ids)


def test_ids_tokenizer_needs_no_embedded_model(monkeypatch):
    """``extra.tokenizer: ids``: a synthetic model without the embedded GGUF (a GPU machine
    fed pre-tokenised jobs); text cannot be encoded, results are ids as text."""
    from engine.config import ConfigError
    from engine.load import load_tokenizer

    def no_model():
        raise FileNotFoundError("not installed")

    monkeypatch.setattr("engine.weights.embedded.default_model_path", no_model)
    tok, name = load_tokenizer("synthetic:qwen2.5-7b", "ids")
    assert name == "synthetic:qwen2.5-7b" and tok.vocab_size == 152064 and not tok.eos_ids
    assert tok.decode([5, 151000]) == "5 151000"
    with pytest.raises(ValueError, match="cannot encode text"):
        tok.encode_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="not one of"):
        syn.make_tokenizer(10, "bpe")
    with pytest.raises(ConfigError, match="synthetic models only"):
        load_tokenizer(None, "ids")


def _tiny_engine(**overrides):
    from engine.config import EngineConfig
    from engine.serve.engine import Engine
    from kernels.dispatch import REFERENCE_OPS

    cfg = syn.TINY
    model = LlamaModel(
        syn.synthetic_weights(cfg),
        torch.device("cpu"),
        torch.float32,
        "float",
        Rope(cfg.head_dim, cfg.rope_theta),
    )
    config = EngineConfig(host_pool_gb=0.05, max_batch=2, **overrides)
    return Engine(model, None, config, REFERENCE_OPS, 2048)


def test_dense_indexer_needs_a_budget_for_every_page():
    """indexer=dense under sparse attention selects every page: a top_k or hot buffer
    smaller than the context is refused up front (it used to crash the first decode)."""
    from engine.config import ConfigError

    with pytest.raises(ConfigError, match="indexer=dense selects every page.*--top-k-tokens"):
        _tiny_engine(attention="sparse", indexer="dense", top_k=256)
    _tiny_engine(attention="sparse", indexer="dense", top_k=2048)  # 128 pages: fits


def test_context_advice_follows_the_policy():
    from engine.config import SamplingParams
    from engine.events import Job

    job = Job("long", tuple(range(3000)), SamplingParams(max_tokens=8))
    refuse = _tiny_engine()
    assert "use --context-policy extend" in refuse._check_job(job)
    extend = _tiny_engine(context_policy="extend")
    msg = extend._check_job(job)
    assert "raise --max-context to at least 3008" in msg and "policy extend" not in msg


def test_max_context_above_training_needs_extend():
    """Under refuse and truncate, max_context can only lower the trained context; a value
    above it used to be silently ignored and is now a ConfigError (exit 2 in the CLI)."""
    from engine.config import ConfigError, EngineConfig
    from engine.load import context_limit_and_rope

    cfg = syn.synthetic_shape("tiny")
    trained = cfg.max_position
    for policy in ("refuse", "truncate"):
        limit, _ = context_limit_and_rope(cfg, EngineConfig(context_policy=policy, max_context=trained // 2))
        assert limit == trained // 2
        with pytest.raises(ConfigError, match="only context_policy extend goes past it"):
            context_limit_and_rope(cfg, EngineConfig(context_policy=policy, max_context=2 * trained))
    limit, _ = context_limit_and_rope(cfg, EngineConfig(context_policy="extend", max_context=2 * trained))
    assert limit == 2 * trained


def test_a_new_indexer_is_one_registry_entry(monkeypatch):
    """The indexer seam: an entry in ``engine.decode.indexers.INDEXERS`` (here a rule that
    ranks the most recent pages first) is accepted by the config and drives every decode
    step, with no other change."""
    from engine.config import EngineConfig, SamplingParams
    from engine.decode import indexers
    from engine.events import Job, JobFinished

    calls = []

    def recent(ops, cache, plan, layer, q, config, scale):
        b, hkv = q.shape[0], cache.model.num_kv_heads
        p_max = plan.block_table.shape[1]
        pages = torch.arange(p_max, dtype=torch.float32).expand(b, hkv, p_max).clone()
        beyond = pages >= plan.num_pages.view(b, 1, 1).float()
        calls.append(layer)
        return pages.masked_fill(beyond, float("-inf"))

    entry = indexers.Indexer("recent", ranks=True, reads_pool=False, graph_safe=True, score=recent)
    monkeypatch.setitem(indexers.INDEXERS, "recent", entry)
    assert EngineConfig(indexer="recent").problems() == []
    engine = _tiny_engine(attention="sparse", indexer="recent", top_k=64, local_window=16)
    engine.tokenizer = syn.make_tokenizer(syn.TINY.vocab_size, "ids")  # decodes ids as text
    job = Job("j", tuple(range(1, 300)), SamplingParams(max_tokens=3))
    finished = [e for e in engine.run([job]) if isinstance(e, JobFinished)]
    assert len(finished) == 1 and finished[0].result.finish_reason in ("length", "stop")
    assert len(calls) >= 2 * syn.TINY.num_layers  # every layer of every decode step
    (problem,) = EngineConfig(indexer="nope").problems()
    assert "recent" in problem.message and "quest" in problem.message


def test_indexer_names_are_the_registry():
    from engine.config import INDEXERS
    from engine.decode import indexers

    assert set(INDEXERS) == set(indexers.INDEXERS) == {"quest", "dense", "oracle"}
    assert not indexers.get("dense").ranks and indexers.get("oracle").reads_pool
    with pytest.raises(KeyError, match="unknown indexer 'nope'"):
        indexers.get("nope")
