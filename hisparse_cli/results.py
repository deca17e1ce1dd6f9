"""Output files: ``results.jsonl`` (one line per finished job) and ``<output>.txt``.

Durability:

- ``<output>.txt`` is written to a temporary file in the same folder, fsynced, then
  moved over the target with ``os.replace``: a reader sees the old file or the new
  one, never half of one.
- Each ``results.jsonl`` line is one ``os.write`` on a descriptor opened with
  ``O_APPEND``, followed by ``fsync``. A kill can at worst leave the *last* line
  truncated; :func:`read_results` ignores it with a warning, and the next run
  (:meth:`ResultsLog.set_aside_broken_lines`, holding the lock) moves its bytes to a new
  ``results.jsonl.partial`` file (``.partial.2`` ... beside an earlier one, never over it)
  and cuts ``results.jsonl`` back to its last complete line, so the file stays valid JSON
  lines; so it does with a line in the middle that is not JSON (a cut-short line an
  earlier version left there, appending after it). If that is not done, the next append
  starts with a newline so the damage never spreads.
- Lines are never rewritten: a redone job appends a new line and readers take the
  last line per id. The one exception is :meth:`ResultsLog.compact`, which drops
  failure lines without text that a later line of the same id superseded (so jobs
  that fail on every run do not grow the file), replacing the file atomically.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import secrets
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self

from engine.events import AuditStats, CacheStats, JobResult
from hisparse_cli.display import escaped
from hisparse_cli.naming import EarlierJob
from hisparse_cli.textio import input_identity

RESULTS_FILE = "results.jsonl"
PARTIAL_FILE = RESULTS_FILE + ".partial"
"""Where the bytes of cut-short ``results.jsonl`` lines are moved (``.partial.2`` ... when
it exists: :meth:`ResultsLog.set_aside_broken_lines`)."""
LOCK_FILE = ".hisparse.lock"
SUCCESS_REASONS = ("stop", "length")
RESULT_KEYS = ("id", "output", "key", "finish_reason")
"""Keys every ``results.jsonl`` line hisparse wrote has (every version's): a file with
content and no such line is someone else's (:func:`is_hisparse_results`)."""
FINAL_INPUT, FINAL_PROMPT = "input", "prompt"
"""Values of a failure line's ``final``: the inputs were refused for their content, or
the prompt for its length. Either fails again with the same resume key."""


class OutputDirBusy(Exception):
    """Another process holds the output directory's lock."""


FULL_DISK = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up"}
"""The errors of a disk with no room left, in words."""


class WriteFailed(OSError):
    """Writing one of the run's files (``results.jsonl``, ``config.json``, a result file)
    failed: a full disk, a file made read-only meanwhile. ``errno``, ``strerror`` and
    ``filename`` are the system's error's, ``filename`` the file meant (not a temporary
    one); ``str()`` is one line naming it (:func:`write_problem`). ``removed``: a result
    file removed because this failure left no line recording it; ``reported``: the
    error was shown already (the run sets both)."""

    def __init__(self, path: Path, exc: OSError) -> None:
        super().__init__(exc.errno, exc.strerror or str(exc), str(path))
        self.message = write_problem(path, exc)
        self.removed: Path | None = None
        self.reported = False

    def __str__(self) -> str:
        return self.message


def write_problem(path: Path, exc: OSError, also: str = "") -> str:
    """``cannot write PATH (the system's reason)``, then ``also`` (what became of the
    files); for a full disk or quota (:data:`FULL_DISK`) it says so, and what to do."""
    full = FULL_DISK.get(exc.errno or 0)
    reason = f"{exc.strerror or exc}: {full}" if full else f"{exc.strerror or exc}"
    text = f"cannot write {escaped(str(path))} ({reason}){also}"
    if full:
        text += (
            "; free space on that disk (or choose an --output-dir on another disk) and run again: "
            f"jobs already recorded in {RESULTS_FILE} are skipped"
        )
    return text


def utc_now() -> str:
    """Current time as an ISO 8601 UTC string with milliseconds."""
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def json_line(obj: Any) -> str:
    """``obj`` as one line of JSON (no newline), other than ASCII characters kept as they
    are, except where it holds a lone surrogate (the name of a file that is not UTF-8, as
    Python decodes it: ``caf\\udce9.txt``), which UTF-8 cannot encode: that line is written
    with ``\\uXXXX`` escapes, still valid JSON that reads back as the same string (the
    results line of such a document was lost: the run stopped with an encoding error)."""
    line = json.dumps(obj, ensure_ascii=False, default=str)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj, default=str)
    return line


def marked_document(
    data: bytes, marker: Mapping[str, Any], earlier: Callable[[dict], bool] | None = None
) -> bool:
    """Whether ``data``, the bytes of a file hisparse writes (``config.json``,
    ``eval.json``, ``bench.json``), is one it wrote: a JSON object holding every item of
    ``marker``, or one ``earlier`` accepts (the same file of versions before the marker).
    An empty file is taken as one (replacing it loses nothing); any other file is
    someone else's, which hisparse must not replace, ``--force`` or not."""
    if not data.strip():
        return True
    try:
        document = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return False
    if not isinstance(document, dict):
        return False
    if all(document.get(k) == v for k, v in marker.items()):
        return True
    return earlier is not None and earlier(document)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8) atomically and durably.

    Hidden temp file in the same folder -> write -> fsync -> ``os.replace`` -> fsync the folder.
    """
    write_bytes_atomic(path, text.encode("utf-8"))


def _write_synced(fd: int, data: bytes) -> None:
    """Write ``data`` to the new file open on ``fd`` (closed here) and sync it to disk."""
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably (as :func:`write_text_atomic`).

    Raises
    ------
    WriteFailed
        It could not be written (a full disk): ``path`` is as it was, no temporary file left.
    """
    path = Path(path)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # mode as umask allows
    except OSError as exc:
        raise WriteFailed(path, exc) from exc
    try:
        _write_synced(fd, data)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):  # a full disk: the file named, not the temporary one
            raise WriteFailed(path, exc) from exc
        raise
    _fsync_dir(path.parent)


def lock_file_problem(output_dir: Path) -> str | None:
    """Why the run's lock file in the existing folder ``output_dir`` cannot be opened
    (:func:`lock_output_dir`), or ``None``: ``os.access`` says yes to root even where no
    file can be made (``/sys``, ``/proc``), so this makes one, a probe removed at once
    (not the lock file itself: another run may be about to take it)."""
    path = Path(output_dir) / LOCK_FILE
    try:
        if path.exists():
            os.close(os.open(path, os.O_RDWR))
        else:
            probe = path.parent / f".hisparse.probe.{os.getpid()}.{secrets.token_hex(4)}"
            os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644))
            os.unlink(probe)
    except OSError as exc:
        return f"cannot create its lock file {escaped(str(path))} ({exc.strerror or exc})"
    return None


def results_file_problem(output_dir: Path) -> str | None:
    """Why ``output_dir``'s existing ``results.jsonl`` cannot be opened to read it and
    append to it (a run does both: :class:`ResultsLog`), or ``None`` (no such file, or it
    can): ``chmod 444`` on it let the jobs run, then every line failed. Opens it, as
    ``os.access`` says yes to root."""
    path = Path(output_dir) / RESULTS_FILE
    if not path.is_file():
        return None
    try:
        os.close(os.open(path, os.O_RDWR | os.O_APPEND))
    except OSError as exc:
        return (
            f"{escaped(str(path))} cannot be opened for reading and writing "
            f"({exc.strerror or exc}); a run reads it and appends a line there for each job: "
            "make it writable (chmod u+rw), or choose another --output-dir"
        )
    return None


@contextlib.contextmanager
def lock_output_dir(output_dir: Path, option: str = "--output-dir") -> Iterator[None]:
    """Hold an exclusive advisory lock on ``output_dir`` (``flock`` on a lock file).

    Two runs appending to one ``results.jsonl`` would redo each other's jobs; the second
    one gets :class:`OutputDirBusy` instead (its message names ``option``, the flag that
    gave the folder). Where ``fcntl`` is missing, no lock is taken.

    Raises
    ------
    OutputDirBusy
        The lock is held by another process.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on POSIX
        yield
        return
    path = Path(output_dir) / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            who = f" (process {holder})" if holder.isdigit() else ""
            raise OutputDirBusy(
                f"another hisparse run{who} is using {escaped(str(output_dir))}: it holds the "
                f"lock on {escaped(str(path))}; wait for it to end, or choose another {option}"
            ) from None
        try:
            os.ftruncate(fd, 0)  # the holder's process id, for the message above
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:  # a full disk
            raise WriteFailed(path, exc) from exc
        yield
    finally:
        os.close(fd)


def is_success(record: dict[str, Any]) -> bool:
    """A results line counts as done: finish_reason ``stop``/``length`` and no error."""
    return record.get("finish_reason") in SUCCESS_REASONS and not record.get("error")


@dataclass(frozen=True)
class ExistingResults:
    """What an earlier run left in ``results.jsonl``.

    latest: id -> last valid line for that id.
    latest_success: id -> last successful line for that id (the one whose text the output
        file holds: a failed or cancelled run writes no text).
    latest_by_key: (id, resume key) -> last line for that id with that key.
    truncated_tail: the bytes of a truncated last line (a write cut short: its job's text
        file may exist without a whole line naming it).
    warnings: human-readable notes on ignored lines.
    needs_newline: the file does not end in ``\\n`` (a truncated last line).
    """

    latest: dict[str, dict[str, Any]] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    needs_newline: bool = False
    latest_success: dict[str, dict[str, Any]] = field(default_factory=dict)
    latest_by_key: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    truncated_tail: bytes = b""


def read_results(path: Path) -> ExistingResults:
    """Read ``results.jsonl``; a missing file is empty, bad lines are skipped with a warning."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return ExistingResults()
    latest: dict[str, dict[str, Any]] = {}
    success: dict[str, dict[str, Any]] = {}
    by_key: dict[tuple[str, str], dict[str, Any]] = {}
    tail = b""
    warnings: list[str] = []
    shown = escaped(str(path))
    lines = data.split(b"\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        record = _parse_line(line)
        if record is not None:
            latest[record["id"]] = record
            if is_success(record):
                success[record["id"]] = record
            by_key[(record["id"], str(record.get("key")))] = record
        elif number == len(lines):
            tail = line
            warnings.append(f"{shown}: ignoring truncated last line {number} (interrupted write)")
        else:
            warnings.append(f"{shown}: ignoring line {number}: not a JSON object with an id")
    return ExistingResults(
        latest, tuple(warnings), bool(data) and not data.endswith(b"\n"), success, by_key, tail
    )


def is_hisparse_results(data: bytes) -> bool:
    """Whether ``data``, the bytes of a ``results.jsonl``, is one hisparse wrote: empty,
    or with a line that is a JSON object with :data:`RESULT_KEYS`, or one that is not
    JSON but starts as hisparse starts its lines (``{"id": ``: a write a kill cut short,
    which the run sets aside to :data:`PARTIAL_FILE`). Any other file is someone else's,
    which a run must not append to."""
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        if not _is_json(line):
            if line.startswith(b'{"id": '):
                return True
            continue
        record = _parse_line(line)
        if record is not None and all(k in record for k in RESULT_KEYS):
            return True
    return not data.strip()


def earlier_outputs(output_dir: Path) -> set[Path]:
    """The files earlier runs wrote in ``output_dir``, resolved: the ``output`` of each
    id's last successful ``results.jsonl`` line (a failure line wrote none); none when
    there is no file or it cannot be read."""
    try:
        success = read_results(Path(output_dir) / RESULTS_FILE).latest_success
    except OSError:
        return set()
    names = [r["output"] for r in success.values() if isinstance(r.get("output"), str)]
    return {(Path(output_dir) / name).resolve() for name in names}


def earlier_jobs(output_dir: Path) -> list[EarlierJob]:
    """The jobs earlier runs recorded in ``output_dir``'s ``results.jsonl`` (the last
    line of each id; none when there is no file or it cannot be read — the run reports
    that when it opens it), for :func:`hisparse_cli.naming.derive_ids`. A line whose
    ``input`` is not a non-empty list of strings keeps no inputs; its id and output are
    still avoided."""
    try:
        latest = read_results(Path(output_dir) / RESULTS_FILE).latest
    except OSError:
        return []
    return jobs_of(latest)


def jobs_of(latest: dict[str, dict[str, Any]]) -> list[EarlierJob]:
    """:class:`~hisparse_cli.naming.EarlierJob` of each id's last line (``latest`` as in
    :class:`ExistingResults`): the inputs it was given (:func:`given_inputs`) resolved
    (``-``, standard input, kept as it is), or none when ``input`` is not a non-empty list
    of strings; output ``output``, or the id
    when that is not a string; ``input_sha256`` when it is a list of strings."""
    found: list[EarlierJob] = []
    for ident, record in latest.items():
        paths = tuple(input_identity(p) for p in given_inputs(record))
        hashes = record.get("input_sha256")
        if not (isinstance(hashes, list) and all(isinstance(h, str) for h in hashes)):
            hashes = []
        output = record.get("output")
        output = output if isinstance(output, str) else ident
        found.append(EarlierJob(ident, paths, output, tuple(hashes)))
    return found


def given_inputs(record: dict[str, Any]) -> list[str]:
    """The inputs a results line's job was given, in order: ``input`` (the files it read)
    with the files of ``input_left_out`` put back at their ``index``; none when ``input``
    is not a non-empty list of strings (a malformed ``input_left_out`` is ignored)."""
    inputs = record.get("input")
    if not (isinstance(inputs, list) and inputs and all(isinstance(p, str) for p in inputs)):
        return []
    given = list(inputs)
    left_out = record.get("input_left_out")
    entries = left_out if isinstance(left_out, list) else []
    if not all(
        isinstance(e, dict) and isinstance(e.get("path"), str) and type(e.get("index")) is int
        for e in entries
    ):
        return given
    for entry in sorted(entries, key=lambda e: e["index"]):
        given.insert(entry["index"], entry["path"])
    return given


def _is_json(line: bytes) -> bool:
    """Whether ``line`` is a JSON value (of any kind): one that is not was cut short."""
    try:
        json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return False
    return True


def _new_partial_file(folder: Path, data: bytes) -> Path:
    """Write ``data`` durably to a new file :data:`PARTIAL_FILE` in ``folder``, or
    ``.partial.2``, ``.partial.3`` ... when it exists (an earlier run's is never
    overwritten); its path."""
    number = 1
    while True:
        path = Path(folder) / (PARTIAL_FILE if number == 1 else f"{PARTIAL_FILE}.{number}")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            number += 1
            continue
        except OSError as exc:
            raise WriteFailed(path, exc) from exc
        try:
            _write_synced(fd, data)
        except OSError as exc:  # a full disk: nothing moved, results.jsonl as it was
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise WriteFailed(path, exc) from exc
        _fsync_dir(path.parent)
        return path


def _parse_line(line: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("id"), str) else None


class ResultsLog:
    """Append-only ``results.jsonl`` of one output directory.

    Use as a context manager; :meth:`append` is durable when it returns.
    """

    def __init__(self, output_dir: Path) -> None:
        self.path = Path(output_dir) / RESULTS_FILE
        self.existing = read_results(self.path)
        self.latest: dict[str, dict[str, Any]] = dict(self.existing.latest)
        """id -> its last line, earlier runs' and those appended since."""
        self._needs_newline = self.existing.needs_newline
        self._fd: int | None = None

    def is_done(self, job_id: str, key: str) -> bool:
        """Whether the last *successful* line for ``job_id`` has resume key ``key``, is the
        last line with that key, and its output file (``output`` of that line, in this
        directory) still exists: a deleted output, or a later failure with the same
        settings, means the job is run again. Later failed or cancelled lines with other
        settings wrote no text, so the file is still that line's result."""
        record = self.existing.latest_success.get(job_id)
        if record is None or record.get("key") != key:
            return False
        if self.existing.latest_by_key.get((job_id, str(key))) is not record:
            return False
        output = record.get("output")
        return not isinstance(output, str) or (self.path.parent / output).is_file()

    def final_failure(self, job_id: str, key: str, kind: str) -> dict[str, Any] | None:
        """The last line for ``job_id`` when it is a final failure (``final`` equal to
        ``kind``, :data:`FINAL_INPUT` or :data:`FINAL_PROMPT`) with resume key ``key``:
        the job would fail the same way again. Otherwise ``None``."""
        record = self.existing.latest.get(job_id)
        if record is None or not key or record.get("key") != key or is_success(record):
            return None
        return record if record.get("final") == kind else None

    def set_aside_broken_lines(self) -> str | None:
        """Move the lines of ``results.jsonl`` that are not JSON (a truncated last line,
        a write a kill cut short; or such a line in the middle, where an earlier version
        appended after it) to a new :data:`PARTIAL_FILE` (their bytes, each followed by a
        newline; written and synced first, so a crash leaves them in both files, never in
        neither), then replace ``results.jsonl`` atomically with the other lines, ending
        in a newline: the file is valid JSON lines again. Lines that are JSON but not an
        object with an id are left (and warned about) as they are. Call it holding the
        output dir's lock, before :meth:`append`. :attr:`existing` is read again, but keeps
        its ``truncated_tail`` (the cut job's text file may be replaced).

        Returns
        -------
        str or None
            What was done, naming the lines and the file they went to (for stderr); ``None``
            when every line was JSON.
        """
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        lines = data.split(b"\n")
        broken = [n for n, line in enumerate(lines) if line.strip() and not _is_json(line)]
        if not broken:
            return None
        moved = b"".join(lines[n] + b"\n" for n in broken)
        partial = _new_partial_file(self.path.parent, moved)
        kept = b"\n".join(line for n, line in enumerate(lines) if n not in broken)
        if kept and not kept.endswith(b"\n"):
            kept += b"\n"
        write_bytes_atomic(self.path, kept)
        self.close()  # the file was replaced: appends reopen it
        tail = self.existing.truncated_tail
        self.existing = dataclasses.replace(read_results(self.path), truncated_tail=tail)
        self.latest = dict(self.existing.latest)
        self._needs_newline = False
        last = len(lines) - 1
        what = [
            f"truncated last line {n + 1} (interrupted write)"
            if n == last
            else f"line {n + 1} (not JSON: a line cut short, with lines appended after it)"
            for n in broken
        ]
        size = len(moved)  # as the .partial file holds them: each with its newline
        return (
            f"{escaped(str(self.path))}: {', '.join(what)}: moved "
            f"{'its' if len(broken) == 1 else 'their'} {size} bytes to {escaped(str(partial))} "
            f"(a new file); {self.path.name} now holds only its "
            "complete lines"
        )

    def compact(self) -> int:
        """Drop superseded failure lines from ``results.jsonl``: a line that did not
        succeed (an error, or ``cancelled`` with its partial text) and has a later line
        with the same id, so repeated failures or Ctrl-C and resume leave one line per job
        for its latest state. Successful lines and lines that cannot be read stay, in order. The file is replaced atomically (same folder,
        fsync, ``os.replace``) and only when a line is dropped; call it while holding the
        output dir's lock, before :meth:`append`.

        Returns
        -------
        int
            Lines dropped.
        """
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return 0
        lines = data.split(b"\n")
        records = [_parse_line(line) if line.strip() else None for line in lines]
        last: dict[str, int] = {}
        for number, record in enumerate(records):
            if record is not None:
                last[record["id"]] = number
        dropped = {
            n
            for n, r in enumerate(records)
            if r is not None and last[r["id"]] != n and not is_success(r)
        }
        if not dropped:
            return 0
        kept = b"\n".join(line for n, line in enumerate(lines) if n not in dropped)
        write_bytes_atomic(self.path, kept)
        return len(dropped)

    def append(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line: a single ``write`` then ``fsync``.

        Raises
        ------
        WriteFailed
            The line could not be written (a full disk, a file made read-only): what part
            of it was written is cut off again, so the file keeps only complete lines.
        """
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            size = os.lseek(self._fd, 0, os.SEEK_END)  # the lock is held: no other writer
        except OSError as exc:
            raise WriteFailed(self.path, exc) from exc
        line = json_line(record) + "\n"
        data = (("\n" if self._needs_newline else "") + line).encode("utf-8")
        try:
            written = os.write(self._fd, data)
            while written < len(data):  # only on exotic filesystems (or a disk filling up)
                written += os.write(self._fd, data[written:])
            os.fsync(self._fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, size)
            raise WriteFailed(self.path, exc) from exc
        self._needs_newline = False
        self.latest[record["id"]] = record

    def close(self) -> None:
        """Close the file (appending again reopens it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class AuditLimits:
    """When a job's audit (``--audit``) is flagged: top-1 agreement below
    ``min_agreement`` (0-1) or mean KL(dense || sparse) above ``max_kl`` (nats;
    ``None``: not checked)."""

    min_agreement: float = 0.75
    max_kl: float | None = None

    def problem(self, audit: AuditStats) -> str:
        """Why ``audit`` is flagged, or ``""``. A job with no audited step is not."""
        if not audit.steps:
            return ""
        why = []
        if audit.top1_agreement < self.min_agreement:
            why.append(
                f"top-1 agreement with dense {audit.top1_agreement:.0%} < "
                f"{self.min_agreement:.0%} (--audit-min-agreement)"
            )
        if self.max_kl is not None and audit.kl_mean > self.max_kl:
            why.append(f"mean KL {audit.kl_mean:.3g} > {self.max_kl:g} nats (--audit-max-kl)")
        return "; ".join(why)


def audit_figures(audit: AuditStats) -> dict[str, Any]:
    """An audit's figures as a results line gives them: ``steps``, ``top1_agreement``,
    ``kl_mean``, ``kl_max`` (nats), ``mass_kept_mean`` (0-1) and ``seconds`` the audit
    took. With no audited step (a reply shorter than the first scheduled one) the figures
    are ``None``: nothing was compared."""
    known = audit.steps > 0
    return {
        "steps": audit.steps,
        "top1_agreement": audit.top1_agreement if known else None,
        "kl_mean": audit.kl_mean if known else None,
        "kl_max": audit.kl_max if known else None,
        "mass_kept_mean": min(audit.mass_kept_mean, 1.0) if known else None,
        "seconds": audit.seconds,
    }


def audit_record(audit: AuditStats, limits: AuditLimits) -> dict[str, Any]:
    """The ``audit`` field of a results line: :func:`audit_figures`, ``flagged`` and,
    when flagged, ``flag_reason``."""
    why = limits.problem(audit)
    record = {**audit_figures(audit), "flagged": bool(why)}
    if why:
        record["flag_reason"] = why
    return record


def cache_record(cache: CacheStats) -> dict[str, Any]:
    """The ``cache`` field of a results line: ``hits``, ``misses`` (records attention
    selected), ``hit_rate`` (0-1), ``prefetched`` (records) and ``h2d_bytes``
    (:class:`engine.events.CacheStats`)."""
    return {
        "hits": cache.hits,
        "misses": cache.misses,
        "hit_rate": cache.hit_rate,
        "prefetched": cache.prefetched,
        "h2d_bytes": cache.h2d_bytes,
    }


def result_record(
    base: dict[str, Any], result: JobResult, audit_limits: AuditLimits | None = None
) -> dict[str, Any]:
    """A results line for a job the engine finished.

    Parameters
    ----------
    base
        Job facts known before it ran (id, output, input, input_sha256, key,
        settings_hash, task, model, truncated, started_at).
    result
        The engine's result; with an audit (``--audit``) the line gets an ``audit``
        field (:func:`audit_record`, flagged by ``audit_limits``).
    """
    extra = {}
    if result.audit is not None:
        extra["audit"] = audit_record(result.audit, audit_limits or AuditLimits())
    return {
        **base,
        "ok": result.finish_reason in SUCCESS_REASONS and not result.error,
        "prompt_tokens": result.prompt_tokens,
        "generated_tokens": len(result.token_ids),
        "text": result.text,
        "finish_reason": result.finish_reason,
        "ttft_s": result.ttft_s,
        "prefill_tok_s": result.prefill_tok_s,
        "decode_tok_s": result.decode_tok_s,
        "cache": cache_record(result.cache),
        **extra,
        "error": result.error,
        "finished_at": utc_now(),
    }


def failure_record(base: dict[str, Any], error: str) -> dict[str, Any]:
    """A results line for a job that failed before or during the engine run.

    ``prompt_tokens`` is ``base["prompt_tokens"]``: the prompt's length when it was
    tokenised (e.g. a prompt longer than the context), ``None`` (JSON ``null``) when it
    never was (an unreadable document). ``final`` is ``base["final"]``
    (:data:`FINAL_INPUT`, :data:`FINAL_PROMPT`) when the same key would fail again, else
    ``None``. Resume (:meth:`ResultsLog.is_done`, :meth:`ResultsLog.final_failure`)
    reads only ``id``, ``key``, ``finish_reason``, ``error`` and ``final``. The timing
    and cache fields of a finished job's line are present as ``None`` (the same keys on
    every line, so a reader need not test for them).
    """
    return {
        **base,
        "ok": False,
        "prompt_tokens": base.get("prompt_tokens"),
        "generated_tokens": 0,
        "text": "",
        "finish_reason": "error",
        "ttft_s": None,
        "prefill_tok_s": None,
        "decode_tok_s": None,
        "cache": None,
        "started_at": base.get("started_at"),
        "error": error,
        "final": base.get("final"),
        "finished_at": utc_now(),
    }


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
