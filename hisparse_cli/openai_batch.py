"""OpenAI-batch JSONL as a manifest (the input of vLLM's ``run-batch`` and the OpenAI Batch API).

Input, one request per line (OpenAI "batch request input" object)::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "any", "messages": [{"role": "user", "content": "..."}],
              "max_tokens": 64, "temperature": 0, "top_p": 1, "stop": ["\\n\\n"], "seed": 1}}

A ``.jsonl`` manifest is read this way when its first JSON-object line has ``custom_id`` or
``body`` (:func:`is_batch_request`). Each request becomes one job whose id is its
``custom_id`` (made file-safe when it is not: :func:`job_id_for`); its ``messages`` are
rendered with the model's chat template (``TextTokenizer.encode_chat``, which encodes every
message's content with special-token matching off, so text such as ``<|im_end|>`` in a
message is data, never a control token). ``max_completion_tokens`` is an alias of
``max_tokens``; ``body.model`` is recorded but the run's ``--model`` answers.

A bad line (not JSON, wrong shape, bad field, a ``custom_id`` already used on an earlier
line) is rejected with the file and line (:class:`Rejected`); the rest of the batch runs,
the rejected request gets an error line in the output file (:func:`rejected_line`) and the
run's summary counts it (``refused``).

Output, ``batch_output.jsonl`` in the output directory, one line per request (OpenAI
"batch request output" object; the same shape vLLM's ``run-batch`` writes)::

    {"id": "batch_req_<hex>", "custom_id": "q1",
     "response": {"status_code": 200, "request_id": "<hex>", "body": {"id": "chatcmpl-<hex>",
         "object": "chat.completion", "created": <unix s>, "model": "<model>",
         "choices": [{"index": 0, "message": {"role": "assistant", "content": "..."},
                      "logprobs": null, "finish_reason": "stop"}],
         "usage": {"prompt_tokens": P, "completion_tokens": C, "total_tokens": P + C}}},
     "error": null}

A job that failed has ``"response": null`` and ``"error": {"code": ..., "message": ...}``.
A rejected line's error also has ``line`` (its line number in the input file) and, where
one field is at fault, ``param`` (the fields of the OpenAI batch's ``errors.data`` objects);
a line refused for a duplicate ``custom_id`` has ``"custom_id": null`` (its id is in the
message and ``param`` is ``custom_id``), so each ``custom_id`` of the output file is the
one request that ran under it. Source of the format: the OpenAI API reference, "Batch" -> "The request input object" and
"The request output object" (``BatchRequestInput``/``BatchRequestOutput`` in its OpenAPI spec).
"""

from __future__ import annotations

import calendar
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from engine.config import SamplingParams, sampling_problem
from hisparse_cli.naming import MAX_NAME_CHARS, name_problem, output_filename

BATCH_OUTPUT_FILE = "batch_output.jsonl"
CHAT_URL = "/v1/chat/completions"
CHAT_TASK = "chat"
"""The ``task`` recorded on the results line of a batch request (its messages are the prompt)."""

REQUEST_KEYS = ("custom_id", "method", "url", "body")
ROLES = ("system", "developer", "user", "assistant")
SAMPLING_KEYS = (
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
)  # fmt: skip
IGNORED_KEYS = ("model", "user", "metadata", "store", "stream_options", "logprobs")
"""Body keys accepted without effect (``model``: the run's ``--model`` answers)."""

FINISH_REASONS = {"stop": "stop", "length": "length"}
ERROR_CODES = {"cancelled": "cancelled", "error": "server_error"}


@dataclass(frozen=True)
class BatchRequest:
    """One valid request line.

    messages: the chat messages, each ``{"role": str, "content": str}`` (text parts joined;
        ``developer`` becomes ``system``).
    sampling: the job's sampling fields by manifest name (``max_new_tokens``, ``temperature``,
        ``top_p``, ``top_k``, ``seed``, ``stop``); only those the body gave.
    """

    line: int
    custom_id: str
    messages: tuple[dict[str, str], ...]
    sampling: dict[str, Any]
    model: str | None


@dataclass(frozen=True)
class Rejected:
    """A line that is not a usable request: where, its ``custom_id`` when it had one, why."""

    file: str
    line: int
    custom_id: str | None
    message: str
    duplicate: bool = False
    """The line repeats an earlier line's ``custom_id`` (that line's request runs)."""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}; this request is skipped"


def is_batch_request(obj: Any) -> bool:
    """Whether a JSON line has the shape of an OpenAI batch request (``custom_id`` or ``body``)."""
    return isinstance(obj, dict) and ("custom_id" in obj or "body" in obj)


def parse_request(number: int, obj: Any) -> BatchRequest | str:
    """Check one batch line; the request, or why it is rejected (a sentence)."""
    if not isinstance(obj, dict):
        return "each line must be a JSON object (an OpenAI batch request)"
    unknown = [k for k in obj if k not in REQUEST_KEYS]
    if unknown:
        return f"unknown key(s) {', '.join(map(repr, unknown))}; a request has {', '.join(REQUEST_KEYS)}"
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return f"custom_id must be a non-empty string, got {custom_id!r}"
    if obj.get("method", "POST") != "POST":
        return f"method must be 'POST', got {obj['method']!r}"
    if obj.get("url", CHAT_URL) != CHAT_URL:
        return f"url must be {CHAT_URL!r} (the only endpoint served), got {obj['url']!r}"
    body = obj.get("body")
    if not isinstance(body, dict):
        return f"body must be a JSON object, got {body!r}"
    messages = _messages(body.get("messages"))
    if isinstance(messages, str):
        return f"body.messages: {messages}"
    sampling = _sampling(body)
    if isinstance(sampling, str):
        return sampling
    model = body.get("model")
    return BatchRequest(number, custom_id, messages, sampling, model if isinstance(model, str) else None)


def _messages(value: Any) -> tuple[dict[str, str], ...] | str:
    if not isinstance(value, list) or not value:
        return f"must be a non-empty list of messages, got {value!r}"
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return f"[{i}] must be an object with role and content"
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            return f"[{i}].role must be one of {', '.join(ROLES)}, got {role!r}"
        if isinstance(content, list):  # content parts: only text ones
            kinds = [p.get("type") if isinstance(p, dict) else p for p in content]
            if any(k != "text" for k in kinds) or not all(isinstance(p.get("text"), str) for p in content):
                return f"[{i}].content parts must all be {{'type': 'text', 'text': str}}"
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            return f"[{i}].content must be a string or a list of text parts, got {content!r}"
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return tuple(out)


def _sampling(body: dict[str, Any]) -> dict[str, Any] | str:
    found: dict[str, Any] = {}
    tokens = {k: body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None}
    if len(set(map(repr, tokens.values()))) > 1:
        return f"body.max_tokens and body.max_completion_tokens differ ({tokens})"
    for name, value in tokens.items():
        problem = sampling_problem("max_tokens", value)
        if problem:
            return f"body.{name} {problem}"
        found["max_new_tokens"] = value
    for name in ("temperature", "top_p", "top_k", "seed", "stop"):  # the one table's rules
        problem = sampling_problem(name, body.get(name))
        if problem:
            return f"body.{name} {problem}"
        if body.get(name) is not None:
            found[name] = body[name]
    stop = found.pop("stop", None)
    if stop:  # a string, or a list of them ([]: none)
        found["stop"] = [stop] if isinstance(stop, str) else stop
    if body.get("n", 1) != 1:
        return f"body.n must be 1 (one choice per request), got {body['n']!r}"
    if body.get("stream", False) is not False:
        return "body.stream must be false (a batch writes whole responses)"
    known = {*SAMPLING_KEYS, *IGNORED_KEYS, "messages", "n", "stream"}
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        return (
            f"body field(s) {', '.join(unknown)} not supported; supported: messages, "
            f"{', '.join(SAMPLING_KEYS)}, n (1), stream (false)"
        )
    return found


def job_id_for(custom_id: str, taken: set[str]) -> str:
    """A job id (and output file stem) for ``custom_id``: the id itself when it is a safe
    name (:func:`hisparse_cli.naming.name_problem`) whose output file (case-folded) is not
    yet ``taken``, else its safe characters plus 8 (or more) hex digits of its SHA-256.
    Adds the output file to ``taken``."""
    ident = custom_id
    if name_problem(ident) is not None or _out(ident) in taken:
        stem = re.sub(r"[^A-Za-z0-9._-]+", "_", custom_id).replace("..", "_").strip("._-")
        digest, n = hashlib.sha256(custom_id.encode()).hexdigest(), 8
        while True:  # more digits in the (unlikely) case that the shorter one is taken
            ident = f"{(stem or 'request')[: MAX_NAME_CHARS - n - 1]}-{digest[:n]}"
            if _out(ident) not in taken:
                break
            n += 1
    taken.add(_out(ident))
    return ident


def _out(ident: str) -> str:
    return output_filename(ident).casefold()


def read_batch(
    file: str, lines: Sequence[tuple[int, Any]], errors: Mapping[int, str]
) -> tuple[list[BatchRequest], list[Rejected]]:
    """Check every ``(line number, parsed JSON)``; ``errors``: line number -> why it is not
    JSON (its parsed value is ``None``).

    Returns the valid requests and the rejected lines; a ``custom_id`` given on an earlier
    valid line rejects the later one, naming both lines.
    """
    requests: list[BatchRequest] = []
    rejected: list[Rejected] = []
    first: dict[str, int] = {}
    for number, obj in lines:
        parsed = errors.get(number) or parse_request(number, obj)
        custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
        custom_id = custom_id if isinstance(custom_id, str) else None
        if isinstance(parsed, str):
            rejected.append(Rejected(file, number, custom_id, parsed))
        elif parsed.custom_id in first:
            message = (
                f"duplicate custom_id {parsed.custom_id!r} (first on line "
                f"{first[parsed.custom_id]}; line {number} is refused)"
            )
            rejected.append(Rejected(file, number, parsed.custom_id, message, duplicate=True))
        else:
            first[parsed.custom_id] = number
            requests.append(parsed)
    return requests, rejected


def sampling_params(values: Mapping[str, Any]) -> SamplingParams:
    """:class:`SamplingParams` of a request's fields (manifest names; flags already merged)."""
    stop = values.get("stop", ())
    return SamplingParams(
        temperature=float(values.get("temperature", 0.0)),
        top_p=float(values.get("top_p", 1.0)),
        top_k=values.get("top_k", 0),
        seed=values.get("seed"),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        max_tokens=values.get("max_new_tokens", SamplingParams().max_tokens),
    )


def last_user_index(messages: Sequence[Mapping[str, str]]) -> int | None:
    """Index of the last ``user`` message (the part a ``truncate`` policy may cut), or ``None``."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "user":
            return i
    return None


def last_user_text(messages: Sequence[Mapping[str, str]]) -> str:
    """The last ``user`` message's content (``""`` when there is none)."""
    index = last_user_index(messages)
    return "" if index is None else messages[index]["content"]


def messages_with(messages: Sequence[Mapping[str, str]], text: str) -> list[dict[str, str]]:
    """``messages`` with the last user message's content replaced by ``text``."""
    out = [dict(m) for m in messages]
    index = last_user_index(out)
    if index is not None:
        out[index]["content"] = text
    return out


def messages_sha256(messages: Sequence[Mapping[str, str]]) -> str:
    """SHA-256 (hex) of the messages as canonical JSON: the request's "input content" hash."""
    text = json.dumps(list(messages), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def output_line(record: Mapping[str, Any] | None, custom_id: str, model: str) -> dict[str, Any]:
    """The OpenAI batch output object for one request from its ``results.jsonl`` line
    (``None``: the request did not run; a rejected line passes :func:`rejected_line`)."""
    seed = f"{custom_id}\0{(record or {}).get('key', '')}\0{(record or {}).get('finished_at', '')}"
    digest = hashlib.sha256(seed.encode()).hexdigest()
    line: dict[str, Any] = {"id": f"batch_req_{digest[:24]}", "custom_id": custom_id}
    if record is None:
        return {**line, "response": None, "error": {"code": "not_run", "message": "the request did not run"}}
    if not record.get("ok"):
        reason = record.get("finish_reason") or "error"
        code = ERROR_CODES.get(reason, "server_error")
        message = record.get("error") or reason
        return {**line, "response": None, "error": {"code": code, "message": message}}
    prompt, generated = int(record.get("prompt_tokens") or 0), int(record.get("generated_tokens") or 0)
    body = {
        "id": f"chatcmpl-{digest[24:48]}",
        "object": "chat.completion",
        "created": _unix(record.get("finished_at")),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": record.get("text", "")},
                "logprobs": None,
                "finish_reason": FINISH_REASONS.get(record.get("finish_reason"), "stop"),
            }
        ],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": generated,
            "total_tokens": prompt + generated,
        },
    }
    response = {"status_code": 200, "request_id": digest[48:], "body": body}
    return {**line, "response": response, "error": None}


def rejected_line(rejected: Rejected) -> dict[str, Any]:
    """The output object of a rejected line: ``custom_id`` ``null`` when it had none or
    when it repeats an earlier line's (whose answer holds that ``custom_id``); the error
    object has the input's ``line`` and, for a duplicate, ``param: "custom_id"`` (as the
    OpenAI batch's ``errors.data`` objects: ``code``, ``message``, ``param``, ``line``)."""
    digest = hashlib.sha256(f"{rejected.file}:{rejected.line}".encode()).hexdigest()
    message = f"{rejected.file}:{rejected.line}: {rejected.message}"
    error: dict[str, Any] = {"code": "invalid_request", "message": message, "line": rejected.line}
    if rejected.duplicate:
        error["param"] = "custom_id"
    return {
        "id": f"batch_req_{digest[:24]}",
        "custom_id": None if rejected.duplicate else rejected.custom_id,
        "response": None,
        "error": error,
    }


def _unix(stamp: Any) -> int:
    """Unix seconds of an ISO-8601 UTC time stamp (``results.utc_now``); 0 if unreadable."""
    try:
        return calendar.timegm(datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).utctimetuple())
    except ValueError:
        return 0

