"""Time chunked causal prefill attention on a CUDA GPU: the flash kernel with
bottom-right causal alignment (what :func:`engine.model.llama.prefill_attention` uses for
a chunk after the first) against SDPA over a materialised mask (what it used before),
one layer of a whole prompt in ``--chunk``-token chunks, for SmolLM2-135M (9/3 heads,
D 64) and Llama-3.1-8B (32/8, D 128) head shapes. Prints a table and writes JSON.

    python scripts/bench_prefill.py --contexts 8192,32768,65536 --out prefill.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from engine.model import llama

SHAPES = {"smollm2-135m": (9, 3, 64), "llama3.1-8b": (32, 8, 128)}


def layer_ms(hq: int, hkv: int, d: int, t: int, chunk: int, flash: bool) -> float:
    """Median ms of one layer's attention over a ``t``-token prompt in chunks."""
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    llama._LOWER_RIGHT_FLASH[0] = flash

    def run() -> None:
        for s in range(0, t, chunk):
            e = min(s + chunk, t)
            llama.prefill_attention(q[s:e], k[:e], v[:e], s)

    run()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    if flash and not llama._LOWER_RIGHT_FLASH[0]:
        raise RuntimeError("the flash kernel refused the inputs")
    return sorted(times)[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="8192,32768,65536")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    print(f"{'shape':>14} {'tokens':>7} {'masked ms':>10} {'flash ms':>9} {'speed-up':>8}")
    for name, (hq, hkv, d) in SHAPES.items():
        for t in (int(x) for x in args.contexts.split(",")):
            masked = layer_ms(hq, hkv, d, t, args.chunk, False)
            flash = layer_ms(hq, hkv, d, t, args.chunk, True)
            rows.append(dict(shape=name, tokens=t, chunk=args.chunk, masked_ms=masked, flash_ms=flash))
            print(f"{name:>14} {t:>7} {masked:>10.2f} {flash:>9.2f} {masked / flash:>7.2f}x", flush=True)
    res = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
