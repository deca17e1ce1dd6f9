"""Load a Llama-architecture GGUF file with the ``gguf`` package.

Format: GGUF spec (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md); tensor names
and metadata keys as written by llama.cpp's ``convert_hf_to_gguf.py``. Q4_0/Q4_1 linear
weights are kept as 4-bit blocks (:func:`engine.weights.quant.int4_from_gguf_blocks`); F32, F16,
BF16 and Q8_0 tensors are dequantised to float32 with ``gguf.quants.dequantize``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.config import ModelConfig, RopeScaling
from engine.weights.quant import int4_from_gguf_blocks
from engine.weights.types import LayerWeights, ModelWeights, unpermute_qk_rows

SUPPORTED_ARCHS = ("llama",)
FLOAT_TYPES = ("F32", "F16", "BF16", "Q8_0")
INT4_TYPES = ("Q4_0", "Q4_1")

_LAYER_TENSORS = {
    "attn_norm": "attn_norm.weight",
    "ffn_norm": "ffn_norm.weight",
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "wo": "attn_output.weight",
    "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
}
_OPTIONAL = {"bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias"}


class GGUFError(ValueError):
    """The file is not a GGUF model this engine runs; the message names file and field."""


def open_reader(path: Path):
    """``gguf.GGUFReader`` on ``path``, checking every tensor's description before any
    tensor data is mapped.

    Each tensor's type must be known, its row length (``ne0``, elements) a multiple of
    its type's block size (32 for Q8_0/Q4_0/Q4_1), and its data must lie inside the file
    (a truncated download). Those checks run on the tensor-info section the reader has
    parsed, before it shapes the data, so the error names the tensor instead of
    surfacing as a numpy reshape error.

    Raises
    ------
    GGUFError
        ``"{path}: tensor {name} ({type}, shape [...]): ..."`` for a bad tensor, or
        ``"{path}: not a readable GGUF file (...)"`` when the header itself cannot be
        parsed.
    """
    import gguf

    class CheckedReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list) -> None:
            for field in fields:
                _check_tensor_info(path, len(self.data), start_offs, field.parts)
            super()._build_tensors(start_offs, fields)

    try:
        return CheckedReader(str(path))
    except GGUFError:
        raise
    except Exception as e:  # gguf raises ValueError/struct errors on bad files
        raise GGUFError(f"{path}: not a readable GGUF file ({e})") from e


def _check_tensor_info(path: Path, file_bytes: int, data_start: int, parts: list) -> None:
    """Raise :class:`GGUFError` when one tensor-info record (the reader's field parts:
    name length, name, n_dims, dims, type, offset) describes data the file cannot hold."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        _name_len, name_data, _n_dims, dims, raw_type, offset = parts
    except ValueError:  # another gguf-py layout: leave the checks to the reader
        return
    name = bytes(name_data).decode("utf-8", "replace")
    shape = [int(d) for d in dims]  # ggml order: ne0 (the row length) first
    try:
        kind = GGMLQuantizationType(int(raw_type[0]))
    except ValueError:
        raise GGUFError(
            f"{path}: tensor {name} (shape {shape}) has unknown ggml type id "
            f"{int(raw_type[0])}; the file is damaged or newer than this gguf package"
        ) from None
    where = f"{path}: tensor {name} ({kind.name}, shape {shape}, ne0 first)"
    block, type_bytes = GGML_QUANT_SIZES[kind]
    if shape and shape[0] % block:
        raise GGUFError(
            f"{where}: row length {shape[0]} is not a multiple of the {kind.name} block size "
            f"{block}; the file is damaged or was written wrongly"
        )
    elements = 1
    for d in shape:
        elements *= d
    need = elements // block * type_bytes
    begin = data_start + int(offset[0])
    if begin + need > file_bytes:
        raise GGUFError(
            f"{where}: needs {need} bytes at offset {begin} but the file ends at {file_bytes} "
            f"bytes ({begin + need - file_bytes} missing); the file is truncated (an "
            "interrupted download or copy?)"
        )


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_config(reader, path: Path) -> ModelConfig:
    """Build :class:`ModelConfig` from GGUF metadata.

    Raises
    ------
    GGUFError
        Unsupported ``general.architecture`` or a missing required key.
    """
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(
            f"{path}: general.architecture={arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHS)})"
        )

    def req(key: str):
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise GGUFError(f"{path}: missing metadata key {arch}.{key}")
        return v

    hidden = int(req("embedding_length"))
    heads = int(req("attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(_field(reader, f"{arch}.vocab_size", len(tokens.data) if tokens else 0))
    ctx = int(_field(reader, f"{arch}.context_length", 4096))
    scaling = None
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in ("linear", "yarn"):
        scaling = RopeScaling(
            kind=kind,
            factor=float(_field(reader, f"{arch}.rope.scaling.factor", 1.0)),
            original_max_position=int(
                _field(reader, f"{arch}.rope.scaling.original_context_length", ctx)
            ),
        )
    names = {t.name for t in reader.tensors}
    return ModelConfig(
        arch=arch,
        num_layers=int(req("block_count")),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(req("feed_forward_length")),
        vocab_size=vocab,
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=ctx,
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        name=str(_field(reader, "general.name", path.stem)),
    )


def _load_tensor(t, path: Path):
    """float32 tensor (numpy dims reversed to row-major ``[N, K]``) or Int4Weight."""
    kind = t.tensor_type.name
    shape = tuple(int(x) for x in reversed(t.shape))  # ggml ne0 is the inner dim
    if kind in INT4_TYPES:
        return int4_from_gguf_blocks(np.asarray(t.data), kind, shape)
    if kind not in FLOAT_TYPES:
        raise GGUFError(
            f"{path}: tensor {t.name} has type {kind}; supported: "
            f"{', '.join(FLOAT_TYPES + INT4_TYPES)}"
        )
    import gguf

    arr = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    return torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(shape)


def load_gguf(path: str | Path) -> ModelWeights:
    """Read config and weights of a GGUF model.

    Returns
    -------
    ModelWeights with Q/K rows restored to Hugging Face order.

    Raises
    ------
    FileNotFoundError
        No such file.
    GGUFError
        Not a readable GGUF file; a tensor whose type is unknown, whose row length is not a
        multiple of its block size, or whose data lies past the end of the file (named
        with its type and shape, before any data is read; :func:`open_reader`); an
        unsupported architecture, a missing key or tensor, or a wrong shape.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    reader = open_reader(path)
    cfg = read_config(reader, path)
    cfg.validate()
    by_name = {t.name: t for t in reader.tensors}
    formats = {name: t.tensor_type.name for name, t in by_name.items()}

    def get(name: str):
        t = by_name.get(name)
        if t is None:
            raise GGUFError(f"{path}: missing tensor {name}")
        return _load_tensor(t, path)

    q_index = unpermute_qk_rows(cfg.num_heads * cfg.head_dim, cfg.num_heads)
    k_index = unpermute_qk_rows(cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads)
    layers = []
    for i in range(cfg.num_layers):
        parts = {k: get(f"blk.{i}.{v}") for k, v in _LAYER_TENSORS.items()}
        for k, v in _OPTIONAL.items():
            parts[k] = get(f"blk.{i}.{v}") if f"blk.{i}.{v}" in by_name else None
        parts["wq"] = _permute(parts["wq"], q_index)
        parts["wk"] = _permute(parts["wk"], k_index)
        if parts["bq"] is not None:
            parts["bq"] = parts["bq"][q_index]
            parts["bk"] = parts["bk"][k_index]
        _check_layer(cfg, i, parts, path)
        layers.append(LayerWeights(**parts))
    embed = get("token_embd.weight")
    lm_head = None if cfg.tie_word_embeddings else get("output.weight")
    return ModelWeights(cfg, embed, get("output_norm.weight"), layers, lm_head, formats)


def _permute(w, index: torch.Tensor):
    return w.permute_rows(index) if hasattr(w, "permute_rows") else w[index]


def _check_layer(cfg: ModelConfig, i: int, parts: dict, path: Path) -> None:
    h, d = cfg.hidden_size, cfg.head_dim
    want = {
        "wq": (cfg.num_heads * d, h),
        "wk": (cfg.num_kv_heads * d, h),
        "wv": (cfg.num_kv_heads * d, h),
        "wo": (h, cfg.num_heads * d),
        "w_gate": (cfg.intermediate_size, h),
        "w_up": (cfg.intermediate_size, h),
        "w_down": (h, cfg.intermediate_size),
    }
    for name, shape in want.items():
        got = tuple(parts[name].shape)
        if got != shape:
            raise GGUFError(f"{path}: blk.{i} {name} has shape {got}, expected {shape}")
