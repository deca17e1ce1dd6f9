"""``hisparse quantize``: a 4-bit copy of a Hugging Face model folder.

The main app calls :func:`register`. The command is thin: it parses flags, calls
:func:`engine.weights.quantize.quantize_folder` (imported inside, so ``--help`` stays fast)
and prints the sizes before and after.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.text import Text

from hisparse_cli.display import escaped, shown_message, terminal_text
from hisparse_cli.options import nonempty_path

EXIT_REFUSED = 2

SrcArg = Annotated[
    Path,
    typer.Argument(
        parser=nonempty_path,
        help="Hugging Face model folder: config.json + *.safetensors (single or sharded).",
        show_default=False,
        metavar="SRC",
    ),
]
OutArg = Annotated[
    Path,
    typer.Argument(
        parser=nonempty_path, help="Output folder (created).", show_default=False, metavar="OUT"
    ),
]
GroupSizeOpt = Annotated[
    int,
    typer.Option(
        "--group-size",
        "-g",
        help="Weights per scale/offset group along K: 32, 64, 128 or 256 "
        "(a smaller one where K needs it).",
    ),
]
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force/--no-force", metavar="", show_default=False,
        help="Replace the files of OUT quantize writes (model.safetensors, config.json, "
        "the tokenizer files) where they exist.",
    ),
]  # fmt: skip
QuietOpt = Annotated[
    bool,
    typer.Option(
        "--quiet/--no-quiet", "-q", metavar="", show_default=False, help="No per-tensor progress."
    ),
]


def register(app: typer.Typer) -> None:
    """Add the ``quantize`` command to ``app``."""
    app.command("quantize")(quantize_command)


def quantize_command(
    src: SrcArg,
    out: OutArg,
    group_size: GroupSizeOpt = 128,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Quantise a Hugging Face model folder SRC to 4 bits into the folder OUT.

    Linear weights (q/k/v/o, gate/up/down projections) become 4-bit groups: qweight uint8, float32 scales and offsets. Embeddings, lm_head, norms and biases are copied unquantised, in their stored dtype (16-bit for bf16/fp16 checkpoints). config.json and the tokenizer files are copied; `hisparse run --model OUT` loads the result.

    Exit code: 0 written, 2 refused (unsupported model, bad group size, a file it writes exists in OUT: --force replaces them), found before any work.
    """
    from engine.weights.quantize import existing_outputs, quantize_folder

    console = Console(stderr=True)

    def progress(name: str) -> None:  # a tensor's name, as the file spells it: plain text
        console.print(f"  {escaped(name)}", markup=False, highlight=False)

    names = (src, out)  # escaped wherever a message holds them
    try:
        report = quantize_folder(
            src, out, group_size, overwrite=force, progress=None if quiet else progress
        )
    except FileExistsError:  # the engine's words name its overwrite=True
        existing = [escaped(str(p)) for p in existing_outputs(src, out)]
        _refuse(
            f"{', '.join(existing)} exist{'s' if len(existing) == 1 else ''}: quantize would "
            f"replace {'it' if len(existing) == 1 else 'them'}; --force replaces "
            f"{'it' if len(existing) == 1 else 'them'}, or choose another OUT"
        )
    except (ValueError, FileNotFoundError) as exc:  # the engine's words name its argument
        message = str(exc).replace(f"group_size={group_size} ", f"-g/--group-size {group_size} ")
        _refuse(shown_message(message, names))
    except OSError as exc:  # OUT cannot be written: no permission, a full disk
        where = escaped(exc.filename) if isinstance(exc.filename, str) else escaped(str(out))
        _refuse(f"cannot write {where}: {exc.strerror or exc}")
    smaller = (
        f", {report.num_smaller_group} with a smaller group" if report.num_smaller_group else ""
    )
    typer.echo(
        f"{report.num_quantized} linear weights quantised to 4 bits (group {report.group_size}"
        f"{smaller}), {report.num_copied} tensors copied unquantised"
    )
    typer.echo(
        f"safetensors: {_mb(report.src_bytes)} -> {_mb(report.out_bytes)} "
        f"({report.ratio:.1%}); wrote {escaped(str(report.out))}"
    )


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB ({n:,} bytes)"


def _refuse(message: str) -> NoReturn:
    """``error: message`` on stderr as plain text (a ``[red]`` in a name is no markup),
    no control character of it reaching the terminal; exit 2."""
    error = Text.assemble(("error:", "red bold"), " ", terminal_text(message))
    Console(stderr=True, soft_wrap=True).print(error, highlight=False)
    raise typer.Exit(EXIT_REFUSED)
