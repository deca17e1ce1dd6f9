"""Build an :class:`engine.serve.engine.Engine` from a model path (or the embedded default) and a
resolved :class:`EngineConfig`. This is the one entry point front ends use."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.config import ConfigError, EngineConfig, ModelConfig, RopeScaling
from engine.serve.engine import Engine
from engine.model.rope import Rope
from engine.weights.types import ModelWeights, describe_placement

if TYPE_CHECKING:
    from engine.serve.workers import ParallelEngine


def resolve_device(config: EngineConfig) -> torch.device:
    """The compute device; ``cuda`` without a GPU is a :class:`ConfigError`."""
    dev = torch.device(config.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={config.device!r} but CUDA is not available on this machine")
    return dev


def load_weights(model: str | None, tokenizer: str | None = None) -> tuple[ModelWeights, object, str]:
    """Read weights and tokenizer.

    Parameters
    ----------
    model : path to a ``.gguf`` file or a Hugging Face model folder; ``None`` for the
        embedded SmolLM2-135M-Instruct Q4_1, ``synthetic:NAME`` for random weights of a
        published shape.
    tokenizer : ``config.extra["tokenizer"]``: ``None`` (the model's own), or for a
        synthetic model ``ids`` (no text: jobs as token ids; see :mod:`engine.weights.synthetic`).

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

    _check_tokenizer_choice(model, tokenizer)
    if model is None:
        from engine.weights.embedded import default_model_path

        model = str(default_model_path())
    if model.startswith("synthetic:"):
        from engine.weights.synthetic import load_synthetic

        return load_synthetic(model.split(":", 1)[1], tokenizer=tokenizer)
    path = Path(model)
    if path.is_dir():
        from engine.weights.hf import load_hf_folder

        tokenizer = TextTokenizer.from_folder(path)  # refused before any weight is read
        return load_hf_folder(path), tokenizer, path.name
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    from engine.weights import gguf

    tokenizer = TextTokenizer.from_gguf(path, reference="llama.cpp")  # before the weights
    return gguf.load_gguf(path), tokenizer, path.stem


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
        return TextTokenizer.from_folder(path), path.name
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    return TextTokenizer.from_gguf(path, reference="llama.cpp"), path.stem


def _check_tokenizer_choice(model: str | None, tokenizer: str | None) -> None:
    if tokenizer is not None and not (model or "").startswith("synthetic:"):
        raise ConfigError(
            f"tokenizer={tokenizer!r} is for synthetic models only; {model or 'the embedded model'} "
            "has its own"
        )


def context_limit_and_rope(cfg: ModelConfig, config: EngineConfig) -> tuple[int, Rope]:
    """Tokens per request and the RoPE table under the context policy.

    ``refuse`` and ``truncate`` keep the trained context (``max_context`` may lower it);
    ``extend`` raises it to ``max_context`` (default 4x trained) with ``extend_method``
    scaling of factor ``max_context / trained`` (quality not guaranteed past training).

    Raises
    ------
    ConfigError
        ``max_context`` above the trained context without ``extend`` (it would be ignored).
    """
    trained = cfg.max_position
    scaling = cfg.rope_scaling
    limit = trained
    if config.context_policy == "extend":
        limit = config.max_context or 4 * trained
        factor = limit / trained
        if factor > 1 and scaling is None:
            scaling = RopeScaling(kind=config.extend_method, factor=factor, original_max_position=trained)
    elif config.max_context:
        if config.max_context > trained:
            raise ConfigError(
                f"max_context={config.max_context} is above the model's trained context of "
                f"{trained} tokens; only context_policy extend goes past it "
                f"(--context-policy extend), {config.context_policy!r} can only lower the limit"
            )
        limit = config.max_context
    return limit, Rope(cfg.head_dim, cfg.rope_theta, scaling, cfg.rope_freq_factors)


def pick_weight_format(config: EngineConfig, device: torch.device) -> str:
    """``auto``: int4 (torch's int4 kernel) on CUDA, float on CPU, where torch's CPU int4
    GEMM is slower than fp32 GEMM for these shapes (see docs/performance.md)."""
    if config.weight_format != "auto":
        return config.weight_format
    return "int4" if device.type == "cuda" else "float"


def load_engine(
    config: EngineConfig, model: str | None = None, tracer=None
) -> Engine | ParallelEngine:
    """Load a model and build the engine.

    When ``config.extra["devices"]`` names more than one device (``--devices cuda:0,cuda:1``
    or a preset's ``hardware.devices``) this starts one worker per device and returns an
    :class:`engine.serve.workers.ParallelEngine` (same surface) running ``config.extra["parallel"]``
    (``data``, the default, or ``pipeline``).

    ``tracer`` is a selection recorder (see :class:`engine.measure.trace.TraceWriter`); without
    one, ``config.extra["trace_path"]`` (``hisparse run --trace FILE``) makes a
    :class:`~engine.measure.trace.TraceWriter` there, closed when ``Engine.run`` ends.

    With ``config.memory_budget_gb`` (``--memory-budget``) the KV cache is sized by
    :func:`engine.capacity.budget.budget_cache`: the device pool (all-resident) or ``max_batch``
    (hierarchical) is what the budget leaves after weights, activations and reserve;
    the split is ``engine.budget_sizing``. With several devices the budget caps each
    one: a data worker sizes its cache this way, a pipeline stage for its own layers
    (:func:`engine.serve.pipeline.stage_budget_cache`).

    Raises
    ------
    ConfigError, FileNotFoundError, ValueError (unsupported model files)
    """
    from engine.model.registry import build_model
    from kernels.dispatch import get_ops

    config.validate()
    devices = config.extra.get("devices") or ()
    if devices:
        from engine.serve.workers import ParallelEngine, parse_devices

        devices = parse_devices(devices)
        if len(devices) > 1:
            return ParallelEngine(config, model, devices, config.extra.get("parallel") or "data")
        config = config.replace(device=devices[0])
    device = resolve_device(config)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    weights, tokenizer, name = load_weights(model, config.extra.get("tokenizer"))
    limit, rope = context_limit_and_rope(weights.config, config)
    dtype = getattr(torch, config.dtype)
    fmt = pick_weight_format(config, device)
    llm = build_model(weights, device, dtype, fmt, rope)
    ops = get_ops(device, config.use_triton)
    if tracer is None and config.extra.get("trace_path"):
        from engine.measure.trace import TraceHeader, TraceWriter

        header = TraceHeader.for_engine(name, weights.config, config)
        tracer = TraceWriter(config.extra["trace_path"], header)
    cache, sizing = None, None
    if config.memory_budget_gb is not None:  # pool / max_batch from the budget
        from engine.capacity.budget import budget_cache

        config, cache, sizing = budget_cache(llm, config, limit)
    engine = Engine(llm, tokenizer, config, ops, limit, tracer, cache=cache)
    engine.budget_sizing = sizing
    engine.model_name = name
    engine.weight_format = fmt
    engine.weights_info = describe_placement(weights.formats, fmt, config.dtype)
    return engine
