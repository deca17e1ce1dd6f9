"""Several devices: data-parallel workers and a two-stage pipeline, on the real embedded
model (SmolLM2-135M-Instruct, fp32, CPU workers over gloo), against one in-process engine.

The hot buffer is small enough (8 pages per request, layer and KV head, top 4 selected) that
the prompts of 100-400 tokens evict and miss, so both the selection and the LRU state of
every stage must stay in lockstep for the tokens and cache counters to match.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from engine.config import EngineConfig, SamplingParams
from engine.events import DecodeStep, Job, JobFailed, JobFinished, JobQueued, MemorySnapshot
from engine.serve.pipeline import split_batch
from engine.serve.workers import (
    JOIN_TIMEOUT_S,
    JobPlaced,
    ParallelEngine,
    WorkerDied,
    parse_devices,
    worker_config,
    worker_trace_path,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CONFIG = EngineConfig(
    # float32 weights on every CPU: `auto` keeps the 4-bit linears on CPUs with AVX512-BF16 or
    # AMX, and the budget test below sizes the stages from the planner's float32 weights
    weight_format="float",
    host_pool_gb=0.25,
    max_batch=2,
    page_size=16,
    top_k=64,
    device_buffer=128,
    sink_tokens=16,
    local_window=32,
    prefill_chunk=128,
    num_threads=1,
)
TEXT = (
    "Python lists have a built-in sort method that modifies the list in place, and the "
    "sorted function builds a new sorted list from any iterable. Both accept a key "
    "function and a reverse flag; the sort is stable, so records sorted by one key keep "
    "their earlier order among equal keys. "
)
# (words of the document, sampling): greedy and seeded sampling, one without a seed. Prefill
# takes one layer per scheduler turn, so job0 needs over 30 tokens to still be decoding when
# job1 joins it (a decode batch of 2: two micro-batches in the pipeline).
JOB_SHAPES = [
    (60, SamplingParams(max_tokens=40)),
    (250, SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7)),
    (140, SamplingParams(max_tokens=16)),
    (20, SamplingParams(max_tokens=8, temperature=1.0, top_k=40)),
]


def make_jobs(tokenizer, shapes=JOB_SHAPES, prefix="job"):
    words = (TEXT * 20).split()
    jobs = []
    for i, (n, sampling) in enumerate(shapes):
        content = f"Summarize this text ({i}):\n\n" + " ".join(words[i * 7 : i * 7 + n])
        ids = tokenizer.encode_chat([{"role": "user", "content": content}])
        jobs.append(Job(f"{prefix}{i}", tuple(ids), sampling))
    return jobs


def results(events):
    """job id -> JobResult, asserting every job ended once."""
    ended = Counter()
    out = {}
    for e in events:
        if isinstance(e, JobFinished):
            out[e.result.job_id] = e.result
            ended[e.result.job_id] += 1
        elif isinstance(e, JobFailed):
            out[e.job_id] = e.error
            ended[e.job_id] += 1
    assert all(n == 1 for n in ended.values()), ended
    return out


@pytest.fixture(scope="module")
def single():
    """One in-process engine: the reference."""
    from engine.load import load_engine

    torch.set_num_threads(1)
    return load_engine(CONFIG)


@pytest.fixture(scope="module")
def jobs(single):
    made = make_jobs(single.tokenizer)
    assert all(100 <= len(j.prompt_ids) <= 400 for j in made[:3]), [len(j.prompt_ids) for j in made]
    return made


@pytest.fixture(scope="module")
def reference(single, jobs):
    out = results(single.run(jobs))
    assert not any(isinstance(r, str) for r in out.values()), out
    return out


@pytest.fixture(scope="module")
def data_engine(single):
    with ParallelEngine(CONFIG, None, ["cpu", "cpu"], "data", tokenizer=single.tokenizer) as eng:
        yield eng


@pytest.fixture(scope="module")
def pipeline_engine(single):
    with ParallelEngine(CONFIG, None, "cpu,cpu", "pipeline", tokenizer=single.tokenizer) as eng:
        yield eng


def assert_same_results(got, reference):
    assert set(got) == set(reference)
    for job_id, ref in reference.items():
        res = got[job_id]
        assert not isinstance(res, str), f"{job_id} failed: {res}"
        assert res.token_ids == ref.token_ids, job_id
        assert res.text == ref.text and res.finish_reason == ref.finish_reason, job_id
        assert (res.cache.hits, res.cache.misses) == (ref.cache.hits, ref.cache.misses), job_id
    assert sum(r.cache.misses for r in reference.values()) > 0  # the hierarchy was exercised


# ----------------------------------------------------------------------------- no processes


def test_engine_pulls_jobs_only_when_it_has_room(single):
    drawn = []
    jobs = make_jobs(single.tokenizer, [(20, SamplingParams(max_tokens=2))] * 4, prefix="lazy")

    def source():
        yield None  # nothing ready yet: the engine must carry on, not stop
        for job in jobs:
            drawn.append(job.id)
            yield job

    seen = []
    for event in single.run(source()):
        if isinstance(event, JobQueued):
            seen.append((event.job_id, list(drawn)))
        if isinstance(event, JobFinished | JobFailed):
            seen.append(("end", list(drawn)))
    queued = [d for name, d in seen if name != "end"]
    assert [q[-1] for q in queued] == ["lazy0", "lazy1", "lazy2", "lazy3"]
    first_end = next(d for name, d in seen if name == "end")
    assert len(first_end) <= 3  # max_batch 2 running + at most one waiting
    assert sum(name == "end" for name, _ in seen) == 4


def test_split_batch_and_worker_settings():
    assert split_batch([1, 2, 3, 4, 5], 2) == [[1, 2, 3], [4, 5]]
    assert split_batch([1], 2) == [[1]]
    assert parse_devices("cuda:0, cuda:1") == ["cuda:0", "cuda:1"]
    cfg = CONFIG.replace(
        num_threads=None, devices=("cpu", "cpu"), trace_path="/t/run.jsonl"
    )
    w1 = worker_config(cfg, "cpu", 1, ["cpu", "cpu"], "data")
    assert w1.host_pool_gb == CONFIG.host_pool_gb / 2 and w1.device == "cpu"
    assert w1.trace_path == "/t/run.w1.jsonl" and w1.num_threads >= 1
    assert w1.devices == () and w1.parallel == "data"  # a worker runs one device
    stage = worker_config(cfg, "cpu", 1, ["cpu", "cpu"], "pipeline")
    assert stage.host_pool_gb == CONFIG.host_pool_gb and stage.trace_path == "/t/run.w1.jsonl"
    assert stage.devices == ()
    assert worker_trace_path("/t/sel.jsonl.gz", 0) == "/t/sel.w0.jsonl.gz"
    budget = worker_config(cfg.replace(memory_budget_gb=48.0), "cpu", 0, ["cpu", "cpu"], "pipeline")
    assert budget.memory_budget_gb == 48.0  # every stage is capped, for its own layers


# ----------------------------------------------------------------------------- two workers


def test_data_parallel_matches_one_engine(data_engine, jobs, reference):
    assert data_engine.prompt_limit() == 8192 and data_engine.model_config.num_layers == 30
    events = list(data_engine.run(jobs))
    assert_same_results(results(events), reference)
    placed = {e.job_id: e.worker for e in events if isinstance(e, JobPlaced)}
    assert set(placed) == {j.id for j in jobs} and set(placed.values()) == {0, 1}
    first = {}
    for e in events:
        job_id = getattr(e, "job_id", None)
        if job_id is not None:
            first.setdefault(job_id, type(e))
    assert set(first.values()) == {JobPlaced}  # the placement comes before the job's events
    devices = {e.device for e in events if isinstance(e, MemorySnapshot)}
    assert devices <= {"cpu#0", "cpu#1"} and devices


def test_pipeline_matches_one_engine(pipeline_engine, jobs, reference):
    events = list(pipeline_engine.run(jobs))
    assert_same_results(results(events), reference)
    assert {e.worker for e in events if isinstance(e, JobPlaced)} == {0}  # stage 0 schedules
    assert max(e.batch_size for e in events if isinstance(e, DecodeStep)) == 2  # split in 2
    snaps = [e for e in events if isinstance(e, MemorySnapshot)]
    assert {(e.device, e.stage) for e in snaps} == {("cpu#0", 0), ("cpu#1", 1)}  # every stage
    # each stage holds its layers' share of the pool; the parent reports their sum
    assert snaps[-1].host_pool_total == 2 * pipeline_engine.workers[1].info["host_pool_bytes"]
    again = results(pipeline_engine.run(jobs[3:]))  # the stages stay usable across runs
    assert again[jobs[3].id].token_ids == reference[jobs[3].id].token_ids


def test_pipeline_budget_sizes_each_stage_and_traces_every_layer(single, jobs, reference, tmp_path):
    """--memory-budget and --trace in pipeline mode. The budget is set so that stage 1
    (the LM head's logits scratch) fits 2 requests and stage 0 fits 3: both stages build
    max_batch 2, from the planner's rows for their layers, and give the reference tokens
    (max_batch 2). The two stage traces, replayed together through LRU at the engine's
    buffer, give every job's hit and miss counts."""
    from engine.capacity.budget import stage_sizing
    from engine.capacity.planner import (
        DEVICE_RESERVE_FRACTION,
        GIB,
        Hardware,
        device_tables,
        stage_layers,
        weight_bytes,
    )
    from engine.measure.replay import load_streams, replay
    from engine.measure.trace import read_traces

    mc, limit = single.model_config, single.prompt_limit()
    ranges = stage_layers(mc.num_layers, 2)

    def own(cfg, weights=None):  # each stage's sizing before the stages agree
        return [
            stage_sizing(
                mc,
                cfg,
                weights[i] if weights else weight_bytes(mc, cfg, r, embed=i == 0, head=i == 1),
                limit,
                r,
            )
            for i, r in enumerate(ranges)
        ]

    probe = CONFIG.replace(max_batch=16, memory_budget_gb=3.0)
    s1 = own(probe)[1]
    spare = (
        s1.room_bytes - s1.num_pool_pages * s1.meta_page_bytes - 2.5 * s1.per_request_device_bytes
    )
    cfg = probe.replace(  # the CPU reserve is 5 % of the budget: 95 % of a cut is room
        memory_budget_gb=3.0 - spare / GIB / (1 - DEVICE_RESERVE_FRACTION),
        trace_path=str(tmp_path / "sel.jsonl"),
    )
    with ParallelEngine(cfg, None, "cpu,cpu", "pipeline", tokenizer=single.tokenizer) as eng:
        infos = [w.info for w in eng.workers]
        assert [i["max_batch"] for i in infos] == [2, 2]
        assert eng.config.max_batch == 2  # what the stages admit (config.json says it)
        sizings = [i["budget_sizing"] for i in infos]
        assert [tuple(s["layers"]) for s in sizings] == ranges
        assert [s.max_batch for s in own(cfg, [s["weights_bytes"] for s in sizings])] == [3, 2]
        hw = Hardware(devices=("cpu", "cpu"), memory_gb=100.0, parallel="pipeline")
        for table, sizing in zip(device_tables(mc, cfg, hw, 0, limit), sizings, strict=True):
            assert table.weights_bytes == sizing["weights_bytes"]
            assert table.activation_bytes == sizing["activation_bytes"]
            assert table.comm_bytes == sizing["comm_bytes"] > 0
            assert table.reserve_bytes == sizing["reserve_bytes"]
        assert eng.trace_paths == [str(tmp_path / "sel.w0.jsonl"), str(tmp_path / "sel.w1.jsonl")]
        got = results(eng.run(jobs))
    assert_same_results(got, reference)
    header, records = read_traces(eng.trace_paths)
    assert header.layers is None and header.num_layers == mc.num_layers  # together: every layer
    streams = load_streams(records)
    for job_id, res in got.items():
        mine = {k: v for k, v in streams.items() if k[0] == job_id}
        assert {k[2] for k in mine} == set(range(mc.num_layers))
        lru = replay(mine, cfg.buffer_pages, "lru")
        assert (lru.hits, lru.misses) == (res.cache.hits, res.cache.misses), job_id


def test_pipeline_budget_without_room_names_the_stage(single):
    """A budget too small for the stages fails the start, naming each stage (the synthetic
    two-layer model: one layer per stage, quick to load)."""
    # below each stage's weights: both hold the tied 49152 x 128 float32 embedding (24 MiB)
    cfg = CONFIG.replace(memory_budget_gb=0.02)
    with pytest.raises(RuntimeError, match=r"stage 0 \(layers 0-0, cpu\).*stage 1 \(layers 1-1"):
        ParallelEngine(cfg, "synthetic:tiny", "cpu,cpu", "pipeline", tokenizer=single.tokenizer)


def test_cli_run_drives_parallel_engine(data_engine, tmp_path, monkeypatch):
    """``hisparse run --devices cpu,cpu`` hands the CLI the merged stream unchanged."""
    from typer.testing import CliRunner

    from hisparse_cli import runner, settings
    from hisparse_cli.main import app

    borrowed = SimpleNamespace(  # the module's workers, without letting the runner close them
        config=data_engine.config,
        tokenizer=data_engine.tokenizer,
        model_name=data_engine.model_name,
        weight_format=data_engine.weight_format,
        weights_info=data_engine.weights_info,
        trace_paths=data_engine.trace_paths,
        run=data_engine.run,
        cancel=data_engine.cancel,
        prompt_limit=data_engine.prompt_limit,
        close=lambda: None,
    )
    configs = []
    monkeypatch.setattr(settings, "preset_overrides", lambda name: dict(CONFIG.to_dict()))
    monkeypatch.setattr(runner, "load_engine", lambda cfg, model: configs.append(cfg) or borrowed)
    monkeypatch.chdir(tmp_path)
    for name in ("alpha", "beta", "gamma"):
        (tmp_path / f"{name}.txt").write_text(TEXT * 2)
    args = ["run", "alpha.txt", "beta.txt", "gamma.txt", "--devices", "cpu,cpu"]
    result = CliRunner().invoke(app, [*args, "--max-new-tokens", "4"], catch_exceptions=False)
    assert result.exit_code == 0, result.stdout
    assert configs[0].devices == ("cpu", "cpu")
    rows = [
        json.loads(x)
        for x in (tmp_path / "hisparse-out/results.jsonl").read_text().split("\n")
        if x
    ]
    assert sorted(r["id"] for r in rows) == ["alpha", "beta", "gamma"] and all(
        r["ok"] for r in rows
    )


def test_killed_worker_is_reported_and_the_other_finishes(data_engine, single):
    """SIGKILL worker 1 as soon as it admits a job: its jobs fail naming it, worker 0 runs
    every other job (including those not yet handed out), and stays usable."""
    shapes = [(40 + 10 * i, SamplingParams(max_tokens=16)) for i in range(5)]
    jobs = make_jobs(single.tokenizer, shapes, prefix="kill")
    pid1 = data_engine.workers[1].process.pid
    placed, events = {}, []
    for event in data_engine.run(jobs):
        events.append(event)
        if isinstance(event, JobPlaced):
            placed[event.job_id] = event.worker
        if isinstance(event, JobQueued) and placed.get(event.job_id) == 1 and pid1:
            os.kill(pid1, signal.SIGKILL)
            pid1 = 0
    out = results(events)
    assert set(out) == {j.id for j in jobs}
    (died,) = [e for e in events if isinstance(e, WorkerDied)]
    assert died.worker == 1 and died.error == "worker 1 (cpu) died: killed by SIGKILL"
    lost = {j for j, w in placed.items() if w == 1}
    assert lost and set(died.job_ids) == lost
    for job_id, res in out.items():
        if job_id in lost:
            assert isinstance(res, str) and res.startswith("worker 1 (cpu) died: killed by SIGKILL")
        else:
            assert not isinstance(res, str) and len(res.token_ids) == 16, (job_id, res)
            assert placed[job_id] == 0
    assert [w.alive for w in data_engine.workers] == [True, False]
    after = results(data_engine.run(jobs[:1]))
    assert not isinstance(after[jobs[0].id], str)


def test_lost_stage_fails_the_pipeline_jobs(pipeline_engine, jobs):
    """SIGKILL stage 1 mid-run: the run ends (no hang) and every job fails, naming it."""
    pid1 = pipeline_engine.workers[1].process.pid
    events = []
    for event in pipeline_engine.run(jobs):
        events.append(event)
        if isinstance(event, DecodeStep) and pid1:
            os.kill(pid1, signal.SIGKILL)
            pid1 = 0
    out = results(events)
    assert set(out) == {j.id for j in jobs}
    (died,) = [e for e in events if isinstance(e, WorkerDied)]
    assert "worker 1 (cpu) died: killed by SIGKILL" in died.error
    failed = [r for r in out.values() if isinstance(r, str)]
    assert failed and all("worker 1 (cpu) died" in r or "no worker left" in r for r in failed)
    assert not any(w.alive for w in pipeline_engine.workers)


@pytest.mark.parametrize("mode", ["data", "pipeline"])
def test_ctrl_c_while_the_workers_load_stops_them_at_once(mode, tmp_path):
    """Fresh-user finding: Ctrl-C during the load of ``--devices cpu,cpu`` stopped the run
    only 8-9 s later: the workers, still loading, were sent ``exit`` and read it once
    loaded (a bigger model: the whole 10 s join timeout, then SIGTERM). A worker without
    ``ready`` holds nothing to keep: it is stopped at once, and the interrupt goes on."""
    model = tmp_path / "model.gguf"
    os.mkfifo(model)  # reading the weights blocks until a writer opens it: a load that hangs
    fired = []

    def interrupt():
        fired.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    before = set(multiprocessing.active_children())  # the module's engines' workers
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in `hisparse run`
    timer = threading.Timer(1.0, interrupt)
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            ParallelEngine(CONFIG, str(model), "cpu,cpu", mode, tokenizer=object())
        stopped = time.monotonic()
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert fired and stopped - fired[0] < JOIN_TIMEOUT_S / 2
    assert set(multiprocessing.active_children()) <= before  # its own workers are gone


# ----------------------------------------------------------------------------- GPU smoke


def _one_gpu_reference():
    """A small bf16 config on ``cuda:0`` (max_batch 1), the test jobs, and one engine's
    results for them (the reference the multi-worker runs must reproduce)."""
    from engine.load import load_engine

    cfg = EngineConfig(
        device="cuda:0",
        dtype="bfloat16",
        kv_dtype="bfloat16",
        host_pool_gb=1.0,
        max_batch=1,
        page_size=16,
        top_k=64,
        device_buffer=128,
        sink_tokens=16,
        local_window=32,
    )
    one = load_engine(cfg)
    jobs = make_jobs(one.tokenizer)
    reference = results(one.run(jobs))
    del one
    torch.cuda.empty_cache()
    return cfg, jobs, reference


def _assert_same_tokens(got: dict, reference: dict) -> None:
    for job_id, ref in reference.items():
        assert not isinstance(got[job_id], str), got[job_id]
        assert got[job_id].token_ids == ref.token_ids, job_id


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["data", "pipeline"])
def test_two_workers_share_one_gpu(mode, tmp_path):
    """Both modes with two workers on ``cuda:0`` (the pipeline over gloo: NCCL refuses two
    ranks on one GPU). With max_batch 1 every decode has the single engine's shapes, so the
    tokens must match it exactly; with max_batch 4 every job must finish."""
    cfg, jobs, reference = _one_gpu_reference()
    with ParallelEngine(cfg, None, ["cuda:0", "cuda:0"], mode, tokenizer=None) as eng:
        _assert_same_tokens(results(eng.run(jobs)), reference)
    wide = cfg.replace(max_batch=4)
    with ParallelEngine(wide, None, ["cuda:0", "cuda:0"], mode, tokenizer=None) as eng:
        events = list(eng.run(jobs))
        got = results(events)
        assert all(not isinstance(r, str) and r.token_ids for r in got.values()), got
        assert any(isinstance(e, MemorySnapshot) and e.device.startswith("cuda:0") for e in events)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("mode", ["data", "pipeline"])
def test_two_workers_on_two_gpus(mode):
    """Both modes with one worker per GPU (``cuda:0,cuda:1``; the pipeline passes
    activations over NCCL): the same tokens as one engine on one GPU (max_batch 1, so
    every decode has the single engine's shapes), and memory reported for both devices."""
    cfg, jobs, reference = _one_gpu_reference()
    with ParallelEngine(cfg, None, ["cuda:0", "cuda:1"], mode, tokenizer=None) as eng:
        events = list(eng.run(jobs))
    _assert_same_tokens(results(events), reference)
    devices = {e.device for e in events if isinstance(e, MemorySnapshot)}
    assert {"cuda:0", "cuda:1"} <= devices, devices


def test_every_worker_sizes_a_budget_for_the_runs_longest_job(monkeypatch):
    """``load_engine(..., job_tokens=N)`` over several devices hands N to every worker's
    load, a data worker's engine and a pipeline stage alike, so each budget-sized cache is
    built for the run's jobs as a one-device run's is (no model is loaded here)."""
    import engine.load
    import engine.serve.pipeline as pipeline
    import engine.serve.workers as workers

    made, seen = [], []
    monkeypatch.setattr(workers, "ParallelEngine", lambda *a, **k: made.append(k) or "engine")
    assert engine.load.load_engine(CONFIG.replace(devices=("cpu", "cpu")), job_tokens=300)
    assert made == [{"job_tokens": 300}]
    load = lambda c, m, job_tokens, pool_shares: seen.append((job_tokens, pool_shares))  # noqa: E731
    monkeypatch.setattr(engine.load, "load_engine", load)
    monkeypatch.setattr(pipeline, "load_stage", lambda *a: seen.append((a[-1], None)))
    for mode in ("data", "pipeline"):
        workers._load(workers.WorkerSpec(0, 2, "cpu", mode, CONFIG, None, job_tokens=300))
    # a data worker also knows it holds one of 2 shares of host_pool_gb (its refusals
    # name the user's total); a pipeline stage keeps the whole setting
    assert seen == [(300, 2), (300, None)]
