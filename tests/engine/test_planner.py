"""Capacity planner: the brief's sanity figures, bounds, refusals and the CLI."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import typer
from typer.testing import CliRunner

from engine.capacity.planner import (
    GIB,
    Hardware,
    activation_bytes,
    admit,
    device_reserve_bytes,
    job_device_bytes,
    job_host_bytes,
    max_concurrent_jobs,
    parse_context,
    plan,
    shared_device_bytes,
    weight_bytes,
)
from engine.capacity.shapes import MODEL_SHAPES, get_model_shape
from engine.config import ConfigError, EngineConfig, ModelConfig, SamplingParams
from engine.presets import load_preset_full, resolve_config
from hisparse_cli.presets_cmd import register

K256 = 256 * 1024
LLAMA13 = MODEL_SHAPES["llama2-13b-gqa8"]  # the article's 13B: 8 KV heads


def _preset(name: str, **overrides):
    p = load_preset_full(name)
    return resolve_config(p, {}, overrides), p.hardware


def test_llama2_13b_shape_has_the_published_40_kv_heads():
    """meta-llama/Llama-2-13b-hf is multi-head: 40 KV heads, 200 GiB of bf16 KV per 256K
    job; the 8-KV-head variant has its own name."""
    config = EngineConfig(kv_dtype="bfloat16", page_size=64)
    real = get_model_shape("Llama-2-13b-hf")
    assert real is MODEL_SHAPES["llama2-13b"]
    assert (real.num_heads, real.num_kv_heads) == (40, 40)
    assert job_host_bytes(real, config, K256) == 200 * GIB
    assert get_model_shape("llama2-13b-gqa8").num_kv_heads == 8


def test_256k_kv_of_llama2_13b_gqa8_shape_is_40_gib():
    config = EngineConfig(kv_dtype="bfloat16", page_size=64)
    assert job_host_bytes(LLAMA13, config, K256) == 40 * 8 * 128 * 2 * 2 * K256
    assert job_host_bytes(LLAMA13, config, K256) == 42_949_672_960 == 40 * GIB


def test_256k_kv_of_qwen25_7b_is_14_gib():
    config = EngineConfig(kv_dtype="bfloat16", page_size=64)
    assert job_host_bytes(MODEL_SHAPES["qwen2.5-7b"], config, K256) == 14 * GIB


def test_host_kv_rounds_up_to_whole_pages():
    config = EngineConfig(kv_dtype="bfloat16", page_size=64)
    per_token = 40 * 8 * 128 * 2 * 2
    assert job_host_bytes(LLAMA13, config, 65) == 128 * per_token


def test_float_weights_match_published_parameter_counts():
    config = EngineConfig(weight_format="float", dtype="float32")
    assert weight_bytes(MODEL_SHAPES["smollm2-135m"], config) == 134_515_008 * 4
    assert weight_bytes(MODEL_SHAPES["llama3.1-8b"], config) == 8_030_261_248 * 4
    assert weight_bytes(MODEL_SHAPES["qwen2.5-7b"], config) == 7_615_616_512 * 4


def test_int4_weights_keep_embeddings_and_head_in_bf16():
    """On a CPU an int4 linear holds its source blocks (0.5 B/param + a float32 scale and
    offset a group, for the prefill's dense GEMM) and torch's packed copy (0.5 B/param + a
    bf16 scale and zero a group, for decode); the embedding and head stay in the dtype.
    ``test_plan_counts_the_weights_a_cpu_load_places`` measures it against a load."""
    config = EngineConfig(weight_format="int4", dtype="bfloat16", device="cpu")
    vocab_bytes = 2 * 32000 * 5120 * 2  # embedding + lm_head, untied, bf16
    linear = 40 * (5120 * 5120 * 2 + 5120 * 1024 * 2 + 3 * 5120 * 13824)
    norms = (40 * 2 + 1) * 5120 * 4  # RMSNorm weights are placed in float32
    source = linear // 2 + linear // 128 * 8
    packed = linear // 2 + linear // 128 * 4
    expected = source + packed + vocab_bytes + norms
    assert weight_bytes(LLAMA13, config) == expected
    assert 11.5 * GIB < expected < 12 * GIB


@pytest.mark.parametrize("fast", [True, False], ids=["bf16-cpu", "avx2-cpu"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("stored", ["Q4_1", "F32"])
@pytest.mark.parametrize("weight_format", ["auto", "int4", "float"])
def test_plan_places_weights_by_the_loaders_rule(monkeypatch, fast, device, stored, weight_format):
    """The plan's weight format is the loader's (``engine.load.pick_weight_format``) for
    every device, CPU answer to "bf16 instructions?" and storage of the linears: ``auto``
    is int4 on CUDA, and on a CPU only with bf16 instructions and linears stored 4-bit
    (the embedded model's Q4_1). Before, a CPU plan counted ``auto`` as float always:
    0.50 GiB of weights for the embedded model where run placed 0.24 (int4)."""
    import torch

    import engine.weights.placement as placement
    import engine.weights.quant as quant
    from engine.capacity.planner import weight_format as planned
    from engine.load import pick_weight_format

    monkeypatch.setattr(quant, "cpu_fast_bf16", lambda: fast)
    monkeypatch.setattr(placement, "cpu_fast_bf16", lambda: fast)
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    formats = {f"blk.{i}.{n}.weight": stored for i in range(30) for n in names}
    shape = dataclasses.replace(MODEL_SHAPES["smollm2-135m"], int4_linears=stored == "Q4_1")
    config = EngineConfig(device=device, weight_format=weight_format)
    loads = pick_weight_format(config, torch.device(device), formats)
    assert planned(config, shape) == loads
    if weight_format == "auto":
        assert loads == ("int4" if device == "cuda" or (fast and stored == "Q4_1") else "float")


def _placed(monkeypatch, fast: bool, config: EngineConfig, model: str = "synthetic:tiny"):
    """``(shape, PlacedModel)``: ``model`` placed by ``engine.load.place_model`` with the CPU's
    bf16 answer patched to ``fast`` where the loader and the planner read it; the tiny
    synthetic model's 4-bit linears are named as a Q4_1 GGUF's, and its shape says so."""
    import engine.weights.placement as placement
    import engine.weights.quant as quant
    from engine.load import load_weights, place_model
    from engine.weights.synthetic import GROUP_SIZE

    monkeypatch.setattr(quant, "cpu_fast_bf16", lambda: fast)
    monkeypatch.setattr(placement, "cpu_fast_bf16", lambda: fast)
    monkeypatch.setattr(quant, "_LM_HEAD_CHOICES", {})  # the record decides, as in a new run
    if model.startswith("synthetic:"):
        weights, tokenizer, name = load_weights(model, "ids")
        n = weights.config.num_layers
        names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
        q4 = {f"blk.{i}.{x}.weight": "Q4_1" for i in range(n) for x in names}
        weights = dataclasses.replace(weights, formats={**q4, "token_embd.weight": "F32"})
        shape = dataclasses.replace(weights.config, int4_group_size=GROUP_SIZE, int4_linears=True)
        config = config.replace(tokenizer="ids")
    else:
        weights, tokenizer, name = load_weights(model)
        shape = get_model_shape(model)
    return shape, place_model(config, weights=(weights, tokenizer, name))


@pytest.mark.parametrize("fast", [True, False], ids=["bf16-cpu", "avx2-cpu"])
@pytest.mark.parametrize("weight_format", ["auto", "int4", "float"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plan_counts_the_weights_a_cpu_load_places(
    monkeypatch, tmp_path, fast, weight_format, dtype
):
    """The plan's weights are the bytes ``place_model`` puts on a CPU, for each weight
    format and either answer to "bf16 instructions?": ``auto`` is int4 only there and
    with 4-bit linears (the loader's rule, one function); an int4 linear keeps its source
    blocks and torch's packed copy (scales in bf16 where the products are); norms stay
    float32. Before, a CPU plan counted ``auto`` as float (0.50 GiB for the embedded
    model where run placed 0.24) and int4 linears as the packed copy alone. Before the
    first load has measured the CPU LM head, the plan counts its fp16 copy: never fewer
    bytes than the load places."""
    from engine.capacity.planner import weight_format as planned_format
    from engine.weights.synthetic import GROUP_SIZE, synthetic_shape

    monkeypatch.setenv("HISPARSE_CACHE_DIR", str(tmp_path))  # no head measured yet
    monkeypatch.setattr("engine.weights.placement.cpu_fast_bf16", lambda: fast)
    config = EngineConfig(device="cpu", dtype=dtype, weight_format=weight_format)
    tiny = synthetic_shape("tiny")
    tiny = dataclasses.replace(tiny, int4_group_size=GROUP_SIZE, int4_linears=True)
    before = weight_bytes(tiny, config)
    shape, placed = _placed(monkeypatch, fast, config)
    int4 = weight_format == "int4" or (weight_format == "auto" and fast)
    assert placed.weight_format == planned_format(config, shape) == ("int4" if int4 else "float")
    assert weight_bytes(shape, config) == placed.model.weight_bytes
    assert before >= placed.model.weight_bytes


@pytest.mark.parametrize("fp16", [True, False])
def test_plan_counts_the_cpu_fp16_head_this_machine_recorded(monkeypatch, tmp_path, fp16):
    """int4 linears with bf16 products over a float32 model: the load keeps an fp16 copy
    of the tied head where this machine measured it faster (its record), and the plan
    counts it (``V x H x 2``) exactly where the record says so."""
    import engine.weights.quant as quant

    monkeypatch.setenv("HISPARSE_CACHE_DIR", str(tmp_path))
    quant._write_lm_head_record(quant._lm_head_key((49152, 128)), {"fp16": fp16, "note": ""})
    config = EngineConfig(device="cpu", dtype="float32")
    shape, placed = _placed(monkeypatch, True, config)
    assert placed.weight_format == "int4"
    assert isinstance(placed.model.lm_head, quant.CastLinear) == fp16
    planned = weight_bytes(shape, config)
    assert planned == placed.model.weight_bytes
    quant._write_lm_head_record(quant._lm_head_key((49152, 128)), {"fp16": not fp16, "note": ""})
    copy = 49152 * 128 * 2
    assert weight_bytes(shape, config) == planned + (-copy if fp16 else copy)


def test_plan_of_the_embedded_model_counts_what_run_places(
    monkeypatch, tmp_path, smollm2_gguf_path
):
    """The new user's CPU box: ``hisparse plan`` (the ``smollm2-135m`` shape, or the GGUF
    file) counts the embedded model's weights as ``hisparse run`` places them, int4 on a
    CPU with bf16 instructions (0.24 GiB with a float32 head), float32 elsewhere (0.50)."""
    import engine.weights.quant as quant

    monkeypatch.setenv("HISPARSE_CACHE_DIR", str(tmp_path))  # this test's head record
    quant._write_lm_head_record(quant._lm_head_key((49152, 576)), {"fp16": False, "note": ""})
    for fast, gib in ((True, 0.24), (False, 0.50)):
        config = EngineConfig(device="cpu", dtype="float32")
        shape, placed = _placed(monkeypatch, fast, config, str(smollm2_gguf_path))
        assert placed.model.weight_bytes / GIB == pytest.approx(gib, abs=0.005)
        assert weight_bytes(shape, config) == placed.model.weight_bytes
        assert weight_bytes(MODEL_SHAPES["smollm2-135m"], config) == placed.model.weight_bytes


def test_int4_weights_on_cuda_count_tinygemm_copy_only_when_kept():
    """On CUDA the Triton kernels read the source blocks (0.5 B/param + 8 B a group);
    tinygemm's packed copy is counted only with ``int4_triton_min_rows`` above 1."""
    base = EngineConfig(weight_format="int4", dtype="bfloat16", device="cuda")
    vocab_bytes = 2 * 32000 * 5120 * 2
    linear = 40 * (5120 * 5120 * 2 + 5120 * 1024 * 2 + 3 * 5120 * 13824)
    norms = (40 * 2 + 1) * 5120 * 4  # RMSNorm weights are placed in float32
    source = linear // 2 + linear // 128 * 8
    packed = linear // 2 + linear // 128 * 4
    assert weight_bytes(LLAMA13, base) == source + vocab_bytes + norms
    both = base.replace(int4_triton_min_rows=8)
    assert weight_bytes(LLAMA13, both) == source + packed + vocab_bytes + norms
    # the presets: both copies where memory is plentiful, one on the 24 GB cards
    assert _preset("h200")[0].int4_triton_min_rows == 8
    assert _preset("dual4090-24")[0].int4_triton_min_rows == 1


def test_job_device_bytes_is_a_whole_slab_and_its_tables():
    """A hierarchical job claims one slab of device_buffer slots per (layer, KV head) with
    its page table and LRU state; the page metadata belongs to the host pool's pages."""
    config, _ = _preset("dual4090")
    assert (config.page_size, config.device_buffer_tokens) == (16, 8192)
    slots = 8192 // 16  # 512 records of 16 tokens
    slabs = 40 * 8 * slots * 16 * 128 * 2 * 2
    tables = 40 * 8 * (K256 // 16) * 4  # page table: int32 per page, 16384 pages
    lru = 40 * 8 * slots * (4 + 8)  # slot page int32 + last use int64
    assert job_device_bytes(LLAMA13, config, K256) == slabs + tables + lru
    page_bytes = 40 * 8 * 16 * 128 * 2 * 2  # one pool page: L x Hkv x record, 2.5 MiB
    pool_pages = int(336 * GIB) // page_bytes
    meta_page = 40 * 8 * 2 * 128 * 2  # min and max of each key dim, per (layer, KV head)
    metadata = pool_pages * meta_page
    assert shared_device_bytes(LLAMA13, config, pool_pages) == metadata
    # 1/16 of the pool on the device: 21 GiB for 336 GiB (to within the last, partial page)
    assert 0 <= 21 * GIB - metadata < meta_page
    staging = 40 * config.max_batch * 8 * 2 * 128 * 2  # decode write-through rows
    late = config.replace(decode_write_stream=True)
    assert shared_device_bytes(LLAMA13, late, pool_pages) == metadata + staging


def test_short_job_claims_a_whole_slab_as_the_cache_does():
    """The cache reserves a full slab per KV head for any job, so the planner does too
    (only its page table is shorter)."""
    config, _ = _preset("dual4090")
    long_job = job_device_bytes(LLAMA13, config, K256)
    short_job = job_device_bytes(LLAMA13, config, 1000)
    # 16-token pages: 16384 page-table entries against ceil(1000 / 16) = 63
    assert long_job - short_job == 40 * 8 * (K256 // 16 - 63) * 4


def test_dual4090_8x256k_13b_fits_and_host_memory_binds():
    config, hardware = _preset("dual4090")
    result = plan(LLAMA13, config, hardware, 8, K256)
    assert result.feasible, result.reasons
    # the pool holds 8 x 40 GiB and the slab pools max_batch = 8 jobs (4 per card): both
    # bind (a fresh user read "device memory allows 8" beside 18 GiB free per card)
    assert result.capacity.binding == "max_batch+host"
    assert result.capacity.max_jobs == result.capacity.host_limit == 8
    assert result.capacity.device_limit == 8
    assert [d.num_jobs for d in result.devices] == [4, 4]
    assert result.host_needed_bytes == 320 * GIB
    assert all(d.free_bytes > 0 for d in result.devices)
    # each card's cache holds the page metadata of its 168 GiB pool share: 168 / 16 GiB
    meta_page = 40 * 8 * 2 * 128 * 2
    assert all(0 <= 10.5 * GIB - d.metadata_bytes < meta_page for d in result.devices)


def test_h200_qwen_256k_fits_at_16_token_pages_and_host_memory_binds():
    """qwen2.5-7b at 256K on one H200: 14 GiB of KV per job, the 96 GiB pool holds 6; the
    pool's metadata (96 / 16 = 6 GiB) and 6 slabs fit beside the weights with room."""
    config, hardware = _preset("h200")
    shape = MODEL_SHAPES["qwen2.5-7b"]
    result = plan(shape, config, hardware, 6, K256)
    assert result.feasible, result.reasons
    assert result.capacity.binding == "host" and result.capacity.max_jobs == 6
    assert result.capacity.device_limit == config.max_batch == 16
    [device] = result.devices
    meta_page = 28 * 4 * 2 * 128 * 2
    assert 0 <= 6 * GIB - device.metadata_bytes < meta_page
    assert device.free_bytes > 100 * GIB


def test_dual4090_24_fits_six_128k_8b_jobs_and_host_memory_binds():
    config, hardware = _preset("dual4090-24")
    llama8 = MODEL_SHAPES["llama3.1-8b"]
    result = plan(llama8, config, hardware, 6, 128 * 1024)
    assert result.feasible, result.reasons
    assert result.capacity.binding == "host" and result.capacity.max_jobs == 6
    assert [d.num_jobs for d in result.devices] == [3, 3]
    assert all(d.free_bytes > 0 for d in result.devices)
    assert result.host_pool_bytes <= result.host_usable_bytes
    assert not plan(llama8, config, hardware, 7, 128 * 1024).feasible  # 7 x 16 GiB > 96 GiB


def test_cli_plan_dual4090_24_refuses_eight_128k_jobs_naming_the_fix():
    args = ("plan", "-p", "dual4090-24", "-m", "llama3.1-8b", "-n", "8", "-c", "128K")
    result = _invoke(*args)
    assert result.exit_code == 2 and "--jobs 6" in result.output


def test_dense_baseline_cannot_hold_one_256k_13b_job_in_48gb():
    config, hardware = _preset("dual4090")
    result = plan(LLAMA13, config, hardware, 8, K256)
    assert result.dense.max_jobs == 0
    # KV + its metadata: 2 x D of min/max per page of 2 x 16 x D records, 1/16 of the KV
    assert result.dense_job_device_bytes == 40 * GIB + 40 * GIB // 16
    # the same on an H200 capped to 48 GiB
    config, hardware = _preset("h200", memory_budget_gb=48.0)
    assert plan(LLAMA13, config, hardware, 1, K256).dense.max_jobs == 0


def test_nine_jobs_on_dual4090_are_refused_with_nearest_setting():
    config, hardware = _preset("dual4090")
    result = plan(LLAMA13, config, hardware, 9, K256)
    assert not result.feasible
    assert any(r.startswith("host:") for r in result.reasons)
    assert "fewer jobs: --jobs 8" in result.suggestions
    # each card's worker holds half the pool and runs 5 of the 9 jobs: 2 x 5 x 40 GiB
    # (360, the jobs' total, was offered before and refused when followed)
    [pool] = [s for s in result.suggestions if "--host-pool" in s]
    assert "--host-pool 400" in pool
    assert _replan(LLAMA13, config, hardware, 9, K256, pool).feasible


def test_host_bound_cpu_plan_offers_fp8_pages_and_how_run_takes_kv_dtype():
    """A host-bound plan on the cpu preset (float32 KV, bf16 host pages) offers fp8 host
    pages (a run flag) first, and the bfloat16 KV hint says how `hisparse run` takes it
    (no run flag: a preset's or manifest's engine setting)."""
    config, hardware = _preset("cpu")
    # 10 x 32K: 14 GiB of float32 KV for the 8 GiB pool; 3.5 in fp8, 7 in bfloat16
    result = plan(get_model_shape("smollm2-135m"), config, hardware, 10, 32 * 1024)
    assert not result.feasible
    [fp8] = [s for s in result.suggestions if "--kv-host-dtype fp8" in s]
    assert fp8.startswith("a quarter of the host KV bytes")
    [kv] = [s for s in result.suggestions if "--kv-dtype bfloat16" in s]
    assert "kv_dtype: bfloat16" in kv and "engine:" in kv


def test_memory_budget_caps_each_device():
    config, hardware = _preset("h200", memory_budget_gb=48.0)
    result = plan(LLAMA13, config, hardware, 1, K256)
    assert all(d.capacity_bytes == 48 * GIB for d in result.devices)
    assert result.config.memory_budget_gb == 48.0


def test_cpu_reserve_is_five_percent_without_the_cuda_floor():
    """The 1 GiB floor is for what a CUDA process holds outside its tensors (context,
    workspaces, caching allocator); a CPU's working memory keeps 5 % for heap slack, so a
    small budget is not all reserve: the embedded model's 8K job plans in 1 GiB on the cpu
    preset (the floor took the whole GiB before)."""
    assert device_reserve_bytes(GIB // 2, "cpu") == int(GIB // 2 * 0.05)
    assert device_reserve_bytes(GIB // 2, "cuda:0") == GIB // 2  # the floor, capped
    assert device_reserve_bytes(8 * GIB, "cuda") == GIB
    assert device_reserve_bytes(40 * GIB, "cuda") == 2 * GIB
    assert device_reserve_bytes(40 * GIB, "cpu") == 2 * GIB
    config, hardware = _preset("cpu", memory_budget_gb=1.0, host_pool_gb=1.0)
    result = plan(MODEL_SHAPES["smollm2-135m"], config, hardware, 1, 8192)
    assert result.feasible, result.reasons
    assert result.devices[0].reserve_bytes == int(GIB * 0.05)
    assert plan(
        MODEL_SHAPES["smollm2-135m"], config.replace(device="cuda"), hardware, 1, 8192
    ).reasons


_HINT_FIELDS = {
    "--device-buffer": ("device_buffer", int),
    "--top-k-tokens": ("top_k", int),
    "--page-size": ("page_size", int),
    "--host-pool": ("host_pool_gb", float),
    "--memory-budget": ("memory_budget_gb", float),
    "--max-batch": ("max_batch", int),
    "weight_format": ("weight_format", str),
    "--kv-host-dtype": ("kv_host_dtype", str),
    "--kv-dtype": ("kv_dtype", str),
}


def _hint_flags(hint: str) -> dict[str, str]:
    """``"label: --a 1 --b 2 (why)"`` -> ``{"--a": "1", "--b": "2"}``."""
    words = hint.split(": ", 1)[1].split(" (")[0].replace(",", " ").split()
    assert len(words) % 2 == 0, hint
    return dict(zip(words[::2], words[1::2], strict=True))


def _replan(shape, config, hardware, jobs, context, hint):
    """The plan with every setting ``hint`` names applied."""
    changes = {}
    flags = _hint_flags(hint) if "kv_dtype bfloat16" not in hint else {"--kv-dtype": "bfloat16"}
    for flag, value in flags.items():
        if flag == "--parallel":
            hardware = hardware.replace(parallel=value)
        elif flag == "--context":
            context = parse_context(value)
        elif flag == "--jobs":
            jobs = int(value)
        elif flag == "--host-memory":
            hardware = hardware.replace(host_memory_gb=float(value))
        else:
            name, kind = _HINT_FIELDS[flag]
            changes[name] = kind(value)
    return plan(shape, config.replace(**changes), hardware, jobs, context)


@pytest.mark.parametrize(
    "budget,host_pool,pool_flag",
    [(0.5, 8.0, None), (0.7, 8.0, None), (0.1, 0.01, "1")],
    ids=["weights", "metadata", "pool-too-small"],
)
def test_a_budget_too_small_suggests_the_smallest_that_fits(budget, host_pool, pool_flag):
    """``--memory-budget`` below the device's memory binds: the plan offers the smallest
    budget (0.01 GiB steps) with which the jobs fit, whether the weights or the page
    metadata took it (with the pool raised to the jobs' need where it holds fewer); one
    step less does not fit. Before, a new user's CPU plan under 0.5 GiB offered nothing
    that kept the weights and every other setting."""
    config, hardware = _preset("cpu", memory_budget_gb=budget, host_pool_gb=host_pool)
    shape = MODEL_SHAPES["smollm2-135m"]
    result = plan(shape, config, hardware, 1, 8192)
    assert not result.feasible
    [hint] = [s for s in result.suggestions if s.startswith("a larger budget")]
    flags = _hint_flags(hint)
    assert flags.get("--host-pool") == pool_flag
    fixed = _replan(shape, config, hardware, 1, 8192, hint)
    assert fixed.feasible, (hint, fixed.reasons)
    less = round(float(flags["--memory-budget"]) - 0.01, 2)
    assert not plan(shape, fixed.config.replace(memory_budget_gb=less), hardware, 1, 8192).feasible


def test_device_bound_suggests_a_smaller_buffer_that_fits():
    """Slabs bind: the hint is the largest hot buffer at the same page size with which the
    jobs fit (re-planned with every flag it names)."""
    config, hardware = _preset("h200", memory_budget_gb=16.0, host_pool_gb=40.0)
    hardware = hardware.replace(host_memory_gb=1024)
    shape = MODEL_SHAPES["qwen2.5-7b"]
    capacity = max_concurrent_jobs(shape, config, hardware, 32 * 1024)
    assert capacity.device_limit >= 1
    jobs = capacity.device_limit + 2
    result = plan(shape, config, hardware, jobs, 32 * 1024)
    assert result.capacity.binding == "device"
    assert not result.feasible
    [hint] = [s for s in result.suggestions if s.startswith("smaller hot buffer")]
    flags = _hint_flags(hint)
    assert set(flags) == {"--device-buffer", "--top-k-tokens"}  # the page size stays 16
    buffer = int(flags["--device-buffer"])
    top_k = int(flags["--top-k-tokens"])
    assert buffer < config.device_buffer_tokens and 2 * top_k <= buffer
    assert _replan(shape, config, hardware, jobs, 32 * 1024, hint).feasible
    # the largest that fits: one more page of buffer (same top_k) does not
    bigger = config.replace(device_buffer=buffer + 16, top_k=top_k)
    assert not plan(shape, bigger, hardware, jobs, 32 * 1024).feasible
    # every device hint offered fits when applied
    for other in result.suggestions:
        if other.startswith(("smaller", "larger pages")):
            assert _replan(shape, config, hardware, jobs, 32 * 1024, other).feasible, other


def test_device_hints_past_max_batch_raise_it():
    """More jobs than ``max_batch`` (the issue-16 point: 32 x 128K of SmolLM2 in 8 GiB on
    the h200 preset, whose max_batch is 16): the device limit is capped below the jobs
    whatever the memory, so every device hint also raises max_batch, and each fits when
    applied with every flag it names. Before, only "fewer jobs" was offered."""
    config, hardware = _preset("h200", memory_budget_gb=8.0)
    shape = MODEL_SHAPES["smollm2-135m"]
    assert config.max_batch == 16
    result = plan(shape, config, hardware, 32, 128 * 1024)
    assert not result.feasible
    device = [s for s in result.suggestions if s.startswith(("smaller", "larger pages"))]
    assert device, result.suggestions
    for hint in device:
        assert _hint_flags(hint)["--max-batch"] == "32", hint
        assert _replan(shape, config, hardware, 32, 128 * 1024, hint).feasible, hint
    assert "fewer jobs: --jobs 5" in result.suggestions


def test_metadata_bound_suggests_the_host_pool_the_jobs_need():
    """At 16-token pages the device holds min/max of every host pool page, 1/16 of the
    pool: a 100 GiB pool's 6.25 GiB leave a 16 GiB card no room for one slab, which no
    smaller buffer fixes. The hint cuts the pool to what the jobs need, keeping the page
    size, and the plan with it fits."""
    config, hardware = _preset("h200", memory_budget_gb=16.0, host_pool_gb=100.0)
    hardware = hardware.replace(host_memory_gb=1024)
    shape = MODEL_SHAPES["qwen2.5-7b"]
    result = plan(shape, config, hardware, 2, 32 * 1024)
    assert not result.feasible and result.capacity.device_limit == 0
    assert "page metadata of the host pool alone is 6.25 GiB" in result.reasons[0]
    assert "memory holds 0 job(s)" in result.reasons[0]
    [hint] = [s for s in result.suggestions if s.startswith("smaller host pool")]
    # 2 jobs x 32K x 28 layers x 4 KV heads x 128 x 2 x 2 B = 3.5 GiB -> a 4 GiB pool
    assert _hint_flags(hint) == {"--host-pool": "4"}
    assert not any("--page-size" in s for s in result.suggestions)
    fixed = _replan(shape, config, hardware, 2, 32 * 1024, hint)
    assert fixed.feasible and fixed.capacity.host_limit >= 2
    # the same through the CLI: refused, then run again with the hint's flags
    args = ("plan", "-p", "h200", "-m", "qwen2.5-7b", "-n", "2", "-c", "32K",
            "--memory-budget", "16", "--host-memory", "1024")  # fmt: skip
    refused = _invoke(*args, "--host-pool", "100")
    assert refused.exit_code == 2 and "smaller host pool: --host-pool 4" in refused.output
    assert _invoke(*args, "--host-pool", "4").exit_code == 0


def test_larger_pages_are_offered_last_with_their_cost():
    """When nothing at 16-token pages fits (here 24 jobs of 32K on a 14 GiB card: even the
    pool cut to their 42 GiB carries 2.6 GiB of metadata), larger pages come as the last
    hint, naming the fidelity cost, and fit when applied with every flag they name."""
    config, hardware = _preset(
        "h200", memory_budget_gb=14.0, host_pool_gb=200.0, max_batch=64
    )
    hardware = hardware.replace(host_memory_gb=1024)
    shape = MODEL_SHAPES["qwen2.5-7b"]
    result = plan(shape, config, hardware, 24, 32 * 1024)
    assert not result.feasible
    assert not any(s.startswith("smaller") for s in result.suggestions)
    [hint] = [s for s in result.suggestions if s.startswith("larger pages")]
    assert "looser selection" in hint
    flags = _hint_flags(hint)
    assert int(flags["--page-size"]) > 16 and float(flags["--host-pool"]) < 200
    assert _replan(shape, config, hardware, 24, 32 * 1024, hint).feasible


@pytest.mark.parametrize(
    ("preset", "model", "jobs", "context", "changes"),
    [
        ("cpu", "smollm2-135m", 1, 99_999_999 * 1024, {}),
        ("cpu", "smollm2-135m", 1, 1024 * 1024, {}),
        ("cpu", "smollm2-135m", 100, 32 * 1024, {}),
        ("cpu", "smollm2-135m", 2, 64 * 1024, {"max_batch": 1, "host_pool_gb": 1.0}),
        ("dual4090", "llama2-13b-gqa8", 12, K256, {}),
        ("dual4090", "llama2-13b-gqa8", 40, 128 * 1024, {"max_batch": 64}),
        ("dual4090", "llama2-13b-gqa8", 1, 2048 * 1024, {}),
        ("dual4090-24", "llama3.1-8b", 1, 512 * 1024, {}),
        ("dual4090-24", "llama3.1-8b", 4, 512 * 1024, {}),
        ("h200", "llama3.1-8b", 64, 1024 * 1024, {}),
    ],
)
def test_every_hint_a_fresh_user_followed_is_accepted(preset, model, jobs, context, changes):
    """A fresh user followed each "nearest feasible" hint exactly, and many were refused
    again: a shorter context the host still could not hold, a bigger pool below the one
    already set (the pool is split per data worker), more decode slots where the host
    bound too, a host memory past what any flag takes. Every hint is now re-planned in
    full, with ``--jobs N`` where it runs only N."""
    config, hardware = _preset(preset)
    config = config.replace(**changes)
    shape = get_model_shape(model)
    result = plan(shape, config, hardware, jobs, context)
    assert not result.feasible and result.suggestions
    for hint in result.suggestions:
        assert _replan(shape, config, hardware, jobs, context, hint).feasible, hint


def test_io_estimate_counts_the_jobs_that_decode_at_once_and_none_on_direct_reads():
    dual, hw = _preset("dual4090")
    eight, twelve = (plan(LLAMA13, dual, hw, n, K256) for n in (8, 12))
    assert dual.max_batch == 8 and twelve.gather_bytes_per_step == eight.gather_bytes_per_step > 0
    config, hardware = _preset("cpu")
    assert config.cpu_direct_reads
    shape = get_model_shape("smollm2-135m")
    assert plan(shape, config, hardware, 2, 128 * 1024).gather_bytes_per_step == 0
    copied = config.replace(cpu_direct_reads=False)
    assert plan(shape, copied, hardware, 2, 128 * 1024).gather_bytes_per_step > 0


def test_larger_host_pool_hint_says_what_its_metadata_costs():
    """A host pool grown for more jobs grows its page metadata on the device too
    (1/16 of the pool). 4 x 512K of llama3.1-8b on the 24 GB cards need 256 GiB of pool,
    whose metadata leaves room for 2 jobs: the hint says so, with --jobs 2. 8 x 256K of the 40-KV-head
    llama2-13b need 1600 GiB, whose 800 / 16 = 50 GiB of metadata per card exceed a 48 GB
    card: no job would run, so that pool is not offered (a fresh user followed such a
    hint into another refusal)."""
    small, hw24 = _preset("dual4090-24")
    result = plan(MODEL_SHAPES["llama3.1-8b"], small, hw24, 4, 512 * 1024)
    [hint] = [s for s in result.suggestions if "--host-pool 256" in s]
    assert "--jobs 2" in hint and "leaves room for 2 job(s)" in hint
    config, hardware = _preset("dual4090")
    result = plan(MODEL_SHAPES["llama2-13b"], config, hardware, 8, K256)
    assert not [s for s in result.suggestions if "--host-pool 1600" in s], result.suggestions
    bigger = config.replace(host_pool_gb=1600.0)
    hw = hardware.replace(host_memory_gb=2000)
    assert max_concurrent_jobs(MODEL_SHAPES["llama2-13b"], bigger, hw, K256).device_limit == 0


def test_pipeline_splits_layers_and_adds_comm_buffers():
    config, hardware = _preset("dual4090")
    data = plan(LLAMA13, config, hardware, 8, K256)
    pipe = plan(LLAMA13, config, hardware.replace(parallel="pipeline"), 8, K256)
    assert [d.layers for d in pipe.devices] == [(0, 20), (20, 40)]
    assert [d.num_jobs for d in pipe.devices] == [8, 8]
    assert all(d.comm_bytes > 0 for d in pipe.devices)
    assert all(d.comm_bytes == 0 for d in data.devices)
    split = sum(d.weights_bytes for d in pipe.devices)
    assert split == data.devices[0].weights_bytes
    assert (
        pipe.devices[0].kv_slab_bytes == data.devices[0].kv_slab_bytes
    )  # 8 x 20 = 4 x 40


def test_all_resident_config_has_no_host_tier():
    config = EngineConfig(attention="dense", kv_dtype="bfloat16")
    assert job_host_bytes(LLAMA13, config, K256) == 0
    assert job_device_bytes(LLAMA13, config, K256) == 40 * GIB + 40 * GIB // 16  # + metadata
    hardware = Hardware(devices=("cuda:0",), memory_gb=48)
    assert max_concurrent_jobs(LLAMA13, config, hardware, K256).host_limit is None


def test_admit_reports_which_pool_is_short():
    config, _ = _preset("dual4090")
    need_dev = job_device_bytes(LLAMA13, config, K256)
    assert (
        admit(
            LLAMA13, config, K256, device_free_bytes=need_dev, host_free_bytes=40 * GIB
        )
        is None
    )
    assert "host pool" in admit(
        LLAMA13, config, K256, device_free_bytes=need_dev, host_free_bytes=39 * GIB
    )
    assert "on device" in admit(
        LLAMA13, config, K256, device_free_bytes=need_dev - 1, host_free_bytes=40 * GIB
    )


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("256K", 262144),
        ("128k", 131072),
        ("32768", 32768),
        ("1M", 1048576),
        (" 8K ", 8192),
    ],
)
def test_parse_context(text, tokens):
    assert parse_context(text) == tokens


@pytest.mark.parametrize("text", ["", "0", "12G", "-5", "1.5K", "abc"])
def test_parse_context_rejects(text):
    with pytest.raises(ConfigError):
        parse_context(text)


def test_unknown_model_lists_known_shapes():
    with pytest.raises(ConfigError, match="unknown model 'gpt-5'.*llama2-13b"):
        get_model_shape("gpt-5")


def test_a_file_or_folder_that_is_not_a_model_is_named_so(tmp_path):
    """Fresh-user finding: a text file given as --model read "unknown model"."""
    with pytest.raises(ConfigError, match="model not found: "):
        get_model_shape(str(tmp_path / "missing.gguf"))
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(ConfigError, match="is not a regular file or a model folder"):
        get_model_shape(str(tmp_path / "pipe"))
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ConfigError, match="is a file but not a model: pass a .gguf file"):
        get_model_shape(str(tmp_path / "notes.txt"))
    with pytest.raises(ConfigError, match="has no config.json"):
        get_model_shape(str(tmp_path))


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"hidden_size": 8\n"x": 1}', "cannot read it as JSON: Expecting ',' delimiter"),
        ("[1, 2]", "a config.json is a JSON object, got list"),
        ('{"num_attention_heads": "x", "hidden_size": 8, "num_hidden_layers": 2}',
         "num_attention_heads: must be a positive integer, got 'x'"),
    ],
)
def test_a_bad_config_json_is_named_not_a_traceback(tmp_path, text, says):
    """Fresh-user finding: `plan --model FOLDER` with a malformed config.json ended in
    a JSONDecodeError / TypeError traceback (exit 1)."""
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError) as info:
        get_model_shape(str(tmp_path))
    assert str(info.value).startswith(f"{tmp_path / 'config.json'}: ") and says in str(info.value)


def test_model_from_hf_config_json(tmp_path):
    cfg = {
        "model_type": "llama",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = get_model_shape(str(tmp_path))
    assert (shape.head_dim, shape.num_kv_heads) == (128, 8)


SMOLLM2_CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
}


def _config_json(folder, text: str | None = None, **changes):
    """``folder/config.json``: SmolLM2's shape with ``changes`` (None deletes a key), or
    ``text`` as it is (JSON that ``json.dumps`` cannot write: 1e400)."""
    folder.mkdir(exist_ok=True)
    cfg = {k: v for k, v in (SMOLLM2_CONFIG | changes).items() if v is not None}
    (folder / "config.json").write_text(text if text is not None else json.dumps(cfg))
    return folder


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"num_hidden_layers": 0}, "num_hidden_layers: must be a positive integer, got 0"),
        ({"num_hidden_layers": -30}, "num_hidden_layers: must be a positive integer, got -30"),
        ({"num_hidden_layers": 30.5}, "num_hidden_layers: must be a positive integer, got 30.5"),
        ({"num_hidden_layers": True}, "num_hidden_layers: must be a positive integer, got true"),
        ({"num_key_value_heads": 0}, "num_key_value_heads: must be a positive integer, got 0"),
        ({"hidden_size": "576"}, "hidden_size: must be a positive integer, got '576'"),
        ({"vocab_size": [49152]}, "vocab_size: must be a positive integer, got [49152]"),
        ({"hidden_size": 10**30}, f"hidden_size: must be at most 262,144, got {10**30}"),
        ({"max_position_embeddings": 0},
         "max_position_embeddings: must be a positive integer, got 0"),
        ({"intermediate_size": None}, "intermediate_size: missing"),
        ({"num_key_value_heads": 4}, "num_key_value_heads: must divide num_attention_heads (9), got 4"),
        ({"hidden_size": 577},
         "hidden_size: must be a multiple of num_attention_heads (9) when head_dim is not "
         "given, got 577"),
        ({"head_dim": 63}, "head_dim: must be even (RoPE rotates pairs), got 63"),
        ({"hidden_size": 90, "num_attention_heads": 6, "num_key_value_heads": 2},
         "head_dim (hidden_size / num_attention_heads): must be even (RoPE rotates pairs), got 15"),
    ],
)  # fmt: skip
def test_a_config_json_shape_field_out_of_range_is_named(tmp_path, changes, says):
    """Fresh-user finding: `plan --model FOLDER` took 0 layers to a ZeroDivisionError,
    1e400 to an OverflowError, -30 layers to a plan of -0.35 GiB per job, and planned 0
    KV heads as 9, "576" as 576 and 30.5 layers as 30. Every shape field is a positive
    integer in range, and the heads divide; the message names the file and the field."""
    folder = _config_json(tmp_path / "model", **changes)
    with pytest.raises(ConfigError) as info:
        get_model_shape(str(folder))
    assert str(info.value) == f"{folder / 'config.json'}: {says}"


def test_every_shape_problem_of_a_config_json_is_named_at_once(tmp_path):
    text = json.dumps(SMOLLM2_CONFIG | {"num_hidden_layers": -30, "num_key_value_heads": 0})
    folder = _config_json(tmp_path, text.replace('"hidden_size": 576', '"hidden_size": 1e400'))
    with pytest.raises(ConfigError) as info:
        get_model_shape(str(folder))
    where = tmp_path / "config.json"
    assert str(info.value).splitlines() == [
        f"{where}: num_hidden_layers: must be a positive integer, got -30",
        f"{where}: hidden_size: must be a positive integer, got inf",
        f"{where}: num_key_value_heads: must be a positive integer, got 0",
    ]


def test_a_config_json_may_give_its_own_head_dim(tmp_path):
    """Gemma and Qwen3 give a head_dim other than hidden_size / heads (Qwen3-8B: 4096 /
    32 heads, head_dim 128; Gemma 2 2B: 2304 / 8, head_dim 256); absent KV heads are the
    query heads (multi-head attention)."""
    folder = _config_json(tmp_path, hidden_size=2304, num_attention_heads=8, head_dim=256,
                          num_key_value_heads=None)  # fmt: skip
    shape = get_model_shape(str(folder))
    assert (shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (
        2304, 8, 8, 256,
    )  # fmt: skip
    assert get_model_shape(str(_config_json(tmp_path))).head_dim == 64  # 576 / 9


def test_model_config_validate_checks_every_shape_field():
    """Shapes built in code (synthetic, bench) go through the same check."""
    shape = MODEL_SHAPES["smollm2-135m"]
    shape.validate()
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(shape, num_layers=0, num_kv_heads=2).validate()
    assert str(info.value).splitlines() == [
        "model 'smollm2-135m': num_layers: must be a positive integer, got 0",
        "model 'smollm2-135m': num_kv_heads: must divide num_heads (9), got 2",
    ]


# ----------------------------------------------------------------------------- CLI


def _app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def main() -> None:
        """hisparse"""

    register(app)
    return app


def _invoke(*args: str):
    return CliRunner().invoke(_app(), list(args), env={"COLUMNS": "160"})


def test_cli_plan_dual4090_8x256k():
    result = _invoke("plan", "--preset", "dual4090", "--jobs", "8", "--context", "256K")
    assert result.exit_code == 0, result.output
    assert "max_batch and host memory bind" in " ".join(result.output.split())
    assert "dense all-resident baseline: 0 job(s)" in result.output


def test_cli_plan_refuses_with_exit_2_and_nearest_setting():
    result = _invoke("plan", "-p", "dual4090", "-n", "9", "-c", "256K")
    assert result.exit_code == 2
    assert "refused" in result.output
    assert "--jobs 8" in result.output


def test_cli_plan_json_with_memory_budget():
    result = _invoke(
        "plan", "-p", "h200", "-m", "llama2-13b-gqa8", "-n", "2", "-c", "256k",
        "--memory-budget", "48", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["feasible"] is True
    assert data["devices"][0]["capacity_bytes"] == 48 * GIB
    assert data["capacity"]["binding"] == "host"


def test_cli_plan_sparse_budget_flag_is_named_as_in_run():
    base = ("plan", "-p", "h200", "-m", "llama2-13b-gqa8", "-n", "1", "-c", "32K", "--json")
    result = _invoke(*base, "--top-k-tokens", "1024", "--device-buffer", "2048")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["config"]["top_k"] == 1024
    help_text = _invoke("plan", "--help").output
    assert "--top-k-tokens" in help_text and "--top-k " not in help_text


def test_cli_plan_old_top_k_flag_says_what_to_use():
    result = _invoke("plan", "-p", "h200", "-n", "1", "-c", "32K", "--top-k", "1024")
    assert result.exit_code == 2
    assert "--top-k-tokens 1024" in result.output and "sampling filter" in result.output


@pytest.mark.parametrize(
    "flags",
    [
        ("--host-memory", "inf"),
        ("--host-memory", "nan"),
        ("--host-memory", "1e308"),
        ("--host-pool", "1e308"),
        ("--memory-budget", "1e308"),
    ],
)
def test_cli_plan_refuses_infinite_or_huge_memory(flags):
    """Fresh-user finding: these ended in OverflowError / ValueError tracebacks (exit 1):
    their byte counts are not finite integers."""
    result = _invoke("plan", "-n", "1", "-c", "8K", *flags)
    assert result.exit_code == 2, result.output
    assert "<= 1,000,000" in " ".join(result.output.split())


@pytest.mark.parametrize("value", ["0", "-30", "1e400", "30.5", '"30"'])
def test_cli_plan_refuses_a_bad_config_json_shape_with_exit_2(tmp_path, value):
    """Fresh-user finding: 0 layers ended in a ZeroDivisionError traceback (exit 1), 1e400
    in an OverflowError, -30 in a plan of negative GiB."""
    text = json.dumps(SMOLLM2_CONFIG).replace(": 30,", f": {value},")  # num_hidden_layers
    folder = _config_json(tmp_path / "model", text)
    result = _invoke("plan", "-p", "cpu", "-m", str(folder), "-n", "1", "-c", "8K")
    assert result.exit_code == 2, result.output
    shown = {"1e400": "inf", '"30"': "'30'"}.get(value, value)
    says = f"num_hidden_layers: must be a positive integer, got {shown}"
    assert f"error: {folder / 'config.json'}: {says}" in " ".join(result.output.split())
    assert "Traceback" not in result.output and "GiB" not in result.output


def test_cli_plan_names_a_context_as_tokens_not_jobs():
    """Fresh-user finding: `plan -c 177635` printed "max concurrent 177635 jobs: 1", which
    reads as a count of jobs."""
    result = _invoke("plan", "-p", "cpu", "-n", "1", "-c", "177635")
    out = " ".join(result.output.split())
    assert "1 x 177,635-token jobs of smollm2-135m on cpu" in out
    assert "max concurrent 177,635-token jobs: 1 (" in out
    assert "177635 jobs" not in out
    round_k = " ".join(_invoke("plan", "-p", "cpu", "-n", "1", "-c", "8K").output.split())
    assert "1 x 8K-token jobs of" in round_k and "max concurrent 8K-token jobs: " in round_k


def test_cli_plan_says_raise_max_batch_only_where_it_runs_more_of_the_jobs():
    """Fresh-user finding: "max_batch binds: raise --max-batch" came with 1 job of 16 that
    fit; the hint is for jobs beyond the decode slots (they wait their turn)."""
    one = " ".join(_invoke("plan", "-p", "h200", "-n", "1", "-c", "8K").output.split())
    assert "max concurrent 8K-token jobs: 16 (max_batch allows 16" in one
    assert "max_batch binds)" in one and "--max-batch" not in one
    ten = _invoke("plan", "-p", "cpu", "-n", "10", "-c", "512")
    assert ten.exit_code == 0, ten.output
    out = " ".join(ten.output.split())
    assert "max concurrent 512-token jobs: 4 (max_batch allows 4" in out
    assert "max_batch binds: raise --max-batch for more of the 10 jobs at once)" in out


def test_cli_plan_bad_context_exits_2():
    result = _invoke("plan", "-p", "cpu", "-n", "1", "-c", "lots")
    assert result.exit_code == 2
    assert "256K" in result.output


def test_weights_that_do_not_fit_are_refused_with_hints():
    """bf16 weights of the 13B (21 GiB) leave a 24 GiB card nothing. int4 weights alone
    do not make room either: each card's 168 GiB pool share carries 168 / 16 = 10.5 GiB
    of page metadata. With the pool cut to one job's 40 GiB they fit: data mode gives each
    card half the pool (so 80 GiB), a pipeline stage the whole pool for half the layers
    (so 40 GiB). Every hint, applied, plans one job that fits."""
    config, hardware = _preset("dual4090", memory_budget_gb=24.0)
    config = config.replace(weight_format="float")
    result = plan(LLAMA13, config, hardware, 1, K256)
    assert not result.feasible
    assert "before any KV" in result.reasons[0]
    assert not plan(LLAMA13, config.replace(weight_format="int4"), hardware, 1, K256).feasible
    assert "int4 weights: weight_format int4, --host-pool 80" in result.suggestions
    assert (
        "split the layers across the devices: --parallel pipeline --host-pool 40"
        in result.suggestions
    )
    for hint in result.suggestions:
        assert _replan(LLAMA13, config, hardware, 1, K256, hint).feasible, hint


def test_no_gather_when_the_hot_buffer_holds_every_page():
    config, hardware = _preset("dual4090")
    assert plan(LLAMA13, config, hardware, 8, 8192).gather_bytes_per_step == 0
    assert plan(LLAMA13, config, hardware, 8, K256).gather_bytes_per_step > 0


# ----------------------------------------------------------------------------- plan == admission

TINY = ModelConfig(
    arch="llama",
    num_layers=4,
    hidden_size=256,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=512,
    vocab_size=1000,
    max_position=65536,
    name="tiny-planner",
)


def _admitted(model, config, hardware, context) -> int:
    """Jobs of ``context`` tokens the run's caches admit: each device's cache sized from
    the budget exactly as a run builds it (``size_kv_for_budget`` over that device's
    settings, then ``KVCache``), filled with ``allocate`` until ``can_admit`` says no."""
    import torch

    from engine.capacity.budget import size_kv_for_budget
    from engine.capacity.planner import device_config, stage_layers
    from engine.kv.cache import KVCache

    here = device_config(config, hardware)
    pipeline = hardware.parallel == "pipeline" and hardware.num_devices > 1
    n = hardware.num_devices
    ranges = stage_layers(model.num_layers, n) if pipeline else [(0, model.num_layers)] * n
    counts = []
    for i, layers in enumerate(ranges):
        first, last = (i == 0, i == n - 1) if pipeline else (True, True)
        weights = weight_bytes(model, here, layers, embed=first, head=last)
        try:
            sizing = size_kv_for_budget(
                model, here, weights, context, layers=layers if pipeline else None
            )
        except ConfigError:
            counts.append(0)
            continue
        cache = KVCache(
            model,
            here.replace(max_batch=sizing.max_batch),
            torch.device("cpu"),
            -(-context // here.page_size),
            num_pool_pages=sizing.num_pool_pages,
            layers=range(*layers),
        )
        admitted = 0
        while cache.can_admit(context):
            cache.allocate(admitted, context)
            admitted += 1
        cache.close()
        counts.append(admitted)
    return min(counts) if pipeline else sum(counts)


# The caches below are built on the CPU (``device: cpu``), whose reserve is 5 % of the budget
# (:func:`engine.capacity.planner.device_reserve_bytes`): each budget leaves about the room
# (0.08, 0.2, 0.6 GiB) that 1.08, 1.2 and 1.6 GiB left over a 1 GiB reserve, so the bound
# each id names binds as it did.
CPU_BUDGETS = [(0.085, 0.25, 64), (0.21, 0.5, 64), (0.63, 0.05, 64), (0.63, 1.0, 3)]


@pytest.mark.parametrize("preset", ["cpu", "h200", "dual4090"])
@pytest.mark.parametrize(
    "budget_gb,host_pool_gb,max_batch",
    CPU_BUDGETS,
    ids=["device-bound", "roomier", "host-bound", "batch-bound"],
)
@pytest.mark.parametrize("context", [4096, 16384])
@pytest.mark.parametrize("mode", ["hierarchical", "dense"])
def test_plan_equals_what_admission_admits(preset, budget_gb, host_pool_gb, max_batch, context, mode):
    """``hisparse plan``'s job count is the number of jobs the caches of a run with the
    same settings admit, for every bound (device room, host pool, slab pool) and mode."""
    _plan_vs_admission(preset, budget_gb, host_pool_gb, max_batch, context, mode)


def _plan_vs_admission(preset, budget_gb, host_pool_gb, max_batch, context, mode):
    loaded = load_preset_full(preset)
    overrides = {
        "device": "cpu",
        "memory_budget_gb": budget_gb,
        "host_pool_gb": host_pool_gb,
        "max_batch": max_batch,
        "max_context": context,
        "top_k": 256,
        "device_buffer": 1024,
        "local_window": 64,
        "sink_tokens": 64,
    }
    if mode == "dense":
        overrides.update(attention="dense", hierarchical=False)
    if mode == "hierarchical-fp8":
        overrides.update(kv_host_dtype="fp8")
    config = resolve_config(loaded, {}, overrides)
    hardware = loaded.hardware.replace(host_memory_gb=64.0, memory_gb=budget_gb)
    planned = max_concurrent_jobs(TINY, config, hardware, context).max_jobs
    assert planned == _admitted(TINY, config, hardware, context)


@pytest.mark.parametrize("preset", ["h200", "dual4090"])
@pytest.mark.parametrize(
    "budget_gb,host_pool_gb,max_batch",
    CPU_BUDGETS,
    ids=["device-bound", "roomier", "host-bound", "batch-bound"],
)
def test_plan_equals_what_admission_admits_fp8(preset, budget_gb, host_pool_gb, max_batch):
    """The same with fp8 host pages (``kv_host_dtype=fp8``): the pool page the planner
    counts (fp8 records and their exponents) is the one the cache allocates."""
    _plan_vs_admission(preset, budget_gb, host_pool_gb, max_batch, 4096, "hierarchical-fp8")


def test_shape_names_as_people_spell_them():
    assert get_model_shape("llama-3.1-8b") is MODEL_SHAPES["llama3.1-8b"]
    assert get_model_shape("Qwen2.5-7B-Instruct") is MODEL_SHAPES["qwen2.5-7b"]


def test_fp8_host_pages_double_jobs_per_host_gib():
    """With ``kv_host_dtype=fp8`` a host-bound plan fits about twice the jobs (a record is
    ``2 S (D + 1)`` bytes instead of ``2 S D b_kv``), the pool page shrinks by that ratio
    in the cache too, and the estimated link bytes per step halve likewise."""
    from engine.capacity.planner import _gather_bytes_per_step
    from engine.kv import sizing

    loaded = load_preset_full("h200")
    shape = get_model_shape("llama2-13b-gqa8")
    over = {"device": "cpu", "max_context": 262144, "max_batch": 64}
    bf16 = resolve_config(loaded, {}, over)
    fp8 = resolve_config(loaded, {}, {**over, "kv_host_dtype": "fp8"})
    assert bf16.kv_dtype == "bfloat16"
    d, s = shape.head_dim, bf16.page_size
    assert sizing.host_record_bytes(shape, fp8) == 2 * s * (d + 1)
    assert sizing.record_bytes(shape, fp8) == sizing.record_bytes(shape, bf16) == 2 * s * d * 2
    ratio = sizing.pool_page_bytes(shape, bf16) / sizing.pool_page_bytes(shape, fp8)
    assert ratio == pytest.approx(2 * d / (d + 1))
    hardware = loaded.hardware.replace(host_memory_gb=400.0)
    jobs = {
        name: max_concurrent_jobs(shape, cfg, hardware, 262144).max_jobs
        for name, cfg in (("bf16", bf16), ("fp8", fp8))
    }
    assert jobs["bf16"] >= 2 and jobs["fp8"] >= int(1.9 * jobs["bf16"]), jobs
    link = [_gather_bytes_per_step(shape, c, 4, 262144) for c in (bf16, fp8)]
    assert link[0] / link[1] == pytest.approx(2 * d / (d + 1), rel=1e-6)
    resident = fp8.replace(hierarchical=False)  # no host tier: fp8 only rounds
    assert sizing.pool_page_bytes(shape, resident) == sizing.pool_page_bytes(shape, bf16)


def test_context_past_training_note_names_every_policy_that_runs_it():
    config, hardware = _preset("dual4090")
    config = config.replace(context_policy="refuse")
    result = plan(LLAMA13, config, hardware, 1, 4 * LLAMA13.max_position)
    (note,) = [n for n in result.notes if "trained" in n]
    assert "refuses unless context_policy is extend, truncate or chunk" in note


def test_plan_of_a_q4_gguf_counts_its_32_element_groups(smollm2_gguf_path):
    """The embedded model's GGUF (Q4_1 linears) plans with the group the engine keeps:
    32 elements a float32 scale and offset, 0.75 B/param of source on CUDA."""
    from engine.capacity.planner import _linear_params_per_layer

    shape = get_model_shape(str(smollm2_gguf_path))
    assert shape.int4_group_size == 32 and shape.num_layers == 30 and shape.int4_linears
    named = MODEL_SHAPES["smollm2-135m"]  # the shape name plans the embedded model
    assert dataclasses.replace(shape, rms_norm_eps=named.rms_norm_eps, name=named.name) == named
    config = EngineConfig(weight_format="int4", dtype="bfloat16", device="cuda")
    linear = _linear_params_per_layer(shape) * shape.num_layers
    rest = shape.vocab_size * shape.hidden_size * 2 + (2 * 30 + 1) * shape.hidden_size * 4
    assert weight_bytes(shape, config) == linear // 2 + linear // 32 * 8 + rest
    # tinygemm's copy, where kept, has the file's groups too: a bf16 scale and zero per 32
    both = config.replace(int4_triton_min_rows=8)
    packed = linear // 2 + linear // 32 * 4
    assert weight_bytes(shape, both) - weight_bytes(shape, config) == packed


def test_a_budget_sizes_the_engine_for_the_runs_longest_job():
    """``load_engine(..., job_tokens=N)`` under a memory budget builds each request for N
    tokens (its page table, the prefill scratch), as ``hisparse plan --context N`` counts
    a job, instead of the context limit (8192 for the tiny synthetic model): a job of N
    tokens runs; one over N fails, naming the size the cache was built for."""
    from engine.events import Job, JobFailed, JobFinished
    from engine.load import load_engine
    from engine.weights.synthetic import TINY

    config = EngineConfig(
        memory_budget_gb=0.2, host_pool_gb=0.05, max_batch=2, top_k=64, device_buffer=128,
        prefill_chunk=128, tokenizer="ids", num_threads=1,
    )  # fmt: skip
    whole = load_engine(config, "synthetic:tiny")
    assert whole.cache.max_pages_per_seq == 8192 // 16
    eng = load_engine(config, "synthetic:tiny", job_tokens=300)
    assert eng.prompt_limit() == 8192  # the context policy's limit is unchanged
    assert eng.cache.max_pages_per_seq == 19  # 300 tokens: 19 pages of 16
    sized = eng.budget_sizing
    assert sized.activation_bytes == activation_bytes(TINY, config, 300, config.max_batch)
    assert sized.activation_bytes < whole.budget_sizing.activation_bytes
    greedy = SamplingParams(max_tokens=8)
    jobs = [Job("fits", tuple(range(5, 297)), greedy), Job("over", tuple(range(5, 305)), greedy)]
    events = list(eng.run(jobs))
    assert [e.result.job_id for e in events if isinstance(e, JobFinished)] == ["fits"]
    (failed,) = [e for e in events if isinstance(e, JobFailed)]
    assert failed.job_id == "over" and "jobs of at most 304 tokens" in failed.error


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize(
    "host_pool_gb,budget_gb", [(24.0, 0.3), (0.001, 0.03)], ids=["metadata", "small-pool"]
)
def test_a_split_host_pool_is_named_as_the_user_set_it(workers, host_pool_gb, budget_gb):
    """Fresh-user finding: a data-parallel worker holds ``host_pool_gb / n``
    (:func:`worker_config`), and its budget refusal named that share ("host_pool_gb 12"
    where the user set 24 over 2 devices) and advised a ``--host-pool`` for one worker.
    It now names the total and the split, and every ``--host-pool`` it advises is a
    total whose share holds one request on each worker."""
    import re

    from engine.capacity.budget import size_kv_for_budget
    from engine.serve.workers import worker_config

    devices = ["cpu"] * workers
    config = EngineConfig(
        device="cpu", memory_budget_gb=budget_gb, host_pool_gb=host_pool_gb, top_k=256,
        device_buffer=1024, max_batch=4,
    )  # fmt: skip

    def sized(cfg):
        share = worker_config(cfg, "cpu", 0, devices, "data")
        return size_kv_for_budget(TINY, share, weight_bytes(TINY, share), 4096, pool_shares=workers)

    with pytest.raises(ConfigError, match="no room") as refused:
        sized(config)
    message = str(refused.value)
    share = host_pool_gb / workers
    assert f"(host_pool_gb {host_pool_gb:g} split across {workers} devices: {share:g} on this one)" \
        in message
    flags = [dict(re.findall(r"--([a-z-]+) ([\d.]+)", g)) for g in re.findall(r"\((--[^;)]*)", message)]
    advised = [f for f in flags if "host-pool" in f]
    assert advised, message
    for fix in advised:
        total = float(fix["host-pool"])
        assert f" split across {workers} devices ({total / workers:g} each)" in message
        budget = float(fix.get("memory-budget", budget_gb))
        assert sized(config.replace(host_pool_gb=total, memory_budget_gb=budget)).max_jobs(256) >= 1


def test_a_data_workers_pool_refusal_names_the_users_host_pool():
    """A job too long for a data-parallel worker's share of the host pool fails naming
    the total the user set and the split, not the share (the synthetic two-layer model:
    0.001 GiB over 2 workers holds 32 pages each)."""
    from engine.events import Job, JobFailed
    from engine.load import load_engine
    from engine.serve.workers import worker_config

    config = EngineConfig(host_pool_gb=0.001, max_batch=2, top_k=64, device_buffer=128,
                          tokenizer="ids", num_threads=1)  # fmt: skip
    share = worker_config(config, "cpu", 0, ["cpu", "cpu"], "data")
    eng = load_engine(share, "synthetic:tiny", pool_shares=2)
    job = Job("long", tuple(range(5, 600)), SamplingParams(max_tokens=8))
    (failed,) = [e for e in eng.run([job]) if isinstance(e, JobFailed)]
    pages = eng.cache.num_pool_pages
    assert failed.error == (
        f"needs 38 KV pool pages but this device's share of the pool has {pages} "
        "(host_pool_gb=0.001 split across 2 devices)"
    )
