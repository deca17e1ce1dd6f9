"""Error of re-quantising higher-precision GGUF linears to int4 (docs/performance.md,
"GGUF tensor types: what int4 placement costs").

With ``weight_format=int4`` a linear stored as Q8_0 / Q5_x / Q6_K is dequantised
(``gguf.quants.dequantize``) and re-quantised by :func:`engine.weights.quant.make_linear`
(asymmetric min/max, group 128, or 32 where K is not a multiple of 128). This script
measures that step on the embedded SmolLM2-135M model's tensors:

* ``token_embd.weight`` is stored as Q8_0 (a real 8-bit tensor);
* the Q4_1 linears are re-encoded with gguf-py's quantisers into Q8_0 and Q5_1 (the
  types gguf-py can write; Q5_K/Q6_K sit between them in precision), then decoded and
  re-quantised to int4 as the engine does.

Reported per source type: relative RMS error ``||W_src - W_int4|| / ||W_src||`` of the
re-quantisation, against the error the source encoding itself had (``||W - W_src||``).
Usage: ``python scripts/measure_requant_error.py [model.gguf]``.
"""

from __future__ import annotations

import sys

import numpy as np
import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def requant(w: torch.Tensor) -> torch.Tensor:
    from engine.weights.quant import quantize_int4

    g = 128 if w.shape[1] % 128 == 0 else 32
    return quantize_int4(w, g).dequantize()


def main(path: str | None = None) -> None:
    import gguf

    from engine.weights.embedded import default_model_path

    reader = gguf.GGUFReader(str(path or default_model_path()))
    rows: dict[str, list[tuple[float, float]]] = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        if len(shape) != 2:
            continue
        w = torch.from_numpy(
            np.array(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), np.float32)
        ).reshape(shape)
        if t.name == "token_embd.weight":
            rows.setdefault(f"{t.tensor_type.name} (stored, {t.name})", []).append(
                (float("nan"), rel(requant(w), w))
            )
            continue
        if not t.name.startswith("blk.") or int(t.name.split(".")[1]) % 6:
            continue  # every 6th layer: enough, and quick
        for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q5_1):
            src = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), qtype), qtype)
            src = torch.from_numpy(np.array(src, np.float32)).reshape(shape)
            rows.setdefault(f"{qtype.name} (re-encoded Q4_1 linears)", []).append(
                (rel(src, w), rel(requant(src), src))
            )
    print(f"{'source':40s} {'tensors':>7s} {'source err':>10s} {'int4 re-quant err':>17s}")
    for name, vals in rows.items():
        src = np.nanmean([v[0] for v in vals]) if any(v[0] == v[0] for v in vals) else float("nan")
        print(f"{name:40s} {len(vals):7d} {src:10.4f} {np.mean([v[1] for v in vals]):17.4f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
