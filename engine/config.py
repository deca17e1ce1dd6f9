"""Configuration dataclasses: the model's shape and the engine's run settings.

Every knob a preset, a manifest or a CLI flag can set lives in :class:`EngineConfig`;
:meth:`EngineConfig.problems` lists every bad value and inconsistency (each naming its
fields) and :meth:`EngineConfig.validate` raises :class:`ConfigError` with all of them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import numbers
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from engine.decode.indexers import INDEXERS as INDEXER_REGISTRY


class ConfigError(ValueError):
    """A setting is out of range or inconsistent; the message names the field."""


class CacheFullError(RuntimeError):
    """Not enough free pool pages or slabs for a request, or a host pool larger than the
    memory available (raised by :mod:`engine.kv.cache`; defined here so front ends can
    catch it without importing torch)."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling.

    kind: ``llama3`` (Llama 3.1 ``rope_scaling``), ``linear`` (position interpolation),
    ``dynamic`` (dynamic NTK, Reddit/LocalLLaMA 2023; as in transformers'
    ``_compute_dynamic_ntk_parameters``), ``yarn`` (Peng et al. 2023, "YaRN: Efficient
    Context Window Extension of Large Language Models", arXiv:2309.00071) or ``longrope``
    (Phi-3/3.5, Ding et al. 2024, arXiv:2402.13753; transformers
    ``_compute_longrope_parameters``): per-frequency divisors ``short_factor`` /
    ``long_factor`` (``D / 2`` floats each; the long ones when the run's context limit is
    above ``original_max_position``) and cos/sin multiplied by ``attention_factor``.
    """

    kind: str
    factor: float = 1.0
    original_max_position: int = 8192
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    attention_factor: float | None = None


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3, SmolLM).

    ``max_position`` is the context the model was trained for (tokens).
    ``rope_freq_factors``: per-frequency divisors of the RoPE inverse frequencies
    (``D / 2`` floats), as a GGUF file's ``rope_freqs.weight`` stores them (llama.cpp
    writes Llama 3.1's ``llama3`` scaling this way); ``None`` when the file has none.
    ``qkv_bias``: q/k/v projections carry biases (Qwen2). ``qk_norm``: per-head RMSNorm
    of q and k before RoPE (Qwen3, Gemma 3).
    Gemma 2/3 (:mod:`engine.model.gemma`): ``attn_softcap`` / ``final_softcap`` cap
    attention logits / output logits as ``c * tanh(x / c)`` (``None``: off);
    ``query_pre_attn_scalar``: the softmax scale is its ``-1/2`` power (``None``:
    ``head_dim``); ``sliding_layers``: the layers attending only to the last
    ``sliding_window`` positions (tokens); ``rope_local_theta``: RoPE base of those layers
    when it differs from ``rope_theta`` (Gemma 3), unscaled.
    ``int4_group_size``: elements per scale of the 4-bit linears as the engine holds them,
    for the planner's byte counts (32 for a GGUF file's Q4_0/Q4_1/Q4_K blocks,
    :func:`engine.capacity.shapes.shape_from_gguf`; 128 otherwise, as ``quantize_int4``
    makes them). ``int4_linears``: every decoder-layer linear is stored in a 4-bit format
    the int4 kernels take as is (:func:`engine.weights.placement.linears_stored_int4`: a
    GGUF file's Q4_0/Q4_1/Q4_K, as :func:`engine.capacity.shapes.shape_from_gguf` reads
    them), which ``weight_format: auto`` places as int4 on a CPU with bf16 instructions;
    for the planner, like ``int4_group_size``.
    """

    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 4096
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    name: str = ""
    rope_freq_factors: tuple[float, ...] | None = None
    qk_norm: bool = False
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None
    int4_group_size: int = 128
    int4_linears: bool = False

    @property
    def group_size(self) -> int:
        """G = Hq / Hkv, query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def validate(self) -> None:
        """Raise :class:`ConfigError` if the shape is not one this engine runs
        (:func:`check_shape` over its integer fields, named as the fields are)."""
        fields = {f: (f, getattr(self, f)) for f in SHAPE_LIMITS}
        check_shape(f"model {self.name!r}", fields)


SHAPE_LIMITS: dict[str, int] = {
    "num_layers": 1 << 12,
    "hidden_size": 1 << 18,
    "num_heads": 1 << 12,
    "num_kv_heads": 1 << 12,
    "head_dim": 1 << 12,
    "intermediate_size": 1 << 20,
    "vocab_size": 1 << 24,
    "max_position": (1 << 31) - 1,
    "sliding_window": (1 << 31) - 1,
}
"""The largest value each integer field of a model shape may take: far above any
published model's (126 layers, hidden 25,600, 128 heads, head_dim 512, FFN 73,728,
vocabulary 262,144, contexts of 10M tokens), and low enough that no byte count the
planner or the loader makes of them overflows a float or an int64."""

SHAPE_REQUIRED = ("num_layers", "hidden_size", "num_heads", "intermediate_size", "vocab_size")
"""The shape fields a model file must give; ``num_kv_heads`` and ``head_dim`` have defaults
(:func:`check_shape`), ``max_position`` and ``sliding_window`` are the reader's to fill."""


MODEL_SHAPE = (
    "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
    "intermediate_size", "vocab_size",
)  # fmt: skip
"""The :class:`ModelConfig` fields every reader fills from a :func:`check_shape` result."""


def model_shape(shape: Mapping[str, int], **override: int) -> dict[str, int]:
    """The :data:`MODEL_SHAPE` fields of a :func:`check_shape` result (``override``
    replacing some, e.g. a head size the reader derives), as :class:`ModelConfig` keyword
    arguments. Raises ``KeyError`` for a field the result lacks."""
    return {name: override.get(name, shape[name]) for name in MODEL_SHAPE}


def check_shape(where: str, fields: Mapping[str, tuple[str, Any]]) -> dict[str, int]:
    """The integer fields of a model shape, checked: the one check every reader of a model
    file (a Hugging Face ``config.json``, a GGUF header) and :meth:`ModelConfig.validate`
    make.

    Parameters
    ----------
    where
        What the values come from, first in every message (the file's path).
    fields
        :class:`ModelConfig` field (a key of :data:`SHAPE_LIMITS`) -> (the name the source
        gives it, e.g. ``num_hidden_layers`` or ``llama.block_count``; its value as read,
        ``None`` when absent). Fields left out are not checked.

    Each value must be an integer (not a bool, a float or a string), from 1 to its
    :data:`SHAPE_LIMITS` entry. An absent ``num_kv_heads`` is ``num_heads`` (multi-head
    attention), an absent ``head_dim`` is ``hidden_size / num_heads``, which must then be
    whole (as transformers' defaults; Gemma and Qwen3 give a ``head_dim`` of their own,
    which need not be). ``num_kv_heads`` must divide ``num_heads`` and ``head_dim`` must be
    even (RoPE rotates pairs).

    Returns
    -------
    The given fields as ints, the defaulted ones filled in (absent optional ones left out).

    Raises
    ------
    ConfigError
        Every problem at once, one line each: ``where: name: what is wrong``.
    """
    problems: list[str] = []
    values: dict[str, int] = {}
    for field_name, (label, raw) in fields.items():
        if raw is None:
            if field_name in SHAPE_REQUIRED:
                problems.append(f"{where}: {label}: missing")
            continue
        limit = SHAPE_LIMITS[field_name]
        if isinstance(raw, bool) or not isinstance(raw, numbers.Integral) or raw < 1:
            problems.append(f"{where}: {label}: must be a positive integer, got {_shown(raw)}")
        elif raw > limit:
            problems.append(f"{where}: {label}: must be at most {limit:,}, got {_shown(raw)}")
        else:
            values[field_name] = int(raw)

    def name(field_name: str) -> str:
        return fields[field_name][0]

    def given(field_name: str) -> bool:
        return field_name in fields and fields[field_name][1] is not None

    heads = values.get("num_heads")
    if heads is not None and "num_kv_heads" in fields and not given("num_kv_heads"):
        values["num_kv_heads"] = heads
    kv = values.get("num_kv_heads")
    if heads is not None and kv is not None and heads % kv:
        problems.append(
            f"{where}: {name('num_kv_heads')}: must divide {name('num_heads')} ({heads}), got {kv}"
        )
    hidden = values.get("hidden_size")
    head_dim_name = name("head_dim") if "head_dim" in fields else "head_dim"
    if "head_dim" in fields and not given("head_dim") and heads and hidden:
        if hidden % heads:
            problems.append(
                f"{where}: {name('hidden_size')}: must be a multiple of {name('num_heads')} "
                f"({heads}) when {head_dim_name} is not given, got {hidden}"
            )
        else:
            values["head_dim"] = hidden // heads
            head_dim_name = f"{head_dim_name} ({name('hidden_size')} / {name('num_heads')})"
    head_dim = values.get("head_dim")
    if head_dim is not None and head_dim % 2:
        problems.append(
            f"{where}: {head_dim_name}: must be even (RoPE rotates pairs), got {head_dim}"
        )
    if problems:
        raise ConfigError("\n".join(problems))
    return values


def check_numbers(where: str, fields: Mapping[str, tuple[Any, float]]) -> dict[str, float]:
    """The real-valued fields of a model file (RoPE base and scaling, the norm epsilon, ...),
    checked: the one check every reader of a model file (a Hugging Face ``config.json``, a
    GGUF header, ``hisparse plan``'s shape reader) makes of them, as :func:`check_shape` of
    the integer ones.

    Parameters
    ----------
    where
        What the values come from, first in every message (the file's path).
    fields
        The name the source gives a field (``rope_theta``, ``llama.rope.freq_base``) -> (its
        value as read, ``None`` when absent; the bound it must be above: 0, or 1 for a RoPE
        base, whose logarithm divides). Absent fields are left out.

    Each value must be a number (not a bool or a string), finite and above its bound.

    Returns
    -------
    The given fields as floats, by the source's names.

    Raises
    ------
    ConfigError
        Every problem at once, one line each: ``where: name: must be a finite number > 0,
        got 'abc'``.
    """
    problems: list[str] = []
    values: dict[str, float] = {}
    for label, (raw, above) in fields.items():
        if raw is None:
            continue
        number = isinstance(raw, numbers.Real) and not isinstance(raw, bool)
        if number and math.isfinite(raw) and raw > above:
            values[label] = float(raw)
        else:
            problems.append(
                f"{where}: {label}: must be a finite number > {above:g}, got {_shown(raw)}"
            )
    if problems:
        raise ConfigError("\n".join(problems))
    return values


def _shown(value: Any) -> str:
    """A value as a message shows it: JSON's words for true/false/null, strings quoted,
    and at most 40 characters."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


ATTENTION_MODES = ("dense", "sparse")
INDEXERS = tuple(INDEXER_REGISTRY)  # engine.decode.indexers: one entry per indexer
GROUP_COMBINES = ("sum", "max", "normmax", "union")  # = kernels.quest_scores.GROUP_COMBINES
PAGE_SIZES = (16, 32, 64)
CONTEXT_POLICIES = ("refuse", "extend", "truncate", "chunk")
EXTEND_METHODS = ("yarn", "dynamic", "linear")
TRUNCATE_KEEP = ("head", "tail", "middle")
WEIGHT_FORMATS = ("auto", "int4", "float")
DTYPES = ("float32", "bfloat16", "float16")
PARALLEL_MODES = ("data", "pipeline")
EVICTION_POLICIES = ("lru",)
KV_HOST_DTYPES = ("bf16", "fp8")
HOT_BUFFER_DTYPES = ("bf16", "fp8")
PAGE_METADATA = ("exact", "superpage")
SUPERPAGE_COMBINES = ("sum", "max", "normmax")  # = kernels.superpage_select.SUPERPAGE_COMBINES
TOKENIZER_CHOICES = (None, "ids")


@dataclass(frozen=True)
class EngineConfig:
    """Resolved run settings (defaults < preset < manifest defaults < CLI flags).

    Units: token counts in tokens, memory in GiB (``*_gb``).

    attention: ``dense`` reads every page; ``sparse`` reads the pages the indexer selects.
    hierarchical: with ``sparse``, keep all KV in the host pool and only a hot buffer of
        ``device_buffer`` tokens per (request, layer, KV head) on the compute device; when
        False every record stays resident in the KV pool (no host tier).
    cpu_direct_reads: hierarchical on a CPU device only: attention reads the selected
        records straight from the host pool instead of resolving them into the hot buffer
        and gathering the misses (on the CPU both live in the same RAM, so the hierarchy
        would only copy). Outputs are bit-identical either way: it is the all-resident
        sparse path of the correctness ladder over the host pool. The cache statistics then
        count every selected record as a hit (read where it lives, nothing copied) and no
        misses; the miss rate a GPU hot buffer would have is what ``hisparse replay`` of a
        selection trace (``--trace``) measures. No effect on CUDA, with
        ``kv_host_dtype=fp8`` (the hot buffer holds the dequantised records) or with
        ``prefetch_pages``. Default False (the ``cpu`` preset sets it).
    group_combine: how the ``quest`` indexer turns the G query heads' page bounds of a KV
        head into one ranking (:func:`kernels.quest_scores.combine_group_ref`): ``sum``
        (Quest's GQA rule), ``max``, ``normmax`` (max of per-head log-softmax-normalised
        bounds) or ``union`` (each head's own top pages, round by round, until the KV
        head's budget is full). The budget in pages per KV head is the same for all;
        other indexers ignore it. Default ``normmax``, chosen by measurement
        (docs/performance.md, "Selection rule": the needle at 10 % depth that ``sum``
        loses, and lower KL against dense).
    top_k: sparse budget in tokens per (request, layer, KV head), turned into pages.
    device_buffer: hot-buffer capacity in tokens per (request, layer, KV head);
        ``None`` means 2 x top_k.
    sink_tokens / local_window: always-selected tokens at the start / end of the context.
    context_policy: what to do with a prompt longer than the model's trained context:
        ``refuse``, ``extend`` (RoPE scaling ``extend_method`` up to ``max_context``) or
        ``truncate`` (keep ``truncate_keep`` part of the document) or ``chunk`` (map the
        task over overlapping chunks that fit, reduce over their results; see
        :mod:`engine.text.context`).
    cuda_graph: on CUDA with the Triton kernels, replay each decode step from a captured
        CUDA graph (one per batch size and page-table width bucket; see
        :mod:`engine.decode.cuda_graph`); False launches every kernel eagerly.
    decode_overlap: with CUDA graphs and the hierarchy, decode a batch of two or more as
        two micro-batches on two streams, so the host->device gathers of one can overlap
        the compute of the other. Off by default; the ``h200`` presets turn it on (on an
        H200 it gains 4-7 % at 8-32 jobs since the small ops were fused; it lost before;
        docs/performance.md, "The small ops around attention").
    decode_micro_batches: how many micro-batches ``decode_overlap`` splits a batch into
        (at least 2; a batch of fewer rows runs one row each), each on a stream of its own
        with its gathers taking turns on the link (``gather_turns``). More chains give
        each chain's gathers more of the others' compute to hide behind, and read the
        weights once more a step each. Not yet measured on a GPU (docs/performance.md,
        "Three micro-batches": the command that would measure it); no preset sets it.
    async_decode: launch decode step t+1 before the host reads step t's tokens (greedy
        batches: the device feeds step t's argmax to step t+1), so the host's work between
        steps (stop checks, events, scheduling) overlaps the GPU's step instead of
        leaving it idle. A job that finishes at step t rides step t+1 too (its token there
        is discarded; its reserved pages hold that position), so graph and eager runs keep
        one schedule. ``None`` (default): on CUDA; True forces it on CPU (tests), False off.
    prefill_chunk: prompt tokens per prefill step of one layer.
    prefill_turn_tokens: prompt tokens a job's prefill may advance between two decode steps
        of the running batch (whole chunks, at least one): a long prompt's layer is spread
        over several turns, so the batch keeps decoding while a new job prefills (the
        token budget of chunked prefill, as vLLM and SGLang mix it into decode). ``None``
        or 0 (default): a whole layer of the prompt per turn. Measured on an H200
        (docs/performance.md, "Prefill turns"): one 4096-token chunk per turn left the
        wall time equal and doubled the median TTFT of an 8-document run, so it is opt-in.
    prefill_copy_stream: write each prefill chunk's K/V records to the KV pool as soon as
        they exist (:meth:`engine.kv.cache.KVCache.write_prefill_chunk`); with a pinned host
        pool on CUDA the device->host copies run on a dedicated copy stream, double-buffered,
        overlapping the compute of the next chunk and layer. False: one blocking copy of the
        whole layer after its last chunk (:meth:`engine.kv.cache.KVCache.write_prefill`).
        Either way the pool bytes are the same.
    decode_write_stream: with a pinned host pool on CUDA, write each decode step's new
        K/V records to the pool from a copy stream: the compute stream updates the page
        metadata and stages the token on the device, the copy stream writes it to host
        memory while the following layers compute, and the step ends by waiting for it
        (see :class:`engine.decode.attention.DecodeAttention`). False (the default): the append
        kernel writes the pool itself on the compute stream — posted writes through
        unified addressing, about 0.1 ms of a 7-22 ms step on an H200, which the two
        extra launches per layer of the copy stream cost more than they hide
        (docs/performance.md, "Decode write-through"). Either way the pool bytes are
        the same.
    gather_turns: hierarchical with ``decode_overlap`` on CUDA: the two micro-batches'
        gathers take turns on the host link, each waiting for the other's previous one
        (:class:`engine.decode.attention.LinkTurns`), instead of starting together and
        sharing it; the same bytes move, so outputs are bit-identical. False: no order
        between them (the bench's ``sharedlink`` mode).
    prefetch_pages: hierarchical only; after each layer's attention, load the next
        ``prefetch_pages`` pages of this step's indexer ranking (ranks ``top_k`` +1 ..
        +``prefetch_pages``, the near misses) into the hot buffer when they are not resident,
        so that the next step finds them if it selects them. With a pinned host pool on CUDA
        the ranking, resolve and gather run on the cache's copy stream, overlapping the
        following layers, and the step ends by waiting for them (see
        :class:`engine.decode.attention.DecodeAttention`). Outputs do not change: attention reads
        the same records either way. Needs a top-k indexer and ``device_buffer`` of at least
        (pages one step may select + ``prefetch_pages``) pages. 0 (the default) is off.
    eviction: which resident record a miss replaces when its hot buffer is full; ``lru``
        (least recently used among the unselected slots) is the one policy now, the seam
        for another is :data:`kernels.dispatch.RESOLVERS`.
    kv_host_dtype: how the host pool stores records (hierarchical). ``bf16``: in
        ``kv_dtype``, as computed (bfloat16 on the GPU presets; the name is the GPU case).
        ``fp8``: float8 e4m3 with one power-of-two scale per (token, layer, KV head, K|V)
        row, an int8 exponent (:mod:`kernels.fp8_kv`; the choice measured in
        docs/performance.md, "fp8 host pages"): half the pinned bytes and half the link
        bytes per miss; the gather dequantises to ``kv_dtype`` into the hot buffer, and
        page metadata bounds the fp8-rounded keys attention reads. All-resident runs (no
        host tier) keep ``kv_dtype`` but round every record the same way, so they hold the
        same KV as the hierarchical path (its exactness reference). Needs a pool-free
        indexer (not ``oracle``) when hierarchical.
    hot_buffer_dtype: how the hot buffer on the device holds records (hierarchical).
        ``bf16``: in ``kv_dtype`` (the gather dequantises fp8 host records). ``fp8``: as
        the fp8 host pool stores them (e4m3 and one int8 exponent per row; needs
        ``kv_host_dtype=fp8``): the gather copies them as stored, attention dequantises
        them to ``kv_dtype`` as it reads, and a slot takes ``2 x S x (D + 1)`` bytes
        instead of ``2 x S x D x 2`` — about twice the ``device_buffer`` tokens in the
        same device memory. The same records as with ``bf16``, but on a GPU the attention
        kernel's fp8 variant sums in another order (its MMA operand layout), so about 1
        output in 20,000 differs by one unit in the last place and greedy text can differ
        from ``bf16``'s (docs/performance.md, "Why an fp8 hot buffer's text differs");
        it enters the resume key, and no preset sets it. No effect with CPU direct reads
        (no hot buffer).
    page_metadata: how the ``quest`` indexer reads page metadata. ``exact`` (the default and
        the reference): flat Quest, every page's key min / max each step (KV/16 bytes at
        page 16). ``superpage``: a two-level index (:mod:`kernels.superpage_select`):
        superpages of ``superpage_pages`` pages, whose min / max bound their pages, are
        scored first; only the pages of the best ``ceil(superpage_oversample x top_k /
        (page_size x superpage_pages))`` superpages are scored and ranked. Sinks, the local
        window and the everything-fits rule are as with ``exact``. Full-attention layers
        only (a sliding-window layer keeps ``exact``); ``group_combine`` sum, max or
        normmax; no ``prefetch_pages``. Measured in docs/performance.md ("Compact page
        metadata: superpages").
    superpage_pages: pages per superpage (``page_metadata=superpage``).
    superpage_oversample: candidate pages scored per (request, layer, KV head), as a
        multiple of the ``top_k`` pages (at least 1; default 8: metadata KV/84 at 128K
        with top_k 2048, the best measured fidelity within the issue's KV/64).
    devices: the devices of a multi-device run (``--devices``, a preset's
        ``hardware.devices``); empty: the one ``device``.
    parallel: with several ``devices``: ``data`` (a worker per device, each the whole
        model) or ``pipeline`` (layers split across devices).
    trace_path: write every selection to this JSONL file (``hisparse run --trace``); one
        file per worker with several devices.
    tokenizer: ``None`` (the model's own) or, for a synthetic model, ``ids`` (jobs given
        as token ids; see :mod:`engine.weights.synthetic`).
    int4_triton_min_rows: decode batches of at least this many rows run 4-bit linears
        with the Triton kernels, fewer with torch's tinygemm (CUDA); environment
        ``HISPARSE_INT4_TRITON_MIN_ROWS``. Default 1: Triton for every batch and one copy
        of each 4-bit weight on the device; above 1 tinygemm's packed copy is kept too
        (0.625 B/param more; :data:`engine.weights.quant.TRITON_MIN_ROWS`).
    host_memory_gb: host memory the KV pool may use, declared (GiB) for virtual machines
        whose ``MemAvailable`` reads low; ``None`` reads ``/proc/meminfo``; environment
        ``HISPARSE_HOST_MEMORY_GB``. The pool is refused above 90% of it.
    audit_steps: per job, this many decode steps (spread over its decode by
        ``audit_seed``) also run a dense forward over the job's whole KV and record top-1
        agreement, KL(dense || sparse) and the attention mass the selection kept
        (:mod:`engine.decode.audit`); 0 (the default) is off. The sparse decode is the
        same with it. Not with a pipeline of several devices.
    audit_seed: seed of the audited steps' choice (with each job's id).
    """

    device: str = "cpu"
    dtype: str = "float32"
    kv_dtype: str = "float32"
    weight_format: str = "auto"
    attention: str = "sparse"
    hierarchical: bool = True
    cpu_direct_reads: bool = False
    indexer: str = "quest"
    group_combine: str = "normmax"
    page_size: int = 16
    top_k: int = 2048
    device_buffer: int | None = None
    sink_tokens: int = 16
    local_window: int = 64
    max_batch: int = 8
    prefill_chunk: int = 1024
    prefill_turn_tokens: int | None = None
    prefill_copy_stream: bool = True
    decode_write_stream: bool = False
    gather_turns: bool = True
    prefetch_pages: int = 0
    host_pool_gb: float = 8.0
    memory_budget_gb: float | None = None
    context_policy: str = "refuse"
    extend_method: str = "yarn"
    max_context: int | None = None
    truncate_keep: str = "head"
    use_triton: bool | None = None
    num_threads: int | None = None
    skip_host_io: bool = False
    cuda_graph: bool = True
    decode_overlap: bool = False
    decode_micro_batches: int = 2
    async_decode: bool | None = None
    eviction: str = "lru"
    kv_host_dtype: str = "bf16"
    hot_buffer_dtype: str = "bf16"
    page_metadata: str = "exact"
    superpage_pages: int = 16
    superpage_oversample: float = 8.0
    devices: tuple[str, ...] = ()
    parallel: str = "data"
    trace_path: str | None = None
    tokenizer: str | None = None
    int4_triton_min_rows: int = 1
    host_memory_gb: float | None = None
    audit_steps: int = 0
    audit_seed: int = 0

    def __post_init__(self) -> None:
        # YAML and JSON give lists; the config stays hashable and immutable.
        if isinstance(self.devices, list):
            object.__setattr__(self, "devices", tuple(self.devices))

    @property
    def device_buffer_tokens(self) -> int:
        """Hot-buffer tokens per (request, layer, KV head); 2 x top_k when unset."""
        return self.device_buffer if self.device_buffer is not None else 2 * self.top_k

    @property
    def top_k_pages(self) -> int:
        """Budget in pages, rounded up so no page is lost to rounding."""
        return -(-self.top_k // self.page_size)

    @property
    def buffer_pages(self) -> int:
        """Hot-buffer slots per (request, layer, KV head)."""
        return self.device_buffer_tokens // self.page_size

    @property
    def sink_pages(self) -> int:
        return -(-self.sink_tokens // self.page_size) if self.sink_tokens > 0 else 0

    @property
    def window_pages(self) -> int:
        """Pages of the local window, counting the (possibly partial) tail page."""
        return max(1, -(-self.local_window // self.page_size))

    @property
    def max_selected_pages(self) -> int:
        """Upper bound on pages selected per (request, layer, KV head) in one step."""
        return max(self.top_k_pages, self.sink_pages + self.window_pages)

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` applied (unknown names raise :class:`ConfigError`)."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ConfigError(f"unknown setting(s): {', '.join(unknown)}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Raise :class:`ConfigError` listing every problem :meth:`problems` finds."""
        found = self.problems()
        if found:
            raise ConfigError("; ".join(str(p) for p in found))

    def problems(self) -> list[SettingProblem]:
        """Every out-of-range value (:func:`setting_problem`) and every inconsistency
        between settings; an inconsistency is only checked when its settings are each
        valid."""
        found = [
            SettingProblem((name,), message)
            for name in SETTING_CHECKS
            if (message := setting_problem(name, getattr(self, name)))
        ]
        bad = {p.fields[0] for p in found}
        try:
            consistency = self._consistency_problems()
        except (ArithmeticError, TypeError, ValueError):
            if not bad:
                raise
            consistency = []  # a bad value (page_size 0) broke a cross-field check's arithmetic
        found += [p for p in consistency if not bad & set(p.fields)]
        return found

    def _consistency_problems(self) -> list[SettingProblem]:
        found = []
        if self.device_buffer is not None and self.device_buffer % self.page_size:
            found.append(
                SettingProblem(
                    ("device_buffer", "page_size"),
                    f"device_buffer={self.device_buffer} tokens is not a multiple of "
                    f"page_size={self.page_size}",
                )
            )
        if self.attention == "sparse" and self.buffer_pages < self.max_selected_pages:
            found.append(
                SettingProblem(
                    _SELECTION_FIELDS,
                    f"device_buffer={self.device_buffer_tokens} tokens holds "
                    f"{self.buffer_pages} pages but one step may select "
                    f"{self.max_selected_pages} pages (top_k={self.top_k}, "
                    f"sink_tokens={self.sink_tokens}, local_window={self.local_window}, "
                    f"page_size={self.page_size}); raise device_buffer to at least "
                    f"{self.max_selected_pages * self.page_size} tokens"
                    + (
                        " or lower sink_tokens/local_window"
                        if self.sink_pages + self.window_pages > self.top_k_pages
                        else " (>= top_k)"
                    ),
                )
            )
        elif self.prefetch_pages and self.attention == "sparse" and self.hierarchical:
            found += self._prefetch_problems()
        if (
            self.kv_host_dtype == "fp8"
            and self.attention == "sparse"
            and self.hierarchical
            and INDEXER_REGISTRY[self.indexer].reads_pool
        ):
            found.append(
                SettingProblem(
                    ("kv_host_dtype", "indexer"),
                    f"kv_host_dtype=fp8 stores the host pool as float8, which the "
                    f"{self.indexer} indexer cannot read; use indexer quest or dense, or "
                    "kv_host_dtype bf16",
                )
            )
        if (
            self.hot_buffer_dtype == "fp8"
            and self.attention == "sparse"
            and self.hierarchical
            and self.kv_host_dtype != "fp8"
        ):
            found.append(
                SettingProblem(
                    ("hot_buffer_dtype", "kv_host_dtype"),
                    "hot_buffer_dtype=fp8 holds the records as an fp8 host pool stores them; "
                    "set kv_host_dtype fp8 too, or hot_buffer_dtype bf16",
                )
            )
        if self.page_metadata == "superpage":
            found += self._superpage_problems()
        if self.context_policy == "chunk" and len(self.devices) > 1:
            found.append(
                SettingProblem(
                    ("context_policy", "devices"),
                    "context_policy=chunk runs on one device for now (its reduce jobs wait for "
                    "their map jobs, which the multi-device job queue cannot yet); use one "
                    "--device, or --context-policy truncate",
                )
            )
        if self.audit_steps and self.parallel == "pipeline" and len(self.devices) > 1:
            found.append(
                SettingProblem(
                    ("audit_steps", "parallel"),
                    f"audit_steps={self.audit_steps} needs the whole model in one engine, "
                    "not a pipeline of several devices; use --parallel data or drop --audit",
                )
            )
        return found

    def _superpage_problems(self) -> list[SettingProblem]:
        """What stops ``page_metadata=superpage`` from working with the other settings."""
        found = []
        if self.indexer != "quest":
            found.append(
                SettingProblem(
                    ("page_metadata", "indexer"),
                    f"page_metadata=superpage is a layout of the quest indexer's metadata; "
                    f"indexer {self.indexer} does not read it (use indexer quest or "
                    "page_metadata exact)",
                )
            )
        if self.group_combine not in SUPERPAGE_COMBINES:
            found.append(
                SettingProblem(
                    ("page_metadata", "group_combine"),
                    f"group_combine={self.group_combine} ranks every page; page_metadata="
                    f"superpage needs one of {', '.join(SUPERPAGE_COMBINES)}",
                )
            )
        if self.prefetch_pages:
            found.append(
                SettingProblem(
                    ("page_metadata", "prefetch_pages"),
                    "prefetch_pages ranks pages past the budget, which page_metadata="
                    "superpage does not score; use prefetch_pages 0 or page_metadata exact",
                )
            )
        return found

    def _prefetch_problems(self) -> list[SettingProblem]:
        """What stops ``prefetch_pages`` from working with the other settings."""
        if not INDEXER_REGISTRY[self.indexer].ranks:
            return [
                SettingProblem(
                    ("prefetch_pages", "indexer"),
                    "prefetch_pages needs a ranking indexer (quest or oracle); the dense "
                    "indexer selects every page",
                )
            ]
        need = self.max_selected_pages + self.prefetch_pages
        if self.buffer_pages >= need:
            return []
        return [
            SettingProblem(
                ("prefetch_pages", *_SELECTION_FIELDS),
                f"prefetch_pages={self.prefetch_pages} on top of the {self.max_selected_pages} "
                f"pages one step may select needs {need} hot-buffer pages but "
                f"device_buffer={self.device_buffer_tokens} tokens holds {self.buffer_pages}; "
                f"raise device_buffer to at least {need * self.page_size} tokens or lower "
                "prefetch_pages",
            )
        ]


_SELECTION_FIELDS = (
    "device_buffer",
    "top_k",
    "sink_tokens",
    "local_window",
    "page_size",
    "attention",
)


@dataclass(frozen=True)
class SettingProblem:
    """One thing wrong with an :class:`EngineConfig`.

    fields: the settings involved, the one at fault first. With one field, ``message``
    says what is wrong with its value ("must be ..., got ..."); with several it names
    them all.
    """

    fields: tuple[str, ...]
    message: str

    def __str__(self) -> str:
        return f"{self.fields[0]}: {self.message}" if len(self.fields) == 1 else self.message


def setting_problem(name: str, value: Any) -> str | None:
    """What is wrong with ``value`` for :class:`EngineConfig` field ``name`` on its own
    (type, range or choice), or ``None``; the message leaves the name out ("must be one
    of dense, sparse, got 'fuzzy'"). Fields without a check (``device``) pass."""
    check = SETTING_CHECKS.get(name)
    return check(value) if check else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _choice(allowed: tuple) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        ok = any(value == a and type(value) is type(a) for a in allowed)
        return None if ok else f"must be one of {', '.join(map(str, allowed))}, got {value!r}"

    return check


def _positive(value: Any) -> str | None:
    return None if _is_int(value) and value > 0 else f"must be a positive integer, got {value!r}"


def _positive_or_none(value: Any) -> str | None:
    return None if value is None else _positive(value)


def _at_least_one(value: Any) -> str | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value >= 1
    return None if ok else f"must be a number >= 1, got {value!r}"


def _at_least_two(value: Any) -> str | None:
    return None if _is_int(value) and value >= 2 else f"must be an integer >= 2, got {value!r}"


def _non_negative(value: Any) -> str | None:
    return None if _is_int(value) and value >= 0 else f"must be an integer >= 0, got {value!r}"


def _non_negative_or_none(value: Any) -> str | None:
    return None if value is None else _non_negative(value)


MAX_GIB = 1_000_000
"""Largest memory figure (GiB) a setting may give: far past any machine; its bytes must
stay a finite integer (1e308 GiB overflowed the planner)."""


def _gib(value: Any) -> str | None:
    if _is_number(value) and 0 < value <= MAX_GIB:
        return None
    return f"must be a number > 0 and <= {MAX_GIB:,} (GiB), got {value!r}"


def _gib_or_none(value: Any) -> str | None:
    return None if value is None else _gib(value)


def _flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"must be true or false, got {value!r}"


def _flag_or_none(value: Any) -> str | None:
    return None if value is None else _flag(value)


def _devices(value: Any) -> str | None:
    ok = isinstance(value, tuple | list) and all(isinstance(d, str) and d for d in value)
    return None if ok else f"must be a list of device names (cuda:0, cuda:1), got {value!r}"


def _path_or_none(value: Any) -> str | None:
    ok = value is None or (isinstance(value, str) and value)
    return None if ok else f"must be a file path, got {value!r}"


SETTING_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "dtype": _choice(DTYPES),
    "kv_dtype": _choice(DTYPES),
    "weight_format": _choice(WEIGHT_FORMATS),
    "attention": _choice(ATTENTION_MODES),
    "hierarchical": _flag,
    "cpu_direct_reads": _flag,
    "indexer": lambda value: _choice(tuple(INDEXER_REGISTRY))(value),  # read at check time
    "group_combine": _choice(GROUP_COMBINES),
    "page_size": _choice(PAGE_SIZES),
    "top_k": _positive,
    "device_buffer": _positive_or_none,
    "sink_tokens": _non_negative,
    "local_window": _non_negative,
    "max_batch": _positive,
    "prefill_chunk": _positive,
    "prefill_turn_tokens": _non_negative_or_none,
    "prefill_copy_stream": _flag,
    "decode_write_stream": _flag,
    "gather_turns": _flag,
    "prefetch_pages": _non_negative,
    "host_pool_gb": _gib,
    "memory_budget_gb": _gib_or_none,
    "context_policy": _choice(CONTEXT_POLICIES),
    "extend_method": _choice(EXTEND_METHODS),
    "max_context": _positive_or_none,
    "truncate_keep": _choice(TRUNCATE_KEEP),
    "use_triton": _flag_or_none,
    "num_threads": _positive_or_none,
    "skip_host_io": _flag,
    "cuda_graph": _flag,
    "decode_overlap": _flag,
    "decode_micro_batches": _at_least_two,
    "async_decode": _flag_or_none,
    "eviction": _choice(EVICTION_POLICIES),
    "kv_host_dtype": _choice(KV_HOST_DTYPES),
    "hot_buffer_dtype": _choice(HOT_BUFFER_DTYPES),
    "page_metadata": _choice(PAGE_METADATA),
    "superpage_pages": _positive,
    "superpage_oversample": _at_least_one,
    "devices": _devices,
    "parallel": _choice(PARALLEL_MODES),
    "trace_path": _path_or_none,
    "tokenizer": _choice(TOKENIZER_CHOICES),
    "int4_triton_min_rows": _positive,
    "host_memory_gb": _gib_or_none,
    "audit_steps": _non_negative,
    "audit_seed": _non_negative,
}
"""EngineConfig field -> check of one value (see :func:`setting_problem`)."""


ENV_SETTINGS = {
    "HISPARSE_INT4_TRITON_MIN_ROWS": ("int4_triton_min_rows", int),
    "HISPARSE_HOST_MEMORY_GB": ("host_memory_gb", float),
}
"""Environment variable -> (EngineConfig field, type): machine facts and tuning switches
that are read once, here, into the config (so ``config.json`` records them)."""


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The :data:`ENV_SETTINGS` set in ``environ`` (default ``os.environ``) as overrides.

    Raises
    ------
    ConfigError
        A value that is not a number of the field's type (naming the variable).
    """
    environ = os.environ if environ is None else environ
    found: dict[str, Any] = {}
    for var, (name, kind) in ENV_SETTINGS.items():
        raw = environ.get(var, "").strip()
        if not raw:
            continue
        try:
            found[name] = kind(raw)
        except ValueError:
            raise ConfigError(f"{var}={raw!r} is not a {kind.__name__}") from None
    return found


def given(flags: Mapping[str, Any] | None) -> dict[str, Any]:
    """The flags actually given: ``None`` (a Typer option left unset) dropped."""
    return {k: v for k, v in (flags or {}).items() if v is not None}


def layered_config(layers: Iterable[tuple[str, Mapping[str, Any]]]) -> EngineConfig:
    """THE precedence chain of every command: built-in defaults < environment
    (:func:`env_overrides`) < each of ``layers`` in order (preset < manifest
    ``defaults.engine`` < flags). Pass flags through :func:`given` first, so a flag left
    unset (``None``) never masks a lower layer. Not validated: callers report
    :meth:`EngineConfig.problems` in their own words (see :mod:`hisparse_cli.settings`).

    Raises
    ------
    ConfigError
        An unknown field, naming the layer (``source``) it came from.
    """
    config = EngineConfig()
    for source, overrides in (("environment", env_overrides()), *layers):
        try:
            config = config.replace(**overrides)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    return config


def job_seed(job_id: str) -> int:
    """A job's default sampling seed, 0 <= seed < 2**32: the first 32 bits of the SHA-256
    of its id (UTF-8), so a rerun of a job samples the same tokens and jobs differ."""
    return int(hashlib.sha256(job_id.encode()).hexdigest()[:8], 16)


@dataclass(frozen=True)
class SamplingParams:
    """Per-job sampling, named as in vLLM's ``SamplingParams``.

    temperature 0 means greedy. top_k 0 (or -1) disables top-k filtering. ``max_tokens``
    is the number of new tokens. ``stop`` strings end generation (not included in text).
    ``seed`` None: the engine seeds the job's generator with :func:`job_seed` of its id.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    max_tokens: int = 256

    def seed_for(self, job_id: str) -> int:
        """The seed the job's sampling generator gets: ``seed``, else :func:`job_seed`."""
        return self.seed if self.seed is not None else job_seed(job_id)

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first field at fault
        (:func:`sampling_problem`)."""
        for f in dataclasses.fields(self):
            problem = sampling_problem(f.name, getattr(self, f.name))
            if problem:
                raise ConfigError(f"{f.name} {problem}")


MAX_SEED = 2**64 - 1
"""Largest sampling seed (``torch.Generator.manual_seed`` takes an unsigned 64-bit
integer)."""


def sampling_problem(name: str, value: Any) -> str | None:
    """What is wrong with ``value`` for :class:`SamplingParams` field ``name`` on its own
    (type and range; the message leaves the name out), or ``None``: THE sampling rules,
    for a preset's ``sampling`` block, a manifest's job fields, the job flags and an
    OpenAI batch request's body alike (:mod:`hisparse_cli.manifest` checks
    ``max_new_tokens`` as ``max_tokens``, :mod:`hisparse_cli.openai_batch`
    ``max_completion_tokens`` too). Each message names the type and the range. ``None``
    passes (a seed derived from the job id; in a manifest, a default cleared); ``top_k``
    -1 or 0: off; ``stop`` a string or a list of non-empty strings, ``[]`` none."""
    check = SAMPLING_CHECKS.get(name)
    return None if value is None or check is None else check(value)


def _stop(value: Any) -> str | None:
    items = [value] if isinstance(value, str) else value
    what = "must be a string or a list of non-empty strings"
    if not isinstance(items, list | tuple):
        return f"{what}, got {value!r}"
    bad = [v for v in items if not isinstance(v, str) or not v]
    return f"{what}; bad item(s): {bad!r}" if bad else None


def _temperature(value: Any) -> str | None:
    return None if _is_number(value) and value >= 0 else f"must be a number >= 0, got {value!r}"


def _top_p(value: Any) -> str | None:
    if _is_number(value) and 0 < value <= 1:
        return None
    return f"must be a number in (0, 1], got {value!r}"


def _top_k(value: Any) -> str | None:
    if _is_int(value) and value >= -1:
        return None
    return f"must be an integer >= 0 (0 or -1: off), got {value!r}"


def _seed(value: Any) -> str | None:
    if _is_int(value) and 0 <= value <= MAX_SEED:  # a larger one crashed the run at admission
        return None
    hint = (
        "; a negative seed does not mean a random one here: leave it unset for one "
        "derived from the job id"
        if _is_int(value) and value < 0
        else ""
    )
    return f"must be an integer from 0 to 2**64 - 1 ({MAX_SEED}), got {value!r}{hint}"


def _max_tokens(value: Any) -> str | None:
    return None if _is_int(value) and value > 0 else f"must be a positive integer, got {value!r}"


SAMPLING_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "temperature": _temperature,
    "top_p": _top_p,
    "top_k": _top_k,
    "seed": _seed,
    "stop": _stop,
    "max_tokens": _max_tokens,
}
"""SamplingParams field -> check of one value that is not ``None`` (see
:func:`sampling_problem`)."""
