"""GGUF loader against transformers, on tiny random models written with gguf-py.

Each test saves a transformers model as a Hugging Face folder (the reference), writes the
same weights as a GGUF in llama.cpp's conventions (:mod:`tiny_models`), loads the GGUF
through :func:`engine.load.load_weights` and the engine's RoPE
(:func:`engine.load.context_limit_and_rope`) and compares logits with transformers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from tiny_models import build_hf, reference_logits, write_gguf  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.load import context_limit_and_rope, load_weights  # noqa: E402
from engine.model.llama import LlamaModel, prefill_attention  # noqa: E402

IDS = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3))
ATOL = 1e-4

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # puts D=16's wavelengths in all three bands
    "rope_theta": 10000.0,
}


def engine_logits(path, ids: torch.Tensor, fmt: str = "float") -> torch.Tensor:
    """Full-sequence forward of the model at ``path`` as the engine places it."""
    weights, _, _ = load_weights(str(path))
    cfg = weights.config
    _, rope = context_limit_and_rope(cfg, EngineConfig())
    model = LlamaModel(weights, torch.device("cpu"), torch.float32, fmt, rope)
    h = model.embed_tokens(ids)
    positions = torch.arange(len(ids))
    for i in range(cfg.num_layers):
        q, k, v = model.qkv(i, h, positions)
        h = model.finish_layer(i, h, prefill_attention(q, k, v, 0))
    return model.logits(h)


# ----------------------------------------------------------------------------- RoPE


@pytest.fixture(scope="module")
def llama31(tmp_path_factory):
    """A Llama-3.1-style model (``llama3`` RoPE scaling) and its GGUF with
    ``rope_freqs.weight`` as llama.cpp's converter writes it (no scaling metadata)."""
    folder = tmp_path_factory.mktemp("llama31")
    model = build_hf(folder, "llama", rope_parameters=LLAMA3_ROPE)
    d = model.config.head_dim
    unscaled = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaled = model.model.rotary_emb.inv_freq.double()  # transformers' _compute_llama3_parameters
    factors = (unscaled / scaled).float().numpy()
    path = write_gguf(folder / "m.gguf", model, "llama", rope_freqs=factors)
    return model, path, factors


def test_rope_freqs_factors_direction(llama31):
    """llama.cpp's factors are >= 1 (1 for short wavelengths, ``factor`` for long ones) and
    ggml divides each frequency by its factor; the loader keeps them as they are."""
    _, path, factors = llama31
    assert factors[0] == pytest.approx(1.0) and factors[-1] == pytest.approx(8.0)
    assert ((factors > 1) & (factors < 8)).any()  # the smooth band is exercised
    cfg = load_weights(str(path))[0].config
    assert cfg.rope_scaling is None
    np.testing.assert_array_equal(np.array(cfg.rope_freq_factors, dtype=np.float32), factors)


def test_rope_freqs_matches_transformers_llama3(llama31):
    model, path, _ = llama31
    torch.testing.assert_close(
        engine_logits(path, IDS), reference_logits(model, IDS), atol=ATOL, rtol=ATOL
    )


def test_rope_freqs_wrong_length_is_refused(tmp_path):
    model = build_hf(tmp_path, "llama")
    path = write_gguf(tmp_path / "m.gguf", model, "llama", rope_freqs=np.ones(5, np.float32))
    with pytest.raises(ValueError, match=r"m\.gguf.*rope_freqs\.weight.*8"):
        load_weights(str(path))
