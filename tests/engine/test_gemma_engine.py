"""Gemma 2 / 3 through the serving engine (prefill, paged KV, decode attention ops) on
tiny random models, against transformers: soft-capped attention and sliding-window
layers in the decode path, dense and sparse, and the sparse selection of a window layer
kept inside its window."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_models import build_hf, greedy_reference, reference_logits  # noqa: E402

from engine.config import EngineConfig, SamplingParams  # noqa: E402
from engine.events import Job  # noqa: E402
from engine.load import load_engine  # noqa: E402

IDS = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(9))
STEPS = 8


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    # a 24-token window: two to three 16-token pages, so window layers need a page cut
    return folder, build_hf(folder, request.param, sliding_window=24)


def run(folder, steps=STEPS, tracer=None, **overrides):
    cfg = EngineConfig(host_pool_gb=0.25, max_batch=1, page_size=16, **overrides)
    eng = load_engine(cfg, str(folder))
    eng.keep_logits = True
    if tracer is not None:
        eng.attn.tracer = tracer
    req = eng.open_request(Job("j", tuple(IDS.tolist()), SamplingParams(max_tokens=steps + 1)))
    try:
        eng.prefill(req)
        first = req.logits.clone()
        while len(req.generated) < steps:
            req.generated.append(eng.decode_step([req])[0])
        return first, list(req.generated)
    finally:
        eng.close_request(req)


@pytest.mark.parametrize("attention", ["dense", "sparse"])
def test_engine_matches_transformers(gemma, attention):
    """Dense, and sparse with a budget covering the context: the prefill logits and the
    greedy continuation (each decode step through the paged attention ops with the cap
    and the window) equal transformers'."""
    folder, model = gemma
    first, tokens = run(folder, attention=attention, top_k=512, sink_tokens=16, local_window=16)
    ref = reference_logits(model, IDS)[-1]
    torch.testing.assert_close(first, ref, atol=1e-4, rtol=1e-4)
    assert tokens == greedy_reference(model, IDS, STEPS)


def test_window_layer_selection_stays_in_its_window(gemma):
    """A sparse budget smaller than the context: the window layer's selection holds only
    pages that overlap its last 24 positions (no sinks, no older pages), while the global
    layer keeps its sink page."""
    folder, _ = gemma
    seen: dict[int, list] = {0: [], 1: []}

    def tracer(plan, layer, selection):
        lens = plan.seq_lens.tolist()
        bits = [(int(w) >> j) & 1 for w in selection[0, 0].tolist() for j in range(32)]
        seen[layer].append((lens[0], [p for p, b in enumerate(bits) if b]))

    run(folder, steps=4, tracer=tracer, top_k=48, sink_tokens=16, local_window=16)
    assert seen[0] and seen[1]
    for seq_len, pages in seen[0]:
        lo_page = (seq_len - 24) // 16
        assert pages and min(pages) >= lo_page, (seq_len, pages)
    assert all(0 in pages for _, pages in seen[1])  # the global layer's sink page


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("attention", ["dense", "sparse"])
def test_engine_on_cuda_matches_transformers(gemma, attention):
    """The same on CUDA: Triton attention with the cap and the window, CUDA graphs on
    (fp32 activations and KV, float weights, so transformers' fp32 tokens are the target)."""
    folder, model = gemma
    first, tokens = run(
        folder,
        device="cuda",
        dtype="float32",
        kv_dtype="float32",
        weight_format="float",
        attention=attention,
        top_k=512,
        sink_tokens=16,
        local_window=16,
    )
    torch.testing.assert_close(first.cpu(), reference_logits(model, IDS)[-1], atol=1e-3, rtol=1e-3)
    assert tokens == greedy_reference(model, IDS, STEPS)


@pytest.mark.parametrize("attention", ["dense", "sparse"])
def test_audit_keeps_the_soft_cap_and_windows(gemma, attention):
    """The fidelity audit's dense pass attends as the dense engine does, soft-cap and
    sliding windows included: under dense attention it agrees with the step exactly (KL
    0, all mass kept); under sparse attention its dense logits equal the per-row
    reference (:func:`engine.decode.audit.dense_step_logits`, which applies them too)."""
    import engine.decode.audit as fidelity

    folder, _ = gemma
    seen = {}
    dense_pass = fidelity.dense_pass

    def spy(*args):
        seen["out"] = dense_pass(*args)
        return seen["out"]

    cfg = EngineConfig(
        host_pool_gb=0.25, max_batch=1, page_size=16, attention=attention, audit_steps=3,
        top_k=32, sink_tokens=16, local_window=16,
    )  # fmt: skip
    eng = load_engine(cfg, str(folder))
    req = eng.open_request(Job("j", tuple(IDS.tolist()), SamplingParams(max_tokens=STEPS + 1)))
    eng.prefill(req)
    req.audit_at = frozenset({1, 2, 3})
    fidelity.dense_pass = spy
    try:
        for _ in range(3):
            fed = req.generated[-1]
            handle = eng.launch_step([req])
            req.generated.append(eng.read_step(handle)[0][0])
            handle.audit.wait()
            agree, kl, kept = handle.audit.figures[:, 0].tolist()
            if attention == "dense":
                assert agree == 1.0 and kl < 1e-6 and kept == 1.0
            else:
                n = eng.cache.seqs[req.seq_id].num_tokens
                ref = fidelity.dense_step_logits(eng.model, eng.cache, req.seq_id, fed, n - 1)
                torch.testing.assert_close(seen["out"][0][0], ref, atol=1e-4, rtol=1e-4)
                assert 0.0 < kept <= 1.0
    finally:
        fidelity.dense_pass = dense_pass
        eng.auditor.clear()
        eng.close_request(req)
