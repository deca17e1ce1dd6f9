"""The context policy, all of it: how many tokens a request may hold, what a prompt that
does not fit gets (refused, or its document cut), and the words that say so.

``context_policy`` (``EngineConfig``):

* ``refuse`` — the model's trained context is the limit (``max_context`` may lower it);
  a longer prompt fails with advice.
* ``extend`` — the limit is ``max_context`` (default 4x trained) and RoPE is scaled by
  ``extend_method`` (:func:`context_limit_and_rope`); quality past training is
  not guaranteed.
* ``truncate`` — the trained limit; the document is cut (``truncate_keep`` head, tail or
  middle, the cut marked in the text) so prompt + ``max_tokens`` fits
  (:func:`engine.text.prompting.fit_document`).
* ``chunk`` — the trained limit; a document that does not fit is split into overlapping
  chunks that do (:func:`chunk_document`), the task runs on each (map), then on their
  results joined (reduce, :func:`reduce_document`; chunked again while too long). The
  runner schedules the chunk jobs (:mod:`hisparse_cli.runner`).

Torch-free, so the CLI can judge documents before the model loads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.config import ConfigError, EngineConfig, ModelConfig, RopeScaling
from engine.text.prompting import NoRoomForDocument, Truncation, fit_document

if TYPE_CHECKING:
    from engine.model.rope import Rope


class PromptTooLong(ValueError):
    """A job's prompt cannot fit the context limit (the job fails; the batch goes on)."""


def context_limit(config: EngineConfig, trained: int) -> int:
    """Tokens (prompt + generated) per request under ``config``'s policy for a model
    trained on ``trained`` positions.

    Raises
    ------
    ConfigError
        ``max_context`` above the trained context without ``extend`` (it would be ignored).
    """
    if config.context_policy == "extend":
        return config.max_context or 4 * trained
    if config.max_context and config.max_context > trained:
        raise ConfigError(
            f"max_context={config.max_context} is above the model's trained context of "
            f"{trained} tokens; only context_policy extend goes past it "
            f"(--context-policy extend), {config.context_policy!r} can only lower the limit"
        )
    return config.max_context or trained


def context_limit_and_rope(cfg: ModelConfig, config: EngineConfig) -> tuple[int, Rope]:
    """Tokens per request (:func:`context_limit`) and the RoPE table under the context
    policy: ``extend`` scales RoPE by ``extend_method`` with factor ``limit / trained``
    unless the model has its own scaling; the model's frequency factors (GGUF
    ``rope_freqs``) always apply; a ``longrope`` model gets its long factors when the limit
    is above its original context (:class:`engine.model.rope.Rope`).

    Raises
    ------
    ConfigError
        ``max_context`` above the trained context without ``extend`` (it would be ignored).
    """
    from engine.model.rope import Rope

    trained = cfg.max_position
    limit = context_limit(config, trained)
    scaling = cfg.rope_scaling
    if config.context_policy == "extend" and limit > trained and scaling is None:
        scaling = RopeScaling(
            kind=config.extend_method, factor=limit / trained, original_max_position=trained
        )
    return limit, Rope(cfg.head_dim, cfg.rope_theta, scaling, cfg.rope_freq_factors, context=limit)


POLICY_CHOICES = (
    "--context-policy extend (RoPE scaling past training; quality not guaranteed), "
    "--context-policy truncate (--truncate-keep head|tail|middle) or --context-policy chunk "
    "(the task over chunks, then over their results)"
)
"""The context policies that let a document longer than the context run, in words: the
advice of every "too long" message (:func:`too_long_advice`, the CLI's pre-load check,
``hisparse plan``'s note)."""


def too_long_advice(
    policy: str, need: int | None = None, room: int | None = None, estimated: bool = False
) -> str:
    """What to do about a prompt over the limit under ``policy`` (``need``: the tokens it
    needs, when known; ``room``: the largest ``max_tokens`` that fits beside the prompt,
    when the prompt alone fits and only ``max_tokens`` does not; ``estimated``: ``room``
    was estimated from the document's size, cautiously: a value safe to follow)."""
    if policy == "extend":
        target = f"to at least {need}" if need else "above that"
        choices = f"raise --max-context {target}, or use --context-policy truncate or chunk"
    else:
        choices = f"use {POLICY_CHOICES}"
    if room is not None and room > 0:
        bound = f"at most ~{room:,} (a cautious estimate)" if estimated else f"at most {room:,}"
        return f"lower --max-new-tokens to {bound} (the prompt fits), or {choices}"
    return choices


def too_long_message(prompt_tokens: int, max_tokens: int, limit: int, policy: str) -> str:
    """The failure of a tokenised prompt of ``prompt_tokens`` over the context limit; when
    the prompt alone fits, the advice names the largest ``--max-new-tokens`` that fits."""
    need = prompt_tokens + max_tokens
    return (
        f"prompt of {prompt_tokens} tokens + max_tokens {max_tokens} exceeds the context "
        f"limit of {limit} tokens; {too_long_advice(policy, need, limit - prompt_tokens)}"
    )


def too_long_by_size_message(at_least: int, max_tokens: int, limit: int, policy: str) -> str:
    """The failure of a prompt whose size alone shows it over the context limit: at least
    ``at_least`` tokens (a lower bound from its bytes, ``min_tokens``; not tokenised)."""
    return (
        f"prompt of at least {at_least} tokens (judged from its size; not tokenised) + "
        f"max_tokens {max_tokens} exceeds the context limit of {limit} tokens; "
        f"{too_long_advice(policy)}"
    )


def fit_prompt(
    tokenizer,
    messages_of: Callable[[str], list[dict]],
    document: str,
    limit: int,
    max_tokens: int,
    config: EngineConfig,
) -> tuple[list[int], Truncation | None]:
    """The prompt ids of ``document`` under the context policy.

    Parameters
    ----------
    tokenizer : renders and encodes chat messages (``render_chat``, ``encode_chat``,
        ``min_tokens``: a lower bound of a text's tokens, ``None`` when unknown)
    messages_of : document text -> the job's chat messages
    limit : the engine's context limit (tokens per request)
    max_tokens : tokens the job may generate

    Returns
    -------
    (prompt ids, the cut): the cut is ``None`` unless ``truncate`` shortened the document.

    Raises
    ------
    PromptTooLong
        Under ``refuse`` and ``extend``, a prompt whose size alone shows it cannot fit
        (``min_tokens`` over the limit less ``max_tokens``), refused without tokenising it;
        a prompt that fits is never refused this way (the engine checks the exact count).
        Under ``truncate``, when no part of the document fits beside the instruction
        (:class:`engine.text.prompting.NoRoomForDocument`), with the ``max_new_tokens``
        that would leave room.
    """

    def render(text: str) -> list[int]:
        return tokenizer.encode_chat(messages_of(text))

    if config.context_policy == "chunk":
        ids = render(document)
        if len(ids) + max_tokens > limit:
            raise PromptTooLong(
                f"prompt of {len(ids)} tokens + max_tokens {max_tokens} exceeds the context "
                f"limit of {limit} tokens; under context_policy chunk split it with "
                "chunk_document first"
            )
        return ids, None
    if config.context_policy == "truncate":
        try:
            document, cut = fit_document(
                tokenizer, document, render, limit - max_tokens, config.truncate_keep
            )
        except NoRoomForDocument as exc:  # the same job fails the same way again: final
            fits = limit - exc.needed
            advice = (
                f"max_new_tokens {fits} or less leaves room (now {max_tokens}; "
                "--max-new-tokens), or raise --max-context"
                if fits > 0
                else "raise --max-context"
            )
            raise PromptTooLong(f"{exc}; {advice}") from None
        return render(document), cut
    at_least = tokenizer.min_tokens(tokenizer.render_chat(messages_of(document)))
    if at_least is not None and at_least + max_tokens > limit:
        raise PromptTooLong(
            too_long_by_size_message(at_least, max_tokens, limit, config.context_policy)
        )
    return render(document), None


CHUNK_OVERLAP = 0.1
"""Share of a chunk's document tokens repeated at the start of the next chunk."""

CHUNK_SLACK = 16
"""Tokens kept free per chunk for re-tokenisation at the chunk's edges."""


def chunk_document(
    tokenizer,
    messages_of: Callable[[str], list[dict]],
    document: str,
    limit: int,
    max_tokens: int,
    overlap: float = CHUNK_OVERLAP,
) -> list[str]:
    """Split ``document`` into chunks whose prompts fit the context (the ``chunk``
    policy's map step): windows of the document's tokens of ``limit - max_tokens -
    template - CHUNK_SLACK`` tokens (the template: the tokens of the prompt around an
    empty document), each starting ``1 - overlap`` of a window after the previous one;
    a chunk whose re-rendered prompt is still over the limit is shrunk until it fits.

    Returns
    -------
    The chunk texts in document order; ``[document]`` when its prompt already fits.

    Raises
    ------
    ValueError
        When the prompt around an empty document leaves no room for a chunk
        (fewer than 2 x ``CHUNK_SLACK`` tokens), or ``overlap`` is not in ``[0, 0.5]``.
    """
    if not 0.0 <= overlap <= 0.5:
        raise ValueError(f"chunk overlap must be between 0 and 0.5, got {overlap}")

    def render(text: str) -> list[int]:
        return tokenizer.encode_chat(messages_of(text))

    room = limit - max_tokens
    if len(render(document)) <= room:
        return [document]
    template = len(render(""))
    window = room - template - CHUNK_SLACK
    if window < 2 * CHUNK_SLACK:
        raise ValueError(
            f"the prompt around a chunk needs {template} tokens + max_tokens {max_tokens} "
            f"of the context limit of {limit}: no room for a chunk of the document"
        )
    encode = getattr(tokenizer, "encode_text", tokenizer.encode)  # special tokens as text
    ids = encode(document)
    stride = max(1, int(window * (1.0 - overlap)))
    chunks, start = [], 0
    while True:
        size = window
        while True:
            text = tokenizer.decode(ids[start : start + size])
            if len(render(text)) <= room or size <= CHUNK_SLACK:
                break
            size -= max(CHUNK_SLACK, size // 50)
        chunks.append(text)
        if start + size >= len(ids):
            return chunks
        start += min(stride, size)


def reduce_document(results: list[str]) -> str:
    """The document of the ``chunk`` policy's reduce step: the map results in order,
    each under a ``[part i of n]`` heading, after a line saying what they are."""
    n = len(results)
    parts = [f"[part {i} of {n}]\n{text.strip()}" for i, text in enumerate(results, 1)]
    head = (
        f"The same task was done on {n} consecutive, overlapping parts of one long "
        "document; these are the results, in order:"
    )
    return "\n\n".join([head, *parts])
