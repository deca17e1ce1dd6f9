"""The CPU direct chain (:mod:`engine.decode.cpu_direct`) against the reference ops it
replaces, called one after the other as :meth:`DecodeAttention.run` used to: RoPE + append
(:func:`rope_append_ref`), Quest scores (:func:`quest_scores_matmul`), top-k pages
(:func:`select_topk_pages_ref`), slots and sparse attention. Outputs, pool and metadata must
be equal bit for bit over several steps, on batches of one (consecutive pool pages: the
in-place metadata slice; scattered pages: the gather) and more, rows of different lengths,
float32 and bf16 records, each group rule, and budgets above and below the pages in use."""

from __future__ import annotations

import pytest
import torch

from engine import events as ev
from engine.config import SamplingParams
from engine.decode.cpu_direct import DirectTables, direct_layer
from kernels.quest_scores import quest_scores_matmul
from kernels.rope_append import RopeParams, rope_append_ref
from kernels.select_topk import select_topk_pages_ref
from kernels.slot_list import resident_slots_of_pages
from kernels.sparse_attention import sparse_decode_attention_ref


def reference_layer(tables_args, q, k, v, rope, pool, meta, scale, combine, hits):
    block_table, seq_lens, num_pages, positions, top_k, sink, window, k_max = tables_args
    q, k = rope_append_ref(q, k, v, positions, rope, block_table, pool, meta)
    scores = quest_scores_matmul(q, meta, block_table, num_pages, combine, scale)
    pages = select_topk_pages_ref(scores, num_pages, top_k, sink, window, k_max)
    slots = resident_slots_of_pages(pages, block_table)
    hits += (pages >= 0).sum((-1, -2))
    records = pool.view(-1, *pool.shape[2:])
    return sparse_decode_attention_ref(q, records, None, slots, seq_lens, scale, pages=pages)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x.view(torch.int32)


@pytest.mark.parametrize(
    "lens,consecutive,dtype,combine,top_k,hq,hkv,s",
    [
        ((301,), True, torch.float32, "normmax", 6, 9, 3, 16),  # the metadata slice
        ((301,), False, torch.float32, "normmax", 6, 9, 3, 16),  # scattered pages: gather
        ((77, 160, 33), False, torch.float32, "normmax", 4, 8, 2, 8),
        ((95, 64), False, torch.bfloat16, "sum", 5, 4, 4, 16),
        ((200, 17), True, torch.float32, "max", 40, 6, 2, 16),  # budget above every page
        ((129,), True, torch.float32, "union", 3, 4, 1, 16),
    ],
)
def test_chain_equals_the_reference_ops(lens, consecutive, dtype, combine, top_k, hq, hkv, s):
    g = torch.Generator().manual_seed(len(lens) * 7 + top_k)
    d, steps, sink, window = 32, 20, 1, 2
    b = len(lens)
    p_max = max(-(-(n + steps) // s) for n in lens)
    pool_pages = b * p_max + 5
    order = torch.arange(pool_pages) if consecutive else torch.randperm(pool_pages, generator=g)
    table = torch.full((b, p_max), -1, dtype=torch.int32)
    for i in range(b):
        table[i] = order[i * p_max : (i + 1) * p_max].int()
    pool = torch.randn(pool_pages, hkv, 2, s, d, generator=g).to(dtype)
    meta = torch.zeros(pool_pages, hkv, 2, d)
    for i, n in enumerate(lens):  # metadata of the prompt's pages, as the prefill leaves it
        for p in range(-(-n // s)):
            keys = pool[table[i, p], :, 0, : min(s, n - p * s)].float()
            meta[table[i, p], :, 0], meta[table[i, p], :, 1] = keys.amin(1), keys.amax(1)
    rope = RopeParams(1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), 1.0, 1.0)
    ref_pool, ref_meta = pool.clone(), meta.clone()
    scale = d**-0.5
    k_max = top_k + sink + window + 1
    for step in range(steps):
        seq = torch.tensor([n + step + 1 for n in lens], dtype=torch.int32)
        num_pages = (seq + s - 1) // s
        width = int(num_pages.max())
        bt = table[:, :width].clone()
        bt[torch.arange(width)[None, :] >= num_pages[:, None]] = -1
        positions = (seq - 1).long()
        q = torch.randn(b, hq, d, generator=g).to(dtype)
        k = torch.randn(b, hkv, d, generator=g).to(dtype)
        v = torch.randn(b, hkv, d, generator=g).to(dtype)
        tables = DirectTables(bt, seq, num_pages, positions, s, hkv, top_k, sink, window, k_max)
        assert (tables.meta_start is not None) == (consecutive and b == 1)
        hits, ref_hits = torch.zeros(b, dtype=torch.int64), torch.zeros(b, dtype=torch.int64)
        out = direct_layer(tables, q, k, v, rope, pool, meta, scale, combine, hits)
        args = (bt, seq, num_pages, positions, top_k, sink, window, k_max)
        ref = reference_layer(args, q, k, v, rope, ref_pool, ref_meta, scale, combine, ref_hits)
        assert out.dtype == ref.dtype and torch.equal(bits(out), bits(ref)), f"step {step}"
        assert torch.equal(hits, ref_hits)
        assert torch.equal(bits(pool), bits(ref_pool)) and torch.equal(meta, ref_meta)


def test_tables_refuse_a_budget_over_k_max():
    bt = torch.arange(20, dtype=torch.int32)[None, :]
    seq = torch.tensor([320], dtype=torch.int32)
    with pytest.raises(ValueError, match="k_max=4"):
        DirectTables(bt, seq, torch.tensor([20], dtype=torch.int32), seq.long() - 1, 16, 1,
                     8, 1, 2, 4)  # fmt: skip


def test_engine_takes_the_chain_and_matches_the_op_route():
    """The CPU engine's default path is the chain; turned off, the op-by-op route gives the
    same logits bit for bit (one request: the in-place metadata slice)."""
    from engine.config import EngineConfig
    from engine.load import load_engine

    cfg = EngineConfig(
        host_pool_gb=0.25, max_batch=1, page_size=16, top_k=48, sink_tokens=16,
        local_window=16, device_buffer=96, prefill_chunk=128, tokenizer="ids",
        cpu_direct_reads=True,
    )  # fmt: skip
    runs = []
    for chain in (True, False):
        engine = load_engine(cfg, "synthetic:tiny")
        engine.keep_logits = True
        assert engine.attn.chain_direct
        engine.attn.chain_direct = chain
        gen = torch.Generator().manual_seed(3)
        ids = tuple(torch.randint(5, 40000, (250,), generator=gen).tolist())
        req = engine.open_request(ev.Job("j", ids, SamplingParams(max_tokens=12)))
        engine.prefill(req)
        logits = []
        for _ in range(10):
            req.generated.append(engine.decode_step([req])[0])
            logits.append(req.logits.clone())
        runs.append((list(req.generated), torch.stack(logits)))
    assert runs[0][0] == runs[1][0]
    assert torch.equal(runs[0][1].view(torch.int32), runs[1][1].view(torch.int32))
