"""Job ids and output names that can never write outside the output directory.

A user-given id or output name must be a plain file name: ASCII letters, digits,
``.``, ``_`` and ``-``, starting with a letter or digit, at most 128 characters, no
path separators, no ``..`` and not a reserved device name. Ids derived from document
paths are slugs of the file stem (of the resolved path; of the name given for a broken
symbolic link; ``_`` appended to a reserved device name:
``nul.bin`` -> ``nul_``); when two documents in different folders give the
same slug, parent folder names are prepended one at a time until they differ; ids
that still collide (same folder, e.g. ``a.txt`` and ``a.md``) get a short hash of the
resolved path appended. Given the jobs earlier runs recorded in the same output
directory, a job over the same inputs keeps its earlier id and every other derived id
avoids theirs and their output names: adding documents never renames (and so redoes) jobs
already run, and never takes over a file an earlier run wrote.
"""

from __future__ import annotations

import hashlib
import os
import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

MAX_NAME_CHARS = 128
SLUG_MAX_CHARS = 80
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_RESERVED = {"con", "prn", "aux", "nul"} | {f"{p}{i}" for p in ("com", "lpt") for i in range(10)}


def name_problem(name: object) -> str | None:
    """Why ``name`` is not a safe id / output name, or ``None`` if it is.

    Parameters
    ----------
    name
        The candidate value, as read from a manifest or the command line.

    Returns
    -------
    str or None
        A reason phrased to follow the field name ("must be ..."), or ``None``.
    """
    if not isinstance(name, str):
        return f"must be a string, got {type(name).__name__}"
    if not name:
        return "must not be empty"
    if name.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", name):
        return f"must be a plain name, not an absolute path: {name!r}"
    if "/" in name or "\\" in name:
        return f"must be a plain name without path separators: {name!r}"
    if ".." in name:
        return f"must not contain '..': {name!r}"
    if len(name) > MAX_NAME_CHARS:
        return f"must be at most {MAX_NAME_CHARS} characters, got {len(name)}"
    if not _SAFE_NAME.fullmatch(name):
        return (
            f"may only use letters, digits, '.', '_' and '-' and must start with a "
            f"letter or digit: {name!r}"
        )
    if name.split(".")[0].lower() in _RESERVED:
        return f"is a reserved device name on Windows: {name!r}"
    return None


def output_filename(name: str) -> str:
    """File name of a job's text output: ``name`` plus ``.txt`` (not doubled)."""
    return name if name.lower().endswith(".txt") else f"{name}.txt"


def slugify(text: str) -> str:
    """Lower-case ASCII slug of ``text`` (``"How To: Sorting"`` -> ``"how-to-sorting"``)."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    slug = re.sub(r"[^a-z0-9]+", "-", ascii_text.lower()).strip("-")
    return slug[:SLUG_MAX_CHARS].strip("-") or "doc"


@dataclass(frozen=True)
class EarlierJob:
    """A job an earlier run recorded in the output directory (its last results line).

    inputs: resolved paths (empty when the line's ``input`` was unreadable; ``-``, not
        resolved, for standard input);
    output: the file name it wrote (or would have written) there.
    input_sha256: the SHA-256 of each input the line records (empty when it has none).
    """

    id: str
    inputs: tuple[Path, ...]
    output: str
    input_sha256: tuple[str, ...] = ()


STDIN_ID = "stdin"
"""Id of the job over standard input (``hisparse run -``), when it is free."""


def stdin_job_id(sha256: str | None, earlier: Sequence[EarlierJob] = ()) -> str:
    """Id of the job over standard input whose bytes have SHA-256 ``sha256``.

    Standard input has no path to tell documents apart, so its text does: the id of an
    earlier job over standard input (``inputs == (Path("-"),)``) with the same
    ``input_sha256`` that wrote ``<id>.txt`` (resume finds it done), else ``stdin`` when
    no earlier job holds that id or output name, else ``stdin-`` and the first 8 hex
    digits of ``sha256`` (more when those are taken too): other text never takes over
    an earlier job's result.

    Parameters
    ----------
    sha256
        Hex digest of standard input's bytes (``None``: not read; ``stdin``).
    earlier
        Jobs earlier runs recorded in the output directory.
    """
    stdin = (Path("-"),)
    for job in sorted(earlier, key=lambda e: e.id):
        same = sha256 is not None and job.input_sha256 == (sha256,)
        if job.inputs == stdin and same and job.output == output_filename(job.id):
            return job.id
    taken = {job.id.casefold() for job in earlier}
    taken |= {job.output.removesuffix(".txt").casefold() for job in earlier}
    if STDIN_ID not in taken or sha256 is None:
        return STDIN_ID
    for digits in range(8, len(sha256) + 1, 4):
        candidate = f"{STDIN_ID}-{sha256[:digits]}"
        if candidate not in taken:
            return candidate
    return f"{STDIN_ID}-{sha256}-{len(earlier)}"


def derive_ids(
    paths: Sequence[Path],
    taken: Iterable[str] = (),
    earlier: Sequence[EarlierJob] = (),
    inputs: Sequence[Sequence[Path]] | None = None,
) -> list[str]:
    """Unique ids for documents, one per path, stable for the same set of paths.

    Parameters
    ----------
    paths
        Document paths (distinct files): each job's first input.
    taken
        Ids already in use (explicit ids from a manifest); derived ids avoid them.
    earlier
        Jobs earlier runs recorded in the same output directory
        (:func:`hisparse_cli.results.earlier_jobs`). A job whose inputs equal an earlier
        job's keeps that job's id when this function could have derived it from its
        first input and the job wrote ``<id>.txt`` (so never a manifest's own id or
        output), unless ``taken`` holds it. Every other derived id avoids every earlier
        job's id and output name, whether or not its document still exists: a new,
        moved or renamed document never takes over a file an earlier run wrote.
    inputs
        Each job's inputs, to match ``earlier`` by (default: ``paths[i]`` alone).

    Returns
    -------
    list of str
        ``ids[i]`` for ``paths[i]``; all distinct (case-insensitively) and safe.
    """
    resolved = [Path(p).resolve() for p in paths]
    named = [naming_path(p) for p in paths]
    taken_set = {t.casefold() for t in taken}
    if earlier:
        keys = [(p,) for p in resolved]
        if inputs is not None:
            keys = [tuple(Path(p).resolve() for p in job) for job in inputs]
        owners: dict[tuple[Path, ...], list[EarlierJob]] = {}
        for job in sorted(earlier, key=lambda e: e.id):
            owners.setdefault(job.inputs, []).append(job)
        kept: dict[int, str] = {}
        for i, (path, key) in enumerate(zip(named, keys, strict=True)):
            for job in owners.get(key, []):
                free = job.id.casefold() not in taken_set
                if free and job.output == output_filename(job.id) and derivable(path, job.id):
                    kept[i] = job.id
                    taken_set.add(job.id.casefold())
                    break
        for job in earlier:
            taken_set.add(job.id.casefold())
            stem = job.output[:-4] if job.output.lower().endswith(".txt") else job.output
            taken_set.add(stem.casefold())
        rest = [i for i in range(len(resolved)) if i not in kept]
        fresh = iter(derive_ids([named[i] for i in rest], taken_set))
        return [kept[i] if i in kept else next(fresh) for i in range(len(resolved))]
    depths = [0] * len(named)
    while True:
        ids = [_candidate(p, d) for p, d in zip(named, depths, strict=True)]
        groups = _clash_groups(ids, taken_set)
        deepened = False
        for key, group in groups.items():
            if key in taken_set or len({named[i].parent for i in group}) > 1:
                deepened |= _deepen(group, named, depths)
        if not deepened:
            break
    clashing = {i for group in groups.values() for i in group}
    return [
        f"{ident}-{_short_hash(p)}" if i in clashing else ident
        for i, (ident, p) in enumerate(zip(ids, named, strict=True))
    ]


def naming_path(path: Path | str) -> Path:
    """The path a derived id is made from: ``path`` resolved, except a broken symbolic
    link (``dangling.txt -> nowhere.txt``), which keeps the name it was given (its folder
    resolved): the job is ``dangling``, named as the user named it, not after a file that
    is not there."""
    path = Path(path)
    resolved = path.resolve()
    if path.is_symlink() and not os.path.lexists(resolved):
        return path.parent.resolve() / path.name
    return resolved


def derivable(path: Path, ident: str) -> bool:
    """Whether :func:`derive_ids` can give ``ident`` to the resolved ``path`` (its slug
    with 0..all parent folders, with or without the path's short hash)."""
    for depth in range(len(path.parent.parts)):
        candidate = _candidate(path, depth)
        if ident in (candidate, f"{candidate}-{_short_hash(path)}"):
            return True
    return False


def _candidate(path: Path, depth: int) -> str:
    parents = list(path.parent.parts[1:])[-depth:] if depth else []
    return safe_slug(slugify("-".join([*parents, path.stem or path.name])))


def safe_slug(slug: str) -> str:
    """``slug`` with ``_`` appended when it is a reserved device name on Windows
    (``nul`` -> ``nul_``, ``com1`` -> ``com1_``): derived ids never need renaming."""
    return f"{slug}_" if slug.split(".")[0].casefold() in _RESERVED else slug


def _clash_groups(ids: list[str], taken: set[str]) -> dict[str, list[int]]:
    """Casefolded id -> indices, for ids used twice or already taken."""
    groups: dict[str, list[int]] = {}
    for n, ident in enumerate(ids):
        groups.setdefault(ident.casefold(), []).append(n)
    return {k: g for k, g in groups.items() if len(g) > 1 or k in taken}


def _deepen(group: list[int], resolved: list[Path], depths: list[int]) -> bool:
    """Prepend one more parent folder to each id in ``group`` that has one left."""
    deepened = False
    for i in group:
        if depths[i] < len(resolved[i].parent.parts) - 1:
            depths[i] += 1
            deepened = True
    return deepened


def _short_hash(path: Path) -> str:
    """8 hex digits of the SHA-256 of ``path``'s bytes as the file system names it (a name
    that is not UTF-8, such as ``caf\\xe9.txt`` in Latin-1, has no UTF-8 encoding: it
    stopped the run with a ``UnicodeEncodeError``; UTF-8 names hash as before)."""
    return hashlib.sha256(os.fsencode(path)).hexdigest()[:8]
