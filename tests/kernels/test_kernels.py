"""Triton kernels against their PyTorch references, on small awkward shapes.

Without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, which
``conftest.py`` sets before anything imports triton when this module is collected on a
machine without a GPU); with CUDA they run natively. Copies, resolve and selection must
match bit for bit; attention within 1e-5 (fp32) or the output dtype's rounding.

Two interpreter limits shape the CPU cases (both are fine on a GPU): it multiplies bf16
bit patterns as integers in ``tl.dot`` (the attention launcher upcasts there), and it
rounds fp32 -> bf16 towards zero, so mixed-dtype append cases run on CUDA only.
"""

from __future__ import annotations

import os

import pytest
import torch
from kernel_cases import (
    attention_inputs,
    bits_equal,
    outvoted_head_case,
    poison_,
    poisoned_allocations,
    quest_inputs,
    random_selection_mask,
    to_device,
)

from engine.config import GROUP_COMBINES as CONFIG_GROUP_COMBINES
from engine.config import EngineConfig
from kernels.append_kv import append_kv, append_kv_ref
from kernels.bitmask import pack_bits, unpack_bits
from kernels.dispatch import REFERENCE_OPS, get_ops
from kernels.fp8_kv import FP8, fp8_dequantize_ref, fp8_quantize_ref, fp8_round_ref
from kernels.gather import gather, gather_ref
from kernels.int4_matmul import Q4Config, group_int4_linear, group_int4_linear_ref
from kernels.oracle_scores import oracle_scores_ref
from kernels.quest_scores import (
    GROUP_COMBINES,
    combine_group_ref,
    quest_head_bounds_ref,
    quest_scores,
    quest_scores_ref,
)
from kernels.resolve import resolve, resolve_ref
from kernels.rmsnorm import rms_norm, rms_norm_ref
from kernels.rope_append import (
    RopeParams,
    rope_append,
    rope_append_ref,
    rope_cos_sin_ref,
    rotate_half_ref,
)
from kernels.select_topk import dense_selection, select_topk, select_topk_ref, top_keys
from kernels.slot_list import resident_slot_list, resident_slot_list_triton
from kernels.sparse_attention import (
    dense_decode_attention,
    dense_decode_attention_ref,
    sparse_decode_attention,
    sparse_decode_attention_ref,
)
from kernels.swiglu import swiglu, swiglu_ref

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
    reason="no CUDA and Triton's interpreter is off (run this module through tests/conftest.py)",
)

ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def assert_close(out: torch.Tensor, ref: torch.Tensor, atol: float) -> None:
    out, ref = out.float().cpu(), ref.float().cpu()
    assert not out.isnan().any(), "NaN in output (unwritten element?)"
    err = (out - ref).abs()
    bad = err > atol + atol * ref.abs()
    assert not bad.any(), (
        f"max err {err.max():.3g} at {tuple(bad.nonzero()[0].tolist())} (atol {atol})"
    )


# --- sparse attention ------------------------------------------------------------------

ATTENTION_CASES = [
    # b, hq, hkv, d, s, p_max, k, dtype, pages_per_split
    (1, 9, 3, 64, 16, 40, 6, torch.float32, None),
    (2, 9, 3, 64, 16, 40, 6, torch.float32, 2),
    (2, 28, 4, 128, 32, 12, 5, torch.float32, 1),
    (2, 8, 2, 128, 64, 6, 3, torch.float32, 64),
    (2, 4, 4, 64, 16, 20, 30, torch.float32, 3),  # budget >= context: every page selected
    (3, 9, 3, 64, 32, 10, 1, torch.float32, None),  # a budget of one page (the tail)
    (2, 9, 3, 64, 16, 40, 6, torch.float16, 2),
    (2, 28, 4, 64, 64, 8, 4, torch.bfloat16, 1),
]


@pytest.mark.parametrize(
    "case", ATTENTION_CASES, ids=lambda c: f"{c[:7]}-pps{c[8]}".replace(" ", "")
)
def test_sparse_attention_matches_reference(case):
    b, hq, hkv, d, s, p_max, k, dtype, pps = case
    args = attention_inputs(b, hq, hkv, d, s, p_max, k, dtype, seed=sum(case[:7]))
    ref = sparse_decode_attention_ref(**args)
    with poisoned_allocations():
        out = sparse_decode_attention(**to_device(args, DEVICE), pages_per_split=pps)
    assert out.dtype == dtype and out.shape == ref.shape
    assert_close(out, ref, ATOL[dtype])


@pytest.mark.slow
def test_sparse_attention_batch_33():
    args = attention_inputs(33, 6, 2, 64, 16, 9, 3, torch.float32, seed=33)
    ref = sparse_decode_attention_ref(**args)
    with poisoned_allocations():
        out = sparse_decode_attention(**to_device(args, DEVICE))
    assert_close(out, ref, ATOL[torch.float32])


def test_sparse_attention_masks_pages_past_the_context():
    """A selected page at or past ``seq_len`` (with a real slot) contributes nothing."""
    args = attention_inputs(2, 9, 3, 64, 16, 12, 3, torch.float32, seed=4)
    args["seq_lens"] = torch.tensor([40, 17], dtype=torch.int32)  # pages 0..2 and 0..1
    mask = torch.zeros(2, 3, 12, dtype=torch.bool)
    mask[:, :, 0] = True
    mask[0, :, 2] = True  # the partial tail page of request 0
    mask[:, :, 7] = True  # past both contexts
    k_max = 4
    args["selection"] = pack_bits(mask)
    n_slots = args["kv_slots"].shape[0]
    slots = torch.randperm(n_slots, generator=torch.Generator().manual_seed(2))[: 2 * 3 * k_max]
    count = mask.sum(-1, keepdim=True)
    args["slot_list"] = torch.where(torch.arange(k_max) < count, slots.view(2, 3, k_max), -1).int()
    ref = sparse_decode_attention_ref(**args)
    out = sparse_decode_attention(**to_device(args, DEVICE), pages_per_split=1)
    assert_close(out, ref, ATOL[torch.float32])


def test_sparse_attention_independent_of_slot_placement():
    args = attention_inputs(2, 9, 3, 64, 16, 30, 5, torch.float32, seed=7)
    first = sparse_decode_attention(**to_device(args, DEVICE), pages_per_split=2)
    # Move every record to another slot and renumber the slot list.
    n = args["kv_slots"].shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    moved = torch.empty_like(args["kv_slots"])
    moved[perm] = args["kv_slots"]
    sl = args["slot_list"]
    args2 = dict(
        args, kv_slots=moved, slot_list=torch.where(sl >= 0, perm[sl.clamp(min=0).long()], -1).int()
    )
    second = sparse_decode_attention(**to_device(args2, DEVICE), pages_per_split=2)
    assert bits_equal(first.cpu(), second.cpu())


@pytest.mark.parametrize(
    "b,hq,hkv,d,s,width,dtype",
    [
        (1, 9, 3, 64, 16, 7, torch.float32),
        (3, 8, 2, 128, 32, 64, torch.float32),  # a padded table, far wider than any context
        (2, 28, 4, 64, 64, 5, torch.bfloat16),
    ],
)
def test_dense_attention_matches_reference(b, hq, hkv, d, s, width, dtype):
    """Paged dense decode (the sparse kernel, every page selected, read in place) against
    the SDPA reference, with partial last pages and -1 padded block tables."""
    gen = torch.Generator().manual_seed(b * 100 + width)
    pages_used = min(width, 6)
    p_pool = b * pages_used + 3
    pool = torch.randn(p_pool, hkv, 2, s, d, generator=gen).to(dtype)
    perm = torch.randperm(p_pool, generator=gen)[: b * pages_used].view(b, pages_used)
    lens = torch.randint(1, pages_used * s + 1, (b,), generator=gen, dtype=torch.int32)
    lens[0] = pages_used * s - (s // 2)  # a partial last page
    table = torch.full((b, width), -1, dtype=torch.int32)
    for i in range(b):
        n = -(-int(lens[i]) // s)
        table[i, :n] = perm[i, :n].int()
    q = torch.randn(b, hq, d, generator=gen).to(dtype)
    ref = dense_decode_attention_ref(q, pool, table, lens, d**-0.5)
    with poisoned_allocations():
        out = dense_decode_attention(
            *(x.to(DEVICE) for x in (q, pool, table, lens)), d**-0.5
        )
    assert out.dtype == dtype and out.shape == ref.shape
    assert_close(out, ref, ATOL[dtype])


# Gemma 2/3 options: attention logit soft-capping and sliding-window layers.
SOFTCAP_WINDOW_CASES = [
    # softcap, window, pages_per_split, dtype
    (2.0, None, None, torch.float32),
    (None, 23, 1, torch.float32),  # the window starts mid-page; splits left empty
    (3.0, 40, 2, torch.float32),
    (None, 1, None, torch.float32),  # only the new token
    (2.5, 30, 1, torch.bfloat16),
]


@pytest.mark.parametrize("softcap,window,pps,dtype", SOFTCAP_WINDOW_CASES)
def test_sparse_attention_softcap_and_window_match_reference(softcap, window, pps, dtype):
    args = attention_inputs(2, 9, 3, 64, 16, 12, 8, dtype, seed=int(window or 7))
    args["q"] = (args["q"].float() * 4).to(dtype)  # logits of a few units: the cap bites
    args["seq_lens"] = torch.tensor([150, 61], dtype=torch.int32)
    mask = torch.zeros(2, 3, 12, dtype=torch.bool)
    mask[0, :, [0, 3, 7, 8, 9]] = True  # page 7 holds position 150 - 30 = 120 ...
    mask[1, :, [0, 1, 2, 3]] = True
    k_max = 6
    args["selection"] = pack_bits(mask)
    n_slots = args["kv_slots"].shape[0]
    slots = torch.randperm(n_slots, generator=torch.Generator().manual_seed(3))[: 2 * 3 * k_max]
    count = mask.sum(-1, keepdim=True)
    args["slot_list"] = torch.where(torch.arange(k_max) < count, slots.view(2, 3, k_max), -1).int()
    ref = sparse_decode_attention_ref(**args, softcap=softcap, window=window)
    plain = sparse_decode_attention_ref(**args)
    assert (ref.float() - plain.float()).abs().max() > 0.05  # the options change the result
    with poisoned_allocations():
        out = sparse_decode_attention(
            **to_device(args, DEVICE), softcap=softcap, window=window, pages_per_split=pps
        )
    assert_close(out, ref, ATOL[dtype])


def test_dense_attention_softcap_and_window_match_reference():
    """The paged dense kernel with both options against the SDPA-free dense reference, and
    that reference against the sparse one with every page selected (two implementations
    of the window mask and the cap)."""
    gen = torch.Generator().manual_seed(11)
    b, hq, hkv, d, s, width = 2, 8, 2, 64, 16, 6
    pool = torch.randn(b * width + 2, hkv, 2, s, d, generator=gen)
    table = torch.randperm(b * width + 2, generator=gen)[: b * width].view(b, width).int()
    lens = torch.tensor([90, 37], dtype=torch.int32)
    table[1, 3:] = -1
    q = 4 * torch.randn(b, hq, d, generator=gen)
    ref = dense_decode_attention_ref(q, pool, table, lens, d**-0.5, softcap=2.0, window=29)
    sel = dense_selection(-(-lens // s), hkv, width)
    slots = table.clamp(min=0).long()[:, None, :] * hkv + torch.arange(hkv)[None, :, None]
    slot_list = torch.where(table[:, None, :] >= 0, slots, -1).int()
    records = pool.view(-1, 2, s, d)
    sparse = sparse_decode_attention_ref(q, records, sel, slot_list, lens, d**-0.5, 2.0, 29)
    torch.testing.assert_close(sparse, ref, atol=1e-5, rtol=1e-5)
    with poisoned_allocations():
        out = dense_decode_attention(
            *(x.to(DEVICE) for x in (q, pool, table, lens)), d**-0.5, softcap=2.0, window=29
        )
    assert_close(out, ref, ATOL[torch.float32])


# --- resolve ---------------------------------------------------------------------------


def _resolve_state(num_slabs: int, p_max: int, c: int) -> list[torch.Tensor]:
    return [
        torch.full((num_slabs, p_max), -1, dtype=torch.int32),
        torch.full((num_slabs * c,), -1, dtype=torch.int32),
        torch.full((num_slabs * c,), -1, dtype=torch.int64),
    ]


RESOLVE_CASES = [
    # b, hkv, p_max, c, k_max, steps
    (2, 3, 70, 12, 8, 4),
    (1, 1, 33, 5, 5, 6),  # k_max == C, tiny slab: every unselected slot gets reused
    (2, 2, 100, 40, 16, 3),
    (1, 2, 600, 150, 48, 4),  # a larger, non-power-of-two slab: the sort spans 256 keys
]


@pytest.mark.parametrize("case", RESOLVE_CASES, ids=str)
@pytest.mark.parametrize("tensor_step", [False, True], ids=["int-step", "tensor-step"])
def test_resolve_matches_reference_over_steps(case, tensor_step):
    b, hkv, p_max, c, k_max, steps = case
    gen = torch.Generator().manual_seed(sum(case))
    num_slabs = b * hkv + 2
    slab_ids = torch.randperm(num_slabs, generator=gen)[: b * hkv].view(b, hkv).int()
    ref_state = _resolve_state(num_slabs, p_max, c)
    dev_state = [t.to(DEVICE, copy=True) for t in ref_state]
    for step in range(steps):
        n = torch.randint(p_max // 2, p_max + 1, (b,), generator=gen)
        mask = random_selection_mask(
            n, hkv, p_max, int(torch.randint(1, k_max + 1, (), generator=gen)), gen
        )
        sel = pack_bits(mask)
        ref = resolve_ref(sel, slab_ids, *ref_state, step, c, k_max)
        stp = torch.tensor([step], device=DEVICE) if tensor_step else step
        with poisoned_allocations():
            out = resolve(sel.to(DEVICE), slab_ids.to(DEVICE), *dev_state, stp, c, k_max)
        for name, r, o in zip(
            ("slot_list", "load_pages", "load_slots", "hits"), ref, out, strict=True
        ):
            assert torch.equal(r, o.cpu()), f"step {step}: {name} differs"
        for name, r, o in zip(
            ("page_table", "slot_page", "slot_last_use"), ref_state, dev_state, strict=True
        ):
            assert torch.equal(r, o.cpu()), f"step {step}: {name} differs"


def test_resolve_accumulates_step_counters():
    """``hits_acc`` / ``misses_acc``: the reference and the kernel add each request's hits
    and misses (over its KV heads) to the step counters, equal to counting the outputs."""
    b, hkv, p_max, c, k_max = 5, 3, 90, 24, 12
    gen = torch.Generator().manual_seed(11)
    slab_ids = torch.randperm(b * hkv + 1, generator=gen)[: b * hkv].view(b, hkv).int()
    ref_state = _resolve_state(b * hkv + 1, p_max, c)
    dev_state = [t.to(DEVICE, copy=True) for t in ref_state]
    acc_ref = [torch.full((b,), 7, dtype=torch.int64) for _ in range(2)]
    acc_dev = [t.to(DEVICE, copy=True) for t in acc_ref]
    expect = [t.clone() for t in acc_ref]
    for step in range(4):
        n = torch.randint(p_max // 2, p_max + 1, (b,), generator=gen)
        sel = pack_bits(random_selection_mask(n, hkv, p_max, k_max, gen))
        ref = resolve_ref(sel, slab_ids, *ref_state, step, c, k_max, *acc_ref)
        out = resolve(sel.to(DEVICE), slab_ids.to(DEVICE), *dev_state, step, c, k_max, *acc_dev)
        assert all(torch.equal(r, o.cpu()) for r, o in zip(ref, out, strict=True))
        expect[0] += ref[3].sum(-1)
        expect[1] += (ref[2] >= 0).sum((-1, -2))
        for name, e, r, o in zip(("hits", "misses"), expect, acc_ref, acc_dev, strict=True):
            assert torch.equal(e, r), f"step {step}: reference {name} counter"
            assert torch.equal(e, o.cpu()), f"step {step}: kernel {name} counter"
    assert expect[0].sum() > 7 * b and expect[1].sum() > 7 * b  # both counted something


@pytest.mark.slow
def test_resolve_batch_33_wide_page_axis():
    b, hkv, p_max, c, k_max = 33, 1, 1500, 24, 20
    gen = torch.Generator().manual_seed(5)
    slab_ids = torch.arange(b * hkv).view(b, hkv).int()
    ref_state = _resolve_state(b * hkv, p_max, c)
    dev_state = [t.to(DEVICE, copy=True) for t in ref_state]
    for step in range(3):
        n = torch.randint(1, p_max + 1, (b,), generator=gen)
        sel = pack_bits(random_selection_mask(n, hkv, p_max, k_max, gen))
        ref = resolve_ref(sel, slab_ids, *ref_state, step, c, k_max)
        out = resolve(sel.to(DEVICE), slab_ids.to(DEVICE), *dev_state, step, c, k_max)
        assert all(torch.equal(r, o.cpu()) for r, o in zip(ref, out, strict=True))
        assert all(torch.equal(r, o.cpu()) for r, o in zip(ref_state, dev_state, strict=True))


def test_resolve_rejects_k_max_above_slab():
    sel = torch.zeros(1, 1, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="exceeds"):
        resolve(sel, sel[0], *[t.to(DEVICE) for t in _resolve_state(1, 8, 4)], 0, 4, 5)


def test_resident_slot_list_matches_reference():
    gen = torch.Generator().manual_seed(3)
    mask = torch.rand(3, 2, 70, generator=gen) < 0.2
    sel = pack_bits(mask)
    bt = torch.randperm(300, generator=gen)[:210].view(3, 70).int()
    k_max = int(mask.sum(-1).max()) + 2
    with poisoned_allocations():
        out = resident_slot_list_triton(sel.to(DEVICE), bt.to(DEVICE), k_max)
    assert torch.equal(out.cpu(), resident_slot_list(sel, bt, k_max))


# --- gather and append ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("s", [16, 32, 64])
def test_gather_byte_exact(dtype, s):
    gen = torch.Generator().manual_seed(s)
    b, hkv, d, p_pool, p_max, k, n_slots = 3, 3, 64, 30, 8, 5, 60
    kv_pool = torch.randn(p_pool, hkv, 2, s, d, generator=gen).to(dtype)
    block_table = torch.randperm(p_pool, generator=gen)[: b * p_max].view(b, p_max).int()
    load_pages = torch.randint(0, p_max, (b, hkv, k), generator=gen, dtype=torch.int32)
    load_slots = torch.randperm(n_slots, generator=gen)[: b * hkv * k].view(b, hkv, k).int()
    skip = torch.rand(b, hkv, k, generator=gen) < 0.4
    load_pages[skip], load_slots[skip] = -1, -1
    ref_slots = poison_(torch.empty(n_slots, 2, s, d, dtype=dtype))
    dev_slots = ref_slots.clone().to(DEVICE)
    gather_ref(kv_pool, ref_slots, block_table, load_pages, load_slots)
    gather(
        kv_pool.to(DEVICE),
        dev_slots,
        block_table.to(DEVICE),
        load_pages.to(DEVICE),
        load_slots.to(DEVICE),
    )
    assert bits_equal(ref_slots, dev_slots.cpu())


def _fp8_pool(p_pool, hkv, s, d, gen):
    """A random fp8 pool layer and its exponents (rows of very different magnitudes)."""
    x = torch.randn(p_pool, hkv, 2, s, d, generator=gen)
    x = x * torch.exp2(torch.randint(-12, 12, (p_pool, hkv, 2, s, 1), generator=gen).float())
    return fp8_quantize_ref(x)


def _fp8_load_case(s: int, d: int, n_slots: int, gen: torch.Generator):
    """An fp8 pool layer (2 requests, 3 KV heads, 20 pool pages) and a load list of up to 4
    entries a row into ``n_slots`` slots, 40 % of them skipped: ``(q, e, block_table,
    load_pages, load_slots)``."""
    b, hkv, p_pool, p_max, k = 2, 3, 20, 6, 4
    q, e = _fp8_pool(p_pool, hkv, s, d, gen)
    block_table = torch.randperm(p_pool, generator=gen)[: b * p_max].view(b, p_max).int()
    load_pages = torch.randint(0, p_max, (b, hkv, k), generator=gen, dtype=torch.int32)
    load_slots = torch.randperm(n_slots, generator=gen)[: b * hkv * k].view(b, hkv, k).int()
    skip = torch.rand(b, hkv, k, generator=gen) < 0.4
    load_pages[skip], load_slots[skip] = -1, -1
    return q, e, block_table, load_pages, load_slots


@pytest.mark.parametrize(
    "dtype,s,d",
    [(torch.bfloat16, 16, 64), (torch.bfloat16, 32, 96), (torch.float32, 16, 40)],
    ids=str,
)
def test_gather_fp8_dequantises_exactly(dtype, s, d):
    """The fp8 gather writes :func:`fp8_dequantize_ref` of each loaded record, bit for
    bit (awkward head dims: 96 and 40 are not powers of two)."""
    gen = torch.Generator().manual_seed(s + d)
    n_slots = 30
    q, e, block_table, load_pages, load_slots = _fp8_load_case(s, d, n_slots, gen)
    ref_slots = poison_(torch.empty(n_slots, 2, s, d, dtype=dtype))
    dev_slots = ref_slots.clone().to(DEVICE)
    gather_ref(q, ref_slots, block_table, load_pages, load_slots, pool_scale=e)
    on = load_slots[load_slots >= 0].long()
    assert not torch.isnan(ref_slots[on]).any()
    bi, hi, ki = torch.nonzero(load_slots >= 0, as_tuple=True)
    pages = block_table.long()[bi, load_pages[bi, hi, ki].long()]
    want = fp8_dequantize_ref(q[pages, hi], e[pages, hi], dtype)
    assert bits_equal(ref_slots[load_slots[bi, hi, ki].long()], want)
    gather(
        q.to(DEVICE),
        dev_slots,
        block_table.to(DEVICE),
        load_pages.to(DEVICE),
        load_slots.to(DEVICE),
        pool_scale=e.to(DEVICE),
    )
    assert bits_equal(ref_slots, dev_slots.cpu())


@pytest.mark.parametrize("s,d", [(16, 64), (32, 96), (8, 40)], ids=str)
def test_gather_fp8_into_fp8_slots_copies_as_stored(s, d):
    """An fp8 hot buffer gets each loaded record's fp8 bytes and exponents as the pool
    stores them (reference and kernel, bit for bit); unloaded slots keep their bytes."""
    gen = torch.Generator().manual_seed(s * d)
    n_slots = 30
    q, e, block_table, load_pages, load_slots = _fp8_load_case(s, d, n_slots, gen)
    ref_slots, ref_scale = _fp8_pool(n_slots, 1, s, d, gen)
    ref_slots, ref_scale = ref_slots[:, 0], ref_scale[:, 0]
    dev_slots, dev_scale = ref_slots.clone().to(DEVICE), ref_scale.clone().to(DEVICE)
    before = ref_slots.view(torch.uint8).clone()
    gather_ref(q, ref_slots, block_table, load_pages, load_slots, pool_scale=e, slot_scale=ref_scale)
    bi, hi, ki = torch.nonzero(load_slots >= 0, as_tuple=True)
    pages = block_table.long()[bi, load_pages[bi, hi, ki].long()]
    on = load_slots[bi, hi, ki].long()
    assert bits_equal(ref_slots.view(torch.uint8)[on], q.view(torch.uint8)[pages, hi])
    assert bits_equal(ref_scale[on], e[pages, hi])
    off = torch.ones(n_slots, dtype=torch.bool)
    off[on] = False
    assert bits_equal(ref_slots.view(torch.uint8)[off], before[off])
    gather(
        q.to(DEVICE), dev_slots, block_table.to(DEVICE), load_pages.to(DEVICE),
        load_slots.to(DEVICE), pool_scale=e.to(DEVICE), slot_scale=dev_scale,
    )  # fmt: skip
    assert bits_equal(ref_slots.view(torch.uint8), dev_slots.cpu().view(torch.uint8))
    assert bits_equal(ref_scale, dev_scale.cpu())
    with pytest.raises(ValueError, match="slot_scale"):
        gather_ref(q, ref_slots, block_table, load_pages, load_slots, pool_scale=e)


@pytest.mark.parametrize(
    "b,hq,hkv,d,s,p_max,k,softcap,window",
    [(3, 6, 2, 64, 16, 9, 4, None, None), (2, 4, 1, 40, 8, 13, 6, 30.0, None),
     (4, 9, 3, 96, 16, 7, 3, None, 40)],
    ids=str,
)
@pytest.mark.parametrize(
    "q_dtype,kv_dtype",
    [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
     (torch.float16, torch.float16)],
    ids=str,
)
def test_sparse_attention_reads_fp8_slots_as_dequantised(
    b, hq, hkv, d, s, p_max, k, softcap, window, q_dtype, kv_dtype
):
    """Attention over an fp8 hot buffer (``slot_scale``, read as ``kv_dtype``) gives the
    same bits as over a hot buffer in ``kv_dtype`` holding the dequantised records — the
    reference and the kernel each, several split widths — and the kernel stays within
    rounding of the reference. Slots outside the selection hold NaN-poisoned bytes. The
    compiled kernel's bit equality holds for these shapes (H200, triton 3.6) but is not
    guaranteed in general: its fp8 variant feeds the MMA in another operand layout
    (``sparse_decode_attention``'s docstring)."""
    args = attention_inputs(b, hq, hkv, d, s, p_max, k, torch.float32, seed=b * 7 + d)
    gen = torch.Generator().manual_seed(d)
    x = args["kv_slots"] * torch.exp2(
        torch.randint(-8, 8, (*args["kv_slots"].shape[:3], 1), generator=gen).float()
    )
    q8, e = fp8_quantize_ref(x)
    unused = torch.ones(q8.shape[0], dtype=torch.bool)
    unused[args["slot_list"][args["slot_list"] >= 0].long()] = False
    q8.view(torch.uint8)[unused] = 0x7F  # e4m3 NaN
    plain = fp8_dequantize_ref(q8, e, kv_dtype)
    q = args["q"].to(q_dtype)
    common = (args["selection"], args["slot_list"], args["seq_lens"], args["scale"], softcap, window)
    want = sparse_decode_attention_ref(q, plain, *common)
    got = sparse_decode_attention_ref(q, q8, *common, slot_scale=e, kv_dtype=kv_dtype)
    assert bits_equal(want, got)
    dev = [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in common]
    for split in (None, 1, 3):
        kw = {"pages_per_split": split}
        t_plain = sparse_decode_attention(q.to(DEVICE), plain.to(DEVICE), *dev, **kw)
        t_fp8 = sparse_decode_attention(
            q.to(DEVICE), q8.to(DEVICE), *dev, slot_scale=e.to(DEVICE), kv_dtype=kv_dtype, **kw
        )
        assert bits_equal(t_plain.cpu(), t_fp8.cpu()), f"split {split}"
        assert_close(t_fp8.cpu(), want, ATOL[q_dtype] if q_dtype != torch.float32 else 2e-5)
    with pytest.raises(ValueError, match="slot_scale"):
        sparse_decode_attention(q.to(DEVICE), q8.to(DEVICE), *dev)


def test_fp8_round_is_close_and_idempotent():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(50, 4, 64, generator=gen) * 30
    r = fp8_round_ref(x)
    assert float((r - x).norm() / x.norm()) < 0.05
    assert bits_equal(fp8_round_ref(r), r)
    q, e = fp8_quantize_ref(x)
    assert float(q.float().abs().amax()) <= 256 and q.dtype == FP8
    assert bits_equal(fp8_round_ref(torch.zeros(3, 8)), torch.zeros(3, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "host,hot", [(True, False), (False, False), (True, True)],
    ids=["fp8-pool", "rounded-pool", "fp8-pool-fp8-hot"],
)
def test_append_kv_fp8_bit_exact(dtype, host, hot):
    """With ``fp8`` the kernel writes the fp8 token and its exponent to an fp8 pool (or the
    rounded token to a pool in the compute dtype), and the rounded token to the metadata
    and the resident tail slot (an fp8 hot buffer: the fp8 token and its exponent, the
    pool's bytes), exactly as the reference."""
    args = _append_case(dtype, dtype, True, seed=7)
    args["k"] = args["k"] * 40
    if host:
        gen = torch.Generator().manual_seed(1)
        p_pool, hkv, _, s, d = args["kv_pool"].shape
        args["kv_pool"], args["pool_scale"] = _fp8_pool(p_pool, hkv, s, d, gen)
    if hot:
        args["kv_slots"], args["slot_scale"] = fp8_quantize_ref(args["kv_slots"])
    ref = {k: v.clone() for k, v in args.items()}
    dev = to_device(args, DEVICE)
    append_kv_ref(**ref, fp8=True)
    append_kv(**dev, fp8=True)
    rk = fp8_round_ref(args["k"])
    first = ref["positions"] % args["kv_pool"].shape[3] == 0
    pm = ref["block_table"].long()[torch.arange(len(first)), ref["positions"].long() // args["kv_pool"].shape[3]]
    assert bits_equal(ref["meta"][pm[first], :, 0], rk[first].to(dtype))
    for name in ("kv_pool", "pool_scale", "meta", "kv_slots", "slot_scale"):
        if name in ref:
            a, b = ref[name], dev[name].cpu()
            if a.dtype == FP8:
                a, b = a.view(torch.uint8), b.view(torch.uint8)
            assert bits_equal(a, b), f"{name} differs"
    if hot:  # every resident tail slot holds the token as the fp8 pool stores it
        s = args["kv_pool"].shape[3]
        pos = args["positions"].long()
        slot = args["page_table"].long()[args["slab_ids"].long(), (pos // s)[:, None]]
        bi, hi = torch.nonzero(slot >= 0, as_tuple=True)
        pp = pm[bi]
        for part in (0, 1):
            got = ref["kv_slots"].view(torch.uint8)[slot[bi, hi], part, pos[bi] % s]
            want = ref["kv_pool"].view(torch.uint8)[pp, hi, part, pos[bi] % s]
            assert bits_equal(got, want)
            assert bits_equal(ref["slot_scale"][slot[bi, hi], part, pos[bi] % s],
                              ref["pool_scale"][pp, hi, part, pos[bi] % s])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_append_kv_fp8_keeps_the_sign_of_zero(dtype):
    """A tiny negative element of a row with a large one rounds to ``-0.0`` in e4m3; the
    kernel writes that ``-0.0`` (pool byte 0x80, metadata, tail slot) as the reference's
    cast does, not ``+0.0``."""
    args = _append_case(dtype, dtype, True, seed=8)
    gen = torch.Generator().manual_seed(1)
    p_pool, hkv, _, s, d = args["kv_pool"].shape
    args["kv_pool"], args["pool_scale"] = _fp8_pool(p_pool, hkv, s, d, gen)
    args["k"][..., 0] = 100.0
    args["k"][..., 1::2] = -1e-6
    ref = {k: v.clone() for k, v in args.items()}
    dev = to_device(args, DEVICE)
    append_kv_ref(**ref, fp8=True)
    append_kv(**dev, fp8=True)
    rounded = fp8_round_ref(args["k"])
    assert bool((rounded[..., 1::2] == 0).all()) and bool(torch.signbit(rounded[..., 1::2]).all())
    for name in ("kv_pool", "pool_scale", "meta", "kv_slots"):
        a, b = ref[name], dev[name].cpu()
        if a.dtype == FP8:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert bits_equal(a, b), f"{name} differs"


def _append_case(dtype: torch.dtype, kv_dtype: torch.dtype, with_slots: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    b, hkv, s, d, p_pool, p_max, per_slab = 5, 3, 16, 64, 40, 6, 10
    pos = torch.randint(0, p_max * s, (b,), generator=gen, dtype=torch.int32)
    pos[0], pos[1] = s, 0  # first token of a page
    args = {
        "k": torch.randn(b, hkv, d, generator=gen).to(dtype),
        "v": torch.randn(b, hkv, d, generator=gen).to(dtype),
        "positions": pos,
        "block_table": torch.randperm(p_pool, generator=gen)[: b * p_max].view(b, p_max).int(),
        "kv_pool": torch.randn(p_pool, hkv, 2, s, d, generator=gen).to(kv_dtype),
        "meta": torch.randn(p_pool, hkv, 2, d, generator=gen).sort(dim=2).values.to(kv_dtype),
    }
    if with_slots:
        num_slabs = b * hkv + 2
        slab_ids = torch.randperm(num_slabs, generator=gen)[: b * hkv].view(b, hkv).int()
        page_table = torch.full((num_slabs, p_max), -1, dtype=torch.int32)
        resident = torch.rand(b, hkv, generator=gen) < 0.7
        for i in range(b):
            for h in range(hkv):
                if resident[i, h]:
                    slab = int(slab_ids[i, h])
                    page_table[slab, int(pos[i]) // s] = slab * per_slab + i % per_slab
        args |= {
            "kv_slots": torch.randn(num_slabs * per_slab, 2, s, d, generator=gen).to(kv_dtype),
            "page_table": page_table,
            "slab_ids": slab_ids,
        }
    return args


MIXED = pytest.mark.skipif(not CUDA, reason="the interpreter rounds fp32 -> bf16 towards zero")
BF16_NATIVE = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(not CUDA, reason="the interpreter's bf16 tl.dot returns garbage"),
)


@pytest.mark.parametrize(
    "dtype,kv_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        pytest.param(torch.float32, torch.bfloat16, marks=MIXED),
    ],
    ids=str,
)
@pytest.mark.parametrize("with_slots", [True, False], ids=["write-through", "pool-only"])
def test_append_kv_bit_exact(dtype, kv_dtype, with_slots):
    args = _append_case(dtype, kv_dtype, with_slots, seed=11)
    ref = {k: v.clone() for k, v in args.items()}
    dev = to_device(args, DEVICE)
    append_kv_ref(**ref)
    append_kv(**dev)
    for name in ("kv_pool", "meta", "kv_slots"):
        if name in ref:
            assert bits_equal(ref[name], dev[name].cpu()), f"{name} differs"


@pytest.mark.parametrize(
    "dtype,kv_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)],
    ids=str,
)
def test_append_kv_in_three_launches(dtype, kv_dtype):
    """The decode write-through split (metadata + staging; pool from the staging, without
    metadata; resident tail slot only) leaves pool, metadata and slots exactly as one
    full launch does, for the reference and the kernel alike; the staging rows hold the
    token. Staging is poisoned (NaN) first to catch unwritten elements."""
    args = _append_case(dtype, kv_dtype, True, seed=5)
    one = {k: v.clone() for k, v in args.items()}
    append_kv_ref(**one)
    b, hkv, d = args["k"].shape
    for fn, device in ((append_kv_ref, "cpu"), (append_kv, DEVICE)):
        t = to_device({k: v.clone() for k, v in args.items()}, device)
        staging = torch.full((b, hkv, 2, d), float("nan"), dtype=kv_dtype, device=device)
        common = (t["positions"], t["block_table"], t["kv_pool"])
        fn(t["k"], t["v"], *common, t["meta"], write_pool=False, staging=staging)
        assert bits_equal(t["kv_pool"].cpu(), args["kv_pool"]), "pool written by the first launch"
        assert bits_equal(staging[:, :, 0].cpu(), args["k"].to(kv_dtype))
        assert bits_equal(staging[:, :, 1].cpu(), args["v"].to(kv_dtype))
        fn(staging[:, :, 0], staging[:, :, 1], *common, None)
        slots = (t["kv_slots"], t["page_table"], t["slab_ids"])
        fn(t["k"], t["v"], *common, None, *slots, write_pool=False)
        for name in ("kv_pool", "meta", "kv_slots"):
            assert bits_equal(one[name], t[name].cpu()), f"{fn.__name__}: {name} differs"


# --- fused RMSNorm and RoPE + append ------------------------------------------------------


def _rope_params(d: int, kind: str) -> RopeParams:
    """The model's RoPE tables (:class:`engine.model.rope.Rope`) for ``kind``."""
    from engine.config import RopeScaling
    from engine.model.rope import Rope

    scaling = {
        "plain": None,
        "llama3": RopeScaling(kind="llama3", factor=8.0, original_max_position=8192),
        "linear": RopeScaling(kind="linear", factor=4.0),
        "yarn": RopeScaling(kind="yarn", factor=4.0, original_max_position=4096),
    }[kind]
    rope = Rope(d, 500000.0 if kind == "llama3" else 10000.0, scaling)
    return RopeParams(rope.inv_freq, rope.position_divisor, rope.attention_factor)


NORM_CASES = [
    # leading shape, H, dtype
    ((1,), 576, torch.float32),
    ((3,), 577, torch.float32),
    ((5,), 7, torch.float16),
    ((), 80, torch.float32),
    ((2, 3), 64, torch.float16),  # per-head norm over D of a [T, H, D] view
    ((33,), 1, torch.float32),
]


@pytest.mark.parametrize("lead,h,dtype", NORM_CASES, ids=str)
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "plain"])
def test_rms_norm_matches_reference(lead, h, dtype, with_residual):
    """Triton RMSNorm (and residual add) against the reference on awkward widths, read
    through strides: ``x`` is a view of a wider buffer (as q/k are of a fused qkv output).
    The sum is bit for bit the reference's; the norm within the dtype's rounding."""
    gen = torch.Generator().manual_seed(h)
    wide = (torch.randn(*lead, h + 5, generator=gen) * 3).to(dtype)
    x = wide[..., 2 : 2 + h]
    res = (torch.randn(*lead, h, generator=gen) * 3).to(dtype) if with_residual else None
    w = torch.rand(h, generator=gen) + 0.5
    out_ref, s_ref = rms_norm_ref(x, w, 1e-5, res)
    dev = {"x": x.to(DEVICE), "w": w.to(DEVICE)}
    out, s = rms_norm(dev["x"], dev["w"], 1e-5, res.to(DEVICE) if res is not None else None)
    assert out.shape == x.shape and out.dtype == dtype
    assert bits_equal(s.cpu(), s_ref), "residual sum differs"
    assert_close(out, out_ref, ATOL[dtype])


def test_rms_norm_ref_is_the_models_norm():
    """The reference (the CPU path) is :func:`engine.model.llama.rms_norm` op for op."""
    from engine.model.llama import rms_norm as model_rms_norm

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x, r = (torch.randn(4, 577, generator=gen).to(dtype) for _ in range(2))
        w = torch.rand(577, generator=gen)
        out, s = rms_norm_ref(x, w, 1e-6, r)
        assert bits_equal(s, x + r)
        assert bits_equal(out, model_rms_norm(x + r, w, 1e-6))
        assert bits_equal(rms_norm_ref(x, w, 1e-6)[0], model_rms_norm(x, w, 1e-6))


@pytest.mark.parametrize(
    "rows,ffn,dtype",
    [(1, 1536, torch.float32), (3, 7, torch.float32), (33, 1025, torch.bfloat16),
     (5, 2048, torch.float16), (0, 64, torch.float32), (2, 1, torch.bfloat16)],
    ids=str,
)
def test_swiglu_matches_reference(rows, ffn, dtype):
    """Triton SwiGLU against the reference on awkward widths (more than one column block,
    odd widths), read through a row stride wider than ``2F`` (a view of a wider buffer)."""
    gen = torch.Generator().manual_seed(ffn + rows)
    wide = (torch.randn(rows, 2 * ffn + 3, generator=gen) * 4).to(dtype)
    x = wide[:, : 2 * ffn]
    ref = swiglu_ref(x)
    out = swiglu(x.to(DEVICE))
    assert out.shape == (rows, ffn) and out.dtype == dtype
    assert_close(out, ref, ATOL[dtype])


def test_swiglu_ref_is_the_unfused_model_math():
    """In float32 the reference equals torch's ``silu(gate) * up`` (the CPU path) bit for
    bit; in bf16 it rounds once where torch rounds twice: at most one bf16 step apart."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 2 * 577, generator=gen) * 3
    gate, up = x.chunk(2, dim=-1)
    assert bits_equal(swiglu_ref(x), F.silu(gate) * up)
    xb = x.bfloat16()
    gb, ub = xb.chunk(2, dim=-1)
    diff = (swiglu_ref(xb).float() - (F.silu(gb) * ub).float()).abs()
    step = (F.silu(gb) * ub).float().abs() * 2.0**-7
    assert bool((diff <= step + 1e-30).all())


def test_swiglu_rejects_bad_input():
    with pytest.raises(ValueError, match="even"):
        swiglu(torch.zeros(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[R, 2F\]"):
        swiglu(torch.zeros(2, 3, 8, device=DEVICE))


def test_rope_ref_is_the_models_rope():
    """The reference rotation is :class:`engine.model.rope.Rope` + ``apply_rope`` bit for bit."""
    from engine.config import RopeScaling
    from engine.model.rope import Rope, apply_rope

    gen = torch.Generator().manual_seed(1)
    pos = torch.randint(0, 1 << 17, (5,), generator=gen)
    for sc in (None, RopeScaling(kind="linear", factor=3.0), RopeScaling(kind="yarn", factor=4.0)):
        rope = Rope(64, 10000.0, sc)
        params = RopeParams(rope.inv_freq, rope.position_divisor, rope.attention_factor)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(5, 3, 64, generator=gen).to(dtype)
            cos, sin = rope.cos_sin(pos, dtype)
            c2, s2 = rope_cos_sin_ref(pos, params, dtype)
            assert bits_equal(cos, c2) and bits_equal(sin, s2)
            assert bits_equal(apply_rope(x, cos, sin), rotate_half_ref(x, c2, s2))


def _qkv_views(b: int, hq: int, hkv: int, d: int, dtype, gen) -> tuple[torch.Tensor, ...]:
    """q, k, v as strided views of one fused qkv output ``[B, (Hq + 2 Hkv) D]``."""
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(b, hq, d), k.view(b, hkv, d), v.view(b, hkv, d)


ROPE_CASES = [
    # b, hq, hkv, d, rope kind, dtype
    (1, 9, 3, 64, "llama3", torch.float32),
    (3, 4, 4, 80, "plain", torch.float32),
    (2, 8, 2, 128, "yarn", torch.float32),
    (5, 6, 3, 64, "linear", torch.float16),
    (4, 2, 1, 80, "plain", torch.float16),
]


@pytest.mark.parametrize("b,hq,hkv,d,kind,dtype", ROPE_CASES, ids=str)
@pytest.mark.parametrize(
    "mode",
    ["write-through", "pool-only", "staging", "fp8-write-through", "fp8-staging",
     "fp8-hot-write-through"],
)
def test_rope_append_matches_reference(b, hq, hkv, d, kind, dtype, mode):
    """RoPE + append in one launch: the rotated q and k match the reference to float32
    cos/sin rounding, and every write (pool, metadata, resident tail slot, staging) is bit
    for bit :func:`append_kv_ref` of the returned key — with ``fp8`` too (an fp8 pool and
    its scale exponents; one scale per row over both RoPE halves). Outputs are poisoned
    (NaN) first."""
    gen = torch.Generator().manual_seed(b * 100 + d)
    s, p_max, per_slab = 16, 6, 4
    p_pool = b * p_max + 3
    q, k, v = _qkv_views(b, hq, hkv, d, dtype, gen)
    pos = torch.randint(0, p_max * s, (b,), generator=gen, dtype=torch.int32)
    pos[0] = s  # the first token of a page
    args = {
        "positions": pos,
        "block_table": torch.randperm(p_pool, generator=gen)[: b * p_max].view(b, p_max).int(),
        "kv_pool": torch.randn(p_pool, hkv, 2, s, d, generator=gen).to(dtype),
        "meta": torch.randn(p_pool, hkv, 2, d, generator=gen).sort(dim=2).values.to(dtype),
    }
    kw = {}
    if mode.startswith("fp8"):
        args["kv_pool"], args["pool_scale"] = _fp8_pool(p_pool, hkv, s, d, gen)
        kw["fp8"] = True
    if mode.endswith("write-through"):
        num_slabs = b * hkv + 1
        slab_ids = torch.randperm(num_slabs, generator=gen)[: b * hkv].view(b, hkv).int()
        page_table = torch.full((num_slabs, p_max), -1, dtype=torch.int32)
        for i in range(b):
            for h in range(hkv):
                if (i + h) % 3:
                    slab = int(slab_ids[i, h])
                    page_table[slab, int(pos[i]) // s] = slab * per_slab + i % per_slab
        args |= {
            "kv_slots": torch.randn(num_slabs * per_slab, 2, s, d, generator=gen).to(dtype),
            "page_table": page_table,
            "slab_ids": slab_ids,
        }
        if "hot" in mode:  # an fp8 hot buffer: fp8 slots and their exponents
            args["kv_slots"], args["slot_scale"] = fp8_quantize_ref(args["kv_slots"])
    if mode.endswith("staging"):
        args["staging"] = torch.full((b, hkv, 2, d), float("nan"), dtype=dtype)
        kw["write_pool"] = False
    rope = _rope_params(d, kind)
    ref = {n: t.clone() for n, t in args.items()}
    q_ref, k_ref = rope_append_ref(q, k, v, rope=rope, **ref, **kw)
    dev = to_device(args, DEVICE)
    rope_dev = RopeParams(rope.inv_freq.to(DEVICE), rope.position_divisor, rope.attention_factor)
    qd, kd, vd = (t.to(DEVICE) for t in (q, k, v))
    q_rot, k_rot = rope_append(qd, kd, vd, rope=rope_dev, **dev, **kw)
    assert_close(q_rot, q_ref, ATOL[dtype])
    assert_close(k_rot, k_ref, ATOL[dtype])
    # The writes are exactly the append of the kernel's own rotated key.
    own = {n: t.clone() for n, t in args.items()}
    append_kv_ref(k_rot.cpu(), v, **own, **kw)
    for name in ("kv_pool", "pool_scale", "meta", "kv_slots", "slot_scale", "staging"):
        if name in own:
            a, b_ = own[name], dev[name].cpu()
            if a.dtype == FP8:
                a, b_ = a.view(torch.uint8), b_.view(torch.uint8)
            assert bits_equal(a, b_), f"{name} differs"


def test_rope_append_far_positions_without_writes():
    """Positions up to 2^20 (angles of ~10^6 rad): cos/sin keep their range reduction
    (no approximate sin/cos). All writes off: only q and k are produced, and the block
    table is not read (its width does not cover these positions)."""
    gen = torch.Generator().manual_seed(3)
    b, hq, hkv, d = 3, 4, 2, 64
    q, k, v = _qkv_views(b, hq, hkv, d, torch.float32, gen)
    pos = torch.tensor([1 << 20, 131071, 65536], dtype=torch.int64)
    rope = _rope_params(d, "plain")
    table = torch.zeros(b, 1, dtype=torch.int32)
    pool = torch.zeros(1, hkv, 2, 16, d)
    cos, sin = rope_cos_sin_ref(pos, rope, torch.float32)
    q_ref, k_ref = rotate_half_ref(q, cos, sin), rotate_half_ref(k, cos, sin)
    rope_dev = RopeParams(rope.inv_freq.to(DEVICE))
    q_rot, k_rot = rope_append(
        *(t.to(DEVICE) for t in (q, k, v, pos)),
        rope_dev,
        table.to(DEVICE),
        pool.to(DEVICE),
        None,
        write_pool=False,
    )
    assert_close(q_rot, q_ref, 1e-4)
    assert_close(k_rot, k_ref, 1e-4)
    assert bits_equal(pool, torch.zeros_like(pool))


def test_fused_launchers_raise_clear_errors():
    x = torch.zeros(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        rms_norm(x, torch.ones(63, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="residual must be"):
        rms_norm(x, torch.ones(64, device=DEVICE), 1e-5, x.half())
    q, k = torch.zeros(1, 9, 64, device=DEVICE), torch.zeros(1, 3, 64, device=DEVICE)
    pool = torch.zeros(2, 3, 2, 16, 64, device=DEVICE)
    table = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    pos = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    rope = RopeParams(torch.ones(32, device=DEVICE))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        rope_append(q[:, :8], k, k, pos, rope, table, pool, None)
    with pytest.raises(ValueError, match="inv_freq"):
        rope_append(q, k, k, pos, RopeParams(torch.ones(31, device=DEVICE)), table, pool, None)
    with pytest.raises(ValueError, match="even head dim"):
        rope_append(q[..., :63], k[..., :63], k[..., :63], pos, rope, table, pool, None)


def test_model_decode_layer_fused_equals_unfused():
    """A decode layer of a tiny Qwen3-shaped model (per-head q/k norms, odd head count):
    on the reference path the fused route (``qkv(rotate=False)`` + ``rope_append_ref``) is
    the unfused one (``qkv`` + ``append_kv_ref``) bit for bit; the Triton norms and
    ``rope_append`` match it to float32 rounding."""
    from engine.config import ModelConfig
    from engine.model.llama import LlamaModel
    from engine.model.rope import Rope
    from engine.weights.synthetic import synthetic_weights

    cfg = ModelConfig(
        arch="qwen3", num_layers=1, hidden_size=96, num_heads=6, num_kv_heads=2, head_dim=16,
        intermediate_size=64, vocab_size=50, qk_norm=True,
    )  # fmt: skip
    rope = Rope(cfg.head_dim, cfg.rope_theta)
    cpu = torch.device("cpu")
    ref_m = LlamaModel(synthetic_weights(cfg, group_size=32), cpu, torch.float32, "float", rope)
    gen = torch.Generator().manual_seed(0)
    qk_norms = [torch.rand(cfg.head_dim, generator=gen) + 0.5 for _ in range(2)]
    ref_m.layers[0].q_norm, ref_m.layers[0].k_norm = qk_norms  # synthetic weights have none
    b, s = 3, 16
    h = torch.randn(b, cfg.hidden_size, generator=gen)
    pos = torch.tensor([5, 16, 40])
    table = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]], dtype=torch.int32)
    pools = [torch.zeros(9, 2, 2, s, 16) for _ in range(3)]
    q, k, v = ref_m.qkv(0, h, pos)
    append_kv_ref(k, v, pos, table, pools[0], None)
    qr, kr, vr = ref_m.qkv(0, h, pos, rotate=False)
    q2, k2 = rope_append_ref(qr, kr, vr, pos, ref_m.rope_params, table, pools[1], None)
    assert bits_equal(q, q2) and bits_equal(k, k2) and bits_equal(pools[0], pools[1])
    attn = torch.randn(b, cfg.num_heads, cfg.head_dim, generator=gen)
    out = ref_m.finish_layer(0, h, attn)

    dev = torch.device(DEVICE)
    tri_m = LlamaModel(
        synthetic_weights(cfg, group_size=32), dev, torch.float32, "float", rope, use_triton=True
    )
    tri_m.layers[0].q_norm, tri_m.layers[0].k_norm = (n.to(dev) for n in qk_norms)
    hd, posd, tabled, pool = (t.to(dev) for t in (h, pos, table, pools[2]))
    qt, kt, vt = tri_m.qkv(0, hd, posd, rotate=False)
    q3, k3 = rope_append(qt, kt, vt, posd, tri_m.rope_params, tabled, pool, None)
    assert_close(q3, q, 1e-5)
    assert_close(k3, k, 1e-5)
    assert_close(pool, pools[0], 1e-5)
    assert_close(tri_m.finish_layer(0, hd, attn.to(dev)), out, 1e-5)
    assert_close(tri_m.logits(hd), ref_m.logits(h), 1e-4)


# --- Quest scores and selection ---------------------------------------------------------


@pytest.mark.parametrize(
    "b,hq,hkv,d,p_max", [(2, 9, 3, 64, 40), (3, 28, 4, 128, 70), (1, 4, 4, 64, 5)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quest_scores_match_reference(b, hq, hkv, d, p_max, dtype):
    gen = torch.Generator().manual_seed(b * hq + p_max)
    p_pool = b * p_max + 4
    q = torch.randn(b, hq, d, generator=gen).to(dtype)
    meta = torch.randn(p_pool, hkv, 2, d, generator=gen).sort(dim=2).values.to(dtype)
    block_table = torch.randperm(p_pool, generator=gen)[: b * p_max].view(b, p_max).int()
    block_table[0, -1] = -1  # an unused tail entry
    num_pages = torch.randint(1, p_max + 1, (b,), generator=gen, dtype=torch.int32)
    num_pages[0] = min(int(num_pages[0]), p_max - 1)
    ref = quest_scores_ref(q, meta, block_table, num_pages)
    with poisoned_allocations():
        out = quest_scores(*(t.to(DEVICE) for t in (q, meta, block_table, num_pages))).cpu()
    assert torch.equal(torch.isneginf(ref), torch.isneginf(out))
    finite = torch.isfinite(ref)
    scale = (q.float().abs().sum(1).max() * meta.float().abs().max()).item()
    assert (out[finite] - ref[finite]).abs().max() <= 1e-5 * scale
# The outvoted head (issue #18): with sink page 0, window page 5 and one free page.
OUTVOTED_PICKS = {"sum": [0, 1, 5], "max": [0, 3, 5], "normmax": [0, 3, 5], "union": [0, 3, 5]}


def test_group_combines_agree_with_config():
    assert CONFIG_GROUP_COMBINES == GROUP_COMBINES == tuple(OUTVOTED_PICKS)


@pytest.mark.parametrize("combine", GROUP_COMBINES)
@pytest.mark.parametrize("triton", [False, True], ids=["reference", "triton"])
def test_outvoted_head_case(combine, triton):
    """Summing the group's bounds loses the page the one attending head needs (the sums
    tie at 5 on pages 1, 2, 4 and page 3 sums to 0, so the tie-break takes page 1); every
    other rule, like the oracle, takes page 3."""
    c = outvoted_head_case()
    args = (c["q"], c["meta"], c["block_table"], c["num_pages"])
    if triton:
        scores = quest_scores(*(t.to(DEVICE) for t in args), combine, 1.0).cpu()
        pick = select_topk(scores.to(DEVICE), c["num_pages"].to(DEVICE), 3, 1, 1).cpu()
    else:
        scores = quest_scores_ref(*args, combine, 1.0)
        pick = select_topk_ref(scores, c["num_pages"], 3, 1, 1)
    if combine == "sum":
        assert scores.tolist() == [[[5.0, 5.0, 5.0, 0.0, 5.0, 5.0]]]
    pages = unpack_bits(pick, 6)[0, 0].nonzero().flatten().tolist()
    assert pages == OUTVOTED_PICKS[combine]
    mass = oracle_scores_ref(c["q"], c["kv_pool"], c["block_table"], c["seq_lens"], 1.0)
    assert mass[0, 0, 3] / 2 > 0.4998  # head 0's 99.98 % (of the group's mass 2)
    oracle_pick = select_topk_ref(mass, c["num_pages"], 3, 1, 1)
    assert unpack_bits(oracle_pick, 6)[0, 0].nonzero().flatten().tolist() == [0, 3, 5]


def test_default_group_combine_finds_the_outvoted_page():
    c = outvoted_head_case()
    rule = EngineConfig().group_combine
    scores = quest_scores_ref(c["q"], c["meta"], c["block_table"], c["num_pages"], rule, 1.0)
    pick = select_topk_ref(scores, c["num_pages"], 3, 1, 1)
    assert unpack_bits(pick, 6)[0, 0].nonzero().flatten().tolist() == [0, 3, 5]


def test_combine_rules_by_their_definitions():
    """Each rule against its formula on hand-written per-head bounds (G = 2, one request,
    four pages, the last unused)."""
    u = torch.tensor([[[1.0, 4.0, 2.0, 0.0], [3.0, -1.0, 3.0, 0.0]]])  # [B, Hq, P]
    n = torch.tensor([3], dtype=torch.int32)
    inf = float("inf")
    assert combine_group_ref(u, n, 1, "sum", 1.0).tolist() == [[[4.0, 3.0, 5.0, -inf]]]
    assert combine_group_ref(u, n, 1, "max", 1.0).tolist() == [[[3.0, 4.0, 3.0, -inf]]]
    x = u[..., :3] * 0.5
    want = (x - torch.logsumexp(x, -1, keepdim=True)).amax(1, keepdim=True)
    got = combine_group_ref(u, n, 1, "normmax", 0.5)
    torch.testing.assert_close(got[..., :3], want, rtol=0, atol=1e-6)
    assert got[0, 0, 3] == -inf
    # head 0 ranks pages 1, 2, 0; head 1 ranks 0, 2 (tie with 0: lower page first), 1
    assert combine_group_ref(u, n, 1, "union", 1.0).tolist() == [[[0.0, 0.0, -1.0, -inf]]]
    with pytest.raises(ValueError, match="combine must be one of"):
        combine_group_ref(u, n, 1, "mean", 1.0)


QUEST_RULE_CASES = [
    # b, hq, hkv, d, p_max
    (2, 9, 3, 64, 41),  # G = 3, odd P (SmolLM2's heads)
    (1, 4, 4, 64, 5),  # G = 1
    (2, 16, 2, 128, 37),  # G = 8, D = 128
    (3, 28, 4, 128, 70),  # G = 7
    (2, 24, 8, 64, 1),  # a single page
]


@pytest.mark.parametrize("combine", GROUP_COMBINES)
@pytest.mark.parametrize("b,hq,hkv,d,p_max", QUEST_RULE_CASES)
def test_quest_rules_match_reference_exact_inputs(combine, b, hq, hkv, d, p_max):
    """Integer-valued inputs: every bound is exact, so ``sum``, ``max`` and ``union`` must
    match bit for bit (ties included: union's ranks and the top-k bitmask), ``normmax``
    within fp32 rounding of its exp/log; the selections must then agree too."""
    t = quest_inputs(b, hq, hkv, d, p_max, torch.float32, seed=p_max + hq, integer=True)
    args = (t["q"], t["meta"], t["block_table"], t["num_pages"])
    ref = quest_scores_ref(*args, combine)
    with poisoned_allocations():
        out = quest_scores(*(x.to(DEVICE) for x in args), combine).cpu()
    assert torch.equal(torch.isneginf(ref), torch.isneginf(out))
    if combine == "normmax":
        fin = torch.isfinite(ref)
        assert (out[fin] - ref[fin]).abs().max() <= 1e-4
        return
    assert torch.equal(out, ref)
    for top_k, sink, window in ((3, 1, 1), (8, 0, 2)):
        assert torch.equal(
            select_topk_ref(ref, t["num_pages"], top_k, sink, window),
            select_topk(out.to(DEVICE), t["num_pages"].to(DEVICE), top_k, sink, window).cpu(),
        )


@pytest.mark.parametrize("combine", ["sum", "max", "normmax"])
@pytest.mark.parametrize("b,hq,hkv,d,p_max", QUEST_RULE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quest_rules_match_reference_random_inputs(combine, b, hq, hkv, d, p_max, dtype):
    t = quest_inputs(b, hq, hkv, d, p_max, dtype, seed=7 * p_max + hkv, integer=False)
    args = (t["q"], t["meta"], t["block_table"], t["num_pages"])
    ref = quest_scores_ref(*args, combine, 0.3)
    with poisoned_allocations():
        out = quest_scores(*(x.to(DEVICE) for x in args), combine, 0.3).cpu()
    assert torch.equal(torch.isneginf(ref), torch.isneginf(out))
    fin = torch.isfinite(ref)
    scale = (t["q"].float().abs().sum(-1).max() * t["meta"].float().abs().max()).item()
    assert (out[fin] - ref[fin]).abs().max() <= 1e-5 * scale * (0.3 if combine == "normmax" else 1)


@pytest.mark.parametrize("tile", [16, 2048], ids=["partials_in_several_tiles", "one_tile"])
def test_normmax_long_page_axis_matches_reference(monkeypatch, tile):
    """``normmax`` over many page blocks (each head's log-sum-exp combined from the blocks'
    partial terms, in several loop iterations when the tile is small), rows of different
    lengths, a row with one page: within fp32 rounding of the reference, and the same
    selection where the scores are not near-tied."""
    import kernels.quest_scores as qs

    monkeypatch.setattr(qs, "NORMMAX_PARTIAL_TILE", tile)
    t = quest_inputs(3, 8, 2, 64, 1500, torch.float32, seed=11, integer=False)
    t["num_pages"] = torch.tensor([1500, 1033, 1], dtype=t["num_pages"].dtype)
    args = (t["q"], t["meta"], t["block_table"], t["num_pages"])
    ref = quest_scores_ref(*args, "normmax", 0.125)
    with poisoned_allocations():
        out = quest_scores(*(x.to(DEVICE) for x in args), "normmax", 0.125).cpu()
    assert torch.equal(torch.isneginf(ref), torch.isneginf(out))
    fin = torch.isfinite(ref)
    assert (out[fin] - ref[fin]).abs().max() <= 1e-4
    sel_ref = select_topk_ref(ref, t["num_pages"], 40, 1, 2)
    sel = select_topk_ref(out, t["num_pages"], 40, 1, 2)
    # equal unless the 40th and 41st pages of a row are within the rounding
    top2 = ref.sort(dim=-1, descending=True).values[..., 38:41]
    if (top2[..., :-1] - top2[..., 1:]).abs().min() > 1e-4:
        assert torch.equal(sel, sel_ref)


@pytest.mark.parametrize("p,k", [(4096, 128), (5000, 128), (20000, 1), (9000, 2048), (100, 7)])
def test_top_keys_equals_torch_topk(p, k):
    """The two-stage top-k of long rows returns exactly ``torch.topk``'s values (distinct
    keys, as the packed page keys are), padding included."""
    gen = torch.Generator().manual_seed(p + k)
    key = torch.randperm(2 * p * 6, generator=gen)[: 6 * p].view(2, 3, p) - p  # distinct
    key[0, 0, :5] = torch.iinfo(torch.int64).min + 1  # near the padding value
    want = torch.topk(key, k, dim=-1, sorted=True).values
    assert torch.equal(top_keys(key.to(DEVICE), k).cpu(), want)


def test_union_ranks_each_heads_own_order():
    """``union`` on random inputs from the per-head bounds: page p's score is minus its
    best place in any head's own ranking (checked against a plain Python ranking)."""
    t = quest_inputs(2, 9, 3, 64, 23, torch.float32, seed=5, integer=False)
    args = (t["q"], t["meta"], t["block_table"], t["num_pages"])
    u = quest_head_bounds_ref(*args)
    scores = quest_scores_ref(*args, "union")
    for b in range(2):
        n = int(t["num_pages"][b])
        for h in range(3):
            best = [n] * n
            for g in range(3):
                row = u[b, h * 3 + g, :n].tolist()
                for place, p in enumerate(sorted(range(n), key=lambda p: (-row[p], p))):
                    best[p] = min(best[p], place)
            assert scores[b, h, :n].tolist() == [-float(r) for r in best]
            assert torch.isneginf(scores[b, h, n:]).all()


def test_quest_scores_reject_unknown_combine():
    t = quest_inputs(1, 4, 2, 64, 4, torch.float32, seed=0, integer=True)
    args = tuple(t[k].to(DEVICE) for k in ("q", "meta", "block_table", "num_pages"))
    with pytest.raises(ValueError, match="combine must be one of"):
        quest_scores(*args, "mean")
    with pytest.raises(ValueError, match="combine must be one of"):
        quest_scores_ref(*(x.cpu() for x in args), "mean")




SELECT_CASES = [
    # top_k, sink, window
    (5, 1, 2),
    (1, 0, 1),  # a budget of one page
    (100, 1, 4),  # budget >= context
    (8, 0, 0),
    (3, 2, 3),  # forced pages exceed the budget
    (6, 40, 0),  # sink covers everything
]


@pytest.mark.parametrize("top_k,sink,window", SELECT_CASES)
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_select_topk_same_bitmask(top_k, sink, window, ties):
    gen = torch.Generator().manual_seed(top_k * 7 + sink)
    b, hkv, p_max = 4, 3, 70
    num_pages = torch.randint(1, p_max + 1, (b,), generator=gen, dtype=torch.int32)
    num_pages[0] = p_max
    scores = torch.randn(b, hkv, p_max, generator=gen)
    if ties:
        scores = torch.randint(-1, 2, (b, hkv, p_max), generator=gen).float()
        scores[0, 0, :10] = -0.0
    scores = scores.masked_fill(torch.arange(p_max) >= num_pages[:, None, None], float("-inf"))
    ref = select_topk_ref(scores, num_pages, top_k, sink, window)
    with poisoned_allocations():
        out = select_topk(scores.to(DEVICE), num_pages.to(DEVICE), top_k, sink, window)
    assert torch.equal(ref, out.cpu())


# --- int4 linear --------------------------------------------------------------------------


def _check_group_int4_linear(w, x, configs, tol):
    """``group_int4_linear`` on the Int4Weight ``w`` matches :func:`group_int4_linear_ref`
    under each tile config, and the reference is the product of the engine's own
    dequantised weight."""
    g = w.group_size
    ref = group_int4_linear_ref(x, w.q, w.scale, w.offset, g)
    exact = (x.float() @ w.dequantize(torch.float32).T).to(x.dtype)  # engine's own dequantiser
    assert torch.equal(ref, exact)
    dev = [t.to(DEVICE) for t in (x, w.q, w.scale, w.offset)]
    for cfg in configs:
        out = group_int4_linear(*dev, g, config=cfg).cpu()
        assert out.dtype == x.dtype and out.shape == ref.shape
        rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert rel < tol, f"relative error {rel:.3g} with {cfg}"
    return dev


@pytest.mark.parametrize(
    "m,n,k,g",
    [
        (1, 64, 96, 32),
        (5, 96, 576, 32),
        (5, 40, 192, 64),
        (3, 40, 576, 64),
        (33, 72, 384, 128),
        (16, 48, 256, 128),
        (7, 24, 512, 256),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16_NATIVE], ids=str)
def test_group_int4_linear_matches_reference(m, n, k, g, dtype):
    """The Int4Weight layout (interleaved nibbles, group g, fp32 scale and offset, as
    ``quantize_int4`` makes it) read in place: odd M, K not a multiple of the K tile, N not
    a multiple of the N tile, groups smaller and larger than the K tile, split-K. (bf16
    runs natively only: the interpreter's bf16 dot is not a reference.)"""
    from engine.weights.quant import quantize_int4

    gen = torch.Generator().manual_seed(m * n + k + g)
    w = quantize_int4(torch.randn(n, k, generator=gen) * 0.05, group_size=g)
    x = torch.randn(m, k, generator=gen).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    configs = (
        None,
        Q4Config(16, 32, 64, 3),
        Q4Config(16, 64, 128, 1),
        Q4Config(32, 16, 32, 2),
        Q4Config(4, 32, 64, 3, kind="gemv"),  # M tiles of 4 rows, split-K
        Q4Config(1, 16, 256, 2, kind="gemv"),  # one row a program; K tile past K and groups
    )
    dev = _check_group_int4_linear(w, x, configs, tol)
    with pytest.raises(ValueError, match="group_size"):
        group_int4_linear(*dev, 3)
    with pytest.raises(ValueError, match="block_k"):
        group_int4_linear(*dev, g, config=Q4Config(16, 32, 48, 1))
    with pytest.raises(ValueError, match="kind"):
        group_int4_linear(*dev, g, config=Q4Config(16, 32, 64, 1, kind="mma"))
    with pytest.raises(ValueError, match="block_m"):
        group_int4_linear(*dev, g, config=Q4Config(4, 32, 64, 1))  # dot needs 16 rows


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_group_int4_linear_on_gguf_blocks(kind):
    """GGUF ``Q4_0``/``Q4_1`` weights as the engine keeps them (converted to Int4Weight,
    group 32, by ``int4_from_gguf_blocks``; Q4_0's offset is ``-8 d``) through the kernel."""
    import numpy as np

    from engine.weights.quant import int4_from_gguf_blocks

    gen = torch.Generator().manual_seed(7)
    n, k, m = 40, 160, 3
    nb = k // 32
    d = (torch.rand(n, nb, 1, generator=gen) * 0.01 + 1e-3).half()
    head = [d.view(torch.uint8)]
    if kind == "Q4_1":
        head.append((torch.randn(n, nb, 1, generator=gen) * 0.05).half().view(torch.uint8))
    qs = torch.randint(0, 256, (n, nb, 16), generator=gen, dtype=torch.uint8)
    raw = torch.cat([*head, qs], dim=-1).reshape(n, -1)
    w = int4_from_gguf_blocks(np.ascontiguousarray(raw.numpy()), kind, (n, k))
    assert w.group_size == 32
    x = torch.randn(m, k, generator=gen)
    _check_group_int4_linear(
        w, x, (None, Q4Config(16, 32, 64, 2), Q4Config(4, 16, 128, 2, kind="gemv")), 1e-6
    )


# --- dispatch, launcher checks, the whole decode step -------------------------------------


def test_get_ops_picks_backend():
    from kernels.quest_scores import quest_scores_matmul

    cpu = get_ops("cpu")
    assert cpu.name == "cpu" and get_ops("cpu", use_triton=False) is cpu
    assert cpu.quest_scores is quest_scores_matmul
    assert cpu.sparse_decode_attention is REFERENCE_OPS.sparse_decode_attention  # the rest
    assert cpu.select_topk is REFERENCE_OPS.select_topk  # are the references
    assert get_ops("cuda").name == "triton"
    assert get_ops("cpu", use_triton=True).name == "triton"
    assert get_ops("cuda", use_triton=False).name == "reference"


def test_launchers_raise_clear_errors():
    args = to_device(attention_inputs(1, 9, 3, 64, 16, 4, 2, torch.float32, seed=0), DEVICE)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        sparse_decode_attention(**dict(args, q=args["q"][:, :8]))
    with pytest.raises(ValueError, match="selection dtype"):
        sparse_decode_attention(**dict(args, selection=args["selection"].long()))
    with pytest.raises(ValueError, match="unit stride"):
        sparse_decode_attention(
            **dict(args, q=args["q"].transpose(1, 2).contiguous().transpose(1, 2))
        )
    with pytest.raises(ValueError, match="power of two"):
        sparse_decode_attention(**dict(args, kv_slots=args["kv_slots"][:, :, :12]))
    if CUDA:
        with pytest.raises(ValueError, match="is on"):
            sparse_decode_attention(**dict(args, seq_lens=args["seq_lens"].cpu()))
    pool = torch.zeros(4, 3, 2, 16, 64, device=DEVICE)
    table = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    loads = torch.zeros(1, 3, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="record shapes"):
        gather(pool, torch.zeros(4, 2, 8, 64, device=DEVICE), table, loads, loads)
    with pytest.raises(ValueError, match="dtype"):
        gather(
            pool, torch.zeros(4, 2, 16, 64, device=DEVICE, dtype=torch.float16), table, loads, loads
        )


@pytest.mark.slow
@pytest.mark.parametrize("buffer_pages", [4, 12], ids=["evicting", "roomy"])
def test_decode_step_hierarchical_equals_resident(buffer_pages):
    """append -> Quest -> top-k -> resolve -> gather -> attention, over several steps,
    against the references; the hierarchical result equals the all-resident one bit for
    bit (same kernel, same K_max, records in other slots)."""
    gen = torch.Generator().manual_seed(buffer_pages)
    b, hq, hkv, d, s, p_max, top_k = 2, 9, 3, 64, 16, 12, 4
    ops, ref_ops = get_ops(DEVICE, use_triton=True), REFERENCE_OPS  # the oracle's Quest
    p_pool = b * p_max
    block_table = torch.arange(p_pool).view(b, p_max).int()
    kv_pool = torch.randn(p_pool, hkv, 2, s, d, generator=gen)
    meta = torch.stack([kv_pool[:, :, 0].amin(2), kv_pool[:, :, 0].amax(2)], dim=2)
    seq_lens = torch.tensor([100, 150], dtype=torch.int32)
    c = buffer_pages
    num_slabs = b * hkv
    slab_ids = torch.arange(num_slabs).view(b, hkv).int()
    state_ref = _resolve_state(num_slabs, p_max, c)
    state = [t.to(DEVICE, copy=True) for t in state_ref]
    slots_ref = torch.zeros(num_slabs * c, 2, s, d)
    slots = slots_ref.to(DEVICE, copy=True)
    dev = to_device({"kv_pool": kv_pool, "meta": meta, "block_table": block_table}, DEVICE)
    for step in range(5):
        k_new, v_new = torch.randn(b, hkv, d, generator=gen), torch.randn(b, hkv, d, generator=gen)
        q = torch.randn(b, hq, d, generator=gen)
        pos = seq_lens.clone()
        seq_lens = seq_lens + 1
        num_pages = -(-seq_lens // s)
        ref_ops.append_kv(
            k_new, v_new, pos, block_table, kv_pool, meta, slots_ref, state_ref[0], slab_ids
        )
        ops.append_kv(
            k_new.to(DEVICE),
            v_new.to(DEVICE),
            pos.to(DEVICE),
            dev["block_table"],
            dev["kv_pool"],
            dev["meta"],
            slots,
            state[0],
            slab_ids.to(DEVICE),
        )
        scores = ref_ops.quest_scores(q, meta, block_table, num_pages)
        sel = ref_ops.select_topk(scores, num_pages, top_k, 1, 1)
        sel_dev = ops.select_topk(
            ops.quest_scores(q.to(DEVICE), dev["meta"], dev["block_table"], num_pages.to(DEVICE)),
            num_pages.to(DEVICE),
            top_k,
            1,
            1,
        )
        assert torch.equal(sel, sel_dev.cpu()), f"step {step}: selection differs"
        k_max = top_k
        r = ref_ops.resolve(sel, slab_ids, *state_ref, step, c, k_max)
        o = ops.resolve(sel_dev, slab_ids.to(DEVICE), *state, step, c, k_max)
        assert all(torch.equal(x, y.cpu()) for x, y in zip(r, o, strict=True)), (
            f"step {step}: resolve differs"
        )
        ref_ops.gather(kv_pool, slots_ref, block_table, r[1], r[2])
        ops.gather(dev["kv_pool"], slots, dev["block_table"], o[1], o[2])
        assert bits_equal(slots_ref, slots.cpu()), f"step {step}: hot buffer differs"
        out_ref = ref_ops.sparse_decode_attention(q, slots_ref, sel, r[0], seq_lens, d**-0.5)
        out_hier = ops.sparse_decode_attention(
            q.to(DEVICE), slots, sel_dev, o[0], seq_lens.to(DEVICE), d**-0.5
        )
        resident = ops.resident_slot_list(sel_dev, dev["block_table"], k_max)
        pool_records = dev["kv_pool"].view(-1, 2, s, d)
        out_res = ops.sparse_decode_attention(
            q.to(DEVICE), pool_records, sel_dev, resident, seq_lens.to(DEVICE), d**-0.5
        )
        assert_close(out_hier, out_ref, ATOL[torch.float32])
        assert bits_equal(out_hier.cpu(), out_res.cpu()), f"step {step}: hierarchical != resident"


def test_eviction_policies_are_one_registry():
    """Every eviction policy a config accepts has a resolve step (reference and kernel)."""
    from engine.config import EVICTION_POLICIES
    from kernels.dispatch import RESOLVERS

    assert set(EVICTION_POLICIES) == set(RESOLVERS)
    assert get_ops("cpu", eviction="lru").resolve is RESOLVERS["lru"][0]
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'"):
        get_ops("cpu", eviction="fifo")


@pytest.mark.parametrize("kv_host_dtype", ["bf16", "fp8"])
def test_audit_dense_pass_through_the_triton_ops(monkeypatch, kv_host_dtype):
    """The audit's dense pass (:func:`engine.decode.audit.dense_pass`) through the Triton
    set — the gather of the rows' records into its staging buffer (fp8 records
    dequantised) and the paged dense attention over it — equals the reference set's, on
    two rows of the tiny synthetic model and a block table padded to a graph's width."""
    if CUDA:
        pytest.skip("the engine's CUDA audit tests cover it there (tests/engine/test_audit.py)")
    import engine.decode.audit as fidelity
    from engine import events as ev
    from engine.config import SamplingParams
    from engine.load import load_engine

    seen = {}
    dense_pass = fidelity.dense_pass

    def spy(*args):
        seen["args"] = args
        return dense_pass(*args)

    monkeypatch.setattr(fidelity, "dense_pass", spy)
    config = EngineConfig(
        host_pool_gb=0.25, max_batch=2, page_size=16, top_k=48, sink_tokens=16,
        local_window=16, device_buffer=96, prefill_chunk=128, tokenizer="ids",
        audit_steps=1, kv_host_dtype=kv_host_dtype,
    )  # fmt: skip
    eng = load_engine(config, "synthetic:tiny")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 40000, (n,), generator=gen).tolist() for n in (300, 181)]
    params = SamplingParams(max_tokens=2)
    reqs = [eng.open_request(ev.Job(f"j{i}", tuple(p), params)) for i, p in enumerate(prompts)]
    for r in reqs:
        eng.prefill(r)
        r.audit_at = frozenset({1})
    eng.read_step(eng.launch_step(reqs))
    model, cache, ref_ops, tokens, lens, table, captured = seen["args"]
    wide = torch.full((table.shape[0], 64), -1, dtype=torch.int32)
    wide[:, : table.shape[1]] = table
    ref = dense_pass(model, cache, ref_ops, tokens, lens, wide, captured)
    got = dense_pass(model, cache, get_ops("cpu", use_triton=True), tokens, lens, wide, captured)
    torch.testing.assert_close(got[0], ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], ref[1], atol=1e-6, rtol=1e-5)
    assert 0.0 < float(ref[1].min()) and float(ref[1].max()) < 1.0
