"""Fitting a document into the context: truncation by tokens (``context_policy=truncate``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

OMISSION = "\n[... {n} tokens omitted ...]\n"


@dataclass(frozen=True)
class Truncation:
    """How a document was cut to fit (``context_policy=truncate``).

    keep: the part kept, ``head``, ``tail`` or ``middle`` (both ends).
    original_tokens: tokens of the whole document.
    kept_tokens: of those, the tokens kept (the omission mark not counted).
    """

    keep: str
    original_tokens: int
    kept_tokens: int

    @property
    def dropped_tokens(self) -> int:
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

    Returns
    -------
    (text, cut): the document to use and how it was cut (``None`` when it already fits).

    Raises
    ------
    NoRoomForDocument
        If no part of the document fits beside the instruction and the omission mark
        (the message says whether the instruction alone is over ``limit``).
    """
    prompt_len = len(render(document))
    if prompt_len <= limit:
        return document, None
    encode = getattr(tokenizer, "encode_text", tokenizer.encode)  # special tokens as text
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
    # the fewest prompt tokens a cut takes: the loop's first budget keeps 16 tokens for the
    # mark and each later one 16 fewer, until the mark's real size fits beside one token
    mark = len(encode(OMISSION.format(n=len(doc_ids))))
    needed = overhead + 17 + 16 * max(0, -(-(mark - 16) // 16))
    if overhead >= limit:
        where = "over" if overhead > limit else "all of"
        raise NoRoomForDocument(
            f"the instruction alone needs {overhead} tokens, {where} the limit of {limit}",
            needed,
        )
    raise NoRoomForDocument(
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
