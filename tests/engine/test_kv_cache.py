"""KV hierarchy invariants and resolve semantics, without a model.

* hand-built resolve cases: LRU order, victims never among the selected pages, exact
  hit / miss counts, empty slots first;
* a hypothesis state machine in which jobs of different lengths join, decode and leave:
  ``check_integrity()`` after every step, and hierarchical attention equal to the
  all-resident attention bit for bit at every step.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.config import EngineConfig, ModelConfig
from engine.decode.attention import DecodeAttention
from engine.kv.cache import KVCache
from kernels.bitmask import pack_bits
from kernels.dispatch import REFERENCE_OPS
from kernels.resolve import resolve_ref


def _state(num_slabs: int, c: int, p_max: int):
    n = num_slabs * c
    return (
        torch.full((num_slabs, p_max), -1, dtype=torch.int32),
        torch.full((n,), -1, dtype=torch.int32),
        torch.full((n,), -1, dtype=torch.int64),
    )


def _sel(pages: list[int], p_max: int = 64) -> torch.Tensor:
    mask = torch.zeros(1, 1, p_max, dtype=torch.bool)
    mask[0, 0, pages] = True
    return pack_bits(mask)


def _resolve(pages, state, step, c=4, k_max=4):
    pt, sp, lu = state
    slab = torch.zeros(1, 1, dtype=torch.int32)
    return resolve_ref(_sel(pages), slab, pt, sp, lu, step, c, k_max)


def test_cold_misses_fill_empty_slots_in_order():
    state = _state(1, 4, 64)
    slot_list, load_pages, load_slots, hits = _resolve([3, 7], state, step=1)
    assert slot_list[0, 0].tolist() == [0, 1, -1, -1]
    assert load_pages[0, 0].tolist() == [3, 7, -1, -1]
    assert load_slots[0, 0].tolist() == [0, 1, -1, -1]
    assert hits.item() == 0
    pt, sp, lu = state
    assert pt[0, 3].item() == 0 and pt[0, 7].item() == 1
    assert sp.tolist() == [3, 7, -1, -1] and lu.tolist() == [1, 1, -1, -1]


def test_hits_refresh_and_lru_victim_is_least_recent_unselected():
    state = _state(1, 4, 64)
    _resolve([1, 2, 3, 4], state, step=1)  # slots 0..3 hold pages 1..4
    _resolve([2, 4], state, step=2)  # refresh pages 2, 4 -> pages 1, 3 least recent
    _resolve([3], state, step=3)  # refresh 3 -> page 1 is least recent
    slot_list, load_pages, load_slots, hits = _resolve([2, 9], state, step=4)
    assert hits.item() == 1
    assert load_pages[0, 0].tolist() == [-1, 9, -1, -1]
    assert load_slots[0, 0, 1].item() == 0, "page 1 (slot 0) was least recently used"
    pt, sp, _ = state
    assert pt[0, 1].item() == -1 and pt[0, 9].item() == 0
    assert slot_list[0, 0].tolist()[:2] == [1, 0]  # position order: page 2, then page 9


def test_selected_pages_are_never_evicted():
    state = _state(1, 4, 64)
    _resolve([1, 2, 3, 4], state, step=1)
    _resolve([1], state, step=2)
    # Page 1 is the most recent; pages 2..4 are older but selected now along with 2 misses
    # -> the misses can only take slots of unselected pages (page 1's slot is selected? no)
    slot_list, load_pages, load_slots, hits = _resolve([2, 3, 10, 11], state, step=3)
    assert hits.item() == 2
    victims = load_slots[0, 0][load_slots[0, 0] >= 0].tolist()
    pt, sp, _ = state
    assert sorted(victims) == sorted([3, 0])  # pages 4 (slot 3) and 1 (slot 0)
    assert pt[0, 2].item() == 1 and pt[0, 3].item() == 2, "selected hits stayed in place"


def test_exact_counts_over_a_sequence():
    state = _state(1, 4, 64)
    seq = [[0, 1], [0, 1, 2], [0, 3, 4], [1, 2], [0, 1, 2, 3]]
    # slots after each step (LRU, 4 slots): computed by hand
    expected_hits = [0, 2, 1, 1, 3]
    for step, pages in enumerate(seq, start=1):
        _, _, load_slots, hits = _resolve(pages, state, step)
        assert hits.item() == expected_hits[step - 1], f"step {step}"
        assert int((load_slots >= 0).sum()) == len(pages) - expected_hits[step - 1]


def test_k_max_above_slab_is_refused():
    state = _state(1, 4, 64)
    try:
        _resolve([1], state, step=1, c=4, k_max=5)
    except ValueError as e:
        assert "k_max" in str(e)
    else:
        raise AssertionError("expected ValueError")


# ----- randomized: jobs join and leave ---------------------------------------------------

TINY = ModelConfig(
    arch="llama",
    num_layers=2,
    hidden_size=16,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=32,
    vocab_size=32,
    name="tiny",
)


class CacheMachine(RuleBasedStateMachine):
    """Jobs with random lengths join, decode random tokens and leave; every step runs the
    full hierarchical data path (append, Quest select, resolve, gather, attention)."""

    @initialize(page_size=st.sampled_from([16, 32]), seed=st.integers(0, 2**16))
    def setup(self, page_size, seed):
        self.gen = torch.Generator().manual_seed(seed)
        common = dict(
            attention="sparse",
            page_size=page_size,
            top_k=2 * page_size,
            sink_tokens=page_size,
            local_window=page_size,
            max_batch=3,
        )
        self.hier_cfg = EngineConfig(device_buffer=3 * page_size, **common)
        self.res_cfg = EngineConfig(hierarchical=False, **common)
        pages = 40
        self.hier = KVCache(TINY, self.hier_cfg, torch.device("cpu"), 16, num_pool_pages=pages)
        self.res = KVCache(TINY, self.res_cfg, torch.device("cpu"), 16, num_pool_pages=pages)
        scale = TINY.head_dim**-0.5
        self.hier_attn = DecodeAttention(self.hier, self.hier_cfg, REFERENCE_OPS, scale)
        self.res_attn = DecodeAttention(self.res, self.res_cfg, REFERENCE_OPS, scale)
        self.jobs: dict[int, list[int]] = {}  # seq_id -> [num_tokens, capacity]
        self.next_id = 0
        self.step = 0

    def _rand(self, *shape):
        return torch.randn(*shape, generator=self.gen)

    @precondition(lambda self: len(self.jobs) < 3)
    @rule(prompt=st.integers(1, 150), extra=st.integers(1, 60))
    def join(self, prompt, extra):
        cap = prompt + extra
        if not self.hier.can_admit(cap):
            return
        sid = self.next_id
        self.next_id += 1
        k = self._rand(prompt, 2, 8)
        v = self._rand(prompt, 2, 8)
        for cache in (self.hier, self.res):
            cache.allocate(sid, cap)
            for layer in range(TINY.num_layers):
                cache.write_prefill(sid, layer, k, v, 0)
        self.jobs[sid] = [prompt, cap]

    @precondition(lambda self: len(self.jobs) > 0)
    @rule(data=st.data())
    def leave(self, data):
        sid = data.draw(st.sampled_from(sorted(self.jobs)))
        self.hier.release(sid)
        self.res.release(sid)
        del self.jobs[sid]

    @precondition(lambda self: any(n < cap for n, cap in self.jobs.values()))
    @rule()
    def decode(self):
        ids = [s for s, (n, cap) in self.jobs.items() if n < cap]
        lens = [self.jobs[s][0] + 1 for s in ids]
        self.step += 1
        ph = self.hier_attn.plan(ids, lens, self.step)
        pr = self.res_attn.plan(ids, lens, self.step)
        for layer in range(TINY.num_layers):
            q = self._rand(len(ids), 4, 8)
            k = self._rand(len(ids), 2, 8)
            v = self._rand(len(ids), 2, 8)
            out_h = self.hier_attn.run(ph, layer, q, k, v)
            out_r = self.res_attn.run(pr, layer, q, k, v)
            assert torch.equal(out_h, out_r), f"layer {layer}: hierarchical != resident"
        for s in ids:
            self.jobs[s][0] += 1

    @invariant()
    def integrity(self):
        if hasattr(self, "hier"):
            self.hier.check_integrity()
            self.res.check_integrity()


CacheMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
test_cache_state_machine = CacheMachine.TestCase


def test_declared_host_memory_overrides_meminfo(monkeypatch):
    from engine.kv.sizing import CacheFullError, available_host_bytes, check_host_memory

    monkeypatch.setenv("HISPARSE_HOST_MEMORY_GB", "2")
    assert available_host_bytes() == 2 * 2**30
    check_host_memory(int(1.5 * 2**30))
    with pytest.raises(CacheFullError, match="2.0 GiB"):
        check_host_memory(2 * 2**30)
    monkeypatch.setenv("HISPARSE_HOST_MEMORY_GB", "lots")
    with pytest.raises(ValueError, match="HISPARSE_HOST_MEMORY_GB"):
        available_host_bytes()


def test_host_pool_refusal_states_the_rule_and_the_settings(monkeypatch):
    """Issue #19.10: 8.0 GiB of 8.6 GiB available is refused; the message says why (90% of
    what is available) and what to change."""
    from engine.kv.sizing import CacheFullError, check_host_memory

    monkeypatch.setenv("HISPARSE_HOST_MEMORY_GB", "8.6")
    with pytest.raises(CacheFullError) as info:
        check_host_memory(8 * 2**30)
    message = str(info.value)
    assert "needs 8.0 GiB but only 8.6 GiB" in message
    assert "90%" in message and "7.7 GiB" in message
    for setting in ("--host-pool", "host_pool_gb", "HISPARSE_HOST_MEMORY_GB"):
        assert setting in message


def test_dense_reference_ignores_unwritten_pool_memory():
    """Pool positions past seq_len (never written: any bits, NaN included) must not reach
    the dense reference's output (NaN * a 0 softmax weight is NaN)."""
    from kernels.sparse_attention import dense_decode_attention_ref

    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(6, 2, 2, 16, 32, generator=gen)
    table = torch.tensor([[4, 1, -1], [0, 2, 5]], dtype=torch.int32)
    lens = torch.tensor([20, 40], dtype=torch.int32)  # partial last pages
    q = torch.randn(2, 4, 32, generator=gen)
    clean = dense_decode_attention_ref(q, pool, table, lens, 32**-0.5)
    poisoned = pool.clone()
    poisoned[1, :, :, 4:] = float("nan")  # request 0: positions 20.. of its page 1
    poisoned[5] = float("nan")  # request 1: page 2 holds positions 32..47, 40.. unused
    poisoned[5, :, :, :8] = pool[5, :, :, :8]
    out = dense_decode_attention_ref(q, poisoned, table, lens, 32**-0.5)
    assert torch.isfinite(out).all()
    assert torch.equal(out, clean)
