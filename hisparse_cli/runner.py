"""``hisparse run``: validate, plan, drive the engine, record results.

Lifecycle of one run:

1. Check the request and build the jobs (manifest or document paths) and the engine
   config, including that its devices exist here (a ``cuda`` preset on a CPU-only box);
   any problem -> messages on stderr, exit 2, nothing written.
2. Create the output dir, lock it, write ``config.json``, read ``results.jsonl``.
3. Plan: drop superseded failure lines from ``results.jsonl``; read every input,
   compute resume keys; skip jobs already done; record jobs whose documents are unusable
   or whose output file is an input of the run as failed; jobs whose last line is a final
   failure with the same key (documents refused for their content, prompts too long) are
   shown as failed without a new line, unless ``--retry-failed`` or ``--force``.
4. Load the engine (:func:`load_engine`, a hook tests replace) and feed it
   :class:`~engine.events.Job` objects lazily (document -> chat messages ->
   ``engine.text.tokenizer.encode_chat``). A load failure caused by a setting, path or
   config (:func:`is_config_error`: bad device, host pool larger than memory, budget
   without room for the weights, missing or non-GGUF model) exits 2; others exit 1.
5. Fold every event into the progress state, show it, and write each result as its
   job ends (``.txt`` first, then the ``results.jsonl`` line). A file that cannot be
   written (:class:`~hisparse_cli.results.WriteFailed`: a full disk) stops the run as an
   engine error does, with one error line; that job counts as failed, and its ``.txt``
   is removed when its line was not written (:meth:`BatchRun._handle`).
6. Ctrl-C (SIGINT) or SIGTERM once: ``engine.cancel()``; running jobs end as
   ``cancelled``. Twice: stop now. SIGTERM before the engine runs stops at once. Once
   the run has returned, a Ctrl-C during the exit ends it quietly (:func:`quiet_late_interrupts`).
7. Print the summary; exit 0 (all ok), 1 (a job failed or did not run), 130 (Ctrl-C),
   143 (SIGTERM).
"""

from __future__ import annotations

import atexit
import codecs
import contextlib
import dataclasses
import fnmatch
import functools
import hashlib
import json
import os
import signal
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from rich.console import Console

from engine.config import CacheFullError, ConfigError, EngineConfig
from engine.cuda_devices import CudaDevices, probe_cuda_devices
from engine.events import (
    Event,
    Job,
    JobAdmitted,
    JobFailed,
    JobFinished,
    JobResult,
    StartupTimes,
)
from engine.serve.base import BatchEngine
from engine.serve.workers import WorkerDied
from engine.text.context import (
    PromptTooLong,
    chunk_document,
    fit_prompt,
    too_long_by_size_message,
    too_long_message,
)
from hisparse_cli import openai_batch, preflight, settings, textio
from hisparse_cli.auto_preset import AUTO, AutoChoice, choose_preset
from hisparse_cli.chunking import ChunkPartFinished, ChunkScheduler
from hisparse_cli.display import escaped, terminal_text
from hisparse_cli.extract import parse_extracted
from hisparse_cli.keys import (
    DEFAULT_MODEL_ID,
    model_fingerprint,
    output_only,
    record_hash,
    setting_changes,
)
from hisparse_cli.manifest import Manifest, ManifestError, jobs_from_paths, load_manifest
from hisparse_cli.naming import EarlierJob
from hisparse_cli.pipes import STDOUT_CLOSED, guard_consoles
from hisparse_cli.plan import FAILED_BEFORE, INVALID, RUN, SKIP, PlannedJob, plan_jobs
from hisparse_cli.progress import ProgressTracker, RunSummary, part_prompt_tokens, summarize
from hisparse_cli.reporters import Reporter, make_reporter
from hisparse_cli.results import (
    FINAL_PROMPT,
    LOCK_FILE,
    RESULTS_FILE,
    SUCCESS_REASONS,
    AuditLimits,
    OutputDirBusy,
    ResultsLog,
    WriteFailed,
    earlier_jobs,
    earlier_outputs,
    failure_record,
    is_hisparse_results,
    jobs_of,
    lock_file_problem,
    lock_output_dir,
    result_record,
    results_file_problem,
    utc_now,
    write_problem,
    write_text_atomic,
)
from hisparse_cli.settings import (
    CONFIG_FILE,
    SettingsError,
    config_document,
    engine_flag,
    is_hisparse_config,
    job_settings,
    preset_sampling,
    resolve_engine_config,
    save_config,
)
from hisparse_cli.tasks import build_messages
from hisparse_cli.textio import (
    ERROR_MODES,
    document_name,
    input_identity,
    join_documents,
    read_documents,
    shown_path,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
DEVICE_KINDS = ("cpu", "cuda")


def handled_stop_signals() -> tuple[int, ...]:
    """The :data:`STOP_SIGNALS` the run handles now: SIGTERM always; SIGINT unless it is
    ignored, as a background job of a non-interactive shell inherits it (``hisparse run
    ... &`` in a script): POSIX programs keep it ignored, so the run never puts its own
    handler over that ``SIG_IGN`` (it did during the imports and the decode, not during
    the weights' load, so one ``kill -INT`` cancelled and another did nothing). The run
    itself never ignores SIGINT: an ignored one was inherited."""
    return tuple(
        sig
        for sig in STOP_SIGNALS
        if not (sig == signal.SIGINT and signal.getsignal(sig) is signal.SIG_IGN)
    )


def job_where(spec: Any) -> str:
    """Where a job comes from, for its error messages: its document's path (``standard
    input`` for ``-``; ``and N more`` for a job over several), else its origin
    (``manifest:line`` or ``command line``)."""
    inputs = list(getattr(spec, "inputs", ()) or ())
    if not inputs:
        return escaped(str(spec.origin))
    more = f" and {len(inputs) - 1} more" if len(inputs) > 1 else ""
    return f"{textio.shown_path(inputs[0])}{more}"  # control characters escaped


class UsageError(Exception):
    """The command line cannot work as given (exit 2)."""


class RunRefused(UsageError):
    """Every check of :func:`run_problems` that refuses the run, as ``--print-config``
    lists them (``problems``, in its order): one ``error:`` line each (exit 2)."""

    def __init__(self, problems: Sequence[str]):
        super().__init__(problems[0])
        self.problems = list(problems)


class LoadConfigError(Exception):
    """The model could not be loaded because of a setting, path or config (exit 2);
    ``problems``: each refusal found before the load (one ``error:`` line each)."""

    def __init__(self, *problems: str):
        super().__init__(*problems[:1])
        self.problems = list(problems)


@dataclass(frozen=True)
class RunRequest:
    """Everything ``hisparse run`` was asked to do.

    job_overrides: job fields from flags (``None`` = not given).
    engine_overrides: EngineConfig fields from flags (``None`` = not given).
    stdin: the bytes of standard input when ``-`` is among ``docs`` (``None``: read by
        :func:`execute`, from ``sys.stdin``).
    """

    docs: tuple[str, ...] = ()
    manifest: Path | None = None
    model: str | None = None
    job_overrides: dict[str, Any] = field(default_factory=dict)
    engine_overrides: dict[str, Any] = field(default_factory=dict)
    preset: str = AUTO
    output_dir: Path = Path("hisparse-out")
    json_progress: bool = False
    encoding: str = "utf-8"
    errors: str = "strict"
    allow_binary: bool = False
    print_config: bool = False
    force: bool = False
    retry_failed: bool = False
    audit_limits: AuditLimits = field(default_factory=AuditLimits)
    stdin: bytes | None = None

    @property
    def text_options(self) -> dict[str, str]:
        """How documents are decoded; part of every job's resume key."""
        return {"encoding": self.encoding, "errors": self.errors}


def import_engine_modules() -> None:
    """Import :mod:`engine.load` and with it torch, triton and the kernels (a hook tests
    replace): their native extensions load here, where a stop signal is only recorded
    (:class:`_StopSignalsDeferred`)."""
    import engine.load  # noqa: F401


def load_engine(config: EngineConfig, model: str | None, job_tokens: int | None = None) -> Any:
    """``engine.load.load_engine``, imported on first use (tests replace this hook; the
    run passes ``job_tokens``, the longest job it counted, only when it has one).

    Checks the host KV pool against the memory available (:func:`check_host_pool`)
    before any weights are read.
    """
    check_host_pool(config, model)
    from engine.load import load_engine as _load_engine

    return _load_engine(config, model, job_tokens=job_tokens)


def load_tokenizer(config: EngineConfig, model: str | None) -> Any:
    """``engine.load.load_tokenizer``'s tokenizer of ``model``, no weights read (tests
    replace this hook, as :func:`load_engine`); the load then reuses it."""
    from engine.load import load_tokenizer as _load_tokenizer

    return _load_tokenizer(model, config.tokenizer)[0]


def job_document(spec: Any, request: RunRequest) -> tuple[list | None, str]:
    """``(documents, text)`` of a job: its input files read and joined, or for an
    OpenAI-batch request ``(None, its last user message)``. Raises what reading raises."""
    if spec.messages is not None:  # an OpenAI-batch request: its last user message
        return None, openai_batch.last_user_text(spec.messages)
    documents = read_documents(
        spec.inputs,
        **request.text_options,
        allow_binary=request.allow_binary,
        stdin=request.stdin,
    )
    return documents, join_documents(documents)


def job_messages(spec: Any) -> Callable[[str], list[dict]]:
    """Document text -> the job's chat messages (an OpenAI-batch request: its own
    messages with ``text`` as the last user message)."""

    def messages(text: str) -> list[dict]:
        if spec.messages is not None:
            return openai_batch.messages_with(spec.messages, text)
        return build_messages(spec.task, text, spec.id, document_name(spec.inputs[0]))

    return messages


def free_cpu_threads(config: EngineConfig) -> int | None:
    """CPU threads for a CPU run whose ``num_threads`` is unset, when other processes keep
    cores busy: the cores less the 1-minute load average (at least 1); ``None`` when the
    machine is idle enough for torch's default (every core), when the user chose
    (``--threads``, ``OMP_NUM_THREADS``), on a GPU run, or where the load cannot be read. torch's OpenMP threads wait on each other when they outnumber
    the free cores: decode ran ~5-8x slower on a shared 2-core box (README, "CPU threads")."""
    chosen = config.num_threads is not None or "OMP_NUM_THREADS" in os.environ
    if chosen or config.device != "cpu" or config.devices:
        return None
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    cores = os.cpu_count() or 1
    free = max(1, int(cores - load + 0.5))
    return free if free < cores else None


def with_free_threads(config: EngineConfig) -> tuple[EngineConfig, str | None]:
    """``config`` with ``num_threads`` set to :func:`free_cpu_threads` when that chose a
    count, and the line that says so (``None`` when it did not); ``hisparse run`` and
    ``hisparse eval`` both apply it before the model loads. A ``num_threads`` above the
    machine's CPU count (``--threads 999``) is cut to that count, with a line saying so:
    OpenMP threads beyond the cores only wait on each other (a run ~4x slower)."""
    cores = os.cpu_count() or 1
    if config.num_threads is not None and config.num_threads > cores:
        note = (
            f"--threads {config.num_threads} is more than the {cores} CPU threads here: "
            f"using {cores} (more threads than cores stall each other)"
        )
        return config.replace(num_threads=cores), note
    threads = free_cpu_threads(config)
    if not threads:
        return config, None
    note = (
        f"using {threads} of {os.cpu_count()} CPU threads: the others are busy "
        f"(load {os.getloadavg()[0]:.1f}); --threads N overrides (the answer can change "
        "with the count: README, \"CPU threads\")"
    )
    return config.replace(num_threads=threads), note


def triton_cache_is_cold() -> str:
    """The Triton kernel cache folder when it holds nothing yet (kernels will compile on
    first use: ``$TRITON_CACHE_DIR``, default ``~/.triton/cache``), else ``""``."""
    folder = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    try:
        return "" if any(folder.iterdir()) else str(folder)
    except OSError:  # missing or unreadable
        return str(folder)


def fit_preset_host_pool(
    config: EngineConfig,
    manifest_engine: Mapping[str, Any] | None,
    flags: Mapping[str, Any] | None,
    model: str | None = None,
) -> tuple[EngineConfig, str | None]:
    """A preset's host pool cap cut to what this machine can hold: when neither
    ``--host-pool`` nor the manifest set ``host_pool_gb`` and the preset's cap exceeds
    :data:`engine.kv.sizing.HOST_POOL_SHARE` of the host memory available now, less what
    loading ``model`` will take of it (:func:`model_load_host_bytes`), the cap becomes that
    share (whole 0.25 GiB, at least 0.25) and the returned note says so: the rule
    :func:`check_host_pool` applies, so the checks before and after the load accept it. A
    cap the user chose is left alone (:func:`check_host_pool` refuses it if it does not
    fit). The pool is a cap: jobs that need more than the cut pool are refused one by one
    with the sizes, not the whole run.

    Returns ``(config, note or None)``."""
    chosen = (flags or {}).get("host_pool_gb") is not None or "host_pool_gb" in (
        manifest_engine or {}
    )
    if chosen or not _pool_on_host(config):
        return config, None
    from engine.kv.sizing import HOST_POOL_SHARE, available_host_bytes, host_pool_limit

    avail = available_host_bytes(config.host_memory_gb)
    if avail is None:
        return config, None
    load = 0 if _declared_host_memory(config) else model_load_host_bytes(config, model)
    limit = host_pool_limit(avail, load)
    if config.host_pool_gb * 2**30 <= limit:
        return config, None
    fit = fitted_pool_gb(limit)
    less = f" less the {load / 2**30:.1f} GiB the model load will take" if load else ""
    note = (
        f"host pool: the preset's {config.host_pool_gb:g} GiB cap is more than "
        f"{HOST_POOL_SHARE:.0%} of the {avail / 2**30:.1f} GiB of host memory available now"
        f"{less}; using {fit:g} GiB (--host-pool GB to choose)"
    )
    return dataclasses.replace(config, host_pool_gb=fit), note


def fitted_pool_gb(limit: int) -> float:
    """The host pool a cap cut to ``limit`` bytes becomes: whole 0.25 GiB, at least 0.25."""
    return max(0.25, int(limit / 2**30 * 4) / 4)


def _pool_on_host(config: EngineConfig) -> bool:
    devices = list(config.devices) or [config.device]
    return any(d.split(":")[0] == "cpu" for d in devices) or (
        config.attention == "sparse" and config.hierarchical
    )


def _declared_host_memory(config: EngineConfig) -> float | None:
    """``host_memory_gb``, else ``$HISPARSE_HOST_MEMORY_GB`` (a fixed figure the load does
    not lower), else ``None`` (``MemAvailable`` is read)."""
    from engine.config import env_overrides

    return config.host_memory_gb or env_overrides().get("host_memory_gb")


def model_load_host_bytes(config: EngineConfig, model: str | None) -> int:
    """What loading ``model`` will add to the host memory in use, which ``MemAvailable``
    read before the load does not show yet: :data:`engine.kv.sizing.LOAD_MARGIN_BYTES`,
    plus the weights of each CPU device (one copy a data-parallel worker, the whole model
    once for a pipeline), as the planner counts them
    (:func:`engine.capacity.planner.weight_bytes`, the shape read from the model's header;
    none counted where it cannot be read)."""
    from engine.kv.sizing import LOAD_MARGIN_BYTES

    cpus = [d for d in (list(config.devices) or [config.device]) if d.split(":")[0] == "cpu"]
    shape = preflight.model_shape(model) if cpus else None
    if shape is None:
        return LOAD_MARGIN_BYTES
    from engine.capacity.planner import weight_bytes

    copies = 1 if config.parallel == "pipeline" else len(cpus)
    return LOAD_MARGIN_BYTES + copies * weight_bytes(shape, config.replace(device="cpu"))


def check_host_pool(config: EngineConfig, model: str | None = None) -> int | None:
    """Raise ``CacheFullError`` when the host KV pool (``host_pool_gb``, shared by all
    workers) cannot fit in the host memory available now, less what loading ``model``
    will take (:func:`model_load_host_bytes`; the cache checks again after the load,
    setting nothing aside); the pool lives on the host on CPU devices and with the
    hierarchical sparse cache. Returns the available bytes read (``None`` where the pool
    is not on the host or they cannot be read)."""
    if not _pool_on_host(config):
        return None
    from engine.kv.sizing import check_host_memory

    load = 0 if _declared_host_memory(config) else model_load_host_bytes(config, model)
    return check_host_memory(int(config.host_pool_gb * 2**30), config.host_memory_gb, load)


def is_config_error(exc: BaseException) -> bool:
    """Whether a model-load failure is a bad setting, model path or config (exit 2)
    rather than a runtime failure (exit 1): ``ConfigError``, ``CacheFullError``
    (pool larger than memory), ``FileNotFoundError`` and ``ValueError`` (not a GGUF
    file, bad environment value)."""
    if isinstance(exc, ConfigError | FileNotFoundError | ValueError):
        return True
    return isinstance(exc, CacheFullError)


GPU_DRIVER_NODES = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")
"""Paths of which a Linux machine with a CUDA (NVIDIA), ROCm (``/dev/kfd``) or WSL
(``/dev/dxg``) GPU shows at least one; torch's ``cuda`` is one of those."""


def cuda_device_count() -> int:
    """CUDA devices this process can use (0 without CUDA); tests replace this hook.

    Where no GPU driver can be present (Linux without any of :data:`GPU_DRIVER_NODES`,
    or macOS) the answer is 0 without probing; elsewhere :func:`cuda_devices` reads
    them through NVML (no torch import, no CUDA context), ``nvidia-smi`` or torch.
    """
    if no_gpu_driver():
        return 0
    return len(cuda_devices().devices)


def no_gpu_driver() -> bool:
    """Whether this machine certainly has no device torch's ``cuda`` could use."""
    if sys.platform == "darwin":
        return True
    return sys.platform.startswith("linux") and not any(map(os.path.exists, GPU_DRIVER_NODES))


@functools.cache
def cuda_devices() -> CudaDevices:
    """This process's CUDA devices (:func:`engine.cuda_devices.probe_cuda_devices`),
    probed once per process."""
    return probe_cuda_devices()


def cuda_devices_read_by() -> str:
    """How :func:`cuda_devices` read the devices (``read through NVML in 0.03 s``), or
    ``""`` when it has not run in this process (no driver, or the hooks replaced)."""
    return cuda_devices().describe() if cuda_devices.cache_info().currsize else ""


def cuda_device_memory_gib(index: int) -> float:
    """Total memory of CUDA device ``index`` in GiB, as CUDA reports it; tests replace
    this hook."""
    return cuda_devices().devices[index].memory_gib


def auto_preset(device_flags: Sequence[str] = ()) -> AutoChoice:
    """What ``--preset auto`` means on this machine (:func:`choose_preset` over the probes
    :func:`cuda_device_count` and :func:`cuda_device_memory_gib`); ``device_flags``: the
    ``--device`` / ``--devices`` values given. ``read_by`` says how the devices were read."""
    memories = [cuda_device_memory_gib(i) for i in range(cuda_device_count())]
    choice = choose_preset(memories, device_flags)
    return dataclasses.replace(choice, read_by=cuda_devices_read_by())


def with_auto_preset(request: RunRequest) -> tuple[RunRequest, AutoChoice | None]:
    """``request`` with ``--preset auto`` replaced by the preset it stands for here."""
    if request.preset != AUTO:
        return request, None
    flags = request.engine_overrides
    named = list(flags.get("devices") or ()) or ([flags["device"]] if flags.get("device") else [])
    choice = auto_preset([str(d) for d in named])
    return dataclasses.replace(request, preset=choice.name), choice


def execute(
    request: RunRequest, console: Console | None = None, err_console: Console | None = None
) -> int:
    """Run ``request`` and return the exit code.

    A closed stdout or stderr (``hisparse run docs/*.txt | head -1``: the reader exited)
    ends what is written there, not the run: both consoles' files are
    :func:`hisparse_cli.pipes.guard`-ed, so the batch carries on to the end, writes its
    results and output files, and stderr (if still open) says once that stdout was closed.
    The exit code stays the batch's (0 when every job is ok, 1 when one failed, ...): the
    results are what the run is for, and they are complete; a pipeline under ``set -o
    pipefail`` that only cut the progress short (``| head``) does not fail for it.

    Parameters
    ----------
    request
        The parsed command line.
    console
        Where progress and the summary go (default: stdout).
    err_console
        Where usage and validation errors go (default: stderr).
    """
    marks = {"cli_ready": time.monotonic()}  # the start-up steps (ev.StartupTimes)
    console = console or Console()
    err_console = err_console or Console(stderr=True)
    results = request.output_dir / RESULTS_FILE
    closed = STDOUT_CLOSED if request.print_config else f"{STDOUT_CLOSED}; results: {results}"
    guard_consoles(console, err_console, closed)
    try:
        request = with_stdin(request)
        request, choice = with_auto_preset(request)
        manifest, config = prepare(request)
        marks["config_resolved"] = time.monotonic()
    except ManifestError as exc:
        return _usage_failure(
            err_console,
            f"{len(exc.problems)} problem(s) in the jobs; nothing was run:",
            exc.problems,
        )
    except SettingsError as exc:
        return _usage_failure(
            err_console,
            f"{len(exc.problems)} problem(s) in the engine settings; nothing was run:",
            exc.problems,
        )
    except RunRefused as exc:  # one line each, as --print-config lists them
        for problem in exc.problems:
            _print_line(err_console, f"error: {problem}", "bold red")
        return EXIT_USAGE
    except (UsageError, ConfigError) as exc:
        return _usage_failure(err_console, f"error: {exc}", [])
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    for warning in manifest.warnings:
        _print_line(err_console, f"warning: {warning}", "yellow")
    document = config_document(config, request.preset, resolved_model(request.model))
    if choice is not None:
        document["preset_auto"] = choice.reason
        if choice.read_by:
            document["preset_auto_devices"] = choice.read_by
    if request.print_config:
        used, threads_note = with_free_threads(config)  # the count the run would use, and why
        if threads_note:  # as config.json records it
            document["engine"]["num_threads"] = used.num_threads
            document.setdefault("effective", {})["num_threads"] = threads_note
        problems = run_problems(config, request, manifest)
        warnings = config_warnings(config)
        printed = {**document, "jobs": [job_settings(spec) for spec in manifest.jobs]}
        if problems:
            printed["problems"] = problems
        if warnings:
            printed["warnings"] = warnings
        if manifest.rejected:  # bad batch lines, globs that matched nothing: a run skips them
            printed["rejected"] = [str(r) for r in manifest.rejected]
        console.file.write(json.dumps(printed, indent=2, sort_keys=True, default=str) + "\n")
        if threads_note:  # as the run says it
            _print_line(err_console, f"note: {threads_note}")
        for line in [f"a run would be refused here: {p}" for p in problems] + warnings:
            _print_line(err_console, f"warning: {line}", "yellow")
        for rejected in manifest.rejected:  # as the run reports them; the others would run
            _print_line(err_console, f"error: {rejected}", "red")
        return EXIT_OK
    batch = BatchRun(request, manifest, config, console, err_console)
    batch.preset_line = preset_line(request.preset, choice)
    batch.startup_marks = marks
    return batch.run(document)


def resolved_model(model: str | None) -> str | None:
    """``model`` as ``config.json`` records it: the embedded model's file path when none
    was given (``None`` where it is not installed; loading then says how to install it)."""
    if model is not None:
        return model
    from engine.weights.embedded import default_model_path

    try:
        return str(default_model_path())
    except FileNotFoundError:
        return None


def warm_cuda(config: EngineConfig, marks: dict[str, float]) -> None:
    """Start the CUDA driver and the context of the run's device in the background
    (:func:`engine.cuda_devices.start_cuda_context`) when the run uses exactly one CUDA
    device in this process; tests replace this hook. ``marks`` gets ``cuda_ready``."""
    devices = list(config.devices) or [config.device]
    if len(devices) == 1 and devices[0].split(":")[0] == "cuda":
        from engine.cuda_devices import start_cuda_context

        start_cuda_context(_cuda_index(devices[0]), marks)


def with_stdin(request: RunRequest, stream: Any = None) -> RunRequest:
    """``request`` with the bytes of standard input when ``-`` is among its documents and
    they were not given: all of ``stream`` (default ``sys.stdin``), read once, before
    anything else, so every step sees the same text.

    Raises
    ------
    UsageError
        Standard input is a terminal (nothing was piped in) or cannot be read.
    """
    if "-" not in request.docs or request.stdin is not None:
        return request
    stream = sys.stdin if stream is None else stream
    if stream is None or stream.isatty():
        raise UsageError(
            "'-' reads the document from standard input, but standard input is a terminal: "
            "pipe the text in (cat doc.txt | hisparse run -) or name the file"
        )
    try:
        # one byte past the cap, so an endless stream (/dev/zero) fails its job, not the
        # memory (textio.MAX_DOCUMENT_BYTES)
        limit = textio.MAX_DOCUMENT_BYTES + 1
        data = stream.buffer.read(limit) if hasattr(stream, "buffer") else stream.read(limit)
    except OSError as exc:
        raise UsageError(f"cannot read standard input: {exc.strerror or exc}") from None
    return dataclasses.replace(request, stdin=data if isinstance(data, bytes) else data.encode())


def preset_line(preset: str, choice: AutoChoice | None) -> str:
    """How the progress output and the summary name the preset: ``cpu`` or
    ``cpu (auto: no CUDA device)``, with how the devices were read where they were."""
    if choice is None:
        return preset
    read_by = f"; devices {choice.read_by}" if choice.read_by else ""
    return f"{preset} (auto: {choice.reason}{read_by})"


def prepare(request: RunRequest) -> tuple[Manifest, EngineConfig]:
    """Check the request, then build and validate the jobs and the engine config.

    Raises
    ------
    UsageError, ManifestError, ConfigError
        Everything that makes the run impossible, before anything is written.
    """
    check_request(request)
    earlier = earlier_jobs(request.output_dir) if request.output_dir.is_dir() else []
    sampling = preset_sampling(request.preset)
    if request.manifest is not None:
        try:
            manifest = load_manifest(
                request.manifest, request.job_overrides, earlier, sampling, request.output_dir
            )
        except ManifestError as exc:  # add the combined engine settings' problems, if any
            try:
                resolve_engine_config(
                    request.preset, exc.engine, request.engine_overrides, exc.engine_origin
                )
            except SettingsError as settings_exc:
                exc.add(settings_exc.problems)
            except ConfigError:
                pass  # an unknown setting: already among the manifest's problems
            raise
    elif request.docs:
        stdin_sha256 = None if request.stdin is None else hashlib.sha256(request.stdin).hexdigest()
        manifest = jobs_from_paths(
            request.docs,
            request.job_overrides,
            earlier_jobs=earlier,
            stdin_sha256=stdin_sha256,
            sampling_base=sampling,
            output_dir=request.output_dir,
            earlier_outputs=earlier_outputs(request.output_dir),
        )
    else:
        manifest = Manifest((), {})
    config = resolve_engine_config(
        request.preset, manifest.engine, request.engine_overrides, manifest.engine_origin
    )
    check_policy_flags(config, request.preset, manifest.engine, request.engine_overrides)
    config = with_preset_devices(config, request.preset, request.engine_overrides)
    config, note = fit_preset_host_pool(
        config, manifest.engine, request.engine_overrides, request.model
    )
    notes = [n for n in (note, preflight.max_context_warning(config, request.model)) if n]
    if notes:
        manifest = dataclasses.replace(manifest, warnings=(*manifest.warnings, *notes))
    if not request.print_config:  # it lists what they find instead (run_problems)
        problems = collect_problems(run_checks(config, request, manifest))
        if problems:  # refused: every problem --print-config lists, in its order
            raise RunRefused(problems + load_problems(config, request, manifest)[0])
    return manifest, config


def run_checks(
    config: EngineConfig, request: RunRequest, manifest: Manifest
) -> list[Callable[[], None]]:
    """The checks that refuse a run (exit 2, nothing written) once its jobs and config are
    resolved, in the order it makes them: each raises :class:`UsageError` (or a
    :class:`ConfigError`). :func:`prepare` makes them all for a run and refuses it with
    every problem found (:class:`RunRefused`); ``--print-config`` lists what every one of
    them finds (:func:`run_problems`), so the two cannot drift apart."""
    flags, engine, output_dir = request.engine_overrides, manifest.engine, request.output_dir
    checks: list[Callable[[], None]] = [
        lambda: check_output_dir(output_dir),
        lambda: check_device_names(config),
        lambda: check_devices(config, request.preset, engine, flags),
        lambda: check_trace_path(config),
        lambda: check_trace_outputs(config, manifest, output_dir),
        lambda: check_run_files(manifest, output_dir),
        lambda: check_foreign_run_files(output_dir),
    ]
    if request.docs:
        checks.append(lambda: check_outputs_over_documents(manifest, output_dir))
    checks += [
        lambda: check_model_header(request.model),
        lambda: check_max_context(config, request, manifest),
        lambda: check_max_new_tokens(
            config, request, manifest, preload_tokenizer(config, request.model)
        ),
    ]
    return checks


def check_model_header(model: str | None) -> None:
    """Refuse a GGUF ``--model`` whose metadata cannot be read, every key and value walked
    as the load reads them (:func:`engine.weights.header.read_gguf_fields`, no weights, no
    torch), or whose tensor records describe data the file cannot hold (a cut-off
    download: :func:`engine.weights.gguf.open_reader`, the load's own check, no tensor
    data read, no torch), so ``--print-config`` lists it and a run stops before the load.
    Other files, folders and missing paths are left to the checks and the load that name
    them.

    Raises
    ------
    UsageError : ``cannot load the model: <file>: ...`` naming where the header breaks,
        or the tensor whose data the file lacks
    """
    if model is None or not Path(model).is_file():
        return
    from engine.weights.gguf import GGUFError, open_reader
    from engine.weights.header import GGUFHeaderError, GGUFTruncatedError, read_gguf_fields

    try:
        with open(model, "rb") as f:
            if f.read(4) != b"GGUF":
                return
        read_gguf_fields(model, frozenset({"hisparse.no-such-key"}))  # walks every field
    except OSError:
        return
    except GGUFHeaderError as exc:
        detail, shown = str(exc).removeprefix(f"{model}: "), escaped(model)
        if isinstance(exc, GGUFTruncatedError):  # as the load and `hisparse plan` say it
            raise UsageError(f"cannot load the model: {shown}: {escaped(detail)}") from None
        raise UsageError(
            f"cannot load the model: {shown}: not a readable GGUF file ({detail})"
        ) from None
    try:
        open_reader(Path(model))  # the tensor records, as the load checks them
    except OSError:
        return
    except GGUFError as exc:  # as the load and `hisparse plan` say it
        detail = str(exc).removeprefix(f"{Path(model)}: ")
        raise UsageError(f"cannot load the model: {escaped(model)}: {escaped(detail)}") from None


def preload_tokenizer(config: EngineConfig, model: str | None) -> Callable[[], Any]:
    """The model's tokenizer for the checks that count prompts before the load, built
    on the first call (:func:`load_tokenizer`: from the model's header, no weights; the
    load reuses it); ``None`` where it cannot be built (the load then says why)."""

    @functools.cache
    def tokenizer() -> Any:
        try:
            return load_tokenizer(config, model)
        except Exception:  # noqa: BLE001 - the load reports the real reason
            return None

    return tokenizer


def job_tokens(
    spec: Any, request: RunRequest, tokenizer: Any, limit: int, counted: dict[str, int]
) -> int | None:
    """The most tokens job ``spec`` holds at once: its prompt + ``max_new_tokens``, within
    ``limit`` (the context limit; a document whose size alone shows it over the limit is
    cut or chunked to it, uncounted), its prompt tokenised with ``tokenizer`` before the
    load and kept in ``counted`` (job id -> prompt tokens). ``None`` where the prompt
    cannot be built here: the job fails when the engine builds it."""
    max_tokens = spec.sampling.max_tokens
    if spec.id not in counted:
        try:
            document = job_document(spec, request)[1]
            floor = tokenizer.min_tokens(document)
            if floor is not None and floor + max_tokens >= limit:  # cut or chunked
                return limit
            counted[spec.id] = len(tokenizer.encode_chat(job_messages(spec)(document)))
        except Exception:  # noqa: BLE001 - the job fails as usual, after the load
            return None
    return min(counted[spec.id] + max_tokens, limit)


def size_floor(spec: Any, request: RunRequest, tokenizer: Any, limit: int) -> int | None:
    """A lower bound on the tokens of job ``spec``'s prompt that already shows it over
    ``limit`` beside its ``max_new_tokens``, found from the first bytes of its documents
    (:func:`textio.document_prefix`) without reading the rest or tokenising: the
    tokenizer's ``min_tokens`` of the prompt around their text (stripped, and joined by
    one newline where the job has several: never more bytes than the prompt the engine
    builds). The bytes read start at twice what ``limit`` tokens can hold and grow
    fourfold while that is not enough. ``None`` when the bound does not show it (the
    documents were read whole first: they are few enough bytes to count exactly), where
    the tokenizer knows no bound, for an OpenAI-batch request, or when a document cannot
    be read (the job fails on reading it, naming the file)."""
    longest = getattr(tokenizer, "max_token_bytes", None)
    if spec.messages is not None or not longest:
        return None
    messages = job_messages(spec)
    size = 2 * longest * limit
    while True:
        parts, whole = [], True
        for path in spec.inputs:
            try:
                text, complete = textio.document_prefix(
                    path, size, **request.text_options,
                    allow_binary=request.allow_binary, stdin=request.stdin,
                )  # fmt: skip
            except textio.DocumentError:
                return None
            parts.append(text.strip())
            whole = whole and complete
        if whole:
            return None
        probe = "\n".join(part for part in parts if part)
        floor = tokenizer.min_tokens(tokenizer.render_chat(messages(probe)))
        if floor is None:
            return None
        if floor + spec.sampling.max_tokens > limit:
            return floor
        size *= 4


def check_memory_budget(
    config: EngineConfig,
    request: RunRequest,
    manifest: Manifest,
    specs: Sequence[Any] | None = None,
    counted: dict[str, int] | None = None,
) -> None:
    """Refuse, before the load, a ``memory_budget_gb`` the load would refuse: one that
    leaves no room beside the weights (and the page metadata of the host pool) for the
    hot buffer of one job (hierarchical) or a KV page, or, where all-resident attention
    (``attention: dense``, or ``hierarchical: false``) keeps the KV pool on the compute
    device, sized by the budget (``host_pool_gb`` does not size it), that cannot hold the
    pool of ``specs`` (default: every job). The budget is split as the load splits it:
    for the longest job (:func:`job_tokens`, prompts counted with the model's tokenizer,
    ``counted`` reused; :func:`engine.load.sized_tokens`; the context limit where the
    tokenizer cannot be read, as the load then sizes it), by
    :func:`engine.capacity.budget.size_kv_for_budget`, with the weights as the planner
    counts the load's placement from the model's header. A job too long for the context
    under ``refuse`` or ``extend`` is left out of the all-resident pool: it fails on its
    own, saying so. The run checks this just before the load, over the jobs it will run;
    ``--print-config`` over all (:func:`run_problems`). The load checks again.

    Raises
    ------
    ConfigError
        The budget leaves no room for a KV page or one job's hot buffer (the load's own
        refusal, in its words).
    UsageError
        The pool holds fewer pages than a job needs; the message names the budget that
        fits the longest. Unchecked with several devices, or where the model's shape or
        tokenizer cannot be read before the load (the engine then fails such a job,
        naming the budget).
    """
    from engine.kv.sizing import hierarchical, pages_for

    if config.memory_budget_gb is None or len(config.devices) > 1:
        return
    config = config.replace(device=config.devices[0]) if config.devices else config
    counted = {} if counted is None else counted
    found = job_needs(config, request, manifest.jobs if specs is None else specs, counted)
    if found is None:
        return
    from engine.capacity.budget import budget_for_pages, size_kv_for_budget
    from engine.capacity.planner import weight_bytes
    from engine.load import sized_tokens

    shape, limit, needs = found
    weights = weight_bytes(shape, config)
    if hierarchical(config):  # the load's split, for the longest job (BatchRun._longest_job)
        longest = max((n for n, _ in needs), default=None)
        size_kv_for_budget(shape, config, weights, sized_tokens(limit, longest))
        return
    if not needs:
        return
    sized = sized_tokens(limit, max(n for n, _ in needs))  # as the load sizes the cache
    pages = size_kv_for_budget(shape, config, weights, sized).num_pool_pages
    short = [(n, s) for n, s in needs if pages_for(n, config.page_size) > pages]
    if not short:
        return
    need, spec = max(short, key=lambda pair: pair[0])
    source = preflight.setting_source(
        "memory_budget_gb", request.preset, manifest.engine, request.engine_overrides
    )
    mode = "attention dense" if config.attention == "dense" else "hierarchical: false"
    more = f" (and {len(short) - 1} more)" if len(short) > 1 else ""
    need_pages = pages_for(need, config.page_size)
    fits = budget_for_pages(shape, config, weights, sized, need_pages)
    prompt = f"a {counted[spec.id]}-token prompt" if spec.id in counted else "its prompt"
    raise UsageError(
        f"{source} {config.memory_budget_gb:g} leaves room for {pages} KV pages "
        f"({pages * config.page_size} tokens) on {config.device}: {mode} keeps the KV pool "
        f"on the compute device, sized by the budget (not host_pool_gb); job {spec.id!r}"
        f"{more} needs {need_pages} ({prompt} + max_new_tokens {spec.sampling.max_tokens}, "
        f"counted with the model's tokenizer before loading it): --memory-budget {fits:g} "
        "fits it"
    )


def job_needs(
    config: EngineConfig, request: RunRequest, specs: Sequence[Any], counted: dict[str, int]
) -> tuple[Any, int, list[tuple[int, Any]]] | None:
    """What the checks that size the KV pool before the load count: ``(the model's shape
    from its header, the context limit, [(tokens, job)])``, the tokens of each job of
    ``specs`` that holds them in the pool (:func:`job_tokens`, its prompt counted with the
    model's tokenizer, kept in ``counted``; none where the tokenizer cannot be read). A
    job whose prompt cannot be built here, or too long for the context under ``refuse``
    or ``extend``, is left out: it fails on its own, naming why. ``None`` where the shape
    or the trained context cannot be read before the load."""
    trained = preflight.trained_context(request.model)
    shape = preflight.model_shape(request.model) if specs and trained is not None else None
    tokenizer = preload_tokenizer(config, request.model)() if shape is not None else None
    if shape is None or trained is None:
        return None
    limit = preflight.context_limit(config, trained)
    needs = []  # (tokens, job)
    for spec in specs if tokenizer is not None else ():
        need = job_tokens(spec, request, tokenizer, limit, counted)
        fits_context = spec.id in counted and counted[spec.id] + spec.sampling.max_tokens <= limit
        if need is None or (config.context_policy in ("refuse", "extend") and not fits_context):
            continue  # it fails on its own, naming why
        needs.append((need, spec))
    return shape, limit, needs


def check_pool_pages(
    config: EngineConfig,
    request: RunRequest,
    manifest: Manifest,
    specs: Sequence[Any] | None = None,
    counted: dict[str, int] | None = None,
) -> None:
    """Refuse, before the load, a ``host_pool_gb`` whose KV pool holds fewer pages than
    the longest job of ``specs`` (default: every job) needs, which the engine would fail
    after the load: the pool's pages are ``host_pool_gb`` over the bytes of a page of the
    model's shape (read from its header) in ``page_size`` and the KV dtypes
    (:func:`engine.kv.sizing.default_pool_pages`, as the cache counts them), the jobs'
    tokens counted as :func:`check_memory_budget` counts them (:func:`job_needs`). Not
    checked with several devices (the workers split the pool), where a memory budget
    sizes an all-resident pool (:func:`check_memory_budget` checks that one), or where
    the shape or tokenizer cannot be read before the load: the engine's own check of
    each job stays the backstop.

    Raises
    ------
    UsageError
        Naming the pool's pages, the job (and how many more) and the ``--host-pool`` that
        fits it (rounded up to few digits).
    """
    from engine.kv.sizing import all_resident, default_pool_pages, pages_for

    if len(config.devices) > 1 or (config.memory_budget_gb is not None and all_resident(config)):
        return
    trained = preflight.trained_context(request.model)
    shape = preflight.model_shape(request.model) if trained is not None else None
    if shape is None:
        return
    pages = default_pool_pages(shape, config)
    if pages_for(preflight.context_limit(config, trained), config.page_size) <= pages:
        return  # it holds a job of the whole context: no prompt to count (no tokenizer)
    counted = {} if counted is None else counted
    found = job_needs(config, request, manifest.jobs if specs is None else specs, counted)
    if found is None:
        return
    needs = found[2]
    short = [(n, s) for n, s in needs if pages_for(n, config.page_size) > pages]
    if not short:
        return
    from engine.capacity.budget import pool_gb_holding

    need, spec = max(short, key=lambda pair: pair[0])
    need_pages = pages_for(need, config.page_size)
    source = preflight.setting_source(
        "host_pool_gb", request.preset, manifest.engine, request.engine_overrides
    )
    more = f" (and {len(short) - 1} more)" if len(short) > 1 else ""
    prompt = f"a {counted[spec.id]}-token prompt" if spec.id in counted else "its prompt"
    fits = pool_gb_holding(shape, config, need_pages, 2 * need_pages, False)
    hint = f": --host-pool {fits[0]:g} fits it" if fits is not None else ""
    raise UsageError(
        f"{source} {config.host_pool_gb:g} holds {pages} KV pool pages "
        f"({pages * config.page_size} tokens); job {spec.id!r}{more} needs {need_pages} "
        f"({prompt} + max_new_tokens {spec.sampling.max_tokens}, counted with the model's "
        f"tokenizer before loading it){hint}"
    )


def check_run_files(manifest: Manifest, output_dir: Path) -> None:
    """Raise :class:`UsageError` when an input of the run is one of the files every run
    writes in ``output_dir`` (``config.json``, ``results.jsonl``, the lock file): the run
    could not record anything without changing an input."""
    own = {(output_dir / name).resolve(): name for name in (CONFIG_FILE, RESULTS_FILE, LOCK_FILE)}
    for job in manifest.jobs:
        for path in job.inputs:
            name = own.get(input_identity(path))
            if name is not None:
                origin, folder = escaped(job.origin), escaped(str(output_dir))
                raise UsageError(
                    f"job {job.id!r} ({origin}) reads {shown_path(path)}, which is the run's "
                    f"own {name} in --output-dir {folder}; a run writes that file, so copy the "
                    "input elsewhere or choose another --output-dir"
                )


def check_foreign_run_files(output_dir: Path) -> None:
    """Raise :class:`UsageError` when ``output_dir`` holds a ``config.json`` or a
    ``results.jsonl`` that hisparse did not write (:func:`is_hisparse_config`,
    :func:`is_hisparse_results`): a run would replace the one and append to the other,
    so it is refused before anything is written (``-o .`` in a project folder). A file
    that cannot be read is left to the run, which names it."""
    foreign = {
        CONFIG_FILE: (is_hisparse_config, "not a JSON object with hisparse's keys", "replace"),
        RESULTS_FILE: (
            is_hisparse_results,
            "no line is a JSON object with hisparse's result keys",
            "append its results to",
        ),
    }
    for name, (ours, why, would) in foreign.items():
        path = output_dir / name
        try:
            data = path.read_bytes() if path.is_file() else b""
        except OSError:
            continue
        if not ours(data):
            raise UsageError(
                f"{escaped(str(path))}: hisparse did not write it ({why}); a run would "
                f"{would} it: move it away or choose another --output-dir"
            )


def check_trace_outputs(config: EngineConfig, manifest: Manifest, output_dir: Path) -> None:
    """Raise :class:`UsageError` when the ``--trace`` file would be one the run writes in
    ``output_dir`` (``config.json``, ``results.jsonl``, the lock file, a job's result file)
    or one of its inputs, even before it exists: the trace would replace it."""
    if not config.trace_path:
        return
    trace = Path(config.trace_path).resolve()
    own = {
        (output_dir / name).resolve(): f"the run's {name}"
        for name in (CONFIG_FILE, RESULTS_FILE, LOCK_FILE)
    }
    for job in manifest.jobs:
        own[(output_dir / job.output).resolve()] = f"job {job.id!r}'s result file"
        own |= {input_identity(p): f"an input of job {job.id!r}" for p in job.inputs}
    if trace in own:
        raise UsageError(
            f"--trace {escaped(config.trace_path)} would replace {own[trace]}; a trace never "
            "replaces a file the run reads or writes: choose another name"
        )


def check_outputs_over_documents(manifest: Manifest, output_dir: Path) -> None:
    """Raise :class:`UsageError` when every result file of the documents given on the
    command line (``<id>.txt`` in ``output_dir``) would be one of the documents, as when
    ``--output-dir`` is the documents' folder: no job could run, so nothing is written.
    When only some collide, those jobs fail and the others run (:func:`output_collisions`)."""
    inputs = {input_identity(p): p for job in manifest.jobs for p in job.inputs}
    hits = [
        (job, inputs[(output_dir / job.output).resolve()])
        for job in manifest.jobs
        if (output_dir / job.output).resolve() in inputs
    ]
    if hits and len(hits) == len(manifest.jobs):
        job, path = hits[0]
        more = f" (and {len(hits) - 1} more: every job)" if len(hits) > 1 else ""
        folder, result = escaped(str(output_dir)), escaped(str(output_dir / job.output))
        raise UsageError(
            f"--output-dir {folder} would overwrite the documents: the result of job "
            f"{job.id!r}, {result}, is the document {shown_path(path)}{more}; nothing was "
            "written: choose another --output-dir (the default is hisparse-out)"
        )


def output_collisions(
    jobs: list[PlannedJob],
    output_dir: Path,
    known_outputs: Iterable[str] = (),
    truncated_tail: bytes = b"",
) -> dict[str, str]:
    """Jobs whose output file is an input of the run, or a file hisparse did not write:
    job id -> the error to fail it with, naming the output and the job (and path) that
    reads it. Paths are compared resolved, so a link or another spelling of the same file
    counts. ``known_outputs``: the ``output`` of every successful line in the folder's
    results.jsonl (the files earlier runs wrote, which a job may replace; a failure line
    wrote none); any other existing file at a
    job's output is the user's and is never overwritten — except the job whose line was
    cut short (``truncated_tail``, the results file's torn last line: its text file was
    written just before). A job skipped as done writes nothing and is never one: its
    output, its own earlier result, may be another job's input."""
    readers: dict[Path, tuple[str, Path]] = {}
    for job in jobs:
        for path in job.spec.inputs:
            readers.setdefault(input_identity(path), (job.spec.id, path))
    found = {}
    for job in jobs:
        if job.status == SKIP:  # done: it writes nothing, its file is its own earlier result
            continue
        target = output_dir / job.spec.output
        reader = readers.get(target.resolve())
        if reader is not None:
            owner, path = reader
            whose = "its own input" if owner == job.spec.id else f"an input of job {owner!r}"
            found[job.spec.id] = (
                f"output {escaped(str(target))} is {whose} ({shown_path(path)}); refusing to "
                "write over an input of the run: choose another --output-dir, or set the "
                "job's output (or id)"
            )
    ours = {(output_dir / name).resolve() for name in known_outputs}
    for job in jobs:
        target = output_dir / job.spec.output
        if job.spec.id in found or job.status == SKIP or not target.exists():
            continue
        cut_short = f'"id": {json.dumps(job.spec.id, ensure_ascii=False)}'.encode()
        if truncated_tail.startswith(b"{" + cut_short):  # killed while writing its line
            continue
        if target.resolve() not in ours:
            results = output_dir / RESULTS_FILE
            unrecorded = (
                f"no line of {escaped(str(results))} records it as hisparse's (a file of "
                "your own, or a result whose line was removed)"
                if results.exists()
                else f"no {escaped(str(results))} records it as hisparse's (there is none: "
                "never written here, or deleted)"
            )
            found[job.spec.id] = (
                f"output {escaped(str(target))} already exists and {unrecorded}; refusing "
                "to overwrite a file hisparse cannot show it wrote (--force does not change "
                "that): delete or move it, choose another --output-dir, or set the job's "
                "output (or id)"
            )
    return found


def check_max_context(config: EngineConfig, request: RunRequest, manifest: Manifest) -> None:
    """Raise :class:`UsageError` when ``max_context`` is above the model's trained context
    without ``--context-policy extend`` (read from the model's header, before loading)."""
    problem = preflight.max_context_problem(
        config, request.model, request.preset, manifest.engine, request.engine_overrides
    )
    if problem:
        raise UsageError(problem)


def check_max_new_tokens(
    config: EngineConfig,
    request: RunRequest,
    manifest: Manifest,
    tokenizer: Callable[[], Any] = lambda: None,
) -> None:
    """Raise :class:`UsageError` when a job's ``max_new_tokens`` cannot fit the context
    limit even with an empty document (:func:`preflight.max_new_tokens_problem`; the
    trained context read from the model's header, before loading), or under ``truncate``
    leaves no room for any of its document (:func:`truncate_room_problem`, counted with
    ``tokenizer``, :func:`preload_tokenizer`'s)."""
    trained = preflight.trained_context(request.model)
    if trained is None or not manifest.jobs:
        return
    limit = preflight.context_limit(config, trained)
    flag = request.job_overrides.get("max_new_tokens") is not None
    source = max_context_source(config, request, manifest, limit)
    problem = preflight.max_new_tokens_problem(
        manifest.jobs, limit, config.context_policy, flag, source
    )
    if problem is None and config.context_policy == "truncate":
        problem = truncate_room_problem(config, request, manifest, limit, tokenizer)
    if problem:
        raise UsageError(problem)


def max_context_source(
    config: EngineConfig, request: RunRequest, manifest: Manifest, limit: int
) -> str | None:
    """Where ``max_context`` was set (``--max-context``, the manifest's or the preset's:
    :func:`preflight.setting_source`) when the context limit ``limit`` is that setting,
    else ``None`` (the model's trained context)."""
    if not config.max_context or limit != config.max_context:
        return None
    flags = request.engine_overrides
    return preflight.setting_source("max_context", request.preset, manifest.engine, flags)


def truncate_room_problem(
    config: EngineConfig,
    request: RunRequest,
    manifest: Manifest,
    limit: int,
    tokenizer: Callable[[], Any],
) -> str | None:
    """Under ``truncate``, why a job's ``max_new_tokens`` leaves no room for any of its
    document beside the prompt, or ``None``: the engine's own cut
    (:func:`engine.text.context.fit_prompt`, whose
    :class:`~engine.text.prompting.NoRoomForDocument` fails the job after the load), run
    before the load with the model's tokenizer. Only jobs whose ``max_new_tokens`` comes
    within :func:`preflight.cut_prompt_bound` of ``limit`` are counted (the others leave
    room); none where the tokenizer cannot be built (the engine then decides)."""
    for spec in manifest.jobs:
        max_tokens = spec.sampling.max_tokens
        if max_tokens + preflight.cut_prompt_bound(spec) <= limit or tokenizer() is None:
            continue
        try:
            _, text = job_document(spec, request)
        except Exception:  # noqa: BLE001 - the job fails on reading it, naming the file
            continue
        try:
            fit_prompt(tokenizer(), job_messages(spec), text, limit, max_tokens, config)
        except PromptTooLong as exc:
            flag = request.job_overrides.get("max_new_tokens") is not None
            source = (
                f"--max-new-tokens {max_tokens:,}"
                if flag
                else f"max_new_tokens {max_tokens:,} of job {spec.id!r} ({escaped(spec.origin)})"
            )
            return (
                f"{source} leaves no room for the document of job {spec.id!r} under "
                f"--context-policy truncate (counted with the model's tokenizer before "
                f"loading it): {exc}"
            )
    return None


def config_warnings(config: EngineConfig) -> list[str]:
    """Settings that run but cost the user something they may not expect, in words: the
    run notes them as warnings when it starts, ``--print-config`` under ``warnings``."""
    found = []
    if config.page_metadata == "superpage" and config.device == "cpu":
        found.append(  # a fresh user found it slower and nothing said why
            "page_metadata superpage on the CPU decodes slower than exact (its selection "
            "does not run in the CPU's one-chain decode); it saves GPU metadata reads at "
            "long contexts"
        )
    return found


def run_problems(config: EngineConfig, request: RunRequest, manifest: Manifest) -> list[str]:
    """What would stop this run here, each in the words the run refuses it with:
    ``--print-config`` reports them (``problems``) since it skips the checks that refuse a
    run (:func:`run_checks`, then :func:`load_problems`: the host pool and the memory
    budget the run checks just before the load)."""
    checks = collect_problems(run_checks(config, request, manifest))
    return checks + load_problems(config, request, manifest)[0]


def load_problems(
    config: EngineConfig,
    request: RunRequest,
    manifest: Manifest,
    specs: Sequence[Any] | None = None,
    counted: dict[str, int] | None = None,
) -> tuple[list[str], int | None]:
    """What the run refuses just before the load, over ``specs`` (default: every job;
    ``counted`` as :func:`job_tokens` keeps it): the host pool against the memory
    available (:func:`check_host_pool`), the memory budget (:func:`check_memory_budget`)
    and the host pool against the longest job (:func:`check_pool_pages`). Where the host
    pool is refused, the other two are judged with the pool that fits (the cap cut as
    :func:`fit_preset_host_pool` cuts a preset's), so their hints do not build on a pool
    the run refuses. Returns ``(problems, the available host bytes read or None)``."""
    problems, available, counted = [], None, {} if counted is None else counted
    judged = ""  # where the pool that fits stands in for the refused one
    try:
        available = check_host_pool(config, request.model)
    except Exception as exc:  # noqa: BLE001 - CacheFullError: not a ValueError
        if not is_config_error(exc):
            raise
        problems.append(str(exc))
        if isinstance(getattr(exc, "available", None), int):  # HostMemoryError
            from engine.kv.sizing import host_pool_limit

            load = (
                0 if _declared_host_memory(config) else model_load_host_bytes(config, request.model)
            )
            fit = fitted_pool_gb(host_pool_limit(exc.available, load))
            if fit < config.host_pool_gb:
                judged = (
                    f" (judged with host_pool_gb {fit:g}, the largest pool that fits, in "
                    f"place of the refused {config.host_pool_gb:g})"
                )
                config = config.replace(host_pool_gb=fit)
    found = collect_problems([
        lambda: check_memory_budget(config, request, manifest, specs, counted),
        lambda: check_pool_pages(config, request, manifest, specs, counted),
    ])  # fmt: skip
    return problems + [f"{problem}{judged}" for problem in found], available


def collect_problems(checks: Sequence[Callable[[], None]]) -> list[str]:
    """The message of each of ``checks`` that refuses the run, in their order."""
    problems = []
    for check in checks:
        try:
            check()
        except (UsageError, ValueError) as exc:  # ConfigError is a ValueError
            problems.append(str(exc))
        except Exception as exc:  # noqa: BLE001 - CacheFullError: not a ValueError
            if not is_config_error(exc):
                raise
            problems.append(str(exc))
    return problems


KEPT_WORDS = {
    "head": "kept the head",
    "tail": "kept the tail",
    "middle": "kept both ends, cut the middle",
}
"""How the truncation warning says which part of a cut document was kept."""

POLICY_FLAGS = {"truncate_keep": "truncate", "extend_method": "extend"}
"""Engine settings that only a context policy uses: setting -> that policy."""


def check_policy_flags(
    config: EngineConfig, preset: str, manifest_engine: dict[str, Any], flags: dict[str, Any]
) -> None:
    """Raise :class:`UsageError` when ``--truncate-keep`` or ``--extend-method`` is given
    but the context policy in force never uses it (the flag would be silently ignored).
    The same keys in a preset or a manifest are defaults for when the policy is chosen,
    so they pass."""
    for name, policy in POLICY_FLAGS.items():
        if flags.get(name) is not None and config.context_policy != policy:
            source = _policy_source(preset, manifest_engine, flags)
            raise UsageError(
                f"{engine_flag(name)} only applies with --context-policy {policy}, but the "
                f"context policy is {config.context_policy!r} ({source}); pass "
                f"--context-policy {policy} or drop {engine_flag(name)}"
            )


def _policy_source(preset: str, manifest_engine: dict[str, Any], flags: dict[str, Any]) -> str:
    """Which layer chose the context policy, in words."""
    if flags.get("context_policy") is not None:
        return "--context-policy"
    if manifest_engine.get("context_policy") is not None:
        return "the manifest's defaults.engine"
    if "context_policy" in settings.preset_overrides(preset):
        return f"preset {preset!r}"
    return "the default"


def with_preset_devices(config: EngineConfig, preset: str, flags: dict[str, Any]) -> EngineConfig:
    """Run on the preset's ``hardware.devices`` (``hardware.parallel`` unless
    ``--parallel`` is given) when it names several and neither ``--device`` nor
    ``--devices`` (or a manifest's ``defaults.engine.devices``) chose the devices."""
    if config.devices or flags.get("device") is not None:
        return config
    try:
        from engine.presets import load_preset_full

        hardware = load_preset_full(preset).hardware
    except (ConfigError, OSError):
        return config
    if hardware.num_devices < 2:
        return config
    parallel = config.parallel if flags.get("parallel") else hardware.parallel
    return config.replace(devices=tuple(hardware.devices), parallel=parallel)


def check_devices(
    config: EngineConfig,
    preset: str,
    manifest_engine: dict[str, Any],
    flags: dict[str, Any],
) -> None:
    """Raise :class:`ConfigError` when the run asks for a CUDA device this machine lacks.

    The devices are ``config.devices`` (``--devices``, the manifest or the preset's
    hardware) or else ``config.device``; the message names where they came from and
    what to pass instead.
    """
    devices = list(config.devices) or [config.device]
    cuda = [d for d in devices if d.split(":")[0] == "cuda"]
    if not cuda:
        return
    count = cuda_device_count()
    missing = [d for d in cuda if count == 0 or _cuda_index(d) >= count]
    if not missing:
        return
    source, fix = _device_source(preset, manifest_engine, flags, bool(config.devices))
    have = "CUDA is not available"
    if count:
        have = f"there are only {count} CUDA device(s)"
        fix = f"use --devices {','.join(f'cuda:{i}' for i in range(count))}"
    raise ConfigError(f"{source} asks for {', '.join(missing)} but {have} on this machine; {fix}")


def check_device_names(config: EngineConfig) -> None:
    """Raise :class:`ConfigError` for a device that is not ``cpu``, ``cuda`` or ``cuda:N``
    (before torch is imported, instead of torch's error at model load)."""
    devices = list(config.devices) or [config.device]
    for device in devices:
        kind, colon, index = device.partition(":")
        if kind not in DEVICE_KINDS or (colon and not (kind == "cuda" and index.isdigit())):
            raise ConfigError(
                f"unknown device {device!r}: use cpu, cuda or cuda:N "
                "(--device, --devices, the manifest or the preset)"
            )


def _cuda_index(device: str) -> int:
    """N of ``cuda:N`` (0 for ``cuda``, or a malformed index torch will report)."""
    index = device.partition(":")[2]
    return int(index) if index.isdigit() else 0


def _device_source(
    preset: str, manifest_engine: dict[str, Any], flags: dict[str, Any], several: bool
) -> tuple[str, str]:
    """Where the device choice came from (flag, manifest or preset), and what to use instead
    on a machine without CUDA."""
    if several:
        if flags.get("devices"):
            return "--devices", "use --devices cpu (or cpu,cpu)"
        if manifest_engine.get("devices"):
            return "the manifest's defaults.engine.devices", "set them to cpu there"
        return f"preset {preset!r} (hardware.devices)", "use --preset cpu"
    if flags.get("device") is not None:
        return "--device", "use --device cpu"
    if manifest_engine.get("device") is not None:
        return "the manifest's defaults.engine.device", "set it to cpu there, or pass --device cpu"
    return f"preset {preset!r}", "use --preset cpu"


def check_gguf_magic(path: Path) -> None:
    """Raise :class:`UsageError` unless ``path`` starts with the GGUF magic (the four bytes
    ``GGUF``, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): a wrong file is
    named before the model line and the tokenizer, not after."""
    shown = escaped(str(path))
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise UsageError(f"--model {shown}: cannot read it: {exc.strerror or exc}") from None
    if magic != b"GGUF":
        raise UsageError(
            f"--model {shown}: not a GGUF file (it starts with {magic!r}, a GGUF file with "
            "b'GGUF'); give a .gguf file or a Hugging Face model folder"
        )


def check_model_path(model: str) -> None:
    """Raise :class:`UsageError` unless ``--model`` names a model folder or a file that
    starts as a GGUF file does (:func:`check_gguf_magic`): a missing path, a pipe or a
    device, or a file of another kind is named before anything loads (``run``, ``bench``,
    ``eval``).

    Raises
    ------
    UsageError : ``"model not found: ..."`` or ``"--model PATH: ..."``.
    """
    path = Path(model)
    if not path.exists():
        raise UsageError(f"model not found: {escaped(model)}")
    if not path.is_dir() and not path.is_file():  # a FIFO: it hung
        raise UsageError(f"--model {escaped(str(path))}: not a regular file or a model folder")
    if path.is_file():
        check_gguf_magic(path)
    else:
        check_model_folder(path)


MODEL_FOLDER_FILES = ("config.json", "tokenizer.json", "*.safetensors")
"""What a Hugging Face model folder given to ``--model`` holds (the weights may be
sharded: several ``*.safetensors``)."""


def check_model_folder(path: Path) -> None:
    """Raise :class:`UsageError` unless the folder ``path`` holds every one of
    :data:`MODEL_FOLDER_FILES`, naming what a model folder needs and which are missing,
    or that a GGUF file is expected: an empty folder (or one without ``config.json``)
    said only "no tokenizer.json in this model folder", after the model line."""
    shown = escaped(str(path))
    try:
        names = [entry.name for entry in path.iterdir()]
    except OSError as exc:
        reason = exc.strerror or exc
        raise UsageError(f"--model {shown}: cannot read the folder: {reason}") from None
    missing = [
        want for want in MODEL_FOLDER_FILES
        if not any(fnmatch.fnmatchcase(n, want) and (path / n).is_file() for n in names)
    ]  # fmt: skip
    if not missing:
        return
    verb = "is" if len(missing) == 1 else "are"
    what = "it is empty" if not names else f"{_and(missing)} {verb} missing"
    hints = []
    if "*.safetensors" in missing and any(n.endswith((".bin", ".pt", ".pth")) for n in names):
        hints.append("PyTorch .bin checkpoints are not read: re-save with safe_serialization=True")
    ggufs = sorted(n for n in names if n.lower().endswith(".gguf") and (path / n).is_file())
    if ggufs:
        given = escaped(str(path / ggufs[0]))
        hints.append(f"it holds {escaped(_and(ggufs))}: give the file, --model {given}")
    hint = f"; {'; '.join(hints)}" if hints else ""
    raise UsageError(
        f"--model {shown}: not a model folder ({what}{hint}): a Hugging Face model folder "
        "holds config.json, tokenizer.json and its weights as *.safetensors; or give a GGUF "
        "file (--model model.gguf)"
    )


def _and(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def check_encoding(encoding: str) -> None:
    """Raise :class:`UsageError` unless ``--encoding`` names a Python text codec (``run``,
    ``eval``): ``base64``, ``rot13``, ``hex``... are codecs, but ``bytes.decode`` refuses
    them (a ``LookupError`` traceback when the first document was read)."""
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise UsageError(f"unknown --encoding {encoding!r}") from None
    try:
        b"a".decode(encoding, "replace")  # a non-text codec refuses any input
    except LookupError:
        raise UsageError(
            f"--encoding {encoding!r} is not a text encoding (give one such as utf-8, "
            "latin-1, cp1252 or utf-16)"
        ) from None


def check_request(request: RunRequest) -> None:
    """Raise :class:`UsageError` for contradictory or impossible arguments."""
    if request.manifest is not None and request.docs:
        raise UsageError("give documents or --manifest, not both")
    if request.manifest is None and not request.docs and not request.print_config:
        raise UsageError(
            "nothing to run: give documents (hisparse run docs/*.txt) or --manifest FILE"
        )
    if request.manifest is not None and request.manifest.is_dir():
        shown = escaped(str(request.manifest))
        raise UsageError(f"--manifest {shown} is a directory: name the manifest file")
    if request.manifest is not None and not request.manifest.is_file():
        raise UsageError(f"manifest not found: {escaped(str(request.manifest))}")
    if request.model is not None:
        check_model_path(request.model)
    if request.errors not in ERROR_MODES:
        raise UsageError(f"--errors must be one of {', '.join(ERROR_MODES)}")
    check_encoding(request.encoding)


def check_output_dir(output_dir: Path) -> None:
    """Raise :class:`UsageError` when the run could not write its files in ``output_dir``:
    not a folder, not writable, not makeable, one of its own files a folder
    (:func:`check_output_folder`), no lock file can be made there
    (:func:`lock_file_problem`), or its ``results.jsonl`` cannot be opened for writing
    (:func:`results_file_problem`). One of :func:`run_checks`, so ``--print-config`` lists
    it as it does the others."""
    check_output_folder(output_dir, (RESULTS_FILE, CONFIG_FILE, LOCK_FILE), probe=False)
    if output_dir.is_dir():  # writable by os.access, yet (root in /sys) no file
        problem = lock_file_problem(output_dir)
        if problem:
            raise UsageError(f"--output-dir {escaped(str(output_dir))} is not writable: {problem}")
        problem = results_file_problem(output_dir)
        if problem:
            raise UsageError(problem)


def check_output_folder(
    output_dir: Path,
    files: Sequence[str],
    option: str = "--output-dir",
    writer: str = "a run",
    probe: bool = True,
) -> None:
    """Raise :class:`UsageError` when ``writer`` (a run, eval, bench) could not write its
    ``files`` in the folder ``output_dir`` (given as ``option``), before any work: it
    exists and is not a folder, is not writable, cannot be made (the nearest existing
    folder above it is not writable or takes no new folders: :func:`folder_probe_problem`),
    or one of ``files`` there is a folder. With ``probe``, an existing folder must also
    take a new entry (``os.access`` says yes to root in ``/proc``)."""
    shown = escaped(str(output_dir))
    if output_dir.exists() and not output_dir.is_dir():
        raise UsageError(f"{option} {shown} exists and is not a directory")
    if output_dir.is_dir() and not os.access(output_dir, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {shown} is not writable")
    if not output_dir.exists():  # the run makes it
        parent = output_dir.absolute().parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        why = "is not a folder" if not parent.is_dir() else None
        if why is None and not os.access(parent, os.W_OK | os.X_OK):
            why = "is not writable"
        if why is None:  # os.access says yes to root even where no folder can be made
            why = folder_probe_problem(parent)  # (/proc, /sys): make one, removed at once
        if why:
            raise UsageError(f"cannot create output dir {shown}: {escaped(str(parent))} {why}")
    for name in files:  # a folder there: a traceback before
        own = output_dir / name
        if own.exists() and not own.is_file():
            raise UsageError(
                f"{escaped(str(own))} is not a regular file (a folder?); {writer} writes its "
                f"{name} there: move it away or choose another {option}"
            )
    if probe and output_dir.is_dir():
        why = folder_probe_problem(output_dir)
        if why:
            raise UsageError(f"{option} {shown} is not writable: it {why}")


def check_no_earlier_results(
    output_dir: Path,
    report: str,
    option: str,
    writer: str,
    force: bool,
    ours: Callable[[bytes], bool] | None = None,
) -> None:
    """Raise :class:`UsageError` when ``output_dir`` holds ``report`` (an earlier eval's
    ``eval.json``, bench's ``bench.json``) and ``force`` is off: ``writer`` would replace
    it, and its plots, without a word (``--force`` lets it). With ``ours`` (whether the
    file's bytes are a report ``writer`` wrote: its marker, as :func:`is_hisparse_config`
    tells a run's ``config.json``), a ``report`` it did not write is refused even with
    ``force``: it is the user's own file. One that cannot be read is left to ``force``."""
    path = output_dir / report
    if not os.path.lexists(path):
        return
    if ours is not None and path.is_file():
        try:
            data = path.read_bytes()
        except OSError:
            data = None
        if data is not None and not ours(data):
            raise UsageError(
                f"{escaped(str(path))}: not written by hisparse {writer}; {writer} would "
                f"replace it (--force neither): move it away or choose another {option}"
            )
    if not force:
        raise UsageError(
            f"{escaped(str(path))} holds the results of an earlier {writer}; give --force to "
            f"replace them, or choose another {option}"
        )


@contextlib.contextmanager
def locked_output_folder(output_dir: Path, option: str) -> Iterator[None]:
    """Make ``output_dir`` (and the folders above it) and hold the lock ``hisparse run``
    takes there (:func:`lock_output_dir`), so two commands writing one folder (eval,
    bench, a run) never replace each other's files: the second is refused. On leaving, a
    folder made here that holds nothing but the lock file (a failure or a stop before
    anything was written) is removed with the folders made above it, as a run does.

    Raises
    ------
    UsageError
        The folder cannot be made, or another process holds its lock (the message names
        the process and the lock file, as a run's does).
    """
    created = missing_folders(output_dir)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        shown = escaped(str(output_dir))
        raise UsageError(f"cannot create output dir {shown}: {exc.strerror or exc}") from None
    try:
        with lock_output_dir(output_dir, option):
            try:
                yield
            finally:
                if created:
                    with _StopSignalsDeferred() as stop:
                        _remove_folders(output_dir, created[1:])
                    if stop.signals:  # as the handlers would have done, now
                        signal.raise_signal(stop.signals[0])
    except OutputDirBusy as exc:  # the folder is the other process's now: left as it is
        raise UsageError(str(exc)) from None


def check_new_file(path: Path, option: str) -> None:
    """Raise :class:`UsageError` when no file ``path`` (given as ``option``) can be made:
    missing folders are made when it is written, so the nearest existing one must be a
    writable folder that takes a new file (tried: ``os.access`` says yes to root
    everywhere, ``/proc`` too). An existing ``path`` that is neither a regular file nor a
    symbolic link (a device such as ``/dev/null``, a FIFO, a socket) is refused: writing
    whole renames a new file over its name, which would replace the device itself."""
    shown = escaped(str(path))
    try:
        mode = path.lstat().st_mode
    except OSError:  # nothing there (or no access: the probe below says)
        mode = None
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise UsageError(
            f"{option} {shown} is not a regular file (a device, FIFO or socket); it is never "
            "replaced: choose a file name"
        )
    parent = path.parent if str(path.parent) else Path(".")
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{option} {shown}: {escaped(str(parent))} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {shown}: not writable")
    try:  # try a file there, then drop it
        fd, probe = tempfile.mkstemp(prefix=".hisparse-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"{option} {shown}: not writable ({exc.strerror or exc})") from None


def folder_probe_problem(parent: Path) -> str | None:
    """Why no folder can be made in the existing folder ``parent`` (``takes no new folders
    (No such file or directory)``), or ``None``: makes an empty probe folder there and
    removes it at once, so ``--print-config`` leaves nothing behind."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".hisparse.probe.", dir=parent))
    except OSError as exc:
        return f"takes no new folders ({exc.strerror or exc})"
    return None


def check_trace_path(config: EngineConfig) -> None:
    """Raise :class:`UsageError` when the ``--trace`` file (``trace_path``; several
    workers write ``STEM.wN.jsonl`` beside it) cannot be written, before the model loads.

    A trace never replaces a file: one that exists already (a document, ``results.jsonl``,
    an earlier trace) is refused by name. Missing folders are made when the trace opens,
    so the nearest existing one must be a writable folder."""
    from engine.serve.workers import worker_trace_path

    trace = config.trace_path
    if not trace:
        return
    path, shown = Path(trace), escaped(trace)
    if path.is_dir():
        raise UsageError(f"--trace {shown} is a directory; give a file name")
    workers = len(config.devices)
    files = [worker_trace_path(trace, r) for r in range(workers)] if workers > 1 else [trace]
    for name in files:
        if os.path.lexists(name):
            raise UsageError(
                f"--trace {shown}: {escaped(str(name))} already exists; a trace never replaces "
                "a file (remove it or choose another name)"
            )
    check_new_file(path, "--trace")


def _usage_failure(err_console: Console, headline: str, problems: list) -> int:
    _print_line(err_console, headline, "bold red")
    for problem in problems:
        _print_line(err_console, f"  {problem}")
    return EXIT_USAGE


def _print_line(console: Console, message: str, style: str | None = None) -> None:
    """``message`` as plain text (no Rich markup, no highlighting), no control character
    of it reaching the terminal (:func:`~hisparse_cli.display.terminal_text`)."""
    text = terminal_text(message)
    console.print(text, style=style, markup=False, highlight=False, soft_wrap=True)


class _StopSignalsDeferred:
    """While active, SIGINT and SIGTERM are only recorded (``signals``, in order): the
    model load's imports of torch and triton load native extensions that call back into
    Python, and a ``KeyboardInterrupt`` raised inside such a callback aborts the process
    (``terminate called after throwing an instance of 'nanobind::python_error'``, exit 134,
    no summary) — a fresh user's SIGTERM 3 s into a run did. The caller stops after the
    block (:func:`import_engine_modules`: a few seconds; the weights' load after it stays
    interruptible). An ignored SIGINT stays ignored (:func:`handled_stop_signals`), here
    and in :class:`_SigintCanceller`."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self._previous: dict[int, Any] = {}

    def __call__(self, signum: int, frame: object) -> None:
        self.signals.append(signum)

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self) for sig in handled_stop_signals()}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


LATE_INTERRUPT = (
    "Ctrl-C while exiting: stopped at once (the run had ended; its results are written)"
)


def quiet_late_interrupts() -> None:
    """Once the interpreter exits, make Ctrl-C end the process at once: exit 130, one line
    (:data:`LATE_INTERRUPT`) on stderr. Called when a run has returned.

    A run's results are written when it returns, but the exit still runs the callbacks
    imports registered with :mod:`atexit` (torch's finalizers take a moment): a Ctrl-C
    there (a second one, pressed as the summary printed) wrote "Exception ignored in
    atexit callback" and a ``KeyboardInterrupt`` traceback. Registered anew on each call,
    so it runs first (atexit runs the last registered first); nothing changes before the
    exit, so a process that goes on (the tests) keeps its own handler."""
    atexit.unregister(_handle_late_interrupts)
    atexit.register(_handle_late_interrupts)


def _handle_late_interrupts() -> None:
    if signal.SIGINT in handled_stop_signals():  # an inherited SIG_IGN stays
        signal.signal(signal.SIGINT, _exit_interrupted)


def _exit_interrupted(signum: int, frame: object) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
            if stream is sys.stderr:
                stream.write(LATE_INTERRUPT + "\n")
                stream.flush()
        except (OSError, ValueError):  # closed: nothing more to say there
            pass
    os._exit(EXIT_INTERRUPTED)


class _SigintCanceller(_StopSignalsDeferred):
    """While active, the first SIGINT or SIGTERM calls ``engine.cancel()``; the second
    raises ``KeyboardInterrupt``. The handler only sets state: the run loop announces it.
    ``signals`` lists the signals received, in order."""

    def __init__(self, engine: Any) -> None:
        super().__init__()
        self.engine, self.count = engine, 0

    def __call__(self, signum: int, frame: object) -> None:
        self.count += 1
        self.signals.append(signum)
        if self.count > 1:
            raise KeyboardInterrupt
        self.engine.cancel()


class _SigtermAsInterrupt:
    """While active, SIGTERM raises ``KeyboardInterrupt`` (as Ctrl-C does) so the run
    records what it has and prints the summary; ``received`` says whether it came."""

    def __init__(self) -> None:
        self.received, self._previous = False, None

    def __call__(self, signum: int, frame: object) -> None:
        self.received = True
        raise KeyboardInterrupt

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


class BatchRun:
    """Steps 2-7 of the module docstring for one prepared request."""

    def __init__(
        self,
        request: RunRequest,
        manifest: Manifest,
        config: EngineConfig,
        console: Console,
        err_console: Console,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.request, self.manifest, self.config = request, manifest, config
        self.console, self.err_console, self.clock = console, err_console, clock
        self.output_dir = request.output_dir
        self.model_name = request.model or DEFAULT_MODEL_ID
        self.preset_line = request.preset  # with the reason when it was --preset auto
        self.startup_marks: dict[str, float] = {}  # ev.StartupTimes of the CLI's steps
        self.tracker = ProgressTracker(clock())
        self.records: dict[str, dict[str, Any]] = {}
        self.prompt_tokens: dict[str, int] = {}  # job id -> tokens of the prompt it was given
        self.reduce_admitted: dict[str, float] = {}  # job id -> when it was admitted
        self.specs: dict[str, Any] = {}  # job id -> JobSpec
        self.final: dict[str, str] = {}  # job id -> why its failure is final (results.FINAL_*)
        self.input_paths: set[Path] = set()  # every input of the run, resolved
        self.own_outputs: set[Path] = set()  # output files earlier runs wrote, resolved
        self.prompt_limit: int | None = None  # the engine's context limit, once loaded
        self.counted: dict[str, int] = {}  # job id -> prompt tokens counted before the load
        self.extract_fields: dict[str, Any] = {}  # extract job id -> its fields (or None)
        self.cancel: _SigintCanceller | None = None
        self.sigterm = _SigtermAsInterrupt()
        self._announced = False
        self.chunker = ChunkScheduler(self._next_level)  # context_policy chunk
        self.engine: BatchEngine | None = None  # while the engine runs
        self.log: ResultsLog
        self.reporter: Reporter
        self.earlier_engine: dict[str, Any] | None = None  # config.json's, before this run
        self.write_failed = False  # a file of the run could not be written: it stopped
        self.replaced_why: dict[str, str] = {}  # a replaced answer's reason -> first job said

    def run(self, config_doc: dict[str, Any]) -> int:
        """Execute the batch; return the exit code."""
        self._created_dirs = missing_folders(self.output_dir)
        shown = escaped(str(self.output_dir))
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return _usage_failure(
                self.err_console, f"error: cannot create output dir {shown}: {exc}", []
            )
        if not os.access(self.output_dir, os.W_OK | os.X_OK):  # e.g. a read-only file system
            return _usage_failure(
                self.err_console, f"error: output dir {shown} is not writable", []
            )
        try:
            with self.sigterm, lock_output_dir(self.output_dir):
                try:
                    with ResultsLog(self.output_dir) as self.log:
                        return self._run_locked(config_doc)
                except KeyboardInterrupt:  # a second Ctrl-C or SIGTERM: it stops at once,
                    self._remove_unused_output_dir()  # but not before this (lock still held)
                    raise
        except OutputDirBusy as exc:
            return _usage_failure(self.err_console, f"error: {exc}", [])
        except WriteFailed as exc:  # before the jobs (the lock file, tidying results.jsonl)
            _print_line(self.err_console, f"error: {exc}", "bold red")
            return EXIT_FAILED
        except KeyboardInterrupt:
            return EXIT_TERMINATED if self.terminated else EXIT_INTERRUPTED

    @property
    def terminated(self) -> bool:
        """Whether SIGTERM (rather than Ctrl-C) stopped the run."""
        first = self.cancel.signals[0] if self.cancel is not None and self.cancel.signals else None
        return first == signal.SIGTERM or (first is None and self.sigterm.received)

    def _run_locked(self, config_doc: dict[str, Any]) -> int:
        set_aside = self.log.set_aside_broken_lines()  # lines cut short: to a .partial file
        self.log.compact()  # superseded failure lines of earlier runs
        self.earlier_engine = earlier_engine_settings(self.output_dir)  # before we write ours
        planned = plan_jobs(
            self.manifest.jobs,
            self.config,
            model_fingerprint(self.request.model),
            self.request.text_options,
            self.log,
            self.request.force,
            self.request.allow_binary,
            self.request.retry_failed,
            self.request.stdin,
        )
        known = [  # files hisparse wrote: only a successful line wrote its text file
            r["output"]
            for r in self.log.existing.latest_success.values()
            if isinstance(r.get("output"), str)
        ]
        self.own_outputs = {(self.output_dir / name).resolve() for name in known}
        collisions = output_collisions(
            planned, self.output_dir, known, self.log.existing.truncated_tail
        )
        planned = [
            dataclasses.replace(j, status=INVALID, error=collisions[j.spec.id], final=None)
            if j.spec.id in collisions
            else j
            for j in planned
        ]
        self.input_paths = {input_identity(p) for j in planned for p in j.spec.inputs}
        runs = any(job.status not in (SKIP, FAILED_BEFORE) for job in planned)
        self._config_doc = config_doc
        if not runs and not (self.output_dir / CONFIG_FILE).exists():
            save_config(self.output_dir, config_doc)
        # config.json describes the run that wrote the latest results: a run that only
        # skips jobs, or whose model does not load, leaves the earlier one in place; a run
        # writes it with its first results line or once its model has loaded.
        self._config_saved = not runs
        self.reporter = make_reporter(
            self.console, self.tracker, self.request.json_progress, self.clock, self.err_console
        )
        interrupted = False
        config_error = None
        with self.reporter:
            for warning in [*([set_aside] if set_aside else []), *self.log.existing.warnings]:
                self.reporter.note(warning, "warning")
            for rejected in self.manifest.rejected:  # bad OpenAI-batch lines: the rest run
                self.reporter.note(str(rejected), "error")
            for warning in config_warnings(self.config) if runs else ():
                self.reporter.note(warning, "warning")
            try:
                self._check_before_load(planned)  # a refused run warns of no replacement
                pending = self._register(planned)
                if pending:
                    interrupted = self._run_engine(pending)
            except KeyboardInterrupt:
                interrupted = True
            except LoadConfigError as exc:
                config_error = exc
            except WriteFailed as exc:  # a full disk: the run stops, as on an engine error
                self._stopped_writing(exc)
            self.tracker.finish(self.clock())  # the last frame and the summary: one time
            self.log.close()  # compact replaces the file: appends reopen it
            try:
                self.log.compact()  # this run's lines supersede earlier failures: one each
                if self.manifest.batch:
                    self._write_batch_output()
            except WriteFailed as exc:  # results.jsonl as it was: replaced atomically
                if not self.write_failed:  # tidying after a full disk: said already
                    self._stopped_writing(exc)
        removed = self._remove_unused_output_dir()
        if config_error is not None:  # one line each
            for problem in config_error.problems:
                _print_line(
                    self.err_console, f"error: cannot load the model: {problem}", "bold red"
                )
            return EXIT_USAGE
        shown = f"{self.output_dir} (removed: nothing written)" if removed else str(self.output_dir)
        summary = summarize(self.tracker.state, self.clock(), shown, interrupted, self.preset_line)
        summary = dataclasses.replace(summary, refused=len(self.manifest.rejected))
        self.reporter.summary(summary)
        code = exit_code(summary)
        if code == EXIT_OK and (self.manifest.rejected or self.write_failed):
            code = EXIT_FAILED  # a request line was refused, or a file could not be written
        return EXIT_TERMINATED if code == EXIT_INTERRUPTED and self.terminated else code

    def _remove_unused_output_dir(self) -> bool:
        """Remove the output folder when this run created it and wrote nothing there but
        its lock file (Ctrl-C or SIGTERM during the model load, a load that failed), with
        the folders above it that the run made: the file system is left as it was. The
        lock file goes first, while still held, so no other run can take it meanwhile.
        A stop signal meanwhile waits for it (then stops the run, as it would have):
        one that cut it short left the folder holding only the lock file, or nothing.
        Also called when a second Ctrl-C or SIGTERM stopped the run before the summary.
        Returns whether the output folder was removed."""
        created = getattr(self, "_created_dirs", [])
        if not created:
            return False
        with _StopSignalsDeferred() as stop:
            removed = _remove_folders(self.output_dir, created[1:])
        if stop.signals:  # as the handlers would have done, now
            self.sigterm.received |= signal.SIGTERM in stop.signals
            raise KeyboardInterrupt
        return removed

    def _write_batch_output(self) -> None:
        """``batch_output.jsonl``: one OpenAI batch output line per request of the manifest,
        in its order (rejected lines included), from each job's latest results line."""
        numbered = [
            (int(job.origin.rpartition(":")[2]), openai_batch.output_line(
                self._this_key_line(job.id), job.custom_id or job.id, self.model_name))
            for job in self.manifest.jobs
        ]  # fmt: skip
        numbered += [(r.line, openai_batch.rejected_line(r)) for r in self.manifest.rejected]
        lines = [line for _, line in sorted(numbered, key=lambda pair: pair[0])]
        text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
        path = self.output_dir / openai_batch.BATCH_OUTPUT_FILE
        write_text_atomic(path, text)
        refused = len(self.manifest.rejected)
        self.reporter.note(f"OpenAI batch output: {escaped(str(path))} ({len(lines)} line(s))")
        if refused:  # the summary counts jobs only: say why the exit code is 1
            self.reporter.note(
                f"{refused} request line(s) of the manifest were refused (errors above; "
                f"invalid_request lines in {path.name})",
                "warning",
            )

    def _this_key_line(self, job_id: str) -> dict[str, Any] | None:
        """The job's latest results line if it is for this run's resume key (an older line
        for other content or settings is not this request's answer)."""
        record = self.log.latest.get(job_id)
        key = self.records.get(job_id, {}).get("key")
        return record if record is not None and record.get("key") == key else None

    def _register(self, planned: list[PlannedJob]) -> list[PlannedJob]:
        """Show every job; record invalid ones as failed; return those to run."""
        for job in planned:
            self.tracker.add_job(job.spec.id, "skipped" if job.status == SKIP else "queued")
            self.records[job.spec.id] = job.base_record(self.model_name)
            self.specs[job.spec.id] = job.spec
            if job.final is not None:
                self.final[job.spec.id] = job.final
            if job.spec.task.task == "extract":
                self.extract_fields[job.spec.id] = job.spec.task.fields
        self.reporter.skipped([j.spec.id for j in planned if j.status == SKIP])
        for job in planned:
            if job.status == FAILED_BEFORE:  # shown as failed; no new line
                self.tracker.update(JobFailed(self.clock(), job.spec.id, job.error))
                self.reporter.on_event(JobFailed(self.clock(), job.spec.id, job.error))
                self.reporter.note(
                    f"{job.spec.id}: not tried again: it failed this way before with the same "
                    f"inputs and settings (see {RESULTS_FILE}); --retry-failed (or --force) "
                    "tries it again",
                    "warning",
                )
        writers: dict[str, list[EarlierJob]] = {}  # output file -> earlier jobs that wrote it
        for earlier in jobs_of(self.log.existing.latest):
            writers.setdefault(earlier.output, []).append(earlier)
        for job in planned:
            if job.status == RUN:
                self._warn_replaced_output(job, writers.get(job.spec.output, []))
            if job.status == INVALID:
                self._handle(JobFailed(self.clock(), job.spec.id, job.error))
            elif job.status == RUN:
                for warning in job.warnings:  # binary read anyway; controls removed (where)
                    self.reporter.note(f"{job.spec.id}: {warning}", "warning")
        return [j for j in planned if j.status == RUN]

    def _warn_replaced_output(self, job: PlannedJob, writers: list[EarlierJob]) -> None:
        """Warn when ``<output>`` holds an earlier result this run replaces (``writers``: the
        earlier jobs that wrote it): a job over other inputs (an explicit id or output equal
        to another job's), or this job's own earlier answer under another resume key (other
        settings or document content). The earlier text stays on its ``results.jsonl``
        line."""
        mine = tuple(input_identity(p) for p in job.spec.inputs)
        path = self.output_dir / job.spec.output
        if not path.is_file():
            return
        shown = escaped(str(path))
        for earlier in writers:
            if earlier.inputs != mine:
                inputs = ", ".join(map(shown_path, earlier.inputs)) or "unrecorded inputs"
                self.reporter.note(
                    f"{job.spec.id}: {shown} holds earlier job {earlier.id}'s result for "
                    f"{inputs}; this run replaces it (that text stays in {RESULTS_FILE})",
                    "warning",
                )
                return
        line = self.log.existing.latest.get(job.spec.id)
        mine_now = self.records.get(job.spec.id, {})
        own = any(e.id == job.spec.id for e in writers)
        if own and line and line.get("key") != mine_now.get("key"):
            wrote = self.log.existing.latest_success.get(job.spec.id) or line  # the file's
            why = earlier_answer_difference(wrote, mine_now, self.earlier_engine)
            first = self.replaced_why.setdefault(why, job.spec.id)
            if first != job.spec.id:  # a batch-wide change: said in full once
                why = f"{why.split(' (', 1)[0]} (as for {first})"
            self.reporter.note(
                f"{job.spec.id}: {shown} holds this job's earlier answer, made with {why}; "
                f"this run replaces it (that text stays in {RESULTS_FILE})",
                "warning",
            )

    def _refuse_too_long(self, pending: list[PlannedJob]) -> list[PlannedJob]:
        """Before the model loads, under ``refuse``/``extend``: the jobs whose document
        could exceed the context limit beside max_new_tokens (more bytes than the limit's
        tokens: :data:`preflight.BOUND_BYTES_PER_TOKEN`, from the files' sizes) are
        checked with the model's tokenizer (read from its header, no weights: the load
        then reuses it). First by size: one whose first bytes already hold more than the
        limit's tokens (:func:`size_floor`) fails with the engine's "judged from its size;
        not tokenised" message, the rest of it neither read nor tokenised (a huge file
        would take minutes and gigabytes to tokenise); the others are tokenised exactly,
        and those over the limit fail with the exact count. Either way with the engine's
        own message and choices, so no model is loaded for a job that cannot run, and the
        other jobs run. Returns the jobs still to run.
        Where the tokenizer cannot be read, the estimate is stated as a warning instead and
        the engine decides after the load."""
        if self.config.context_policy in ("truncate", "chunk"):
            return pending
        trained = preflight.trained_context(self.request.model)
        if trained is None:
            return pending
        limit = preflight.context_limit(self.config, trained)
        jobs = [
            (s.id, s.inputs, s.sampling.max_tokens, preflight.template_tokens(s, safe=True))
            for s in (j.spec for j in pending)
        ]
        # candidates: over the limit at one byte a token, which no text goes below
        bound = preflight.BOUND_BYTES_PER_TOKEN
        found = {
            o.job_id for o in preflight.oversized_documents(jobs, limit, self.request.stdin, bound)
        }
        if not found:
            return pending
        t0 = time.monotonic()
        try:
            tokenizer = load_tokenizer(self.config, self.request.model)
        except Exception:  # noqa: BLE001 - the load reports the real reason; warn only
            estimated = preflight.oversized_documents(jobs, limit, self.request.stdin)
            if estimated:
                statement = preflight.oversized_statement(
                    estimated, limit, self.config.context_policy
                )
                self.reporter.note(statement, "warning")
            return pending
        keep: list[PlannedJob] = []
        refused: list[tuple[PlannedJob, str]] = []
        limit_from = max_context_source(self.config, self.request, self.manifest, limit)
        for planned in pending:
            spec = planned.spec
            if spec.id not in found:
                keep.append(planned)
                continue
            max_tokens = spec.sampling.max_tokens
            floor = size_floor(spec, self.request, tokenizer, limit)
            if floor is not None:  # over the limit by the size of its start: read no more
                policy = self.config.context_policy
                why = too_long_by_size_message(floor, max_tokens, limit, policy, limit_from)
                refused.append((planned, f"{job_where(spec)}: {why}"))
                continue
            try:
                documents, document = self._document_of(planned)
                ids = tokenizer.encode_chat(self._prompt_messages(spec)(document))
            except Exception:  # noqa: BLE001 - the job fails as usual, after the load
                keep.append(planned)
                continue
            self.counted[spec.id] = len(ids)
            if len(ids) + max_tokens <= limit:
                keep.append(planned)
                continue
            if documents is not None:
                planned = planned.with_documents(documents)
            policy = self.config.context_policy
            why = too_long_message(len(ids), max_tokens, limit, policy, limit_from)
            refused.append((planned, f"{job_where(spec)}: {why}"))
            self.prompt_tokens[spec.id] = len(ids)  # counted: its results line says so
        if refused:  # documents that fit are not mentioned
            self.reporter.note(
                f"counted the tokens of {len(found)} document(s) that could exceed the context, "
                f"with the model's tokenizer "
                f"before loading it ({time.monotonic() - t0:.1f}s): {len(refused)} over the context "
                f"limit of {limit:,} tokens" + ("; the other jobs run" if refused and keep else "")
            )
        for planned, why in refused:
            self.records[planned.spec.id] = planned.base_record(self.model_name)
            self.final[planned.spec.id] = FINAL_PROMPT  # the same key fails the same way again
            self._handle(JobFailed(self.clock(), planned.spec.id, why))
        return keep

    def _longest_job(self, pending: list[PlannedJob]) -> int | None:
        """With a memory budget: the most tokens (prompt + max_new_tokens, within the
        context limit) a job of ``pending`` holds, its prompt tokenised with the model's
        tokenizer before the load, so the cache is sized for the jobs this run has, as
        ``hisparse plan --context`` counts a job, not for the whole context. ``None`` (the
        engine sizes for the context limit) without a budget, or where the tokenizer or
        the trained context cannot be read before the load. A job whose prompt cannot be
        built here is left out: it fails when the engine builds it."""
        if self.config.memory_budget_gb is None:
            return None
        trained = preflight.trained_context(self.request.model)
        if trained is None:
            return None
        limit = preflight.context_limit(self.config, trained)
        try:
            tokenizer = load_tokenizer(self.config, self.request.model)
        except Exception:  # noqa: BLE001 - the load reports the real reason
            return None
        needs = [job_tokens(p.spec, self.request, tokenizer, limit, self.counted) for p in pending]
        return max((n for n in needs if n is not None), default=None)

    def _check_before_load(self, planned: list[PlannedJob]) -> None:
        """The refusals of a run that has jobs to run, made before any job is shown, so a
        refused run warns of nothing it would have done (replacing earlier answers): the
        host pool against the memory available (load_engine checks it again), the memory
        budget against the jobs (the load's split; it checks again) and the host pool
        against the longest job (the engine checks each job again): :func:`load_problems`.

        Raises
        ------
        LoadConfigError
            With every one that does not fit (exit 2).
        """
        specs = [job.spec for job in planned if job.status == RUN]
        if not specs:
            return
        problems, self.host_available = load_problems(
            self.config, self.request, self.manifest, specs, self.counted
        )
        if problems:
            raise LoadConfigError(*problems)

    def _run_engine(self, pending: list[PlannedJob]) -> bool:
        """Load the engine and consume its events; return whether Ctrl-C was pressed."""
        warm_cuda(self.config, self.startup_marks)  # while torch is imported below
        pending = self._refuse_too_long(pending)
        if not pending:  # every job to run was over the context: no model to load
            return False
        longest = self._longest_job(pending)  # what a memory budget sizes the cache for
        self.reporter.note(
            f"loading model {self.model_name} ({len(pending)} job(s) to run; "
            f"preset {self.preset_line})"
        )
        # other processes hold cores: more threads than free cores stall decode
        self.config, threads_note = with_free_threads(self.config)
        if threads_note:
            self.reporter.note(threads_note)
            doc = getattr(self, "_config_doc", None)
            if doc is not None:  # config.json says the count the run uses, and why
                doc["engine"]["num_threads"] = self.config.num_threads
                doc.setdefault("effective", {})["num_threads"] = threads_note
        devices = [self.config.device, *(self.config.devices or ())]
        if any(str(d).startswith("cuda") for d in devices):  # the kernels compile on CUDA only
            cold = triton_cache_is_cold()
            if cold:
                self.reporter.note(
                    f"compiling the GPU kernels on first use ({cold} is empty; later runs "
                    "reuse it): the first steps take longer"
                )
        if self.config.parallel == "pipeline" and len(self.config.devices or ()) > 1:
            if any(json_keys(j.spec) for j in pending):
                self.reporter.note(
                    "--parallel pipeline does not constrain --fields replies to the JSON "
                    "object; they are only validated afterwards (--parallel data does)",
                    "warning",
                )
        started = self.clock()
        load_started = time.monotonic()
        with _StopSignalsDeferred() as stop:
            try:
                import_engine_modules()
            except Exception as exc:  # noqa: BLE001 - a broken install ends the run cleanly
                self.reporter.note(f"cannot load the model: {exc}", "error")
                return False
        if stop.signals:  # Ctrl-C or SIGTERM during the imports: stop now it is safe
            self.sigterm.received = stop.signals[0] == signal.SIGTERM
            raise KeyboardInterrupt
        try:
            sized = {} if longest is None else {"job_tokens": longest}
            engine = load_engine(self.config, self.request.model, **sized)
        except Exception as exc:  # noqa: BLE001 - any load failure ends the run cleanly
            if is_config_error(exc):
                raise LoadConfigError(str(exc) + self._memory_shrank(exc)) from exc
            self.reporter.note(f"cannot load the model: {exc}", "error")
            return False
        self._note_sized_batch(engine)
        try:
            self._save_config()  # the jobs run now
        except WriteFailed:  # a full disk: the run stops before any job
            engine.close()
            raise
        info = f" ({engine.weights_info})" if engine.weights_info else ""  # tensor types
        self.reporter.note(f"model loaded in {self.clock() - started:.1f}s{info}")
        self._report_startup(load_started, engine)
        self.prompt_limit = engine.prompt_limit()
        traces = engine.trace_paths
        if len(traces) > 1:  # several devices: one file per worker
            self.reporter.note(
                f"selection traces: {', '.join(traces)} (hisparse replay reads them together)"
            )
        self.engine = engine
        with _SigintCanceller(engine) as self.cancel:
            try:
                for event in engine.run(self._jobs(engine, pending)):
                    self._announce_cancel()
                    self._handle(event)
            except (KeyboardInterrupt, WriteFailed):
                raise
            except Exception as exc:  # noqa: BLE001 - report, keep finished results
                self.err_console.print_exception()
                self.reporter.note(f"the engine stopped with an error: {exc}", "error")
            finally:
                engine.close()  # worker processes of several devices, trace files
            if self.cancel.count:
                self._record_cancelled_chunks()
            return self.cancel.count > 0

    def _memory_shrank(self, exc: BaseException) -> str:
        """For a host pool the cache refused after the load although the check before it
        accepted the pool: the words saying that the memory available shrank meanwhile
        by more than the load was counted to take (other processes took it), else ``""``."""
        from engine.kv.sizing import HostMemoryError

        before = getattr(self, "host_available", None)
        if not isinstance(exc, HostMemoryError) or before is None or exc.available >= before:
            return ""
        load = model_load_host_bytes(self.config, self.request.model)
        return (
            f"; the memory available shrank while the model loaded: {before / 2**30:.1f} GiB "
            f"before it, {load / 2**30:.1f} GiB of which was set aside for the load, and "
            f"{exc.available / 2**30:.1f} GiB after it (other processes took memory "
            "meanwhile)"
        )

    def _note_sized_batch(self, engine: BatchEngine) -> None:
        """``config.json``'s ``max_batch`` is what the loaded engine admits at once: a memory
        budget may hold the hot buffers of fewer jobs than asked; ``effective`` keeps the
        request beside it, as for the settings a CPU run turns off."""
        asked, allowed = self.config.max_batch, engine.config.max_batch
        doc = getattr(self, "_config_doc", None)
        if doc is None or allowed >= asked:
            return
        budget = self.config.memory_budget_gb
        why = (
            f"memory_budget_gb {budget:g} holds the hot buffers of {allowed} job(s) at once"
            if budget is not None
            else f"the engine admits {allowed} job(s) at once"
        )
        doc["engine"]["max_batch"] = allowed
        doc.setdefault("effective", {})["max_batch"] = f"requested {asked}; {why}"

    def _report_startup(self, load_started: float, engine: BatchEngine) -> None:
        """The start-up steps (:class:`engine.events.StartupTimes`) to the reporter: the
        CLI's, then the engine's load steps where it recorded them (one process); the
        JSON progress writes them as a ``startup_times`` object, the displays ignore them.
        """
        now = time.monotonic()
        marks = self.startup_marks | {"load_started": load_started}
        marks |= getattr(engine, "load_marks", None) or {"engine": now}
        self.reporter.on_event(StartupTimes(now, marks))

    def _jobs(self, engine: BatchEngine, pending: list[PlannedJob]) -> Iterator[Job | None]:
        """Jobs for ``engine.run``, built one at a time; stops feeding after Ctrl-C.

        Under ``context_policy: chunk`` a long document's job is its map jobs; the jobs
        of a finished level (:class:`hisparse_cli.chunking.ChunkScheduler`) go before the
        next job of the list, and after the list ``None`` ("none ready yet") is given
        while map jobs still run."""
        for planned in pending:
            yield from self.chunker.take_ready()
            if self._cancelled():
                return
            yield from self._make_jobs(engine, planned)
        while self.chunker.waiting():
            if self._cancelled():
                return
            drawn = False
            for job in self.chunker.take_ready():
                drawn = True
                yield job
            if not drawn:
                yield None

    def _cancelled(self) -> bool:
        """Whether Ctrl-C (or SIGTERM) stopped the run's feeding."""
        return self.cancel is not None and bool(self.cancel.count)

    def _make_jobs(self, engine: BatchEngine, planned: PlannedJob) -> Iterable[Job]:
        """The job of ``planned`` (none when it failed to build; its map jobs under
        ``chunk`` when its document does not fit, built as they are drawn)."""
        spec = planned.spec
        try:
            documents, document = self._document_of(planned)
            if documents is not None:
                planned = planned.with_documents(documents)
                self.records[spec.id] = planned.base_record(self.model_name)
                if self.config.context_policy == "chunk":
                    chunks = self._chunks(engine, spec, document)
                    if len(chunks) > 1:
                        return self._map_jobs(spec, planned.key, chunks)
            prompt_ids = self._prompt_ids(engine, spec, document)
            self.prompt_tokens[spec.id] = len(prompt_ids)
        except PromptTooLong as exc:
            self.final[spec.id] = FINAL_PROMPT  # the same key fails the same way again
            self._handle(JobFailed(self.clock(), spec.id, f"{job_where(spec)}: {exc}"))
            return []
        except Exception as exc:  # noqa: BLE001 - one bad job must not stop the batch
            why = f"{job_where(spec)}: cannot prepare the prompt: {exc}"
            self._handle(JobFailed(self.clock(), spec.id, why))
            return []
        meta = {"key": planned.key, "output": spec.output}
        source = str(spec.inputs[0]) if spec.inputs else spec.origin
        return [Job(spec.id, prompt_ids, spec.sampling, source, meta, json_keys(spec))]

    def _document_of(self, planned: PlannedJob) -> tuple[list | None, str]:
        """:func:`job_document` of a planned job."""
        return job_document(planned.spec, self.request)

    def _prompt_messages(self, spec: Any) -> Callable[[str], list[dict]]:
        """:func:`job_messages`."""
        return job_messages(spec)

    # ----- context_policy chunk (hisparse_cli.chunking) ------------------------------
    def _chunks(self, engine: BatchEngine, spec: Any, document: str) -> Sequence[str]:
        """``document`` as chunks whose prompts fit (one when it fits whole; a huge one's
        texts are decoded as they are read: :func:`engine.text.context.chunk_document`)."""
        return chunk_document(
            engine.tokenizer,
            self._prompt_messages(spec),
            document,
            engine.prompt_limit(),
            spec.sampling.max_tokens,
        )

    def _map_jobs(self, spec: Any, key: str, chunks: Sequence[str]) -> Iterator[Job]:
        """The next level's map jobs of ``spec``'s job, noted in its results line's
        ``chunked`` field; registered now, each built (its chunk's text read, its prompt
        tokenised) only when the engine draws it (:meth:`_build_maps`)."""
        map_ids = self.chunker.maps(spec.id, len(chunks))
        self.tracker.add_parts(spec.id, map_ids)  # shown queued at once (not counted as jobs)
        self.records[spec.id]["chunked"] = self.chunker.jobs[spec.id].summary()
        if len(self.chunker.jobs[spec.id].chunks) == 1:
            self.reporter.note(
                f"{spec.id}: document over the context limit: the task runs on "
                f"{len(chunks)} overlapping chunks, then on their results (context policy chunk)"
            )
        return self._build_maps(spec, key, map_ids, chunks)

    def _build_maps(
        self, spec: Any, key: str, map_ids: list[str], chunks: Sequence[str]
    ) -> Iterator[Job]:
        """The map jobs ``map_ids`` on ``chunks``, one at a time as they are drawn, so
        that those of a huge document (tens of thousands, each with its chunk's prompt
        ids) are never all in memory. None is built after Ctrl-C or once the job was given
        up (a map job failed); one whose prompt cannot be built fails the job. The rows of
        those never built leave the progress table."""
        assert self.engine is not None
        encode, messages = self.engine.tokenizer.encode_chat, self._prompt_messages(spec)
        meta = {"key": key, "output": spec.output, "chunk_of": spec.id}
        source = str(spec.inputs[0])
        for i, map_id in enumerate(map_ids):
            if self._cancelled() or self.chunker.jobs[spec.id].done:
                break
            try:
                ids = tuple(encode(messages(chunks[i])))
            except Exception as exc:  # noqa: BLE001 - one bad job must not stop the batch
                self._map_failed(map_id, f"cannot prepare its prompt: {exc}")
                break
            yield Job(map_id, ids, spec.sampling, source, dict(meta), json_keys(spec))
        else:
            return
        for never in map_ids[i:]:
            self.tracker.forget(never)

    def _next_level(self, job_id: str, document: str) -> Iterable[Job]:
        """After a level of ``job_id``'s map jobs: the reduce job over their joined
        results (``document``) under the job's id, or the next level's map jobs when it
        is still too long. A failure to build them fails the job."""
        assert self.engine is not None
        spec, key = self.specs[job_id], self.records[job_id]["key"]
        try:
            chunks = self._chunks(self.engine, spec, document)
            if len(chunks) > 1:
                return self._map_jobs(spec, key, chunks)
            ids = tuple(self.engine.tokenizer.encode_chat(self._prompt_messages(spec)(document)))
        except Exception as exc:  # noqa: BLE001 - one bad job must not stop the batch
            self.chunker.close(job_id)
            self._handle(JobFailed(self.clock(), job_id, f"chunk policy: reduce step: {exc}"))
            return []
        self.chunker.close(job_id)
        self.prompt_tokens[job_id] = len(ids)
        meta = {"key": key, "output": spec.output}
        return [Job(job_id, ids, spec.sampling, str(spec.inputs[0]), meta, json_keys(spec))]

    def _handle_map(self, event: Event, map_id: str) -> None:
        """An event of a map job: shown, its end as a :class:`ChunkPartFinished` (its row
        leaves the table then); its text goes to :attr:`chunker`; its failure fails its
        job; its cancellation ends the job as ``cancelled``
        (:meth:`_record_cancelled_chunks`)."""
        unadmitted = isinstance(event, JobFailed) and self._unadmitted_after_cancel(map_id)
        self.tracker.update(event)
        if isinstance(event, JobFinished | JobFailed):
            self.reporter.on_event(self._part_finished(event, map_id, unadmitted))
        else:
            self.reporter.on_event(event)
        if isinstance(event, JobAdmitted):
            started = self.chunker.admitted(map_id, event.t)
            if started is not None and started in self.records:  # the job starts with its maps
                self.records[started]["started_at"] = utc_now()
        elif isinstance(event, JobFinished):
            r = event.result
            self._retire_map(map_id, r)
            if r.finish_reason in SUCCESS_REASONS and not r.error:
                self.chunker.finished(map_id, r.text)
            else:
                self._map_failed(map_id, r.error or r.finish_reason)
        elif isinstance(event, JobFailed):
            self._retire_map(map_id)
            self._map_failed(map_id, event.error)

    def _part_finished(
        self, event: JobFinished | JobFailed, map_id: str, unadmitted: bool
    ) -> ChunkPartFinished:
        """The displays' event for a map job's end (``unadmitted``: it failed as never
        admitted after Ctrl-C: cancelled)."""
        job_id, level, index = self.chunker.part(map_id)
        if isinstance(event, JobFinished):
            r = event.result
            return ChunkPartFinished(
                event.t, job_id, map_id, level, index, r.prompt_tokens, len(r.token_ids),
                r.finish_reason, r.error,
            )  # fmt: skip
        row = self.tracker.state.jobs.get(map_id)
        tokens = (row.prompt_tokens, row.generated) if row is not None else (0, 0)
        reason = "cancelled" if unadmitted else "error"
        return ChunkPartFinished(
            event.t, job_id, map_id, level, index, *tokens, reason, event.error
        )

    def _retire_map(self, map_id: str, result: JobResult | None = None) -> None:
        """An ended map job's row leaves the table; its tokens (its prompt's only if it ran:
        :func:`~hisparse_cli.progress.part_ran`) (and, for one that finished,
        its ``result``'s prefill and decode rates, hot-buffer traffic and audit) count for
        its job's results line (:meth:`ChunkScheduler.count`), its progress row and the run
        (:meth:`ProgressTracker.retire_part`)."""
        row = self.tracker.retire_part(map_id)
        if row is None:
            return
        prompt_tokens = part_prompt_tokens(row)  # one that never ran (Ctrl-C): none
        if result is None:
            self.chunker.count(map_id, prompt_tokens, row.generated)
            return
        rates = (result.prefill_tok_s, result.decode_tok_s)
        self.chunker.count(map_id, prompt_tokens, row.generated, rates, result.cache, result.audit)

    def _map_failed(self, map_id: str, why: str) -> None:
        job_id = self.chunker.abandon(map_id)
        if job_id is None:
            return
        if why.startswith("cancelled") or (self.cancel is not None and self.cancel.count):
            self.tracker.set_phase(job_id, "cancelled")  # its line: _record_cancelled_chunks
            return
        self._handle(JobFailed(self.clock(), job_id, f"chunk {map_id} failed: {why}"))

    def _record_cancelled_chunks(self) -> None:
        """After a cancel, when the engine has ended: a ``cancelled`` line for each chunked
        job that started (a map job was admitted) but got no line, as for any job that was
        running; its tokens are those of the map jobs that ran. One whose map jobs were
        handed to the engine but never admitted is counted as cancelled too, so it gets its
        line as well (:meth:`_write_cancelled`); one whose map jobs were never handed over
        was not run (no line)."""
        rows = self.tracker.state.jobs
        handed = [  # map jobs queued, none admitted: _map_failed showed the job cancelled
            s
            for s in self.chunker.jobs.values()
            if not (s.started or s.recorded) and s.job_id in rows
            and rows[s.job_id].phase == "cancelled"
        ]
        for state in [*self.chunker.cancelled_jobs(), *handed]:
            base = self.records.get(state.job_id)
            if base is None:
                continue
            self.tracker.set_phase(state.job_id, "cancelled")
            why = f"cancelled at chunk level {state.level} (map jobs); no reduce step ran"
            if not state.started:
                why = "cancelled before any of its map jobs was admitted"
            elif state.job_id in self.prompt_tokens:  # its reduce job was built, not admitted
                why = "cancelled before its reduce step ran"
            record = failure_record({**base, "prompt_tokens": None, "final": None}, why)
            record = state.attribute(
                {**record, "finish_reason": "cancelled"}, self.request.audit_limits
            )
            state.recorded = True
            self._flag_earlier_output(record)
            self._append(record)

    def _prompt_ids(self, engine: BatchEngine, spec: Any, document: str) -> tuple[int, ...]:
        """The chat prompt under the context policy (:func:`engine.text.context.fit_prompt`):
        with ``truncate`` the cut is reported and recorded as the job's ``truncated`` field.

        Raises
        ------
        PromptTooLong
            The prompt cannot fit the context limit (found without tokenising it).
        """

        messages = self._prompt_messages(spec)
        limit, max_tokens = engine.prompt_limit(), spec.sampling.max_tokens
        ids, cut = fit_prompt(
            engine.tokenizer, messages, document, limit, max_tokens, engine.config
        )
        if cut is not None:
            self.records[spec.id]["truncated"] = cut.to_dict()
            by = (
                f"by {cut.dropped_tokens} tokens"
                if cut.dropped_tokens is not None
                else f"to {cut.kept_tokens} tokens (too long to count whole)"
            )
            self.reporter.note(
                f"{spec.id}: document cut {by} ({KEPT_WORDS[cut.keep]}) to fit the "
                f"{limit - max_tokens} prompt tokens the context leaves beside max_tokens "
                f"{max_tokens}: the prompt is now {len(ids)} tokens",
                "warning",
            )
        return tuple(ids)

    def _handle(self, event: Event) -> None:
        """:meth:`_fold` ``event``; when its job's results line cannot be written
        (:class:`WriteFailed`: a full disk), the job is shown and counted as failed with
        that error, never ok, and the error is raised again: the run stops."""
        try:
            self._fold(event)
        except WriteFailed as exc:
            job_id = event.result.job_id if isinstance(event, JobFinished) else None
            job_id = job_id or getattr(event, "job_id", None)
            if job_id in self.records:  # a job asked for (not a map job): failed, not ok
                failed = JobFailed(t=event.t, job_id=job_id, error=self._stop_message(exc))
                self.tracker.update(failed)
                self.reporter.on_event(failed)
                exc.reported = True
            raise

    def _stopped_writing(self, exc: WriteFailed) -> None:
        """The run stops: a file could not be written (``exc``); one error line, unless
        the failed job's line said it already (:meth:`_handle`)."""
        self.write_failed = True
        if not exc.reported:
            self.reporter.note(self._stop_message(exc), "error")

    @staticmethod
    def _stop_message(exc: WriteFailed) -> str:
        """``the run stopped: cannot write PATH (reason)``, with the job's text file that
        was removed (``exc.removed``: :meth:`_write_result`) and, for a full disk, what
        to do (:func:`~hisparse_cli.results.write_problem`)."""
        removed = exc.removed
        also = (
            f"; {escaped(str(removed))}, written just before, was removed: no {RESULTS_FILE} "
            "line records it"
            if removed is not None
            else ""
        )
        return f"the run stopped: {write_problem(Path(exc.filename), exc, also)}"

    def _fold(self, event: Event) -> None:
        """Fold ``event`` into the state, write results, and show it.

        After Ctrl-C, a job handed to the engine but never admitted (e.g. one whose prompt
        was being prepared when the signal came) is shown and counted as cancelled, so it
        gets a ``cancelled`` line like a running job (the next run redoes it).
        """
        job_id = (
            event.result.job_id
            if isinstance(event, JobFinished)
            else getattr(event, "job_id", None)
        )
        if job_id is not None and self.chunker.is_map(job_id):
            self._handle_map(event, job_id)
            return
        if isinstance(event, JobFailed) and self._unadmitted_after_cancel(event.job_id):
            self.tracker.set_phase(event.job_id, "cancelled")
            self._write_cancelled(event.job_id, event.error)
            self.reporter.on_event(event)
            return
        if isinstance(event, JobFinished) and job_id in self.chunker.jobs:
            event = self._whole_job_figures(event)
        self.tracker.update(event)
        if isinstance(event, JobAdmitted) and event.job_id in self.records:
            self.reduce_admitted[event.job_id] = event.t
            if event.job_id not in self.chunker.jobs:  # a chunked job started with its maps
                self.records[event.job_id]["started_at"] = utc_now()
        elif isinstance(event, JobFinished):
            self._write_result(event.result)
        elif isinstance(event, JobFailed):
            self._write_failure(event.job_id, event.error)
        elif isinstance(event, WorkerDied):
            self.reporter.note(event.error, "error")
        self.reporter.on_event(event)

    def _whole_job_figures(self, event: JobFinished) -> JobFinished:
        """A chunked job's reduce step finished: its time to first token counted from the
        job's start (its first map job's admission) to the reduce step's first token, not
        from the reduce step's own admission — the wait for the answer — and its prefill
        and decode rates, hot-buffer traffic and audit over the whole document
        (:meth:`ChunkedJob.whole_rates`, :meth:`ChunkedJob.whole_cache`,
        :meth:`ChunkedJob.whole_audit`), as the results line, the done line and the JSON
        ``job_finished`` report them (the reduce step's own figures are kept in
        ``chunked``). A fresh user saw the reduce step's
        prefill rate (178 tok/s over its 209 tokens) beside the document's 12,741 tokens,
        which took 264 s."""
        result = event.result
        state = self.chunker.jobs[result.job_id]
        prefill, decode = state.whole_rates(
            result.prompt_tokens, result.prefill_tok_s, len(result.token_ids), result.decode_tok_s
        )
        changes: dict[str, Any] = {"prefill_tok_s": prefill, "decode_tok_s": decode}
        changes["cache"] = state.whole_cache(result.cache)
        changes["audit"] = state.whole_audit(result.audit)
        admitted = self.reduce_admitted.get(result.job_id)
        if state.t_start is not None and admitted is not None:
            state.reduce_ttft_s = result.ttft_s
            changes["ttft_s"] = admitted + result.ttft_s - state.t_start
        return dataclasses.replace(event, result=dataclasses.replace(result, **changes))

    def _write_result(self, result: JobResult) -> None:
        base = self.records.get(result.job_id)
        if base is None:
            return
        record = result_record(base, result, self.request.audit_limits)
        if result.job_id in self.chunker.jobs:  # the whole document's tokens, maps included
            self.chunker.jobs[result.job_id].recorded = True
            record = self.chunker.jobs[result.job_id].attribute(record, self.request.audit_limits)
        audit = record.get("audit")
        if audit and audit["flagged"]:
            self.reporter.note(
                f"{result.job_id}: audit flagged over {audit['steps']} step(s): "
                f"{audit['flag_reason']}; the sparse answer may differ from dense attention's "
                "(raise --top-k-tokens, or --attention dense)",
                "warning",
            )
        if result.job_id in self.extract_fields:  # --task extract: the reply as data
            data, error = parse_extracted(result.text, self.extract_fields[result.job_id])
            if error and result.finish_reason == "length" and "{" in result.text:
                error = (  # an object was started: it was cut off, not malformed
                    f"{error}; the reply stopped at max_new_tokens inside a JSON object: "
                    "raise --max-new-tokens"
                )
            if result.finish_reason == "cancelled":
                error = None  # a cut-off reply is expected to be incomplete: no noise
            record["data"], record["data_error"] = data, error
            if error and record["ok"]:
                self.reporter.note(f"{result.job_id}: no data extracted: {error}", "warning")
        target = self.output_dir / base["output"]
        if record["ok"] and target.resolve() in self.input_paths:  # never write over an input
            error = (
                f"output {escaped(str(target))} is an input of the run; its text was not written"
            )
            record = {**record, "ok": False, "finish_reason": "error", "error": error}
        elif record["ok"]:  # the text file without the reply's leading blank lines/spaces;
            write_text_atomic(target, result.text.lstrip())  # results.jsonl keeps it raw
            if not result.text.strip():  # ok (it stopped as asked), but nothing to read
                self.reporter.note(
                    f"{result.job_id}: the reply is empty ({len(result.token_ids)} token(s) "
                    f"generated, finish_reason {result.finish_reason}): {escaped(str(target))} is "
                    "empty",
                    "warning",
                )
        else:
            self._flag_earlier_output(record)
        try:
            self._append(record)
        except WriteFailed as exc:
            if record["ok"]:  # its text file, that no line records: the next run redoes it
                with contextlib.suppress(OSError):
                    target.unlink()
                    exc.removed = target
            raise

    def _save_config(self) -> None:
        """Write ``config.json`` once, when this run first runs or records a job."""
        if not getattr(self, "_config_saved", True):
            save_config(self.output_dir, self._config_doc)
            self._config_saved = True

    def _append(self, record: dict[str, Any]) -> None:
        """A ``results.jsonl`` line, with ``config.json`` written first."""
        self._save_config()
        self.log.append(record)

    def _write_failure(self, job_id: str, error: str) -> None:
        """Record a failed job; ``prompt_tokens`` is ``None`` if its prompt was never built."""
        base = self.records.get(job_id)
        if base is not None:
            row = self.tracker.state.jobs.get(job_id)
            tokens = self.prompt_tokens.get(job_id) or (row.prompt_tokens if row else 0)
            final = self.final.get(job_id) or self._too_long(job_id, tokens)
            record = failure_record(
                {**base, "prompt_tokens": tokens or None, "final": final}, error
            )
            if job_id in self.chunker.jobs:  # the map jobs that ran before it failed
                self.chunker.jobs[job_id].recorded = True
                record = self.chunker.jobs[job_id].attribute(record, self.request.audit_limits)
            self._flag_earlier_output(record)
            self._append(record)

    def _write_cancelled(self, job_id: str, why: str) -> None:
        """A ``cancelled`` line for a job the cancel stopped before admission: the summary
        counts it as cancelled, so ``results.jsonl`` says so too (never final: rerun)."""
        base = self.records.get(job_id)
        if base is None or job_id in self.chunker.jobs:  # chunked: _record_cancelled_chunks
            return
        tokens = self.prompt_tokens.get(job_id)
        record = failure_record({**base, "prompt_tokens": tokens, "final": None}, why)
        record["finish_reason"] = "cancelled"
        self._flag_earlier_output(record)
        self._append(record)

    def _too_long(self, job_id: str, tokens: int) -> str | None:
        """:data:`FINAL_PROMPT` when the job's tokenised prompt + ``max_tokens`` exceeds the
        engine's context limit (the engine refused it for its length: the same key, which
        covers the model, the context settings and ``max_tokens``, fails again)."""
        spec = self.specs.get(job_id)
        if not tokens or self.prompt_limit is None or spec is None:
            return None
        max_tokens = spec.sampling.max_tokens
        return FINAL_PROMPT if tokens + max_tokens > self.prompt_limit else None

    def _flag_earlier_output(self, record: dict[str, Any]) -> None:
        """A job that ended without text leaves an earlier run's ``<output>`` as it was (its
        text is on that run's results line): say so in ``record`` (``earlier_output``)
        and in a warning, so the file is not taken for this run's result."""
        path = self.output_dir / record["output"]
        ours = path.resolve() in self.own_outputs
        if path.is_file() and ours and path.resolve() not in self.input_paths:
            record["earlier_output"] = True
            self.reporter.note(
                f"{record['id']}: {escaped(str(path))} is an earlier run's output, not this run's "
                f"({record['finish_reason']})",
                "warning",
            )

    def _unadmitted_after_cancel(self, job_id: str) -> bool:
        row = self.tracker.state.jobs.get(job_id)
        cancelling = self.cancel is not None and self.cancel.count > 0
        return cancelling and row is not None and row.phase in ("queued", "map")

    def _announce_cancel(self) -> None:
        if self.cancel is not None and self.cancel.count and not self._announced:
            self._announced = True
            self.tracker.state.cancelling = True
            name = "SIGTERM" if self.cancel.signals[0] == signal.SIGTERM else "Ctrl-C"
            self.reporter.note(
                f"{name}: cancelling; running jobs finish as 'cancelled' "
                "(Ctrl-C or SIGTERM again to stop now)",
                "warning",
            )


def _remove_folders(output_dir: Path, parents: Sequence[Path]) -> bool:
    """Remove ``output_dir`` if it holds nothing but the lock file (or nothing), then
    each of ``parents`` (innermost first) while empty; return whether ``output_dir`` was
    removed."""
    try:
        if os.listdir(output_dir) not in ([LOCK_FILE], []):
            return False
        (output_dir / LOCK_FILE).unlink(missing_ok=True)
        output_dir.rmdir()
    except OSError:
        return False
    for folder in parents:
        try:
            folder.rmdir()
        except OSError:
            break
    return True


def missing_folders(path: Path) -> list[Path]:
    """``path`` and the folders above it that do not exist yet (innermost first): what
    ``path.mkdir(parents=True)`` would create."""
    missing = []
    while not (path.exists() or path.is_symlink()) and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


SHOWN_CHANGES = 3
"""Changed settings a replaced-answer warning names before it says how many more."""


def earlier_engine_settings(output_dir: Path) -> dict[str, Any] | None:
    """The engine settings in ``output_dir``'s ``config.json`` (the last run that ran or
    recorded a job), or ``None`` where there is none to read."""
    try:
        document = json.loads((output_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    engine = document.get("engine") if isinstance(document, dict) else None
    return engine if isinstance(engine, dict) else None


def earlier_answer_difference(
    line: dict[str, Any], record: dict[str, Any], earlier_engine: dict[str, Any] | None
) -> str:
    """What made a job's earlier answer (its results ``line``) differ from this run's
    (``record``: the job's line so far), in words after "made with": the settings that
    changed with their old and new values (``top_k 2048 -> 1024``; the first
    :data:`SHOWN_CHANGES`, then how many more) and the inputs whose content changed.

    The old settings are the line's ``settings``; a line written before lines kept them
    has only their hash, and then ``config.json``'s engine settings (``earlier_engine``)
    are taken where, with this job's other settings, they give that hash (that run
    changed the engine settings only); else the words say the line does not record them.
    """
    found = []
    old_hash, new_settings = line.get("settings_hash"), record.get("settings") or {}
    if old_hash != record.get("settings_hash"):
        old = line.get("settings")
        if not (isinstance(old, dict) and record_hash(old) == old_hash):
            old = None
            if earlier_engine is not None and new_settings:
                guess = {**new_settings, "engine": output_only(earlier_engine)}
                old = guess if record_hash(guess) == old_hash else None
        changes = setting_changes(old, new_settings) if old is not None else []
        if len(changes) > SHOWN_CHANGES:
            more = len(changes) - SHOWN_CHANGES
            changes = changes[:SHOWN_CHANGES]
            changes[-1] += f" and {more} more"
        found.append(
            f"other settings ({', '.join(changes)})"
            if changes
            else f"other settings (which: not recorded on its {RESULTS_FILE} line)"
        )
    old_inputs, old_hashes = line.get("input"), line.get("input_sha256")
    new_inputs, new_hashes = record.get("input"), record.get("input_sha256")
    if old_hashes != new_hashes:
        same_files = (  # the same files, one hash each: name those whose content changed
            isinstance(new_inputs, list)
            and old_inputs == new_inputs
            and isinstance(old_hashes, list)
            and isinstance(new_hashes, list)
            and len(old_hashes) == len(new_hashes) == len(new_inputs)
        )
        pairs = zip(new_inputs, old_hashes, new_hashes, strict=True) if same_files else ()
        edited = [_near(path) for path, a, b in pairs if a != b]
        found.append(
            f"an earlier version of {', '.join(edited)}" if edited else "other document content"
        )
    return " and ".join(found) or "other settings or document content"


def _near(path: str) -> str:
    """``path`` (a results line's absolute input) relative to the current folder where
    it lies below it, as messages show it (:func:`~hisparse_cli.textio.shown_path`)."""
    try:
        return shown_path(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return shown_path(path)


def json_keys(spec: Any) -> tuple[str, ...] | None:
    """The keys a job's reply is constrained to (``Job.json_keys``): the field names of
    ``--task extract --fields a,b`` (or a manifest list); ``None`` for every other job
    (schema text, no fields, other tasks: free text, validated afterwards if extract)."""
    task = spec.task
    if spec.messages is None and task.task == "extract" and isinstance(task.fields, tuple):
        return task.fields
    return None


def exit_code(summary: RunSummary) -> int:
    """130 if interrupted, 1 if any job failed, was cancelled or did not run, else 0."""
    if summary.interrupted:
        return EXIT_INTERRUPTED
    if summary.failed or summary.cancelled or summary.not_run:
        return EXIT_FAILED
    return EXIT_OK
