"""The one engine builder: a model path (or the embedded default) and a resolved
:class:`EngineConfig` become a placed model (:func:`place_model`) and an engine
(:func:`load_engine`). ``hisparse run``, the data-parallel workers, the pipeline stages, the
bench and the scripts all build through here."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.config import ConfigError, EngineConfig
from engine.serve.base import BatchEngine
from engine.serve.engine import Engine
from engine.text.context import context_limit_and_rope  # noqa: F401 - scripts import it here
from engine.weights.types import ModelWeights, describe_placement

if TYPE_CHECKING:
    from engine.model.llama import LlamaModel
    from engine.text.tokenizer import TextTokenizer
    from kernels.dispatch import Ops


def resolve_device(config: EngineConfig) -> torch.device:
    """The compute device; ``cuda`` without a GPU is a :class:`ConfigError`."""
    dev = torch.device(config.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={config.device!r} but CUDA is not available on this machine")
    return dev


def load_weights(
    model: str | None, tokenizer: str | None = None, marks: dict[str, float] | None = None
) -> tuple[ModelWeights, object, str]:
    """Read weights and tokenizer.

    Parameters
    ----------
    model : path to a ``.gguf`` file or a Hugging Face model folder; ``None`` for the
        embedded SmolLM2-135M-Instruct Q4_1, ``synthetic:NAME`` for random weights of a
        published shape.
    tokenizer : ``config.tokenizer``: ``None`` (the model's own), or for a
        synthetic model ``ids`` (no text: jobs as token ids; see :mod:`engine.weights.synthetic`).
    marks : where to stamp (``time.monotonic()``) the end of ``metadata``, ``tokenizer``
        and ``weights`` of a GGUF file (:class:`engine.events.StartupTimes`); other
        sources stamp ``weights`` only.

    Returns
    -------
    (weights, tokenizer, model_name)

    Raises
    ------
    FileNotFoundError
        Missing file, or the embedded model is not installed (message says how).
    ConfigError
        ``tokenizer`` given for a model that is not synthetic.
    """
    from engine.text.tokenizer import TextTokenizer

    marks = {} if marks is None else marks
    _check_tokenizer_choice(model, tokenizer)
    if model is None:
        from engine.weights.embedded import default_model_path

        model = str(default_model_path())
    if model.startswith("synthetic:"):
        from engine.weights.synthetic import load_synthetic

        loaded = load_synthetic(model.split(":", 1)[1], tokenizer=tokenizer)
        marks["weights"] = time.monotonic()
        return loaded
    path = Path(model)
    if path.is_dir():
        from engine.weights.hf import load_hf_folder

        tokenizer = folder_tokenizer(path)  # refused before any weight is read
        weights = load_hf_folder(path)
        marks["weights"] = time.monotonic()
        return weights, tokenizer, path.name
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    from engine.weights import gguf

    reader = gguf.open_reader(path)  # every tensor's description checked, no data read
    gguf.check_architecture(reader, path)  # an unsupported model named before its tokenizer
    marks["metadata"] = time.monotonic()
    tokenizer = _TOKENIZERS.get(_file_identity(path))  # built by load_tokenizer already
    if tokenizer is None:
        tokenizer = TextTokenizer.from_gguf(reader, reference="llama.cpp")  # before the weights
    marks["tokenizer"] = time.monotonic()
    weights = gguf.load_gguf(path, reader)
    marks["weights"] = time.monotonic()
    return weights, tokenizer, path.stem


def load_tokenizer(model: str | None, tokenizer: str | None = None) -> tuple[object, str]:
    """The tokenizer and model name of ``model`` (``model`` and ``tokenizer`` as
    :func:`load_weights` takes them) without reading the weights; what a multi-device
    parent process needs."""
    from engine.text.tokenizer import TextTokenizer

    _check_tokenizer_choice(model, tokenizer)
    if model is None:
        from engine.weights.embedded import default_model_path

        model = str(default_model_path())
    if model.startswith("synthetic:"):
        from engine.weights.synthetic import PREFIX, make_tokenizer, synthetic_shape

        cfg = synthetic_shape(model.split(":", 1)[1])
        return make_tokenizer(cfg.vocab_size, tokenizer), f"{PREFIX}{cfg.name}"
    path = Path(model)
    if path.is_dir():
        return folder_tokenizer(path), path.name
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    _check_gguf_architecture(path)
    key = _file_identity(path)
    if key not in _TOKENIZERS:
        _TOKENIZERS.clear()  # one model per process in practice: keep the last
        _TOKENIZERS[key] = TextTokenizer.from_gguf(path, reference="llama.cpp")
    return _TOKENIZERS[key], path.stem


_TOKENIZERS: dict[tuple, object] = {}
"""The tokenizer :func:`load_tokenizer` built from a GGUF file, by :func:`_file_identity`:
:func:`load_weights` of the same unchanged file takes it instead of building it again (the
CLI counts long documents' tokens before the model loads, so a run that does so builds it
once, not twice: 0.2 s for the embedded model, ``scripts/measure_tokenizer_build.py``)."""


def folder_tokenizer(path: Path) -> TextTokenizer:
    """The tokenizer of the Hugging Face model folder ``path``, checked against the model:
    every id it can give (added tokens included) must have a row in the embedding
    (``vocab_size`` of ``config.json``, which the weights' shapes are checked against). A
    tokenizer smaller than the embedding (rows padded to a round number) is fine.

    Raises
    ------
    HFModelError
        (a ``ValueError``) The tokenizer gives ids past the embedding: not this model's
        tokenizer (an id past the rows would index out of range).
    """
    from engine.text.tokenizer import TextTokenizer
    from engine.weights.hf import HFModelError, read_hf_config

    tokenizer = TextTokenizer.from_folder(path)
    rows = read_hf_config(path).vocab_size
    ids = tokenizer.backend.get_vocab(with_added_tokens=True).values()
    top = max(ids, default=-1)
    if top >= rows:
        raise HFModelError(
            f"{path}: the tokenizer's vocabulary (tokenizer.json: {len(ids):,} tokens, ids up "
            f"to {top:,}) is larger than the model's vocab_size {rows:,} (config.json, the "
            f"embedding's rows): ids from {rows:,} on have no embedding; the tokenizer is "
            "not this model's (use the tokenizer.json saved with its weights)"
        )
    return tokenizer


def _check_gguf_architecture(path: Path) -> None:
    """Raise ``ValueError`` naming the file when its ``general.architecture`` is not one
    the engine runs (from the header alone, no torch); a header that cannot be read is
    left to the tokenizer's reader, which names what is wrong with it."""
    from engine.model.registry import UnsupportedArchitecture, for_gguf
    from engine.weights.header import GGUFHeaderError, read_gguf_fields

    try:
        fields = read_gguf_fields(path, {"general.architecture"})
    except (GGUFHeaderError, OSError):
        return
    try:
        for_gguf(fields.get("general.architecture"))
    except UnsupportedArchitecture as exc:
        raise ValueError(f"{path}: {exc}") from None


def _file_identity(path: Path) -> tuple:
    """(resolved path, size, mtime in ns) of a file: a rewritten file is another key."""
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns)


def _check_tokenizer_choice(model: str | None, tokenizer: str | None) -> None:
    if tokenizer is not None and not (model or "").startswith("synthetic:"):
        raise ConfigError(
            f"tokenizer={tokenizer!r} is for synthetic models only; {model or 'the embedded model'} "
            "has its own"
        )


_MALLOC_SET = [False]


def keep_freed_heap() -> bool:
    """Make glibc keep freed memory for reuse instead of handing it back to the kernel
    (once per process; a no-op without glibc). Returns whether the settings were applied.

    A CPU decode step allocates and frees the same few-MiB tensors in every layer (the
    selected records, the Quest bound terms). With glibc's defaults each such block is
    ``mmap``ed, page-faulted in and ``munmap``ed again, or trimmed off the heap top, every
    time: measured here, the page faults were about half the attention ops' CPU time
    (docs/performance.md, "CPU decode path"). ``M_MMAP_THRESHOLD`` = 32 MiB (glibc's
    largest) serves blocks below it from the heap, ``M_TRIM_THRESHOLD`` = 1 GiB keeps the
    freed heap; the environment variables ``MALLOC_MMAP_THRESHOLD_`` /
    ``MALLOC_TRIM_THRESHOLD_`` do the same from outside (mallopt(3)). The process keeps
    its peak heap, as jemalloc or tcmalloc (PyTorch's recommended CPU allocators) do.
    """
    if _MALLOC_SET[0]:
        return True
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt)
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    ok = mallopt(m_mmap_threshold, 32 << 20) == 1 and mallopt(m_trim_threshold, 1 << 30) == 1
    _MALLOC_SET[0] = ok
    return ok


def pick_weight_format(
    config: EngineConfig, device: torch.device, formats: dict[str, str] | None = None
) -> str:
    """``auto``: :func:`engine.weights.placement.auto_weight_format` for ``device`` and
    whether ``formats`` (``ModelWeights.formats``) stores every linear 4-bit (GGUF
    Q4_0/Q4_1/Q4_K, AWQ/GPTQ/int4-g*): int4 on CUDA; on a CPU int4 only with bf16
    instructions (:func:`engine.weights.quant.cpu_fast_bf16`) and 4-bit linears, float
    elsewhere. The capacity planner applies the same rule to a model's shape
    (:func:`engine.capacity.planner.weight_format`)."""
    from engine.weights import quant
    from engine.weights.placement import auto_weight_format, linears_stored_int4

    if config.weight_format != "auto":
        return config.weight_format
    stored = linears_stored_int4(formats or {})
    return auto_weight_format(device.type, stored, lambda: quant.cpu_fast_bf16())


def cpu_format_note(config: EngineConfig, device: torch.device, fmt: str) -> str:
    """What the model line adds on a CPU about the linears' arithmetic: the int4 kernel's
    activation dtype, and why ``auto`` chose the format ("" on other devices)."""
    from engine.weights.quant import cpu_fast_bf16, cpu_int4_dtype

    if device.type != "cpu":
        return ""
    why = ""
    if config.weight_format == "auto":
        why = "; auto: " + ("CPU has AVX512-BF16/AMX" if cpu_fast_bf16() else "no AVX512-BF16/AMX")
        if cpu_fast_bf16() and fmt == "float":
            why += ", linears not stored 4-bit"
    if fmt == "int4":
        act = str(cpu_int4_dtype(getattr(torch, config.dtype))).removeprefix("torch.")
        return f"; int4 kernel with {act} activations{why}"
    return why


@dataclass(frozen=True)
class PlacedModel:
    """A model read, placed on its device and ready to build an engine around.

    Attributes
    ----------
    model : the placed :class:`engine.model.llama.LlamaModel` (all layers, or a stage's)
    tokenizer : the model's tokenizer (``None`` for a synthetic model run on token ids)
    name : model name for results and reports (file stem, folder name or ``synthetic:NAME``)
    context_limit : tokens (prompt + generated) per request under the context policy
    weight_format : ``int4`` or ``float``, as :func:`pick_weight_format` chose
    ops : the kernel set of the device (:func:`kernels.dispatch.get_ops`)
    weights_info : what each source tensor type became (the run's model line)
    """

    model: LlamaModel
    tokenizer: object
    name: str
    context_limit: int
    weight_format: str
    ops: Ops
    weights_info: str = ""


def place_model(
    config: EngineConfig,
    model: str | None = None,
    *,
    stage: tuple[int, int] | None = None,
    rope_config: EngineConfig | None = None,
    weights: tuple[ModelWeights, object, str] | None = None,
    marks: dict[str, float] | None = None,
) -> PlacedModel:
    """The one load sequence every engine is built from: validate -> device -> threads ->
    weights -> context limit and RoPE -> weight format -> placed model -> kernel set.

    Parameters
    ----------
    config : the resolved settings (validated here)
    model : as :func:`load_weights` takes it
    stage : ``(rank, world_size)`` of a pipeline: place only that stage's layers
        (:func:`engine.capacity.planner.stage_layers`)
    rope_config : settings whose context policy sizes the RoPE table instead of ``config``'s
        (the bench extends RoPE to its longest context)
    weights : already read ``(weights, tokenizer, name)``, skipping :func:`load_weights`
    marks : where to stamp the end of each step (:func:`load_weights`' ``metadata``,
        ``tokenizer``, ``weights``, then ``model`` and ``kernels``; ``time.monotonic()``)

    Raises
    ------
    ConfigError
        Bad settings, CUDA missing, or a pipeline of fewer than 2 or more stages than layers.
    FileNotFoundError, ValueError
        Missing or unsupported model files.
    """
    from engine.capacity.planner import stage_layers
    from engine.model.registry import build_model
    from engine.weights.quant import DenseLinear, Int4Linear, cpu_int4_dtype, pick_cpu_lm_head
    from kernels.dispatch import get_ops

    config.validate()
    device = resolve_device(config)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    if device.type == "cpu":
        keep_freed_heap()
    marks = {} if marks is None else marks
    weights, tokenizer, name = weights or load_weights(model, config.tokenizer, marks)
    layers = None
    if stage is not None:
        rank, world_size = stage
        num_layers = weights.config.num_layers
        if not 2 <= world_size <= num_layers:
            raise ConfigError(
                f"pipeline of {world_size} stages: needs 2 to {num_layers} devices for this model"
            )
        layers = range(*stage_layers(num_layers, world_size)[rank])
    limit, rope = context_limit_and_rope(weights.config, rope_config or config)
    fmt = pick_weight_format(config, device, weights.formats)
    llm = build_model(
        weights, device, getattr(torch, config.dtype), fmt, rope, layers=layers,
        int4_triton_min_rows=config.int4_triton_min_rows,
    )
    int4_dtype = cpu_int4_dtype(getattr(torch, config.dtype))  # bf16 products on a fast CPU
    for layer in llm.layers:
        for lin in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down):
            if isinstance(lin, Int4Linear) and device.type == "cpu":
                lin.set_activation_dtype(int4_dtype)
    head_note = ""
    if (
        device.type == "cpu"
        and fmt == "int4"
        and int4_dtype == torch.bfloat16
        and isinstance(llm.lm_head, DenseLinear)
    ):  # products already bf16: the head in fp16 where that is faster (no measurable loss)
        llm.lm_head, head_note = pick_cpu_lm_head(llm.lm_head)
    marks["model"] = time.monotonic()
    ops = get_ops(device, config.use_triton, config.eviction)
    marks["kernels"] = time.monotonic()
    info = (
        describe_placement(weights.formats, fmt, config.dtype)
        + cpu_format_note(config, device, fmt)
        + head_note
    )
    return PlacedModel(llm, tokenizer, name, limit, fmt, ops, info)


def load_engine(
    config: EngineConfig,
    model: str | None = None,
    tracer=None,
    *,
    job_tokens: int | None = None,
    pool_shares: int = 1,
) -> BatchEngine:
    """Load a model and build the engine (the one builder of run, workers and scripts).

    When ``config.devices`` names more than one device (``--devices cuda:0,cuda:1`` or a
    preset's ``hardware.devices``) this starts one worker per device and returns an
    :class:`engine.serve.workers.ParallelEngine` (same :class:`BatchEngine` surface)
    running ``config.parallel`` (``data``, the default, or ``pipeline``).

    ``tracer`` is a selection recorder (see :class:`engine.measure.trace.TraceWriter`);
    without one, ``config.trace_path`` (``hisparse run --trace FILE``) makes a
    :class:`~engine.measure.trace.TraceWriter` there, closed when ``Engine.run`` ends.

    With ``config.memory_budget_gb`` (``--memory-budget``) the KV cache is sized by
    :func:`engine.capacity.budget.budget_cache`: the device pool (all-resident) or
    ``max_batch`` (hierarchical) is what the budget leaves after weights, activations and
    reserve; the split is the engine's ``budget_sizing``. With several devices the budget
    caps each one: a data worker sizes its cache this way, a pipeline stage for its own
    layers (:func:`engine.serve.pipeline.stage_budget_cache`).

    ``job_tokens``, the most tokens (prompt + ``max_tokens``) a job of the run holds when
    the caller knows it before the load, is what that budget sizes each request for (page
    tables, prefill scratch), as ``hisparse plan --context`` counts a job; without it, the
    context limit. The engine refuses a job over it (:func:`sized_tokens`).

    ``pool_shares``: a data-parallel worker's count of workers splitting the user's
    ``host_pool_gb`` (its ``config`` holds its share), so a refusal names the total.

    A one-process engine's ``load_marks`` holds when each load step ended
    (:class:`engine.events.StartupTimes`: ``engine_imported``, then :func:`place_model`'s,
    then ``engine``).

    Raises
    ------
    ConfigError, FileNotFoundError, ValueError (unsupported model files)
    """
    marks = {"engine_imported": time.monotonic()}
    config.validate()
    devices = config.devices
    if devices:
        from engine.serve.workers import ParallelEngine, parse_devices

        devices = parse_devices(devices)
        if len(devices) > 1:
            mode = config.parallel or "data"
            return ParallelEngine(config, model, devices, mode, job_tokens=job_tokens)
        config = config.replace(device=devices[0])
    placed = place_model(config, model, marks=marks)
    if tracer is None and config.trace_path:
        from engine.measure.trace import TraceHeader, TraceWriter

        header = TraceHeader.for_engine(placed.name, placed.model.config, config)
        tracer = TraceWriter(config.trace_path, header)
    cache, sizing = None, None
    if config.memory_budget_gb is not None:  # pool / max_batch from the budget
        from engine.capacity.budget import budget_cache

        tokens = sized_tokens(placed.context_limit, job_tokens)
        config, cache, sizing = budget_cache(
            placed.model, config, tokens, pool_shares=pool_shares
        )
    engine = Engine.from_placed(
        placed, config, tracer=tracer, cache=cache, budget_sizing=sizing, pool_shares=pool_shares
    )
    engine.load_marks = marks | {"engine": time.monotonic()}
    return engine


def sized_tokens(context_limit: int, job_tokens: int | None) -> int:
    """Tokens per request a budget-sized cache is built for: ``job_tokens`` (the run's
    longest job, prompt + ``max_tokens``) within the context limit, else the limit."""
    return context_limit if job_tokens is None else max(1, min(job_tokens, context_limit))
