"""GGUF metadata without the tensors: the few header values a caller needs before loading.

``gguf.GGUFReader`` parses every tensor record and builds numpy views of the whole file
(seconds even for a 135M model); checks made before the weights load (the trained
context, the architecture) need only a handful of key/value pairs from the header.
Layout (GGUF v2/v3, little-endian): magic ``GGUF``, ``u32`` version, ``u64`` tensor
count, ``u64`` key/value count, then each pair: key (``u64`` length + UTF-8), ``u32``
value type, value (arrays: ``u32`` element type, ``u64`` count, elements).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

_SCALARS = {  # GGUF value type -> struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9


class GGUFHeaderError(ValueError):
    """The file is not a GGUF file, or its header is cut off or malformed."""


class GGUFTruncatedError(GGUFHeaderError):
    """The header runs past the end of the file (a cut-off download or copy); the message
    is the loader's (:func:`engine.weights.gguf.open_reader`)."""


class _Cut(Exception):
    """A fixed-size read past the end of the file."""


class _Past(Exception):
    """A string or array length that runs past the end of the file (cut off, or corrupt:
    unchecked, a huge length sends the next read past ``ssize_t``, an OverflowError)."""


def read_gguf_fields(path: str | Path, keys: set[str] | frozenset[str]) -> dict[str, Any]:
    """The values of ``keys`` found in the GGUF header of ``path`` (missing keys absent).

    Scalars and strings are returned as Python values; array values are skipped (never
    returned), so ask only for scalar keys.

    Raises
    ------
    GGUFHeaderError
        Not a GGUF file (bad magic), unsupported version, or a malformed header;
        :class:`GGUFTruncatedError` where it runs past the end of the file.
    OSError
        The file cannot be read.
    """
    path = Path(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _read(buf, path, keys)
        except _Cut:
            raise GGUFTruncatedError(
                f"{path}: not a valid GGUF file: truncated, its header runs past the end of "
                f"the file ({len(buf):,} bytes)"
            ) from None
        except (_Past, struct.error, IndexError, UnicodeDecodeError) as exc:
            raise GGUFHeaderError(f"{path}: malformed or cut-off GGUF header ({exc})") from None


def _read(buf: mmap.mmap, path: Path, keys: set[str] | frozenset[str]) -> dict[str, Any]:
    if buf[:4] != b"GGUF":
        raise GGUFHeaderError(f"{path}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
    (version,) = _unpack("<I", buf, 4)
    if version not in (2, 3):
        raise GGUFHeaderError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    count = _unpack("<Q", buf, 16)[0]
    pos, found = 24, {}
    for _ in range(count):
        key, pos = _string(buf, pos)
        (kind,) = _unpack("<I", buf, pos)
        pos += 4
        if key in keys and kind != _ARRAY:
            value, pos = _value(buf, pos, kind)
            found[key] = value
            if len(found) == len(keys):
                break
        else:
            pos = _skip(buf, pos, kind)
    return found


def _unpack(fmt: str, buf: mmap.mmap, pos: int) -> tuple[Any, ...]:
    """``struct.unpack_from``, raising :class:`_Cut` where the file ends first."""
    if pos + struct.calcsize(fmt) > len(buf):
        raise _Cut
    return struct.unpack_from(fmt, buf, pos)


def _string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    end = _string_end(buf, pos)
    return bytes(buf[pos + 8 : end]).decode("utf-8"), end


def _string_end(buf: mmap.mmap, pos: int) -> int:
    """The offset after the GGUF string at ``pos``, checked against the file's size."""
    (length,) = _unpack("<Q", buf, pos)
    end = pos + 8 + length
    if end > len(buf):
        raise _Past(f"GGUF string at byte {pos} runs past the end of the file")
    return end


def _value(buf: mmap.mmap, pos: int, kind: int) -> tuple[Any, int]:
    if kind == _STRING:
        return _string(buf, pos)
    fmt = _SCALARS.get(kind)
    if fmt is None:
        raise struct.error(f"unknown value type {kind}")
    return _unpack(fmt, buf, pos)[0], pos + struct.calcsize(fmt)


def _skip(buf: mmap.mmap, pos: int, kind: int) -> int:
    if kind == _STRING:
        return _string_end(buf, pos)
    if kind == _ARRAY:
        start = pos
        element, n = _unpack("<IQ", buf, pos)
        pos += 12
        if element in _SCALARS:
            end = pos + n * struct.calcsize(_SCALARS[element])
            if end > len(buf):
                raise _Past(f"GGUF array at byte {start} runs past the end of the file")
            return end
        for _ in range(n):
            pos = _skip(buf, pos, element)
        return pos
    fmt = _SCALARS.get(kind)
    if fmt is None:
        raise struct.error(f"unknown value type {kind}")
    return pos + struct.calcsize(fmt)
