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

Torch-free, so the CLI can judge documents before the model loads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.config import ConfigError, EngineConfig, ModelConfig, RopeScaling
from engine.text.prompting import Truncation, fit_document

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


def too_long_advice(policy: str, need: int | None = None) -> str:
    """What to do about a prompt over the limit under ``policy`` (``need``: the tokens it
    needs, when known)."""
    if policy == "extend":
        target = f"to at least {need}" if need else "above that"
        return f"raise --max-context {target}, or use --context-policy truncate"
    return "use --context-policy extend (RoPE scaling) or --context-policy truncate"


def too_long_message(prompt_tokens: int, max_tokens: int, limit: int, policy: str) -> str:
    """The failure of a tokenised prompt of ``prompt_tokens`` over the context limit."""
    need = prompt_tokens + max_tokens
    return (
        f"prompt of {prompt_tokens} tokens + max_tokens {max_tokens} exceeds the context "
        f"limit of {limit} tokens; {too_long_advice(policy, need)}"
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
    ValueError
        Under ``truncate``, when even an empty document does not fit.
    """

    def render(text: str) -> list[int]:
        return tokenizer.encode_chat(messages_of(text))

    if config.context_policy == "truncate":
        document, cut = fit_document(
            tokenizer, document, render, limit - max_tokens, config.truncate_keep
        )
        return render(document), cut
    at_least = tokenizer.min_tokens(tokenizer.render_chat(messages_of(document)))
    if at_least is not None and at_least + max_tokens > limit:
        raise PromptTooLong(
            f"prompt of at least {at_least} tokens (judged from its size; not tokenised) + "
            f"max_tokens {max_tokens} exceeds the context limit of {limit} tokens; "
            f"{too_long_advice(config.context_policy)}"
        )
    return render(document), None
