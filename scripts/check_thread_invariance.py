"""Do torch's CPU products give the same bits on 1 and on 2 threads? (README, "CPU threads")

For the embedded model's shapes (hidden 576, FFN 1536, vocabulary 49152): ``F.linear`` in
bf16 and float32 at prefill row counts, torch's int4 kernel with bf16 activations at decode
and prefill row counts, and the one-row float32 LM head. Prints a table and writes JSON.

    OMP_NUM_THREADS=2 python scripts/check_thread_invariance.py --out thread_invariance.json

Random inputs (seeded); a row "differs" means some output bit changed between the thread
counts, which is enough for greedy decoding of a small model to take another path.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from engine.weights.quant import Int4Linear, quantize_int4

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]  # (N, K) of the layers
ROWS = [1, 16, 64, 512, 1000, 2048]


def same_on_1_and_2(fn) -> bool:
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        outs.append(fn())
    return torch.equal(*outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="thread_invariance.json")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen)
        int4 = Int4Linear(quantize_int4(w, 32), None, torch.device("cpu"), torch.float32)
        int4.set_activation_dtype(torch.bfloat16)
        for m in ROWS:
            x = torch.randn(m, k, generator=gen)
            xb, wb = x.bfloat16(), w.bfloat16()
            for name, fn in (
                ("F.linear bf16", lambda x=xb, w=wb: F.linear(x, w)),
                ("F.linear float32", lambda x=x, w=w: F.linear(x, w)),
                ("int4 kernel, bf16 activations", lambda x=xb, lin=int4: lin(x)),
            ):
                same = same_on_1_and_2(fn)
                rows_out.append({"op": name, "rows": m, "n": n, "k": k, "same": same})
    head = torch.randn(49152, 576, generator=gen)
    x = torch.randn(1, 576, generator=gen)
    rows_out.append(
        {"op": "LM head float32", "rows": 1, "n": 49152, "k": 576,
         "same": same_on_1_and_2(lambda: F.linear(x, head))}
    )  # fmt: skip
    print(f"{'op':32} {'M x N x K':>20}  1 vs 2 threads")
    for r in rows_out:
        print(f"{r['op']:32} {r['rows']:>6} x {r['n']:>5} x {r['k']:>5}  "
              f"{'same' if r['same'] else 'DIFFERS'}")  # fmt: skip
    meta = {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({**meta, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
