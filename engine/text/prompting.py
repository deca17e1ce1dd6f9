"""Fitting a document into the context: truncation by tokens (``context_policy=truncate``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

OMISSION = "\n[... {n} tokens omitted ...]\n"
OMISSION_CHARS = "\n[... {n} characters omitted ...]\n"
"""The mark of a cut in a document too long to tokenise whole (:func:`fit_document`)."""

ENDS_MARGIN = 256
"""Tokens past the most that can be kept which an end of a huge document is tokenised
with (:func:`document_ends`), so that the kept tokens lie away from the piece's edge."""

FAR_OVER_CHARS = 32
"""Characters per token of ``limit`` + :data:`ENDS_MARGIN` past which a document's size
alone says it is far over a limit of ``limit`` tokens (:func:`over_by_size`): 8 x the
about 4 characters a token holds in English, 3 in logs and code. Such a document is not
tokenised whole to learn that it does not fit: ``truncate`` tokenises the ends it keeps
(:func:`document_ends`), ``chunk`` tokenises it in pieces
(:func:`engine.text.context.chunk_document`)."""


def over_by_size(chars: int, limit: int, parts: int = 1) -> bool:
    """Whether a document of ``chars`` characters is far over ``limit`` tokens judged by
    its size alone: more than ``parts`` x :data:`FAR_OVER_CHARS` characters per token of
    ``limit`` + :data:`ENDS_MARGIN` (``parts``: 2 where both ends are kept). Not a proof:
    a text of more than 32 characters a token (long runs of one character) is this long
    and may fit; callers that act on it check the tokens they get."""
    return chars > parts * FAR_OVER_CHARS * (limit + ENDS_MARGIN)


@dataclass(frozen=True)
class Truncation:
    """How a document was cut to fit (``context_policy=truncate``).

    keep: the part kept, ``head``, ``tail`` or ``middle`` (both ends).
    original_tokens: tokens of the whole document; ``None`` for one so much longer than
        the context that only its ends were tokenised (:func:`fit_document`).
    kept_tokens: of those, the tokens kept (the omission mark not counted).
    """

    keep: str
    original_tokens: int | None
    kept_tokens: int

    @property
    def dropped_tokens(self) -> int | None:
        """Tokens cut, or ``None`` for a document too large to tokenise whole
        (``original_tokens`` is then ``None``: :func:`fit_document`)."""
        if self.original_tokens is None:
            return None
        return self.original_tokens - self.kept_tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cut_tokens(ids: list[int], keep: int, where: str) -> tuple[list[int], list[int]]:
    """Split ``ids`` into the kept parts around the cut.

    Parameters
    ----------
    ids : document token ids; keep : how many to keep (>= 0)
    where : ``head`` (keep the beginning), ``tail`` (keep the end) or ``middle``
        (keep the beginning and the end, drop the middle)

    Returns
    -------
    (before, after): the kept ids before and after the omission.
    """
    if keep >= len(ids):
        return list(ids), []
    if where == "head":
        return list(ids[:keep]), []
    if where == "tail":
        return [], list(ids[len(ids) - keep :])
    if where == "middle":
        first = keep // 2
        return list(ids[:first]), list(ids[len(ids) - (keep - first) :])
    raise ValueError(f"truncate_keep={where!r} is not one of head, tail, middle")


def fit_document(
    tokenizer,
    document: str,
    render: Callable[[str], list[int]],
    limit: int,
    keep: str,
) -> tuple[str, Truncation | None]:
    """Shorten ``document`` until ``render(document)`` has at most ``limit`` tokens.

    Parameters
    ----------
    tokenizer : has ``encode`` / ``decode`` (and ``encode_text``, special-token matching
        off, used for the document when present)
    render : document text -> full prompt ids (chat template applied)
    limit : token budget for the prompt (context limit - max_tokens)
    keep : which part survives (:func:`cut_tokens`); the cut is marked in the text

    A document far longer than ``limit`` tokens (:func:`document_ends`) is not tokenised
    whole: only the ends it keeps are, and the mark counts the characters cut
    (:data:`OMISSION_CHARS`; ``original_tokens`` ``None``). Tokenising a 300 MB document
    to keep 8K of its tokens took all of a 24 GB machine's memory.

    Returns
    -------
    (text, cut): the document to use and how it was cut (``None`` when it already fits).

    Raises
    ------
    NoRoomForDocument
        If no part of the document fits beside the instruction and the omission mark
        (the message says whether the instruction alone is over ``limit``).
    """
    encode = getattr(tokenizer, "encode_text", tokenizer.encode)  # special tokens as text
    ends = document_ends(encode, document, limit, keep)
    if ends is not None:
        return _fit_ends(tokenizer, document, render, limit, keep, *ends)
    prompt_len = len(render(document))
    if prompt_len <= limit:
        return document, None
    doc_ids = encode(document)
    overhead = prompt_len - len(doc_ids)
    budget = limit - overhead - 16
    while budget > 0:
        before, after = cut_tokens(doc_ids, budget, keep)
        dropped = len(doc_ids) - len(before) - len(after)
        text = tokenizer.decode(before) + OMISSION.format(n=dropped) + tokenizer.decode(after)
        if len(render(text)) <= limit:
            return text, Truncation(keep, len(doc_ids), len(doc_ids) - dropped)
        budget -= max(16, budget // 50)
    raise _no_room(overhead, len(encode(OMISSION.format(n=len(doc_ids)))), limit)


def _no_room(overhead: int, mark: int, limit: int) -> NoRoomForDocument:
    """:func:`fit_document`'s failure: ``overhead`` tokens of instruction and a cut's mark
    of ``mark`` tokens leave no room for the document within ``limit``."""
    # the fewest prompt tokens a cut takes: the loop's first budget keeps 16 tokens for the
    # mark and each later one 16 fewer, until the mark's real size fits beside one token
    needed = overhead + 17 + 16 * max(0, -(-(mark - 16) // 16))
    if overhead >= limit:
        where = "over" if overhead > limit else "all of"
        return NoRoomForDocument(
            f"the instruction alone needs {overhead} tokens, {where} the limit of {limit}",
            needed,
        )
    return NoRoomForDocument(
        f"the instruction needs {overhead} tokens and the mark of the cut text {mark} more: "
        f"no room for any of the document within the limit of {limit}",
        needed,
    )


class NoRoomForDocument(ValueError):
    """:func:`fit_document` found no room for any of the document: ``needed`` is about the
    fewest prompt tokens a cut prompt takes (the instruction, the omission mark and one
    token of the document), for the caller's advice."""

    def __init__(self, message: str, needed: int) -> None:
        super().__init__(message)
        self.needed = needed


def document_ends(
    encode: Callable[[str], list[int]], document: str, limit: int, keep: str
) -> tuple[list[int], list[int]] | None:
    """The token ids of the start and the end of ``document`` that :func:`fit_document`
    may keep under ``keep`` (``[]`` for an end it drops), each tokenised from a piece of
    the text with at least ``limit`` + :data:`ENDS_MARGIN` tokens; or ``None`` for a
    document that is not at least 4 times such pieces (it is tokenised whole).

    A document is tokenised whole unless :func:`over_by_size` (by both ends' share for
    ``middle``). A piece starts at a quarter of that bound, ``8 x (limit + ENDS_MARGIN)``
    characters, and grows fourfold while it holds too few tokens. The ids kept are at least :data:`ENDS_MARGIN` tokens from the
    piece's cut edge, so they are the whole document's ids there unless one pre-token (a
    run of text the tokenizer never splits across, such as a word) spans that margin.
    """
    if keep not in ("head", "tail", "middle"):
        raise ValueError(f"truncate_keep={keep!r} is not one of head, tail, middle")
    parts = 2 if keep == "middle" else 1
    if not over_by_size(len(document), limit, parts):
        return None
    want = limit + ENDS_MARGIN
    size = FAR_OVER_CHARS // 4 * want
    while 4 * size * parts < len(document):  # the first time: over_by_size
        head = encode(document[:size]) if keep in ("head", "middle") else []
        tail = encode(document[-size:]) if keep in ("tail", "middle") else []
        if all(len(ids) >= want for ids, used in ((head, keep != "tail"), (tail, keep != "head")) if used):
            return head, tail
        size *= 4
    return None


def _fit_ends(
    tokenizer, document: str, render: Callable[[str], list[int]], limit: int, keep: str,
    head: list[int], tail: list[int],
) -> tuple[str, Truncation]:
    """:func:`fit_document` of a document known to be far over ``limit`` from its ends'
    ids (:func:`document_ends`): the same budget search, with the cut's mark in
    characters."""
    overhead = len(render(""))
    budget = limit - overhead - 16
    while budget > 0:
        first = {"head": budget, "tail": 0, "middle": budget // 2}[keep]
        before = head[:first]
        after = tail[len(tail) - (budget - first) :] if budget > first else []
        start, end = tokenizer.decode(before), tokenizer.decode(after)
        dropped = max(0, len(document) - len(start) - len(end))
        text = start + OMISSION_CHARS.format(n=dropped) + end
        if len(render(text)) <= limit:
            return text, Truncation(keep, None, len(before) + len(after))
        budget -= max(16, budget // 50)
    encode = getattr(tokenizer, "encode_text", tokenizer.encode)
    raise _no_room(overhead, len(encode(OMISSION_CHARS.format(n=len(document)))), limit)
