"""Text from outside the program (file names above all) made safe to show on a terminal.

A file name may hold any character but ``/`` and NUL: a newline (``evil\\nFAILED
other: fake.txt`` printed raw forges a line of the log), an escape sequence (``\\x1b[2J``
clears the screen) or a carriage return (it writes over the start of the line).
``results.jsonl`` is JSON, which escapes them; human-readable output escapes them here:

- :func:`escaped`: every control character written as an escape (``\\n``, ``\\t``,
  ``\\r``, ``\\x1b``, ``\\x9b``, ``\\u202e``), for a name and for a line that must stay one
  line (a job's ``FAILED`` or ``done`` line): where file names enter messages
  (:func:`hisparse_cli.textio.shown_path`) and in the reporters' job lines.
- :func:`terminal_text`: the same but keeping newlines, for a message as a whole (its
  lines are the program's own): what the reporters and the run's error lines write, so
  no escape sequence reaches the terminal whatever names a message holds.
- :func:`shown_message`: a message the engine built from the raw names the user gave
  (``model not found: a<newline>b.gguf``, a preset's ``file:line: ...`` problems): those
  names escaped where they stand, then :func:`terminal_text`.

Controls: C0 (U+0000-U+001F), DEL, C1 (U+0080-U+009F: U+009B is the one-character
CSI), the line and paragraph separators (U+2028, U+2029) and the bidirectional
embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069), which reorder what a
terminal shows. Rich markup in a name (``[bold]``) is a separate matter: messages are
printed as plain text (``markup=False``, :class:`rich.text.Text`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from os import PathLike
from pathlib import Path

_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(char: str) -> str:
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escaped(text: str) -> str:
    """``text`` with every control character (newlines included) written as an escape:
    ``evil\\nx`` -> ``evil\\\\nx``, ``\\x1b[31m`` -> ``\\\\x1b[31m``; other text as it is."""
    return _CONTROLS.sub(lambda m: _escape(m.group()), text)


def terminal_text(text: str) -> str:
    """``text`` with every control character but ``\\n`` written as an escape
    (:func:`escaped`): a message keeps its own lines, nothing in it drives the terminal."""
    return "\n".join(escaped(line) for line in text.split("\n"))


def shown_message(message: str, names: Iterable[str | PathLike[str] | None] = ()) -> str:
    """``message``, built from raw file names (the engine's errors: ``model not found:
    nl<newline>x.gguf``, a preset's ``nl<newline>x.yaml:3: ...`` problems), made safe to
    show: each of ``names`` (what the user gave: ``--model``, ``--preset``, a path
    argument; ``None`` is skipped) is written :func:`escaped` wherever it stands in the
    message, as given, as a path (``./a`` is ``a``) and with ``~`` expanded, so a newline
    in it forges no line; then every other control character but the message's own
    newlines is escaped too (:func:`terminal_text`)."""
    forms: set[str] = set()
    for name in names:
        if name is None:
            continue
        text = str(name)
        forms |= {text, str(Path(text)), str(Path(text).expanduser())} if text else set()
    for form in sorted(forms, key=len, reverse=True):  # a longer form before its part
        shown = escaped(form)
        if shown != form:
            message = message.replace(form, shown)
    return terminal_text(message)
