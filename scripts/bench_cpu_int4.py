"""CPU linear layers: torch's int4 kernel (``_weight_int4pack_mm_for_cpu``, bf16 activations,
group 32) against an fp32 GEMM on dequantised weights, on SmolLM2-135M shapes. This is why
``weight_format: auto`` picks ``float`` on CPU.

Usage::

    python scripts/bench_cpu_int4.py [--threads 2] [--out bench_cpu_int4.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine.weights.quant import Int4Linear, quantize_int4

SHAPES = ((576, 576), (1536, 576), (576, 1536))  # (N, K)
ROWS = (1, 8, 256)


def median_us(fn, repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=Path, default=Path("bench_cpu_int4.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    print(f"{'N x K':>12s} {'M':>4s} {'int4 bf16 us':>13s} {'fp32 us':>9s}")
    for n, k in SHAPES:
        w = torch.randn(n, k) * 0.02
        q = quantize_int4(w, 32)
        int4 = Int4Linear(q, None, torch.device("cpu"), torch.bfloat16)
        dense = q.dequantize(torch.float32)
        for m in ROWS:
            x = torch.randn(m, k)
            xb = x.to(torch.bfloat16)
            t_int4 = median_us(lambda f=int4, a=xb: f(a))
            t_fp32 = median_us(lambda a=x, w=dense: a @ w.t())
            rows.append({"n": n, "k": k, "m": m, "int4_bf16_us": t_int4, "fp32_us": t_fp32})
            print(f"{n:>5d} x {k:<5d} {m:>4d} {t_int4:13.1f} {t_fp32:9.1f}")
    args.out.write_text(json.dumps({"threads": args.threads, "torch": torch.__version__,
                                    "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
