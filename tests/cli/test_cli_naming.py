"""Safe names and derived ids."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hisparse_cli.naming import (
    EarlierJob,
    derive_ids,
    name_problem,
    output_filename,
    slugify,
)


@pytest.mark.parametrize("name", ["report", "job-1", "a.b_c", "X" * 128])
def test_safe_names_pass(name):
    assert name_problem(name) is None


@pytest.mark.parametrize(
    "name, phrase",
    [
        ("../up", "separator"),
        ("..", "'..'"),
        ("a..b", "'..'"),
        ("/abs", "absolute"),
        ("C:evil", "absolute"),
        ("dir/file", "separator"),
        ("dir\\file", "separator"),
        (".hidden", "start with a letter"),
        ("", "empty"),
        ("nul.txt", "reserved"),
        ("new\nline", "letters, digits"),
        ("x" * 129, "at most 128"),
        (5, "string"),
    ],
)
def test_unsafe_names_are_refused(name, phrase):
    assert phrase in name_problem(name)


def test_output_filename_adds_txt_once():
    assert output_filename("a") == "a.txt"
    assert output_filename("a.txt") == "a.txt"


def test_slugify():
    assert slugify("How To: Sorting!") == "how-to-sorting"
    assert slugify("Ünïcödé") == "unicode"
    assert slugify("***") == "doc"


def test_same_name_in_different_folders_gets_parent(tmp_path):
    paths = [
        tmp_path / "x" / "howto" / "sorting.txt",
        tmp_path / "y" / "howto" / "sorting.txt",
        tmp_path / "notes.txt",
    ]
    assert derive_ids(paths) == ["x-howto-sorting", "y-howto-sorting", "notes"]


def test_same_stem_same_folder_falls_back_to_hash(tmp_path):
    ids = derive_ids([tmp_path / "a.txt", tmp_path / "a.md", tmp_path / "A.txt"])
    assert len(set(ids)) == 3 and all(i.startswith("a") for i in ids)


def _earlier(ident, *inputs, output=None):
    return EarlierJob(ident, tuple(p.resolve() for p in inputs), output or f"{ident}.txt")


def test_earlier_ids_are_kept_when_documents_are_added(tmp_path):
    a, b, c = tmp_path / "docs" / "a.txt", tmp_path / "other" / "a.txt", tmp_path / "docs" / "a.md"
    assert derive_ids([a]) == ["a"]
    assert derive_ids([a, b]) == ["docs-a", "other-a"]  # without the earlier run's names
    assert derive_ids([a, b], earlier=[_earlier("a", a)]) == ["a", "other-a"]
    assert derive_ids([b, a, c], earlier=[_earlier("a", a)]) == ["other-a", "a", "docs-a"]
    # Never a name derive_ids could not give that path (a manifest's own id or output),
    # nor a name an explicit id now takes.
    assert derive_ids([a], earlier=[_earlier("contract-1", a)]) == ["a"]
    assert derive_ids([a], earlier=[_earlier("a", a, output="summary.txt")]) == ["docs-a"]
    assert derive_ids([a], taken=["a"], earlier=[_earlier("a", a)]) == ["docs-a"]
    hashed = derive_ids([a, c])
    earlier = [_earlier(hashed[0], a), _earlier(hashed[1], c)]
    assert derive_ids([a, c, b], earlier=earlier)[:2] == hashed
    # A job over several inputs keeps its id only for the same inputs.
    assert derive_ids([a], earlier=[_earlier("a", a, c)], inputs=[[a, c]]) == ["a"]
    assert derive_ids([a], earlier=[_earlier("a", a, c)], inputs=[[a]]) == ["docs-a"]


def test_new_documents_avoid_every_earlier_id_and_output(tmp_path):
    a, b = tmp_path / "docs" / "a.txt", tmp_path / "other" / "a.txt"
    upper, gone = tmp_path / "docs2" / "A.md", tmp_path / "old" / "a.txt"
    assert derive_ids([b], earlier=[_earlier("a", a)]) == ["other-a"]
    assert derive_ids([upper], earlier=[_earlier("a", a)]) == ["docs2-a"]
    # Also when that document is gone (its a.txt is still there), ran under two ids, or
    # its line's input was unreadable; and an explicit output file name counts as taken.
    assert derive_ids([b], earlier=[_earlier("a", gone)]) == ["other-a"]
    assert derive_ids([b], earlier=[_earlier("foo", a), _earlier("a", a)]) == ["other-a"]
    assert derive_ids([b], earlier=[EarlierJob("a", (), "a.txt")]) == ["other-a"]
    assert derive_ids([b], earlier=[_earlier("yy", a, output="a.txt")]) == ["other-a"]
    # The document itself keeps its id even when it also ran under another.
    assert derive_ids([a, b], earlier=[_earlier("foo", a), _earlier("a", a)]) == ["a", "other-a"]


def test_derived_ids_avoid_taken(tmp_path):
    (derived,) = derive_ids([tmp_path / "sub" / "intro.txt"], taken=["intro"])
    assert derived == "sub-intro"


# names that slug alike: case, accents, scripts ASCII drops, a Latin-1 name (not UTF-8:
# Python names it with a surrogate, "caf\udce9")
NAMES = ["a", "b", "A", "a b", "é", "x.y", "Report", "REPORT", "résumé 日本", "résumé 中国",
         "日本", "caf\udce9", "café"]  # fmt: skip


@given(
    st.lists(
        st.lists(st.sampled_from(NAMES), min_size=1, max_size=4),
        min_size=1,
        max_size=12,
        unique_by=tuple,
    )
)
def test_derived_ids_are_unique_safe_and_stable(parts):
    paths = [Path("/root", *p[:-1], p[-1] + ".txt") for p in parts]
    ids = derive_ids(paths)
    assert len({i.casefold() for i in ids}) == len(ids)
    assert all(name_problem(i) is None for i in ids)
    assert derive_ids(paths[::-1]) == ids[::-1]  # the same names whatever the order


def test_unicode_case_and_non_utf8_names_get_ascii_ids(tmp_path):
    """A fresh user's ``résumé 日本.txt``, names differing only in case, and a Latin-1
    file name (``caf\\xe9.txt``, which hashing as UTF-8 stopped the run with a
    UnicodeEncodeError): lower-case ASCII ids, a short hash where two slug alike."""
    names = ["résumé 日本.txt", "résumé 中国.txt", "日本.txt", "Report.txt", "report.txt"]
    ids = derive_ids([tmp_path / n for n in names])
    assert ids[2] == "doc" and all(i.startswith(("resume-", "report-")) for i in ids[:2] + ids[3:])
    assert len(set(ids)) == 5 and all(i.isascii() and i == i.lower() for i in ids)
    latin1 = Path(os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9.txt"))
    assert derive_ids([latin1]) == ["caf"]
    (one, other) = derive_ids([latin1, tmp_path / "caf.md"])
    assert one.startswith("caf-") and other.startswith("caf-") and one != other


@pytest.mark.parametrize(
    "file, ident",
    [
        ("nul.bin", "nul_"),
        ("con.txt", "con_"),
        ("AUX.txt", "aux_"),
        ("com1.txt", "com1_"),
        ("lpt9.md", "lpt9_"),
        ("console.txt", "console"),
        ("nul-report.txt", "nul-report"),
    ],
)
def test_derived_ids_avoid_reserved_device_names(tmp_path, file, ident):
    (ident_,) = derive_ids([tmp_path / file])
    assert ident_ == ident
    assert name_problem(ident_) is None


def test_command_line_problem_names_the_document_and_the_field():
    from hisparse_cli.manifest import COMMAND_LINE, _problem
    from hisparse_cli.manifest_source import Entry

    entry = Entry(COMMAND_LINE, "document /tmp/ut/nul.bin", None, {"id": "nul"})
    text = str(_problem(entry, "id", "is a reserved device name on Windows: 'nul'"))
    assert (
        text
        == "command line: document /tmp/ut/nul.bin, id: is a reserved device name on Windows: 'nul'"
    )
