"""Known model shapes for planning, as :class:`~engine.config.ModelConfig`.

The planner needs only a model's shape (no weights, no torch), so the shapes of the models
the presets are sized for live here. Each entry is taken from the model's published
``config.json`` (Hugging Face hub), except where noted.

Shape symbols: ``L`` layers, ``H`` hidden size, ``Hq`` query heads, ``Hkv`` KV heads,
``D`` head dim, ``F`` FFN (intermediate) size, ``V`` vocabulary.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.config import (
    ConfigError,
    ModelConfig,
    RopeScaling,
    check_numbers,
    check_shape,
    model_shape,
)
from engine.model.registry import UnsupportedArchitecture, for_hf

MODEL_SHAPES: dict[str, ModelConfig] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct; the embedded default model (DESIGN.md), whose
    # GGUF file stores the linears Q4_1 (groups of 32), as shape_from_gguf reads it.
    "smollm2-135m": ModelConfig(
        arch="llama",
        num_layers=30,
        hidden_size=576,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        max_position=8192,
        tie_word_embeddings=True,
        name="smollm2-135m",
        int4_group_size=32,
        int4_linears=True,
    ),
    # meta-llama/Llama-2-13b-hf: multi-head attention, 40 KV heads (800 KiB of bf16 KV
    # per token).
    "llama2-13b": ModelConfig(
        arch="llama",
        num_layers=40,
        hidden_size=5120,
        num_heads=40,
        num_kv_heads=40,
        head_dim=128,
        intermediate_size=13824,
        vocab_size=32000,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position=4096,
        name="llama2-13b",
    ),
    # Not a published model: the Llama-2-13B shape with 8 grouped KV heads, as the
    # dual-4090 article sizes its 13B example (160 KiB of bf16 KV per token). The seed
    # scenario and the measurements in docs/performance.md use it; bench records written
    # before it had its own name (docs/bench/*2026-11-2*, *2026-12-01*) call it
    # ``llama2-13b``.
    "llama2-13b-gqa8": ModelConfig(
        arch="llama",
        num_layers=40,
        hidden_size=5120,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=13824,
        vocab_size=32000,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position=4096,
        name="llama2-13b-gqa8",
    ),
    # meta-llama/Llama-3.1-8B-Instruct.
    "llama3.1-8b": ModelConfig(
        arch="llama",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        max_position=131072,
        rope_scaling=RopeScaling(
            kind="llama3",
            factor=8.0,
            original_max_position=8192,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
        ),
        name="llama3.1-8b",
    ),
    # Qwen/Qwen2.5-7B-Instruct (32K native; Qwen2.5-7B-Instruct-1M has the same shape).
    "qwen2.5-7b": ModelConfig(
        arch="qwen2",
        num_layers=28,
        hidden_size=3584,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=18944,
        vocab_size=152064,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position=32768,
        qkv_bias=True,
        name="qwen2.5-7b",
    ),
}


def list_models() -> list[str]:
    """Names of the known shapes, sorted."""
    return sorted(MODEL_SHAPES)


def get_model_shape(name_or_path: str) -> ModelConfig:
    """The shape called ``name_or_path``, or read from a Hugging Face ``config.json``.

    Parameters
    ----------
    name_or_path
        A key of :data:`MODEL_SHAPES` (case-insensitive), a ``config.json`` file, or a
        directory holding one.

    Raises
    ------
    ConfigError
        Unknown name, or a file without the fields a Llama-family shape needs.
    """
    key = name_or_path.lower()
    if key in MODEL_SHAPES:
        return MODEL_SHAPES[key]
    spelled = _spelling(key)  # llama-3.1-8b, Llama-3.1-8B-Instruct -> llama3.1-8b
    found = [name for name in MODEL_SHAPES if _spelling(name) == spelled]
    if len(found) == 1:
        return MODEL_SHAPES[found[0]]
    path = Path(name_or_path)
    if path.suffix.lower() == ".gguf" and path.is_file():
        return shape_from_gguf(path)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" and path.is_file():
        return shape_from_hf_config(path)
    if path.is_file():  # a file, but neither a GGUF nor a config.json
        raise ConfigError(
            f"model {name_or_path!r} is a file but not a model: pass a .gguf file, a Hugging "
            f"Face config.json (or its folder), or a known shape ({', '.join(list_models())})"
        )
    named = Path(name_or_path)
    if named.exists() and not named.is_dir():  # a FIFO, a device
        raise ConfigError(f"model {name_or_path!r} is not a regular file or a model folder")
    if not named.exists() and (named.suffix.lower() in (".gguf", ".json") or "/" in name_or_path):
        raise ConfigError(f"model not found: {name_or_path}")
    if Path(name_or_path).is_dir():  # a folder without config.json
        raise ConfigError(
            f"model folder {name_or_path!r} has no config.json: pass a .gguf file, a Hugging "
            f"Face model folder, or a known shape ({', '.join(list_models())})"
        )
    close = difflib.get_close_matches(key, list_models(), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(
        f"unknown model {name_or_path!r}{hint}: known shapes are {', '.join(list_models())} "
        "(or pass a GGUF file or a Hugging Face config.json)"
    )


def shape_from_gguf(path: str | Path) -> ModelConfig:
    """The shape of a GGUF file, from its header (the engine's own reader and
    :func:`engine.weights.gguf.read_config`; no tensor data is read). Its
    ``int4_group_size`` is 32 where the file's layer-0 query projection is a 4-bit block
    type the engine keeps as is (Q4_0, Q4_1, Q4_K: one scale per 32 elements), else 128
    (other types are re-quantised by ``quantize_int4``); ``int4_linears`` says whether
    every layer linear is such a type (:func:`engine.weights.placement.linears_stored_int4`,
    the loader's test of ``ModelWeights.formats``, which keeps the files' tensor types).

    Raises
    ------
    ConfigError
        The file is not a readable GGUF file of a supported architecture (the message
        names the file).
    """
    from engine.weights.gguf import INT4_TYPES, GGUFError, open_reader, read_config
    from engine.weights.placement import linears_stored_int4

    path = Path(path)
    try:
        reader = open_reader(path)
        shape = read_config(reader, path)
    except GGUFError as exc:
        raise ConfigError(str(exc)) from None
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    group = 32 if types.get("blk.0.attn_q.weight") in INT4_TYPES else 128
    return replace(shape, int4_group_size=group, int4_linears=linears_stored_int4(types))


HF_SHAPE_NAMES = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
    "max_position": "max_position_embeddings",
    "sliding_window": "sliding_window",
}
""":class:`ModelConfig` shape field -> its name in a Hugging Face ``config.json``."""


def hf_shape(raw: dict[str, Any], path: str | Path) -> dict[str, int]:
    """The shape fields of a ``config.json`` dict, checked (:func:`engine.config.check_shape`:
    the one check of every model file's shape), as :class:`ModelConfig` names them.

    Absent (or null) ``num_key_value_heads``: ``num_attention_heads``; ``head_dim``:
    ``hidden_size / num_attention_heads``; ``max_position_embeddings``: 4096. A
    ``sliding_window`` of null, false or 0 is none (left out).

    Raises
    ------
    ConfigError
        Every field that is missing or not a positive integer in range, and heads that do
        not divide, at once; each line names the file and the field.
    """
    fields = {name: (key, raw.get(key)) for name, key in HF_SHAPE_NAMES.items()}
    if "max_position_embeddings" not in raw:
        fields["max_position"] = ("max_position_embeddings", 4096)
    if raw.get("sliding_window") in (None, False, 0):
        del fields["sliding_window"]
    return check_shape(str(path), fields)


def hf_rope_base(raw: dict[str, Any], block: str = "rope_parameters") -> tuple[str, Any]:
    """The RoPE base of a ``config.json`` dict as (its name in messages, its value as read,
    ``None`` when absent): ``rope_parameters.rope_theta`` (transformers 5; ``block`` names
    that block) where given, else ``rope_theta``. Checked (> 1) by the readers, with
    :func:`engine.config.check_numbers`."""
    params = raw.get("rope_parameters") or {}
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return f"{block}.rope_theta", params["rope_theta"]
    return "rope_theta", raw.get("rope_theta")


def shape_from_hf_config(path: str | Path) -> ModelConfig:
    """Build a :class:`ModelConfig` from a Hugging Face ``config.json`` (pure JSON, no torch).

    The shape fields are read and checked by :func:`hf_shape`, as ``hisparse run`` reads
    them (:func:`engine.weights.hf.read_hf_config`).

    Raises
    ------
    ConfigError
        The file cannot be read, is not JSON, is not a JSON object, names an architecture
        the engine does not run (``architectures``, else ``model_type``, checked first as
        the loader does; a file naming neither is read as a Llama-family shape), or lacks
        a field or has one of the wrong type or out of range (the message names the file
        and the field).
    """
    path = Path(path)
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it as JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: a config.json is a JSON object, got {type(cfg).__name__}")
    if cfg.get("architectures") or cfg.get("model_type") is not None:
        try:  # the loader's first check (read_hf_config): another kind of model is named so
            for_hf(cfg.get("architectures"), cfg.get("model_type"))
        except UnsupportedArchitecture as exc:
            raise ConfigError(f"{path}: {exc}") from None
    problems = []  # as the loader reports them (engine.weights.hf.read_hf_config)
    try:
        shape = hf_shape(cfg, path)
    except ConfigError as exc:
        problems.append(str(exc))
    base, theta = hf_rope_base(cfg)
    try:
        numbers = check_numbers(
            str(path), {"rms_norm_eps": (cfg.get("rms_norm_eps"), 0.0), base: (theta, 1.0)}
        )
    except ConfigError as exc:
        problems.append(str(exc))
    if problems:
        raise ConfigError("\n".join(problems))
    model = ModelConfig(
        arch=str(cfg.get("model_type", "llama")),
        **model_shape(shape),
        rope_theta=numbers.get(base, 10000.0),
        rms_norm_eps=numbers.get("rms_norm_eps", 1e-5),
        max_position=shape["max_position"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
        name=path.parent.name or path.stem,
    )
    model.validate()
    return model


def _spelling(name: str) -> str:
    """A shape name without the separators and suffixes people add: ``Llama-3.1-8B-Instruct``
    and ``llama3.1-8b`` compare equal."""
    key = name.lower()
    for suffix in ("-instruct", "-chat", "-hf", "-base"):
        key = key.removesuffix(suffix)
    return key.replace("-", "").replace("_", "")
