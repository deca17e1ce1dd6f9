"""Document reading: BOM, newlines, control characters, bad bytes, binary, empty."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hisparse_cli import textio
from hisparse_cli.textio import (
    STDIN,
    DocumentError,
    join_documents,
    normalise_text,
    read_document,
    read_documents,
)


def write(tmp_path, name, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_utf8_bom_is_stripped(tmp_path):
    doc = read_document(write(tmp_path, "a.txt", b"\xef\xbb\xbfHello"))
    assert doc.text == "Hello"


def test_crlf_and_lone_cr_become_lf(tmp_path):
    doc = read_document(write(tmp_path, "a.txt", b"one\r\ntwo\rthree\n"))
    assert doc.text == "one\ntwo\nthree\n"


def test_tabs_and_very_long_lines_are_kept(tmp_path):
    line = "\t".join(["word"] * 200_000)  # ~1 MB on one line
    doc = read_document(write(tmp_path, "long.txt", line.encode()))
    assert doc.text == line
    assert "\n" not in doc.text


def test_stray_nul_and_controls_are_removed_and_counted(tmp_path):
    text = b"a" * 500 + b"\x00" + b"b\x1b[31mred\x07\x7f" + b"\x0c" + b"end"
    doc = read_document(write(tmp_path, "ctl.txt", text))
    assert doc.text == "a" * 500 + "bredend"  # the escape sequence whole (ANSI_SEQUENCE)
    assert doc.removed_controls == 5


def test_invalid_utf8_names_byte_offset_and_line(tmp_path):
    path = write(tmp_path, "bad.txt", b"ok line\nsecond \xff here")
    with pytest.raises(DocumentError) as info:
        read_document(path)
    assert "byte offset 15" in info.value.reason
    assert "line 2" in info.value.reason
    assert "0xff" in info.value.reason
    assert info.value.path == path


def test_invalid_utf8_offset_counts_the_bom(tmp_path):
    path = write(tmp_path, "bad.txt", b"\xef\xbb\xbfab\xc3")
    with pytest.raises(DocumentError, match="byte offset 5"):
        read_document(path)


def test_errors_replace_substitutes(tmp_path):
    doc = read_document(write(tmp_path, "bad.txt", b"caf\xe9 au lait"), errors="replace")
    assert doc.text == "caf\ufffd au lait"


def test_other_encoding_decodes(tmp_path):
    doc = read_document(write(tmp_path, "latin.txt", "café".encode("latin-1")), encoding="latin-1")
    assert doc.text == "café"


def test_utf16_with_a_bom_is_read_with_or_without_the_encoding_flag(tmp_path):
    """A byte-order mark is unambiguous: no ``--encoding utf-16`` needed (it was refused
    with that hint, and following the hint in a mixed batch garbled the other files)."""
    path = write(tmp_path, "u16.txt", "hello".encode("utf-16"))
    assert read_document(path).text == "hello"
    assert read_document(path, encoding="utf-16").text == "hello"


@pytest.mark.parametrize(
    "codec", ["utf-8", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"]
)
@pytest.mark.parametrize("asked", ["utf-8", "latin-1", "utf-16", "utf-32-be", "cp1252"])
def test_a_byte_order_mark_wins_over_encoding(tmp_path, codec, asked):
    before, text = "caf\u00e9 \u65e5\u672c\r\nsecond ", "\x1b line\n"
    native = f"-{sys.byteorder[0]}e"  # what Python's utf-16 and utf-32 write
    plain = codec + native if codec in ("utf-16", "utf-32") else codec
    bom = "\ufeff".encode(plain)
    data = bom + (before + text).encode(plain)
    path = write(tmp_path, "bom.txt", data)
    doc = read_document(path, encoding=asked)
    assert doc.text == "caf\u00e9 \u65e5\u672c\nsecond  line\n"
    assert doc.first_control == (len(bom) + len(before.encode(plain)), 2)
    prefix, whole = textio.document_prefix(path, 8, encoding=asked)
    assert whole and prefix == doc.text


@pytest.mark.parametrize("asked", ["utf-16", "utf-16-le", "utf-32", "UTF-16BE"])
def test_utf8_text_without_a_bom_is_not_read_as_utf16(tmp_path, asked):
    """Fresh-user finding: under ``--encoding utf-16`` the 28-byte ASCII file of the same
    batch became CJK gibberish, without a word, and ran."""
    path = write(tmp_path, "even.txt", b"Dogs bark loudly at night!!\n")
    with pytest.raises(DocumentError) as info:
        read_document(path, encoding=asked)
    assert info.value.path == path and info.value.sha256  # final: the same bytes fail again
    assert "is not utf-" in info.value.reason and "no byte-order mark" in info.value.reason
    assert "reads as UTF-8" in info.value.reason and "--encoding" in info.value.reason
    with pytest.raises(DocumentError, match="is not utf-"):
        textio.document_prefix(path, 8, encoding=asked)
    assert read_document(path).text == "Dogs bark loudly at night!!\n"


def test_utf16_without_a_bom_reads_with_its_encoding_and_hints_at_it(tmp_path):
    data = "plain text, \u65e5\u672c\n".encode("utf-16-le")
    path = write(tmp_path, "le.txt", data)
    assert read_document(path, encoding="utf-16-le").text == "plain text, \u65e5\u672c\n"
    with pytest.raises(DocumentError) as info:  # read as UTF-8: every other byte a NUL
        read_document(path)
    assert "looks binary" in info.value.reason
    assert "UTF-16 text without a byte-order mark: pass --encoding utf-16-le" in info.value.reason
    big_endian = write(tmp_path, "be.txt", "plain text\n".encode("utf-16-be"))
    with pytest.raises(DocumentError, match="pass --encoding utf-16-be"):
        read_document(big_endian)
    with pytest.raises(DocumentError) as info:  # NULs, but not every other byte
        read_document(write(tmp_path, "blob.bin", b"\x00\x01\x02\x00" * 100))
    assert "UTF-16" not in info.value.reason


def test_invalid_text_after_a_bom_says_the_mark_chose_the_encoding(tmp_path):
    path = write(tmp_path, "bad.txt", b"\xef\xbb\xbfcaf\xe9\n")
    with pytest.raises(DocumentError) as info:
        read_document(path, encoding="latin-1")
    assert "invalid utf-8 at byte offset 6" in info.value.reason
    assert "starts with a utf-8 byte-order mark" in info.value.reason
    assert read_document(path, errors="replace").text == "caf\ufffd\n"


@pytest.mark.parametrize(
    "data, phrase",
    [
        (b"%PDF-1.7\n...", "PDF"),
        (b"PK\x03\x04rest", "ZIP"),
        (b"\x00\x01\x02\x00" * 100, "NUL bytes"),
        (bytes(range(1, 9)) * 100 + b"text", "control bytes"),
    ],
)
def test_binary_files_are_refused(tmp_path, data, phrase):
    with pytest.raises(DocumentError, match=phrase):
        read_document(write(tmp_path, "blob.bin", data))


def test_control_byte_refusal_names_the_first_ones_offset(tmp_path):
    path = write(tmp_path, "ctl.txt", b"plain text " + bytes(range(1, 9)) * 100)
    with pytest.raises(DocumentError) as info:
        read_document(path)
    assert "800 control bytes" in str(info.value)
    assert "first at byte offset 11" in str(info.value)


def test_nul_refusal_names_file_first_nul_offset_and_override(tmp_path):
    path = write(tmp_path, "short.txt", b"A short note\x00 with a NUL.\n")
    with pytest.raises(DocumentError) as info:
        read_document(path)
    message = str(info.value)
    assert str(path) in message
    assert "first at byte offset 12" in message
    assert "--allow-binary" in message


def test_allow_binary_decodes_with_replacement_and_warns(tmp_path):
    path = write(tmp_path, "short.txt", b"A short note\x00 with \xff a NUL.\n")
    doc = read_document(path, allow_binary=True)  # errors="strict" is overridden
    assert doc.text == "A short note with \ufffd a NUL.\n"
    assert doc.removed_controls == 1
    assert str(path) in doc.warning and "--allow-binary" in doc.warning
    assert read_document(write(tmp_path, "plain.txt", b"plain\n"), allow_binary=True).warning == ""


def test_the_binary_message_and_the_removal_warning_agree_on_offsets(tmp_path):
    """Fresh-user finding: on a file with an ESC byte and NULs the binary check said
    ``the first at byte offset 29`` and the removal warning ``the first at byte offset 15``:
    the first NUL and the first control byte, unnamed. The warning now also gives the NULs
    among the removed characters, with the binary message's offset."""
    data = b"Status report: \x1b[1mbold\x1b[0m x\x00\x00\x00 more \x00\x00 text here and there\n"
    path = write(tmp_path, "mixed.txt", data)
    with pytest.raises(DocumentError) as info:
        read_document(path)
    assert "looks binary: 5 NUL bytes in the first 61 bytes (the first at byte offset 29)" in (
        info.value.reason
    )
    doc = read_document(path, allow_binary=True)
    assert "5 NUL bytes in the first 61 bytes (the first at byte offset 29)" in doc.warning
    assert doc.control_note == (
        f"removed 7 control character(s) from {path} (the first at byte offset 15, line 1); "
        "5 of them NUL bytes, the first at byte offset 29 (line 1)"
    )


@pytest.mark.parametrize("controls", [b"\x01\x7f", b"\x7f\x02\x1f", b"\x08\x07"])
def test_the_binary_test_counts_the_control_bytes_that_are_removed(tmp_path, controls):
    """The control bytes the binary test counts and locates are the ones reading removes
    but escape, form feed and vertical tab (DEL was removed, but not counted, so a file of
    them was read while its count and first offset disagreed)."""
    data = b"some text\n" + controls * 10 + b" end\n"
    path = write(tmp_path, "ctl.txt", data)
    with pytest.raises(DocumentError) as info:
        read_document(path)
    count, first = 10 * len(controls), len(b"some text\n")
    assert f"{count} control bytes in the first {len(data)} bytes" in info.value.reason
    assert f"(the first at byte offset {first};" in info.value.reason
    doc = read_document(path, allow_binary=True)
    assert doc.removed_controls == count and doc.first_control == (first, 2)
    removed = f"removed {count} control character(s) from {path}"
    assert doc.control_note == f"{removed} (the first at byte offset {first}, line 2)"


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"\x00" * 100, "has no text: only NUL/control bytes, which are removed (100 control "
         "character(s), 100 of them NUL)"),
        (b"\x00\x00  \n\x00", "only NUL/control bytes and whitespace"),
        (b"\x07\x7f" * 20, "only NUL/control bytes, which are removed (40 control character(s))"),
    ],
    ids=["all-nul", "nul-and-whitespace", "bel-and-del"],
)  # fmt: skip
def test_a_file_of_only_control_bytes_read_anyway_says_so(tmp_path, data, says):
    """Fresh-user finding: an all-NUL file read with --allow-binary failed with ``is empty
    or only whitespace``."""
    with pytest.raises(DocumentError) as info:
        read_document(write(tmp_path, "nul.bin", data), allow_binary=True)
    assert says in info.value.reason and "is empty or only whitespace" not in info.value.reason
    assert info.value.empty  # among a job's files: left out, as an empty one is


def test_allow_binary_does_not_override_known_formats(tmp_path):
    with pytest.raises(DocumentError, match="PDF"):
        read_document(write(tmp_path, "a.pdf", b"%PDF-1.7\n\x00\x00"), allow_binary=True)


@pytest.mark.parametrize("data", [b"", b"   \n\t\r\n  ", b"\xef\xbb\xbf\n"])
def test_empty_or_whitespace_is_refused(tmp_path, data):
    with pytest.raises(DocumentError, match="empty"):
        read_document(write(tmp_path, "empty.txt", data))


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("\u200b\ufeff\u00a0\u2028\u3000", "U+200B ZERO WIDTH SPACE"),  # the trial's file
        ("\ufeff\u200b\u200c\u200d\u2060\n", "U+2060 WORD JOINER"),
        (" \u00ad\u2029\u202f\u2062\u180e\u3164\ufe0f\U000e0001\u2800\t\n", "U+00AD SOFT HYPHEN"),
        ("\x85\u200e\u200f\u061c", "U+200E LEFT-TO-RIGHT MARK"),  # NEL (C1), bidi marks
    ],
)
def test_only_invisible_characters_is_refused_as_empty_naming_them(tmp_path, text, named):
    """Fresh-user finding: a file of only U+200B, U+FEFF, U+00A0, U+2028, U+3000 ran as
    80 tokens and got a made-up summary. Invisible characters count as whitespace."""
    path = write(tmp_path, "invisible.txt", text.encode())
    with pytest.raises(DocumentError) as info:
        read_document(path)
    assert info.value.empty and info.value.sha256  # final, left out among several
    assert info.value.reason.startswith("is empty or only whitespace or invisible characters")
    assert named in info.value.reason


@pytest.mark.parametrize(
    "text", ["\u200bhello", "\u3000\u200b\u00b7", "\u200d\U0001f600", "\u0301"]
)
def test_one_visible_character_among_invisible_ones_is_text(tmp_path, text):
    assert read_document(write(tmp_path, "a.txt", text.encode())).text == text


def test_a_file_of_invisible_characters_is_left_out_of_a_job_of_several(tmp_path):
    one = write(tmp_path, "one.txt", b"Some text.\n")
    blank = write(tmp_path, "blank.txt", "\u200b\u2060\n".encode())
    documents = read_documents([one, blank])
    assert [d.path for d in documents] == [one]
    assert "left out 1 empty file(s) of the job's inputs" in documents[0].warning
    ((path, reason),) = documents[0].left_out
    assert path == blank and "U+2060 WORD JOINER" in reason


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(DocumentError, match="not found"):
        read_document(tmp_path / "nope.txt")
    with pytest.raises(DocumentError, match="directory"):
        read_document(tmp_path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_pipe_or_device_is_refused_without_reading_it(tmp_path):
    """Fresh-user finding: a FIFO among the documents hung the run and /dev/zero filled
    the memory, though the warning said only that job fails. A writer thread feeds the
    FIFO, so a reader that opens it anyway gets text (and the test fails) instead of
    blocking."""
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)

    def feed():
        try:
            with open(fifo, "w") as handle:  # blocks until a reader opens it
                handle.write("text from a pipe\n")
        except BrokenPipeError:  # the reader below that only frees this thread
            pass

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        with pytest.raises(DocumentError, match="not a regular file"):
            read_document(fifo)
    finally:
        if writer.is_alive():  # nobody read it: open and drop a reader to free the thread
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        writer.join(timeout=5)
    if os.path.exists("/dev/zero"):
        with pytest.raises(DocumentError, match="not a regular file"):
            read_document(Path("/dev/zero"))


def test_larger_than_the_cap_is_refused_before_reading(tmp_path, monkeypatch):
    monkeypatch.setattr(textio, "MAX_DOCUMENT_BYTES", 16)
    with pytest.raises(DocumentError, match="is larger than"):
        read_document(write(tmp_path, "big.txt", b"x" * 17))
    assert read_document(write(tmp_path, "ok.txt", b"y" * 16)).text == "y" * 16
    with pytest.raises(DocumentError, match="goes on past"):
        read_document(STDIN, stdin=b"z" * 17)


def test_a_documents_prefix_reads_only_its_first_bytes(tmp_path):
    """:func:`textio.document_prefix`, for the size check before the load: the text of the
    first bytes as read_document decodes and normalises them (a prefix of its text), and
    whether that was all; nothing past them is read, so a bad byte there is not seen."""
    size = textio.SAMPLE_BYTES
    start = "\ufeffA line\r\nof text é 日本\n".encode()  # BOM, CRLF, 2- and 3-byte chars
    body = start + b"x" * (size - len(start) - 1) + "é".encode() + b"tail\xff"
    path = write(tmp_path, "big.txt", body)
    text, whole = textio.document_prefix(path, 10)  # at least the binary test's sample
    assert not whole and text.startswith("A line\nof text é 日本\n") and text.endswith("x")
    assert len(text) == size - 3 - 1 - 6  # the BOM, the CR and "é", cut in two, left out
    with pytest.raises(DocumentError, match="invalid utf-8"):  # the whole file is refused
        read_document(path)
    small = write(tmp_path, "small.txt", start + b"end\r")
    text, whole = textio.document_prefix(small, size)
    assert whole and text == read_document(small).text == "A line\nof text é 日本\nend\n"
    cut = write(tmp_path, "cut.txt", b"y" * (size - 1) + b"\r\nz")  # CR read, LF not
    text, whole = textio.document_prefix(cut, size)
    assert not whole and read_document(cut).text.startswith(text) and text.endswith("y\n")
    text, whole = textio.document_prefix(STDIN, size, stdin=b"w" * (size + 5))
    assert (text, whole) == ("w" * size, False)
    with pytest.raises(DocumentError, match="looks like a PDF"):
        textio.document_prefix(write(tmp_path, "a.pdf", b"%PDF-1.7" + b"x" * size), size)


def test_sha256_is_of_raw_bytes(tmp_path):
    a = read_document(write(tmp_path, "a.txt", b"same\r\n"))
    b = read_document(write(tmp_path, "b.txt", b"same\n"))
    assert a.text == b.text
    assert a.sha256 != b.sha256


def test_join_documents_headers_only_for_several(tmp_path):
    one, two = (
        read_document(write(tmp_path, n, t)) for n, t in (("1.txt", b"A\n"), ("2.txt", b"B"))
    )
    assert join_documents([one]) == "A\n"
    assert (
        join_documents(read_documents([one.path, two.path]))
        == "--- 1.txt ---\nA\n\n--- 2.txt ---\nB"
    )


@given(st.text())
def test_normalise_leaves_only_tab_and_newline_controls(text):
    cleaned, removed = normalise_text(text)
    assert "\r" not in cleaned
    assert all(c in "\t\n" or ord(c) >= 32 and ord(c) != 127 for c in cleaned)
    assert removed >= 0


@pytest.mark.parametrize("codec", ["utf-8", "utf-16", "latin-1"])
def test_removed_controls_say_where_the_first_was(tmp_path, codec):
    """Issue #19.8: the byte offset (in the file as stored) and line of the first removed
    control character."""
    from hisparse_cli.textio import read_document

    text = "first line\r\nsecond \x1b[0m line\n"
    raw = text.encode(codec)
    path = tmp_path / "doc.txt"
    path.write_bytes(raw)
    doc = read_document(path, encoding=codec)
    assert doc.removed_controls == 1
    assert doc.first_control == (raw.index("\x1b".encode(codec).removeprefix(b"\xff\xfe")), 2)
    assert f"from {path} (the first at byte offset {doc.first_control[0]}, line 2)" in doc.control_note
    (tmp_path / "clean.txt").write_text("ok\n")
    clean = read_document(tmp_path / "clean.txt")
    assert clean.first_control is None and clean.control_note == ""


def test_a_broken_link_says_so_and_where_it_points(tmp_path):
    """Not "file not found": the link is there, its target is not."""
    (tmp_path / "dangling.txt").symlink_to("nowhere.txt")
    with pytest.raises(DocumentError) as info:
        read_document(tmp_path / "dangling.txt")
    assert info.value.reason == (
        f"is a broken symbolic link: it points to 'nowhere.txt' ({tmp_path / 'nowhere.txt'}), "
        "which does not exist"
    )
    with pytest.raises(DocumentError) as missing:
        read_document(tmp_path / "missing.txt")
    assert missing.value.reason == "file not found"


def test_a_coloured_log_is_text_its_escapes_removed(tmp_path):
    """ANSI colours in a captured log (``ls --color``, a build) are escape bytes, often
    more than 5 % of them: the file is read, not refused as binary, and the escape
    sequences are removed whole, parameters included (a second trial saw ``[31merror[0m``
    reach the model: only the ESC bytes went); the warning counts the control characters;
    form feeds and vertical tabs are removed too."""
    line = b"\x1b[01;34mdir\x1b[0m  \x1b[01;32mrun.sh\x1b[0m\f\v\n"
    data = line * 200
    assert data.count(0x1B) / len(data) > 0.05
    doc = read_document(write(tmp_path, "ls.txt", data))
    assert doc.text.startswith("dir  run.sh\ndir  run.sh\n")  # the sequences whole
    assert doc.removed_controls == 6 * 200 and not doc.warning
    with pytest.raises(DocumentError, match="escape, form feed and vertical tab not counted"):
        read_document(write(tmp_path, "bin.txt", b"text\n" + b"\x01\x1b" * 50))


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        (b"\x1b[31merror\x1b[0m: disk full\n", "error: disk full\n"),
        (b"\x1b[1;38;5;208mwarn\x1b[m x\x1b[2K\x1b[1A\n", "warn x\n"),
        (b"\x1b]0;title\x07build ok \x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\\n", "build ok link\n"),
        (b"a \x1b7saved\x1b8 b \x1b\n", "a saved b \n"),  # a lone ESC: only it goes
    ],
    ids=["csi-colour", "csi-256-and-cursor", "osc-title-and-link", "two-char-and-lone"],
)  # fmt: skip
def test_terminal_escape_sequences_are_removed_whole(tmp_path, raw, text):
    doc = read_document(write(tmp_path, "log.txt", raw))
    assert doc.text == text
    assert doc.removed_controls == raw.count(b"\x1b") + raw.count(b"\x07")


def test_a_prefix_cut_inside_an_escape_sequence_leaves_none_of_it(tmp_path):
    """The start of a document read for a size check (:func:`document_prefix`) ends
    inside a colour sequence: its parameters are left out as the whole document's
    reading removes them, so the prefix is never longer than the document's start."""
    from hisparse_cli.textio import SAMPLE_BYTES, document_prefix

    line = b"error: disk full \x1b[38;5;208mhot\x1b[0m\n"
    raw = line * (2 * SAMPLE_BYTES // len(line))
    path = write(tmp_path, "log.txt", raw)
    whole = read_document(path).text
    for size in range(SAMPLE_BYTES, SAMPLE_BYTES + len(line)):
        text, complete = document_prefix(path, size)
        assert not complete and whole.startswith(text), size
