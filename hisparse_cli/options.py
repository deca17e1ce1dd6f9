"""Command-line options of ``hisparse run``, each declared once as an ``Annotated`` type.

Options that set a job field or an engine setting default to ``None`` ("not given"),
so they only override lower layers (preset, manifest) when the user passes them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

import typer

JOBS, SAMPLING, ENGINE, OUTPUT, TEXT = "Jobs", "Sampling", "Engine", "Output", "Input text"
AUDIT = "Audit"
"""The audit options' own panel: beside the on/off flags of ``Output`` (their ``--no-`` forms
take a column) their long names would be cut at 80 columns."""


def nonempty_text(value: str | Path) -> str:
    """Typer parser of an option that names something (a model, a file, a folder): ``""``
    or spaces (an unset shell variable, ``-o "$OUT"``) are refused instead of being read
    as ``.``, the current folder. A leading ``~`` is the home folder
    (:func:`os.path.expanduser`) even when the shell left it (``-o "~/out"``), as for the
    documents: not a folder named ``~`` in the current one.

    Raises
    ------
    typer.BadParameter : the value is empty or only spaces.
    """
    if not str(value).strip():
        raise typer.BadParameter("is empty (an unset shell variable?); give a path or a name")
    return os.path.expanduser(str(value))


def home_expanded(value: str) -> str:
    """Typer parser of ``--preset`` (a name or a file): a leading ``~`` is the home folder,
    as for the other paths (:func:`nonempty_text`)."""
    return os.path.expanduser(value)


def nonempty_path(value: str | Path) -> Path:
    """:func:`nonempty_text` as a :class:`~pathlib.Path`."""
    return Path(nonempty_text(value))


def run_output_dir(value: str | Path) -> Path:
    """Typer parser of ``hisparse run --output-dir``: :func:`nonempty_path`, and ``-``
    (standard output, as for the documents) refused rather than made a folder named ``-``.

    Raises
    ------
    typer.BadParameter : the value is empty or ``-``.
    """
    if str(value) == "-":
        raise typer.BadParameter(
            "'-' is not standard output here: results go to a folder (results.jsonl and "
            "<job>.txt); to stream them, --json-progress writes each job_finished object, "
            "its text included, as a JSON line on stdout; ./- names a folder called '-'"
        )
    return nonempty_path(value)


def json_output_file(value: str | Path) -> Path:
    """Typer parser of ``hisparse replay --json``: :func:`nonempty_path`, and ``-`` refused
    rather than made a file named ``-`` (the table already goes to standard output).

    Raises
    ------
    typer.BadParameter : the value is empty or ``-``.
    """
    if str(value) == "-":
        raise typer.BadParameter(
            "'-' is not standard output here: --json writes a file (the table goes to "
            "stdout); ./- names a file called '-'"
        )
    return nonempty_path(value)


def default_is(value: str) -> str:
    """`` [default: VALUE]`` for the help text of an option whose real default is ``None``
    ("not given": a preset or manifest may set it), shown as a value (Typer's
    ``show_default="..."`` would print it in parentheses); the bracket is escaped so
    Rich markup keeps it."""
    return f" \\[default: {value}]"


FLAG = ""
"""``metavar`` of on/off flags: no ``<bool>`` placeholder in ``--help``."""

Docs = Annotated[
    list[str] | None,
    typer.Argument(
        help="Documents (paths or globs), one job per file; - reads one from stdin.",
        show_default=False,
        metavar="DOCS",
    ),
]
ManifestFile = Annotated[
    list[Path] | None,  # a list only to refuse a second one (one_manifest), not silently
    typer.Option(
        "--manifest",
        "-m",
        parser=nonempty_path,
        metavar="FILE",
        help="Job manifest (.yaml or .jsonl) instead of DOCS.",
        rich_help_panel=JOBS,
    ),
]


def one_manifest(manifests: list[Path] | None) -> Path | None:
    """The one ``--manifest`` of ``hisparse run``: given twice, the last silently won (the
    first file's jobs never ran); several are refused, naming them.

    Raises
    ------
    typer.BadParameter : more than one ``--manifest``.
    """
    if not manifests:
        return None
    if len(manifests) > 1:
        from hisparse_cli.display import escaped

        shown = ", ".join(escaped(str(m)) for m in manifests)
        raise typer.BadParameter(
            f"given {len(manifests)} times ({shown}): a run takes one manifest; put the "
            "jobs in one file, or run each manifest on its own",
            param_hint="'--manifest' / '-m'",
        )
    return manifests[0]


Model = Annotated[
    str | None,
    typer.Option(
        parser=nonempty_text,
        metavar="FILE",
        help="Model file (GGUF) or folder." + default_is("the embedded SmolLM2-135M-Instruct"),
        show_default=False,
        rich_help_panel=JOBS,
    ),
]
Task = Annotated[
    Literal["summarize", "answer", "extract", "custom"] | None,
    typer.Option(
        metavar="NAME",  # not TASK: typer 0.27 takes a metavar equal to the name as the flag
        help="Built-in task: summarize, answer (with --question), extract (with --fields) or "
        "custom (with --prompt)." + default_is("summarize"),
        show_default=False,
        rich_help_panel=JOBS,
    ),
]
Prompt = Annotated[
    str | None,
    typer.Option(help="Custom prompt template; must contain ${document}.", rich_help_panel=JOBS),
]
Fields = Annotated[
    str | None,
    typer.Option(
        help="Comma-separated field names for --task extract (e.g. title,date,total): the "
        "reply is decoded constrained to one JSON object with exactly these keys, in order; "
        "the parsed object is the results line's data.",
        rich_help_panel=JOBS,
    ),
]
Question = Annotated[
    str | None, typer.Option(help="Question for --task answer.", rich_help_panel=JOBS)
]

MaxNewTokens = Annotated[
    int | None,
    typer.Option(
        help="New tokens per job."
        + default_is("the preset's sampling.max_tokens: 256 on cpu, 512 on the GPU presets"),
        show_default=False,
        rich_help_panel=SAMPLING,
    ),
]
Temperature = Annotated[
    float | None,
    typer.Option(
        help="0 = greedy." + default_is("the preset's, 0 in every preset"),
        show_default=False,
        rich_help_panel=SAMPLING,
    ),
]
TopP = Annotated[
    float | None,
    typer.Option(
        help="Nucleus sampling mass." + default_is("the preset's, 1 in every preset"),
        show_default=False,
        rich_help_panel=SAMPLING,
    ),
]
TopK = Annotated[
    int | None,
    typer.Option(
        "--top-k",
        help="Sample from the K most likely tokens (0 or -1 = off). Not the sparse budget.",
        rich_help_panel=SAMPLING,
    ),
]
Seed = Annotated[
    int | None,
    typer.Option(
        help="Sampling seed. Default: one derived from each job's id, so a rerun of a job "
        "draws the same sample; pass another seed for a different one.",
        rich_help_panel=SAMPLING,
    ),
]
Stop = Annotated[
    list[str] | None, typer.Option(help="Stop string (repeatable).", rich_help_panel=SAMPLING)
]

Preset = Annotated[
    str,
    typer.Option(
        parser=home_expanded,
        metavar="NAME|FILE",
        help="Hardware preset name or YAML file (see `hisparse presets`); auto picks the "
        "preset matching this machine's CUDA devices (cpu without CUDA).",
        rich_help_panel=ENGINE,
    ),
]
Attention = Annotated[
    Literal["dense", "sparse"] | None, typer.Option(help="Attention mode.", rich_help_panel=ENGINE)
]
Indexer = Annotated[
    Literal["quest", "dense", "oracle"] | None,
    typer.Option(help="Page selector for sparse attention.", rich_help_panel=ENGINE),
]
PageSize = Annotated[
    int | None, typer.Option(help="Tokens per page (16, 32 or 64).", rich_help_panel=ENGINE)
]
TopKTokens = Annotated[
    int | None,
    typer.Option(
        "--top-k-tokens",
        help="Sparse budget: tokens selected per layer and KV head.",
        rich_help_panel=ENGINE,
    ),
]
DeviceBuffer = Annotated[
    int | None,
    typer.Option(
        help="Hot-buffer tokens per layer and KV head." + default_is("2 x --top-k-tokens"),
        rich_help_panel=ENGINE,
    ),
]
SinkTokens = Annotated[
    int | None, typer.Option(help="Always-selected tokens at the start.", rich_help_panel=ENGINE)
]
LocalWindow = Annotated[
    int | None, typer.Option(help="Always-selected most recent tokens.", rich_help_panel=ENGINE)
]
MaxBatch = Annotated[
    int | None, typer.Option(help="Jobs decoded together.", rich_help_panel=ENGINE)
]
ContextPolicy = Annotated[
    Literal["refuse", "extend", "truncate", "chunk"] | None,
    typer.Option(
        help="Prompts longer than the model's trained context: refuse, extend (RoPE scaling), "
        "truncate (cut the document) or chunk (the task on overlapping chunks, then on their "
        "results).",
        rich_help_panel=ENGINE,
    ),
]
MaxContext = Annotated[
    int | None,
    typer.Option(
        help="Context limit for --context-policy extend/truncate.", rich_help_panel=ENGINE
    ),
]
ExtendMethod = Annotated[
    Literal["yarn", "dynamic", "linear"] | None,
    typer.Option(
        help="RoPE scaling for --context-policy extend." + default_is("yarn"),
        show_default=False,
        rich_help_panel=ENGINE,
    ),
]
TruncateKeep = Annotated[
    Literal["head", "tail", "middle"] | None,
    typer.Option(
        help="What --context-policy truncate keeps: head, tail, or middle (both ends; "
        "the middle is cut)." + default_is("head"),
        show_default=False,
        rich_help_panel=ENGINE,
    ),
]
MemoryBudget = Annotated[
    float | None,
    typer.Option("--memory-budget", help="Device memory to use, GiB.", rich_help_panel=ENGINE),
]
PageMetadata = Annotated[
    Literal["exact", "superpage"] | None,
    typer.Option(
        "--page-metadata",
        help="Quest page metadata read per step: exact (every page's key min/max, the "
        "reference) or superpage (score superpages of 16 pages first, then only the pages "
        "of the best ones: far fewer bytes, near-identical pages).",
        rich_help_panel=ENGINE,
    ),
]
KvHostDtype = Annotated[
    Literal["bf16", "fp8"] | None,
    typer.Option(
        "--kv-host-dtype",
        help="Host KV pool records: bf16 (in the KV dtype) or fp8 (e4m3, one scale per "
        "token row: half the pinned and link bytes).",
        rich_help_panel=ENGINE,
    ),
]
HotBufferDtype = Annotated[
    Literal["bf16", "fp8"] | None,
    typer.Option(
        "--hot-dtype",
        help="Hot buffer on the device: bf16 (records dequantised into the KV dtype) or fp8 "
        "(as an fp8 host pool stores them, read by attention; about twice the "
        "--device-buffer tokens in the same memory; needs --kv-host-dtype fp8; attention "
        "sums in another order on a GPU, so its text can differ from bf16's: "
        "docs/performance.md).",
        rich_help_panel=ENGINE,
    ),
]
HostPool = Annotated[
    float | None,
    typer.Option(
        "--host-pool",
        help="Host KV pool, GiB, over all workers (pinned when CUDA is present).",
        rich_help_panel=ENGINE,
    ),
]
Threads = Annotated[
    int | None,
    typer.Option(
        "--threads",
        min=1,
        help="CPU threads for torch (num_threads; OMP_NUM_THREADS also sets it)."
        + default_is(
            "the free cores of a CPU run: the cores less the 1-minute load average, at least "
            "1 (all of them on an idle box); several CPU devices split the cores"
        ),
        show_default=False,
        rich_help_panel=ENGINE,
    ),
]
Device = Annotated[str | None, typer.Option(help="cpu, cuda or cuda:N.", rich_help_panel=ENGINE)]
Devices = Annotated[
    str | None,
    typer.Option(
        help="Several devices, comma-separated (cuda:0,cuda:1 or cpu,cpu): one worker each."
        + default_is("the preset's hardware devices"),
        show_default=False,
        rich_help_panel=ENGINE,
    ),
]
Parallel = Annotated[
    Literal["data", "pipeline"] | None,
    typer.Option(
        help="With several devices: data (whole jobs per device) or pipeline (layers split "
        "across devices)." + default_is("the preset's"),
        show_default=False,
        rich_help_panel=ENGINE,
    ),
]
Trace = Annotated[
    Path | None,
    typer.Option(
        parser=nonempty_path,
        metavar="FILE",
        help="Record every selection to FILE (hisparse replay FILE); with several devices one "
        "file per worker, FILE.w0.jsonl, FILE.w1.jsonl, ...",
        rich_help_panel=ENGINE,
    ),
]

OutputDir = Annotated[
    Path,
    typer.Option(
        "--output-dir",
        "-o",
        parser=run_output_dir,
        metavar="DIR",
        help="Where results.jsonl, config.json and <job>.txt go.",
        rich_help_panel=OUTPUT,
    ),
]

Audit = Annotated[
    int | None,
    typer.Option(
        "--audit",
        min=0,
        metavar="N",
        help="Fidelity audit: N decode steps of each job (spread over its decode, seeded) also "
        "run dense attention over the job's whole KV; the results line gets top-1 agreement, "
        "KL and the attention mass kept (audit_steps)." + default_is("0, off"),
        show_default=False,
        rich_help_panel=AUDIT,
    ),
]
AuditSeed = Annotated[
    int | None,
    typer.Option(
        min=0,
        help="Seed of the audited steps' choice (audit_seed)." + default_is("0"),
        show_default=False,
        rich_help_panel=AUDIT,
    ),
]
AuditMinAgreement = Annotated[
    float,
    typer.Option(
        min=0.0,
        max=1.0,
        help="Flag a job whose audited top-1 agreement with dense is below this share (0-1).",
        rich_help_panel=AUDIT,
    ),
]
AuditMaxKl = Annotated[
    float | None,
    typer.Option(
        "--audit-max-kl",
        min=0.0,
        help="Also flag a job whose mean audited KL(dense || sparse) is above this (nats)."
        + default_is("not checked"),
        show_default=False,
        rich_help_panel=AUDIT,
    ),
]

JsonProgress = Annotated[
    bool,
    typer.Option(
        metavar=FLAG,
        show_default=False,
        help="Progress as JSON lines on stdout.",
        rich_help_panel=OUTPUT,
    ),
]
PrintConfig = Annotated[
    bool,
    typer.Option(
        metavar=FLAG,
        show_default=False,
        help="Print the resolved config (engine settings, and each job's task, inputs and "
        "sampling) and exit; nothing is run or written.",
        rich_help_panel=OUTPUT,
    ),
]
Force = Annotated[
    bool,
    typer.Option(
        metavar=FLAG,
        show_default=False,
        help="Redo jobs already done in results.jsonl.",
        rich_help_panel=OUTPUT,
    ),
]
RetryFailed = Annotated[
    bool,
    typer.Option(
        metavar=FLAG,
        show_default=False,
        help="Try again jobs whose last failure will recur with the same inputs and settings "
        "(document refused for its content, prompt too long); they are skipped otherwise.",
        rich_help_panel=OUTPUT,
    ),
]

Encoding = Annotated[
    str, typer.Option(help="Text encoding of the documents.", rich_help_panel=TEXT)
]
Errors = Annotated[
    Literal["strict", "replace"],
    typer.Option(
        help="Invalid bytes: strict = refuse the document, replace = U+FFFD.", rich_help_panel=TEXT
    ),
]
AllowBinary = Annotated[
    bool,
    typer.Option(
        metavar=FLAG,
        show_default=False,
        help="Read documents that look binary (NUL or control bytes) anyway: invalid bytes "
        "become U+FFFD, control characters are removed, and a warning names the file.",
        rich_help_panel=TEXT,
    ),
]
