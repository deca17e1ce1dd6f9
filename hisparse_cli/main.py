"""The ``hisparse`` command (console script ``hisparse = "hisparse_cli.main:app"``).

Commands are thin: they turn flags into a request and hand it over. Heavy modules
(the engine, torch, the runner) are imported inside the command, so ``--help`` is fast.
"""

from pathlib import Path
from typing import Annotated

import click
import typer
import typer.core

from hisparse_cli import bench_cmd, eval_cmd, presets_cmd, quantize_cmd, replay_cmd
from hisparse_cli import options as opt
from hisparse_cli.pipes import guard_std_streams


def _flag_type(self: typer.core.TyperOption, ctx: click.Context) -> str | None:
    """No ``<bool>`` placeholder for on/off flags in the rich ``--help`` (typer shows one for
    every flag without a ``metavar``, ``--help`` and ``--install-completion`` included)."""
    if self.is_flag and self.metavar is None:
        return None
    return _typer_type(self, ctx)


# Only on typer releases that render option types through this hook (the ones that show
# ``<bool>``); other releases keep their own help unchanged.
_typer_type = getattr(typer.core.TyperOption, "display_type_rich", None)
if _typer_type is not None:
    typer.core.TyperOption.display_type_rich = _flag_type

app = typer.Typer(
    name="hisparse",
    help="Offline long-document LLM batch processor with sparse hierarchical KV decoding.",
    no_args_is_help=True,
)


def version() -> str:
    """The installed ``hisparse`` version, else the checkout's ``pyproject.toml`` one."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("hisparse")
    except PackageNotFoundError:
        import tomllib

        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["version"]


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"hisparse {version()}")
        raise typer.Exit()


@app.callback()
def main(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            metavar="",
            help="Print the version and exit.",
        ),
    ] = False,
) -> None:
    """Offline long-document LLM batch processor with sparse hierarchical KV decoding.

    Shell completion: `hisparse --install-completion` (bash, zsh, fish, PowerShell).
    """
    # every command: a reader of stdout that exits early (`hisparse plan | head -1`) ends
    # the output, not the command (run, eval and bench add where their results go)
    guard_std_streams(notice=None)


@app.command()
def run(
    docs: opt.Docs = None,
    manifest: opt.ManifestFile = None,
    model: opt.Model = None,
    prompt: opt.Prompt = None,
    task: opt.Task = None,
    question: opt.Question = None,
    fields: opt.Fields = None,
    max_new_tokens: opt.MaxNewTokens = None,
    temperature: opt.Temperature = None,
    top_p: opt.TopP = None,
    top_k: opt.TopK = None,
    seed: opt.Seed = None,
    stop: opt.Stop = None,
    output_dir: opt.OutputDir = Path("hisparse-out"),
    preset: opt.Preset = "auto",
    attention: opt.Attention = None,
    indexer: opt.Indexer = None,
    page_size: opt.PageSize = None,
    top_k_tokens: opt.TopKTokens = None,
    device_buffer: opt.DeviceBuffer = None,
    sink_tokens: opt.SinkTokens = None,
    local_window: opt.LocalWindow = None,
    max_batch: opt.MaxBatch = None,
    context_policy: opt.ContextPolicy = None,
    max_context: opt.MaxContext = None,
    extend_method: opt.ExtendMethod = None,
    truncate_keep: opt.TruncateKeep = None,
    memory_budget: opt.MemoryBudget = None,
    host_pool: opt.HostPool = None,
    kv_host_dtype: opt.KvHostDtype = None,
    hot_buffer_dtype: opt.HotBufferDtype = None,
    page_metadata: opt.PageMetadata = None,
    threads: opt.Threads = None,
    device: opt.Device = None,
    devices: opt.Devices = None,
    parallel: opt.Parallel = None,
    json_progress: opt.JsonProgress = False,
    trace: opt.Trace = None,
    audit: opt.Audit = None,
    audit_seed: opt.AuditSeed = None,
    audit_min_agreement: opt.AuditMinAgreement = 0.75,
    audit_max_kl: opt.AuditMaxKl = None,
    encoding: opt.Encoding = "utf-8",
    errors: opt.Errors = "strict",
    allow_binary: opt.AllowBinary = False,
    print_config: opt.PrintConfig = False,
    force: opt.Force = False,
    retry_failed: opt.RetryFailed = False,
) -> None:
    """Run a task over documents and write one result per job.

    Examples: `hisparse run docs/*.txt` · `hisparse run report.txt --task answer --question "What was the revenue?"` · `hisparse run --manifest jobs.yaml`

    Results go to OUTPUT_DIR/results.jsonl and OUTPUT_DIR/<job>.txt; jobs already done with the same inputs and settings are skipped (--force redoes them).

    Exit code: 0 all jobs ok, 1 a job failed, 2 bad arguments, jobs or config, 130 Ctrl-C, 143 SIGTERM.
    """
    from hisparse_cli.results import AuditLimits
    from hisparse_cli.runner import RunRequest, execute, quiet_late_interrupts

    job_overrides = {
        "task": task,
        "prompt": prompt,
        "question": question,
        "fields": _field_names(fields),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "stop": list(stop) if stop else None,
    }
    engine_overrides = {
        "attention": attention,
        "indexer": indexer,
        "page_size": page_size,
        "top_k": top_k_tokens,
        "device_buffer": device_buffer,
        "sink_tokens": sink_tokens,
        "local_window": local_window,
        "max_batch": max_batch,
        "context_policy": context_policy,
        "max_context": max_context,
        "extend_method": extend_method,
        "truncate_keep": truncate_keep,
        "memory_budget_gb": memory_budget,
        "host_pool_gb": host_pool,
        "kv_host_dtype": kv_host_dtype,
        "hot_buffer_dtype": hot_buffer_dtype,
        "page_metadata": page_metadata,
        "num_threads": threads,
        "device": device,
        "trace_path": str(trace) if trace is not None else None,
        "devices": _device_list(devices),
        "parallel": parallel,
        "audit_steps": audit,
        "audit_seed": audit_seed,
    }
    request = RunRequest(
        docs=tuple(docs or ()),
        manifest=opt.one_manifest(manifest),
        model=model,
        job_overrides=job_overrides,
        engine_overrides=engine_overrides,
        preset=preset,
        output_dir=output_dir,
        json_progress=json_progress,
        encoding=encoding,
        errors=errors,
        allow_binary=allow_binary,
        print_config=print_config,
        force=force,
        retry_failed=retry_failed,
        audit_limits=AuditLimits(audit_min_agreement, audit_max_kl),
    )
    code = execute(request)
    quiet_late_interrupts()  # the results are written: a Ctrl-C now only stops the exit
    raise typer.Exit(code)


def _device_list(devices: str | None) -> tuple[str, ...] | None:
    """``--devices cuda:0,cuda:1`` as ``EngineConfig.devices`` (``None`` when not given)."""
    names = tuple(d.strip() for d in (devices or "").split(",") if d.strip())
    return names or None


def _field_names(fields: str | None) -> list[str] | None:
    """``--fields a,b`` -> ``["a", "b"]``; an empty name (``a,,b``, ``","``) is kept, for
    the manifest's checks to refuse naming the flag."""
    if fields is None:
        return None
    return [name.strip() for name in fields.split(",")]


presets_cmd.register(app)
quantize_cmd.register(app)
bench_cmd.register(app)
replay_cmd.register(app)
eval_cmd.register(app)
