"""``FastGGUFReader`` builds the very fields and tensors of ``gguf.GGUFReader``."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.constants import GGUFEndian, GGUFValueType

from engine.weights.gguf_reader import FastGGUFReader

SCALAR_ARRAYS = {
    GGUFValueType.UINT8: [0, 7, 255],
    GGUFValueType.INT8: [-128, 0, 5],
    GGUFValueType.UINT16: [1, 65535],
    GGUFValueType.INT16: [-3, 3],
    GGUFValueType.UINT32: [1, 2, 4_000_000_000],
    GGUFValueType.INT32: [-1, 0, 1, 2, 3],
    GGUFValueType.FLOAT32: [0.5, -1.25, 3e-8],
    GGUFValueType.UINT64: [2**40 + 1],
    GGUFValueType.INT64: [-(2**40)],
    GGUFValueType.FLOAT64: [1e300, -0.0],
    GGUFValueType.BOOL: [True, False, True],
}


def assert_same_reader(fast: gguf.GGUFReader, stock: gguf.GGUFReader) -> None:
    """Every field (offset, name, types, data indices, each part's dtype, shape and
    bytes) and every tensor equal; contents() equal."""
    assert list(fast.fields) == list(stock.fields)
    for name, want in stock.fields.items():
        got = fast.fields[name]
        where = f"field {name}"
        assert (got.offset, got.name, got.types, got.data) == (
            want.offset,
            want.name,
            want.types,
            want.data,
        ), where
        assert len(got.parts) == len(want.parts), where
        for i, (a, b) in enumerate(zip(got.parts, want.parts, strict=True)):
            assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{where} part {i}"
            assert a.tobytes() == b.tobytes(), f"{where} part {i}"
        assert got.contents() == want.contents(), where
    assert fast.data_offset == stock.data_offset
    assert [t.name for t in fast.tensors] == [t.name for t in stock.tensors]
    for a, b in zip(fast.tensors, stock.tensors, strict=True):
        assert (a.tensor_type, a.n_bytes, a.data_offset) == (
            b.tensor_type,
            b.n_bytes,
            b.data_offset,
        )
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype
        assert np.array_equal(a.data, b.data), a.name


def write_awkward(path: Path, endianess: GGUFEndian = GGUFEndian.LITTLE) -> Path:
    """A GGUF with every array kind: strings (unicode, one empty), each scalar type,
    a one-element array, an array of arrays, scalars between them, and two tensors."""
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    w.add_uint32("a.scalar", 7)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "", "héllo wörld", "Ġthe", "😀", "a" * 300])
    for vtype, values in SCALAR_ARRAYS.items():
        w.add_key_value(f"arr.{vtype.name.lower()}", values, GGUFValueType.ARRAY, sub_type=vtype)
        w.add_string(f"after.{vtype.name.lower()}", "x")
    w.add_array("arr.one", ["only"])
    w.add_key_value("arr.nested", [[1, 2], [3]], GGUFValueType.ARRAY)
    w.add_array("tokenizer.ggml.merges", ["Ġ t", "h e"])
    w.add_tensor("t.f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("t.f16", np.ones((2, 32), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_fields_and_tensors_equal_the_stock_reader(tmp_path: Path) -> None:
    path = write_awkward(tmp_path / "awkward.gguf")
    assert_same_reader(FastGGUFReader(path), gguf.GGUFReader(path))


def test_byte_swapped_file_takes_the_stock_path(tmp_path: Path) -> None:
    path = write_awkward(tmp_path / "big.gguf", GGUFEndian.BIG)
    fast, stock = FastGGUFReader(path), gguf.GGUFReader(path)
    assert fast.byte_order == "S"
    assert_same_reader(fast, stock)


def test_cut_off_string_array_is_refused(tmp_path: Path) -> None:
    path = write_awkward(tmp_path / "cut.gguf")
    data = path.read_bytes()
    at = data.index(b"a" * 300)
    cut = tmp_path / "cut2.gguf"
    cut.write_bytes(data[: at + 10])
    with pytest.raises(ValueError, match="past the end"):
        FastGGUFReader(cut)


def test_embedded_model_equals_the_stock_reader(smollm2_gguf_path: Path) -> None:
    """The 49K-token vocabulary and merges of the embedded model, field for field."""
    assert_same_reader(FastGGUFReader(smollm2_gguf_path), gguf.GGUFReader(smollm2_gguf_path))
