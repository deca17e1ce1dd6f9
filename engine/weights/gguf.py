"""Load a GGUF file of a registered architecture (:mod:`engine.model.registry`: ``llama``,
``mistral``, ``qwen2``, ``qwen3``, ``phi3``) with the ``gguf`` package.

Format: GGUF spec (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md); tensor names
and metadata keys as written by llama.cpp's ``convert_hf_to_gguf.py``: Q/K rows are
permuted for ``llama`` (undone here) and not for ``qwen2`` / ``qwen3``; Qwen2's q/k/v
biases are ``attn_{q,k,v}.bias``, Qwen3's per-head norms ``attn_{q,k}_norm.weight``;
Phi-3 (``Phi3MiniModel``) keeps its fused ``attn_qkv.weight`` (q|k|v rows, unpermuted) and
``ffn_up.weight`` (gate|up rows, no ``ffn_gate``), split here, and writes ``longrope`` as
``rope_factors_short.weight`` / ``rope_factors_long.weight`` with
``phi3.rope.scaling.attn_factor`` and ``phi3.rope.scaling.original_context_length``; a
``<arch>.attention.sliding_window`` > 0 caps the trained context of an all-layer window
(Mistral, Phi-3) as for Hugging Face folders (:mod:`engine.weights.hf`). Gemma 2/3
(``Gemma2Model`` / ``Gemma3Model``): norms already hold ``1 + w``, Q/K unpermuted, the
output norms ``post_attention_norm`` / ``post_ffw_norm`` (``ffn_norm`` is the pre-MLP
norm), soft-caps and the window from the metadata, sliding layers and query scale as
llama.cpp derives them (:func:`_gemma_fields`).
A tensor the architecture does not use is refused (never silently dropped).

Tensor types: Q4_0, Q4_1 and Q4_K linear weights are kept as their 4-bit codes
(:func:`engine.weights.quant.int4_from_gguf_blocks`, exact); every other type gguf-py
decodes (F32, F16, BF16, Q8_0, Q5_0/Q5_1, Q2_K..Q6_K, IQ*, ...) and every embedding, norm
and bias is dequantised to float32 with ``gguf.quants.dequantize``. Placement then keeps
float linears float (``weight_format=float``) or re-quantises them group-wise to int4
(``int4``; see :func:`engine.weights.quant.make_linear` and docs/performance.md for the
error). ``ModelWeights.formats`` records each tensor's GGUF type. Q4_0/Q4_1 linear
weights are kept as 4-bit blocks (:func:`engine.weights.quant.int4_from_gguf_blocks`); F32, F16,
BF16 and Q8_0 tensors are dequantised to float32 with ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.config import (
    ConfigError,
    ModelConfig,
    RopeScaling,
    check_numbers,
    check_shape,
    model_shape,
)
from engine.model import registry

if TYPE_CHECKING:
    import torch

    from engine.weights.types import ModelWeights

# torch (and the weight types built on it) is imported where tensors are made
# (:func:`load_gguf`), so reading a header's shape (``hisparse plan``, ``run
# --print-config``, the host-pool fit before the load) starts without it.

SUPPORTED_ARCHS = registry.gguf_names()
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # linears kept as 4-bit codes

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
_QK_NORMS = {"q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight"}
# Gemma 2/3: the norms of the attention and MLP outputs (``ffn_norm`` is the pre-MLP norm).
_GEMMA_NORMS = {"post_attn_norm": "post_attention_norm.weight", "post_ffn_norm": "post_ffw_norm.weight"}
_GLOBAL = ("token_embd.weight", "output_norm.weight", "output.weight")
# Fused tensors of ``fused_projections`` architectures (Phi-3) -> the fields they split into.
_FUSED = {"attn_qkv.weight": ("wq", "wk", "wv"), "ffn_up.weight": ("w_gate", "w_up")}
ROPE_FACTORS = {"short_factor": "rope_factors_short.weight", "long_factor": "rope_factors_long.weight"}


class GGUFError(ValueError):
    """The file is not a GGUF model this engine runs; the message names file and field."""


GGUF_FIXED_HEADER_BYTES = 24
"""Magic (4), version (4), tensor count (8), metadata count (8): the bytes every GGUF
file starts with (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md)."""


def open_reader(path: Path):
    """``gguf.GGUFReader`` on ``path`` (as :class:`engine.weights.gguf_reader.FastGGUFReader`
    parses its metadata arrays: the same fields, ~20x sooner), checking every tensor's
    description before any tensor data is mapped.

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
        parsed, ``"{path}: not a valid GGUF file: truncated ..."`` when it runs past the
        end of the file.
    """
    from engine.weights.gguf_reader import FastGGUFReader

    class CheckedReader(FastGGUFReader):
        def _build_tensors(self, start_offs: int, fields: list) -> None:
            for field in fields:
                _check_tensor_info(path, len(self.data), start_offs, field.parts)
            super()._build_tensors(start_offs, fields)

    with open(path, "rb") as f:
        head = f.read(GGUF_FIXED_HEADER_BYTES)
    if head[:4] == b"GGUF" and len(head) < GGUF_FIXED_HEADER_BYTES:  # else numpy's error
        raise GGUFError(
            f"{path}: not a valid GGUF file: truncated, {len(head):,} bytes is less than "
            f"the {GGUF_FIXED_HEADER_BYTES} of its fixed header"
        )
    try:
        return CheckedReader(str(path))
    except GGUFError:
        raise
    except ValueError as e:
        if head[:4] == b"GGUF" and "dtype" in str(e):  # numpy viewing bytes past the end
            raise GGUFError(
                f"{path}: not a valid GGUF file: truncated, its header runs past the end "
                f"of the file ({Path(path).stat().st_size:,} bytes)"
            ) from e
        raise GGUFError(f"{path}: not a readable GGUF file ({e})") from e
    except (IndexError, struct.error) as e:  # numpy/struct read past the end of the file
        raise GGUFError(
            f"{path}: not a valid GGUF file: truncated, its header runs past the end of "
            f"the file ({Path(path).stat().st_size:,} bytes)"
        ) from e
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


def check_architecture(reader, path: Path) -> registry.Architecture:
    """The registered architecture of the file's ``general.architecture``: checked before
    the tokenizer is built, so a model of another architecture is named as such rather
    than by its tokenizer.

    Raises
    ------
    GGUFError
        Unsupported (or missing) ``general.architecture``; the message lists the supported.
    """
    try:
        return registry.for_gguf(_field(reader, "general.architecture"))
    except registry.UnsupportedArchitecture as exc:
        raise GGUFError(f"{path}: {exc}") from None


def read_config(reader, path: Path) -> ModelConfig:
    """Build :class:`ModelConfig` from GGUF metadata.

    Raises
    ------
    GGUFError
        Unsupported ``general.architecture``, or shape keys missing or out of range
        (:func:`gguf_shape`), or RoPE / norm numbers out of range (:func:`gguf_numbers`):
        all of those at once.
    """
    arch = _field(reader, "general.architecture")
    entry = check_architecture(reader, path)

    problems = []  # the one check of a model file's fields, every problem at once
    try:
        shape = gguf_shape(reader, arch, path)
    except GGUFError as exc:
        problems.append(str(exc))
    try:
        numbers = gguf_numbers(reader, arch, path)
    except GGUFError as exc:
        problems.append(str(exc))
    if problems:
        raise GGUFError("\n".join(problems))
    head_dim = shape["head_dim"]
    ctx = shape["max_position"]
    original = int(numbers.get("original_context_length", ctx))
    scaling = None
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in ("linear", "yarn"):
        scaling = RopeScaling(
            kind=kind,
            factor=numbers.get("rope_factor", 1.0),
            original_max_position=original,
        )
    names = {t.name for t in reader.tensors}
    if any(n in names for n in ROPE_FACTORS.values()):
        scaling = RopeScaling(
            kind="longrope",
            factor=ctx / original,
            original_max_position=original,
            attention_factor=numbers.get("rope_attn_factor"),
            **{k: _float_vector(reader, path, t, head_dim // 2) for k, t in ROPE_FACTORS.items()},
        )
    window = shape.get("sliding_window")
    if window and entry.sliding_window == "always":
        ctx = min(ctx, window)
    gemma = _gemma_fields(reader, arch, entry, shape, numbers) if entry.gemma else {}
    freq_factors = _rope_freq_factors(reader, path, head_dim)
    return ModelConfig(
        arch=entry.name,
        **model_shape(shape, head_dim=head_dim),
        rope_theta=numbers.get("rope_theta", 10000.0),
        rms_norm_eps=numbers.get("rms_norm_eps", 1e-5),
        max_position=ctx,
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in names,
        qkv_bias=entry.qkv_bias or "blk.0.attn_q.bias" in names,
        name=str(_field(reader, "general.name", path.stem)),
        rope_freq_factors=freq_factors,
        qk_norm=entry.qk_norm,
        **gemma,
    )


GGUF_SHAPE_KEYS = {
    "num_layers": "block_count",
    "hidden_size": "embedding_length",
    "num_heads": "attention.head_count",
    "num_kv_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "intermediate_size": "feed_forward_length",
    "vocab_size": "vocab_size",
    "max_position": "context_length",
    "sliding_window": "attention.sliding_window",
}
""":class:`ModelConfig` shape field -> its GGUF metadata key, after ``<arch>.``."""


def gguf_shape(reader, arch: str, path: Path) -> dict[str, int]:
    """The shape fields of a GGUF header, checked (:func:`engine.config.check_shape`: the
    one check of every model file's shape), as :class:`ModelConfig` names them.

    Absent ``<arch>.attention.head_count_kv``: ``head_count``; ``key_length``:
    ``embedding_length / head_count``; ``vocab_size``: the tokenizer's token count;
    ``context_length``: 4096. A ``sliding_window`` of 0 is none (left out).

    Raises
    ------
    GGUFError
        Every key that is missing or not a positive integer in range, and heads that do
        not divide, at once; each line names the file and the key.
    """
    fields = {
        name: (f"{arch}.{key}", _field(reader, f"{arch}.{key}"))
        for name, key in GGUF_SHAPE_KEYS.items()
    }
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if fields["vocab_size"][1] is None and tokens:
        fields["vocab_size"] = (f"{arch}.vocab_size", len(tokens.data))
    if fields["max_position"][1] is None:
        fields["max_position"] = (f"{arch}.context_length", 4096)
    if fields["sliding_window"][1] in (None, False, 0):
        del fields["sliding_window"]
    try:
        return check_shape(str(path), fields)
    except ConfigError as exc:
        raise GGUFError(str(exc)) from None


GGUF_NUMBER_KEYS = {
    "rope_theta": ("rope.freq_base", 1.0),
    "rms_norm_eps": ("attention.layer_norm_rms_epsilon", 0.0),
    "rope_factor": ("rope.scaling.factor", 0.0),
    "rope_attn_factor": ("rope.scaling.attn_factor", 0.0),
    "attention_scale": ("attention.scale", 0.0),
    "attn_softcap": ("attn_logit_softcapping", 0.0),
    "final_softcap": ("final_logit_softcapping", 0.0),
}
"""Real-valued field -> (its GGUF metadata key, after ``<arch>.``; the bound it must be
above, :func:`engine.config.check_numbers`)."""
_ZERO_IS_UNSET = ("attention_scale", "attn_softcap", "final_softcap")  # as llama.cpp reads them


def gguf_numbers(reader, arch: str, path: Path) -> dict[str, float]:
    """The real-valued fields of a GGUF header (:data:`GGUF_NUMBER_KEYS`) and
    ``<arch>.rope.scaling.original_context_length``, checked: each number finite and above
    its bound (:func:`engine.config.check_numbers`, as a ``config.json``'s), the context a
    positive integer (:func:`engine.config.check_shape`, as ``context_length``). Absent
    keys are left out, and so are a Gemma query scale or soft-cap of 0 (llama.cpp: not
    given / off).

    Raises
    ------
    GGUFError
        Every key out of range at once; each line names the file and the key.
    """
    fields = {}
    for name, (key, above) in GGUF_NUMBER_KEYS.items():
        value = _field(reader, f"{arch}.{key}")
        if name not in _ZERO_IS_UNSET or value not in (0, False):
            fields[name] = (f"{arch}.{key}", value, above)
    key = f"{arch}.rope.scaling.original_context_length"
    problems = []
    try:
        numbers = check_numbers(str(path), {k: (v, a) for k, v, a in fields.values()})
    except ConfigError as exc:
        problems.append(str(exc))
    try:  # a context length, checked as context_length is
        original = check_shape(str(path), {"max_position": (key, _field(reader, key))})
    except ConfigError as exc:
        problems.append(str(exc))
    if problems:
        raise GGUFError("\n".join(problems))
    found = {name: numbers[k] for name, (k, _, _) in fields.items() if k in numbers}
    if "max_position" in original:
        found["original_context_length"] = original["max_position"]
    return found


# llama.cpp (llama-model.cpp): Gemma 2 and 3 mark every 2nd / 6th layer global
# (``set_swa_pattern``), use RoPE base 10 000 on Gemma 3's sliding layers
# (``rope_freq_base_train_swa``), and scale queries by ``(hidden / heads) ** -0.5`` for the
# 27B models (46 / 62 layers) and ``head_dim ** -0.5`` otherwise; the converter writes no
# ``query_pre_attn_scalar``.
_GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
GEMMA3_LOCAL_ROPE_THETA = 10000.0


def _gemma_fields(
    reader, arch: str, entry, shape: dict[str, int], numbers: dict[str, float]
) -> dict:
    """:class:`ModelConfig` fields of a ``gemma2`` / ``gemma3`` file (see the constants
    above): soft-caps (``<arch>.attn_logit_softcapping`` /
    ``final_logit_softcapping``), sliding layers (``attention.sliding_window_pattern`` when
    written: a period or one bool per layer; else llama.cpp's pattern) and the query
    scale (``shape``: :func:`gguf_shape`'s; ``numbers``: :func:`gguf_numbers`')."""
    n, hidden, heads = shape["num_layers"], shape["hidden_size"], shape["num_heads"]
    head_dim, window = shape["head_dim"], shape.get("sliding_window")
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        sliding = tuple(i for i, swa in enumerate(pattern) if swa)
    else:
        period = int(pattern or _GEMMA_SWA_PATTERN[entry.name])
        sliding = tuple(i for i in range(n) if (i + 1) % period) if period > 1 else ()
    if not window:
        sliding = ()
    scale = numbers.get("attention_scale")
    if scale:
        scalar = scale**-2
    elif n == _GEMMA_27B_LAYERS[entry.name]:
        scalar = hidden / heads
    else:
        scalar = float(head_dim)
    return dict(
        attn_softcap=numbers.get("attn_softcap"),
        final_softcap=numbers.get("final_softcap"),
        query_pre_attn_scalar=scalar,
        sliding_window=int(window) if sliding else None,
        sliding_layers=sliding,
        rope_local_theta=GEMMA3_LOCAL_ROPE_THETA if entry.name == "gemma3" else None,
    )


ROPE_FREQS = "rope_freqs.weight"


def _float_vector(reader, path: Path, name: str, size: int) -> tuple[float, ...]:
    """The ``size`` positive floats of the 1-D tensor ``name`` (``longrope`` factors).

    Raises
    ------
    GGUFError
        The tensor is missing or does not hold ``size`` positive values.
    """
    import gguf

    t = next((t for t in reader.tensors if t.name == name), None)
    if t is None:
        raise GGUFError(f"{path}: missing tensor {name}")
    values = np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), np.float32)
    values = values.reshape(-1)
    if values.size != size or not (values > 0).all():
        raise GGUFError(f"{path}: tensor {name} has {values.size} values; expected {size} positive")
    return tuple(float(v) for v in values)


def _rope_freq_factors(reader, path: Path, head_dim: int) -> tuple[float, ...] | None:
    """The ``rope_freqs.weight`` tensor (``[D/2]`` float divisors of the RoPE inverse
    frequencies; llama.cpp's converter writes Llama 3.1's ``llama3`` scaling this way and
    ``ggml_rope_ext`` divides by it), or ``None`` when the file has none.

    Raises
    ------
    GGUFError
        The tensor does not hold ``D/2`` positive values.
    """
    t = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if t is None:
        return None
    import gguf

    values = np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), np.float32)
    values = values.reshape(-1)
    if values.size != head_dim // 2 or not (values > 0).all():
        raise GGUFError(
            f"{path}: tensor {ROPE_FREQS} has {values.size} values "
            f"(min {values.min() if values.size else None}); expected {head_dim // 2} "
            f"positive RoPE frequency factors for head_dim={head_dim}"
        )
    return tuple(float(v) for v in values)


def _load_tensor(t, path: Path, keep_int4: bool = False):
    """One tensor, numpy dims reversed to row-major (``[N, K]`` for a linear).

    ``keep_int4``: a Q4_0 / Q4_1 / Q4_K tensor becomes an :class:`Int4Weight` (linears);
    otherwise, and for every other type, a float32 tensor from ``gguf.quants.dequantize``.

    Raises
    ------
    GGUFError
        A type gguf-py cannot decode, or blocks that do not fit the shape (names tensor).
    """
    import gguf
    import torch

    from engine.weights.quant import int4_from_gguf_blocks

    kind = t.tensor_type.name
    shape = tuple(int(x) for x in reversed(t.shape))  # ggml ne0 is the inner dim
    try:
        if keep_int4 and kind in INT4_TYPES and len(shape) == 2:
            return int4_from_gguf_blocks(np.asarray(t.data), kind, shape)
        arr = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    except NotImplementedError as exc:
        raise GGUFError(
            f"{path}: tensor {t.name} has type {kind}, which gguf-py cannot decode ({exc})"
        ) from None
    except ValueError as exc:
        raise GGUFError(f"{path}: tensor {t.name} ({kind}, shape {shape}): {exc}") from None
    return torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(shape)


def load_gguf(path: str | Path, reader=None) -> ModelWeights:
    """Read config and weights of a GGUF model (``reader``: one :func:`open_reader` already
    opened on ``path``, e.g. for its tokenizer).

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
    from engine.weights.types import (
        LINEAR_NAMES,
        LayerWeights,
        ModelWeights,
        split_rows,
        unpermute_qk_rows,
    )

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    reader = reader if reader is not None else open_reader(path)
    cfg = read_config(reader, path)
    cfg.validate()
    by_name = {t.name: t for t in reader.tensors}
    formats = {name: t.tensor_type.name for name, t in by_name.items()}

    def get(name: str, keep_int4: bool = False):
        t = by_name.get(name)
        if t is None:
            raise GGUFError(f"{path}: missing tensor {name}")
        return _load_tensor(t, path, keep_int4)

    _check_names(cfg, by_name, path)
    _check_vocabulary(reader, by_name, path)
    permuted = registry.get(cfg.arch).gguf_permuted_qk
    layer_tensors, fused = _layer_tensors(cfg)
    kv_rows = cfg.num_kv_heads * cfg.head_dim
    rows = {"wq": cfg.num_heads * cfg.head_dim, "wk": kv_rows, "wv": kv_rows}
    rows |= {"w_gate": cfg.intermediate_size, "w_up": cfg.intermediate_size}
    q_index = unpermute_qk_rows(cfg.num_heads * cfg.head_dim, cfg.num_heads)
    k_index = unpermute_qk_rows(cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads)
    layers = []
    for i in range(cfg.num_layers):
        parts = {
            k: get(f"blk.{i}.{v}", keep_int4=k in LINEAR_NAMES) for k, v in layer_tensors.items()
        }
        for tensor, fields in fused.items():  # Phi-3: q|k|v and gate|up rows
            w = get(f"blk.{i}.{tensor}", keep_int4=True)
            want = sum(rows[f] for f in fields)
            if w.shape[0] != want:
                raise GGUFError(
                    f"{path}: blk.{i}.{tensor} has {w.shape[0]} rows, expected {want} "
                    f"({' + '.join(f'{f}={rows[f]}' for f in fields)})"
                )
            parts.update(zip(fields, split_rows(w, [rows[f] for f in fields]), strict=True))
        for k, v in _OPTIONAL.items():
            parts[k] = get(f"blk.{i}.{v}") if cfg.qkv_bias else None
        if cfg.qk_norm:
            parts.update({k: get(f"blk.{i}.{v}") for k, v in _QK_NORMS.items()})
        if permuted:
            parts["wq"] = _permute(parts["wq"], q_index)
            parts["wk"] = _permute(parts["wk"], k_index)
            if parts["bq"] is not None:
                parts["bq"] = parts["bq"][q_index]
                parts["bk"] = parts["bk"][k_index]
        _check_layer(cfg, i, parts, path)
        layers.append(LayerWeights(**parts))
    embed = get("token_embd.weight")
    lm_head = None if cfg.tie_word_embeddings else get("output.weight", keep_int4=True)
    return ModelWeights(cfg, embed, get("output_norm.weight"), layers, lm_head, formats)


def _layer_tensors(cfg: ModelConfig) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """(field -> tensor name of the unfused tensors, fused tensor name -> fields) of one
    layer of ``cfg``'s architecture."""
    if registry.get(cfg.arch).gemma:
        return dict(_LAYER_TENSORS) | _GEMMA_NORMS, {}
    if not registry.get(cfg.arch).fused_projections:
        return dict(_LAYER_TENSORS), {}
    split = {f for fields in _FUSED.values() for f in fields}
    return {k: v for k, v in _LAYER_TENSORS.items() if k not in split}, dict(_FUSED)


def _check_names(cfg: ModelConfig, by_name: dict, path: Path) -> None:
    """Refuse tensors this architecture would not use (an unknown tensor may carry math
    the engine would otherwise silently skip, as ``rope_freqs`` once was)."""
    known = set(_GLOBAL) | {ROPE_FREQS} | set(ROPE_FACTORS.values())
    layer_tensors, fused = _layer_tensors(cfg)
    per_layer = list(layer_tensors.values()) + list(fused)
    per_layer += list(_OPTIONAL.values()) if cfg.qkv_bias else []
    per_layer += list(_QK_NORMS.values()) if cfg.qk_norm else []
    known |= {f"blk.{i}.{t}" for i in range(cfg.num_layers) for t in per_layer}
    unknown = sorted(set(by_name) - known)
    if unknown:
        more = f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else ""
        raise GGUFError(
            f"{path}: tensor(s) {', '.join(unknown[:5])}{more} are not used by a {cfg.arch} "
            f"model ({registry.get(cfg.arch).description}); refusing rather than ignoring them"
        )


def _check_vocabulary(reader, by_name: dict, path: Path) -> None:
    """Refuse a file whose tokenizer or LM head gives ids past the token embedding's rows,
    from the header alone (no tensor data read). llama.cpp sizes both tensors by the token
    list (``token_embd.weight`` and ``output.weight`` are ``{n_embd, n_vocab}``,
    ``llama-model.cpp``) and refuses other shapes; here a larger token list is refused
    (an id past the rows would index out of range: on the CPU the job failed with "index
    226 is out of bounds", on a GPU a device-side assert ends every job) and a smaller one
    is accepted (rows padded to a round number).

    Raises
    ------
    GGUFError
        The token list (``tokenizer.ggml.tokens``) or ``output.weight`` has more entries
        than ``token_embd.weight`` has rows; the message names the file and both counts.
    """
    embed = by_name.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        return  # the load names a missing tensor; a wrong rank fails its shape check
    rows = int(embed.shape[1])  # ggml's ne1: one row per token id
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    count = len(tokens.data) if tokens is not None else 0
    if count > rows:
        raise GGUFError(
            f"{path}: the tokenizer (tokenizer.ggml.tokens) has {count:,} tokens but "
            f"token_embd.weight only {rows:,} rows: ids from {rows:,} on have no "
            "embedding; the file is broken or its tokenizer is not this model's"
        )
    head = by_name.get("output.weight")
    if head is not None and len(head.shape) == 2 and int(head.shape[1]) > rows:
        raise GGUFError(
            f"{path}: output.weight has {int(head.shape[1]):,} rows (token ids the model "
            f"can generate) but token_embd.weight only {rows:,}: a generated id past "
            f"{rows - 1:,} would have no embedding"
        )


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
    if cfg.qkv_bias:
        kv = cfg.num_kv_heads * d
        want |= {"bq": (cfg.num_heads * d,), "bk": (kv,), "bv": (kv,)}
    if cfg.qk_norm:
        want |= {"q_norm": (d,), "k_norm": (d,)}
    if registry.get(cfg.arch).gemma:
        want |= {"post_attn_norm": (h,), "post_ffn_norm": (h,)}
    for name, shape in want.items():
        got = tuple(parts[name].shape)
        if got != shape:
            raise GGUFError(f"{path}: blk.{i} {name} has shape {got}, expected {shape}")
