"""``hisparse presets`` (list / show) and ``hisparse plan`` (capacity planner).

The main app calls :func:`register`; the commands stay thin: parse flags, call
:mod:`engine.presets` / :mod:`engine.capacity.planner`, render.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn

import typer
import yaml
from rich.console import Console
from rich.markup import escape as markup_escape
from rich.table import Table
from rich.text import Text

from engine.capacity.planner import (
    GIB,
    LRU_MISS_RATE,
    Hardware,
    Plan,
    device_reserve_rule,
    format_context,
    parse_context,
    plan,
    weight_format,
)
from engine.capacity.shapes import MODEL_SHAPES, get_model_shape, shape_from_gguf
from engine.config import (
    DTYPES,
    HOT_BUFFER_DTYPES,
    KV_HOST_DTYPES,
    ConfigError,
    EngineConfig,
    ModelConfig,
)
from engine.kv.sizing import hot_fp8
from engine.presets import (
    Preset,
    defaulted_settings,
    environment_notes,
    list_presets,
    load_preset_full,
    preset_path,
    resolve_config,
    resolved_preset_dict,
)
from hisparse_cli.auto_preset import AUTO, AutoChoice, name_auto, rules
from hisparse_cli.display import escaped, shown_message
from hisparse_cli.options import default_is, nonempty_text

EXIT_REFUSED = 2

PresetOpt = Annotated[
    str,
    typer.Option(
        "--preset",
        "-p",
        metavar="NAME|FILE",
        help="Hardware preset name or YAML file (see `hisparse presets`); auto picks the "
        "preset matching this machine's CUDA devices (cpu without CUDA), as in `hisparse run`.",
    ),
]
ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        parser=nonempty_text,
        metavar="NAME|FILE",
        help="Model shape name or config.json." + default_is("the preset's, else smollm2-135m"),
        show_default=False,
    ),
]
JobsOpt = Annotated[int, typer.Option("--jobs", "-n", min=1, help="Concurrent jobs.")]
ContextOpt = Annotated[
    str,
    typer.Option(
        "--context", "-c", help="Positions per job, prompt + output: 256K, 128k, 32768."
    ),
]
MemoryBudgetOpt = Annotated[
    float | None,
    typer.Option(
        "--memory-budget", help="Cap per-device memory, GiB (emulate a smaller card)."
    ),
]
TopKTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--top-k-tokens",
        help="Sparse budget: tokens selected per layer and KV head (as in `hisparse run`).",
    ),
]
# ``--top-k`` used to be the sparse budget here but is the sampling filter in
# ``hisparse run``; it is kept, hidden, only to say what to use instead.
RemovedTopKOpt = Annotated[str | None, typer.Option("--top-k", hidden=True)]
DeviceBufferOpt = Annotated[
    int | None,
    typer.Option(
        "--device-buffer", help="Hot-buffer tokens per (job, layer, KV head)."
    ),
]
PageSizeOpt = Annotated[
    int | None, typer.Option("--page-size", help="Tokens per page: 16, 32, 64.")
]
KvDtypeOpt = Annotated[
    Literal[DTYPES] | None,  # type: ignore[valid-type]  # the choices of engine.config
    typer.Option("--kv-dtype", help="KV dtype."),
]
KvHostDtypeOpt = Annotated[
    Literal[KV_HOST_DTYPES] | None,  # type: ignore[valid-type]
    typer.Option(
        "--kv-host-dtype",
        help="Host KV pool records: bf16 (in the KV dtype) or fp8 (e4m3, one scale per "
        "token row: half the pinned and link bytes).",
    ),
]
HotBufferDtypeOpt = Annotated[
    Literal[HOT_BUFFER_DTYPES] | None,  # type: ignore[valid-type]
    typer.Option(
        "--hot-dtype",
        help="Hot buffer: bf16 or fp8 (half the bytes a slot; needs --kv-host-dtype fp8).",
    ),
]
MaxBatchOpt = Annotated[int | None, typer.Option("--max-batch", help="Decode batch.")]
PrefillChunkOpt = Annotated[
    int | None, typer.Option("--prefill-chunk", help="Prefill chunk.")
]
AttentionOpt = Annotated[
    Literal["dense", "sparse"] | None, typer.Option("--attention", help="Attention mode.")
]
HostPoolOpt = Annotated[
    float | None, typer.Option("--host-pool", help="Pinned host pool, GiB.")
]
HostMemoryOpt = Annotated[
    float | None,
    typer.Option(
        "--host-memory",
        help="Host RAM, GiB." + default_is("the environment's, as run; else the preset's"),
        show_default=False,
    ),
]
ParallelOpt = Annotated[
    Literal["data", "pipeline"] | None,
    typer.Option(
        "--parallel",
        help="With several devices: data (whole jobs per device) or pipeline (layers split "
        "across devices)." + default_is("the preset's"),
        show_default=False,
    ),
]
JsonOpt = Annotated[
    bool,
    typer.Option("--json/--no-json", metavar="", show_default=False, help="Print the plan as JSON."),
]


def register(app: typer.Typer) -> None:
    """Add ``presets`` (a sub-app: list, ``show NAME``) and ``plan`` to ``app``."""
    presets_app = typer.Typer(
        help="List the hardware presets, or show one resolved.", no_args_is_help=False
    )

    @presets_app.callback(invoke_without_command=True)
    def presets(ctx: typer.Context) -> None:
        """List the hardware presets (``presets show NAME`` for one)."""
        if ctx.invoked_subcommand is None:
            Console().print(_presets_table())

    @presets_app.command("show")
    def show(
        name: Annotated[
            str, typer.Argument(metavar="NAME|FILE", help="Preset name or YAML file, or auto.")
        ],
    ) -> None:
        """Print the preset with its engine settings resolved over the defaults, as YAML.

        The output is a preset file: save it, edit it and pass it to --preset. A setting the preset file does not set ends in '# default' (the built-in default).

        Settings the environment gives (HISPARSE_HOST_MEMORY_GB, HISPARSE_INT4_TRITON_MIN_ROWS) are left out unless the preset sets them, so a copy follows the environment as the preset does; a comment gives their values here.

        `presets show auto` prints the preset auto picks on this machine, after a comment saying which and why.
        """
        choice = auto_choice(name)
        try:
            path = preset_path(choice.name if choice else name)
            resolved = resolved_preset_dict(path)
            defaulted = defaulted_settings(path)
            notes = environment_notes(resolved["engine"])
        except ConfigError as exc:
            _refuse(str(exc), (name,))
        shown, file = escaped(path.stem), escaped(str(path))  # one comment line each
        # YAML comments: the output is a preset file, which has no name or file keys
        if choice is not None:
            typer.echo(f"# auto: {choice.name} on this machine ({choice.reason})")
            typer.echo(f"# auto picks: {rules()}")
            if choice.read_by:
                typer.echo(f"# devices {choice.read_by}")
        typer.echo(f"# preset {shown} ({file}), resolved over the defaults")
        typer.echo(
            f"# a setting marked '{DEFAULT_MARK}' is the built-in default: "
            f"{escaped(path.name)} does not set it"
        )
        for note in notes:  # a copy must not freeze them: the environment sets them
            typer.echo(f"# {note}")
        typer.echo(preset_yaml(resolved, defaulted), nl=False)

    app.add_typer(presets_app, name="presets")
    app.command("plan")(plan_command)


def plan_command(
    jobs: JobsOpt,
    context: ContextOpt,
    preset: PresetOpt = AUTO,
    model: ModelOpt = None,
    memory_budget: MemoryBudgetOpt = None,
    top_k_tokens: TopKTokensOpt = None,
    removed_top_k: RemovedTopKOpt = None,
    device_buffer: DeviceBufferOpt = None,
    page_size: PageSizeOpt = None,
    kv_dtype: KvDtypeOpt = None,
    kv_host_dtype: KvHostDtypeOpt = None,
    hot_buffer_dtype: HotBufferDtypeOpt = None,
    max_batch: MaxBatchOpt = None,
    prefill_chunk: PrefillChunkOpt = None,
    attention: AttentionOpt = None,
    host_pool: HostPoolOpt = None,
    host_memory: HostMemoryOpt = None,
    parallel: ParallelOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Plan device and host memory for JOBS concurrent jobs of CONTEXT tokens.

    Example: `hisparse plan --preset dual4090 --model llama2-13b-gqa8 --jobs 8 --context 256K`

    With --preset auto (the default) the plan is for this machine's CUDA devices, as `hisparse run` would pick; the output says which preset that is and why.

    Host RAM: --host-memory, else HISPARSE_HOST_MEMORY_GB (what `hisparse run` checks its host pool against), else the preset's; the host table says which.

    Exits 2, with the reason and the nearest feasible setting, when they do not fit.
    """
    if removed_top_k is not None:
        _refuse(
            "hisparse plan has no --top-k: the sparse budget is --top-k-tokens "
            f"(e.g. --top-k-tokens {removed_top_k}), as in hisparse run, where --top-k is "
            "the sampling filter"
        )
    overrides = {
        "memory_budget_gb": memory_budget,
        "top_k": top_k_tokens,
        "device_buffer": device_buffer,
        "page_size": page_size,
        "kv_dtype": kv_dtype,
        "kv_host_dtype": kv_host_dtype,
        "hot_buffer_dtype": hot_buffer_dtype,
        "max_batch": max_batch,
        "prefill_chunk": prefill_chunk,
        "attention": attention,
        "host_pool_gb": host_pool,
    }
    choice = auto_choice(preset)
    if choice is not None:
        preset = choice.name
    names = (preset, model)  # what the user named, escaped wherever a message holds it
    problem = None if host_memory is None else Hardware.field_problem("host_memory_gb", host_memory)
    if problem:  # named by the flag, not by the preset's hardware.host_memory_gb
        _refuse(f"--host-memory: {problem}")
    try:
        loaded = load_preset_full(preset)
        config = _engine_config(preset, loaded, overrides)
        memory_gb, memory_source = host_memory_figure(
            host_memory, config.host_memory_gb, loaded.hardware.host_memory_gb, loaded.name
        )
        hardware = loaded.hardware.replace(
            host_memory_gb=memory_gb, **({"parallel": parallel} if parallel else {})
        )
        shape = model_shape(model or loaded.model or "smollm2-135m")
        result = plan(shape, config, hardware, jobs, parse_context(context))
    except ConfigError as exc:
        _refuse(str(exc), names)
    if as_json:
        named = {"preset": loaded.name} | ({"preset_auto": choice.reason} if choice else {})
        named["host_memory_source"] = memory_source
        typer.echo(json.dumps(named | result.to_dict(), indent=2))
    else:
        if choice is not None:
            Console().print(f"preset {choice.name} (auto: {choice.reason})", highlight=False)
        _render_plan(result, loaded.name, memory_source)
    if not result.feasible:
        if not as_json:
            _render_refusal(result)
        raise typer.Exit(EXIT_REFUSED)


def _engine_config(preset: str, loaded: Preset, overrides: dict[str, Any]) -> EngineConfig:
    """The engine settings of ``loaded`` (the preset named ``preset``) under the flags' (``resolve_config``); a setting that
    cannot run is named by what set it, as ``hisparse run`` names it: the flag
    (``--host-pool: must be a number > 0 ...``), else the preset's ``engine.<field>``.

    Raises
    ------
    ConfigError
        One line per problem (:func:`hisparse_cli.settings.resolve_engine_config`).
    """
    from hisparse_cli.manifest_source import COMMAND_LINE
    from hisparse_cli.settings import SettingsError, resolve_engine_config

    try:
        resolve_engine_config(preset, {}, overrides)
    except SettingsError as exc:
        raise ConfigError(
            "\n".join(
                f"{p.field}: {p.message}" if p.file == COMMAND_LINE else str(p)
                for p in exc.problems
            )
        ) from None
    return resolve_config(loaded, {}, overrides)


def model_shape(model: str) -> ModelConfig:
    """The shape ``plan --model`` names: a known shape, a Hugging Face ``config.json`` or
    its folder (:func:`~engine.capacity.shapes.get_model_shape`), or a GGUF file, which is
    checked as ``hisparse run`` checks ``--model``, in its words: a pipe or a device, or a
    file of another kind (``not a GGUF file (it starts with b'...')``,
    :func:`hisparse_cli.runner.check_gguf_magic`), whatever its name ends in.

    Raises
    ------
    ConfigError
        The shape cannot be read (the message names the file or the shape).
    """
    from hisparse_cli.runner import UsageError, check_gguf_magic

    path = Path(model)
    if model.lower() in MODEL_SHAPES or path.suffix.lower() == ".json" or path.is_dir():
        return get_model_shape(model)
    try:
        if path.exists() and not path.is_file():  # a FIFO, a device
            raise UsageError(f"--model {escaped(model)}: not a regular file or a model folder")
        if path.is_file():
            check_gguf_magic(path)
            return shape_from_gguf(path)
    except UsageError as exc:
        raise ConfigError(str(exc)) from None
    return get_model_shape(model)


DEFAULT_MARK = "# default"
"""The trailing comment ``presets show`` puts on a setting the preset file does not set."""
_BLOCK_KEY = re.compile(r"  ([A-Za-z_][A-Za-z0-9_]*):(?: |$)")


def preset_yaml(resolved: dict[str, Any], defaulted: dict[str, set[str]]) -> str:
    """``resolved`` (:func:`~engine.presets.resolved_preset_dict`) as YAML, each setting
    named in ``defaulted`` (block -> names: :func:`~engine.presets.defaulted_settings`)
    ending in :data:`DEFAULT_MARK`. The blocks are written one line a setting (no folded
    scalars, so a comment never lands inside a value); lists go on the lines after their
    key, which carries the comment. Loads as ``resolved``."""
    blocks = set(defaulted)
    head = {k: v for k, v in resolved.items() if k not in blocks}
    parts = [yaml.safe_dump(head, sort_keys=False)] if head else []
    for block in (k for k in resolved if k in blocks):
        text = yaml.safe_dump({block: resolved[block]}, sort_keys=False, width=1 << 30)
        lines = []
        for line in text.splitlines():
            match = _BLOCK_KEY.match(line)
            if match and match.group(1) in defaulted[block]:
                line = f"{line} {DEFAULT_MARK}"
            lines.append(line)
        parts.append("\n".join(lines) + "\n")
    return "".join(parts)


def host_memory_figure(
    flag_gb: float | None, declared_gb: float | None, preset_gb: float, preset: str
) -> tuple[float, str]:
    """The host RAM a plan uses, in GiB, and where it came from: ``--host-memory``, else
    ``HISPARSE_HOST_MEMORY_GB`` (``declared_gb``: ``EngineConfig.host_memory_gb``, which
    ``hisparse run`` checks its host pool against, :func:`engine.kv.sizing.check_host_memory`),
    else the preset's ``hardware.host_memory_gb``; that last source also says what run
    would check against here (``MemAvailable``), as run does not read the preset's figure.
    """
    if flag_gb is not None:
        return flag_gb, "--host-memory"
    if declared_gb is not None:
        return declared_gb, "HISPARSE_HOST_MEMORY_GB, as hisparse run uses"
    from engine.kv.sizing import available_host_bytes

    avail = available_host_bytes()
    here = "" if avail is None else f"; run checks MemAvailable: {avail / GIB:.1f}"
    return preset_gb, f"preset {preset}'s{here}"


def auto_choice(preset: str) -> AutoChoice | None:
    """What ``--preset auto`` stands for on this machine (the one resolution ``hisparse
    run`` and ``hisparse bench`` use: :func:`hisparse_cli.runner.auto_preset`, which imports
    torch to probe CUDA); ``None`` for any other preset name or file."""
    if preset != AUTO:
        return None
    from hisparse_cli.runner import auto_preset

    return auto_preset()


# ----------------------------------------------------------------------------- render


def _presets_table() -> Table:
    """One row per preset: its name, then the hardware on one line and the description
    wrapped below it, so the list reads at 80 columns."""
    table = Table(title="presets", title_justify="left", box=None, show_header=False)
    table.add_column("name", style="bold", no_wrap=True)
    table.add_column("preset", overflow="fold", ratio=1)
    for name in list_presets():
        try:
            p = load_preset_full(name)
        except ConfigError as exc:  # a file of HISPARSE_PRESETS_DIR: its name escaped
            table.add_row(Text(escaped(name)), Text(shown_message(str(exc), [name]), "red"))
            continue
        hw = p.hardware
        hardware = (
            f"{hw.num_devices} x {hw.device_name or hw.devices[0]}, {hw.memory_gb:g} GiB each; "
            f"host RAM {hw.host_memory_gb:g} GiB; {hw.parallel} parallel"
            + (f"; model {p.model}" if p.model else "")
        )
        table.add_row(Text(escaped(name)), Text.assemble((hardware, "cyan"), "\n", p.description))
        table.add_row("", "")
    choice = auto_choice(AUTO)
    assert choice is not None
    table.add_row(
        "auto",
        Text.assemble(
            (f"here: {choice.name} ({choice.reason})", "cyan"),
            "\nthe default of `hisparse run`, `bench`, `eval` and `plan`: the preset "
            f"matching this machine's CUDA devices: {rules()}",
        ),
    )
    return table


def _gib(n: int) -> str:
    return f"{n / GIB:,.2f}"


def _device_table(result: Plan) -> Table:
    pipeline = result.hardware.parallel == "pipeline" and len(result.devices) > 1
    title = (
        "working memory (GiB), in host RAM"
        if result.hardware.shares_host_memory
        else "device memory (GiB)"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("")
    for d in result.devices:
        layers = f" L{d.layers[0]}-{d.layers[1] - 1}" if pipeline else ""
        table.add_column(f"{d.device}{layers}\n{d.num_jobs} job(s)", justify="right")
    table.add_column("what")
    cfg, m = result.config, result.model
    rows: list[tuple[str, str, Any]] = [
        ("weights", "weights_bytes", _weights_what(cfg, m)),
        (
            "hot KV slab pool",
            "kv_slab_bytes",
            f"jobs x L x {m.num_kv_heads} x {cfg.device_buffer_tokens} tok x "
            + (f"({m.head_dim} + 1) fp8" if hot_fp8(cfg) else f"{m.head_dim} x 2")
            + " x K|V",
        ),
        ("page metadata", "metadata_bytes", f"min+max per page (KV / {cfg.page_size})"),
        (
            "activations + scratch",
            "activation_bytes",
            "decode, chunk, one layer's prefill",
        ),
        (
            "communication",
            "comm_bytes",
            "pipeline hand-off" if pipeline else "none (data)",
        ),
        ("reserve", "reserve_bytes", device_reserve_rule(cfg.device)),
        ("used", "used_bytes", ""),
        ("capacity", "capacity_bytes", "device or --memory-budget"),
        ("free", "free_bytes", ""),
    ]
    for label, attr, what in rows:
        values = [_gib(getattr(d, attr)) for d in result.devices]
        style = "bold" if label in ("used", "free") else None
        table.add_row(label, *values, what, style=style)
    return table


def _weights_what(config, model) -> str:
    """The weights row's words: the dtype and the format the engine places, with why
    where ``weight_format`` is ``auto`` (:func:`engine.capacity.planner.weight_format`)."""
    fmt = weight_format(config, model)
    if config.weight_format != "auto":
        return f"{config.dtype} / {fmt} weights"
    if config.device.split(":")[0] != "cpu":
        why = "auto"
    elif not model.int4_linears:
        why = "auto: linears not stored 4-bit"
    else:
        why = "auto: " + ("CPU has AVX512-BF16/AMX" if fmt == "int4" else "no AVX512-BF16/AMX")
    return f"{config.dtype} / {fmt} weights ({why})"


def _host_table(result: Plan, memory_source: str) -> Table:
    table = Table(title="host memory (GiB)", title_justify="left")
    table.add_column("")
    table.add_column("GiB", justify="right")
    table.add_column("what")
    memory = Text(escaped(memory_source))  # a preset's file name: no markup, no controls
    table.add_row("host RAM", f"{result.hardware.host_memory_gb:,.2f}", memory)
    ctx = _context_tokens(result.context)
    table.add_row(
        "KV per job", _gib(result.job_kv_bytes), f"{ctx} x L x Hkv x D x 2, paged"
    )
    host_dtype = result.config.kv_host_dtype
    records = (
        "fp8 + 1 B scale per row (2 x S x (D + 1) per record)"
        if host_dtype == "fp8"
        else f"records in the KV dtype ({result.config.kv_dtype})"
    )
    table.add_row(
        "host KV per job",
        _gib(result.host_needed_bytes // max(result.num_jobs, 1)),
        f"host pages {host_dtype}: {records}" if host_dtype == "fp8" else records,
    )
    shared = result.hardware.shares_host_memory  # CPU devices: no pinning, no copies
    table.add_row(
        "KV needed in the pool" if shared else "pinned KV needed",
        _gib(result.host_needed_bytes),
        f"{result.num_jobs} job(s)",
    )
    table.add_row(
        "host pool", _gib(result.host_pool_bytes), "host_pool_gb, within usable RAM"
    )
    usable = "RAM less max(10 %, 4 GiB)"
    if shared:
        usable += " and the working memory above"
    table.add_row("usable host RAM", _gib(result.host_usable_bytes), usable)
    return table


def _context_tokens(tokens: int) -> str:
    """A context as the plan's sentences name it: ``256K``, or ``177,635`` where it is not
    a whole number of K (``-c 177635``), never read as a count of jobs."""
    text = format_context(tokens)
    return f"{tokens:,}" if text == str(tokens) else text


def _render_plan(result: Plan, preset_name: str, memory_source: str) -> None:
    console = Console()
    hw, ctx = result.hardware, _context_tokens(result.context)
    model, preset = (markup_escape(escaped(n)) for n in (result.model.name, preset_name))
    console.print(
        f"[bold]{result.num_jobs} x {ctx}-token jobs[/] of [bold]{model}[/] on "
        f"[bold]{preset}[/]: {hw.num_devices} x {hw.device_name or hw.devices[0]}, "
        f"{hw.parallel} parallel, attention {result.config.attention}"
    )
    console.print(_device_table(result))
    console.print(_host_table(result, memory_source))
    cap, dense = result.capacity, result.dense
    host = (
        "no host tier"
        if cap.host_limit is None
        else f"host memory allows {cap.host_limit}"
    )
    if cap.binding == "max_batch":
        device, binds = f"max_batch allows {cap.device_limit}", "[bold]max_batch[/] binds"
        if result.num_jobs > cap.max_jobs:  # more decode slots would run more of them at once
            binds += f": raise --max-batch for more of the {result.num_jobs} jobs at once"
    elif cap.binding == "max_batch+host":
        device = f"max_batch allows {cap.device_limit}"
        binds = "[bold]max_batch[/] and [bold]host[/] memory bind"
    else:
        device, binds = f"device memory allows {cap.device_limit}", f"[bold]{cap.binding}[/] memory binds"
    console.print(
        f"max concurrent {ctx}-token jobs: [bold]{cap.max_jobs}[/] ({device}, {host}; {binds})"
    )
    console.print(
        f"dense all-resident baseline: [bold]{dense.max_jobs}[/] job(s) "
        f"({_gib(result.dense_job_device_bytes)} GiB of KV per job on the device)"
    )
    if result.gather_bytes_per_step:
        console.print(
            f"decode IO estimate: {result.gather_bytes_per_step / 1e6:,.0f} MB per step from "
            f"host at {LRU_MISS_RATE:.1%} LRU misses = {result.gather_ms_per_step:.1f} ms at "
            f"{hw.host_link_gbps:g} GB/s"
        )
    for note in result.notes:
        console.print(f"[yellow]note:[/] {note}")


def _render_refusal(result: Plan) -> None:
    err = Console(stderr=True, soft_wrap=True)  # a reason or hint stays one line
    err.print("[red bold]refused:[/] this does not fit")
    for reason in result.reasons:
        err.print(f"  - {reason}")
    if result.suggestions:
        err.print("nearest feasible:")
        for suggestion in result.suggestions:
            err.print(f"  - {suggestion}")


def _refuse(message: str, names: Sequence[str | None] = ()) -> NoReturn:
    """``error: message`` on stderr, one line per problem of ``message`` (as ``hisparse
    run``'s: the terminal wraps it), exit 2. ``names``: the preset and model as the user
    gave them, escaped where the message holds them raw
    (:func:`~hisparse_cli.display.shown_message`); the message is plain text, never Rich
    markup (a ``[red]`` in a file name stays as it is)."""
    console = Console(stderr=True, soft_wrap=True)
    for line in shown_message(name_auto(message), names).split("\n"):
        console.print(Text.assemble(("error:", "red bold"), " ", line), highlight=False)
    raise typer.Exit(EXIT_REFUSED)
