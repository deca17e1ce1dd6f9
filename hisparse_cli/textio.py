"""Reading documents: decoding, normalising and refusing what is not text.

Policy (applied in this order):

1. The file is read as bytes; its SHA-256 is the content hash used for resume.
2. Refused as binary: a known binary signature (PDF, ZIP/Office, PNG, JPEG, GIF,
   gzip, ELF), or, for ASCII-compatible encodings, more than 1% NUL bytes or more than
   5% control bytes (:data:`CONTROL_CHARS`, those step 5 removes, but
   :data:`TEXT_CONTROLS`: escape, form feed, vertical tab) in the first 64 KiB
   (the message gives the byte offset of the first NUL or control byte; NULs at every other byte add a hint that the file looks like
   UTF-16 without a byte-order mark). ``allow_binary`` (``--allow-binary``) overrides the NUL
   and control-byte test, not the signatures: such a document is decoded with
   ``errors="replace"`` and carries a :attr:`Document.warning`.
   Under a UTF-16/32 ``encoding``, a file without a byte-order mark that is valid UTF-8
   and has no NUL byte is refused: it is not UTF-16/32 text (decoded so, ASCII becomes CJK
   gibberish).
3. A byte-order mark (UTF-8, UTF-16 or UTF-32, little- or big-endian) is unambiguous: a
   file that starts with one is decoded in that encoding whatever ``encoding`` says, and
   the mark is dropped. Other files are decoded with ``encoding`` (default UTF-8).
   Invalid bytes raise an error naming the byte offset and line, unless
   ``errors="replace"``.
4. CRLF and lone CR become ``\\n``. Tabs and long lines are kept as they are.
5. Terminal escape sequences (``ESC [ 31 m`` and the like: :data:`ANSI_SEQUENCE`) are
   removed whole, then the remaining C0 control characters other than ``\\t`` and ``\\n``
   (a stray NUL, a lone escape byte, form feed ...) and DEL are **removed**; the count of
   control characters is reported so the caller can warn.
6. A document that is empty or only whitespace after this is refused (one that had
   only NUL/control bytes, read with ``allow_binary``, says so); invisible
   characters count as whitespace there (zero-width and other format characters such as
   U+200B or U+FEFF, every space, line and paragraph separator, fillers and variation
   selectors: :func:`is_invisible`), so a file of only those is refused too, naming them.

Every failure is a :class:`DocumentError` carrying the path and the reason.

Standard input is the document :data:`STDIN` (``-`` on the command line): its bytes are
read once by the caller and passed as ``stdin``; the same policy applies, and messages
name it ``standard input``.
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import os
import re
import stat
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SAMPLE_BYTES = 64 * 1024
MAX_DOCUMENT_BYTES = 1 << 30
"""Largest document read, 1 GiB (about 250M tokens, far past any context or map-reduce
run): a larger file, or standard input that goes on past it (``/dev/zero``), fails its
job instead of filling the memory."""

MAX_NUL_SHARE = 0.01
MAX_CONTROL_SHARE = 0.05
ERROR_MODES = ("strict", "replace")

_SIGNATURES = {
    b"%PDF-": "a PDF file",
    b"PK\x03\x04": "a ZIP archive (or .docx/.xlsx/.epub)",
    b"\x89PNG": "a PNG image",
    b"\xff\xd8\xff": "a JPEG image",
    b"GIF8": "a GIF image",
    b"\x1f\x8b": "a gzip archive",
    b"\x7fELF": "an executable",
}
_BOMS = (  # UTF-32 first: its little-endian mark starts with UTF-16's
    (codecs.BOM_UTF32_LE, "utf-32-le"),
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)
CONTROL_CHARS = "".join(chr(c) for c in (*range(32), 0x7F) if chr(c) not in "\t\n\r")
"""The control characters: C0 but tab, newline and carriage return (which becomes a
newline), and DEL. One definition for what step 5 removes (and counts, and locates) and
for what the binary test of step 2 counts and locates as control bytes (NUL among them)."""
TEXT_CONTROLS = "\x1b\f\v"
"""Control characters that text files carry: escape (terminal colours in captured logs,
``ls --color``, build output), form feed and vertical tab (page breaks). Reading removes
them like the others, but the binary test does not count them: a coloured log is text."""
_CONTROL_BYTES = "".join(c for c in CONTROL_CHARS if c not in TEXT_CONTROLS).encode("ascii")
_CONTROL_CHARS = re.compile(f"[{re.escape(CONTROL_CHARS)}]")
_CONTROL_BYTE = re.compile(b"[" + re.escape(_CONTROL_BYTES) + b"]")

STDIN = Path("-")
"""The input path that stands for standard input (``hisparse run -``)."""
STDIN_NAME = "stdin"
"""Its name where a file's name goes (the job id, ``$name`` in templates)."""


def shown_path(path: Path | str) -> str:
    """``path`` as messages name it: ``standard input`` for :data:`STDIN`; control
    characters (a newline, an escape sequence) escaped (:func:`~hisparse_cli.display.escaped`)."""
    from hisparse_cli.display import escaped

    return "standard input" if Path(path) == STDIN else escaped(str(path))


def document_name(path: Path | str) -> str:
    """A document's file name (``$name``), :data:`STDIN_NAME` for standard input."""
    return STDIN_NAME if Path(path) == STDIN else Path(path).name


def broken_link(path: Path | str) -> str | None:
    """``None``, or, when ``path`` is a symbolic link whose target does not exist, what
    to say about it: ``is a broken symbolic link: it points to 'nowhere.txt'
    (/abs/nowhere.txt), which does not exist``."""
    path = Path(path)
    if path == STDIN or not path.is_symlink():
        return None
    try:
        path.stat()
        return None  # the target exists (or a loop: that says so itself)
    except FileNotFoundError:
        pass
    except OSError:
        return None
    try:
        target = os.readlink(path)
    except OSError:
        return None
    where = Path(os.path.abspath(path.parent / target))
    shown = repr(target) if str(where) == target else f"{target!r} ({shown_path(where)})"
    return f"is a broken symbolic link: it points to {shown}, which does not exist"


def file_identity(path: Path | str) -> tuple[int, int] | Path:
    """What tells two named files apart when they are read: the device and inode of the
    file a path leads to, so a symbolic link, another spelling (``a/../b``) and a hard
    link (``ln a.txt b.txt``: one file under two names) of one file are the same; the
    resolved path where the file cannot be looked up (missing), :data:`STDIN` itself for
    standard input."""
    if Path(path) == STDIN:
        return STDIN
    try:
        info = os.stat(path)
    except OSError:
        return Path(path).resolve()
    return (info.st_dev, info.st_ino)


def input_identity(path: Path | str) -> Path:
    """What tells inputs apart: the resolved path, :data:`STDIN` itself for standard
    input (``-`` is no file in the current directory)."""
    return STDIN if Path(path) == STDIN else Path(path).resolve()


class DocumentError(Exception):
    """A document that cannot be used as text.

    Attributes
    ----------
    path : Path
        The offending file (:data:`STDIN` for standard input).
    reason : str
        What is wrong with it, and what to do about it when there is a fix.
    sha256 : str or None
        Hex digest of the bytes that were refused: set when the refusal follows from the
        content (binary, undecodable, empty), so reading the same bytes with the same
        options fails again; ``None`` when the file could not be read at all.
    empty : bool
        The document has no text to read (:data:`EMPTY`, or only invisible characters):
        of a job over several files it is left out (:func:`read_documents`).
    """

    def __init__(
        self, path: Path | str, reason: str, sha256: str | None = None, empty: bool = False
    ) -> None:
        super().__init__(f"{shown_path(path)}: {reason}")
        self.path = Path(path)
        self.reason = reason
        self.sha256 = sha256
        self.empty = empty


@dataclass(frozen=True)
class Document:
    """A decoded, normalised document.

    sha256: hex digest of the file's bytes as stored on disk.
    removed_controls: how many control characters step 5 of the policy removed.
    first_control: where the first of them was in the file, ``(byte offset, line)``
        (offset 0-based, counted in the file as stored, BOM included; line 1-based), or
        ``None`` when none was removed.
    removed_nuls, first_nul: how many of them were NULs, and where the first NUL was (as
        ``first_control``; the binary test's message names it).
    warning: set when the document looked binary and was read anyway (``allow_binary``);
        names the file and says what was done.
    left_out: of the first document of a job over several files
        (:func:`read_documents`), the files the job left out, each with its refusal's
        reason (empty or only invisible characters).
    bom_encoding: the codec of the byte-order mark the file starts with, which decided
        its decoding whatever ``encoding`` asked (:func:`text_codec`); ``None`` without one.
    """

    path: Path
    text: str
    sha256: str
    removed_controls: int = 0
    warning: str = ""
    first_control: tuple[int, int] | None = None
    left_out: tuple[tuple[Path, str], ...] = ()
    removed_nuls: int = 0
    first_nul: tuple[int, int] | None = None
    bom_encoding: str | None = None

    @property
    def control_note(self) -> str:
        """``""``, or what step 5 removed from this file and where the first one was; when
        NULs were among them, how many and where the first NUL was (what the binary
        test's message gives, so the two agree)."""
        if not self.removed_controls:
            return ""
        where = ""
        if self.first_control is not None:
            offset, line = self.first_control
            where = f" (the first at byte offset {offset}, line {line})"
        if self.removed_nuls:
            where += f"; {self.removed_nuls} of them NUL bytes"
            if self.first_nul is not None:
                offset, line = self.first_nul
                where += f", the first at byte offset {offset} (line {line})"
        source = shown_path(self.path)
        return f"removed {self.removed_controls} control character(s) from {source}{where}"


def read_document(
    path: Path | str,
    encoding: str = "utf-8",
    errors: str = "strict",
    allow_binary: bool = False,
    stdin: bytes | None = None,
    reads_stdin: bool = True,
) -> Document:
    """Read one document following the module's policy.

    Parameters
    ----------
    path
        File to read.
    encoding
        A Python codec name (``utf-8``, ``latin-1``, ``utf-16``, ...).
    errors
        ``strict`` (invalid bytes are an error) or ``replace`` (U+FFFD).
    allow_binary
        Read a document that looks binary by its NUL / control bytes anyway, decoding
        with ``errors="replace"``; :attr:`Document.warning` says so. Known binary
        formats (PDF, ZIP, images, ...) are refused regardless.
    stdin
        The bytes of standard input, read when ``path`` is :data:`STDIN`.
    reads_stdin
        Whether the command takes a document on standard input (``hisparse run -``): its
        messages suggest it only then (``hisparse eval`` reads files only).

    Raises
    ------
    DocumentError
        Unreadable, binary, undecodable, or empty/whitespace-only; for :data:`STDIN`
        also when ``stdin`` is ``None`` (standard input was not read), or always when
        ``reads_stdin`` is false.
    """
    path = Path(path)
    data = _read_bytes(path, stdin, reads_stdin)
    asked = codecs.lookup(encoding).name
    digest = hashlib.sha256(data).hexdigest()
    refused = format_reason(data, asked)
    if refused:
        raise DocumentError(path, refused, digest)
    codec = text_codec(data, asked)
    warning = ""
    binary = looks_binary(data, codec)
    if binary and not allow_binary:
        raise DocumentError(
            path,
            f"{binary}; pass --allow-binary to read it as text anyway "
            "(invalid bytes become U+FFFD, control characters are removed)",
            digest,
        )
    if binary:
        errors = "replace"
        warning = f"{shown_path(path)}: {binary}; read as text because of --allow-binary "
        warning += "(invalid bytes replaced with U+FFFD, control characters removed)"
    try:
        text = decode_bytes(data, codec, errors)
    except ValueError as exc:
        raise DocumentError(path, str(exc), digest) from None
    first = first_control(data, text, codec) if _CONTROL_CHARS.search(text) else None
    nuls = text.count("\x00")
    first_nul = first_control(data, text, codec, "\x00") if nuls else None
    text, removed = normalise_text(text)
    if not text.strip():
        reason = EMPTY
        if removed:  # an all-NUL file read with --allow-binary: not "whitespace"
            of_them = f", {nuls} of them NUL" if nuls else ""
            reason = (
                f"has no text: only NUL/control bytes{' and whitespace' if text else ''}, "
                f"which are removed ({removed} control character(s){of_them})"
            )
        raise DocumentError(path, reason, digest, empty=True)
    if not has_visible(text):
        raise DocumentError(path, invisible_reason(text), digest, empty=True)
    first = first if removed else None
    bom = bom_codec(data)
    return Document(
        path,
        text,
        digest,
        removed,
        warning,
        first,
        removed_nuls=nuls,
        first_nul=first_nul,
        bom_encoding=bom[0] if bom is not None else None,
    )


def first_control(
    data: bytes, text: str, codec: str, chars: str = CONTROL_CHARS
) -> tuple[int, int] | None:
    """Where the first control character that :func:`normalise_text` removes (or, with
    ``chars``, the first of those) sits in the file: ``(byte offset, line)``, or ``None``
    if there is none.

    Parameters
    ----------
    data
        The file's bytes.
    text
        ``data`` decoded with ``codec`` (before :func:`normalise_text`).
    codec
        Normalised codec name. In an ASCII-compatible codec (UTF-8, Latin-1, cp1252...) a
        byte below 0x20 or 0x7F is that control character and never part of another
        character, so the offset is exact; in others (UTF-16...) it is the length of the
        encoded text before it.
    chars
        Some of :data:`CONTROL_CHARS` (``"\\x00"``: the first NUL).
    """
    if _ascii_compatible(codec):
        match = re.search(b"[" + re.escape(chars.encode("ascii")) + b"]", data)
        if match is None:
            return None
        at = match.start()
        return at, data[:at].count(b"\n") + 1
    match = re.search(f"[{re.escape(chars)}]", text)
    if match is None:
        return None
    before = text[: match.start()]
    try:
        own_bom = len("".encode(codec))  # utf-16/utf-32 put a BOM in front of every encode
        bom = len(data) - (len(text.encode(codec, "surrogatepass")) - own_bom)
        at = max(bom, 0) + len(before.encode(codec, "surrogatepass")) - own_bom
    except (UnicodeEncodeError, LookupError):
        at = len(before)
    return at, before.count("\n") + before.count("\r") - before.count("\r\n") + 1


EMPTY = "is empty or only whitespace"
""":class:`DocumentError` reason of a document with no text."""

_INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Zs", "Zl", "Zp"})
_BLANK_CHARS = frozenset(
    "\u034f\u115f\u1160\u17b4\u17b5\u180b\u180c\u180d\u180e\u180f\u2800\u3164\uffa0"
)
"""Characters of other categories that show nothing: the combining grapheme joiner,
Hangul fillers, Khmer inherent vowels, Mongolian variation selectors, the blank Braille
pattern."""


def is_invisible(char: str) -> bool:
    """Whether ``char`` shows nothing: whitespace, a control or format character (Unicode
    category Cc, Cf: U+200B-U+200D, U+2060, U+FEFF, U+00AD ...), a space, line or
    paragraph separator (Zs, Zl, Zp), a variation selector or a filler
    (:data:`_BLANK_CHARS`)."""
    if char.isspace() or char in _BLANK_CHARS:
        return True
    code = ord(char)
    if 0xFE00 <= code <= 0xFE0F or 0xE0100 <= code <= 0xE01EF:  # variation selectors
        return True
    return unicodedata.category(char) in _INVISIBLE_CATEGORIES


def has_visible(text: str) -> bool:
    """Whether ``text`` has a character that is not :func:`is_invisible` (the first
    character past the leading whitespace answers for nearly every document)."""
    at = 0
    while (found := _NOT_SPACE.search(text, at)) is not None:
        if not is_invisible(found.group()):
            return True
        at = found.end()
    return False


_NOT_SPACE = re.compile(r"\S")


def invisible_reason(text: str) -> str:
    """:class:`DocumentError` reason of a document with characters but no visible one:
    :data:`EMPTY`, then which invisible characters it holds (the first 5 kinds, ASCII
    whitespace left unnamed)."""
    kinds = list(dict.fromkeys(c for c in text if not c.isspace() or ord(c) > 0x7F))
    shown = ", ".join(f"U+{ord(c):04X} {unicodedata.name(c, '(unnamed)')}" for c in kinds[:5])
    more = f" and {len(kinds) - 5} more kind(s)" if len(kinds) > 5 else ""
    return (
        f"{EMPTY} or invisible characters: its {len(text)} character(s) show nothing "
        f"({shown}{more})"
    )


def read_documents(
    paths: Sequence[Path],
    encoding: str = "utf-8",
    errors: str = "strict",
    allow_binary: bool = False,
    stdin: bytes | None = None,
) -> list[Document]:
    """Read several documents (one job's inputs); the first failure raises. ``stdin``:
    the bytes of standard input, for an input :data:`STDIN`.

    Of a job over several files, an empty one adds nothing to the joined text, so it is
    left out with a warning (on the first document kept) instead of failing the job (a
    fresh user's ``input: '**/*.txt'`` failed for one empty file among six; a file of only
    invisible characters counts as empty, :attr:`DocumentError.empty`); a job whose files
    are all empty raises the first one's :class:`DocumentError`."""
    documents: list[Document] = []
    empty: list[DocumentError] = []
    for p in paths:
        try:
            documents.append(read_document(p, encoding, errors, allow_binary, stdin))
        except DocumentError as exc:
            if not exc.empty or len(paths) == 1:
                raise
            empty.append(exc)
    if not documents:
        raise empty[0]
    if empty:
        names = ", ".join(shown_path(e.path) for e in empty)
        note = f"left out {len(empty)} empty file(s) of the job's inputs: {names}"
        first = documents[0]
        warning = f"{first.warning}; {note}" if first.warning else note
        left_out = tuple((e.path, e.reason) for e in empty)
        documents[0] = dataclasses.replace(first, warning=warning, left_out=left_out)
    return documents


def join_documents(documents: Sequence[Document]) -> str:
    """One text for a job: a single document as is; several each under a
    ``--- <file name> ---`` header, separated by blank lines."""
    if len(documents) == 1:
        return documents[0].text
    return "\n\n".join(f"--- {d.path.name} ---\n{d.text.rstrip()}" for d in documents)


def binary_reason(data: bytes, codec: str) -> str | None:
    """Why ``data`` looks binary (or in the wrong encoding), or ``None`` if it looks like text.

    :func:`format_reason` or else :func:`looks_binary`.

    Parameters
    ----------
    data
        The file's bytes.
    codec
        Normalised codec name (``codecs.lookup(...).name``).
    """
    return format_reason(data, codec) or looks_binary(data, codec)


def format_reason(data: bytes, codec: str) -> str | None:
    """Why ``data`` is a known binary format or not in the asked encoding ``codec`` (by
    its first bytes), or ``None``. ``allow_binary`` does not override these.

    Under a UTF-16/32 ``codec``, a file with no byte-order mark whose first
    :data:`SAMPLE_BYTES` are valid UTF-8 without a NUL byte is not UTF-16/32 text (ASCII
    would decode as CJK gibberish, and fluently so); a file with a mark is read in the
    mark's encoding (:func:`text_codec`)."""
    for signature, kind in _SIGNATURES.items():
        if data.startswith(signature):
            return f"looks like {kind}, not text; convert it to plain text first"
    if codec.startswith(("utf-16", "utf-32")) and data and bom_codec(data) is None:
        sample = data[:SAMPLE_BYTES]
        try:
            codecs.getincrementaldecoder("utf-8")().decode(sample, final=len(data) <= len(sample))
        except UnicodeDecodeError:
            return None
        if b"\x00" not in sample:
            return (
                f"is not {codec} text: it has no byte-order mark and no NUL byte, and reads "
                f"as UTF-8 (as {codec} it would decode to gibberish); read it without "
                f"--encoding {codec} (a file that starts with a byte-order mark is read in "
                "that mark's encoding whatever --encoding says: UTF-16 files with one need "
                "no --encoding)"
            )
    return None


def bom_codec(data: bytes) -> tuple[str, int] | None:
    """``(codec, length)`` of the byte-order mark ``data`` starts with, or ``None``. A
    UTF-32-LE mark is taken for one only when the length is a multiple of 4 (else it is
    UTF-16-LE text whose first character is U+0000)."""
    for bom, codec in _BOMS:
        if data.startswith(bom):
            if codec == "utf-32-le" and len(data) % 4:
                continue
            return codec, len(bom)
    return None


def text_codec(data: bytes, codec: str) -> str:
    """The codec ``data`` is decoded with: that of its byte-order mark
    (:func:`bom_codec`) whatever ``codec`` (the asked ``--encoding``) says, else
    ``codec``."""
    found = bom_codec(data)
    return found[0] if found is not None else codec


def looks_binary(data: bytes, codec: str) -> str | None:
    """Why ``data`` looks binary by its NUL or control bytes (first 64 KiB), or ``None``.

    Only for ASCII-compatible codecs; the message gives the byte offset of the first NUL
    (or control byte) in the file. Control bytes are :data:`CONTROL_CHARS` (those step 5
    removes, NUL and DEL included) but :data:`TEXT_CONTROLS` (escape, form feed, vertical
    tab: a coloured log is text), and the message says so; the removal warning
    (:attr:`Document.control_note`) counts them all and gives the first NUL's offset as
    this message does.
    """
    if not _ascii_compatible(codec):
        return None
    sample = data[:SAMPLE_BYTES]
    if not sample:
        return None
    nuls = sample.count(0)
    if nuls / len(sample) > MAX_NUL_SHARE:
        return (
            f"looks binary: {nuls} NUL bytes in the first {len(sample)} bytes "
            f"(the first at byte offset {sample.index(0)}){_utf16_hint(sample)}"
        )
    controls = sum(sample.count(b) for b in _CONTROL_BYTES)
    if controls / len(sample) > MAX_CONTROL_SHARE:
        first = _CONTROL_BYTE.search(sample).start()  # as first_control finds it
        return (
            f"looks binary: {controls} control bytes in the first {len(sample)} bytes "
            f"(the first at byte offset {first}; escape, form feed and vertical tab not "
            "counted)"
        )
    return None


def _utf16_hint(sample: bytes) -> str:
    """``""``, or, when at least half the odd (even) bytes of ``sample`` are NULs and
    hardly any others (mostly ASCII text in UTF-16 without a byte-order mark), a hint to
    pass ``--encoding utf-16-le`` (``-be``)."""
    even, odd = sample[0::2], sample[1::2]
    if len(sample) < 4 or len(sample) % 2:
        return ""
    for zeros, other, codec in ((odd, even, "utf-16-le"), (even, odd, "utf-16-be")):
        if zeros.count(0) >= 0.5 * len(zeros) and other.count(0) <= 0.1 * len(other):
            return f"; it may be UTF-16 text without a byte-order mark: pass --encoding {codec}"
    return ""


def decode_bytes(data: bytes, codec: str, errors: str = "strict") -> str:
    """Decode ``data``; a byte-order mark of ``codec`` (:func:`text_codec`) is skipped.

    Raises
    ------
    ValueError
        Invalid input under ``errors="strict"``; the message names the byte offset
        (counted in the file, BOM included) and the line.
    """
    offset = _bom_length(data, codec)
    try:
        text = data[offset:].decode(codec, errors)
    except UnicodeDecodeError as exc:
        at = offset + exc.start
        line = data[:at].count(b"\n") + 1
        other = "or --encoding to read it as another encoding (e.g. latin-1, cp1252)"
        if offset:  # --encoding does not apply to it
            other = f"it starts with a {codec} byte-order mark, so it is read as {codec}"
            other += " whatever --encoding says"
        raise ValueError(
            f"invalid {codec} at byte offset {at} (line {line}, byte 0x{data[at]:02x}); "
            f"pass --errors replace to substitute U+FFFD; {other}"
        ) from None
    return text.removeprefix("\ufeff")


def _bom_length(data: bytes, codec: str) -> int:
    """Length of ``data``'s byte-order mark when it is ``codec``'s (skipped before
    decoding), else 0."""
    found = bom_codec(data)
    return found[1] if found is not None and found[0] == codec else 0


ANSI_SEQUENCE = re.compile(
    r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_78=>])"
)
"""A terminal escape sequence (ECMA-48): a CSI sequence (``ESC [ 31 m``: colours, cursor
moves), an OSC sequence (``ESC ] ... BEL``: titles, links) or a two-character escape
(``ESC`` and one of ``@``-``_``, or ``7 8 = >``: cursor save and restore, keypad modes).
Removed whole with its parameters, so a coloured log reads ``error: disk full``, not
``[31merror[0m: disk full``."""


def normalise_text(text: str) -> tuple[str, int]:
    """Newlines to ``\\n``, terminal escape sequences (:data:`ANSI_SEQUENCE`) and control
    characters removed (policy steps 4-5).

    Returns
    -------
    text : str
        The cleaned text.
    removed : int
        Number of control characters removed (an escape sequence's ESC, and its BEL,
        among them; its other characters are not counted).
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if "\x1b" in text:
        controls = len(_CONTROL_CHARS.findall(text))
        text = _CONTROL_CHARS.sub("", ANSI_SEQUENCE.sub("", text))
        return text, controls
    return _CONTROL_CHARS.subn("", text)


def input_bytes(path: Path, stdin: bytes | None = None) -> bytes:
    """The bytes of input ``path``: ``stdin`` for :data:`STDIN`, else the file's.

    Raises
    ------
    DocumentError
        A folder, a missing or unreadable file; :data:`STDIN` without ``stdin``.
    """
    return _read_bytes(Path(path), stdin)


def document_prefix(
    path: Path | str,
    size: int,
    encoding: str = "utf-8",
    errors: str = "strict",
    allow_binary: bool = False,
    stdin: bytes | None = None,
) -> tuple[str, bool]:
    """The text of the first ``size`` bytes of document ``path`` (at least its first
    :data:`SAMPLE_BYTES`, which the binary test reads), decoded and normalised as
    :func:`read_document` does, and whether that is the whole document. Only those bytes
    are read (the file's size is checked first, as :func:`read_document` checks it).

    The text is a prefix of :func:`read_document`'s text of the same file, less a
    character cut at the end: a size check can look at the start of a huge document
    without reading, decoding or tokenising all of it. Refusals other than those the
    first bytes show (an invalid byte further on, a document empty past them) are
    :func:`read_document`'s.

    Raises
    ------
    DocumentError
        As :func:`read_document`, for the bytes read.
    """
    path = Path(path)
    limit = max(size, SAMPLE_BYTES)
    data = _read_bytes(path, stdin, limit=limit)
    whole = len(data) <= limit
    data = data[:limit]
    asked = codecs.lookup(encoding).name
    refused = format_reason(data, asked)
    if refused:
        raise DocumentError(path, refused)
    codec = text_codec(data, asked)
    binary = looks_binary(data, codec)
    if binary and not allow_binary:
        raise DocumentError(path, binary)
    if binary:
        errors = "replace"
    try:
        if whole:
            text = decode_bytes(data, codec, errors)
        else:  # a character cut at the end waits for bytes that were not read: left out
            start = _bom_length(data, codec)
            decoder = codecs.getincrementaldecoder(codec)(errors)
            text = decoder.decode(data[start:], final=False).removeprefix("\ufeff")
            # an escape sequence cut at the end would leave its parameters: left out too
            esc = text.rfind("\x1b", max(0, len(text) - 256))
            if esc >= 0 and not ANSI_SEQUENCE.match(text, esc):
                text = text[:esc]
    except ValueError as exc:  # UnicodeDecodeError too
        raise DocumentError(path, str(exc)) from None
    return normalise_text(text)[0], whole


def _read_bytes(
    path: Path, stdin: bytes | None = None, reads_stdin: bool = True, limit: int | None = None
) -> bytes:
    """The bytes of input ``path`` (``stdin`` for :data:`STDIN`); with ``limit``, at most
    ``limit + 1`` of them (one more than asked tells whether there are more)."""
    if path == STDIN:
        if not reads_stdin:
            raise DocumentError(path, "is not read here, only files are: save the text to a file")
        if stdin is None:
            raise DocumentError(path, "was not read (no bytes of standard input were given)")
        if len(stdin) > MAX_DOCUMENT_BYTES:
            raise DocumentError(path, f"goes on past {_TOO_LARGE}")
        return stdin if limit is None else stdin[: limit + 1]
    try:
        info = path.stat()
        mode = info.st_mode
        if stat.S_ISDIR(mode):
            raise DocumentError(path, "is a directory")
        if not stat.S_ISREG(mode):  # reading /dev/zero or a FIFO never ends
            pipe = ", or pipe it to `hisparse run -`" if reads_stdin else ""
            raise DocumentError(
                path,
                "is not a regular file (a pipe or a device): documents are read from "
                f"files; save the text to a file{pipe}",
            )
        if info.st_size > MAX_DOCUMENT_BYTES:
            raise DocumentError(path, f"is larger than {_TOO_LARGE}")
        if limit is None:
            return path.read_bytes()
        with path.open("rb") as f:
            return f.read(limit + 1)
    except FileNotFoundError:
        raise DocumentError(path, broken_link(path) or "file not found") from None
    except OSError as exc:
        raise DocumentError(path, f"cannot be read: {exc.strerror or exc}") from None


_TOO_LARGE = (
    f"{MAX_DOCUMENT_BYTES >> 30} GiB, the largest document read (split it into several "
    "documents)"
)


def _ascii_compatible(codec: str) -> bool:
    try:
        return "aZ09\n".encode(codec) == b"aZ09\n"
    except (UnicodeEncodeError, LookupError):
        return False
