#!/usr/bin/env bash
# hisparse bench on an H200 (issue 7): decode throughput against concurrency for the dense
# and all-resident sparse baselines, the hierarchy and the no-IO oracle, every mode under
# the same 48 GiB budget (the dual-4090 card emulated), synthetic 4-bit weights of a
# published shape, contexts counted as prompt + decoded tokens.
#
# 1. Once, on the CPU box, with the project venv active (the device machine lacks the
#    embedded GGUF the tokenizer is read from, and ../shared/corpus does not travel):
#       bash scripts/bench_capacity.sh prep    # -> .bench/corpus_tokens.json (~1 MB)
# 2. On the GPU machine, carrying [".bench"]:
#       [HOST_POOL=GiB] [GPU=n] bash scripts/bench_capacity.sh SCENARIO   # -> $OUT
#
# Scenarios (the host pool bounds the hierarchy's concurrency; size HOST_POOL to the
# machine: ~200 on the 2 x H200 box with 256 GiB RAM, ~56 on the 1 x H200 box):
#   qwen     qwen2.5-7b shape, 128K and 256K, concurrency 1..24, then a 2000-step soak
#            (8 jobs at 128K); CONTEXTS / LEVELS override the sweep.
#   llama31  llama3.1-8b shape, 128K and 256K, concurrency 1..16.
#   seed     the seed scenario: llama2-13b-gqa8 shape (Llama-2-13B with 8 KV heads), 256K jobs, as many as the
#            host pool holds (40 GiB of bf16 KV each); the planner's answer is printed.
#   quick    qwen2.5-7b, 32K and 128K, concurrency 1, 4, 8 (a smoke run, ~3 min).
#   overlap  qwen2.5-7b, 128K, concurrency 1, 4, 8: the hierarchy with the decode
#            write-through on the compute stream (hierarchical, the default), on a copy
#            stream (copystream), with near-miss prefetch on the copy stream (prefetch;
#            PREFETCH pages, default a quarter of top-k), and the no-IO oracle; 64 timed
#            steps per run.
# MODES overrides the modes of any scenario (comma list, see `hisparse bench --help`);
# DEVICE_BUFFER sets the hot buffer in tokens per (job, layer, KV head) (default: the h200
# preset's 4096 = 2 x top_k; the dual4090 preset uses 8192). KV_HOST_DTYPE=fp8 stores the
# host pool as fp8 records (kv_host_dtype; default bf16): about twice the jobs per host GiB.
# Files back: bench.json, bench.log, gpu.txt and the PNG plots. A rerun into the same OUT
# replaces them all (bench --force: the earlier plots are removed first).
#
# On virtual machines whose memory grows on demand (MemAvailable reads far less than the
# machine has), HOST_MEMORY_GB declares the real size (HISPARSE_HOST_MEMORY_GB).
# --time-limit starts no run after LIMIT seconds (default 420) and `timeout` ends the
# command inside a 10-minute limit; bench.json is rewritten after every run, so a cut run
# still reports every point it finished.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
TOKENS="${CORPUS_TOKENS:-.bench/corpus_tokens.json}"
SCENARIO="${1:-qwen}"

if [ "$SCENARIO" = "prep" ]; then
  "$PY" -m hisparse_cli.bench_cmd --write-corpus-tokens "$TOKENS" || exit
  grep -qx '/.bench/' .git/info/exclude 2>/dev/null || echo '/.bench/' >>.git/info/exclude
  exit 0
fi

OUT="${OUT:-bench_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
[ -n "${HOST_MEMORY_GB:-}" ] && export HISPARSE_HOST_MEMORY_GB="$HOST_MEMORY_GB"
[ -n "${GPU:-}" ] && export CUDA_VISIBLE_DEVICES="$GPU"
[ -f "$TOKENS" ] || { echo "missing $TOKENS: run 'bash scripts/bench_capacity.sh prep' first and carry .bench" >&2; exit 2; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
free -g >>"$OUT/gpu.txt"

SOAK=()
EXTRA=()
[ -n "${PREFETCH:-}" ] && EXTRA+=(--prefetch-pages "$PREFETCH")
[ -n "${DEVICE_BUFFER:-}" ] && EXTRA+=(--device-buffer "$DEVICE_BUFFER")
MASTER=24
DOCS=2
case "$SCENARIO" in
  qwen)
    MODEL=synthetic:qwen2.5-7b; CONTEXTS="${CONTEXTS:-128K,256K}"; LEVELS="${LEVELS:-1,2,4,8,16,24}"
    SOAK=(--soak 2000 --soak-batch 8 --soak-every 250) ;;
  llama31)
    MODEL=synthetic:llama3.1-8b; CONTEXTS="${CONTEXTS:-128K,256K}"; LEVELS="${LEVELS:-1,2,4,8,12,16}" ;;
  seed)
    MODEL=synthetic:llama2-13b-gqa8; CONTEXTS="${CONTEXTS:-256K}"; LEVELS="${LEVELS:-1,2,4,5,6,8}"
    MASTER=44; DOCS=1
    "$PY" -m hisparse_cli plan --preset dual4090 --model llama2-13b-gqa8 --jobs 8 --context 256K \
      2>&1 | tee "$OUT/seed_plan.txt" ;;
  quick)
    MODEL=synthetic:qwen2.5-7b; CONTEXTS="${CONTEXTS:-32K,128K}"; LEVELS="${LEVELS:-1,4,8}" ;;
  overlap)
    MODEL=synthetic:qwen2.5-7b; CONTEXTS="${CONTEXTS:-128K}"; LEVELS="${LEVELS:-1,4,8}"
    MODES="${MODES:-hierarchical,copystream,prefetch,noio}"; STEPS="${STEPS:-64}" ;;
  *) echo "unknown scenario $SCENARIO (qwen, llama31, seed, quick, overlap, prep)" >&2; exit 2 ;;
esac

timeout "${TIMEOUT:-570}" "$PY" -m hisparse_cli.bench_cmd \
  --out "$OUT" --force --model "$MODEL" --preset h200 --memory-budget 48 \
  --contexts "$CONTEXTS" --concurrency "$LEVELS" \
  --modes "${MODES:-dense,sparse,hierarchical,noio}" \
  --decode-steps "${STEPS:-16}" --warmup-steps 3 --profile-steps 2 \
  --docs "$DOCS" --master-gb "$MASTER" --prefill window --prefill-window 1024 \
  --host-pool "${HOST_POOL:-56}" --kv-host-dtype "${KV_HOST_DTYPE:-bf16}" "${SOAK[@]}" "${EXTRA[@]}" \
  --time-limit "${LIMIT:-420}" --corpus-tokens "$TOKENS" 2>&1 | tee "$OUT/bench.log"
exit "${PIPESTATUS[0]}"
