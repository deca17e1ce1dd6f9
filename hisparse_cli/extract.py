"""``--task extract`` as data: the model's reply parsed into the JSON object it was asked for.

:func:`parse_extracted` takes the reply text and the requested fields and returns the
object for the results line's ``data`` (``None`` when it cannot be had, with the reason
for ``data_error``). Approach: one pass, no second generation. The reply may wrap the
object in prose or a Markdown code fence; the first ``{`` that starts a complete JSON
object is taken. With field names (``--fields a,b`` or a manifest list) every name must
be a key of it (other keys are kept); with schema text or no fields any object passes.
A failed parse leaves the job ``ok`` (its text is on the line and in ``<id>.txt``).

With field names the reply is also *decoded* under a constraint
(:mod:`engine.decode.json_constraint`, through ``Job.json_keys``): every token is masked
to a JSON object with exactly those keys in that order, closed within ``max_new_tokens``,
so the reply is that object and this parse finds it. The parse still runs on every reply
(a pipeline-parallel run, or a ``max_new_tokens`` below the object's punctuation, is not
held to the grammar) and is the only thing that puts ``data`` on the results line.
"""

from __future__ import annotations

import json
from typing import Any

_DECODER = json.JSONDecoder()


def parse_extracted(
    text: str, fields: tuple[str, ...] | str | None
) -> tuple[dict[str, Any] | None, str | None]:
    """``(object, None)`` or ``(None, why)`` for a reply ``text`` to an extract prompt."""
    start, last_error = text.find("{"), "no JSON object in the reply"
    while start != -1:
        try:
            value, _ = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError as exc:
            if last_error == "no JSON object in the reply":
                # json's messages either end in "at" (where the bad part starts) or not
                where = (
                    f" character {exc.pos}"
                    if exc.msg.endswith(" at")
                    else f" at character {exc.pos}"
                )
                last_error = f"invalid JSON: {exc.msg}{where}"
            start = text.find("{", start + 1)
            continue
        if isinstance(value, dict):
            return _check_fields(value, fields)
        start = text.find("{", start + 1)
    return None, last_error


def _check_fields(
    value: dict[str, Any], fields: tuple[str, ...] | str | None
) -> tuple[dict[str, Any] | None, str | None]:
    if not isinstance(fields, tuple):
        return value, None
    missing = [name for name in fields if name not in value]
    if missing:
        return None, f"the JSON object lacks field(s) {', '.join(map(repr, missing))}"
    return value, None
