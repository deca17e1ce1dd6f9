"""Output streams whose reader went away: ``hisparse run docs/*.txt | head -1``.

Once the program reading a pipe exits, every later write to it raises
:class:`BrokenPipeError`. A batch run is long and its results go to files, so a closed
progress stream must not stop it. :class:`PipeGuard` wraps such a stream (stdout, and
stderr for ``2>&1 | head``); on its first broken pipe it

- drops every later write (nothing is retried, nothing raised),
- points the file descriptor under the stream at ``os.devnull`` (``os.dup2``), so what
  Python still holds for it (its buffer, flushed at exit) goes nowhere instead of printing
  ``Exception ignored ... BrokenPipeError`` at shutdown (the remedy of Python's "Note on
  SIGPIPE", https://docs.python.org/3/library/signal.html#note-on-sigpipe),
- writes its ``notice`` once to ``notice_to`` (stderr), if that is still open.

Rich consoles catch a broken pipe themselves and exit with status 1
(``Console.on_broken_pipe``); a console whose ``file`` is a guard never sees one.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import IO, cast

from rich.console import Console

STDOUT_CLOSED = "warning: stdout was closed (its reader exited); carrying on without writing to it"
"""The default notice of a closed stdout (``hisparse run`` adds where the results go)."""


class PipeGuard:
    """A text stream that stops writing to ``stream`` once its pipe is closed (see module
    docstring); everything else is ``stream``'s.

    Parameters
    ----------
    stream
        The stream written to (``sys.stdout``, a console's file).
    notice
        Said once on ``notice_to`` when the pipe closes (``None``: nothing).
    notice_to
        Where ``notice`` goes (stderr; a guard itself where it may close too).
    """

    def __init__(
        self, stream: IO[str], notice: str | None = None, notice_to: IO[str] | None = None
    ) -> None:
        self.stream, self.notice, self.notice_to = stream, notice, notice_to
        self.closed_pipe = False
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        if not self.closed_pipe:
            try:
                return self.stream.write(text)
            except BrokenPipeError:
                self._pipe_closed()
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if not self.closed_pipe:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._pipe_closed()

    def isatty(self) -> bool:
        try:
            return self.stream.isatty()
        except (OSError, ValueError):
            return False

    def __getattr__(self, name: str) -> object:  # fileno, encoding, getvalue, ...
        if name == "stream":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.stream, name)

    def _pipe_closed(self) -> None:
        with self._lock:
            if self.closed_pipe:
                return
            self.closed_pipe = True
        _to_devnull(self.stream)
        if self.notice and self.notice_to is not None:
            try:
                self.notice_to.write(self.notice.rstrip("\n") + "\n")
                self.notice_to.flush()
            except (OSError, ValueError):  # stderr closed too: nobody to tell
                pass


def guard(stream: IO[str], notice: str | None = None, notice_to: IO[str] | None = None) -> IO[str]:
    """``stream`` in a :class:`PipeGuard` (``stream`` itself if it is one already, with a
    ``notice`` given here replacing the general one: the app guards stdout for every
    command, and ``run`` then says where its results go)."""
    if isinstance(stream, PipeGuard):
        if notice is not None and (stream.notice is None or stream.notice == STDOUT_CLOSED):
            stream.notice = notice
            if notice_to is not None:
                stream.notice_to = notice_to
        return stream
    return cast(IO[str], PipeGuard(stream, notice, notice_to))


def guard_consoles(console: Console, err_console: Console, notice: str = STDOUT_CLOSED) -> None:
    """Guard the files of ``console`` (stdout: ``notice`` on stderr when it closes) and
    ``err_console`` (stderr: silently)."""
    err_console.file = guard(err_console.file)
    console.file = guard(console.file, notice, err_console.file)


def _to_devnull(stream: IO[str]) -> None:
    """Point the file descriptor under ``stream`` (where it has one) at ``os.devnull``."""
    try:
        fd = stream.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
    except (AttributeError, OSError, ValueError):  # a StringIO, a test's stream
        return
    try:
        os.dup2(devnull, fd)
    except OSError:  # the writes are dropped all the same
        pass
    finally:
        os.close(devnull)


def guard_std_streams(notice: str | None = STDOUT_CLOSED) -> None:
    """:func:`guard` ``sys.stdout`` and ``sys.stderr`` themselves, for the commands that
    print through ``typer.echo`` and consoles made without a file (``hisparse eval``,
    ``hisparse bench``: their results go to files, ``eval.json`` / ``bench.json``, so a
    closed stdout must not stop them either). ``notice=None``: silent, as the app guards
    every command (``hisparse plan | head -1`` ends quietly, as other tools do).
    Idempotent."""
    import sys

    sys.stderr = guard(sys.stderr)
    sys.stdout = guard(sys.stdout, notice, sys.stderr)
