#!/usr/bin/env bash
# hisparse bench on one H200 (issue 7): decode throughput against concurrency for the dense
# and all-resident sparse baselines, the hierarchy and the no-IO oracle, every mode under
# the same 48 GiB budget; qwen2.5-7b shape with synthetic 4-bit weights; contexts 32K,
# 128K and 256K (prompt + decoded tokens); concurrency 1..32 (each mode stops where
# admission stops); 32 timed decode steps per point; and a SHORTENED soak: 300 steps of
# 8 jobs at 32K (the issue's default is 2000).
#
# 1. Once, on the CPU box, with the project venv active (the device machine lacks the
#    embedded GGUF the tokenizer is read from, and ../shared/corpus does not travel):
#       bash scripts/bench_capacity.sh prep    # -> .bench/corpus_tokens.json (~1 MB)
# 2. On the H200, carrying [".bench"]:
#       bash scripts/bench_capacity.sh         # -> $OUT
#    Files back (7): bench.json, bench.log, gpu.txt, throughput_32K.png,
#    throughput_128K.png, throughput_256K.png, soak_step_latency.png.
#
# Runtime estimate, about 5 minutes (H200 figures from DESIGN.md / KINDS.md; CPU-side
# costs scaled from runs here): start-up, synthetic weights and int4 packing ~45 s; window
# prefill of 2 + 2 + 1 documents (bf16 linears ~600 TFLOP/s, 1024-token window) ~35 s;
# the pinned 56 GiB host pool, once ~30 s; Triton compiles ~30 s; decode of the
# sparse / hierarchical / noio points (~25-40 ms a step x 38 steps x ~40 points) ~60 s,
# plus their KV imports (~850 GiB device -> pinned at ~45 GB/s) ~20 s; dense (reference
# attention, ~0.4-1 us per token of KV a step) 65-180 s; soak ~15 s. --time-limit 420
# starts no run after 7 minutes (the 256K points are the first to go if dense is slower) and `timeout
# 570` ends the command inside the 10-minute limit; bench.json is rewritten after every
# run, so a cut run still reports every point it finished.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
TOKENS="${CORPUS_TOKENS:-.bench/corpus_tokens.json}"

if [ "${1:-}" = "prep" ]; then
  "$PY" -m hisparse_cli.bench_cmd --write-corpus-tokens "$TOKENS" || exit
  grep -qx '/.bench/' .git/info/exclude 2>/dev/null || echo '/.bench/' >>.git/info/exclude
  exit 0
fi

OUT="${OUT:-bench_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
[ -f "$TOKENS" ] || { echo "missing $TOKENS: run 'bash scripts/bench_capacity.sh prep' first and carry .bench" >&2; exit 2; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

timeout 570 "$PY" -m hisparse_cli.bench_cmd \
  --out "$OUT" --model synthetic:qwen2.5-7b --preset h200 --memory-budget 48 \
  --contexts 32K,128K,256K --concurrency 1,2,4,8,16,32 \
  --modes dense,sparse,hierarchical,noio \
  --decode-steps 32 --warmup-steps 3 --profile-steps 3 \
  --docs 2 --master-gb 24 --prefill window --prefill-window 1024 --host-pool 56 \
  --soak 300 --soak-batch 8 --soak-every 100 \
  --time-limit 420 --corpus-tokens "$TOKENS" 2>&1 | tee "$OUT/bench.log"
exit "${PIPESTATUS[0]}"
