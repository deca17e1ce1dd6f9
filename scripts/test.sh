#!/usr/bin/env bash
# The test suite on a CPU machine: everything except tests that need a CUDA GPU.
# Triton kernels run under TRITON_INTERPRET=1 (set by tests/conftest.py for test_kernels.py).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
exec "$VENV/bin/python" -m pytest -q -m "not cuda" "$@"
