"""Checks made before the model loads, from the model's metadata and the documents' sizes.

* :func:`max_context_problem`: ``--max-context`` above the model's trained context under a
  policy other than ``extend`` (the engine would refuse it after reading the weights).
* :func:`oversized_documents`: documents whose size alone shows they are longer than the
  context under ``refuse``, so the user reads the choices before waiting for the load.

The trained context comes from the model's header (:func:`trained_context`: GGUF
key/value pairs or an HF ``config.json``), read in milliseconds; where it cannot be read
the checks stay silent and loading reports the real reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import ConfigError, EngineConfig
from engine.text.context import context_limit as engine_context_limit

BYTES_PER_TOKEN = 4.5
"""Bytes of text per token used to estimate a document's length before the tokenizer is
loaded: above what English prose and documentation take with the embedded model's
tokenizer (3.3-4.3 over the corpus), so the estimate stays below the real count."""


def trained_context(model: str | None) -> int | None:
    """Trained context of ``model`` (``None``: the embedded model; ``synthetic:NAME``; an
    HF folder; a GGUF file) without loading weights, or ``None`` if it cannot be read."""
    try:
        if model is not None and model.startswith("synthetic:"):
            from engine.weights.synthetic import synthetic_shape

            return synthetic_shape(model.split(":", 1)[1]).max_position
        if model is not None and Path(model).is_dir():
            from engine.weights.hf import read_hf_config

            return read_hf_config(model).max_position
        return _gguf_context(Path(model) if model is not None else _embedded_path())
    except (OSError, ValueError, KeyError, ConfigError):
        return None


def _embedded_path() -> Path:
    from engine.weights.embedded import default_model_path

    return default_model_path()


def _gguf_context(path: Path) -> int | None:
    """``<arch>.context_length`` (4096 when absent, as the loader reads it)."""
    from engine.weights.gguf import SUPPORTED_ARCHS
    from engine.weights.header import read_gguf_fields

    keys = {"general.architecture", *(f"{arch}.context_length" for arch in SUPPORTED_ARCHS)}
    fields = read_gguf_fields(path, keys)
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        return None  # the loader names the unsupported architecture
    return int(fields.get(f"{arch}.context_length", 4096))


def setting_source(
    name: str, preset: str, manifest_engine: Mapping[str, Any], flags: Mapping[str, Any]
) -> str:
    """Where engine setting ``name`` was given, in words (flag, manifest or preset)."""
    from hisparse_cli import settings

    if flags.get(name) is not None:
        return settings.engine_flag(name)
    if manifest_engine.get(name) is not None:
        return f"the manifest's defaults.engine.{name}"
    if name in settings.preset_overrides(preset):
        return f"preset {preset!r} (engine.{name})"
    return "the default"


def max_context_problem(
    config: EngineConfig,
    model: str | None,
    preset: str,
    manifest_engine: Mapping[str, Any],
    flags: Mapping[str, Any],
) -> str | None:
    """Why ``max_context`` cannot work with this model, or ``None``: only ``extend``
    goes past the trained context; ``refuse`` and ``truncate`` can only lower it."""
    if config.context_policy == "extend" or not config.max_context:
        return None
    trained = trained_context(model)
    if trained is None or config.max_context <= trained:
        return None
    source = setting_source("max_context", preset, manifest_engine, flags)
    return (
        f"{source} {config.max_context} is above the model's trained context of {trained} "
        f"tokens; only --context-policy extend goes past it (RoPE scaling), "
        f"--context-policy {config.context_policy} can only lower the limit: pass "
        f"--context-policy extend or a --max-context of at most {trained}"
    )


EXTEND_WARN_FACTOR = 32
"""``--context-policy extend`` beyond this many times the trained context gets a warning."""


def max_context_warning(config: EngineConfig, model: str | None) -> str | None:
    """A note when ``extend`` asks for more than :data:`EXTEND_WARN_FACTOR` times the
    model's trained context (e.g. ``--max-context 10000000`` on an 8K model): RoPE scaling
    that far is beyond what the published extensions (YaRN, LongRoPE: 16–32x) were shown
    to work for, and the page tables sized for it slow every decode step."""
    if config.context_policy != "extend" or not config.max_context:
        return None
    trained = trained_context(model)
    if trained is None or config.max_context <= EXTEND_WARN_FACTOR * trained:
        return None
    return (
        f"--max-context {config.max_context} is {config.max_context / trained:.0f}x the "
        f"model's trained context of {trained} tokens: RoPE extension that far is untested "
        f"(more than {EXTEND_WARN_FACTOR}x), and tables sized for it slow every step; use a "
        "limit near your longest document"
    )


@dataclass(frozen=True)
class Oversized:
    """A document that looks longer than the context limit: job id, bytes, estimate."""

    job_id: str
    size: int
    tokens: int


def oversized_documents(
    jobs: Sequence[tuple[str, Sequence[Path], int]], limit: int
) -> list[Oversized]:
    """Jobs (id, inputs, max_tokens) whose inputs' size alone (at :data:`BYTES_PER_TOKEN`)
    already needs more than ``limit`` tokens beside max_tokens."""
    found = []
    for job_id, inputs, max_tokens in jobs:
        try:
            size = sum(Path(p).stat().st_size for p in inputs)
        except OSError:
            continue  # the job fails on reading it, naming the file
        tokens = int(size / BYTES_PER_TOKEN)
        if tokens + max_tokens > limit:
            found.append(Oversized(job_id, size, tokens))
    return found


def oversized_statement(found: Sequence[Oversized], limit: int, policy: str) -> str:
    """One warning naming the documents and the choices."""
    shown = ", ".join(f"{o.job_id} (~{o.tokens:,} tokens)" for o in found[:5])
    more = f" and {len(found) - 5} more" if len(found) > 5 else ""
    advice = (
        "raise --max-context"
        if policy == "extend"
        else "use --context-policy extend (RoPE scaling past training; quality not "
        "guaranteed) or --context-policy truncate (--truncate-keep head|tail|middle)"
    )
    return (
        f"{len(found)} document(s) look longer than the model's context of {limit:,} tokens, "
        f"judged from their size before the model loads: {shown}{more}; under "
        f"--context-policy {policy} they will fail; {advice}"
    )


def context_limit(config: EngineConfig, trained: int) -> int:
    """The engine's context limit for ``trained`` under the config's policy
    (:func:`engine.text.context.context_limit`; a ``max_context`` it would refuse counts
    as the trained context here, :func:`max_context_problem` reports it)."""
    try:
        return engine_context_limit(config, trained)
    except ConfigError:
        return trained
