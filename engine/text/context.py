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

import bisect
import itertools
import re
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, overload

from engine.config import ConfigError, EngineConfig, ModelConfig, RopeScaling
from engine.text.prompting import NoRoomForDocument, Truncation, fit_document, over_by_size

if TYPE_CHECKING:
    import numpy as np

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
    policy: str,
    need: int | None = None,
    room: int | None = None,
    estimated: bool = False,
    limit_from: str | None = None,
) -> str:
    """What to do about a prompt over the limit under ``policy`` (``need``: the tokens it
    needs, when known; ``room``: the largest ``max_tokens`` that fits beside the prompt,
    when the prompt alone fits and only ``max_tokens`` does not; ``estimated``: ``room``
    was estimated from the document's size, cautiously: a value safe to follow;
    ``limit_from``: where ``max_context`` was set when it is the limit, as ``--max-context``:
    raising it is then a choice too, up to the model's trained context)."""
    if policy == "extend":
        target = f"to at least {need}" if need else "above that"
        choices = f"raise --max-context {target}, or use --context-policy truncate or chunk"
    elif limit_from:
        choices = f"raise it (up to the model's trained context), or use {POLICY_CHOICES}"
    else:
        choices = f"use {POLICY_CHOICES}"
    if room is not None and room > 0:
        bound = f"at most ~{room:,} (a cautious estimate)" if estimated else f"at most {room:,}"
        return f"lower --max-new-tokens to {bound} (the prompt fits), or {choices}"
    return choices


def too_long_message(
    prompt_tokens: int, max_tokens: int, limit: int, policy: str, limit_from: str | None = None
) -> str:
    """The failure of a tokenised prompt of ``prompt_tokens`` over the context limit; when
    the prompt alone fits, the advice names the largest ``--max-new-tokens`` that fits.
    ``limit_from``: where ``max_context`` was set, when the limit is that setting."""
    need = prompt_tokens + max_tokens
    advice = too_long_advice(policy, need, limit - prompt_tokens, limit_from=limit_from)
    return (
        f"prompt of {prompt_tokens} tokens + max_tokens {max_tokens} exceeds the context "
        f"limit of {limit} tokens{set_by(limit_from)}; {advice}"
    )


def too_long_by_size_message(
    at_least: int, max_tokens: int, limit: int, policy: str, limit_from: str | None = None
) -> str:
    """The failure of a prompt whose size alone shows it over the context limit: at least
    ``at_least`` tokens (a lower bound from its bytes, ``min_tokens``; not tokenised)."""
    return (
        f"prompt of at least {at_least} tokens (judged from its size; not tokenised) + "
        f"max_tokens {max_tokens} exceeds the context limit of {limit} tokens"
        f"{set_by(limit_from)}; {too_long_advice(policy, limit_from=limit_from)}"
    )


def set_by(limit_from: str | None) -> str:
    """`` (set by --max-context)``: where a context limit that is ``max_context`` was set."""
    return f" (set by {limit_from})" if limit_from else ""


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

CHUNK_PIECE_CHARS = 1 << 20
"""Characters of a document that :func:`chunk_document` tokenises at once: a longer one is
tokenised in pieces of about this many characters (:func:`piece_ids`), so that a huge log
never goes to the tokenizer whole (its ``tokenizers`` encoding of a 100 MB text takes
gigabytes)."""


def chunk_document(
    tokenizer,
    messages_of: Callable[[str], list[dict]],
    document: str,
    limit: int,
    max_tokens: int,
    overlap: float = CHUNK_OVERLAP,
) -> Sequence[str]:
    """Split ``document`` into chunks whose prompts fit the context (the ``chunk``
    policy's map step): windows of the document's tokens of ``limit - max_tokens -
    template - CHUNK_SLACK`` tokens (the template: the tokens of the prompt around an
    empty document), each starting ``1 - overlap`` of a window after the previous one;
    a chunk whose re-rendered prompt is still over the limit is shrunk until it fits.

    A document whose size alone shows it far over the context
    (:func:`engine.text.prompting.over_by_size`, as ``truncate`` judges it) is not
    rendered whole to learn that it does not fit. One of more than
    :data:`CHUNK_PIECE_CHARS` characters is tokenised in pieces cut at line starts
    (:func:`piece_ids`: the ids of the whole, so the same chunks, for a byte-level BPE),
    its ids kept as numpy arrays (2 bytes a token where they are below 65,536, as in most
    vocabularies, else 4), and its chunks are a :class:`TokenChunks`: each text is
    decoded when it is read, so the texts of a huge document are never all in memory at
    once.

    Returns
    -------
    The chunk texts in document order (``len`` of them known): ``[document]`` when its
    prompt already fits; a ``list`` for a document of at most :data:`CHUNK_PIECE_CHARS`
    characters, else a :class:`TokenChunks`.

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
    huge = over_by_size(len(document), room)
    if not huge and len(render(document)) <= room:
        return [document]
    template = len(render(""))
    window = room - template - CHUNK_SLACK
    if window < 2 * CHUNK_SLACK:
        raise ValueError(
            f"the prompt around a chunk needs {template} tokens + max_tokens {max_tokens} "
            f"of the context limit of {limit}: no room for a chunk of the document"
        )
    encode = getattr(tokenizer, "encode_text", tokenizer.encode)  # special tokens as text
    in_pieces = len(document) > CHUNK_PIECE_CHARS
    if in_pieces:
        ids = piece_ids(encode, document)
        take = ids.take
    else:
        whole = encode(document)
        ids, take = whole, lambda a, b: whole[a:b]
    # a document over the size bound may still fit (more than 32 characters a token)
    if huge and len(ids) <= window + 2 * CHUNK_SLACK and len(render(document)) <= room:
        return [document]
    stride = max(1, int(window * (1.0 - overlap)))
    windows = _windows(len(ids), take, tokenizer.decode, render, room, window, stride)
    if not in_pieces:
        return [text for _, _, text in windows]
    return TokenChunks(ids, [(start, size) for start, size, _ in windows], tokenizer.decode)


def _windows(
    n: int,
    take: Callable[[int, int], list[int]],
    decode: Callable[[list[int]], str],
    render: Callable[[str], list[int]],
    room: int,
    window: int,
    stride: int,
) -> Iterator[tuple[int, int, str]]:
    """:func:`chunk_document`'s chunks of a document of ``n`` tokens (``take(a, b)``: its
    ids ``[a, b)``), in order: ``(first token, tokens, text)``, each of at most ``window``
    tokens (fewer where its rendered prompt is over ``room``), starting ``stride`` tokens
    (at most its own size) after the previous one, the last reaching token ``n``."""
    start = 0
    while True:
        size = window
        while True:
            text = decode(take(start, start + size))
            if len(render(text)) <= room or size <= CHUNK_SLACK:
                break
            size -= max(CHUNK_SLACK, size // 50)
        yield start, size, text
        if start + size >= n:
            return
        start += min(stride, size)


class PieceIds:
    """A document's token ids as numpy arrays, one per piece of its text
    (:func:`piece_ids`): 2 bytes a token (``uint16``, ids below 65536) or 4 (``int32``),
    where a list of Python ints takes 8 to 36.

    Parameters
    ----------
    pieces : the ids of each piece, in document order (``[T_i]`` arrays; empty allowed).
    """

    def __init__(self, pieces: list[np.ndarray]) -> None:
        self.pieces = pieces
        self.starts = list(itertools.accumulate((len(p) for p in pieces), initial=0))
        """``[len(pieces) + 1]``: the index of each piece's first id, then the total."""

    def __len__(self) -> int:
        return self.starts[-1]

    def take(self, a: int, b: int) -> list[int]:
        """The ids ``[a, b)`` as Python ints (``b`` past the end is the end), across
        pieces where they span several."""
        b = min(b, len(self))
        out: list[int] = []
        i = bisect.bisect_right(self.starts, a) - 1
        while a < b:
            piece, first = self.pieces[i], self.starts[i]
            stop = min(b - first, len(piece))
            out += piece[a - first : stop].tolist()
            a, i = first + stop, i + 1
        return out


def piece_ids(
    encode: Callable[[str], list[int]], document: str, piece_chars: int | None = None
) -> PieceIds:
    """The token ids of ``document``, tokenised in pieces of at most ``piece_chars``
    characters (default :data:`CHUNK_PIECE_CHARS`) so that the tokenizer never holds all
    of it.

    A piece ends at a line start, else before a space between two words
    (:func:`_piece_end`; at most ``2 x piece_chars`` characters), else at ``piece_chars``
    (twice that text without such a place: the one case where a piece's edge can split
    a word, and its ids there differ). A piece after the first is tokenised with the
    character before it in front (the newline, the word's last character) and that
    character's ids are taken off again, so a tokenizer that marks the start of a text
    (a sentencepiece ``▁``) does not mark the piece's start. For a byte-level BPE, whose
    pre-tokens never span those places, the ids are those of ``encode(document)``.

    Returns
    -------
    The ids, 2 or 4 bytes each (:class:`PieceIds`); ``len`` of it is the document's tokens.
    """
    import numpy as np  # not at import: the CLI imports this module before the load

    size = CHUNK_PIECE_CHARS if piece_chars is None else piece_chars
    pieces, start = [], 0
    while start < len(document):
        end = _piece_end(document, start, size)
        if start == 0:
            ids = encode(document[:end])
        else:
            anchor = encode(document[start - 1])
            ids = encode(document[start - 1 : end])
            if ids[: len(anchor)] == anchor:
                ids = ids[len(anchor) :]
            else:  # the character is not a token of its own there
                ids = encode(document[start:end])
        piece = np.asarray(ids, dtype=np.int32)
        if not len(piece) or piece.max() < 1 << 16:  # most vocabularies: 2 bytes a token
            piece = piece.astype(np.uint16)
        pieces.append(piece)
        start = end
    return PieceIds(pieces)


_LINE_START = re.compile(r"(?<=\S)\n(?=[^\W_])")
"""A newline after a character other than whitespace, before a letter or digit: a piece
may start after it (:func:`_piece_end`)."""

_WORD_SPACE = re.compile(r"(?<=\S) (?=\S)")
"""A space between two characters other than whitespace: a piece may start at it."""


def _piece_end(document: str, start: int, size: int) -> int:
    """Where the piece of ``document`` from ``start`` of about ``size`` characters ends
    (:func:`piece_ids`): after the last newline of :data:`_LINE_START`, else at the
    last space of :data:`_WORD_SPACE` (the space begins the next piece), looked for in
    the piece's second half, then in all of it; else at the first of either in the next
    ``size`` characters; else (``2 x size`` characters without one) at ``size``.

    No pre-token of a byte-level BPE (GPT-2's split, Llama 3's, Qwen2's, Tekken's and
    GPT-4o's) spans those places: whitespace runs (``" \\t\\n"``, ``"\\r\\n"``) and
    punctuation that takes the newline and a ``/`` after it (Tekken) are left whole, and
    the space before a word goes with the word."""
    end = start + size
    if end >= len(document):
        return len(document)
    for lo in (start + size // 2, start + 1):
        at = end
        while (k := document.rfind("\n", lo, at)) >= 0:
            if document[k + 1].isalnum() and not document[k - 1].isspace():
                return k + 1
            at = k
        at = end
        while (k := document.rfind(" ", lo, at)) >= 0:
            if not (document[k - 1].isspace() or document[k + 1].isspace()):
                return k
            at = k
    line = _LINE_START.search(document, end, end + size)
    word = _WORD_SPACE.search(document, end, end + size)
    cuts = [m.end() for m in (line,) if m] + [m.start() for m in (word,) if m]
    return min(cuts, default=end)


class TokenChunks(Sequence[str]):
    """:func:`chunk_document`'s chunks of a document tokenised in pieces: their number is
    known, and each text is decoded from the document's ids when it is read (index or
    iteration; again on each read), so the texts are never all in memory at once.

    Parameters
    ----------
    ids : the document's ids (:func:`piece_ids`).
    spans : each chunk's ``(first token, tokens)``, in document order.
    decode : ids -> text (the tokenizer's ``decode``).
    """

    def __init__(
        self, ids: PieceIds, spans: list[tuple[int, int]], decode: Callable[[list[int]], str]
    ) -> None:
        self.ids, self.spans, self.decode = ids, spans, decode

    def __len__(self) -> int:
        return len(self.spans)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        start, size = self.spans[index]
        return self.decode(self.ids.take(start, start + size))


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
