"""``gguf.GGUFReader`` with its metadata arrays parsed in one pass over a plain array.

Why own code: gguf-py (0.10-0.19) parses a metadata array element by element, each
element through ``GGUFReader._get``, which slices the file's ``np.memmap``; every slice of
a memmap runs numpy's Python-level ``memmap.__getitem__`` and ``__array_finalize__``. A
49K-token vocabulary and its 49K merges are ~250K such slices: 2-3 s on the development
CPU and on the H200 host, before any tensor is touched (docs/performance.md, "Start-up").
gguf-py has no lazy or vectorised mode for them, and the reader is the library we keep
for the tensors, so :class:`FastGGUFReader` subclasses it and replaces only the parse of
an array of strings or of scalars: the same element layout (GGUF spec, "Array": ``u32``
element type, ``u64`` count, then the elements; a string is a ``u64`` length and its
UTF-8 bytes), read with :func:`struct.unpack_from` and sliced from a plain ``ndarray``
view of the same memmap. The :class:`gguf.ReaderField` objects it builds are those of
the stock reader: the same parts (values, dtypes and shapes; plain ``ndarray`` views of
the file instead of ``memmap`` views), data indices and types
(``tests/engine/test_gguf_reader.py`` compares every field of the embedded model and of
written files with the stock reader). Tensors, scalar fields, nested arrays and
byte-swapped files take the stock code.
"""

from __future__ import annotations

import struct
from typing import Any

import gguf
import numpy as np
from gguf.constants import GGUFValueType

_ARRAY = GGUFValueType.ARRAY
_STRING = GGUFValueType.STRING


class FastGGUFReader(gguf.GGUFReader):
    """``gguf.GGUFReader(path)`` whose metadata arrays of strings or scalars are parsed in
    one loop (see the module docstring); everything else is the stock reader's.

    Parameters
    ----------
    path : the ``.gguf`` file (``mode`` as ``gguf.GGUFReader`` takes it).

    Raises
    ------
    ValueError, struct.error
        As ``gguf.GGUFReader`` on a damaged file (a string or array past the end of the
        file raises ``ValueError``).
    """

    def _plain(self) -> np.ndarray:
        """The file's bytes as a plain ``uint8`` ndarray (no memmap subclass per slice)."""
        plain = self.__dict__.get("_plain_data")
        if plain is None:
            plain = self.__dict__["_plain_data"] = self.data.view(np.ndarray)
        return plain

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list, list]:
        if raw_type != _ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        plain = self._plain()
        item_raw, count = struct.unpack_from("<IQ", plain, orig_offs)
        item = GGUFValueType(item_raw)
        if item == _STRING:
            parts, end = self._string_parts(plain, orig_offs + 12, count)
        elif item in self.gguf_scalar_to_np:
            parts, end = self._scalar_parts(plain, orig_offs + 12, count, item)
        else:  # arrays of arrays: the stock recursion
            return super()._get_field_parts(orig_offs, raw_type)
        head = [
            plain[orig_offs : orig_offs + 4].view(np.uint32),
            plain[orig_offs + 4 : orig_offs + 12].view(np.uint64),
        ]
        step = 2 if item == _STRING else 1
        data = list(range(2 + step - 1, 2 + step * count, step))
        types = [GGUFValueType(raw_type)] + ([item] if count else [])
        return end - orig_offs, head + parts, data, types

    @staticmethod
    def _string_parts(plain: np.ndarray, offs: int, count: int) -> tuple[list[Any], int]:
        """``count`` strings from ``offs``: ``[len_0, bytes_0, len_1, bytes_1, ...]`` as
        ``uint64[1]`` and ``uint8[len]`` views, and the offset after the last."""
        parts: list[Any] = []
        size = len(plain)
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            (length,) = unpack(plain, offs)
            end = offs + 8 + length
            if end > size:
                raise ValueError(f"GGUF string at byte {offs} runs past the end of the file")
            parts.append(plain[offs : offs + 8].view(np.uint64))
            parts.append(plain[offs + 8 : end])
            offs = end
        return parts, offs

    def _scalar_parts(
        self, plain: np.ndarray, offs: int, count: int, item: GGUFValueType
    ) -> tuple[list[Any], int]:
        """``count`` scalars of type ``item`` from ``offs``: one 1-element view each (as
        the stock reader keeps them), and the offset after the last."""
        dtype = np.dtype(self.gguf_scalar_to_np[item])
        width = dtype.itemsize
        end = offs + width * count
        if end > len(plain):
            raise ValueError(f"GGUF array at byte {offs} runs past the end of the file")
        values = plain[offs:end].view(dtype)
        return [values[i : i + 1] for i in range(count)], end
