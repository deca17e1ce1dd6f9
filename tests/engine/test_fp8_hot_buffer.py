"""The fp8 hot buffer (``hot_buffer_dtype=fp8``) on the tiny synthetic model, CPU: the
same tokens, cache traffic and slot contents as the bf16 hot buffer over the same fp8 host
pool, about half the device bytes per slot (what ``plan`` and the cache count), and a
clear refusal without fp8 host records. The CUDA-graph counterpart is
``tests/engine/test_cuda_graph.py::test_fp8_hot_buffer_reads_what_a_bf16_one_does``."""

from __future__ import annotations

import pytest
import torch

from engine import events as ev
from engine.config import ConfigError, EngineConfig, ModelConfig, SamplingParams
from engine.kv import sizing
from kernels.fp8_kv import FP8, fp8_dequantize_ref

# Small pages and a hot buffer that forces misses over ~300-token prompts.
SPARSE = dict(
    host_pool_gb=0.25, max_batch=2, page_size=16, top_k=48, sink_tokens=16,
    local_window=16, device_buffer=96, prefill_chunk=128, tokenizer="ids",
    kv_host_dtype="fp8", decode_write_stream=False,
)  # fmt: skip


def make(**overrides):
    from engine.load import load_engine

    return load_engine(EngineConfig(**{**SPARSE, **overrides}), "synthetic:tiny")


def jobs(max_tokens=12):
    g = torch.Generator().manual_seed(5)
    return [
        ev.Job(f"j{i}", tuple(torch.randint(5, 40000, (n,), generator=g).tolist()),
               SamplingParams(max_tokens=max_tokens))
        for i, n in enumerate((300, 211))
    ]  # fmt: skip


def run(engine):
    events = list(engine.run(jobs()))
    return {e.result.job_id: e.result for e in events if isinstance(e, ev.JobFinished)}


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_fp8_hot_buffer_decodes_as_the_bf16_one(kv_dtype):
    """Hot buffer fp8 vs kv_dtype over the same fp8 host records: the same tokens and
    cache traffic (misses forced), and every slot that holds a page holds, dequantised,
    the bf16 buffer's values."""
    fp8 = make(hot_buffer_dtype="fp8", kv_dtype=kv_dtype)
    plain = make(hot_buffer_dtype="bf16", kv_dtype=kv_dtype)
    assert fp8.cache.hot_fp8 and not plain.cache.hot_fp8
    assert fp8.cache.slots[0].dtype == FP8 and fp8.cache.slot_scale[0].dtype == torch.int8
    a, b = run(fp8), run(plain)
    assert a.keys() == b.keys() == {"j0", "j1"}
    for job_id, r in b.items():
        assert a[job_id].token_ids == r.token_ids
        assert a[job_id].cache == r.cache
        assert r.cache.misses > 0
    # Step by hand to look at the slots while the jobs hold them.
    dt = getattr(torch, kv_dtype)
    reqs = {}
    for name, eng in (("fp8", fp8), ("plain", plain)):
        reqs[name] = [eng.open_request(j) for j in jobs()]
        for r in reqs[name]:
            eng.prefill(r)
    for _ in range(6):
        for name, eng in (("fp8", fp8), ("plain", plain)):
            for r, t in zip(reqs[name], eng.decode_step(reqs[name]), strict=True):
                r.generated.append(t)
    assert [r.generated for r in reqs["fp8"]] == [r.generated for r in reqs["plain"]]
    for layer in range(fp8.cache.num_layers):
        assert torch.equal(fp8.cache.slot_page[layer], plain.cache.slot_page[layer])
        held = fp8.cache.slot_page[layer] >= 0
        assert int(held.sum()) > 0
        deq = fp8_dequantize_ref(fp8.cache.slots[layer][held], fp8.cache.slot_scale[layer][held], dt)
        want = plain.cache.slots[layer][held]
        assert torch.equal(deq.isnan(), want.isnan()), f"layer {layer}"
        assert torch.equal(deq.nan_to_num(), want.nan_to_num()), f"layer {layer}"
    fp8.cache.check_integrity()


def test_fp8_hot_buffer_needs_fp8_host_records():
    """Asked for over a bf16 host pool, the refusal names both settings and the fixes."""
    with pytest.raises(ConfigError, match="hot_buffer_dtype.*kv_host_dtype fp8"):
        EngineConfig(**{**SPARSE, "kv_host_dtype": "bf16", "hot_buffer_dtype": "fp8"}).validate()
    with pytest.raises(ConfigError, match="hot_buffer_dtype"):
        EngineConfig(**{**SPARSE, "hot_buffer_dtype": "fp16"}).validate()
    # no hot buffer to shape: all-resident runs accept and ignore it
    EngineConfig(
        **{**SPARSE, "kv_host_dtype": "bf16", "hot_buffer_dtype": "fp8", "hierarchical": False}
    ).validate()


@pytest.mark.parametrize("head_dim,page_size", [(64, 16), (128, 32), (80, 64)])
def test_fp8_slots_take_about_half_the_bytes(head_dim, page_size):
    """A slot is ``2 S (D + 1)`` bytes with an fp8 hot buffer against ``2 S D x 2`` in
    bf16, so a job's slabs take ``(D + 1) / 2D`` of the bytes; the cache allocates what
    the sizing (and so ``plan``) counts."""
    model = ModelConfig(
        arch="llama", vocab_size=512, hidden_size=head_dim * 4, intermediate_size=256,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=head_dim,
    )  # fmt: skip
    base = dict(SPARSE, page_size=page_size, kv_dtype="bfloat16", top_k=page_size * 6,
                sink_tokens=page_size, local_window=page_size, device_buffer=page_size * 8)  # fmt: skip
    cfgs = {h: EngineConfig(**{**base, "hot_buffer_dtype": h}) for h in ("bf16", "fp8")}
    slot = {h: sizing.slot_bytes(model, c) for h, c in cfgs.items()}
    assert slot["bf16"] == 2 * page_size * head_dim * 2
    assert slot["fp8"] == 2 * page_size * (head_dim + 1)
    from engine.kv.cache import KVCache

    for h, c in cfgs.items():
        cache = KVCache(model, c, torch.device("cpu"), max_pages_per_seq=12, num_pool_pages=40)
        want = c.max_batch * sizing.per_request_device_bytes(model, c, 12)
        assert cache.hot_buffer_bytes == want, h
        cache.close()
