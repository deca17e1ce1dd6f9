"""Where an fp8 KV record's scale should live: reconstruction error on real keys/values.

Prefills corpus documents with the real model (the embedded SmolLM2-135M-Instruct by
default, CPU, fp32), takes every layer's K (after RoPE) and V from an all-resident cache,
and quantises them to float8 e4m3 with the scale at each granularity:

* ``row-pow2`` — one power-of-two scale per (token, layer, KV head, K|V) row (what
  ``kv_host_dtype=fp8`` stores, :mod:`kernels.fp8_kv`: one int8 exponent per row);
* ``row`` — the same rows, exact scale ``amax / 448`` (an fp32 per row);
* ``record`` — one scale per (page of ``--page-size`` tokens, layer, KV head, K|V): the
  page x KV-head record, ``amax / 448``;
* ``head`` — one scale per (layer, KV head, K|V) over the whole prompt ``amax / 448``
  (calibrated on this very prompt, so an upper bound on a static per-head scale);
* ``none`` — the raw values cast (saturated to +-448).

For each: relative error ``||x' - x|| / ||x||`` of K and V (over all layers), the mean
relative error of the attention logits ``q . k`` against a random real query of the same
layer (the last prompt position's query is not kept, so the last key stands in for it),
and the scale bytes per element. Prints a table and writes JSON.

Usage::

    OMP_NUM_THREADS=1 python scripts/measure_fp8_kv.py --out docs/bench/fp8_kv_error.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig, SamplingParams  # noqa: E402
from engine.events import Job  # noqa: E402
from engine.load import load_engine  # noqa: E402
from engine.measure.bench_kv import corpus_dir  # noqa: E402
from kernels.fp8_kv import FP8, fp8_round_ref  # noqa: E402

FP8_MAX = 448.0


def _cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` quantised with ``scale`` (broadcast) and back, saturating at 448."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale


def schemes(x: torch.Tensor, page_size: int) -> dict[str, torch.Tensor]:
    """``x [T, Hkv, D]`` (one layer's keys or values) reconstructed by each scheme."""
    t, hkv, d = x.shape
    tiny = torch.finfo(torch.float32).tiny
    row = x.abs().amax(-1, keepdim=True).clamp_min(tiny) / FP8_MAX
    n = -(-t // page_size)
    padded = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, n * page_size - t))
    rec = padded.view(n, page_size, hkv, d).abs().amax((1, 3), keepdim=True).clamp_min(tiny)
    rec = (rec / FP8_MAX).expand(n, page_size, hkv, 1).reshape(n * page_size, hkv, 1)[:t]
    head = x.abs().amax((0, 2), keepdim=True).clamp_min(tiny) / FP8_MAX
    return {
        "row-pow2": fp8_round_ref(x),
        "row": _cast(x, row),
        "record": _cast(x, rec),
        "head": _cast(x, head),
        "none": _cast(x, torch.ones(())),
    }


SCALE_BYTES = {"row-pow2": 1, "row": 4, "record": 4, "head": 0, "none": 0}
"""Scale bytes per row of D (record: 4 per page_size rows; head: negligible)."""


def kv_of(engine, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(K, V)`` ``[T, Hkv, D]`` of a prefill of ``ids`` (all-resident cache)."""
    req = engine.open_request(Job("m", tuple(ids), SamplingParams(max_tokens=1)))
    engine.prefill(req)
    c = engine.cache
    pages = torch.tensor(c.seqs[req.seq_id].pages[: c.pages_for(len(ids))])
    out = []
    for layer in range(c.num_layers):
        rec = c.pool[layer][pages].float()  # [n, Hkv, 2, S, D]
        tok = rec.permute(0, 3, 1, 2, 4).reshape(-1, rec.shape[1], 2, rec.shape[-1])[: len(ids)]
        out.append((tok[:, :, 0].clone(), tok[:, :, 1].clone()))
    engine.close_request(req)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus", type=Path, default=corpus_dir())
    p.add_argument("--docs", default="howto-sorting.txt", help="comma-separated corpus files")
    p.add_argument("--tokens", type=int, default=1024, help="prompt tokens per document")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    cfg = EngineConfig(hierarchical=False, host_pool_gb=0.5, max_batch=1, page_size=args.page_size)
    engine = load_engine(cfg, args.model)
    sums: dict[str, dict[str, float]] = {}
    for name in args.docs.split(","):
        text = (args.corpus / name).read_text("utf-8")
        ids = engine.tokenizer.encode(text)[: args.tokens]
        for k, v in kv_of(engine, ids):
            q = k[-1:]  # [1, Hkv, D]: a real key direction as the query
            logits = (q * k).sum(-1)  # [T, Hkv]
            for which, x in (("k", k), ("v", v)):
                for scheme, y in schemes(x, args.page_size).items():
                    acc = sums.setdefault(scheme, {})
                    acc[f"{which}_err2"] = acc.get(f"{which}_err2", 0.0) + float((y - x).pow(2).sum())
                    acc[f"{which}_norm2"] = acc.get(f"{which}_norm2", 0.0) + float(x.pow(2).sum())
                    if which == "k":
                        lq = (q * y).sum(-1)
                        err = (lq - logits).abs().sum() / logits.abs().sum()
                        acc["logit_err"] = acc.get("logit_err", 0.0) + float(err)
                        acc["n"] = acc.get("n", 0) + 1
    rows = {}
    print(f"{'scheme':10} {'K rel err':>10} {'V rel err':>10} {'qk rel err':>11} {'scale B/row':>12}")
    for scheme, acc in sums.items():
        row = {
            "k_rel_err": (acc["k_err2"] / acc["k_norm2"]) ** 0.5,
            "v_rel_err": (acc["v_err2"] / acc["v_norm2"]) ** 0.5,
            "qk_rel_err": acc["logit_err"] / acc["n"],
            "scale_bytes_per_row": SCALE_BYTES[scheme] / (args.page_size if scheme == "record" else 1),
        }
        rows[scheme] = row
        print(
            f"{scheme:10} {row['k_rel_err']:10.4f} {row['v_rel_err']:10.4f} "
            f"{row['qk_rel_err']:11.4f} {row['scale_bytes_per_row']:12.3f}"
        )
    result = {
        "what": "fp8 e4m3 reconstruction error of real K/V by scale granularity",
        "model": args.model or "embedded SmolLM2-135M-Instruct",
        "docs": args.docs,
        "tokens": args.tokens,
        "page_size": args.page_size,
        "schemes": rows,
        "machine": platform.node(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python scripts/measure_fp8_kv.py " + " ".join(argv or sys.argv[1:]),
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
