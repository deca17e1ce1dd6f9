"""Chunked causal prefill attention (:func:`engine.model.llama.prefill_attention`): a
prompt attended chunk by chunk equals one causal pass over it, on awkward shapes (GQA
groups 1/3/4, head_dim 64/80/128, chunks that do not divide the prompt), on the CPU (the
masked path) and on CUDA (the flash kernel, bottom-right causal) against the masked path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import llama
from engine.model.llama import prefill_attention

SHAPES = [(9, 3, 64, 300, 128), (8, 8, 80, 257, 64), (32, 8, 128, 1000, 384)]


def _chunked(q, k, v, chunk):
    outs = []
    for s in range(0, q.shape[0], chunk):
        e = min(s + chunk, q.shape[0])
        outs.append(prefill_attention(q[s:e], k[:e], v[:e], s))
    return torch.cat(outs)


def _whole(q, k, v):
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    return out[0].transpose(0, 1)


def _qkv(hq, hkv, d, t, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(hq * 1000 + t)
    return [
        torch.randn(t, h, d, generator=g).to(device=device, dtype=dtype)
        for h in (hq, hkv, hkv)
    ]


@pytest.mark.parametrize("hq,hkv,d,t,chunk", SHAPES)
def test_chunked_prefill_equals_one_causal_pass_cpu(hq, hkv, d, t, chunk):
    q, k, v = _qkv(hq, hkv, d, t, "cpu", torch.float32)
    torch.testing.assert_close(_chunked(q, k, v, chunk), _whole(q, k, v), atol=2e-5, rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("hq,hkv,d,t,chunk", SHAPES)
def test_flash_lower_right_equals_masked_path_cuda(hq, hkv, d, t, chunk, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, k, v = _qkv(hq, hkv, d, t, "cuda", torch.bfloat16)
    llama._LOWER_RIGHT_FLASH[0] = True
    flash = _chunked(q, k, v, chunk)
    assert llama._LOWER_RIGHT_FLASH[0], "the flash kernel refused these inputs"
    monkeypatch.setattr(llama, "_LOWER_RIGHT_FLASH", [False])
    masked = _chunked(q, k, v, chunk)
    torch.testing.assert_close(flash.float(), masked.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(flash.float(), _whole(q, k, v).float(), atol=2e-2, rtol=2e-2)
