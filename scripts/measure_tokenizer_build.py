"""What building the tokenizer from a GGUF's vocabulary costs each run, and what a cache
of the built ``tokenizers`` JSON could save.

Each of ``--runs`` fresh processes opens the GGUF as ``engine.load`` does
(``gguf.open_reader``), times ``TextTokenizer.from_gguf(reader, reference="llama.cpp")``
(the ``tokenizer`` step of a run's start-up), then times ``tokenizers.Tokenizer.from_str``
of that tokenizer's JSON (what a cached load would cost at least, besides reading the
file). Prints the medians and writes JSON.

    python scripts/measure_tokenizer_build.py --runs 6 \\
        --out docs/bench/tokenizer_build_cpu_2026-12-02.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

_CHILD = """
import json, sys, time
from engine.weights import gguf
from engine.text.tokenizer import TextTokenizer
from tokenizers import Tokenizer
path = sys.argv[1]
reader = gguf.open_reader(path)
t0 = time.perf_counter()
tok = TextTokenizer.from_gguf(reader, reference="llama.cpp")
t1 = time.perf_counter()
text = tok.backend.to_str()
t2 = time.perf_counter()
Tokenizer.from_str(text)
t3 = time.perf_counter()
print(json.dumps({"build_s": t1 - t0, "from_str_s": t3 - t2, "json_chars": len(text)}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="GGUF file (default: the embedded model)")
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.model is None:
        from engine.weights.embedded import default_model_path

        args.model = str(default_model_path())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rows = []
    for _ in range(args.runs):
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, args.model], capture_output=True, text=True,
            check=True, env=env,
        )  # fmt: skip
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    build = statistics.median(r["build_s"] for r in rows)
    load = statistics.median(r["from_str_s"] for r in rows)
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "model": Path(args.model).name,
        "runs": rows,
        "median_build_s": build,
        "median_from_str_s": load,
        "largest_saving_s": build - load,
        "load_average": os.getloadavg(),
    }
    print(
        f"{Path(args.model).name}: from_gguf {build:.3f} s, Tokenizer.from_str of its JSON "
        f"{load:.3f} s (a cache saves at most {build - load:.3f} s); "
        f"load {result['load_average'][0]:.2f}"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
