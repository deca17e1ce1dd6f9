"""``hisparse bench`` on CPU with the two-layer synthetic model: the report has every field,
the resident baselines stop admitting at a tiny budget, the hierarchy is exact (same tokens
as the all-resident sparse path), the no-IO oracle runs, plots are written; plus the
budget sizing that ``hisparse run --memory-budget`` shares."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from engine.capacity.budget import (
    cache_device_bytes,
    meta_page_bytes,
    pool_page_bytes,
    size_kv_for_budget,
)
from engine.capacity.planner import DEVICE_RESERVE_FRACTION, GIB
from engine.config import ConfigError, EngineConfig, SamplingParams
from engine.events import Job
from engine.measure.bench import MODES, RUN_FIELDS, BenchSpec, hierarchical_pool_pages, run_bench
from engine.measure.bench_kv import export_kv, page_runs, prefill_window
from engine.measure.report import metadata_rows_per_head, roofline, selected_pages
from hisparse_cli.bench_cmd import register

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CONTEXT = 512
# 16-token pages, top-k 64 tokens (4 pages), a 6-page hot buffer: misses happen.
SMALL = dict(
    device="cpu",
    page_size=16,
    top_k=64,
    device_buffer=96,
    sink_tokens=16,
    local_window=16,
    prefill_chunk=256,
    host_pool_gb=0.05,
)


@pytest.fixture(scope="module")
def tiny():
    """The placed two-layer synthetic model and its tokenizer (skips without the embedded
    model, whose tokenizer it uses)."""
    from engine.load import load_weights
    from engine.model.llama import LlamaModel
    from engine.model.rope import Rope

    try:
        weights, tokenizer, _ = load_weights("synthetic:tiny")
    except FileNotFoundError as err:
        pytest.skip(str(err))
    cfg = weights.config
    model = LlamaModel(
        weights, torch.device("cpu"), torch.float32, "float", Rope(cfg.head_dim, cfg.rope_theta)
    )
    return model, tokenizer


@pytest.fixture(scope="module")
def cli_report(tmp_path_factory, tiny, corpus_dir):
    """One full bench through the CLI: every mode, concurrency 1,2, a short soak."""
    if not sorted(corpus_dir.glob("*.txt")):
        pytest.skip(f"no corpus in {corpus_dir}")
    out = tmp_path_factory.mktemp("bench")
    app = typer.Typer()
    register(app)

    @app.callback()
    def main() -> None:
        """Keep ``bench`` a named sub-command."""

    args = [
        "bench",
        "--out",
        str(out),
        "--model",
        "synthetic:tiny",
        "--preset",
        "cpu",
        "--memory-budget",
        "2",
        "--contexts",
        str(CONTEXT),
        "--concurrency",
        "1,2",
        "--modes",
        ",".join(MODES),
        "--decode-steps",
        "6",
        "--warmup-steps",
        "2",
        "--profile-steps",
        "2",
        "--docs",
        "2",
        "--page-size",
        "16",
        "--top-k-tokens",
        "64",
        "--device-buffer",
        "96",
        "--local-window",
        "16",
        "--host-pool",
        "0.05",
        "--soak",
        "30",
        "--soak-every",
        "10",
    ]
    result = CliRunner().invoke(app, args, env={"HISPARSE_CORPUS": str(corpus_dir)})
    assert result.exit_code == 0, result.output
    return out, json.loads((out / "bench.json").read_text()), result.output


def test_report_has_every_field(cli_report):
    out, report, output = cli_report
    assert report["synthetic"] and any("synthetic" in n for n in report["notes"])
    assert "hisparse replay" in report["notes"][0]
    assert "NOTE: weights are synthetic" in output
    assert report["seed_scenario"]["dense_holds_one_256k_job"] is False
    assert report["corpus"]["files_in_order"] == sorted(report["corpus"]["files_in_order"])
    runs = report["runs"]
    assert {(r["mode"], r["concurrency"]) for r in runs} == {(m, c) for m in MODES for c in (1, 2)}
    for row in runs:
        assert set(RUN_FIELDS) <= set(row), set(RUN_FIELDS) - set(row)
        assert row["status"] == "ok" and row["admitted"] == row["concurrency"]
        assert row["decode_tok_s"] > 0 and row["step_ms_p99"] >= row["step_ms_p50"] > 0
        assert row["ttft_s"] > 0 and row["prefill_tok_s"] > 0
        assert set(row["breakdown_ms"]) >= {"weights", "attention", "resolve", "gather", "other"}
        assert row["roofline"] is None  # a CPU's: left out (test_a_cpu_bench_leaves...)
    assert "roofline ratios left out on the CPU" in output
    assert not re.search(r"x[\d.]+ roofline", output)
    ctx = report["contexts"][0]
    assert ctx["prompt_tokens"] + ctx["decode_reserve"] == CONTEXT
    assert set(ctx["sizing"]) == set(MODES)


def test_hierarchy_is_exact_and_misses(cli_report):
    _, report, _ = cli_report
    by = {(r["mode"], r["concurrency"]): r for r in report["runs"]}
    for c in (1, 2):
        hier, sparse = by[("hierarchical", c)], by[("sparse", c)]
        assert hier["token_sha256"] == sparse["token_sha256"]
        assert by[("copystream", c)]["token_sha256"] == hier["token_sha256"]
        pre = by[("prefetch", c)]
        assert pre["token_sha256"] == hier["token_sha256"]
        assert pre["prefetched"] > 0 and hier["prefetched"] == 0
        record_bytes = hier["h2d_bytes"] // hier["misses"]
        assert pre["h2d_bytes"] == (pre["misses"] + pre["prefetched"]) * record_bytes
        assert hier["misses"] > 0 and 0 < hier["hit_rate"] < 1
        assert hier["h2d_bytes"] > 0 and by[("noio", c)]["h2d_bytes"] == 0
        assert by[("noio", c)]["misses"] > 0
        assert sparse["hits"] is None and sparse["host_pool_bytes"] == 0


def test_plots_and_soak(cli_report):
    out, report, _ = cli_report
    assert (out / f"throughput_{CONTEXT}.png").stat().st_size > 1000
    assert (out / "soak_step_latency.png").stat().st_size > 1000
    soak = report["soak"]
    assert soak["mode"] == "hierarchical" and soak["batch"] == 2
    assert len(soak["step_ms"]) == 30 and soak["integrity_checks"] == 3 and soak["integrity_ok"]
    assert soak["memory_drift"] is not None and soak["p99_over_mean"] >= 1


def test_dense_admission_stops_at_a_tiny_budget(tmp_path, tiny, corpus_dir):
    model, _ = tiny
    if not sorted(corpus_dir.glob("*.txt")):
        pytest.skip(f"no corpus in {corpus_dir}")
    base = EngineConfig(**SMALL, max_batch=4)
    dense = base.replace(attention="dense", hierarchical=False)
    probe = size_kv_for_budget(
        model.config, dense.replace(memory_budget_gb=1.5), model.weight_bytes, CONTEXT
    )
    job = (CONTEXT // 16) * (probe.page_bytes + probe.meta_page_bytes)
    fixed = probe.weights_bytes + probe.activation_bytes
    budget_gb = (fixed + 1.5 * job) / (1 - DEVICE_RESERVE_FRACTION) / GIB  # CPU: 5 % reserve
    spec = BenchSpec(
        model="synthetic:tiny",
        config=base.replace(memory_budget_gb=budget_gb),
        contexts=(CONTEXT,),
        concurrency=(1, 2, 4),
        out_dir=tmp_path,
        modes=("dense", "sparse", "hierarchical"),
        decode_steps=2,
        warmup_steps=1,
        profile_steps=0,
        num_docs=1,
        corpus_dir=corpus_dir,
    )
    report = run_bench(spec)
    assert report["status"] == "complete"
    assert json.loads((tmp_path / "bench.json").read_text())["status"] == "complete"
    dense_rows = [r for r in report["runs"] if r["mode"] == "dense"]
    assert [r["concurrency"] for r in dense_rows] == [1, 2]  # the sweep ends at the wall
    assert dense_rows[1]["status"] == "admission_stopped" and dense_rows[1]["admitted"] == 1
    assert report["contexts"][0]["capacity"]["dense"]["max_jobs"] == 1
    hier = [r for r in report["runs"] if r["mode"] == "hierarchical"]
    assert [r["admitted"] for r in hier] == [1, 2, 4]  # same budget, host pool: no wall
    from hisparse_cli.bench_plots import make_plots  # the CLI draws the plots of a report

    assert f"throughput_{CONTEXT}.png" in make_plots(report, tmp_path)
    assert (tmp_path / f"throughput_{CONTEXT}.png").exists()


def test_ctrl_c_writes_the_runs_done_marked_interrupted(tmp_path, tiny, corpus_dir, monkeypatch):
    """Fresh-user finding: a bench stopped by Ctrl-C left a bench.json that looked
    finished. Its ``status`` says ``running`` during the sweep (a killed bench leaves
    that), ``interrupted`` after Ctrl-C (written with the runs done), ``complete`` at the
    end."""
    from engine.measure import bench as bench_module

    if not sorted(corpus_dir.glob("*.txt")):
        pytest.skip(f"no corpus in {corpus_dir}")
    real, statuses = bench_module.run_point, []

    def second_point_interrupted(*args, **kwargs):
        if (tmp_path / "bench.json").exists():
            statuses.append(json.loads((tmp_path / "bench.json").read_text())["status"])
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_module, "run_point", second_point_interrupted)
    spec = BenchSpec(
        model="synthetic:tiny",
        config=EngineConfig(**SMALL, max_batch=2, memory_budget_gb=2.0),
        contexts=(CONTEXT,),
        concurrency=(1, 2),
        out_dir=tmp_path,
        modes=("sparse",),
        decode_steps=2,
        warmup_steps=1,
        profile_steps=0,
        num_docs=1,
        corpus_dir=corpus_dir,
    )
    with pytest.raises(bench_module.BenchInterrupted) as stopped:
        run_bench(spec)
    assert statuses == ["running"]
    assert stopped.value.path == tmp_path / "bench.json" and stopped.value.runs == 1
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["status"] == "interrupted" and len(report["runs"]) == 1


def test_window_prefill_with_full_window_is_the_engine_prefill(tiny):
    from engine.kv.cache import KVCache
    from engine.serve.engine import Engine
    from kernels.dispatch import get_ops

    model, tokenizer = tiny
    cfg = EngineConfig(**SMALL).replace(hierarchical=False)
    ids = tuple(range(1000, 1000 + 300))
    outs = []
    for window in (None, 10_000):
        cache = KVCache(model.config, cfg, model.device, 32, num_pool_pages=32)
        engine = Engine(model, tokenizer, cfg, get_ops("cpu"), 512, cache=cache)
        req = engine.open_request(Job("d", ids, SamplingParams(max_tokens=1)))
        chunk = cfg.prefill_chunk
        first = (
            engine.prefill(req)
            if window is None
            else prefill_window(model, cache, req.seq_id, ids, chunk, window)
        )
        outs.append((first, *export_kv(cache, req.seq_id, len(ids))))
    (f0, r0, m0), (f1, r1, m1) = outs
    assert f0 == f1
    assert all(torch.equal(a, b) for a, b in zip(r0 + m0, r1 + m1, strict=True))


def test_budget_sizing_resident_and_hierarchical(tiny):
    model, _ = tiny
    mc = model.config
    resident = EngineConfig(**SMALL, attention="sparse", hierarchical=False, memory_budget_gb=1.1)
    s = size_kv_for_budget(mc, resident, model.weight_bytes, CONTEXT)
    assert s.pool_on_device and s.num_pool_pages == s.room_bytes // (
        s.page_bytes + s.meta_page_bytes
    )
    assert s.page_bytes == pool_page_bytes(mc, resident) and s.meta_page_bytes == meta_page_bytes(
        mc, resident
    )
    assert s.device_kv_bytes <= s.room_bytes
    hier = resident.replace(hierarchical=True, max_batch=64)
    h = size_kv_for_budget(mc, hier, model.weight_bytes, CONTEXT, num_pool_pages=100)
    assert not h.pool_on_device and 1 <= h.max_batch <= 64
    used = cache_device_bytes(mc, hier.replace(max_batch=h.max_batch), 100, CONTEXT // 16)
    assert used == h.device_kv_bytes <= h.room_bytes
    with pytest.raises(ConfigError, match="no room"):  # below the weights (0.025 GiB)
        size_kv_for_budget(mc, resident.replace(memory_budget_gb=0.02), model.weight_bytes, CONTEXT)


def test_a_cpu_budget_keeps_five_percent_not_a_gib(tiny):
    """``run --memory-budget`` on a CPU: the reserve is 5 % of the budget (heap slack), not
    the 1 GiB floor a CUDA device keeps, which took every budget under 1 GiB whole."""
    model, _ = tiny
    cfg = EngineConfig(**SMALL, max_batch=4, memory_budget_gb=0.5)
    s = size_kv_for_budget(model.config, cfg, model.weight_bytes, CONTEXT)
    assert s.reserve_bytes == int(0.5 * GIB * DEVICE_RESERVE_FRACTION) and s.max_batch == 4
    with pytest.raises(ConfigError, match="reserve 0.50 GiB"):  # CUDA: 1 GiB, capped
        size_kv_for_budget(model.config, cfg.replace(device="cuda"), model.weight_bytes, CONTEXT)


_ADVICE_FIELDS = {
    "--memory-budget": ("memory_budget_gb", float),
    "--host-pool": ("host_pool_gb", float),
    "--device-buffer": ("device_buffer", int),
    "--top-k-tokens": ("top_k", int),
}


def _advised(message: str) -> list[dict]:
    """The settings of each change a budget refusal names: ``(--a 1 --b 2; why)`` -> one
    dict per parenthesised group of flags."""
    out = []
    for group in re.findall(r"\((--[^;)]*)", message):
        words = group.split()
        assert len(words) % 2 == 0, group
        pairs = zip(words[::2], words[1::2], strict=True)
        out.append({_ADVICE_FIELDS[f][0]: _ADVICE_FIELDS[f][1](v) for f, v in pairs})
    return out


@pytest.mark.parametrize(
    "changes,offers",
    [
        ({"memory_budget_gb": 0.02}, {"memory_budget_gb"}),  # below the weights
        ({"memory_budget_gb": 0.5, "host_pool_gb": 16.0}, {"memory_budget_gb", "host_pool_gb"}),
        (
            {"memory_budget_gb": 0.06, "device_buffer": 65536},
            {"memory_budget_gb", "device_buffer"},
        ),
        (  # a pool of 6 pages cannot hold a 32-page request: every change raises it too
            {"memory_budget_gb": 0.03, "host_pool_gb": 0.0001, "device_buffer": 65536},
            {"memory_budget_gb", "device_buffer", "host_pool_gb"},
        ),
        ({"memory_budget_gb": 0.02, "hierarchical": False}, {"memory_budget_gb"}),
    ],
    ids=["weights", "metadata", "hot-buffer", "small-pool", "resident"],
)
def test_a_budget_refusal_names_only_changes_that_fit_a_request(tiny, changes, offers):
    """``run --memory-budget`` too small: each change the refusal names, applied with the
    flags it gives, sizes a cache that holds one request of the context; a change that
    cannot make room (a smaller pool or buffer when the weights alone exceed the budget) is
    not named. Before, the advice was "lower host_pool_gb or device_buffer" whatever
    bound, which did nothing when the weights (or a 1 GiB reserve) took the budget."""
    model, _ = tiny
    config = EngineConfig(**SMALL, max_batch=4).replace(**changes)
    with pytest.raises(ConfigError, match="no room") as refused:
        size_kv_for_budget(model.config, config, model.weight_bytes, CONTEXT)
    advice = _advised(str(refused.value))
    assert advice and {"memory_budget_gb"} <= set(advice[0])
    assert set().union(*advice) - {"top_k"} == offers, str(refused.value)
    for fix in advice:
        sized = size_kv_for_budget(model.config, config.replace(**fix), model.weight_bytes, CONTEXT)
        assert sized.max_jobs(CONTEXT // config.page_size) >= 1, (fix, sized)


def test_load_engine_sizes_the_pool_from_the_budget(tiny):
    from engine.load import load_engine

    cfg = EngineConfig(**SMALL, attention="sparse", hierarchical=False, memory_budget_gb=1.1)
    engine = load_engine(cfg, "synthetic:tiny")
    sizing = engine.budget_sizing
    assert sizing is not None and engine.cache.num_pool_pages == sizing.num_pool_pages
    assert engine.cache.pool_bytes_total + engine.cache.metadata_bytes <= sizing.room_bytes


def test_a_job_over_a_budget_sized_device_pool_names_the_budget(tiny):
    """A job larger than an all-resident pool that ``memory_budget_gb`` sized fails naming
    the budget, not ``host_pool_gb`` (which sizes no pool on the compute device here)."""
    from engine.load import load_engine

    cfg = EngineConfig(**SMALL, attention="dense", memory_budget_gb=0.04)
    engine = load_engine(cfg, "synthetic:tiny")
    pages = engine.cache.num_pool_pages
    big = Job("big", tuple(range(1, 2 + pages * cfg.page_size)), SamplingParams(max_tokens=1))
    assert len(big.prompt_ids) + 1 <= engine.context_limit  # too big for the pool only
    why = engine._check_job(big)
    assert f"but the pool has {pages} (memory_budget_gb=0.04" in why
    assert "host_pool_gb" not in why


def test_page_runs_and_pool_rounding():
    assert page_runs([0, 1, 2, 7, 8, 3]) == [(0, 0, 3), (3, 7, 2), (5, 3, 1)]
    from engine.capacity.shapes import MODEL_SHAPES

    qwen = MODEL_SHAPES["qwen2.5-7b"]
    cfg = EngineConfig(page_size=64, kv_dtype="bfloat16", top_k=2048, device_buffer=4096)
    layer_page = pool_page_bytes(qwen, cfg) // qwen.num_layers  # 128 KiB
    # 8 x 128K jobs need exactly 2 GiB per layer: a power of two, kept.
    assert hierarchical_pool_pages(8 * 2048, 96 * GIB, qwen, cfg, pinned=True) == 8 * 2048
    # 13 jobs: pinned layers are registered at their exact size, so nothing is rounded.
    assert hierarchical_pool_pages(13 * 2048, 96 * GIB, qwen, cfg, pinned=True) == 13 * 2048
    assert hierarchical_pool_pages(13 * 2048, 96 * GIB, qwen, cfg, pinned=False) == 13 * 2048
    # The cap binds: 96 GiB / 28 layers of 128 KiB pages.
    assert hierarchical_pool_pages(99 * 2048, 96 * GIB, qwen, cfg, pinned=True) == (
        96 * GIB // qwen.num_layers // layer_page
    )


def test_roofline_terms(tiny):
    model, _ = tiny
    cfg = EngineConfig(**SMALL)
    pages = [32, 32]
    assert selected_pages(cfg, 32) == 4 and selected_pages(cfg.replace(attention="dense"), 32) == 32
    r = roofline(
        model, cfg, pages, misses_per_step=10, measured_ms=1.0, hbm_gbps=1000, link_gbps=50
    )
    per_page = model.config.num_layers * model.config.num_kv_heads * 2 * 16 * 32 * 4
    assert r["selected_kv_bytes"] == 8 * per_page
    assert r["missed_kv_bytes"] == 10 * 2 * 16 * 32 * 4
    expect = (
        (r["weight_bytes"] + r["selected_kv_bytes"]) / 1e12 + r["missed_kv_bytes"] / 50e9
    ) * 1e3
    assert r["modeled_ms"] == pytest.approx(expect)
    noio = roofline(model, cfg.replace(skip_host_io=True), pages, 10, 1.0, 1000, 50)
    assert noio["missed_kv_bytes"] == 0
    # exact Quest reads every page's key min and max (2 x D values) per layer and KV head
    pair_row = model.config.num_layers * model.config.num_kv_heads * 2 * 32 * 4
    assert r["metadata_bytes"] == 64 * pair_row == sum(pages) * per_page // 16
    assert r["modeled_with_metadata_ms"] == pytest.approx(
        expect + r["metadata_bytes"] / 1e12 * 1e3
    )
    assert r["measured_over_roofline_with_metadata"] == pytest.approx(
        1.0 / r["modeled_with_metadata_ms"]
    )
    assert roofline(model, cfg.replace(attention="dense"), pages, 0, 1.0, 1000, 50)[
        "metadata_bytes"
    ] == 0


def test_superpage_metadata_rows_per_step():
    """Superpage selection reads every superpage row, the C best superpages' page rows and
    the refreshed newest superpage's pages, per (job, layer, KV head)."""
    cfg = EngineConfig(**SMALL).replace(page_metadata="superpage", superpage_pages=16,
                                        superpage_oversample=8, top_k=2048, device_buffer=4096)  # fmt: skip
    # 128K at page 16: 8192 pages, 512 superpages; top_k 128 pages x 8 = 1024 -> C = 64
    assert metadata_rows_per_head(cfg, 8192) == 512 + 64 * 16 + 16
    assert metadata_rows_per_head(cfg.replace(page_metadata="exact"), 8192) == 8192
    # a short context: C is cut to the superpages there are
    assert metadata_rows_per_head(cfg, 100) == 7 + 7 * 16 + 16


def test_bad_arguments_exit_2(tmp_path):
    app = typer.Typer()
    register(app)

    @app.callback()
    def main() -> None:
        """Keep ``bench`` a named sub-command."""

    result = CliRunner().invoke(app, ["bench", "--out", str(tmp_path), "--preset", "cpu"])
    assert result.exit_code == 2 and "memory-budget" in result.output
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "--out",
            str(tmp_path),
            "--preset",
            "cpu",
            "--memory-budget",
            "2",
            "--modes",
            "fast",
        ],
    )
    assert result.exit_code == 2 and "modes" in result.output
    base = ["bench", "--out", str(tmp_path), "--preset", "cpu", "--memory-budget", "2"]
    result = CliRunner().invoke(app, [*base, "--model", "synthetic:gpt5"])
    assert result.exit_code == 2 and "unknown synthetic model" in result.output
    result = CliRunner().invoke(app, ["bench", "--out", str(tmp_path / "none"), "--replot"])
    assert result.exit_code == 2 and "cannot replot" in result.output
    (tmp_path / "bench.json").write_text('{"runs": [')  # cut off
    result = CliRunner().invoke(app, ["bench", "--out", str(tmp_path), "--replot"])
    assert result.exit_code == 2 and "cannot replot" in result.output


def test_prefetch_arguments(tmp_path):
    """``--prefetch-pages`` must be >= 1 and come with the prefetch mode; a prefetch that
    does not fit the hot buffer (given or default) is refused up front, naming where the
    value came from; the default shrinks to the buffer's spare pages."""
    from engine.config import ConfigError, EngineConfig
    from engine.measure.bench import BenchSpec, default_prefetch_pages, mode_config

    app = typer.Typer()
    register(app)

    @app.callback()
    def main() -> None:
        """Keep ``bench`` a named sub-command."""

    base = ["bench", "--out", str(tmp_path), "--preset", "cpu", "--memory-budget", "2"]
    small = ["--top-k-tokens", "256", "--device-buffer", "256"]  # no spare slot
    cases = [
        ([*base, "--modes", "prefetch", "--prefetch-pages", "0"], "--prefetch-pages"),
        ([*base, "--modes", "hierarchical", "--prefetch-pages", "4"], "add prefetch to --modes"),
        ([*base, *small, "--modes", "hierarchical,prefetch"], "(the default"),
        ([*base, *small, "--modes", "prefetch", "--prefetch-pages", "2"], "(--prefetch-pages)"),
    ]
    for args, words in cases:
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and words in result.output, (args, result.output)
    cfg = EngineConfig(top_k=256, device_buffer=320, page_size=16, local_window=32)
    assert default_prefetch_pages(cfg) == 4  # a quarter of 16 pages; 4 spare slots
    assert default_prefetch_pages(cfg.replace(device_buffer=288)) == 2  # 2 spare slots
    assert mode_config(cfg, "prefetch", 3).prefetch_pages == 3
    assert mode_config(cfg.replace(prefetch_pages=3), "hierarchical").prefetch_pages == 0
    spec = BenchSpec("synthetic:tiny", cfg, (4096,), (1,), tmp_path, modes=("prefetch",))
    with pytest.raises(ConfigError, match="memory-budget"):
        spec.validate()  # the prefetch checks pass; the next one fails


def test_pretokenized_corpus_needs_no_tokenizer(tmp_path, tiny, corpus_dir):
    from engine.measure.bench_kv import read_corpus_tokens, write_corpus_tokens

    if not sorted(corpus_dir.glob("*.txt")):
        pytest.skip(f"no corpus in {corpus_dir}")
    path = write_corpus_tokens(tmp_path / "tokens.json", corpus_dir)
    files, streams = read_corpus_tokens(path, 1000)
    assert files == sorted(files) and max(max(s) for s in streams) < 1000
    spec = BenchSpec(
        model="synthetic:tiny",
        config=EngineConfig(**SMALL, memory_budget_gb=2.0),
        contexts=(CONTEXT,),
        concurrency=(1,),
        out_dir=tmp_path / "out",
        modes=("hierarchical",),
        decode_steps=2,
        warmup_steps=1,
        profile_steps=1,
        num_docs=1,
        corpus_tokens=path,
    )
    report = run_bench(spec)
    assert report["runs"][0]["status"] == "ok" and report["corpus"]["files_in_order"] == files


def test_kernel_phase_names():
    from engine.measure.profiling import kernel_phase

    assert kernel_phase("_sparse_decode_split_kernel") == "attention"
    assert kernel_phase("_resolve_kernel") == "resolve"
    assert kernel_phase("_gather_kernel") == "gather"
    assert kernel_phase("_gather_fp8_kernel") == "gather"
    assert kernel_phase("_quest_scores_kernel") == "select"
    assert kernel_phase("_normmax_kernel") == "select"
    assert kernel_phase("void at::native::radixSortKVInPlace<2, -1, 32, 4, long>") == "select"
    assert kernel_phase("_int4_split_sum_kernel") == "weights"
    assert kernel_phase("void at::native::sbtopk::gatherTopK<float>") == "select"
    assert kernel_phase("void (anonymous namespace)::tinygemm_m16n8k16_chunk_kernel") == "weights"
    assert kernel_phase("nvjet_tst_64x8_64x16_2x1_v_bz_TNN") == "weights"
    assert kernel_phase("void at::native::vectorized_elementwise_kernel<4, ...>") == "other"


def test_exclusive_time_counts_only_what_runs_alone():
    from engine.measure.profiling import exclusive_time

    # gather 0-4 beside attention 2-6, a second gather stream 1-3, a lone gather 8-9
    spans = [(0, 4, "gather"), (2, 6, "attention"), (1, 3, "gather"), (8, 9, "gather")]
    alone, active = exclusive_time(spans)
    assert alone == {"gather": 3.0, "attention": 2.0}
    assert active == 7.0
    assert exclusive_time([(5, 5, "gather")]) == ({}, 0.0)  # empty spans count nothing


def test_every_selection_kernel_is_counted_as_select():
    """Each Triton kernel of the selection modules lands in the ``select`` phase of a graph
    step's breakdown (two new superpage kernels once showed up as ``other``)."""
    import re
    from pathlib import Path

    from engine.measure.profiling import kernel_phase

    root = Path(__file__).resolve().parents[2] / "kernels"
    for module in ("quest_scores.py", "select_topk.py", "superpage_select.py"):
        names = re.findall(r"@triton\.jit\ndef (_\w+_kernel)\(", (root / module).read_text())
        assert names, module
        for name in names:
            assert kernel_phase(name) == "select", f"{module}: {name}"


def test_bench_corpus_is_beside_the_checkout_else_the_bundled_examples(monkeypatch, tmp_path):
    """Without ``$HISPARSE_CORPUS`` the bench reads ``<checkout>/../shared/corpus`` (not a
    ``shared/`` inside the checkout, as it once did), and where that has no ``*.txt`` the
    checkout's ``examples/`` (fresh-user finding: a clone elsewhere failed after loading)."""
    from pathlib import Path

    from engine.measure import bench_kv

    monkeypatch.delenv(bench_kv.CORPUS_ENV, raising=False)
    checkout = Path(bench_kv.__file__).resolve().parents[2]
    found = bench_kv.corpus_dir()
    beside = checkout.parent / "shared" / "corpus"
    if any(beside.glob("*.txt")):
        assert found == beside
    else:
        assert found == checkout / "examples"
    assert any(found.glob("*.txt"))
    monkeypatch.setenv(bench_kv.CORPUS_ENV, str(tmp_path))
    assert bench_kv.corpus_dir() == tmp_path


def test_a_cpu_bench_leaves_the_roofline_out_and_says_why():
    """Fresh-user finding: ``hisparse bench`` on a CPU printed ``x7305.1 roofline`` per
    run, a ratio to H200 bandwidths it has not. Off CUDA the ratio is left out (the run
    line has no roofline column, the row's ``roofline`` is ``None``) and one note says
    why; with both bandwidths given it is computed from them."""
    from engine.measure.bench import CPU_ROOFLINE_NOTE, _bandwidths
    from engine.measure.report import point_line

    spec = BenchSpec(model="synthetic:tiny", config=EngineConfig(), contexts=(512,),
                     concurrency=(1,), out_dir=Path("unused"))  # fmt: skip
    cpu = torch.device("cpu")
    left, info = _bandwidths(spec, cpu)
    assert left.hbm_gbps is None and left.link_gbps is None and info["hbm_gbps"] is None
    assert "roofline ratios left out on the CPU" in CPU_ROOFLINE_NOTE
    half, _ = _bandwidths(dataclasses.replace(spec, hbm_gbps=50.0), cpu)
    assert half.hbm_gbps is None  # one bandwidth is not a roofline
    given, info = _bandwidths(dataclasses.replace(spec, hbm_gbps=50.0, link_gbps=20.0), cpu)
    assert (given.hbm_gbps, given.link_gbps) == (50.0, 20.0) and info["source"]["hbm_gbps"] == "given"
    row = {"mode": "dense", "context": 512, "concurrency": 1, "status": "ok", "admitted": 1,
           "hit_rate": None, "peak_gpu_bytes": None, "roofline": None, "decode_tok_s": 10.0,
           "step_ms_p50": 90.0, "step_ms_p99": 99.0, "h2d_gbps": 0.0, "decode_steps": 2}  # fmt: skip
    assert "roofline" not in point_line(row) and point_line(row).endswith("peak    -  ")
    row["roofline"] = {"measured_over_roofline": 7.0}
    assert point_line(row).endswith("x7.0 roofline")
