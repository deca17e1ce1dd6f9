#!/usr/bin/env bash
# On a CUDA machine, in one command: the kernel tests (natively on the GPU) and the kernel
# benchmark. Logs, JUnit XML and the benchmark JSON go under $OUT (default ./bench_out).
# Usage: OUT=dir bash scripts/gpu_suite.sh [bench_kernels.py options, e.g. --sections attention]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench_out}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv >"$OUT/gpu.txt" 2>&1
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

timeout "${TEST_TIMEOUT_S:-300}" "$PY" -m pytest -q -p no:cacheprovider \
  tests/kernels/test_kernels_cuda.py tests/kernels/test_kernels.py --junitxml="$OUT/kernels_junit.xml" 2>&1 |
  tee "$OUT/kernels_tests.log" | grep -v "^tests/.*PASSED"
tests_rc=${PIPESTATUS[0]}

timeout "${BENCH_TIMEOUT_S:-420}" "$PY" scripts/bench_kernels.py --out "$OUT/bench_kernels.json" "$@" 2>&1 |
  tee "$OUT/bench_kernels.log"
bench_rc=${PIPESTATUS[0]}

echo "kernel tests rc=$tests_rc, benchmark rc=$bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
