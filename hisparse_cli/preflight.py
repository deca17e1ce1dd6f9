"""Checks made before the model loads, from the model's metadata and the documents' sizes.

* :func:`max_context_problem`: ``--max-context`` above the model's trained context under a
  policy other than ``extend`` (the engine would refuse it after reading the weights).
* :func:`max_new_tokens_problem`: a ``max_new_tokens`` that cannot fit the context even
  with an empty document (no context policy helps; the run is refused).
* :func:`oversized_documents`: documents whose size suggests they may not fit the context
  beside ``max_new_tokens`` under ``refuse``, so the user reads the choices before waiting
  for the load; one that fits alone gets a ``--max-new-tokens`` that is safe to follow
  (judged at :data:`SAFE_BYTES_PER_TOKEN`, which overestimates the tokens).

The trained context comes from the model's header (:func:`trained_context`: GGUF
key/value pairs or an HF ``config.json``), read in milliseconds; where it cannot be read
the checks stay silent and loading reports the real reason.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import ConfigError, EngineConfig
from engine.text.context import context_limit as engine_context_limit
from hisparse_cli.display import escaped
from hisparse_cli.textio import STDIN, document_name

BYTES_PER_TOKEN = 4.5
"""Bytes of text per token used to estimate a document's length before the tokenizer is
loaded: above what English prose and documentation take with the embedded model's
tokenizer (3.3-4.3 over the corpus), so the estimate stays below the real count: used
where an overestimate would refuse a run that fits (:func:`max_new_tokens_problem`)."""

SAFE_BYTES_PER_TOKEN = 2.8
"""Bytes of text per token for advice that must be safe to follow (the largest
``--max-new-tokens`` that fits beside a document): below what ordinary prose and
documentation take with the embedded model's tokenizer in any 16 KB stretch of the corpus
(2.99-4.04; whole documents 3.35-4.25), so the tokens it gives are above the real count.
Tables of numbers go lower (2.1 in docs/performance.md): the advice says it is an estimate."""

CHAT_TEMPLATE_TOKENS = 64
"""Tokens allowed for the chat template's own markup (role headers, special tokens) in the
safe estimate; the embedded model's template adds about 10."""


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


def model_shape(model: str | None) -> Any:
    """The :class:`~engine.config.ModelConfig` of ``model`` (as :func:`trained_context`
    names models) read from its header, no weights (a GGUF file's reader imports torch),
    or ``None`` if it cannot be read."""
    try:
        if model is not None and model.startswith("synthetic:"):
            from engine.weights.synthetic import synthetic_shape

            return synthetic_shape(model.split(":", 1)[1])
        from engine.capacity.shapes import shape_from_gguf, shape_from_hf_config

        if model is not None and Path(model).is_dir():
            return shape_from_hf_config(Path(model) / "config.json")
        return shape_from_gguf(Path(model) if model is not None else _embedded_path())
    except (OSError, ValueError, KeyError, ConfigError):
        return None


def _embedded_path() -> Path:
    from engine.weights.embedded import default_model_path

    return default_model_path()


def _gguf_context(path: Path) -> int | None:
    """``<arch>.context_length`` (4096 when absent, as the loader reads it)."""
    from engine.model.registry import gguf_names  # not engine.weights.gguf: no torch yet
    from engine.weights.header import read_gguf_fields

    archs = gguf_names()
    keys = {"general.architecture", *(f"{arch}.context_length" for arch in archs)}
    fields = read_gguf_fields(path, keys)
    arch = fields.get("general.architecture")
    if arch not in archs:
        return None  # the loader names the unsupported architecture
    value = fields.get(f"{arch}.context_length", 4096)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None  # the loader names the bad value (engine.config.check_shape)
    return value


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


def template_tokens(spec: Any, safe: bool = False) -> int:
    """Tokens of job ``spec``'s prompt around an empty document, estimated from its chat
    messages' text at :data:`BYTES_PER_TOKEN` (the chat template's own tokens not
    counted), so it stays below the real count; ``safe``: at :data:`SAFE_BYTES_PER_TOKEN`
    plus :data:`CHAT_TEMPLATE_TOKENS`, so it stays above it."""
    size = _template_text_bytes(spec)
    if safe:
        return safe_tokens(size) + CHAT_TEMPLATE_TOKENS
    return int(size / BYTES_PER_TOKEN)


CUT_MARK_TOKENS = 33
"""Most tokens a truncated prompt adds beside its instruction and the document it keeps:
:func:`engine.text.prompting.fit_document`'s 16 tokens of slack, one of the document, and
16 for the omission mark (about 30 bytes, so at most 16 tokens more)."""


def cut_prompt_bound(spec: Any) -> int:
    """Most prompt tokens job ``spec`` can need under ``truncate`` to keep any of its
    document (:class:`engine.text.prompting.NoRoomForDocument`'s ``needed``), from its
    chat messages' text before the tokenizer is built: every byte a token
    (:data:`BOUND_BYTES_PER_TOKEN`), plus the chat template's markup
    (:data:`CHAT_TEMPLATE_TOKENS`) and :data:`CUT_MARK_TOKENS`. A job whose
    ``max_new_tokens`` leaves this much room needs no count."""
    size = _template_text_bytes(spec)
    return math.ceil(size / BOUND_BYTES_PER_TOKEN) + CHAT_TEMPLATE_TOKENS + CUT_MARK_TOKENS


def _template_text_bytes(spec: Any) -> int:
    """Bytes of the text of job ``spec``'s chat messages around an empty document."""
    from hisparse_cli.tasks import build_messages

    if spec.messages is not None:  # an OpenAI-batch request: its other messages
        messages = list(spec.messages)
    else:
        name = document_name(spec.inputs[0]) if spec.inputs else ""
        messages = build_messages(spec.task, "", spec.id, name)
    return sum(len(m["content"].encode()) for m in messages if isinstance(m.get("content"), str))


def safe_tokens(size: int) -> int:
    """Tokens of ``size`` bytes of text at :data:`SAFE_BYTES_PER_TOKEN`, rounded up: at
    least the real count for ordinary text."""
    return math.ceil(size / SAFE_BYTES_PER_TOKEN)


def max_new_tokens_problem(
    specs: Sequence[Any],
    limit: int,
    policy: str,
    flag_given: bool,
    limit_source: str | None = None,
) -> str | None:
    """Why a job's ``max_new_tokens`` cannot fit the context limit even with an empty
    document (beside the prompt's :func:`template_tokens`), or ``None``: truncating or
    chunking does not help, only a smaller ``--max-new-tokens`` or a larger context
    (``extend`` with a larger ``--max-context``). ``flag_given``: ``--max-new-tokens`` set it (else each job's own).
    ``limit_source``: where ``max_context`` was set (:func:`setting_source`), if it was:
    a limit too small for the prompt alone is then blamed on it."""
    fits = [(spec, limit - template_tokens(spec)) for spec in specs]
    bad = [(spec, room) for spec, room in fits if spec.sampling.max_tokens > room]
    if not bad:
        return None
    spec, room = min(bad, key=lambda pair: pair[1])
    if room <= 0 and limit_source is not None:
        return (
            f"{limit_source} {limit:,} is too small for the prompt: the text around a "
            f"document alone takes at least ~{limit - room:,} tokens (judged from its size), "
            "before the document and max_new_tokens; raise it or leave it unset"
        )
    source = (
        f"--max-new-tokens {spec.sampling.max_tokens:,}"
        if flag_given
        else f"max_new_tokens {spec.sampling.max_tokens:,} of job {spec.id!r} (from "
        f"{escaped(spec.source('max_new_tokens'))})"
    )
    more = (
        "; or raise --max-context"
        if policy == "extend"
        else "; or --context-policy extend with a --max-context above it (RoPE scaling past "
        "the model's trained context, which may cost quality)"
    )
    context = f"the model's context of {limit:,} tokens"
    if limit_source is not None:  # the limit is max_context's: raising it is a fix too
        context = f"the context limit of {limit:,} tokens (set by {limit_source})"
        if policy == "extend":
            more = f"; or raise {limit_source}"
        else:
            more = (
                f"; or raise {limit_source} (up to the model's trained context), or use "
                "--context-policy extend with a --max-context above that (RoPE scaling past "
                "the model's trained context, which may cost quality)"
            )
    return (
        f"{source} cannot fit {context} even with an empty "
        f"document (the prompt around a document takes at least ~{limit - room:,} tokens, "
        f"judged from its size): the largest --max-new-tokens that could fit is below "
        f"{max(room, 0):,}, less the document's own tokens; truncating or chunking the "
        f"document does not help with that{more}"
    )


def _input_size(path: Path, stdin: bytes | None) -> int:
    if path == STDIN:
        return len(stdin or b"")
    return Path(path).stat().st_size


@dataclass(frozen=True)
class Oversized:
    """A document that may not fit the context limit beside ``max_new_tokens``: job id,
    bytes, its estimated tokens (:func:`safe_tokens`, above the real count), ``room``:
    a ``max_new_tokens`` that fits beside its prompt per that estimate (``<= 0``: the
    document alone may not fit), and ``prompt``: the tokens of the prompt around it
    (``template_tokens(spec, safe=True)``: its instruction and the chat template)."""

    job_id: str
    size: int
    tokens: int
    room: int = 0
    prompt: int = 0


BOUND_BYTES_PER_TOKEN = 1.0
"""Bytes per token that no document can go below: every token of a byte-level BPE or a
SentencePiece vocabulary with byte fallback covers at least one byte of the text, so a
document of N bytes is at most N tokens (decoding and control-character removal only
shorten it). Documents over the limit at this rate are the ones worth tokenising before
the load (:meth:`hisparse_cli.runner.BatchRun._refuse_too_long`); the others fit."""


def oversized_documents(
    jobs: Sequence[tuple[str, Sequence[Path], int, int]],
    limit: int,
    stdin: bytes | None = None,
    bytes_per_token: float = SAFE_BYTES_PER_TOKEN,
) -> list[Oversized]:
    """Jobs (id, inputs, max_tokens, ``template_tokens(spec, safe=True)``) whose inputs'
    size at ``bytes_per_token`` (default :data:`SAFE_BYTES_PER_TOKEN`, an overestimate
    for ordinary text; :data:`BOUND_BYTES_PER_TOKEN`: a bound for any text) may need more
    than ``limit`` tokens beside max_tokens. ``stdin``: the bytes of standard input (an
    input :data:`~hisparse_cli.textio.STDIN`)."""
    found = []
    for job_id, inputs, max_tokens, template in jobs:
        try:
            size = sum(_input_size(p, stdin) for p in inputs)
        except OSError:
            continue  # the job fails on reading it, naming the file
        tokens = math.ceil(size / bytes_per_token)
        if tokens + template + max_tokens > limit:
            found.append(Oversized(job_id, size, tokens, limit - tokens - template, template))
    return found


def oversized_statement(found: Sequence[Oversized], limit: int, policy: str) -> str:
    """One warning naming the documents and the choices; documents that fit alone per the
    safe estimate, only not beside ``max_new_tokens``, get a ``--max-new-tokens`` that
    fits them per that estimate (the exact figure comes once the model loads)."""
    from engine.text.context import too_long_advice

    shown = ", ".join(f"{o.job_id} (~{o.tokens:,} tokens)" for o in found[:5])
    more = f" and {len(found) - 5} more" if len(found) > 5 else ""
    prompts = {o.prompt for o in found}  # the documents' own tokens are not all it counts
    around = f"{'' if len(prompts) == 1 else 'up to '}~{max(prompts):,} tokens"
    counted = (
        f"with the prompt around them (the task's instruction and the chat template: "
        f"{around}, counted high), estimated from their size before the model loads"
    )
    if all(o.room > 0 for o in found):
        room = min(o.room for o in found)
        return (
            f"{len(found)} document(s) may not fit beside --max-new-tokens in the model's "
            f"context of {limit:,} tokens {counted}: {shown}{more}; under --context-policy "
            f"{policy} they would fail; {too_long_advice(policy, room=room, estimated=True)}"
        )
    return (
        f"{len(found)} document(s) may be longer than the model's context of {limit:,} "
        f"tokens {counted}: {shown}{more}; under --context-policy {policy} they would "
        f"fail; {too_long_advice(policy)}"
    )


def context_limit(config: EngineConfig, trained: int) -> int:
    """The engine's context limit for ``trained`` under the config's policy
    (:func:`engine.text.context.context_limit`; a ``max_context`` it would refuse counts
    as the trained context here, :func:`max_context_problem` reports it)."""
    try:
        return engine_context_limit(config, trained)
    except ConfigError:
        return trained
