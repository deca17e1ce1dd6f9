"""AWQ (GEMM) and GPTQ (v1) folders kept 4-bit, against transformers on the same values.

Each test builds a tiny Llama or Qwen2 with transformers' own config classes and random
weights, quantises every decoder linear here with an independent packer written from the
formats' descriptions (AutoAWQ ``WQLinear_GEMM``: ``qweight [K, N/8]`` with nibble ``i`` of
a word holding column ``8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]``; AutoGPTQ v1 ``QuantLinear``:
``qweight [K/8, N]`` in input-row order, zeros stored minus one), writes the weights
transformers should see — ``(q - z) * s`` — back into the model (the dense reference) and
saves the folder with a ``quantization_config``. The engine's logits must match
transformers' and its greedy tokens must equal them where the top two are not tied.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_loader import our_logits  # noqa: E402
from tiny_models import build_hf, reference_logits  # noqa: E402

from engine.weights.hf import HFModelError, load_hf_folder  # noqa: E402
from engine.weights.prequant import fit_group  # noqa: E402
from engine.weights.quant import Int4Weight, make_linear  # noqa: E402
from engine.weights.types import describe_placement  # noqa: E402

IDS = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(5))
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column offset held by nibble i of a word


def quantise(w: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit group quantisation of ``w [N, K]`` along K, as AWQ/GPTQ store it:
    returns codes ``q [N, K]`` (0..15), zero points ``z [N, K/g]`` (1..15, so GPTQ v1's
    ``z - 1`` fits a nibble) and fp16 scales ``s [N, K/g]``."""
    n, k = w.shape
    wg = w.view(n, k // g, g)
    lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    s = ((hi - lo) / 15).clamp(min=1e-4).half()
    z = torch.round(-lo / s.float()).clamp(1, 15)
    q = torch.round(wg / s.float()[..., None] + z[..., None]).clamp(0, 15)
    return q.view(n, k).int(), z.int(), s


def dense(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, g: int) -> torch.Tensor:
    """The formats' dequantisation ``(q - z) * s`` (float32) ``[N, K]``."""
    n, k = q.shape
    return ((q.view(n, k // g, g) - z[..., None]).float() * s.float()[..., None]).view(n, k)


def pack_words(nibbles: torch.Tensor) -> torch.Tensor:
    """int ``[..., 8]`` nibbles -> int32 ``[...]``, nibble ``i`` at bits ``4i``."""
    word = torch.zeros(nibbles.shape[:-1], dtype=torch.int64)
    for i in range(8):
        word |= (nibbles[..., i].to(torch.int64) & 0xF) << (4 * i)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def pack_awq(q, z, s) -> dict[str, torch.Tensor]:
    """AWQ GEMM tensors of one linear from codes ``q [N, K]``, zeros and scales ``[N, K/g]``."""

    def columns(x):  # [N, R] -> [R, N/8] words of 8 output columns in AWQ's order
        x = x.T
        return pack_words(x.reshape(x.shape[0], -1, 8)[..., list(AWQ_PACK_ORDER)])

    return {"qweight": columns(q), "qzeros": columns(z), "scales": s.T.contiguous()}


def pack_gptq(q, z, s, g: int) -> dict[str, torch.Tensor]:
    """GPTQ v1 tensors of one linear (``g_idx`` trivial, zeros stored minus one)."""
    n, k = q.shape
    qt = q.T.reshape(k // 8, 8, n).permute(0, 2, 1)  # [K/8, N, 8]: rows 8r..8r+7
    zt = (z.T - 1).reshape(-1, n // 8, 8)
    return {
        "qweight": pack_words(qt),
        "qzeros": pack_words(zt),
        "scales": s.T.contiguous(),
        "g_idx": (torch.arange(k) // g).to(torch.int32),
    }


def save_prequantised(folder: Path, family: str, method: str, group: int):
    """A tiny ``family`` model whose decoder linears are ``method`` 4-bit with ``group``
    (-1: one group per row); returns the transformers model holding the decoded values."""
    from safetensors.torch import save_file

    model = build_hf(folder, family)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            module = name.removesuffix(".weight")
            if not (name.endswith(".weight") and module.split(".")[-1] in LINEARS):
                continue
            g = p.shape[1] if group == -1 else group
            q, z, s = quantise(p.float(), g)
            p.copy_(dense(q, z, s, g))
            del state[name]
            packed = pack_awq(q, z, s) if method == "awq" else pack_gptq(q, z, s, g)
            state |= {f"{module}.{k}": v for k, v in packed.items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    quant = {"quant_method": method, "bits": 4, "group_size": group}
    quant |= {"version": "gemm", "zero_point": True} if method == "awq" else {"desc_act": False}
    _edit_config(folder, quantization_config=quant)
    return model


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def greedy_agrees(ours: torch.Tensor, ref: torch.Tensor, margin: float = 1e-3) -> None:
    """Teacher-forced argmax equal at every position whose reference top two differ by
    more than ``margin`` (and at least 3/4 of the positions are such)."""
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > margin
    assert clear.float().mean() > 0.75
    assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])


@pytest.mark.parametrize(
    ("family", "method", "group"),
    [("llama", "awq", 32), ("qwen2", "awq", -1), ("llama", "gptq", -1), ("qwen2", "gptq", 32)],
)
def test_prequantised_matches_transformers(tmp_path, family, method, group):
    model = save_prequantised(tmp_path, family, method, group)
    weights = load_hf_folder(tmp_path)
    layer = weights.layers[1]
    for field in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        w = getattr(layer, field)
        assert isinstance(w, Int4Weight) and w.group_size == 32, field
    # Exact: the 4-bit codes and scale/offset reproduce (q - z) * s bit for bit.
    hf = model.model.layers[1]
    assert torch.equal(layer.wq.dequantize(), hf.self_attn.q_proj.weight)
    assert torch.equal(layer.w_down.dequantize(), hf.mlp.down_proj.weight)
    ref = reference_logits(model, IDS)
    ours = our_logits(weights, IDS)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    greedy_agrees(ours, ref)
    int4 = our_logits(weights, IDS, fmt="int4")  # torch's CPU int4 kernel on the same codes
    torch.testing.assert_close(int4, ref, atol=2e-3, rtol=2e-3)
    greedy_agrees(int4, ref, margin=5e-3)
    label = f"{method.upper()}-g{96 if group == -1 else group}"
    assert weights.formats["model.layers.0.self_attn.q_proj"] == label


def test_model_line_names_prequantised_types(tmp_path):
    save_prequantised(tmp_path, "llama", "awq", 32)
    formats = load_hf_folder(tmp_path).formats
    assert describe_placement(formats, "int4", "bfloat16") == (
        "linears: AWQ-g32 x14 -> int4 as stored; other: F32 x7 -> float"
    )


def test_group_without_kernel_size_is_decoded_to_float(tmp_path):
    """Group 16 is no int4 kernel group: the exact float values, re-quantised at
    placement, and the model line says so."""
    model = save_prequantised(tmp_path, "llama", "gptq", 16)
    weights = load_hf_folder(tmp_path)
    assert torch.equal(weights.layers[0].wk, model.model.layers[0].self_attn.k_proj.weight)
    torch.testing.assert_close(
        our_logits(weights, IDS), reference_logits(model, IDS), atol=1e-4, rtol=1e-4
    )
    assert describe_placement(weights.formats, "int4", "bfloat16").startswith(
        "linears: GPTQ g16 (float) x14 -> re-quantised to int4"
    )


def test_fit_group_repeats_scales_exactly():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 256, (8, 512), dtype=torch.uint8, generator=gen)
    w = Int4Weight(q, torch.rand(8, 2, generator=gen), torch.randn(8, 2, generator=gen), 512)
    fitted = fit_group(w)
    assert fitted.group_size == 256 and torch.equal(fitted.dequantize(), w.dequantize())
    assert fit_group(Int4Weight(q[:, :8], w.scale, w.offset, 8)) is None


@pytest.mark.parametrize(
    ("quant", "field"),
    [
        ({"quant_method": "gptq", "bits": 4, "desc_act": True}, r"desc_act=true"),
        ({"quant_method": "gptq", "bits": 8}, r"bits=8"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "gptq_v2"}, "gptq_v2"),
        ({"quant_method": "gptq", "bits": 4, "is_marlin_format": True}, "marlin"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version='gemv'"),
        ({"quant_method": "awq", "bits": 4, "version": "marlin"}, "version='marlin'"),
        ({"quant_method": "gptq", "bits": 4, "lm_head": True}, "lm_head=true"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method='bitsandbytes'"),
        ({"quant_method": "exl2", "bits": 4}, "quant_method='exl2'"),
    ],
)
def test_other_quantisations_are_refused(tmp_path, quant, field):
    build_hf(tmp_path, "llama")
    _edit_config(tmp_path, quantization_config=quant)
    with pytest.raises(HFModelError, match=rf"config\.json: quantization_config.*{field}") as e:
        load_hf_folder(tmp_path)
    assert "AWQ (quant_method 'awq', version 'gemm'" in str(e.value)
    assert "hisparse quantize" in str(e.value)


def test_act_order_g_idx_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    save_prequantised(tmp_path, "llama", "gptq", 32)
    path = tmp_path / "model.safetensors"
    state = load_file(str(path))
    name = "model.layers.0.mlp.up_proj.g_idx"
    state[name] = state[name].flip(0).contiguous()
    save_file(state, str(path))
    with pytest.raises(HFModelError, match=r"up_proj.*g_idx is not k // 32"):
        load_hf_folder(tmp_path)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_mapped_weights_have_the_int4_kernels_layout(tmp_path, method):
    """The mapped ``Int4Weight`` passes the CUDA int4 launchers' layout checks (unit stride
    on the last dimension): an AWQ offset built from a transposed zero-point view did not,
    and the Triton path refused it on the H200 (2026-12-02)."""
    from kernels._launch import check_tensor

    save_prequantised(tmp_path, "qwen2", method, 32)
    for name, w in vars(load_hf_folder(tmp_path).layers[0]).items():
        if not hasattr(w, "group_size"):
            continue
        check_tensor(f"{name}.q", w.q, 2, (torch.uint8,))
        for part in ("scale", "offset"):
            check_tensor(f"{name}.{part}", getattr(w, part), 2, (torch.float32,))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_awq_weight_runs_on_cuda_int4_paths(tmp_path):
    """The mapped weight through every CUDA int4 path (tinygemm at 1 row, the Triton
    dequant-matmul at 8-63, dense above) equals the dense matmul of the same values."""
    save_prequantised(tmp_path, "qwen2", "awq", 32)
    w = load_hf_folder(tmp_path).layers[0].w_down
    dev = torch.device("cuda")
    lin = make_linear(w, None, "int4", dev, torch.bfloat16)
    ref_w = w.dequantize().to(dev)
    for rows in (1, 8, 16, 64):
        x = torch.randn(rows, w.shape[1], device=dev, dtype=torch.bfloat16)
        ref = x.float() @ ref_w.T
        torch.testing.assert_close(lin(x).float(), ref, atol=3e-2, rtol=3e-2)
