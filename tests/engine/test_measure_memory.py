"""``scripts/measure_memory.py`` (plan vs measured memory per device): the plan-only mode
for the GPU scenarios, and the measuring path on two CPU workers (a two-stage pipeline of
the synthetic tiny model under a small budget), each as a subprocess the way it is run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.capacity.budget import pool_page_bytes
from engine.capacity.planner import job_host_bytes
from engine.config import EngineConfig

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "measure_memory.py"
PARTS = ("weights", "kv_slab", "metadata", "activation", "comm", "reserve", "total", "capacity")


def run_script(tmp_path: Path, *args: str, timeout: float = 240) -> dict:
    out = tmp_path / "memory.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"wrote {out}" in proc.stdout
    return json.loads(out.read_text())


def test_dry_run_plans_every_gpu_scenario(tmp_path):
    report = run_script(tmp_path, "--dry-run")
    assert report["format"] == "hisparse-memory" and report["settings"]["mode"] == "dry-run"
    by = {s["key"]: s for s in report["scenarios"]}
    assert set(by) == {"a", "b", "c", "d"}
    for sc in by.values():
        assert sc["status"] == "planned" and sc["reason"] == "", sc["reason"]
        rows = [r["planned"] for r in sc["rows"]]
        assert len(rows) == len(sc["devices"])
        for r in rows:
            assert all(r[k] >= 0 for k in PARTS) and r["total"] <= r["capacity"]
            assert r["total"] == sum(r[k] for k in PARTS[:6])
        assert sc["host"]["planned_jobs_kv"] == sc["plan"]["host"]["needed_bytes"] > 0
        assert sc["host"]["planned_pool"] >= sc["host"]["planned_jobs_kv"]
    assert [r["planned"]["capacity"] for r in by["b"]["rows"]] == [48 * 2**30] * 2
    pipe = [r["planned"] for r in by["c"]["rows"]]
    assert [p["layers"] for p in pipe] == [[0, 14], [14, 28]]  # qwen2.5-7b: 28 layers
    assert all(p["comm"] > 0 for p in pipe) and by["b"]["rows"][0]["planned"]["comm"] == 0
    # data: the planner's max_batch is the box's, each worker runs its share
    assert by["b"]["plan_config"]["max_batch"] == 4 and by["b"]["per_worker_max_batch"] == 2
    assert by["c"]["per_worker_max_batch"] == 4


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_cpu_pipeline_measures_each_stage(tmp_path, corpus_dir):
    if not sorted(corpus_dir.glob("*.txt")):
        pytest.skip(f"no corpus in {corpus_dir}")
    report = run_script(
        tmp_path,
        "--cpu",
        "--scenarios",
        "cpu-pipeline",
        "--model",
        "synthetic:tiny",
        "--memory-budget",
        "1.1",
        "--corpus",
        str(corpus_dir),
    )
    (sc,) = report["scenarios"]
    assert sc["status"] == "measured", sc.get("reason")
    assert sc["run"]["finished"] == 2 and sc["run"]["tokens"] == 2 * 4
    rows = sc["rows"]
    assert [r["planned"]["layers"] for r in rows] == [[0, 1], [1, 2]]
    for row in rows:
        p, m = row["planned"], row["measured"]
        # the stage's tensors are what the planner counts for its layers
        assert (m["weights"], m["kv_slab"], m["metadata"]) == (
            p["weights"],
            p["kv_slab"],
            p["metadata"],
        )
        sizing = m["budget_sizing"]
        assert sizing["layers"] == p["layers"] and sizing["comm_bytes"] == p["comm"] > 0
        assert sizing["activation_bytes"] == p["activation"]
        assert m["max_batch"] == 2 and m["peak_allocated"] is None  # CUDA-only figures
    # the host pool holds exactly the two jobs, split over the stages by layer
    cfg = EngineConfig(**sc["plan_config"])
    from engine.weights.synthetic import TINY

    assert sc["host"]["planned_jobs_kv"] == 2 * job_host_bytes(TINY, cfg, 1024)
    assert sc["host"]["allocated_pool"] == sc["host"]["planned_jobs_kv"]
    assert sum(r["measured"]["host_pool"] for r in rows) == sc["host"]["allocated_pool"]
    assert sc["host"]["planned_pool"] - sc["host"]["allocated_pool"] < pool_page_bytes(TINY, cfg)
