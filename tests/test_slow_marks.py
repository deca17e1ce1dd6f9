"""tests/conftest.py marks ``slow`` what loads the real model and what is listed as slow;
``-m "not cuda"`` over CUDA-only tests exits 0, not 5."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pytest(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_model_tests_and_listed_tests_are_marked_slow():
    files = ("tests/engine/test_workers.py", "tests/engine/test_kv_cache.py", "tests/cli/test_cli_tasks.py")
    done = _pytest("--collect-only", "-m", "slow", *files)
    assert done.returncode == 0, done.stdout + done.stderr
    collected = done.stdout
    assert "test_workers.py::test_data_parallel_matches_one_engine" in collected  # loads it
    assert "test_workers.py::test_split_batch_and_worker_settings" not in collected
    assert "test_kv_cache.py::test_cache_state_machine::runTest" in collected  # listed
    assert "test_cli_tasks.py" not in collected


def test_a_marker_filter_that_leaves_nothing_exits_0_but_a_wrong_path_exits_5():
    done = _pytest("-m", "not cuda", "tests/engine/test_cuda_graph.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "deselected by -m; nothing to run" in done.stdout
    assert _pytest("tests/test_no_such_file.py").returncode in (4, 5)
