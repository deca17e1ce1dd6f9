"""``hisparse bench``: decode throughput against concurrency for every KV mode under one
memory budget, with a soak test. Thin: flags -> :class:`engine.measure.bench.BenchSpec` ->
:func:`engine.measure.bench.run_bench` (imported inside the command, so ``--help`` stays fast).
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from hisparse_cli import options as opt
from hisparse_cli.display import escaped, shown_message
from hisparse_cli.pipes import STDOUT_CLOSED, guard_std_streams

BENCH, SOAK, MODEL = "Benchmark", "Soak", "Roofline"
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143, as hisparse run

ModelOpt = Annotated[
    str,
    typer.Option(
        "--model", help="synthetic:NAME (e.g. synthetic:qwen2.5-7b), a GGUF file or HF folder."
    ),
]
PresetOpt = Annotated[
    str,
    typer.Option(
        help="Hardware preset name or YAML file; auto picks the preset matching this "
        "machine's CUDA devices (cpu without CUDA), as in `hisparse run`.",
        rich_help_panel=BENCH,
    ),
]
ContextsOpt = Annotated[
    str,
    typer.Option(help="Contexts (prompt + decoded tokens): 32K,128K,256K.", rich_help_panel=BENCH),
]
ConcurrencyOpt = Annotated[
    str, typer.Option(help="Concurrent jobs, ascending: 1,2,4,8.", rich_help_panel=BENCH)
]
BudgetOpt = Annotated[
    float | None,
    typer.Option(
        "--memory-budget",
        help="Required: device memory per GPU for every mode, GiB (the dual 4090: 48).",
        rich_help_panel=BENCH,
    ),
]
ModesOpt = Annotated[
    str,
    typer.Option(
        help="dense, sparse, hierarchical, noio, copystream (hierarchical with the decode "
        "write-through on a copy stream), prefetch (hierarchical with near-miss prefetch on "
        "the copy stream), sharedlink (hierarchical with the two micro-batches' gathers "
        "sharing the host link instead of taking turns) — comma list." + opt.default_is("dense, sparse, hierarchical, noio"),
        show_default=False,
        rich_help_panel=BENCH,
    ),
]
PrefetchOpt = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Near-miss pages per (job, layer, KV head) the prefetch mode loads; only with "
        "--modes ...,prefetch."
        + opt.default_is("a quarter of the top-k pages, at most the hot buffer's spare pages"),
        show_default=False,
        rich_help_panel=BENCH,
    ),
]
DecodeStepsOpt = Annotated[
    int, typer.Option(min=1, help="Timed decode steps per run.", rich_help_panel=BENCH)
]
WarmupOpt = Annotated[
    int, typer.Option(min=0, help="Untimed steps before each run.", rich_help_panel=BENCH)
]
ProfileStepsOpt = Annotated[
    int,
    typer.Option(min=0, help="Instrumented steps per run (time breakdown).", rich_help_panel=BENCH),
]
DocsOpt = Annotated[
    int,
    typer.Option(
        min=1, help="Distinct documents per context (job j uses j mod D).", rich_help_panel=BENCH
    ),
]
MasterGbOpt = Annotated[
    float,
    typer.Option(
        help="Cap on prefilled KV kept for reuse per context, GiB.", rich_help_panel=BENCH
    ),
]
PrefillOpt = Annotated[
    str,
    typer.Option(
        help="full (engine prefill), window (synthetic shortcut) or auto.", rich_help_panel=BENCH
    ),
]
PrefillWindowOpt = Annotated[
    int, typer.Option(help="Tokens each query sees in the window prefill.", rich_help_panel=BENCH)
]
HostPoolOpt = Annotated[
    float | None,
    typer.Option(
        "--host-pool", help="Host pool cap for the hierarchical modes, GiB.", rich_help_panel=BENCH
    ),
]
TimeLimitOpt = Annotated[
    float | None,
    typer.Option(help="Skip runs not started within this many seconds.", rich_help_panel=BENCH),
]
OutOpt = Annotated[Path, typer.Option("--out", help="Output folder (bench.json, PNG plots).")]
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force/--no-force", metavar="", show_default=False,
        help="Replace an earlier bench's bench.json and plots in OUT (never a file bench did "
        "not write).",
    ),
]  # fmt: skip
CorpusTokensOpt = Annotated[
    Path | None,
    typer.Option(
        help="Pre-tokenized corpus (from --write-corpus-tokens); synthetic models, no embedded model needed.",
        rich_help_panel=BENCH,
    ),
]
WriteCorpusTokensOpt = Annotated[
    Path | None,
    typer.Option(help="Tokenize the corpus into FILE and exit.", rich_help_panel=BENCH),
]
ReplotOpt = Annotated[
    bool,
    typer.Option(
        "--replot/--no-replot", metavar="", show_default=False,
        help="Only redraw the plots of OUT/bench.json.",
    ),
]  # fmt: skip
SoakStepsOpt = Annotated[
    int,
    typer.Option(
        "--soak", min=0, help="Soak: decode steps of one batch (0 = off).", rich_help_panel=SOAK
    ),
]
SoakBatchOpt = Annotated[
    int | None,
    typer.Option(
        help="Soak batch." + opt.default_is("the largest level that fits"),
        show_default=False,
        rich_help_panel=SOAK,
    ),
]
SoakEveryOpt = Annotated[
    int, typer.Option(min=1, help="Integrity check / memory sample interval.", rich_help_panel=SOAK)
]
SoakModeOpt = Annotated[str, typer.Option(help="Mode the soak runs in.", rich_help_panel=SOAK)]
HbmOpt = Annotated[
    float | None,
    typer.Option(
        help="HBM read bandwidth for the roofline, GB/s (on a CPU: no roofline unless "
        "both this and --link-gbps are given)."
        + opt.default_is("measured on the GPU at start"),
        show_default=False,
        rich_help_panel=MODEL,
    ),
]
LinkOpt = Annotated[
    float | None,
    typer.Option(
        help="Host->device bandwidth for the roofline, GB/s."
        + opt.default_is("measured on the GPU at start"),
        show_default=False,
        rich_help_panel=MODEL,
    ),
]


def register(app: typer.Typer) -> None:
    """Add ``bench`` to ``app``."""
    app.command("bench")(bench_command)


def bench_command(
    out: OutOpt = Path("bench-out"),
    model: ModelOpt = "synthetic:qwen2.5-7b",
    memory_budget: BudgetOpt = None,
    contexts: ContextsOpt = "32K,128K",
    concurrency: ConcurrencyOpt = "1,2,4,8",
    modes: ModesOpt = "dense,sparse,hierarchical,noio",
    prefetch_pages: PrefetchOpt = None,
    decode_steps: DecodeStepsOpt = 32,
    warmup_steps: WarmupOpt = 4,
    profile_steps: ProfileStepsOpt = 4,
    docs: DocsOpt = 4,
    master_gb: MasterGbOpt = 24.0,
    prefill: PrefillOpt = "auto",
    prefill_window: PrefillWindowOpt = 1024,
    host_pool: HostPoolOpt = None,
    time_limit: TimeLimitOpt = None,
    soak: SoakStepsOpt = 0,
    soak_batch: SoakBatchOpt = None,
    soak_every: SoakEveryOpt = 100,
    soak_mode: SoakModeOpt = "hierarchical",
    preset: PresetOpt = "auto",
    device: opt.Device = None,
    page_size: opt.PageSize = None,
    top_k_tokens: opt.TopKTokens = None,
    device_buffer: opt.DeviceBuffer = None,
    sink_tokens: opt.SinkTokens = None,
    local_window: opt.LocalWindow = None,
    kv_host_dtype: opt.KvHostDtype = None,
    hot_buffer_dtype: opt.HotBufferDtype = None,
    page_metadata: opt.PageMetadata = None,
    hbm_gbps: HbmOpt = None,
    link_gbps: LinkOpt = None,
    corpus_tokens: CorpusTokensOpt = None,
    write_corpus_tokens: WriteCorpusTokensOpt = None,
    replot: ReplotOpt = False,
    force: ForceOpt = False,
) -> None:
    """Decode throughput vs concurrency for each KV mode under one memory budget.

    Example: `hisparse bench --model synthetic:qwen2.5-7b --contexts 32K,128K --concurrency 1,2,4,8 --memory-budget 48 --decode-steps 32 --out bench-out --soak 2000`

    Writes OUT/bench.json (rewritten after every run; its status says running, complete or interrupted), OUT/throughput_<context>.png and OUT/soak_step_latency.png; an OUT holding an earlier bench.json is refused unless --force, which removes its plots before the new run starts; a bench.json bench did not write, or (with none) a PNG named as a plot it draws, is refused even with --force. OUT is locked as `hisparse run` locks its folder. Exit code 2 on bad arguments, found before the model loads; 130 on Ctrl-C, 143 on SIGTERM (bench.json keeps the runs done).
    """
    guard_std_streams(f"{STDOUT_CLOSED}; results: {out / 'bench.json'}")
    from engine.capacity.planner import parse_context
    from engine.config import ConfigError
    from engine.measure import bench, bench_kv
    from engine.measure import report as bench_report
    from engine.presets import resolve_config
    from engine.weights.gguf import GGUFError
    from engine.weights.hf import HFModelError
    from hisparse_cli import bench_plots
    from hisparse_cli.results import LOCK_FILE
    from hisparse_cli.runner import (
        UsageError,
        _SigtermAsInterrupt,
        check_model_path,
        check_output_folder,
        locked_output_folder,
    )

    if write_corpus_tokens is not None:
        typer.echo(f"wrote {escaped(str(bench_kv.write_corpus_tokens(write_corpus_tokens)))}")
        return
    if replot:
        try:
            plots = bench_plots.replot(out)
        except (OSError, ValueError) as exc:  # no bench.json, a cut one, not a report
            shown = escaped(str(out / bench_report.REPORT_FILE))
            typer.echo(f"error: cannot replot {shown}: {shown_message(str(exc), [out])}", err=True)
            raise typer.Exit(EXIT_USAGE) from None
        typer.echo(f"plots: {', '.join(plots) or 'none'}")
        return
    if memory_budget is None:
        typer.echo("error: --memory-budget is required (GiB per device, every mode)", err=True)
        raise typer.Exit(EXIT_USAGE)
    names = (model, preset, corpus_tokens)  # escaped where a message holds them raw
    overrides = {
        "memory_budget_gb": memory_budget,
        "device": device,
        "page_size": page_size,
        "top_k": top_k_tokens,
        "device_buffer": device_buffer,
        "sink_tokens": sink_tokens,
        "local_window": local_window,
        "kv_host_dtype": kv_host_dtype,
        "hot_buffer_dtype": hot_buffer_dtype,
        "page_metadata": page_metadata,
    }
    try:
        config = resolve_config(_chosen_preset(preset, device), {}, overrides)
        spec = bench.BenchSpec(
            model=model,
            config=config,
            contexts=bench.parse_int_list(contexts, parse_context),
            concurrency=bench.parse_int_list(concurrency),
            modes=tuple(m.strip() for m in modes.split(",") if m.strip()),
            out_dir=out,
            decode_steps=decode_steps,
            warmup_steps=warmup_steps,
            profile_steps=profile_steps,
            num_docs=docs,
            master_gb=master_gb,
            prefill=prefill,
            prefill_window=prefill_window,
            soak_steps=soak,
            soak_batch=soak_batch,
            soak_every=soak_every,
            soak_mode=soak_mode,
            hbm_gbps=hbm_gbps,
            link_gbps=link_gbps,
            host_pool_gb=host_pool,
            time_limit_s=time_limit,
            corpus_tokens=corpus_tokens,
            prefetch_pages=prefetch_pages,
        )
        spec.validate()
        if model.startswith("synthetic:"):
            from engine.weights.synthetic import synthetic_shape

            synthetic_shape(model)  # an unknown name raises ValueError listing the known ones
        else:
            check_model_path(model)  # as `hisparse run`: a missing path, not a GGUF file
        own = (bench_report.REPORT_FILE, LOCK_FILE)
        check_output_folder(out, own, "--out", "bench")  # as run's
        _check_earlier_bench(out, force, bench_plots.plot_names(spec.contexts, bool(soak)))
    except (ConfigError, ValueError, UsageError) as exc:
        _fail(_flags_named(str(exc), overrides), names)
    shown_names = (*names, out)

    def log(line: str) -> None:  # the engine's lines name OUT raw ("wrote OUT/bench.json")
        typer.echo(shown_message(line, shown_names))

    sigterm = _SigtermAsInterrupt()  # SIGTERM stops bench as Ctrl-C does, and says so
    try:
        with sigterm, locked_output_folder(out, "--out"):  # as `hisparse run`'s folder
            _check_earlier_bench(out, force, bench_plots.plot_names(spec.contexts, bool(soak)))
            earlier = (out / bench_report.REPORT_FILE).is_file()  # hisparse's, checked
            removed = bench_plots.remove_plots(out) if force and earlier else []
            if removed:
                typer.echo(f"removed the earlier bench's plots (--force): {', '.join(removed)}")
            try:
                report = bench.run_bench(spec, log=log)
            except (ConfigError, FileNotFoundError) as exc:
                _fail(str(exc), names)
            except (GGUFError, HFModelError) as exc:  # a truncated or malformed model file
                _fail(f"cannot load the model: {exc}", names)
            report["plots"] = bench_plots.make_plots(report, spec.out_dir)
            bench_report.write_report(report, spec.out_dir)
    except UsageError as exc:  # another process holds OUT's lock
        _fail(str(exc), names)
    except KeyboardInterrupt as exc:  # typer's own exit 130 says nothing (SIGTERM: silent)
        _interrupted(out, exc, sigterm.received)
    typer.echo(f"plots: {', '.join(report['plots']) or 'none'}")


def _check_earlier_bench(out: Path, force: bool, plots: Sequence[str]) -> None:
    """Raise ``UsageError`` when OUT holds a ``bench.json`` hisparse did not write
    (``--force`` or not), an earlier bench's without ``force``, or, with no bench.json
    (nothing says a plot there is an earlier bench's), a file named as one of the
    ``plots`` this bench draws: the user's own, which bench would replace."""
    import os

    from engine.measure.report import REPORT_FILE
    from hisparse_cli import bench_plots
    from hisparse_cli.runner import UsageError, check_no_earlier_results

    check_no_earlier_results(out, REPORT_FILE, "--out", "bench", force, bench_plots.is_bench_report)
    if os.path.lexists(out / REPORT_FILE):
        return
    for name in plots:
        if os.path.lexists(out / name):
            raise UsageError(
                f"{escaped(str(out / name))}: not drawn by hisparse bench (no {REPORT_FILE} "
                "beside it); bench would replace it (--force neither): move it away or choose "
                "another --out"
            )


def _interrupted(out: Path, exc: BaseException, terminated: bool) -> NoReturn:
    """Say on stderr that Ctrl-C (``terminated``: SIGTERM) stopped bench and what it left
    written (:class:`~engine.measure.bench.BenchInterrupted`: a bench.json whose
    ``status`` says the sweep is incomplete); exit 130 (143)."""
    from engine.measure.report import INTERRUPTED, REPORT_FILE

    path = getattr(exc, "path", None)
    if path is not None:
        runs = getattr(exc, "runs", 0)
        where = (
            f"after {runs} run(s): wrote {escaped(str(path))} with them, marked "
            f'"status": "{INTERRUPTED}" (the sweep is incomplete); no plots drawn '
            f"(bench --replot --out {escaped(str(out))} draws them)"
        )
    else:
        where = f"before the sweep: nothing written in {escaped(str(out))}"
        if (out / REPORT_FILE).is_file():
            where += f"; the {REPORT_FILE} there is an earlier bench's, left as it was"
    typer.echo(f"interrupted ({'SIGTERM' if terminated else 'Ctrl-C'}) {where}", err=True)
    raise typer.Exit(EXIT_TERMINATED if terminated else EXIT_INTERRUPTED)


def _flags_named(message: str, overrides: dict[str, object]) -> str:
    """``message`` with each line that starts ``field:`` for a field set by a flag here
    starting with that flag instead (``memory_budget_gb:`` -> ``--memory-budget:``), as
    ``hisparse run`` names them; a preset's fields keep their names."""
    from hisparse_cli.settings import engine_flag

    lines = []
    for line in message.split("\n"):
        field, sep, rest = line.partition(":")
        given = sep and overrides.get(field) is not None
        lines.append(f"{engine_flag(field)}:{rest}" if given else line)
    return "\n".join(lines)


def _fail(message: str, names: Sequence[str | Path | None]) -> NoReturn:
    """``error:`` and a line of ``message`` per line on stderr (a preset's problems), exit
    2; ``names`` (what the user gave) escaped where the message holds them raw
    (:func:`~hisparse_cli.display.shown_message`)."""
    for line in shown_message(message, names).split("\n"):
        typer.echo(f"error: {line}", err=True)
    raise typer.Exit(EXIT_USAGE)


def _chosen_preset(preset: str, device: str | None) -> str:
    """``preset``, or for ``auto`` the preset matching this machine's CUDA devices
    (:func:`hisparse_cli.runner.auto_preset`; said on stdout)."""
    from hisparse_cli.auto_preset import AUTO
    from hisparse_cli.runner import auto_preset

    if preset != AUTO:
        return preset
    choice = auto_preset([device] if device else [])
    typer.echo(f"preset {choice.name} (auto: {choice.reason})")
    return choice.name


if __name__ == "__main__":  # python -m hisparse_cli.bench_cmd (before main.py registers it)
    typer.run(bench_command)
