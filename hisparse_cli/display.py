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

Controls: C0 (U+0000-U+001F), DEL, C1 (U+0080-U+009F: U+009B is the one-character
CSI), the line and paragraph separators (U+2028, U+2029) and the bidirectional
embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069), which reorder what a
terminal shows. Rich markup in a name (``[bold]``) is a separate matter: messages are
printed as plain text (``markup=False``, :class:`rich.text.Text`).
"""

from __future__ import annotations

import re

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
