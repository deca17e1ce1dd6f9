"""``hisparse replay``: miss rates of hot-buffer policies on a recorded selection trace.

Record a trace with ``hisparse run --trace FILE``; this command replays it through LRU
(the engine's policy), FIFO, random and Bélády's optimum (:mod:`engine.measure.replay`) and
prints policy x buffer -> miss rate. A run on several devices writes one file per worker
(``FILE.w0.jsonl``, ...: jobs in data mode, layers in pipeline mode); give them all and
they are replayed as one trace. The engine is imported inside the command.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from hisparse_cli import options as opt
from hisparse_cli.display import escaped, shown_message, terminal_text
from hisparse_cli.textio import input_identity

if TYPE_CHECKING:
    from engine.measure.replay import ReplayResult
    from engine.measure.trace import TraceHeader

EXIT_BAD_INPUT = 2
DEFAULT_MULTIPLES = (1.0, 2.0, 4.0)

def _check_traces(paths: list[Path]) -> None:
    """Refuse, in one ``error:`` line as ``hisparse run`` refuses a document, a trace that
    is missing, a folder, or a pipe or a device: reading /dev/zero never ends (and filled
    the memory), a FIFO with no writer blocks forever."""
    for path in paths:
        shown = escaped(str(path))
        if not path.exists():
            _refuse(f"trace not found: {shown}")
        if path.is_dir():
            _refuse(f"{shown} is a directory: a trace is a file written by hisparse run --trace")
        if not stat.S_ISREG(path.stat().st_mode):
            _refuse(
                f"{shown} is not a regular file (a pipe or a device): a trace is a file "
                "written by hisparse run --trace"
            )


TraceArg = Annotated[
    list[Path],
    typer.Argument(
        metavar="TRACES",
        help="Selection trace (hisparse run --trace FILE); with several devices, every "
        "worker's file (FILE.w0.jsonl FILE.w1.jsonl ...).",
    ),
]
BufferPagesOpt = Annotated[
    list[int] | None,
    typer.Option(
        "--device-buffer-pages",
        min=1,
        help="Hot-buffer capacity in pages per (job, layer, KV head); repeat for several.",
    ),
]
BufferMultipleOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--buffer-multiple",
        help="Capacity as a multiple of top_k: repeat or comma-separate. [default: 1,2,4]",
    ),
]
PolicyOpt = Annotated[
    list[str] | None,
    typer.Option("--policy", help="lru, fifo, random, belady: repeat or comma-separate. [default: all]"),
]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the random policy.")]
JsonOutOpt = Annotated[
    Path | None,
    typer.Option(
        "--json",
        metavar="FILE",
        parser=opt.json_output_file,
        help="Also write the results as JSON to FILE (a new file).",
        rich_help_panel=opt.OUTPUT,
    ),
]
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force/--no-force", metavar="", show_default=False,
        help="Replace an existing --json FILE (never one of the TRACES).",
        rich_help_panel=opt.OUTPUT,
    ),
]  # fmt: skip


def register(app: typer.Typer) -> None:
    """Add the ``replay`` command to ``app``."""
    app.command("replay")(replay_command)


def replay_command(
    traces: TraceArg,
    device_buffer_pages: BufferPagesOpt = None,
    buffer_multiple: BufferMultipleOpt = None,
    policy: PolicyOpt = None,
    seed: SeedOpt = 0,
    json_out: JsonOutOpt = None,
    force: ForceOpt = False,
) -> None:
    """Replay TRACES (the files of one run) through LRU, FIFO, random and Bélády at each hot-buffer size.

    Miss rate = misses / selected pages; "warm" leaves out cold misses (first selection of a page). --json never replaces a file unless --force, and never one of the TRACES; it is checked before anything is replayed (exit 2).

    Example: `hisparse replay trace.jsonl --buffer-multiple 1,2,4 --json out.json`
    """
    from engine.measure.replay import POLICIES, capacities_from_multiples, load_streams, replay
    from engine.measure.trace import read_traces

    _check_traces(traces)
    policies = _split(policy) or list(POLICIES)
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        _refuse(f"unknown policy {', '.join(unknown)}; choose from {', '.join(POLICIES)}")
    multiples = _multiples(buffer_multiple)
    if json_out is not None:
        _check_json_out(json_out, traces, force)
    try:
        header, records = read_traces(traces)
        _check_selections(traces)
        if not multiples and not device_buffer_pages:
            multiples = list(DEFAULT_MULTIPLES)
        capacities = sorted(
            set(device_buffer_pages or []) | set(capacities_from_multiples(header, multiples))
        )
        streams = load_streams(records)
        results = [replay(streams, c, p, seed) for p in policies for c in capacities]
    except ValueError as exc:  # its text names the files raw: escaped here
        _refuse(shown_message(str(exc), traces))
    except OSError as exc:  # a trace that cannot be opened (no permission)
        where = exc.filename if isinstance(exc.filename, str) else ", ".join(map(str, traces))
        _refuse(f"cannot read {escaped(where)}: {exc.strerror or exc}")
    Console().print(render_table(header, results))
    if json_out is not None:
        payload = {
            "trace": str(traces[0]) if len(traces) == 1 else [str(t) for t in traces],
            "header": header.to_json(),
            "seed": seed,
            "results": [r.to_dict() for r in results],
        }
        _write_json(json_out, json.dumps(payload, indent=2) + "\n")


def _check_json_out(path: Path, traces: list[Path], force: bool) -> None:
    """Refuse (exit 2) a ``--json`` FILE that cannot be written, before any work: a
    folder, one of the ``traces`` (the results would destroy their input, ``--force``
    or not), a device, FIFO or socket (``/dev/null``: ``--force`` or not), an existing file
    without ``force``, or a place where no file can be made
    (:func:`~hisparse_cli.runner.check_new_file`, as ``run --trace`` checks its file)."""
    from hisparse_cli.runner import UsageError, check_new_file

    shown = escaped(str(path))
    if path.is_dir():
        _refuse(f"--json {shown} is a directory; give a file name")
    if any(_same_file(path, trace) for trace in traces):
        _refuse(
            f"--json {shown} is one of the traces replayed; the results never replace "
            "their input (--force neither): choose another name"
        )
    try:  # first: a device or FIFO is never replaced, --force or not
        check_new_file(path, "--json")
    except UsageError as exc:
        _refuse(str(exc))
    if os.path.lexists(path) and not force:
        _refuse(
            f"--json {shown} already exists; give --force to replace it, or choose another name"
        )


def _check_selections(traces: list[Path]) -> None:
    """Refuse (exit 2) TRACES none of which holds a selection, only a header (what a run
    stopped before its first decode step leaves): there is nothing to replay, and a 0.0 %
    miss rate over 0 streams would say otherwise. Where only some are empty, each is
    named in a warning and the others replay."""
    from engine.measure.trace import read_trace

    empty = [t for t in traces if next(read_trace(t), None) is None]
    if not empty:
        return
    why = "only the header, no selection (the run stopped before its first decode step)"
    if len(empty) == len(traces):
        names = ", ".join(escaped(str(t)) for t in empty)
        _refuse(f"nothing to replay: {names} hold{'s' if len(empty) == 1 else ''} {why}")
    for t in empty:
        line = Text.assemble(("warning:", "yellow"), f" {escaped(str(t))} holds {why}; skipped")
        Console(stderr=True, soft_wrap=True).print(line, highlight=False)


def _same_file(path: Path, trace: Path) -> bool:
    """Whether ``path`` names the file ``trace`` (the same path resolved, or a hard link)."""
    if input_identity(path) == input_identity(trace):
        return True
    try:
        return os.path.samefile(path, trace)
    except OSError:  # no such file
        return False


def _write_json(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a temporary file renamed into place);
    missing folders are made. A failure is one error line naming the file, exit 1."""
    from hisparse_cli.results import write_text_atomic

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text)
    except OSError as exc:
        _refuse(f"cannot write --json {escaped(str(path))} ({exc.strerror or exc})", 1)


def render_table(header: TraceHeader, results: list[ReplayResult]) -> Table:
    """Policy rows x capacity columns; each cell "miss rate (warm miss rate)"."""
    capacities = sorted({r.capacity_pages for r in results})
    policies = list(dict.fromkeys(r.policy for r in results))
    first = results[0] if results else None
    caption = (
        f"{header.model}: page_size {header.page_size}, top_k {header.top_k} tokens "
        f"({header.top_k_pages} pages)"
    )
    if first is not None:
        caption += f"; {first.num_streams} streams, {first.accesses} selected pages"
    # the model as the run named it (a path): plain text, its control characters escaped
    table = Table(title="miss rate (warm: without cold misses)", caption=Text(escaped(caption)))
    table.add_column("policy")
    for c in capacities:
        table.add_column(f"{c} pages ({c / header.top_k_pages:g}x top_k)", justify="right")
    by_key = {(r.policy, r.capacity_pages): r for r in results}
    for p in policies:
        cells = [_cell(by_key.get((p, c))) for c in capacities]
        table.add_row(p, *cells)
    return table


def _cell(r: ReplayResult | None) -> str:
    if r is None:
        return ""
    return f"{100 * r.miss_rate:.1f}% ({100 * r.warm_miss_rate:.1f}%)"


def _split(values: list[str] | None) -> list[str]:
    return [v.strip() for item in values or [] for v in item.split(",") if v.strip()]


def _multiples(values: list[str] | None) -> list[float]:
    """``--buffer-multiple`` values as numbers; anything but a finite number > 0 is
    refused (a capacity of zero pages or less cannot hold a selection)."""
    multiples = []
    for text in _split(values):
        try:
            multiple = float(text)
        except ValueError:
            _refuse(f"--buffer-multiple {text!r} is not a number")
        if not math.isfinite(multiple) or multiple <= 0:
            _refuse(f"--buffer-multiple must be a number > 0 (a multiple of top_k), got {text}")
        multiples.append(multiple)
    return multiples


def _refuse(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """``error: message`` on stderr, exit ``code`` (2: bad input): plain text, not markup,
    and no control character of it reaching the terminal (names are escaped where they
    enter it)."""
    error = Text.assemble(("error:", "red"), " ", terminal_text(message))
    Console(stderr=True, soft_wrap=True).print(error, highlight=False)
    raise typer.Exit(code)
