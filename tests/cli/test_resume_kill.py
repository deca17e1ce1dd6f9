"""A real ``hisparse run`` process (real embedded model) is killed with SIGKILL midway;
re-running the same command finishes the rest with nothing lost, duplicated or corrupt."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _ok_ids(results: Path) -> list[str]:
    ids = []
    if not results.exists():
        return ids
    for line in results.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the kill; the reader skips it
        if rec.get("ok"):
            ids.append(rec["id"])
    return ids


def test_sigkill_midway_then_rerun_finishes_the_rest(tmp_path, corpus_dir, smollm2_gguf_path):
    text = (corpus_dir / "howto-sorting.txt").read_text(encoding="utf-8")
    docs = []
    for i in range(4):
        p = tmp_path / f"doc{i}.txt"
        p.write_text(text[i * 1500 : i * 1500 + 1200], encoding="utf-8")
        docs.append(p)
    manifest = tmp_path / "jobs.jsonl"
    manifest.write_text(
        "\n".join(json.dumps({"id": f"job{i}", "input": d.name}) for i, d in enumerate(docs)) + "\n"
    )
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "hisparse_cli",
        "run",
        "--manifest",
        str(manifest),
        "--output-dir",
        str(out),
        "--max-batch",
        "1",
        "--max-new-tokens",
        "12",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    results = out / "results.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and not _ok_ids(results):
        time.sleep(0.2)
    assert proc.poll() is None, (
        "the run ended before it could be killed:\n" + proc.stdout.read().decode()
    )
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    first = _ok_ids(results)
    assert 1 <= len(first) < 4, first
    for job_id in first:
        assert (out / f"{job_id}.txt").exists(), f"{job_id}: result line without its text file"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    final = _ok_ids(results)
    assert sorted(final) == [f"job{i}" for i in range(4)], "every job exactly once"
    assert final[: len(first)] == first, "finished results were kept, not redone"
    bad = []
    for line in results.read_text(encoding="utf-8").splitlines():
        try:
            json.loads(line)
        except json.JSONDecodeError:
            bad.append(line)
    assert len(bad) <= 1, f"only a line cut by the kill may be partial: {bad}"
