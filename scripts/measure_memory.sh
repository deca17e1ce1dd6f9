#!/usr/bin/env bash
# Plan vs measured peak memory per device (issue 6) on the GPU machine, in one command:
# scripts/measure_memory.py's GPU scenarios (a: h200 on one GPU; b: dual4090 --memory-budget 48,
# parallel data on cuda:0,cuda:1; c: the same as a pipeline; d: b with both workers on cuda:0,
# only when one GPU is present), synthetic qwen2.5-7b weights, 4 jobs of 32K positions each,
# 16 generated tokens. Expected ~4 minutes on 2 x H200 (per scenario: start-up and synthetic
# 4-bit weights ~45 s, pinned 7 GiB pool, Triton compiles in the first, 4 x 32K prefills);
# the script starts no scenario after 300 s and `timeout 570` ends it inside a 10-minute limit.
#
# 1. Once, on the CPU box (the GPU machine has neither the embedded GGUF nor ../shared/corpus):
#       bash scripts/bench_capacity.sh prep      # -> .bench/corpus_tokens.json (~0.75 MB)
# 2. On the GPU machine, carrying [".bench"]:
#       bash scripts/measure_memory.sh           # -> $OUT (default bench_out)
#    Files back (3): memory.json (every figure, rewritten after each scenario), memory.log
#    (the tables), gpu.txt. Extra arguments go to measure_memory.py (e.g. --scenarios b,c).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
TOKENS="${CORPUS_TOKENS:-.bench/corpus_tokens.json}"
OUT="${OUT:-bench_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
[ -f "$TOKENS" ] || { echo "missing $TOKENS: run 'bash scripts/bench_capacity.sh prep' first and carry .bench" >&2; exit 2; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

timeout 570 "$PY" scripts/measure_memory.py --corpus-tokens "$TOKENS" --out "$OUT/memory.json" \
  --time-limit 300 "$@" 2>&1 | tee "$OUT/memory.log"
exit "${PIPESTATUS[0]}"
