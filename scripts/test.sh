#!/usr/bin/env bash
# The test suite on a CPU machine: everything except tests that need a CUDA GPU (what CI
# runs). `scripts/test.sh --fast` leaves out the slow ones too (the real embedded model,
# big sweeps; marked in tests/conftest.py): a few minutes on 2 cores.
# Tests run in parallel, one pytest-xdist worker per core (HISPARSE_TEST_WORKERS=N to
# choose, 0 for one process), each with one torch thread (OMP_NUM_THREADS, unless set)
# so workers do not oversubscribe the cores.
# Triton kernels run under TRITON_INTERPRET=1 (set by tests/conftest.py for test_kernels.py).
# Further arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
MARKS="not cuda"
if [[ "${1:-}" == "--fast" ]]; then
  shift
  MARKS="not cuda and not slow"
fi
WORKERS="${HISPARSE_TEST_WORKERS:-auto}"
PARALLEL=()
if [[ "$WORKERS" != "0" ]] && "$VENV/bin/python" -c "import xdist" 2>/dev/null; then
  PARALLEL=(-n "$WORKERS" --dist worksteal)
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
exec "$VENV/bin/python" -m pytest -q -m "$MARKS" "${PARALLEL[@]}" "$@"
