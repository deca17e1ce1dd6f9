"""Correctness ladder on the real embedded model (SmolLM2-135M-Instruct Q4_1), CPU, fp32.

1. dense path == transformers loading the same GGUF (logits and greedy tokens);
2. sparse with every page selected == dense (logits, tolerance);
3. hierarchical with a hot buffer small enough to force misses == all-resident sparse,
   bit for bit (logits and tokens), over 64+ decode steps of a corpus document; with fp8
   host pages (``kv_host_dtype=fp8``) == an all-resident pool holding the same fp8-rounded
   KV, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import bits_equal

from engine.config import EngineConfig, SamplingParams
from engine.events import Job
from kernels.fp8_kv import FP8, fp8_dequantize_ref

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# Logits tolerance against transformers (fp32 both sides, same dequantised weights): the
# two differ only in summation order (fused QKV / gate-up, chunked attention).
LOGITS_ATOL = 2e-3
# Sparse-with-all-pages vs dense: page-wise softmax vs SDPA, fp32.
SPARSE_DENSE_ATOL = 1e-3


@pytest.fixture(scope="module")
def weights_path(smollm2_gguf_path):
    return smollm2_gguf_path


def make_engine(path, **overrides):
    """The ladder runs float32 weights (``weight_format: auto`` would pick the int4 kernel
    with bf16 products on a CPU with bf16 instructions: tests/engine/test_cpu_formats.py)."""
    from engine.load import load_engine

    cfg = EngineConfig(host_pool_gb=1.0, max_batch=2, **{"weight_format": "float", **overrides})
    eng = load_engine(cfg, str(path))
    eng.keep_logits = True
    return eng


@pytest.fixture(scope="module")
def dense_engine(weights_path):
    return make_engine(weights_path, attention="dense")


@pytest.fixture(scope="module")
def hf_model(weights_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(weights_path.parent), gguf_file=weights_path.name, dtype=torch.float32
    ).eval()


def prompts(tokenizer, corpus_dir):
    doc = (corpus_dir / "howto-sorting.txt").read_text(encoding="utf-8")
    chats = [
        "What is the capital of France?",
        "Write a haiku about sorting lists in Python.",
        "Summarize this document:\n\n" + doc[:16000],
    ]
    return [tokenizer.encode_chat([{"role": "user", "content": c}]) for c in chats]


def greedy(engine, ids, steps, job_id="j"):
    """Our engine, greedy: (first-step logits, generated tokens)."""
    req = engine.open_request(Job(job_id, tuple(ids), SamplingParams(max_tokens=steps + 1)))
    try:
        engine.prefill(req)
        first_logits = req.logits.clone()
        while len(req.generated) < steps:
            req.generated.append(engine.decode_step([req])[0])
        return first_logits, list(req.generated)
    finally:
        engine.close_request(req)


def test_dense_matches_transformers(dense_engine, hf_model, corpus_dir):
    all_prompts = prompts(dense_engine.tokenizer, corpus_dir)
    assert len(all_prompts[2]) > 3000
    for ids in all_prompts:
        logits, tokens = greedy(dense_engine, ids, 32)
        x = torch.tensor([ids])
        with torch.no_grad():
            ref_logits = hf_model(x).logits[0, -1]
            ref = hf_model.generate(
                x, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(ids) :].tolist()
        diff = (logits - ref_logits).abs().max().item()
        assert diff < LOGITS_ATOL, f"max |logit diff| {diff:.2e} for a {len(ids)}-token prompt"
        assert tokens == ref, f"greedy tokens differ for a {len(ids)}-token prompt"


def test_embedded_answers_capital(dense_engine):
    ids = dense_engine.tokenizer.encode_chat(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    _, tokens = greedy(dense_engine, ids, 12)
    assert dense_engine.tokenizer.decode(tokens).startswith("The capital of France is Paris.")


def teacher_forced_logits(engine, ids, tokens):
    """Logits at each step feeding the given ``tokens`` (identical inputs across engines)."""
    req = engine.open_request(Job("t", tuple(ids), SamplingParams(max_tokens=len(tokens) + 1)))
    out = []
    try:
        engine.prefill(req)
        req.generated = [tokens[0]]
        for t in tokens[1:]:
            engine.decode_step([req])
            out.append(req.logits.clone())
            req.generated.append(t)
        return torch.stack(out)
    finally:
        engine.close_request(req)


def test_sparse_all_pages_equals_dense(weights_path, dense_engine, corpus_dir):
    sparse = make_engine(weights_path, attention="sparse", indexer="dense", top_k=8192)
    ids = prompts(dense_engine.tokenizer, corpus_dir)[2]
    _, tokens = greedy(dense_engine, ids, 16)
    a = teacher_forced_logits(dense_engine, ids, tokens)
    b = teacher_forced_logits(sparse, ids, tokens)
    diff = (a - b).abs().max().item()
    assert diff < SPARSE_DENSE_ATOL, f"sparse(all pages) vs dense: max |diff| {diff:.2e}"


@pytest.mark.parametrize(
    "deferred,prefetch,host_dtype",
    [
        (False, 0, "bf16"),
        (True, 0, "bf16"),
        (False, 4, "bf16"),
        (True, 4, "bf16"),
        (True, 4, "fp8"),
        (True, 4, "fp8-hot"),
    ],
    ids=[
        "write-through",
        "late-writes",
        "prefetch",
        "late-writes-prefetch",
        "fp8-late-writes-prefetch",
        "fp8-hot-late-writes-prefetch",
    ],
)
def test_hierarchical_bit_identical_to_resident(
    weights_path, corpus_dir, deferred, prefetch, host_dtype
):
    """``late-writes``: decode tokens reach the host pool only at the end of each step
    (:meth:`KVCache.defer_decode_writes`, the latest a GPU copy stream's write lands), so a
    tail page gathered from the pool mid-step lacks the token until the slot write after
    the gather; the result must not change, and the pool must end up complete.
    ``prefetch``: near misses are loaded after each layer's attention, at the step's end
    (the latest the copy stream's prefetch lands); the next steps then hit some of them,
    and every record they read must still be the right one.
    ``fp8``: the host pool holds fp8 records (the gather dequantises them), the resident
    pool the same records rounded through fp8; logits, tokens and records agree bit for
    bit, and the records carry e4m3's 3 mantissa bits (the rounding is real).
    ``fp8-hot``: the hot buffer holds the fp8 records as stored (``hot_buffer_dtype=fp8``)
    and attention dequantises them; still bit for bit the resident pool's results."""
    hot = "fp8" if host_dtype == "fp8-hot" else "bf16"
    host_dtype = host_dtype.removesuffix("-hot")
    common = dict(
        attention="sparse",
        indexer="quest",
        top_k=256,
        page_size=16,
        sink_tokens=16,
        local_window=32,
        kv_host_dtype=host_dtype,
    )
    resident = make_engine(weights_path, hierarchical=False, **common)
    hier = make_engine(
        weights_path, hierarchical=True, device_buffer=320, prefetch_pages=prefetch,
        hot_buffer_dtype=hot, **common,
    )  # fmt: skip
    assert (hier.cache.slots[0].dtype == FP8) == (hot == "fp8")
    if deferred:
        hier.cache.defer_decode_writes()
    ids = prompts(resident.tokenizer, corpus_dir)[2]
    steps = 64
    logits_r, tokens_r = greedy(resident, ids, steps)
    req = hier.open_request(Job("h", tuple(ids), SamplingParams(max_tokens=steps + 1)))
    hier.prefill(req)
    assert torch.equal(req.logits, logits_r)
    hits = misses = prefetched = 0
    res_req = resident.open_request(Job("r", tuple(ids), SamplingParams(max_tokens=steps + 1)))
    resident.prefill(res_req)
    for step in range(steps - 1):
        t_h = hier.decode_step([req])[0]
        t_r = resident.decode_step([res_req])[0]
        assert torch.equal(req.logits, res_req.logits), f"logits differ at decode step {step}"
        assert t_h == t_r
        req.generated.append(t_h)
        res_req.generated.append(t_r)
        hits += int(hier.attn.hits.sum())
        misses += int(hier.attn.misses.sum())
        prefetched += int(hier.attn.prefetched.sum())
        hier.cache.check_integrity()
    assert req.generated == tokens_r
    assert hits > 0 and misses > 0, (hits, misses)
    assert (prefetched > 0) == bool(prefetch)
    n = hier.cache.seqs[req.seq_id].num_tokens
    assert n == resident.cache.seqs[res_req.seq_id].num_tokens
    for layer in range(hier.cache.num_layers):  # every record of every token, bit for bit
        a = _records_of(hier.cache, req.seq_id, layer, n)
        b = _records_of(resident.cache, res_req.seq_id, layer, n)
        assert bits_equal(a, b), f"layer {layer}: pool records differ"
    hier.close_request(req)
    resident.close_request(res_req)
    hier.cache.check_integrity()
    assert (hier.cache.pool[0].dtype == FP8) == (host_dtype == "fp8")
    if host_dtype == "fp8":  # the resident records really are fp8 values (x 2**e)
        mantissa = torch.frexp(b).mantissa * 16  # 1 + 3 bits: an integer
        assert torch.equal(mantissa, torch.round(mantissa))


@pytest.mark.parametrize("weight_format", ["float", "int4"])
def test_cpu_direct_reads_bit_identical_to_hierarchical(weights_path, corpus_dir, weight_format):
    """Rung 3 for the CPU direct path (``cpu_direct_reads``, the ``cpu`` preset's default):
    attention reading the selected records straight from the host pool gives the
    hierarchical path's logits and tokens bit for bit on the real model, with a hot buffer
    small enough that the hierarchy misses; the direct path counts every selected record
    as a hit and none as a miss. With float32 weights and with the int4 kernel (bf16
    products on a CPU with bf16 instructions: the ``cpu`` preset's ``auto`` there)."""
    common = dict(
        attention="sparse", indexer="quest", top_k=256, page_size=16, sink_tokens=16,
        local_window=32, hierarchical=True, device_buffer=320, weight_format=weight_format,
    )  # fmt: skip
    hier = make_engine(weights_path, cpu_direct_reads=False, **common)
    direct = make_engine(weights_path, cpu_direct_reads=True, **common)
    assert direct.attn.fast_direct
    doc = (corpus_dir / "howto-sorting.txt").read_text(encoding="utf-8")[:4000]
    chat = [{"role": "user", "content": "Summarize this document:\n\n" + doc}]
    ids = hier.tokenizer.encode_chat(chat)  # ~1K tokens: 4 x top_k, 3 x the hot buffer
    assert len(ids) > 3 * 320
    steps = 24
    reqs = [
        e.open_request(Job(f"j{i}", tuple(ids), SamplingParams(max_tokens=steps + 1)))
        for i, e in enumerate((hier, direct))
    ]
    for e, r in zip((hier, direct), reqs, strict=True):
        e.prefill(r)
    assert torch.equal(reqs[0].logits, reqs[1].logits)
    misses = 0
    for step in range(steps - 1):
        tokens = [e.decode_step([r])[0] for e, r in zip((hier, direct), reqs, strict=True)]
        assert torch.equal(reqs[0].logits, reqs[1].logits), f"logits differ at decode step {step}"
        assert tokens[0] == tokens[1]
        selected = int(hier.attn.hits.sum() + hier.attn.misses.sum())
        misses += int(hier.attn.misses.sum())
        assert int(direct.attn.hits.sum()) == selected and int(direct.attn.misses.sum()) == 0
        for r, t in zip(reqs, tokens, strict=True):
            r.generated.append(t)
    assert misses > 0
    for e, r in zip((hier, direct), reqs, strict=True):
        e.close_request(r)
        e.cache.check_integrity()


def _records_of(cache, seq_id: int, layer: int, num_tokens: int) -> torch.Tensor:
    """A request's K/V records of one layer in token order: ``[T, Hkv, 2, D]`` (an fp8
    host pool's dequantised to ``kv_dtype``)."""
    pages = torch.tensor(cache.seqs[seq_id].pages, dtype=torch.long)
    rec = cache.pool[layer][pages]
    if cache.host_fp8:
        rec = fp8_dequantize_ref(rec, cache.pool_scale[layer][pages], cache.dtype)
    rec = rec.permute(0, 3, 1, 2, 4)  # [P, S, Hkv, 2, D]
    return rec.reshape(-1, *rec.shape[2:])[:num_tokens]


@pytest.mark.parametrize(
    "attention,split,deferred,prefetch",
    [
        ("sparse", False, False, 0),
        ("dense", False, False, 0),
        ("sparse", True, False, 0),
        ("sparse", True, True, 0),
        ("sparse", True, True, 3),
    ],
)
def test_static_graph_step_equals_eager_step(
    weights_path, corpus_dir, attention, split, deferred, prefetch
):
    """The function a CUDA graph captures (static buffers, padded page-table width, plan
    tensors computed on the device; :mod:`engine.decode.cuda_graph`), run eagerly on the CPU,
    gives the eager engine's logits, tokens, hits and misses bit for bit — for a batch of
    two requests of different lengths, with a hot buffer small enough to force misses.
    ``split``: the batch as two micro-batches (``decode_overlap``; one after the other here,
    on two streams on a GPU). ``deferred``: the static engine writes decode tokens to the
    pool late (each micro-batch stages its rows at its own offset). ``prefetch``: both
    engines prefetch near misses (the static one at the step's end), and load the same
    records."""
    from engine.decode.cuda_graph import DecodeGraphs

    common = dict(attention=attention, top_k=128, page_size=16, sink_tokens=16, local_window=32)
    if attention == "sparse":
        common.update(device_buffer=192, prefetch_pages=prefetch)
    eager = make_engine(weights_path, **common)
    static = make_engine(weights_path, **common)
    static.graphs = DecodeGraphs(static, capture=False, split=split)
    if deferred:
        static.cache.defer_decode_writes()
    eager.split_batches = split  # the eager step splits the same way (on CUDA: by default)
    assert static.graphs.overlap == split
    docs = prompts(eager.tokenizer, corpus_dir)
    ids = [docs[2][:700], docs[1]]
    reqs = {}
    for name, eng in (("eager", eager), ("static", static)):
        rs = []
        for i, p in enumerate(ids):
            r = eng.open_request(Job(f"{name}{i}", tuple(p), SamplingParams(max_tokens=40)))
            eng.prefill(r)
            rs.append(r)
        reqs[name] = rs
    misses = prefetched = 0
    for step in range(24):
        tokens = {}
        for name, eng in (("eager", eager), ("static", static)):
            tokens[name] = eng.decode_step(reqs[name])
            for r, t in zip(reqs[name], tokens[name], strict=True):
                r.generated.append(t)
        assert tokens["eager"] == tokens["static"], f"step {step}"
        for a, b in zip(reqs["eager"], reqs["static"], strict=True):
            assert torch.equal(a.logits, b.logits), f"logits differ at step {step}"
        if attention == "sparse":
            assert torch.equal(eager.attn.hits, static.attn.hits)
            assert torch.equal(eager.attn.misses, static.attn.misses)
            assert torch.equal(eager.attn.prefetched, static.attn.prefetched)
            misses += int(static.attn.misses.sum())
            prefetched += int(static.attn.prefetched.sum())
            static.cache.check_integrity()
    assert static.graphs.entries, "the static step was not used"
    if attention == "sparse":
        assert misses > 0
        assert (prefetched > 0) == bool(prefetch)


def test_prefetch_traffic_reaches_the_results(weights_path, corpus_dir):
    """A job's results count prefetched records, and its ``h2d_bytes`` (like the decode
    steps' events) cover misses and prefetched records alike."""
    from engine import events as ev

    eng = make_engine(
        weights_path,
        attention="sparse",
        top_k=256,
        page_size=16,
        sink_tokens=16,
        local_window=32,
        device_buffer=320,
        prefetch_pages=4,
    )
    ids = prompts(eng.tokenizer, corpus_dir)[2]
    events = list(eng.run([Job("p", tuple(ids), SamplingParams(max_tokens=12))]))
    (done,) = [e for e in events if isinstance(e, ev.JobFinished)]
    cache = done.result.cache
    steps = [e for e in events if isinstance(e, ev.DecodeStep)]
    assert cache.prefetched > 0 and cache.prefetched == sum(e.prefetched for e in steps)
    rb = eng.cache.record_bytes
    assert cache.h2d_bytes == (cache.misses + cache.prefetched) * rb
    assert sum(e.h2d_bytes for e in steps) == cache.h2d_bytes


def test_top_k_keeps_exactly_k_lowest_ids_on_ties():
    """Issue #19.4: with two logits tied at the maximum, top_k=1 at temperature 1 picked
    either at random; it must be greedy (lowest id), and top_k keeps exactly k."""
    from engine.decode.sampling import sample

    logits = torch.tensor([0.0, 5.0, 5.0, 1.0, 5.0])
    greedy = sample(logits, SamplingParams(temperature=0.0), torch.Generator())
    picks_k1, picks_k2 = set(), set()
    for seed in range(200):
        g = torch.Generator().manual_seed(seed)
        picks_k1.add(sample(logits, SamplingParams(temperature=1.0, top_k=1), g))
        picks_k2.add(sample(logits, SamplingParams(temperature=1.0, top_k=2), g))
    assert picks_k1 == {greedy} == {1}
    assert picks_k2 == {1, 2}
    flat = torch.zeros(8)  # every logit tied: top_p keeps the lowest ids first
    picks_p = {
        sample(flat, SamplingParams(temperature=1.0, top_p=0.25), torch.Generator().manual_seed(s))
        for s in range(100)
    }
    assert picks_p == {0, 1}


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-300),  # 0 in float32: logits / 0 -> inf, nan
        SamplingParams(temperature=9e-6, top_k=3),
        SamplingParams(temperature=0.7, top_p=1e-300),  # under float32's least: kept nothing
    ],
)
def test_tiny_temperature_or_top_p_samples_the_most_likely_token(params):
    """Fresh-user finding: --temperature 1e-300, or --top-p 1e-300, failed the job with
    torch's "probability tensor contains inf, nan". A temperature under GREEDY_BELOW is
    greedy (the limit as it goes to 0); top_p always keeps the most likely token."""
    from engine.decode.sampling import sample

    logits = torch.tensor([0.5, 3.0, -1.0, 2.9, 3.0])
    for seed in range(20):
        assert sample(logits, params, torch.Generator().manual_seed(seed)) == 1
