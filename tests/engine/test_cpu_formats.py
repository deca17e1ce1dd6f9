"""``weight_format: auto`` on a CPU (the ``cpu`` preset): linears stored 4-bit run by
torch's int4 kernel with bf16 products where the CPU has bf16 instructions, float weights
elsewhere (and for float checkpoints, which int4 would re-quantise); the model line says
which and why. The CPU's answer is patched both ways, so the test means the same on any
machine (the bf16 kernel runs everywhere, only slower without them). The tiny synthetic
model's linears are 4-bit codes; :func:`q4_formats` names them as a Q4_1 GGUF's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import EngineConfig
from engine.weights.quant import DenseLinear, Int4Linear

TINY = dict(host_pool_gb=0.25, max_batch=1, tokenizer="ids")


def q4_formats(weights):
    """``weights`` with the source formats a Q4_1 GGUF of its shape reports."""
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    formats = {
        f"blk.{i}.{n}.weight": "Q4_1" for i in range(weights.config.num_layers) for n in names
    }
    return dataclasses.replace(weights, formats={**formats, "token_embd.weight": "F32"})


def place(monkeypatch, fast: bool, stored_int4: bool = True, **overrides):
    import engine.weights.quant as quant
    from engine.load import place_model
    from engine.weights.synthetic import load_synthetic

    monkeypatch.setattr(quant, "cpu_fast_bf16", lambda: fast)
    weights, tokenizer, name = load_synthetic("tiny", tokenizer="ids")
    if stored_int4:
        weights = q4_formats(weights)
    config = EngineConfig(**{**TINY, **overrides})
    return place_model(config, weights=(weights, tokenizer, name))


def logits(placed, ids):
    from engine.model.llama import prefill_attention

    m = placed.model
    with torch.no_grad():
        h = m.embed_tokens(ids)
        for i in m.layer_range:
            q, k, v = m.qkv(i, h, torch.arange(len(ids)))
            h = m.finish_layer(i, h, prefill_attention(q, k, v, 0))
        return m.logits(h)


@pytest.mark.parametrize("fast", [True, False])
def test_auto_picks_int4_with_bf16_products_only_on_a_bf16_cpu(monkeypatch, fast):
    placed = place(monkeypatch, fast)
    linears = [lin for layer in placed.model.layers for lin in (layer.wqkv, layer.w_down)]
    if fast:
        assert placed.weight_format == "int4"
        assert all(isinstance(lin, Int4Linear) and lin.dtype == torch.bfloat16 for lin in linears)
        assert "int4 kernel with bfloat16 activations; auto: CPU has AVX512-BF16/AMX" in (
            placed.weights_info
        )
    else:
        assert placed.weight_format == "float"
        assert all(isinstance(lin, DenseLinear) for lin in linears)
        assert placed.weights_info.endswith("; auto: no AVX512-BF16/AMX")
    assert placed.model.dtype == torch.float32  # the residual stream and attention


def test_bf16_products_keep_float32_activations_around_them(monkeypatch):
    """Decode-sized calls (the int4 kernel) and prefill-sized ones (the dense GEMM) return
    float32, within bf16 rounding of the int4 weights' exact product."""
    placed = place(monkeypatch, True)
    lin = placed.model.layers[0].w_gate_up
    w = lin.source.dequantize()
    for rows in (1, 5, 70):
        x = torch.randn(rows, lin.in_features, generator=torch.Generator().manual_seed(rows))
        y = lin(x)
        assert y.dtype == torch.float32
        torch.testing.assert_close(y, x @ w.T, atol=0.05, rtol=0.02)


def test_auto_keeps_a_float_checkpoint_float(monkeypatch):
    placed = place(monkeypatch, True, stored_int4=False)  # int4 would re-quantise it
    assert placed.weight_format == "float"
    assert placed.weights_info.endswith("auto: CPU has AVX512-BF16/AMX, linears not stored 4-bit")


def test_explicit_formats_are_kept(monkeypatch):
    placed = place(monkeypatch, True, weight_format="float")
    assert placed.weight_format == "float" and "auto" not in placed.weights_info
    placed = place(monkeypatch, False, weight_format="int4")  # fp32 kernel on a slow CPU
    lin = placed.model.layers[0].wo
    assert isinstance(lin, Int4Linear) and lin.dtype == torch.float32
    assert "int4 kernel with float32 activations" in placed.weights_info


def test_bf16_and_float_placements_agree_on_the_logits(monkeypatch):
    ids = torch.randint(5, 1000, (24,), generator=torch.Generator().manual_seed(1))
    fast = logits(place(monkeypatch, True), ids)
    exact = logits(place(monkeypatch, False, weight_format="int4"), ids)
    rel = (fast - exact).norm() / exact.norm()
    assert float(rel) < 0.02  # bf16 products only


def q8_0_values(n, k, seed=0):
    """A float ``[n, k]`` weight holding Q8_0 values: per 32 elements an fp16 ``d`` and
    codes in -127..127 whose largest magnitude is 127 (as ggml's quantiser leaves them)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g)
    q[:, :, 0] = 127 * torch.where(torch.rand(n, k // 32, generator=g) < 0.5, -1, 1)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-4).half().float()
    return (q * d).view(n, k)


def test_q8_head_runs_the_exact_codes_as_two_int4_products():
    from engine.weights.quant import Q8Int4Linear

    w = q8_0_values(320, 576)
    head = Q8Int4Linear.from_float(w)
    assert head is not None and (head.out_features, head.in_features) == (320, 576)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(2))
    y = head(x)
    assert y.dtype == torch.float32 and y.shape == (3, 320)
    want = x.bfloat16().float() @ w.T  # bf16 activations, exact weights
    rel = (y - want).norm() / want.norm()
    assert float(rel) < 4e-3  # bf16 scales and bf16 outputs of the two products
    assert float((y - x @ w.T).norm() / (x @ w.T).norm()) < 8e-3


def test_q8_head_refuses_weights_that_are_not_q8_0_values():
    from engine.weights.quant import Q8Int4Linear

    w = q8_0_values(64, 64)
    assert Q8Int4Linear.from_float(w + 1e-5) is None  # off the codes
    assert Q8Int4Linear.from_float(torch.randn(64, 64)) is None
    assert Q8Int4Linear.from_float(w[:, :48]) is None  # K not whole blocks


def test_head_fp16_when_measured_faster_float32_otherwise(monkeypatch, tmp_path):
    """pick_cpu_lm_head keeps the fp16 copy exactly when its timed product is at most
    ``gain`` of float32's (the timer patched: the choice, not this box's speed, is tested);
    the fp16 head's logits are float32 and within fp16 rounding of the float32 head's."""
    import engine.weights.placement as placement
    import engine.weights.quant as quant

    w = torch.randn(300, 64, generator=torch.Generator().manual_seed(2)) * 0.05
    head = DenseLinear(w)
    clock = iter([])

    def fake_perf_counter():
        return next(clock)

    monkeypatch.setattr("time.perf_counter", fake_perf_counter)
    monkeypatch.setattr(quant, "_LM_HEAD_CHOICES", {})
    monkeypatch.setenv("HISPARSE_CACHE_DIR", str(tmp_path))
    # per product (start, end) pairs: float32 first (3 repeats), then fp16
    clock = iter([0, 10, 0, 10, 0, 10] + [0, 2, 0, 2, 0, 2])
    lin, note = quant.pick_cpu_lm_head(head)
    assert isinstance(lin, quant.CastLinear) and lin.weight.dtype == torch.float16
    assert "LM head fp16 (2000.0 vs 10000.0 ms float32, measured)" in note
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    y = lin(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, head(x), atol=2e-3, rtol=2e-3)
    clock = iter([])  # measured once per process and shape: no second timing
    again, again_note = quant.pick_cpu_lm_head(DenseLinear(w.clone()))
    assert isinstance(again, quant.CastLinear) and again_note == note
    quant._LM_HEAD_CHOICES.clear()  # a new process: the machine's record, no timing
    again, again_note = quant.pick_cpu_lm_head(DenseLinear(w.clone()))
    assert isinstance(again, quant.CastLinear)
    assert again_note == "; LM head fp16 (2000.0 vs 10000.0 ms float32, measured on this machine before)"
    quant._LM_HEAD_CHOICES.clear()
    placement.lm_head_record_path().unlink()  # deleted: measured again
    clock = iter([0, 10, 0, 10, 0, 10] + [0, 9, 0, 9, 0, 9])  # fp16 only 10% faster
    lin, note = quant.pick_cpu_lm_head(head)
    assert lin is head and "LM head float32 (fp16 9000.0 vs 10000.0 ms" in note
    quant._LM_HEAD_CHOICES.clear()
    placement.lm_head_record_path().write_text("{not json")  # unreadable: measured again
    clock = iter([0, 10, 0, 10, 0, 10] + [0, 2, 0, 2, 0, 2])
    lin, note = quant.pick_cpu_lm_head(head)
    assert isinstance(lin, quant.CastLinear) and note.endswith("measured)")


def test_head_choice_only_with_bf16_products(monkeypatch):
    """The engine tries the fp16 head only where the linears already run bf16 products
    (int4 on a bf16 CPU); float placements keep the exact float32 head."""
    import engine.weights.quant as quant

    calls = []
    real = quant.pick_cpu_lm_head

    def spy(head, *a, **k):
        calls.append(head)
        return real(head, *a, **k)

    monkeypatch.setattr(quant, "pick_cpu_lm_head", spy)
    placed = place(monkeypatch, True)
    assert len(calls) == 1 and "LM head" in placed.weights_info
    placed = place(monkeypatch, True, weight_format="float")
    assert len(calls) == 1 and isinstance(placed.model.lm_head, DenseLinear)
    assert placed.model.lm_head.weight.dtype == torch.float32
    placed = place(monkeypatch, False)
    assert len(calls) == 1 and "LM head" not in placed.weights_info
