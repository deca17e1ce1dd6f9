"""Fitting a document into the context: truncation by tokens (``context_policy=truncate``)."""

from __future__ import annotations

from collections.abc import Callable

OMISSION = "\n[... {n} tokens omitted ...]\n"


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
) -> tuple[str, int]:
    """Shorten ``document`` until ``render(document)`` has at most ``limit`` tokens.

    Parameters
    ----------
    tokenizer : has ``encode`` / ``decode``
    render : document text -> full prompt ids (chat template applied)
    limit : token budget for the prompt (context limit - max_tokens)
    keep : which part survives (:func:`cut_tokens`); the cut is marked in the text

    Returns
    -------
    (text, dropped): the document to use and how many document tokens were dropped
    (0 when it already fits).

    Raises
    ------
    ValueError
        If even an empty document does not fit (the instruction alone is too long).
    """
    prompt_len = len(render(document))
    if prompt_len <= limit:
        return document, 0
    doc_ids = tokenizer.encode(document)
    overhead = prompt_len - len(doc_ids)
    budget = limit - overhead - 16
    while budget > 0:
        before, after = cut_tokens(doc_ids, budget, keep)
        dropped = len(doc_ids) - len(before) - len(after)
        text = tokenizer.decode(before) + OMISSION.format(n=dropped) + tokenizer.decode(after)
        if len(render(text)) <= limit:
            return text, dropped
        budget -= max(16, budget // 50)
    raise ValueError(f"the instruction alone needs {overhead} tokens, over the limit of {limit}")
