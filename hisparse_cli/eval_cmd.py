"""``hisparse eval``: long-context fidelity of dense vs sparse decoding on locally generated
RULER-style tasks. Thin: flags -> prompts (:mod:`engine.measure.ruler`) -> runs
(:func:`engine.measure.fidelity.run_eval`) -> JSON, heatmap and table
(:mod:`hisparse_cli.eval_report`). Heavy modules are imported inside the command."""

from __future__ import annotations

import glob
import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn

import typer

from hisparse_cli import options as opt
from hisparse_cli.display import escaped, shown_message
from hisparse_cli.pipes import STDOUT_CLOSED, guard_std_streams

EVAL = "Eval"
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143, as hisparse run
REPORT_FILE = "eval.json"
DEFAULT_OUTPUT_DIR = "hisparse-eval"
EVAL_POLICIES = ("refuse", "extend")
"""The context policies eval uses: every prompt is built to its length, so a length over the
context is skipped (``refuse``) or the context extended to it (``extend``); ``truncate`` and
``chunk`` would cut or split the haystack around the needles, so eval does not take them."""

HaystackDocs = Annotated[
    list[str] | None,
    typer.Argument(
        help="Haystack text files (paths or globs), read in order and repeated as needed."
        + opt.default_is("generated noise"),
        show_default=False,
        metavar="DOCS",
    ),
]
LengthsOpt = Annotated[
    str,
    typer.Option(
        help="Lengths (prompt + answer tokens), comma list: 2K,4K,8K or 2048,4096.",
        rich_help_panel=EVAL,
    ),
]
DepthsOpt = Annotated[
    str,
    typer.Option(
        help="Needle depths (fractions of the haystack), comma list.", rich_help_panel=EVAL
    ),
]
TasksOpt = Annotated[
    str,
    typer.Option(
        help="Tasks, comma list: niah_single, niah_single_word, niah_single_uuid, "
        "niah_multikey, niah_multivalue, vt, cwe (or all).",
        rich_help_panel=EVAL,
    ),
]
ConfigsOpt = Annotated[
    str,
    typer.Option(
        help="Decode configurations, comma list: dense, sparse (the preset's sparse "
        "settings) or key=value pairs joined by ':' over them, keys top_k, page, indexer, "
        "combine, sink, window, buffer, hierarchical, host (bf16|fp8), meta "
        "(exact|superpage), superpage, oversample (top_k=512:page=32, indexer=oracle, "
        "meta=superpage:oversample=4).",
        rich_help_panel=EVAL,
    ),
]
SamplesOpt = Annotated[
    int, typer.Option(min=1, help="Samples per task, length and depth.", rich_help_panel=EVAL)
]
SeedOpt = Annotated[int, typer.Option(help="Seed of every prompt.", rich_help_panel=EVAL)]
MaxNewOpt = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Answer tokens." + opt.default_is("each task's own, 32-64"),
        show_default=False,
        rich_help_panel=EVAL,
    ),
]
EvalContextPolicy = Annotated[
    Literal[EVAL_POLICIES] | None,  # type: ignore[valid-type]
    typer.Option(
        "--context-policy",
        help="Lengths over the model's trained context: refuse (they are skipped) or extend "
        "(RoPE scaling up to the longest length). Not truncate or chunk: they would cut or "
        "split the haystack around the needles." + opt.default_is("refuse"),
        show_default=False,
        rich_help_panel=opt.ENGINE,
    ),
]
EvalMaxContext = Annotated[
    int | None,
    typer.Option(
        help="Context limit: with extend, RoPE is scaled up to it; with refuse it can only "
        "lower the trained context (lengths over the limit are skipped)."
        + opt.default_is("with extend the longest length, else the trained context"),
        show_default=False,
        rich_help_panel=opt.ENGINE,
    ),
]
OutputDirOpt = Annotated[
    Path,
    typer.Option(
        "--output-dir",
        "-o",
        parser=opt.nonempty_path,
        metavar="DIR",
        help="Folder for eval.json and eval.png.",
    ),
]
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force/--no-force", metavar="", show_default=False,
        help="Replace an earlier eval's eval.json and eval.png in OUTPUT_DIR (never a file "
        "eval did not write).",
    ),
]  # fmt: skip


def register(app: typer.Typer) -> None:
    """Add ``eval`` to ``app``."""
    app.command("eval")(eval_command)


def eval_command(
    docs: HaystackDocs = None,
    model: opt.Model = None,
    lengths: LengthsOpt = "2K,4K",
    depths: DepthsOpt = "0.1,0.5,0.9",
    tasks: TasksOpt = "niah_single,niah_multikey",
    configs: ConfigsOpt = "dense,sparse",
    samples: SamplesOpt = 1,
    seed: SeedOpt = 0,
    max_new_tokens: MaxNewOpt = None,
    output_dir: OutputDirOpt = Path(DEFAULT_OUTPUT_DIR),
    force: ForceOpt = False,
    preset: opt.Preset = "auto",
    max_batch: opt.MaxBatch = None,
    context_policy: EvalContextPolicy = None,
    max_context: EvalMaxContext = None,
    extend_method: opt.ExtendMethod = None,
    threads: opt.Threads = None,
    device: opt.Device = None,
    encoding: opt.Encoding = "utf-8",
    errors: opt.Errors = "strict",
    allow_binary: opt.AllowBinary = False,
) -> None:
    """Accuracy of dense and sparse decoding on long-context tasks generated locally.

    Example: `hisparse eval --lengths 2K,4K --tasks niah_single,niah_multikey --configs dense,sparse,top_k=512`

    Every configuration answers the same prompts (prefilled once, decoded as a batch per configuration); scores are RULER's string match (share of expected values in the answer). Writes OUTPUT_DIR/eval.json and OUTPUT_DIR/eval.png and prints the table; an OUTPUT_DIR holding an earlier eval.json is refused unless --force, an eval.json eval did not write even with it; OUTPUT_DIR is locked as `hisparse run` locks its folder.

    Lengths over the model's context are skipped unless --context-policy extend (RoPE scaling; the limit defaults to the longest length). Exit code 2 on bad arguments, found before the model loads; 130 on Ctrl-C, 143 on SIGTERM (nothing is written before every configuration has run).
    """
    guard_std_streams(f"{STDOUT_CLOSED}; results: {output_dir / 'eval.json'}")
    written: list[Path] = []  # eval.json, once written
    from hisparse_cli.runner import _SigtermAsInterrupt

    sigterm = _SigtermAsInterrupt()  # SIGTERM stops eval as Ctrl-C does, and says so
    try:
        sigterm.__enter__()
        from engine.capacity.planner import parse_context
        from engine.config import ConfigError
        from engine.measure import fidelity, ruler
        from engine.presets import resolve_config
        from hisparse_cli.bench_cmd import _chosen_preset
        from hisparse_cli.eval_report import HEATMAP_FILE, is_eval_report
        from hisparse_cli.results import LOCK_FILE
        from hisparse_cli.runner import (
            UsageError,
            check_encoding,
            check_model_path,
            check_no_earlier_results,
            check_output_folder,
            locked_output_folder,
            with_free_threads,
        )

        def check_earlier_eval() -> None:  # an earlier eval's report, or the user's file
            check_no_earlier_results(
                output_dir, REPORT_FILE, "--output-dir", "eval", force, is_eval_report
            )

        def task_names() -> list[str]:
            names = _items(tasks)
            ruler.check_tasks([n for n in names if n != "all"])
            if "all" in names:  # all,niah_single: every task all the same
                return list(ruler.TASKS)
            _unique("--tasks", names, str)
            return names

        def config_specs() -> list[Any]:
            try:
                return fidelity.parse_configs(configs)
            except ValueError as exc:
                raise ValueError(f"--configs: {exc}") from None

        def text_encoding() -> None:
            try:
                check_encoding(encoding)  # as `hisparse run` checks it
            except UsageError as exc:
                raise ValueError(str(exc)) from None

        def length(text: str) -> int:
            try:
                return parse_context(text)
            except ValueError as exc:
                raise ValueError(f"--lengths: {exc}") from None

        try:
            problems: list[str] = []  # every option's problem at once, not only the first
            length_list = _collect(
                problems, lambda: sorted(_unique("--lengths", _items(lengths), length, "tokens"))
            )
            depth_list = _collect(problems, lambda: _unique("--depths", _items(depths), _depth))
            task_list = _collect(problems, task_names)
            config_list = _collect(problems, config_specs)
            _collect(problems, text_encoding)
            if problems:
                raise ValueError("\n".join(problems))
            if not length_list or not depth_list:
                raise ValueError("--lengths and --depths need at least one value each")
            if context_policy == "extend" and max_context is None:
                max_context = max(length_list)
            overrides = {
                "context_policy": context_policy,
                "max_context": max_context,
                "extend_method": extend_method,
                "num_threads": threads,
                "device": device,
                "max_batch": max_batch,
            }
            base = _eval_policy(resolve_config(_chosen_preset(preset, device), {}, overrides))
            base, note = with_free_threads(base)
            if note:
                typer.echo(note)
            _unique("--configs", config_list, lambda c: c.engine_config(base), "settings")
            try:  # as `hisparse run` checks its folder: before the model loads
                check_output_folder(
                    output_dir, (REPORT_FILE, HEATMAP_FILE, LOCK_FILE), writer="eval"
                )
                check_earlier_eval()
            except UsageError as exc:
                raise ValueError(str(exc)) from None
            texts = _read_haystack(docs or [], encoding, errors, allow_binary, output_dir)
            if model is not None and not model.startswith("synthetic:"):
                try:  # as `hisparse run` checks it: a missing path, a FIFO (it hung), a file
                    check_model_path(model)  # not GGUF, a folder lacking a model's files
                except UsageError as exc:
                    raise ValueError(str(exc)) from None
        except (ConfigError, ValueError) as exc:
            _fail(str(exc), (model, preset, *(docs or ())))
        try:  # the lock `hisparse run` takes: a second eval into this folder is refused
            with locked_output_folder(output_dir, "--output-dir"):
                check_earlier_eval()  # again, under the lock: one may have ended since
                report = _run(model, base, config_list, texts, task_list, length_list,
                              depth_list, samples, seed, max_new_tokens)  # fmt: skip
                _write(report, output_dir, written)
        except UsageError as exc:
            _fail(str(exc), (output_dir,))
    except KeyboardInterrupt:  # typer's own exit 130 says nothing (SIGTERM: exit 143, silent)
        _interrupted(output_dir, written, sigterm.received)
    finally:
        sigterm.__exit__()


def _run(model, base, configs, texts, tasks, lengths, depths, samples, seed, max_new):
    from engine.config import ConfigError
    from hisparse_cli.runner import _StopSignalsDeferred, import_engine_modules

    with _StopSignalsDeferred() as stop:  # torch's native imports: a signal only recorded
        import_engine_modules()
    if stop.signals:  # Ctrl-C or SIGTERM during the imports: stop now it is safe
        signal.raise_signal(stop.signals[0])
    from engine.load import place_model
    from engine.measure import fidelity, ruler

    try:
        placed = place_model(base, model)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        _fail(str(exc), (model,))
    limit = placed.context_limit
    skipped = [n for n in lengths if n > limit]
    for n in skipped:
        typer.echo(
            f"skipped length {n}: over the context limit of {limit} tokens "
            f"(--context-policy extend --max-context {max(lengths)} extends RoPE)",
            err=True,
        )
    lengths = [n for n in lengths if n <= limit]
    if not lengths:
        _fail(f"no length fits the context limit of {limit} tokens")
    _note_budget_covers(base, configs, lengths)
    tok = placed.tokenizer
    try:
        hay = ruler.Haystack.from_texts(texts, tok) if texts else ruler.Haystack.noise(tok)
        errors: list[str] = []
        builder = ruler.SuiteBuilder(tok, hay, seed)
        suite = builder.suite(tasks, lengths, depths, samples, max_new, errors=errors)
    except ValueError as exc:
        _fail(str(exc))
    for e in errors:
        typer.echo(f"skipped {e}", err=True)
    if not suite:
        _fail("no prompt could be built")
    typer.echo(
        f"{len(suite)} prompts x {len(configs)} configs on {escaped(placed.name)} "
        f"({'haystack: ' + str(len(texts)) + ' file(s)' if texts else 'haystack: noise'})"
    )
    report = fidelity.run_eval(placed, base, configs, suite, log=typer.echo)
    report |= {
        "seed": seed,
        "tasks": tasks,
        "lengths": lengths,
        "skipped_lengths": skipped,
        "skipped_cells": errors,
        "depths": depths,
        "haystack": "noise" if not texts else f"{len(texts)} file(s)",
    }
    return report


def _note_budget_covers(base, configs, lengths: list[int]) -> None:
    """Say which sparse configurations select every page at some length (a budget of
    ``top_k`` tokens covers the whole prompt there), so they measure dense attention."""
    for config in configs:
        cfg = config.engine_config(base)
        if cfg.attention == "dense":
            continue
        covered = [n for n in lengths if cfg.top_k >= n]
        if covered:
            typer.echo(
                f"note: {config.name} keeps top_k {cfg.top_k} tokens, the whole prompt at "
                f"length(s) {', '.join(map(str, covered))}: every page is selected there, so "
                "it decodes as dense (a longer length or a smaller top_k=N tests the sparsity)",
                err=True,
            )


def _write(report, output_dir: Path, written: list[Path]) -> None:
    """Write eval.json (its path appended to ``written``) and the heatmap; print the table."""
    from rich.console import Console

    from hisparse_cli import eval_report

    path = eval_report.write_report(report, output_dir, REPORT_FILE)
    written.append(path)
    note = eval_report.heatmap(report, output_dir / eval_report.HEATMAP_FILE)
    if note:  # no heatmap drawn: an earlier eval's (--force) would disagree with eval.json
        (output_dir / eval_report.HEATMAP_FILE).unlink(missing_ok=True)
    Console().print(eval_report.accuracy_table(report))
    heatmap = escaped(str(output_dir / eval_report.HEATMAP_FILE))
    typer.echo(f"wrote {escaped(str(path))}" + (f"; {note}" if note else f", {heatmap}"))


def _interrupted(output_dir: Path, written: list[Path], terminated: bool = False) -> NoReturn:
    """Say on stderr that Ctrl-C (``terminated``: SIGTERM) stopped eval and what it left
    written; exit 130 (143)."""
    if written:
        where = f"after writing {escaped(str(written[0]))} (the table and heatmap may be missing)"
    else:
        report = escaped(str(output_dir / REPORT_FILE))
        where = f"before writing {report}: no result was written (eval "
        where += "writes its results only once every configuration has run)"
        if (output_dir / REPORT_FILE).is_file():
            where += f"; the {REPORT_FILE} there is an earlier run's, left as it was"
    typer.echo(f"interrupted ({'SIGTERM' if terminated else 'Ctrl-C'}) {where}", err=True)
    raise typer.Exit(EXIT_TERMINATED if terminated else EXIT_INTERRUPTED)


def _depth(text: str) -> float:
    """A needle depth: a fraction of the haystack in [0, 1].

    Raises
    ------
    ValueError
        Not a number, or outside [0, 1].
    """
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"--depths: {text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"--depths: {text!r} is outside [0, 1] (a fraction of the haystack)")
    return value


def _collect(errors: list[str], check: Callable[[], Any]) -> Any:
    """``check()``, or ``None`` with its ``ValueError``'s message appended to ``errors``."""
    try:
        return check()
    except ValueError as exc:
        errors.append(str(exc))
        return None


def _unique(
    option: str, items: Sequence[Any], value: Callable[[Any], Any], what: str = ""
) -> list[Any]:
    """``value`` of each item, in order; two items of equal value are an error naming
    ``option`` and both as given (``2K`` and ``2048``: ``what`` says what was equal).

    Raises
    ------
    ValueError
        Items given twice or of the same value as an earlier one, or whose ``value``
        raised ``ValueError``: every such item, one line each.
    """
    seen: list[tuple[Any, Any]] = []  # (value, item); values need not be hashable
    problems: list[str] = []
    for item in items:
        try:
            v = value(item)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        earlier = next((i for w, i in seen if w == v), None)
        if earlier is not None:
            first, given = str(getattr(earlier, "name", earlier)), str(getattr(item, "name", item))
            if first == given:
                same = f"{first!r} is given twice"
            elif what == "tokens":
                same = f"{first!r} and {given!r} are both {v} tokens"
            else:
                same = f"{first!r} and {given!r} are the same {what or 'value'}"
            problems.append(f"{option}: {same}; give each once")
            continue
        seen.append((v, item))
    if problems:
        raise ValueError("\n".join(problems))
    return [v for v, _ in seen]


def _eval_policy(base: Any) -> Any:
    """``base`` with a preset's ``truncate`` or ``chunk`` context policy read as ``refuse``
    (said on stderr): eval builds each prompt to its length and skips those over the limit
    (the flag takes only :data:`EVAL_POLICIES`)."""
    if base.context_policy in EVAL_POLICIES:
        return base
    typer.echo(
        f"warning: context_policy {base.context_policy!r} (from the preset) does not apply to "
        "eval, which builds every prompt to its length: lengths over the context are "
        "skipped, as under refuse (--context-policy extend extends RoPE to them)",
        err=True,
    )
    return base.replace(context_policy="refuse")


def _items(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _read_haystack(
    paths: list[str],
    encoding: str = "utf-8",
    errors: str = "strict",
    allow_binary: bool = False,
    output_dir: Path | None = None,
) -> list[str]:
    """The texts of ``paths``: globs expanded as ``hisparse run`` expands its documents'
    (:func:`~hisparse_cli.manifest.expand_documents`: a glob never reads ``output_dir``,
    where eval writes), each file read as run reads documents
    (:func:`~hisparse_cli.textio.read_document` with ``--encoding``, ``--errors`` and
    ``--allow-binary``; its warnings on stderr); a glob that gives no file, and an
    unreadable file, are named and skipped.

    Raises
    ------
    ValueError
        Files were given but none could be read.
    """
    from hisparse_cli.manifest import OutputFolder, expand_documents
    from hisparse_cli.manifest_source import Problem
    from hisparse_cli.textio import DocumentError, read_document

    outputs = OutputFolder(output_dir, default=DEFAULT_OUTPUT_DIR)
    problems: list[Problem] = []
    notes: list[str] = []
    files: list[Path | str] = []
    for p in paths:  # a path named without a glob is read as it is (its own messages)
        globbed = glob.has_magic(os.path.expanduser(p))
        files += expand_documents(p, Path.cwd(), problems, notes, outputs) if globbed else [p]
    for problem in problems:
        typer.echo(f"skipped haystack input: {problem}", err=True)
    for note in [*notes, *(outputs.notes() if files else [])]:
        typer.echo(f"warning: {note}", err=True)
    texts = []
    for f in files:
        try:
            document = read_document(f, encoding, errors, allow_binary, reads_stdin=False)
        except DocumentError as exc:
            typer.echo(f"skipped haystack file {exc}", err=True)
            continue
        for note in (document.warning, document.control_note):
            if note:
                typer.echo(f"warning: {note}", err=True)
        texts.append(document.text)
    if paths and not texts:
        names = ", ".join(escaped(p) for p in paths)
        raise ValueError(f"no readable haystack file among {names}")
    return texts


def _fail(message: str, names: Sequence[str | None] = ()) -> NoReturn:
    """``error:`` and a line of ``message`` per line on stderr, exit 2. ``names``: the
    files and names the user gave (``--model``, ``--preset``, DOCS), escaped where the
    message holds them raw (:func:`~hisparse_cli.display.shown_message`: the engine's
    messages name them as they are), no control character reaching the terminal."""
    message = shown_message(message, names)
    for line in message.splitlines() or [message]:
        typer.echo(f"error: {line}", err=True)
    raise typer.Exit(EXIT_USAGE)
