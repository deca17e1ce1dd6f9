"""Load a Hugging Face model folder (``config.json`` + ``*.safetensors``).

Sources: the model's ``config.json`` as written by transformers (field names of
``LlamaConfig`` / ``MistralConfig`` / ``Qwen2Config``; transformers 5 nests ``rope_theta``
and the scaling in ``rope_parameters``, older files use ``rope_theta`` + ``rope_scaling``;
both are read) and the safetensors format (https://github.com/huggingface/safetensors: an
8-byte little-endian header length, a JSON header of ``{name: {dtype, shape,
data_offsets}}`` plus an optional ``__metadata__`` string map, then the raw data).
Sharded checkpoints list their files in ``model.safetensors.index.json`` (``weight_map``).

Architectures: those of :mod:`engine.model.registry` (``LlamaForCausalLM`` for Llama
2/3/3.1 and SmolLM, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` with q/k/v biases,
``Qwen3ForCausalLM`` with per-head ``self_attn.q_norm`` / ``k_norm``, ``Phi3ForCausalLM``
with fused ``qkv_proj`` / ``gate_up_proj`` split at load and ``longrope`` scaling,
``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM`` with their four ``1 + w`` norms a layer —
1 is added here, as llama.cpp's converter does — and per-layer windows and RoPE bases). Q/K
rows of Hugging Face checkpoints are already in rotate-half order, as
:mod:`engine.model.llama` expects: no permutation.

Tensors are read lazily (``safetensors.safe_open``, memory-mapped), one at a time:
float (F32/F16/BF16) tensors become float32 tensors; linear weights stay float unless
``int4_group_size`` asks to quantise them on load (4-bit quantisation otherwise happens at
placement, :func:`engine.weights.quant.make_linear`). Folders written by ``hisparse quantize``
(:mod:`engine.weights.quantize`, safetensors metadata ``hisparse_format: int4-g<G>``) hold
per linear ``<module>.qweight`` / ``.scales`` / ``.offsets`` and load as
:class:`engine.weights.quant.Int4Weight` without re-quantising.

Sliding-window attention (Mistral 7B v0.1 ``sliding_window: 4096``; Phi-3-mini-4k
``2047``; Qwen2 with ``use_sliding_window``) is not implemented. Within the window, full causal attention is
identical to it, so the trained context (``ModelConfig.max_position``) is capped at the
window: the default ``refuse`` context policy then rejects longer documents instead of
silently attending past the window; ``extend`` goes beyond it at the user's request.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from engine.capacity.shapes import hf_rope_base, hf_shape
from engine.config import (
    ConfigError,
    ModelConfig,
    RopeScaling,
    check_numbers,
    check_shape,
    model_shape,
)
from engine.model import registry
from engine.weights import prequant
from engine.weights.quant import INT4_GROUP_SIZES, Int4Weight
from engine.weights.types import LayerWeights, ModelWeights, WeightT, split_rows

SUPPORTED_ARCHITECTURES = {
    name: a.name for a in registry.ARCHITECTURES.values() for name in a.hf_architectures
}
FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
ROPE_KINDS = ("default", "llama3", "linear", "dynamic", "yarn", "longrope")

# safetensors ``__metadata__`` keys of folders written by ``hisparse quantize``.
FORMAT_KEY = "hisparse_format"
GROUP_SIZE_KEY = "hisparse_group_size"
INT4_FORMAT_PREFIX = "int4-g"
GROUP_SIZES = INT4_GROUP_SIZES
QWEIGHT, SCALES, OFFSETS = "qweight", "scales", "offsets"

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# LayerWeights field -> module under ``model.layers.<i>.`` (linears: + ``.weight``).
LINEAR_MODULES = {
    "wq": "self_attn.q_proj",
    "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj",
    "wo": "self_attn.o_proj",
    "w_gate": "mlp.gate_proj",
    "w_up": "mlp.up_proj",
    "w_down": "mlp.down_proj",
}
NORM_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    "ffn_norm": "post_attention_layernorm.weight",
}
# Gemma 2/3: four norms a layer (``post_attention_layernorm`` is on the attention output).
GEMMA_NORM_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "ffn_norm": "pre_feedforward_layernorm.weight",
    "post_ffn_norm": "post_feedforward_layernorm.weight",
}
GEMMA_ACTIVATION = "gelu_pytorch_tanh"
BIAS_TENSORS = {
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
}
QK_NORM_TENSORS = {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
# Fused modules of ``fused_projections`` architectures (Phi-3) -> the fields they split into.
FUSED_MODULES = {
    "self_attn.qkv_proj": ("wq", "wk", "wv"),
    "mlp.gate_up_proj": ("w_gate", "w_up"),
}
EMBED, FINAL_NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
# Buffers some older checkpoints carry; recomputed from the config, never read.
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$")
LINEAR_WEIGHT = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.([qkvo]|qkv)_proj|mlp\.(gate|up|down|gate_up)_proj)"
    r"\.weight$"
)


class HFModelError(ValueError):
    """The folder is not a model this engine runs; the message names file and field/tensor."""


# ----------------------------------------------------------------------------- config


def read_hf_config(folder: str | Path) -> ModelConfig:
    """Build :class:`ModelConfig` from a model folder's ``config.json``.

    Reads ``architectures`` (else ``model_type``), ``num_hidden_layers``, ``hidden_size``,
    ``num_attention_heads``, ``num_key_value_heads`` (default: MHA), ``head_dim`` (default
    ``hidden_size // num_attention_heads``), ``intermediate_size``, ``vocab_size``,
    ``rms_norm_eps``, ``max_position_embeddings``, ``tie_word_embeddings`` (default False),
    the RoPE base and scaling (see :func:`rope_from_hf`) and the sliding window (caps
    ``max_position``, see the module docstring).

    Raises
    ------
    FileNotFoundError
        No ``config.json``.
    HFModelError
        Unsupported architecture, activation, bias or RoPE kind; a missing field; a shape
        field out of range (:func:`engine.capacity.shapes.hf_shape`); a real-valued field
        that is not a finite number in range (:func:`engine.config.check_numbers`: the
        norm epsilon, the RoPE base and scaling numbers, Gemma's soft-caps and query
        scale), these at once, each line naming the file and the field.
    """
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{Path(folder)}: no config.json in this model folder")
    from engine.text.tokenizer import read_json_object

    try:
        raw = read_json_object(path)
    except ValueError as exc:  # not JSON, or not an object: named
        raise HFModelError(str(exc)) from None
    entry = _architecture(raw, path)
    arch = entry.name
    _check_unsupported(raw, entry, path)
    problems = []  # every problem of the shape and the numbers at once
    shape: dict[str, int] = {}
    try:
        shape = hf_shape(raw, path)  # the one check of a model file's shape
    except ConfigError as exc:
        problems.append(str(exc))
    gemma: dict[str, Any] = {}
    rope = (raw, "rope_parameters")
    if entry.gemma:  # Gemma's layers need the shape, and its fields say where its RoPE is
        try:
            gemma = _gemma_fields(raw, entry, path, shape) if shape else {}
        except HFModelError as exc:
            problems.append(str(exc))
        rope = gemma.pop("global_rope", None)
    wanted = {"rms_norm_eps": ("rms_norm_eps", raw.get("rms_norm_eps"), 0.0)}
    wanted |= gemma.pop("numbers", {})
    try:  # ModelConfig field -> (its name in the file, its value, the bound it must be above)
        checked = check_numbers(str(path), {name: (v, above) for name, v, above in wanted.values()})
    except ConfigError as exc:
        problems.append(str(exc))
        checked = {}
    numbers = {field: checked.get(name) for field, (name, _, _) in wanted.items()}
    eps = numbers.pop("rms_norm_eps")
    gemma |= numbers  # Gemma's soft-caps, query scale and local RoPE base
    if rope is not None:
        try:
            theta, scaling = rope_from_hf(rope[0], path, block=rope[1])
        except HFModelError as exc:
            problems.append(str(exc))
    if problems:
        raise HFModelError("\n".join(problems))
    cfg = ModelConfig(
        arch=arch,
        **model_shape(shape),
        rope_theta=theta,
        rms_norm_eps=1e-6 if eps is None else eps,
        max_position=_max_position(raw, entry, scaling, shape),
        rope_scaling=scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", entry.gemma)),
        qkv_bias=entry.qkv_bias,
        name=path.parent.resolve().name,
        qk_norm=entry.qk_norm,
        **gemma,
    )
    cfg.validate()
    return cfg


def _gemma_fields(
    raw: dict, arch: registry.Architecture, path: Path, shape: dict[str, int]
) -> dict[str, Any]:
    """The :class:`ModelConfig` fields of a Gemma 2/3 ``config.json`` (transformers
    ``Gemma2Config`` / ``Gemma3TextConfig``), under ``global_rope`` the config dict
    :func:`rope_from_hf` reads for the global layers and the name of its RoPE block, and
    under ``numbers`` the real-valued fields, for the caller to check with the others
    (field -> (its name in the file, its value, the bound it must be above:
    :func:`engine.config.check_numbers`)): soft-caps and query scale (null or 0: none, as
    the engine tests them) and the local RoPE base.

    Sliding layers: ``layer_types`` entries ``sliding_attention``; without it, Gemma 2's
    default (even layers) or Gemma 3's ``sliding_window_pattern`` (every layer but each
    ``pattern``-th; default 6). RoPE: transformers 5 writes ``rope_parameters`` per layer
    type (``full_attention`` / ``sliding_attention``); older Gemma 3 files have
    ``rope_theta`` / ``rope_scaling`` for the global layers and ``rope_local_base_freq``.

    Raises
    ------
    HFModelError
        ``layer_types`` of another length than ``num_hidden_layers``, an unknown layer
        type, or a local RoPE with scaling.
    """
    n = shape["num_layers"]
    types = raw.get("layer_types")
    if types is None:
        if arch.name == "gemma2":
            types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        else:
            pattern = int(raw.get("sliding_window_pattern") or 6)
            types = [
                "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
            ]
    bad = [t for t in types if t not in ("sliding_attention", "full_attention")]
    if len(types) != n or bad:
        raise HFModelError(
            f"{path}: layer_types must be {n} entries of sliding_attention/full_attention, "
            f"got {types!r}"
        )
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    window = shape.get("sliding_window")
    if sliding and not window:
        raise HFModelError(f"{path}: sliding_attention layers without a sliding_window")
    params = raw.get("rope_parameters") or {}
    global_rope = (raw, "rope_parameters")
    local_theta: tuple[str, Any] = ("rope_local_base_freq", None)  # (its name, its value)
    if isinstance(params.get("full_attention"), dict):
        global_rope = (
            {**raw, "rope_parameters": params["full_attention"], "rope_scaling": None},
            "rope_parameters.full_attention",
        )
        local = params.get("sliding_attention") or {}
        if (local.get("rope_type") or "default") != "default":
            raise HFModelError(f"{path}: rope_parameters.sliding_attention must be unscaled")
        local_theta = ("rope_parameters.sliding_attention.rope_theta", local.get("rope_theta"))
    elif arch.name == "gemma3":
        local_theta = ("rope_local_base_freq", raw.get("rope_local_base_freq", 10000.0))
    numbers = {
        field: (name, None if raw.get(name) in (0, False) else raw.get(name), 0.0)
        for field, name in (
            ("attn_softcap", "attn_logit_softcapping"),
            ("final_softcap", "final_logit_softcapping"),
            ("query_pre_attn_scalar", "query_pre_attn_scalar"),
        )
    }
    numbers["rope_local_theta"] = (*local_theta, 1.0)
    return dict(
        sliding_window=window if sliding else None,
        sliding_layers=sliding,
        global_rope=global_rope,
        numbers=numbers,
    )


def _require(raw: dict, key: str, where: Path | str) -> Any:
    if raw.get(key) is None:
        raise HFModelError(f"{where}: missing field {key!r}")
    return raw[key]


def _architecture(raw: dict, path: Path) -> registry.Architecture:
    try:
        return registry.for_hf(raw.get("architectures"), raw.get("model_type"))
    except registry.UnsupportedArchitecture as exc:
        raise HFModelError(f"{path}: {exc}") from None


def _check_unsupported(raw: dict, arch: registry.Architecture, path: Path) -> None:
    try:
        prequant.read_quant_config(raw, path)
    except prequant.PrequantError as exc:
        raise HFModelError(str(exc)) from None
    if arch.gemma:
        act = raw.get("hidden_activation") or raw.get("hidden_act") or GEMMA_ACTIVATION
        if act != GEMMA_ACTIVATION:
            raise HFModelError(
                f"{path}: hidden_activation={act!r} is not supported for {arch.name} "
                f"(only {GEMMA_ACTIVATION!r})"
            )
    elif (act := raw.get("hidden_act", "silu")) != "silu":
        raise HFModelError(f"{path}: hidden_act={act!r} is not supported (only 'silu')")
    if raw.get("mlp_bias"):
        raise HFModelError(f"{path}: mlp_bias=true is not supported")
    if not arch.qkv_bias and raw.get("attention_bias"):
        raise HFModelError(f"{path}: attention_bias=true (o_proj bias) is not supported")
    partial = raw.get("partial_rotary_factor", (raw.get("rope_parameters") or {}).get(
        "partial_rotary_factor", 1.0
    ))
    if partial not in (None, 1, 1.0):
        raise HFModelError(f"{path}: partial_rotary_factor={partial} is not supported")


def rope_from_hf(
    raw: dict, path: Path | str = "config.json", block: str = "rope_parameters"
) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling from a ``config.json`` dict.

    Looks in ``rope_parameters`` (transformers 5; ``block`` names it in messages, e.g.
    ``rope_parameters.full_attention`` for Gemma 3's global layers) and then ``rope_theta``
    / ``rope_scaling`` (earlier versions); the kind is ``rope_type`` (or legacy ``type``):

    * ``default`` -> no scaling.
    * ``llama3`` -> ``RopeScaling(kind="llama3", factor, low_freq_factor, high_freq_factor,
      original_max_position=original_max_position_embeddings)`` (required).
    * ``linear`` -> ``factor``.
    * ``dynamic`` -> ``factor``, ``original_max_position = max_position_embeddings``
      (:class:`engine.model.rope.Rope` uses one fixed NTK base for every length, where
      transformers rescales only past the original context).
    * ``longrope`` (Phi-3/3.5) -> ``short_factor``, ``long_factor`` (required, ``D / 2``
      each), ``original_max_position_embeddings`` (there or at the top level, as Phi-3's
      config.json has it), ``factor`` (default ``max_position_embeddings / original``, as
      transformers' ``_compute_longrope_parameters``) and ``attention_factor`` (optional).
    * ``yarn`` -> ``factor`` (default ``max_position_embeddings / original``),
      ``original_max_position_embeddings`` (default ``max_position_embeddings``),
      ``beta_fast``, ``beta_slow``; the attention factor is
      always ``0.1 ln(factor) + 1``, so explicit ``attention_factor`` / ``mscale`` /
      ``mscale_all_dim`` or ``truncate: false`` are refused.

    Raises
    ------
    HFModelError
        Another kind (e.g. ``su``-less ``dynamic`` variants), per-layer-type RoPE parameters, or a missing
        required field; the message names the field. The numbers (the base: > 1; the
        scaling's ``factor``, ``attention_factor``, ``low_freq_factor``,
        ``high_freq_factor``, ``beta_fast``, ``beta_slow``: > 0, ``high_freq_factor`` above
        ``low_freq_factor``; all finite) and the original context (a positive integer) are
        checked at once (:func:`engine.config.check_numbers`, ``check_shape``).
    """
    params = raw.get("rope_parameters") or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise HFModelError(f"{path}: per-layer-type rope_parameters are not supported")
    sc = raw.get("rope_scaling") or params
    field = "rope_scaling" if raw.get("rope_scaling") else block
    kind = sc.get("rope_type") or sc.get("type") or "default"
    if kind not in ROPE_KINDS:
        raise HFModelError(
            f"{path}: {field}.rope_type={kind!r} is not supported; supported: "
            f"{', '.join(ROPE_KINDS)}"
        )
    base, value = hf_rope_base(raw, block)
    fields = {base: (value, 1.0)}  # the RoPE base: its log divides (YaRN)
    if kind != "default":
        fields |= {f"{field}.{name}": (sc.get(name), 0.0) for name in _SCALING_NUMBERS}
    key = "original_max_position_embeddings"
    named = f"{field}.{key}" if sc.get(key) else key
    problems = []
    try:
        numbers = check_numbers(str(path), fields)
    except ConfigError as exc:
        problems.append(str(exc))
    try:  # a context length, checked as max_position_embeddings is
        checked = check_shape(str(path), {"max_position": (named, sc.get(key) or raw.get(key))})
    except ConfigError as exc:
        problems.append(str(exc))
    if problems:
        raise HFModelError("\n".join(problems))
    theta = numbers.get(base, 10000.0)
    if kind == "default":
        return theta, None

    def number(name: str, default: float) -> float:
        return numbers.get(f"{field}.{name}", default)

    where = f"{path} {field}"
    max_pos = int(raw.get("max_position_embeddings", 4096))
    original = checked.get("max_position", max_pos)
    if kind == "longrope":
        factors = {}
        for key in ("short_factor", "long_factor"):
            values = _require(sc, key, where)
            if not isinstance(values, list) or not all(
                isinstance(v, (int, float)) and v > 0 for v in values
            ):
                raise HFModelError(f"{where}.{key} must be a list of positive numbers")
            factors[key] = tuple(float(v) for v in values)
        return theta, RopeScaling(
            kind="longrope",
            factor=number("factor", max_pos / original),
            original_max_position=original,
            attention_factor=numbers.get(f"{field}.attention_factor"),
            **factors,
        )
    if kind == "yarn" and sc.get("factor") is None:  # as transformers: the context ratio
        factor = max_pos / original
    else:
        _require(sc, "factor", where)
        factor = numbers[f"{field}.factor"]
    if kind == "llama3":
        _require(sc, "original_max_position_embeddings", where)
        low, high = number("low_freq_factor", 1.0), number("high_freq_factor", 4.0)
        if high <= low:  # the smooth band between them divides by high - low
            raise HFModelError(
                f"{path}: {field}.high_freq_factor: must be above {field}.low_freq_factor "
                f"({low:g}), got {high:g}"
            )
        return theta, RopeScaling(
            kind="llama3",
            factor=factor,
            original_max_position=original,
            low_freq_factor=low,
            high_freq_factor=high,
        )
    if kind == "yarn":
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if sc.get(key) is not None:
                raise HFModelError(f"{path}: {field}.{key} is not supported for yarn")
        if sc.get("truncate") is False:
            raise HFModelError(f"{path}: {field}.truncate=false is not supported for yarn")
        return theta, RopeScaling(
            kind="yarn",
            factor=factor,
            original_max_position=original,
            beta_fast=number("beta_fast", 32.0),
            beta_slow=number("beta_slow", 1.0),
        )
    return theta, RopeScaling(kind=kind, factor=factor, original_max_position=original)


_SCALING_NUMBERS = (
    "factor",
    "attention_factor",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
)
"""The real-valued fields of a RoPE scaling block (each > 0 where given; 1e400 in JSON
reads as infinity)."""


def _max_position(
    raw: dict, arch: registry.Architecture, scaling: RopeScaling | None, shape: dict[str, int]
) -> int:
    """Trained context: ``max_position_embeddings``, raised to ``original * factor`` for
    yarn / dynamic scaling (Qwen2.5 keeps 32768 there and declares yarn x4 for 128K),
    capped at the sliding window when the model uses one (``shape``: :func:`hf_shape`'s)."""
    max_pos = shape["max_position"]
    if scaling is not None and scaling.kind in ("yarn", "dynamic"):
        max_pos = max(max_pos, int(scaling.original_max_position * scaling.factor))
    window = shape.get("sliding_window")
    if arch.sliding_window == "layers":  # per-layer windows are implemented: no cap
        return max_pos
    uses_window = arch.sliding_window == "always" or (
        arch.sliding_window == "flag"
        and (raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or []))
    )
    if uses_window and window:
        max_pos = min(max_pos, window)
    return max_pos


# ----------------------------------------------------------------------------- tensors


class SafetensorsFolder:
    """The safetensors files of a model folder, opened lazily (``safe_open``, mmap).

    Use as a context manager. ``names`` is every tensor name; ``metadata`` the merged
    ``__metadata__`` of the files.

    Raises
    ------
    HFModelError
        No ``*.safetensors`` file, an index naming a missing file, or a tensor in two files.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._stack = ExitStack()
        self._files: dict[str, Any] = {}
        self.file_of: dict[str, Path] = {}
        self.metadata: dict[str, str] = {}
        try:
            for file in self._list_files():
                self._open(file)
        except BaseException:
            self.close()
            raise

    def _list_files(self) -> list[Path]:
        index = self.folder / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map") or {}
            files = sorted({self.folder / f for f in weight_map.values()})
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise HFModelError(f"{index}: weight_map names missing file(s) {missing}")
            return files
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise HFModelError(
                f"{self.folder}: no *.safetensors files (PyTorch .bin checkpoints are not "
                "read; re-save with safe_serialization=True)"
            )
        return files

    def _open(self, file: Path) -> None:
        from safetensors import safe_open

        try:
            handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
        except Exception as exc:  # safetensors raises its own SafetensorError
            raise HFModelError(f"{file}: not a readable safetensors file ({exc})") from exc
        self.metadata |= handle.metadata() or {}
        for name in handle.keys():
            if name in self.file_of:
                raise HFModelError(f"{file}: tensor {name} is also in {self.file_of[name]}")
            self.file_of[name] = file
            self._files[name] = handle

    def __enter__(self) -> SafetensorsFolder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    @property
    def names(self) -> list[str]:
        return list(self.file_of)

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """safetensors dtype string: ``F32``, ``F16``, ``BF16``, ``U8``, ..."""
        return self._slice(name).get_dtype()

    def get(self, name: str) -> torch.Tensor:
        """The tensor as stored (its own dtype), read from the mapped file."""
        return self._handle(name).get_tensor(name)

    def _slice(self, name: str):
        return self._handle(name).get_slice(name)

    def _handle(self, name: str):
        handle = self._files.get(name)
        if handle is None:
            raise HFModelError(f"{self.folder}: missing tensor {name}")
        return handle

    def where(self, name: str) -> str:
        """``"<file>: tensor <name>"`` for error messages."""
        return f"{self.file_of.get(name, self.folder)}: tensor {name}"

    def read_float(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """float32 copy of a F32/F16/BF16 tensor after checking dtype and ``shape``.

        Raises
        ------
        HFModelError
            Missing tensor, another dtype, or another shape.
        """
        self.check(name, shape, tuple(FLOAT_DTYPES))
        return self.get(name).to(torch.float32)

    def check(self, name: str, shape: tuple[int, ...], dtypes: tuple[str, ...]) -> None:
        dtype = self.dtype(name)
        if dtype not in dtypes:
            raise HFModelError(f"{self.where(name)} has dtype {dtype}; supported: {dtypes}")
        got = self.shape(name)
        if got != tuple(shape):
            raise HFModelError(f"{self.where(name)} has shape {got}, expected {tuple(shape)}")


def int4_format(group_size: int) -> str:
    """The ``hisparse_format`` metadata value of a quantised folder: ``int4-g<G>``."""
    return f"{INT4_FORMAT_PREFIX}{group_size}"


def quantized_group_size(tensors: SafetensorsFolder) -> int | None:
    """Group size of a folder written by ``hisparse quantize``, or None for a float folder.

    Raises
    ------
    HFModelError
        An unknown ``hisparse_format`` value.
    """
    fmt = tensors.metadata.get(FORMAT_KEY)
    if fmt is None:
        return None
    if not fmt.startswith(INT4_FORMAT_PREFIX) or not fmt[len(INT4_FORMAT_PREFIX) :].isdigit():
        raise HFModelError(
            f"{tensors.folder}: unknown {FORMAT_KEY}={fmt!r} in safetensors metadata"
        )
    return int(fmt[len(INT4_FORMAT_PREFIX) :])


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """``[N, K]`` of each linear of one layer, keyed by :data:`LINEAR_MODULES` field (the
    split weights, also for a fused checkpoint; see :func:`stored_linears`)."""
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    return {
        "wq": (q, h),
        "wk": (kv, h),
        "wv": (kv, h),
        "wo": (h, q),
        "w_gate": (f, h),
        "w_up": (f, h),
        "w_down": (h, f),
    }


def stored_linears(cfg: ModelConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, int]]]:
    """The linear modules a checkpoint of ``cfg`` stores per layer: module (under
    ``model.layers.<i>.``) -> (the :data:`LINEAR_MODULES` fields it holds, ``[N, K]``).
    One field each, or Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` (:data:`FUSED_MODULES`,
    rows stacked in field order)."""
    shapes = linear_shapes(cfg)
    out: dict[str, tuple[tuple[str, ...], tuple[int, int]]] = {}
    fused = registry.get(cfg.arch).fused_projections
    covered = set()
    if fused:
        for module, fields in FUSED_MODULES.items():
            rows = sum(shapes[f][0] for f in fields)
            out[module] = (fields, (rows, shapes[fields[0]][1]))
            covered |= set(fields)
    for field, module in LINEAR_MODULES.items():
        if field not in covered:
            out[module] = ((field,), shapes[field])
    return out


def norm_tensors(cfg: ModelConfig) -> dict[str, str]:
    """LayerWeights norm field -> tensor under ``model.layers.<i>.`` for ``cfg``'s
    architecture (:data:`GEMMA_NORM_TENSORS` for Gemma, else :data:`NORM_TENSORS`)."""
    return GEMMA_NORM_TENSORS if registry.get(cfg.arch).gemma else NORM_TENSORS


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every float tensor name of the checkpoint and its shape (linears as ``.weight``)."""
    h = cfg.hidden_size
    kv = cfg.num_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {EMBED: (cfg.vocab_size, h), FINAL_NORM: (h,)}
    if not cfg.tie_word_embeddings:
        shapes[LM_HEAD] = (cfg.vocab_size, h)
    bias_rows = {"bq": cfg.num_heads * cfg.head_dim, "bk": kv, "bv": kv}
    for i in range(cfg.num_layers):
        prefix = f"model.layers.{i}."
        for module, (_, shape) in stored_linears(cfg).items():
            shapes[f"{prefix}{module}.weight"] = shape
        for tensor in norm_tensors(cfg).values():
            shapes[prefix + tensor] = (h,)
        if cfg.qkv_bias:
            for field, tensor in BIAS_TENSORS.items():
                shapes[prefix + tensor] = (bias_rows[field],)
        if cfg.qk_norm:
            for tensor in QK_NORM_TENSORS.values():
                shapes[prefix + tensor] = (cfg.head_dim,)
    return shapes


def _read_linear(
    tensors: SafetensorsFolder,
    module: str,
    shape: tuple[int, int],
    group_size: int | None,
    int4_group_size: int | None,
    quant: prequant.PrequantFormat | None = None,
) -> tuple[WeightT, str]:
    """One linear ``[N, K]``: Int4Weight from AWQ/GPTQ tensors (``quant``) or from
    ``.qweight/.scales/.offsets`` when present, else the float ``.weight`` (quantised on
    load when ``int4_group_size`` is set)."""
    if quant is not None and f"{module}.{QWEIGHT}" in tensors:
        return read_prequant(tensors, module, shape, quant)
    if quant is not None and not quant.keeps_float(module):
        raise HFModelError(
            f"{tensors.where(module + '.' + QWEIGHT)} is missing: config.json "
            f"quantization_config declares {quant.method.upper()} 4-bit linears and "
            "modules_to_not_convert does not name this one"
        )
    if f"{module}.{QWEIGHT}" in tensors:
        if group_size is None:
            raise HFModelError(
                f"{tensors.where(module + '.' + QWEIGHT)}: 4-bit tensor without "
                f"{FORMAT_KEY} metadata"
            )
        q = read_int4(tensors, module, shape)
        return q, int4_format(q.group_size)
    name = f"{module}.weight"
    dtype = tensors.dtype(name)
    w = tensors.read_float(name, shape)
    if int4_group_size:
        from engine.weights.quant import quantize_int4

        try:
            g = group_size_for(shape[1], int4_group_size)
        except ValueError as exc:
            raise HFModelError(f"{tensors.where(name)}: {exc}") from None
        return quantize_int4(w, g), int4_format(g)
    return w, dtype


def read_prequant(
    tensors: SafetensorsFolder,
    module: str,
    shape: tuple[int, int],
    quant: prequant.PrequantFormat,
) -> tuple[WeightT, str]:
    """One AWQ (GEMM) or GPTQ (v1) linear ``[N, K]`` (layouts:
    :mod:`engine.weights.prequant`) and its ``formats`` label (``AWQ-g128`` ...).

    Returns an :class:`Int4Weight` of a kernel group size (exact, also for a larger group
    that is a multiple of one), else the float32 decode of the same values.

    Raises
    ------
    HFModelError
        A missing tensor, another dtype or shape than the config's group size gives, or
        a GPTQ ``g_idx`` that is not ``k // g``.
    """
    n, k = shape
    g = k if quant.group_size == -1 else quant.group_size
    if k % g or n % 8 or k % 8:
        raise HFModelError(
            f"{tensors.where(module + '.' + QWEIGHT)}: [N, K] = {shape} is not whole groups "
            f"of {g} and packed words of 8"
        )
    scale_dtypes = tuple(FLOAT_DTYPES)
    qshape = (k, n // 8) if quant.method == "awq" else (k // 8, n)
    tensors.check(f"{module}.{QWEIGHT}", qshape, ("I32",))
    tensors.check(f"{module}.qzeros", (k // g, n // 8), ("I32",))
    tensors.check(f"{module}.scales", (k // g, n), scale_dtypes)
    parts = [tensors.get(f"{module}.{t}") for t in ("qweight", "qzeros", "scales")]
    if quant.method == "awq":
        w = prequant.awq_to_int4(*parts)
    else:
        if f"{module}.g_idx" in tensors:
            tensors.check(f"{module}.g_idx", (k,), ("I32", "I64"))
            try:
                prequant.check_g_idx(tensors.get(f"{module}.g_idx"), g, tensors.where(module))
            except prequant.PrequantError as exc:
                raise HFModelError(str(exc)) from None
        w = prequant.gptq_to_int4(*parts)
    fitted = prequant.fit_group(w)
    if fitted is None:  # no kernel group divides g: exact float values, re-quantised at placement
        return w.dequantize(), f"{quant.method.upper()} g{g} (float)"
    return fitted, quant.label(g)


def read_int4(tensors: SafetensorsFolder, module: str, shape: tuple[int, int]) -> Int4Weight:
    """Read ``<module>.qweight`` (uint8 ``[N, K/2]``), ``.scales`` and ``.offsets``
    (F16 or F32 ``[N, K/g]``) as an :class:`Int4Weight` (scale/offset widened to float32).

    The group size of each weight is ``K / scales.shape[1]`` (``hisparse quantize`` falls
    back to a smaller group where K is not a multiple of the requested one).

    Raises
    ------
    HFModelError
        Missing tensor, wrong dtype, or a shape that does not match ``shape``.
    """
    n, k = shape
    scales = f"{module}.{SCALES}"
    groups = tensors.shape(scales)[-1] if scales in tensors else 0
    if not groups or k % groups or (k // groups) not in GROUP_SIZES:
        raise HFModelError(
            f"{tensors.where(scales)}: shape {tensors.shape(scales) if groups else None} does "
            f"not give a group size in {GROUP_SIZES} for K={k}"
        )
    group_size = k // groups
    tensors.check(f"{module}.{QWEIGHT}", (n, k // 2), ("U8",))
    for part in (SCALES, OFFSETS):
        tensors.check(f"{module}.{part}", (n, groups), ("F16", "F32"))
    return Int4Weight(
        tensors.get(f"{module}.{QWEIGHT}"),
        tensors.get(f"{module}.{SCALES}").to(torch.float32),
        tensors.get(f"{module}.{OFFSETS}").to(torch.float32),
        group_size,
    )


def group_size_for(k: int, preferred: int) -> int:
    """The largest group size of :data:`GROUP_SIZES` not above ``preferred`` dividing ``k``
    (e.g. 64 for SmolLM2's K=576 with 128 preferred).

    Raises
    ------
    ValueError
        ``k`` is not a multiple of 32.
    """
    for g in sorted(GROUP_SIZES, reverse=True):
        if g <= preferred and k % g == 0:
            return g
    raise ValueError(f"K={k} is not a multiple of any group size in {GROUP_SIZES}")


def check_names(
    tensors: SafetensorsFolder,
    cfg: ModelConfig,
    quantized: bool,
    quant: prequant.PrequantFormat | None = None,
) -> None:
    """Refuse tensors this engine would silently drop (o_proj bias, extra layers ...).
    ``quantized``: a ``hisparse quantize`` folder; ``quant``: an AWQ/GPTQ folder (each
    linear may store its 4-bit tensors instead of ``.weight``)."""
    known = set(expected_shapes(cfg))
    extra = (QWEIGHT, SCALES, OFFSETS) if quantized else ()
    extra += quant.tensors if quant is not None else ()
    for name in list(known):
        if extra and LINEAR_WEIGHT.match(name):
            module = name[: -len(".weight")]
            known |= {f"{module}.{part}" for part in extra}
    if cfg.tie_word_embeddings:
        known.add(LM_HEAD)  # some tied checkpoints still store a copy; the embedding is used
    for name in tensors.names:
        if name not in known and not _IGNORED.match(name):
            raise HFModelError(f"{tensors.where(name)} is not used by a {cfg.arch} model")


def load_hf_folder(path: str | Path, *, int4_group_size: int | None = None) -> ModelWeights:
    """Read config and weights of a Hugging Face model folder.

    Parameters
    ----------
    path : folder with ``config.json`` and ``model.safetensors`` (or shards listed in
        ``model.safetensors.index.json``), or one written by ``hisparse quantize``.
    int4_group_size : quantise float linear weights to :class:`Int4Weight` while loading
        (keeps host memory near 4.5 bits/weight for big models); None keeps them float32.

    Returns
    -------
    ModelWeights
        ``embed [V, H]``, norms ``[H]`` and q/k/v biases ``[N]`` in float32; linears
        float32 ``[N, K]`` or :class:`Int4Weight`; ``lm_head`` None when tied. ``formats``
        maps each Hugging Face tensor (or 4-bit module) name to its stored dtype
        (``BF16``, ``F16``, ``F32``) or ``int4-g<G>``.

    Raises
    ------
    FileNotFoundError
        The folder or its ``config.json`` is missing.
    HFModelError (a ValueError)
        Unsupported architecture or config field; a missing, unexpected, wrongly shaped
        or wrongly typed tensor (the message names the file and tensor).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder not found: {folder}")
    cfg = read_hf_config(folder)
    quant = prequant.read_quant_config(json.loads((folder / "config.json").read_text()), folder)
    with SafetensorsFolder(folder) as tensors:
        group_size = quantized_group_size(tensors)
        check_names(tensors, cfg, group_size is not None, quant)
        formats: dict[str, str] = {}
        norm_plus_one = registry.get(cfg.arch).gemma

        def read(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            formats[name] = tensors.dtype(name)
            t = tensors.read_float(name, shape)
            if norm_plus_one and name.endswith("norm.weight"):  # Gemma's RMSNorm: x * (1 + w)
                t = t + 1.0
            return t

        layers = [
            _read_layer(tensors, cfg, i, (group_size, int4_group_size, quant), read, formats)
            for i in range(cfg.num_layers)
        ]
        h = cfg.hidden_size
        embed = read(EMBED, (cfg.vocab_size, h))
        lm_head = None if cfg.tie_word_embeddings else read(LM_HEAD, (cfg.vocab_size, h))
        return ModelWeights(cfg, embed, read(FINAL_NORM, (h,)), layers, lm_head, formats)


def _read_layer(tensors, cfg, i, linear_args, read, formats) -> LayerWeights:
    prefix = f"model.layers.{i}."
    parts: dict[str, Any] = {}
    split = linear_shapes(cfg)
    for name, (fields, shape) in stored_linears(cfg).items():
        module = prefix + name
        w, formats[module] = _read_linear(tensors, module, shape, *linear_args)
        if len(fields) == 1:
            parts[fields[0]] = w
        else:  # Phi-3's fused projections: rows stacked in field order
            parts.update(zip(fields, split_rows(w, [split[f][0] for f in fields]), strict=True))
    for field, tensor in norm_tensors(cfg).items():
        parts[field] = read(prefix + tensor, (cfg.hidden_size,))
    if cfg.qkv_bias:
        for field, tensor in BIAS_TENSORS.items():
            parts[field] = read(prefix + tensor, (parts["w" + field[1]].shape[0],))
    if cfg.qk_norm:
        for field, tensor in QK_NORM_TENSORS.items():
            parts[field] = read(prefix + tensor, (cfg.head_dim,))
    return LayerWeights(**parts)
