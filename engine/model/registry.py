"""Which model architectures the engine runs, and how each is read and built.

One :class:`Architecture` per architecture name (``ModelConfig.arch``): the names it goes
by in checkpoints (GGUF ``general.architecture``, Hugging Face ``config.json``
``architectures`` / ``model_type``), the layout facts the loaders need (are GGUF Q/K rows
permuted, are there q/k/v biases or per-head q/k norms, how a sliding window is
declared) and the family that computes it (``build``). The loaders
(:mod:`engine.weights.gguf`, :mod:`engine.weights.hf`) look architectures up here and
refuse unknown ones with the list of supported names; everything that places a model
calls :func:`build_model`.

Adding an architecture: one :class:`Architecture` entry in :data:`ARCHITECTURES`, its
family module if the math is new (``build`` returns the placed model, with the
:class:`engine.model.llama.LlamaModel` surface: ``config``, ``embed_tokens``, ``qkv``,
``finish_layer``, ``logits``, ``weight_bytes``, ``layers``) and its test
(``tests/engine/test_architectures.py``).

Sources of the layout facts: llama.cpp ``convert_hf_to_gguf.py`` (``LlamaModel.permute``
is applied to Q/K for ``llama``; ``Qwen2Model`` / ``Qwen3Model`` write them unpermuted;
Qwen3 norms as ``attn_q_norm`` / ``attn_k_norm``; ``Phi3MiniModel`` keeps Phi-3's fused
``attn_qkv`` and ``ffn_up`` = gate|up, unpermuted) and transformers' modelling files
(``modeling_llama``, ``modeling_mistral``, ``modeling_qwen2``, ``modeling_qwen3``,
``modeling_phi3``, ``modeling_gemma2``, ``modeling_gemma3``; llama.cpp's ``Gemma2Model`` /
``Gemma3Model`` add 1 to every ``norm.weight`` and do not permute Q/K).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a model is built, not by the name lookups
    import torch


class UnsupportedArchitecture(ValueError):
    """A checkpoint names an architecture this engine does not run; the message lists
    the supported ones."""


def _build_llama(weights, device, dtype, weight_format, rope, layers=None, **kw):
    from engine.model.llama import LlamaModel

    return LlamaModel(weights, device, dtype, weight_format, rope, layers=layers, **kw)


def _build_gemma(weights, device, dtype, weight_format, rope, layers=None, **kw):
    from engine.model.gemma import GemmaModel

    return GemmaModel(weights, device, dtype, weight_format, rope, layers=layers, **kw)


@dataclass(frozen=True)
class Architecture:
    """One architecture the engine runs.

    name : ``ModelConfig.arch`` (``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``phi3``,
        ``gemma2``, ``gemma3``)
    family : the module computing it (``llama`` = :mod:`engine.model.llama`, ``gemma`` =
        :mod:`engine.model.gemma`)
    description : one line for the README and error messages
    gguf_names : GGUF ``general.architecture`` values read as this architecture
    hf_architectures : ``config.json`` ``architectures`` entries
    hf_model_types : ``config.json`` ``model_type`` values (used when ``architectures``
        is absent)
    gguf_permuted_qk : llama.cpp's converter permuted Q/K rows (rotate-half -> interleaved)
    qkv_bias : ``True`` the q/k/v projections always have biases (Qwen2), ``False`` never
        (a Hugging Face ``attention_bias: true`` is refused: it adds an o_proj bias too);
        GGUF files are read as they are (biases used when present)
    qk_norm : per-head RMSNorm ``[D]`` of q and k before RoPE (Qwen3)
    sliding_window : how a Hugging Face config declares its window: ``always``
        (``sliding_window`` set means used: Mistral, Phi-3), ``flag`` (only with
        ``use_sliding_window`` or a ``sliding_attention`` layer type: Qwen2/3), ``layers``
        (per-layer windows, implemented: Gemma 2/3) or ``never``
    fused_projections : the checkpoint stores q|k|v as one ``qkv_proj`` (GGUF
        ``attn_qkv``) and gate|up as one ``gate_up_proj`` (GGUF ``ffn_up`` of ``2F`` rows,
        no ``ffn_gate``), split into the separate weights at load (Phi-3)
    gemma : Gemma's layout (:mod:`engine.model.gemma`): ``1 + w`` norms (added to Hugging
        Face weights; llama.cpp's converter already added it to GGUF ones), four norms a
        layer, GeGLU, scaled embedding, tied head by default
    build : ``(weights, device, dtype, weight_format, rope, layers=None) -> model``
    """

    name: str
    family: str
    description: str
    gguf_names: tuple[str, ...]
    hf_architectures: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    gguf_permuted_qk: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: str = "never"
    fused_projections: bool = False
    gemma: bool = False
    build: Callable[..., Any] = _build_llama


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture(
            "llama",
            "llama",
            "Llama 2/3/3.1/3.2, SmolLM (RMSNorm, SwiGLU, GQA, rotate-half RoPE)",
            gguf_names=("llama",),
            hf_architectures=("LlamaForCausalLM",),
            hf_model_types=("llama",),
        ),
        Architecture(
            "mistral",
            "llama",
            "Mistral 7B / Nemo (the Llama math; sliding window caps the context)",
            # llama.cpp converts Mistral to general.architecture "llama"; "mistral" is
            # what some other writers (and transformers' GGUF reader) use.
            gguf_names=("mistral",),
            hf_architectures=("MistralForCausalLM",),
            hf_model_types=("mistral",),
            sliding_window="always",
        ),
        Architecture(
            "qwen2",
            "llama",
            "Qwen2 / Qwen2.5 (the Llama math with q/k/v biases)",
            gguf_names=("qwen2",),
            hf_architectures=("Qwen2ForCausalLM",),
            hf_model_types=("qwen2",),
            gguf_permuted_qk=False,
            qkv_bias=True,
            sliding_window="flag",
        ),
        Architecture(
            "qwen3",
            "llama",
            "Qwen3 dense (the Llama math with per-head q/k RMSNorm before RoPE, no biases)",
            gguf_names=("qwen3",),
            hf_architectures=("Qwen3ForCausalLM",),
            hf_model_types=("qwen3",),
            gguf_permuted_qk=False,
            qk_norm=True,
            sliding_window="flag",
        ),
        Architecture(
            "phi3",
            "llama",
            "Phi-3 / 3.5 / 4 (the Llama math with fused qkv and gate-up projections, "
            "longrope scaling)",
            gguf_names=("phi3",),
            hf_architectures=("Phi3ForCausalLM",),
            hf_model_types=("phi3",),
            gguf_permuted_qk=False,
            sliding_window="always",
            fused_projections=True,
        ),
        Architecture(
            "gemma2",
            "gemma",
            "Gemma 2 (1 + w RMSNorms around attention and MLP, GeGLU, logit soft-capping, "
            "alternating sliding-window layers)",
            gguf_names=("gemma2",),
            hf_architectures=("Gemma2ForCausalLM",),
            hf_model_types=("gemma2",),
            gguf_permuted_qk=False,
            sliding_window="layers",
            gemma=True,
            build=_build_gemma,
        ),
        Architecture(
            "gemma3",
            "gemma",
            "Gemma 3 text (Gemma 2's layout with per-head q/k norms, no attention "
            "soft-cap, 5 local : 1 global layers with their own RoPE bases)",
            gguf_names=("gemma3",),
            hf_architectures=("Gemma3ForCausalLM",),
            hf_model_types=("gemma3_text",),
            gguf_permuted_qk=False,
            qk_norm=True,
            sliding_window="layers",
            gemma=True,
            build=_build_gemma,
        ),
    )
}


def gguf_names() -> tuple[str, ...]:
    """Every GGUF ``general.architecture`` value the engine reads (torch-free: the CLI's
    preflight reads the trained context before torch is imported)."""
    return tuple(n for a in ARCHITECTURES.values() for n in a.gguf_names)


def supported() -> str:
    """``"llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3"`` for messages."""
    return ", ".join(ARCHITECTURES)


def get(name: str) -> Architecture:
    """The architecture called ``name`` (``ModelConfig.arch``).

    Raises
    ------
    UnsupportedArchitecture
        ``name`` is not registered (the message lists the supported ones).
    """
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise UnsupportedArchitecture(
            f"architecture {name!r} is not supported (supported: {supported()})"
        )
    return arch


def for_gguf(general_architecture: Any) -> Architecture:
    """The architecture of a GGUF file's ``general.architecture`` value.

    Raises
    ------
    UnsupportedArchitecture
        No registered architecture reads that name (the message lists those that do).
    """
    for arch in ARCHITECTURES.values():
        if general_architecture in arch.gguf_names:
            return arch
    names = ", ".join(n for a in ARCHITECTURES.values() for n in a.gguf_names)
    raise UnsupportedArchitecture(
        f"general.architecture={general_architecture!r} is not supported (supported: {names})"
    )


def for_hf(architectures: list[str] | None, model_type: Any) -> Architecture:
    """The architecture of a ``config.json``: the first known ``architectures`` entry, else
    (when ``architectures`` is absent) its ``model_type``.

    Raises
    ------
    UnsupportedArchitecture
        Neither names a registered architecture (the message lists the supported ones).
    """
    names = list(architectures or [])
    for name in names:
        for arch in ARCHITECTURES.values():
            if name in arch.hf_architectures:
                return arch
    if not names:
        for arch in ARCHITECTURES.values():
            if model_type in arch.hf_model_types:
                return arch
    known = ", ".join(n for a in ARCHITECTURES.values() for n in a.hf_architectures)
    raise UnsupportedArchitecture(
        f"architectures={names!r} (model_type={model_type!r}) is not supported; supported: {known}"
    )


def build_model(
    weights,
    device: torch.device,
    dtype: torch.dtype,
    weight_format: str,
    rope,
    layers: range | None = None,
    int4_triton_min_rows: int | None = None,
):
    """Place ``weights`` on ``device`` as the model of their architecture.

    Parameters
    ----------
    weights : :class:`engine.weights.types.ModelWeights` (consumed)
    device, dtype : compute device and activation dtype
    weight_format : ``float`` or ``int4`` (:func:`engine.weights.quant.make_linear`)
    rope : :class:`engine.model.rope.Rope`
    layers : the decoder layers to place (a pipeline stage), default all
    int4_triton_min_rows : see :class:`engine.model.llama.LlamaModel`

    Raises
    ------
    UnsupportedArchitecture
        ``weights.config.arch`` is not registered.
    """
    arch = get(weights.config.arch)
    return arch.build(
        weights, device, dtype, weight_format, rope, layers=layers,
        int4_triton_min_rows=int4_triton_min_rows,
    )
