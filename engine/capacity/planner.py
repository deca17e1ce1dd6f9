"""Capacity planner: what fits on the devices and in the host pool, by arithmetic alone.

No torch is needed: every figure comes from the model's shape (:class:`ModelConfig`),
the run settings (:class:`EngineConfig`) and the box (:class:`Hardware`). Every byte
count comes from :mod:`engine.kv.sizing`, the formulas :class:`engine.kv.cache.KVCache`
allocates by, and the device split is the one :func:`engine.capacity.budget.size_kv_for_budget`
builds a cache with, so the jobs ``hisparse plan`` says fit are the jobs the cache admits
(``KVCache.can_admit``; ``tests/engine/test_planner.py`` puts both side by side).

Shape symbols: ``L`` layers (``L_d`` on one pipeline stage), ``H`` hidden, ``Hq``/``Hkv``
query/KV heads, ``D`` head dim, ``F`` FFN size, ``V`` vocabulary, ``T`` context tokens,
``S`` page size, ``P = ceil(T / S)`` pages, ``B`` decode batch, ``C`` prefill chunk,
``b`` bytes per element. Memory is in bytes internally and GiB (2**30 bytes) on
interfaces, matching ``EngineConfig.*_gb``; link speeds are decimal GB/s.

Per-device memory table (the rows of the dual-4090 article's budget table):

==================  ============================================================
weights             in the format the engine places (:func:`weight_format`: ``auto``
                    by the loader's rule). int4: linear layers' source blocks at
                    0.5 B/param + 8 B per group, plus torch's packed copy (0.5 B/param
                    + a scale and a zero per group) on a CPU, or on CUDA with
                    ``int4_triton_min_rows > 1``; embeddings, lm_head and biases in
                    ``dtype``, norms in float32. float: every linear in ``dtype``
                    (:func:`weight_bytes`).
hot KV slab pool    jobs x L_d x Hkv x (device_buffer x D x 2 (K,V) x b_kv + page
                    table P x 4 + LRU state slots x 12): a whole slab per (layer, KV
                    head) for every job, however short (all-resident: the job's P pages)
page metadata       hierarchical: every host pool page, pool_pages x L_d x Hkv x 2
                    (min,max) x D x b_kv (= host pool / S), allocated with the pool;
                    all-resident: the job's P pages of it
activations         decode: B x (4H + (Hq+2Hkv)D + 2F) x b, logits B x V x 4;
  and scratch       prefill chunk: C x (4H + (Hq+2Hkv)D + 2F) x b; layer-by-layer
                    prefill of one job: that layer's K/V 2 x Hkv x T x D x b_kv plus
                    hidden states T x H x b (all-resident mode writes K/V straight
                    into its pages, so only the hidden states count there)
communication       pipeline only: double-buffered stage hand-off of one decode
                    micro-batch and one prefill chunk, 2 x (B + C) x H x b
reserve             CUDA: max(5 % of the device, 1 GiB): CUDA context, cuBLAS/Triton
                    workspaces, caching-allocator slack. CPU: 5 %, heap slack only
                    (:func:`device_reserve_bytes`)
==================  ============================================================

Host: every job's full KV, paged: P x S x L x Hkv x D x 2 x b_kv, from the pinned host
pool (``host_pool_gb``), which must itself fit in the host's RAM less a reserve of
max(10 %, 4 GiB) for the OS, the process and the weight file.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from engine.config import PAGE_SIZES, ConfigError, EngineConfig, ModelConfig
from engine.kv.sizing import (  # noqa: F401 - re-exported: the planner's vocabulary
    DTYPE_BYTES,
    GIB,
    all_resident,
    context_pages,
    default_pool_pages,
    dtype_bytes,
    hierarchical,
    host_record_bytes,
    job_device_bytes,
    kv_bytes_per_token,
    meta_page_bytes,
    pool_page_bytes,
    shared_device_bytes,
)
from engine.model.registry import ARCHITECTURES
from engine.weights import placement
from engine.weights.placement import (
    auto_weight_format,
    cpu_int4_dtype_name,
    recorded_cpu_lm_head_fp16,
    requant_group_size,
)

# Every int4 linear keeps its source blocks (uint8 nibbles + float32 scale and offset per
# group: 0.5 B/param + 8 B per group), dequantised for the prefill's dense GEMM and, on CUDA,
# read by the Triton decode kernels (engine.weights.quant.Int4Linear). torch's packed copy
# (0.5 B/param + a scale and a zero per group in the kernel's activation dtype) is kept on
# a CPU always (its decode kernel) and on CUDA only with int4_triton_min_rows > 1.
INT4_SOURCE_GROUP_BYTES = 8
# Prefill-sized int4 calls on CUDA dequantise the layer's weight to bf16 first; the
# transient (int32 nibbles, float32 weight, bf16 copy) peaks near 12 B per element of the
# largest linear (fitted to the measured prefill scratch peak of qwen2.5-7b on an H200,
# docs/performance.md "Plan vs measured memory").
INT4_DEQUANT_SCRATCH_BYTES = 12
LOGITS_BYTES = 4  # logits are computed in float32
NORM_BYTES = 4  # RMSNorm weights are placed in float32 whatever the dtype
DEVICE_RESERVE_FRACTION = 0.05
DEVICE_RESERVE_MIN_BYTES = 1 * GIB
HOST_RESERVE_FRACTION = 0.10
HOST_RESERVE_MIN_BYTES = 4 * GIB
# LRU misses at device_buffer = 2 x top_k on real traces (HiSparse paper, via DESIGN.md);
# used only for the decode IO estimate, never for admission.
LRU_MISS_RATE = 0.134
PARALLEL_MODES = ("data", "pipeline")


DEVICE_NAME = re.compile(r"cpu|cuda(:\d+)?")
"""A device a preset's ``hardware.devices`` may name."""

MAX_HARDWARE_FIGURE = 1_000_000
"""Largest memory (GiB) or link speed (GB/s) a hardware description may give: far past
any machine, and small enough that its byte counts stay finite integers."""


@dataclass(frozen=True)
class Hardware:
    """The box a preset describes: identical devices and one host.

    devices: device names (``cuda:0``, ``cpu``), one entry per device used.
    memory_gb: memory per device in GiB.
    host_link_gbps: effective host-to-device bandwidth per device, decimal GB/s.
    host_memory_gb: host RAM in GiB. On ``cpu`` devices the device working set is
        carved from the same RAM, so it is subtracted from what the host pool may use.
    parallel: ``data`` (each device runs whole jobs, jobs spread round-robin) or
        ``pipeline`` (layers split into contiguous stages, every job on every device).
    """

    devices: tuple[str, ...] = ("cpu",)
    memory_gb: float = 8.0
    host_link_gbps: float = 10.0
    host_memory_gb: float = 32.0
    parallel: str = "data"
    device_name: str = ""
    compute_capability: str | None = None
    host_link: str = ""

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def shares_host_memory(self) -> bool:
        """True when the devices are CPUs, whose memory is the host's RAM."""
        return all(d.split(":")[0] == "cpu" for d in self.devices)

    def replace(self, **changes: Any) -> Hardware:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["devices"] = list(self.devices)
        return out

    @staticmethod
    def field_problem(name: str, value: Any) -> str | None:
        """What is wrong with ``value`` for field ``name`` on its own (the message leaves
        the name out: "must be one of data, pipeline, got 'x'"), or ``None``."""
        if name == "devices":
            if isinstance(value, str) or not isinstance(value, list | tuple) or not value:
                return "must be a non-empty list of device names (cpu, cuda, cuda:N)"
            bad = [d for d in value if not isinstance(d, str) or not DEVICE_NAME.fullmatch(d)]
            if bad:
                return f"unknown device(s) {', '.join(map(repr, bad))}: use cpu, cuda or cuda:N"
        if name == "parallel" and value not in PARALLEL_MODES:
            return f"must be one of {', '.join(PARALLEL_MODES)}, got {value!r}"
        if name in ("memory_gb", "host_link_gbps", "host_memory_gb"):
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or not 0 < value <= MAX_HARDWARE_FIGURE:
                # bytes of 1e308 GiB: inf
                return f"must be a number > 0 and <= {MAX_HARDWARE_FIGURE:,}, got {value!r}"
        return None

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first field at fault
        (:meth:`field_problem`)."""
        for f in dataclasses.fields(self):
            problem = self.field_problem(f.name, getattr(self, f.name))
            if problem:
                raise ConfigError(f"hardware.{f.name}: {problem}")

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "hardware") -> Hardware:
        """Build from a preset's ``hardware`` block; unknown keys raise, naming ``source``."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(
                f"{source}: unknown hardware key(s) {', '.join(unknown)} "
                f"(known: {', '.join(sorted(names))})"
            )
        data = dict(data)
        if "devices" in data:
            if isinstance(data["devices"], str) or not isinstance(
                data["devices"], list
            ):
                raise ConfigError(
                    f"{source}: hardware.devices must be a list of device names"
                )
            data["devices"] = tuple(str(d) for d in data["devices"])
        if data.get("compute_capability") is not None:
            data["compute_capability"] = str(data["compute_capability"])
        hw = cls(**data)
        try:
            hw.validate()
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        return hw


# ----------------------------------------------------------------------------- helpers


def parse_context(text: str | int) -> int:
    """Tokens from ``256K``, ``128k``, ``1M``, ``32768`` (K = 1024, M = 1024**2).

    Raises
    ------
    ConfigError
        Not a positive token count.
    """
    if isinstance(text, int):
        tokens = text
    else:
        match = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", str(text))
        if not match:
            raise ConfigError(
                f"context {text!r} is not a token count like 256K, 128k or 32768"
            )
        scale = {"": 1, "k": 1024, "m": 1024 * 1024}[match.group(2).lower()]
        tokens = int(match.group(1)) * scale
    if tokens <= 0:
        raise ConfigError(f"context must be > 0 tokens, got {text!r}")
    return tokens


def format_context(tokens: int) -> str:
    """``262144`` -> ``256K``; other counts unchanged."""
    if tokens % (1024 * 1024) == 0:
        return f"{tokens // (1024 * 1024)}M"
    if tokens % 1024 == 0:
        return f"{tokens // 1024}K"
    return str(tokens)




def weight_format(config: EngineConfig, model: ModelConfig) -> str:
    """``int4`` or ``float``, as the engine places ``model``: ``auto`` by the loader's own
    rule (:func:`engine.weights.placement.auto_weight_format`, which
    :func:`engine.load.pick_weight_format` applies): int4 on CUDA; on a CPU int4 where it
    has bf16 instructions and the model's linears are stored 4-bit
    (``model.int4_linears``: the embedded model, a Q4 GGUF file), float elsewhere."""
    if config.weight_format != "auto":
        return config.weight_format
    return auto_weight_format(config.device, model.int4_linears)






def stage_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` layer ranges, the first stages taking any remainder."""
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for i in range(num_stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


# ----------------------------------------------------------------------------- weights


def _linear_params_per_layer(model: ModelConfig) -> int:
    """q, k, v, o projections plus gate/up/down of the MLP."""
    h, d = model.hidden_size, model.head_dim
    attn = h * model.num_heads * d * 2 + h * model.num_kv_heads * d * 2
    return attn + 3 * h * model.intermediate_size


def _norm_params_per_layer(model: ModelConfig) -> int:
    """The RMSNorm weights of a layer: two (four in the Gemma family, whose attention and
    MLP outputs are normed too), plus the per-head q and k norms of Qwen3 and Gemma 3."""
    family = ARCHITECTURES.get(model.arch)
    norms = (4 if family is not None and family.family == "gemma" else 2) * model.hidden_size
    return norms + (2 * model.head_dim if model.qk_norm else 0)


def _bias_params_per_layer(model: ModelConfig) -> int:
    """The q/k/v biases of Qwen2-style models."""
    return (model.num_heads + 2 * model.num_kv_heads) * model.head_dim if model.qkv_bias else 0


def weight_bytes(
    model: ModelConfig,
    config: EngineConfig,
    layers: tuple[int, int] | None = None,
    *,
    embed: bool = True,
    head: bool = True,
) -> int:
    """Bytes of the weights one device holds.

    Parameters
    ----------
    layers
        ``[start, end)`` decoder layers on this device; all layers when ``None``.
    embed, head
        Whether the token embedding ``[V, H]`` / final norm and lm_head ``[V, H]`` live
        here. With tied embeddings a device holding only the head still needs the
        shared matrix, so it is counted once per device that holds either.

    Notes
    -----
    int4 linears (:func:`weight_format`) keep their source blocks, 0.5 B/param +
    :data:`INT4_SOURCE_GROUP_BYTES` per group (measured: docs/performance.md, plan vs
    measured memory), and torch's packed copy, 0.5 B/param + a scale and a zero per group
    in the kernel's activation dtype (bf16 on CUDA; on a CPU bf16 with bf16 instructions,
    else ``config.dtype``: :func:`engine.weights.placement.cpu_int4_dtype_name`), on a
    CPU always, on CUDA only with ``int4_triton_min_rows > 1``. Groups are
    ``model.int4_group_size`` elements (32 for a GGUF file's 4-bit blocks), 32 for a
    linear re-quantised at load whose input width is not a multiple of 128
    (:func:`engine.weights.placement.requant_group_size`). The embedding, lm_head and a
    float linear's bias stay in ``config.dtype``, the RMSNorm weights in float32
    (:mod:`engine.model.llama` places them so); a CPU running int4 linears with bf16
    products over a float32 model may add an fp16 copy of a tied head
    (:func:`_cpu_fp16_head_bytes`).
    """
    start, end = layers if layers is not None else (0, model.num_layers)
    num_layers = end - start
    b = dtype_bytes(config.dtype)
    linear = _linear_params_per_layer(model) * num_layers
    fmt = weight_format(config, model)
    cpu = str(config.device).split(":")[0] == "cpu"
    if fmt == "int4":
        groups = _int4_groups_per_layer(model) * num_layers
        source = linear // 2 + groups * INT4_SOURCE_GROUP_BYTES
        act = cpu_int4_dtype_name(config.dtype, placement.cpu_fast_bf16()) if cpu else "bfloat16"
        packed = linear // 2 + groups * 2 * dtype_bytes(act)
        linear_bytes = source + (packed if cpu or config.int4_triton_min_rows > 1 else 0)
    else:
        linear_bytes = linear * b
    vocab_matrix = model.vocab_size * model.hidden_size
    if model.tie_word_embeddings:
        vocab_params = vocab_matrix if (embed or head) else 0
    else:
        vocab_params = vocab_matrix * (int(embed) + int(head))
    norms = _norm_params_per_layer(model) * num_layers + (model.hidden_size if head else 0)
    # an int4 linear's bias is not in its bytes (engine.weights.quant.Int4Linear.nbytes)
    biases = _bias_params_per_layer(model) * num_layers if fmt == "float" else 0
    head_copy = _cpu_fp16_head_bytes(model, config, fmt) if head else 0
    return linear_bytes + (vocab_params + biases) * b + norms * NORM_BYTES + head_copy


def _int4_groups_per_layer(model: ModelConfig) -> int:
    """Quantisation groups of one layer's linears (``[N, K]``: q, k, v, o, gate, up,
    down): ``model.int4_group_size`` elements along ``K``, or the group a linear whose
    ``K`` it does not divide is re-quantised with at load."""
    h, f = model.hidden_size, model.intermediate_size
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    total = 0
    for n, k in ((q, h), (kv, h), (kv, h), (h, q), (f, h), (f, h), (h, f)):
        g = model.int4_group_size if k % model.int4_group_size == 0 else requant_group_size(k)
        total += n * k // g
    return total


def _cpu_fp16_head_bytes(
    model: ModelConfig, config: EngineConfig, fmt: str, *, unmeasured_only: bool = False
) -> int:
    """The fp16 copy of a tied LM head that a CPU load keeps beside the float32 embedding
    where its linears run int4 with bf16 products and fp16 measured faster on this machine
    (:func:`engine.weights.quant.pick_cpu_lm_head`, recorded per machine:
    :func:`engine.weights.placement.recorded_cpu_lm_head_fp16`): ``V x H x 2`` bytes,
    counted too where no choice is recorded yet (the first load measures it); 0 elsewhere.
    An untied head is replaced by its copy, which the head's float32 bytes cover.
    ``unmeasured_only``: the bytes only where they are counted for want of a record."""
    if (
        str(config.device).split(":")[0] != "cpu"
        or fmt != "int4"
        or config.dtype != "float32"
        or cpu_int4_dtype_name(config.dtype, placement.cpu_fast_bf16()) != "bfloat16"
        or not model.tie_word_embeddings
    ):
        return 0
    recorded = recorded_cpu_lm_head_fp16((model.vocab_size, model.hidden_size))
    if recorded is False or (unmeasured_only and recorded is not None):
        return 0
    return model.vocab_size * model.hidden_size * 2


# ----------------------------------------------------------------------------- KV




def job_kv_bytes(model: ModelConfig, config: EngineConfig, context: int) -> int:
    """Full KV of one job, rounded up to whole pages: P x S x L x Hkv x D x 2 x b_kv."""
    return (
        context_pages(config, context)
        * config.page_size
        * kv_bytes_per_token(model, config)
    )


def job_host_bytes(model: ModelConfig, config: EngineConfig, context: int) -> int:
    """Pinned host-pool bytes one job of ``context`` positions needs.

    The host pool holds every record of every admitted job (the authoritative copy), so
    this is ``P`` pool pages (:func:`engine.kv.sizing.pool_page_bytes`: :func:`job_kv_bytes`
    with ``kv_host_dtype=bf16``, fp8 records and their exponents with ``fp8``); it is 0
    when the config keeps every record on the device (``attention='dense'`` or
    ``hierarchical=False``). ``context`` counts every position the job will hold: prompt
    plus generated tokens.
    """
    if all_resident(config):
        return 0
    return context_pages(config, context) * pool_page_bytes(model, config)


# ----------------------------------------------------------------------------- scratch


def _activation_width(model: ModelConfig) -> int:
    """Elements per token live in one layer: hidden, residual, norm out, attn out (4H),
    q/k/v ((Hq + 2Hkv) D) and the MLP's gate and up (2F)."""
    qkv = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    return 4 * model.hidden_size + qkv + 2 * model.intermediate_size


def activation_bytes(
    model: ModelConfig,
    config: EngineConfig,
    context: int,
    batch: int,
    *,
    head: bool = True,
) -> int:
    """Activations and scratch on one device, in bytes.

    decode B x width x b + logits B x V x 4 (``head`` only), prefill chunk C x width x b,
    and the layer-by-layer prefill of one job: K/V 2 x Hkv x T x D x b_kv (hierarchical
    only) plus hidden states T x H x b; with int4 weights on CUDA, the prefill's
    dequantisation of the largest linear (:data:`INT4_DEQUANT_SCRATCH_BYTES` per element).
    """
    b = dtype_bytes(config.dtype)
    width = _activation_width(model)
    decode = batch * width * b + (
        batch * model.vocab_size * LOGITS_BYTES if head else 0
    )
    chunk = min(config.prefill_chunk, context) * width * b
    hidden = context * model.hidden_size * b
    layer_kv = (
        0 if all_resident(config) else kv_bytes_per_token(model, config, 1) * context
    )
    dequant = 0
    if weight_format(config, model) == "int4" and str(config.device).startswith("cuda"):
        largest = 2 * model.intermediate_size * model.hidden_size  # fused gate/up
        dequant = largest * INT4_DEQUANT_SCRATCH_BYTES
    return decode + chunk + hidden + layer_kv + dequant


def comm_bytes(
    model: ModelConfig, config: EngineConfig, batch: int, hardware: Hardware
) -> int:
    """Pipeline hand-off buffers: 2 x (B + C) x H x b; 0 in data mode or on one device."""
    if hardware.parallel != "pipeline" or hardware.num_devices == 1:
        return 0
    return stage_comm_bytes(model, config, batch)


def stage_comm_bytes(model: ModelConfig, config: EngineConfig, batch: int) -> int:
    """One pipeline stage's hand-off buffers, in bytes: 2 x (B + C) x H x b (a decode
    micro-batch of up to ``batch`` rows and one prefill chunk, double-buffered)."""
    return (
        2
        * (batch + config.prefill_chunk)
        * model.hidden_size
        * dtype_bytes(config.dtype)
    )


def device_reserve_bytes(capacity_bytes: int, device: str) -> int:
    """What a device of ``capacity_bytes`` (its memory, or ``memory_budget_gb``) keeps out
    of the table, capped at the capacity.

    CUDA: max(5 %, 1 GiB). The floor is for what a CUDA process holds outside its tensors
    whatever their size: the CUDA context (not counted by torch), cuBLAS and Triton
    workspaces, and the caching allocator's slack (on an H200 peak reserved ran 0.87 GiB
    over peak allocated: docs/performance.md, "Plan vs measured memory per device").

    CPU (``device`` ``cpu``): 5 %, no floor. A CPU run has no context, no device workspaces
    and no caching allocator; the process itself (interpreter, torch's libraries, the
    weight file) is in the host reserve (:func:`host_reserve_bytes`), outside the working
    memory the budget caps. What remains is heap slack around the tensors (glibc keeps
    freed blocks for reuse: :func:`engine.load.keep_freed_heap`). With the 1 GiB floor
    every budget under about 2 GiB was refused on a CPU whatever else was lowered.
    """
    floor = _reserve_floor(device)
    return min(capacity_bytes, max(int(capacity_bytes * DEVICE_RESERVE_FRACTION), floor))


def _reserve_floor(device: str) -> int:
    return 0 if str(device).split(":")[0] == "cpu" else DEVICE_RESERVE_MIN_BYTES


def device_reserve_rule(device: str) -> str:
    """:func:`device_reserve_bytes`' rule for ``device``, as the plan's table names it."""
    return "max(5 %, 1 GiB)" if _reserve_floor(device) else "5 % (CPU)"


def host_reserve_bytes(host_bytes: int) -> int:
    """max(10 % of host RAM, 4 GiB), capped at host RAM."""
    return min(
        host_bytes, max(int(host_bytes * HOST_RESERVE_FRACTION), HOST_RESERVE_MIN_BYTES)
    )


def device_capacity_bytes(config: EngineConfig, hardware: Hardware) -> int:
    """Per-device memory: the device's, capped by ``memory_budget_gb`` when set."""
    gb = hardware.memory_gb
    if config.memory_budget_gb is not None:
        gb = min(gb, config.memory_budget_gb)
    return int(gb * GIB)


def host_usable_bytes(config: EngineConfig, hardware: Hardware) -> int:
    """Host RAM the pinned pool may take: RAM less the host reserve (less the device
    working sets when the devices are CPUs sharing that RAM)."""
    host = int(hardware.host_memory_gb * GIB)
    usable = host - host_reserve_bytes(host)
    if hardware.shares_host_memory:
        usable -= hardware.num_devices * device_capacity_bytes(config, hardware)
    return max(0, usable)


def host_memory_needed_bytes(
    pool_bytes: int, config: EngineConfig, hardware: Hardware
) -> int:
    """Host RAM R whose usable part (R less its reserve, less CPU device working sets)
    holds a pool of ``pool_bytes``: R = max((pool + shared) / 0.9, pool + shared + 4 GiB)."""
    shared = hardware.num_devices * device_capacity_bytes(config, hardware)
    need = pool_bytes + (shared if hardware.shares_host_memory else 0)
    return max(
        math.ceil(need / (1 - HOST_RESERVE_FRACTION)), need + HOST_RESERVE_MIN_BYTES
    )


def host_pool_bytes(config: EngineConfig, hardware: Hardware) -> int:
    """Pinned pool the jobs may fill: ``host_pool_gb``, capped by usable host RAM."""
    return min(int(config.host_pool_gb * GIB), host_usable_bytes(config, hardware))


# ----------------------------------------------------------------------------- tables


@dataclass(frozen=True)
class DeviceMemory:
    """One device's memory table, in bytes.

    ``per_job_bytes`` is :func:`engine.kv.sizing.job_device_bytes` for this device's
    layers and ``shared_kv_bytes`` what the cache allocates whatever the jobs
    (:func:`engine.kv.sizing.shared_device_bytes`: the host pool's page metadata);
    ``kv_slab_bytes + metadata_bytes == num_jobs * per_job_bytes + shared_kv_bytes``.
    ``job_cap`` is the slab pool's ``max_batch`` (hierarchical), ``None`` all-resident.
    """

    device: str
    layers: tuple[int, int]
    num_jobs: int
    capacity_bytes: int
    weights_bytes: int
    kv_slab_bytes: int
    metadata_bytes: int
    activation_bytes: int
    comm_bytes: int
    reserve_bytes: int
    per_job_bytes: int
    shared_kv_bytes: int = 0
    job_cap: int | None = None

    @property
    def fixed_bytes(self) -> int:
        """Everything that does not grow with the number of jobs."""
        return (
            self.weights_bytes
            + self.activation_bytes
            + self.comm_bytes
            + self.reserve_bytes
        )

    @property
    def used_bytes(self) -> int:
        return self.fixed_bytes + self.kv_slab_bytes + self.metadata_bytes

    @property
    def free_bytes(self) -> int:
        """Capacity left (negative when over)."""
        return self.capacity_bytes - self.used_bytes

    @property
    def max_jobs(self) -> int:
        """Jobs whose slabs (or pages) fit next to the fixed parts and the shared KV
        bytes, at most ``job_cap``."""
        room = self.capacity_bytes - self.fixed_bytes - self.shared_kv_bytes
        fit = max(0, room // self.per_job_bytes) if self.per_job_bytes else 0
        return fit if self.job_cap is None else min(fit, self.job_cap)

    @property
    def capped(self) -> bool:
        """Whether ``job_cap`` (the cache's ``max_batch`` slabs), not memory, sets
        :attr:`max_jobs`."""
        if self.job_cap is None or not self.per_job_bytes:
            return False
        room = self.capacity_bytes - self.fixed_bytes - self.shared_kv_bytes
        return max(0, room // self.per_job_bytes) > self.job_cap

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["layers"] = list(self.layers)
        out.update(
            fixed_bytes=self.fixed_bytes,
            used_bytes=self.used_bytes,
            free_bytes=self.free_bytes,
            max_jobs=self.max_jobs,
        )
        return out


def device_config(config: EngineConfig, hardware: Hardware) -> EngineConfig:
    """The settings one device's cache is built with (as
    :func:`engine.serve.workers.worker_config` gives a worker): in data mode each of ``n``
    devices holds ``host_pool_gb / n`` of the host pool and ``ceil(max_batch / n)`` slabs;
    a pipeline stage keeps both (it holds every job, for its layers)."""
    n = hardware.num_devices
    if n < 2 or hardware.parallel == "pipeline":
        return config
    return config.replace(host_pool_gb=config.host_pool_gb / n, max_batch=-(-config.max_batch // n))


def device_tables(
    model: ModelConfig,
    config: EngineConfig,
    hardware: Hardware,
    jobs: int,
    context: int,
) -> list[DeviceMemory]:
    """The memory table of every device with ``jobs`` jobs of ``context`` positions.

    data: device i runs jobs i, i+n, ... (all layers); pipeline: every device runs every
    job for its stage's layers, the first stage holding the embedding, the last the head.
    """
    n = hardware.num_devices
    capacity = device_capacity_bytes(config, hardware)
    pipeline = hardware.parallel == "pipeline" and n > 1
    ranges = (
        stage_layers(model.num_layers, n) if pipeline else [(0, model.num_layers)] * n
    )
    here = device_config(config, hardware)
    batch = here.max_batch
    pool_pages = default_pool_pages(model, here)
    tables = []
    for i, (device, layers) in enumerate(zip(hardware.devices, ranges, strict=True)):
        first, last = (i == 0, i == n - 1) if pipeline else (True, True)
        jobs_here = jobs if pipeline else jobs // n + (1 if i < jobs % n else 0)
        nl = layers[1] - layers[0]
        per_job = job_device_bytes(model, here, context, nl)
        shared = shared_device_bytes(model, here, pool_pages, nl)
        pages = context_pages(config, context)
        meta = 0 if shared else jobs_here * pages * meta_page_bytes(model, config, nl)
        tables.append(
            DeviceMemory(
                device=device,
                layers=layers,
                num_jobs=jobs_here,
                capacity_bytes=capacity,
                weights_bytes=weight_bytes(
                    model, config, layers, embed=first, head=last
                ),
                kv_slab_bytes=jobs_here * per_job - meta,
                metadata_bytes=meta + shared,
                activation_bytes=activation_bytes(
                    model, config, context, batch, head=last
                ),
                comm_bytes=comm_bytes(model, config, batch, hardware),
                reserve_bytes=device_reserve_bytes(capacity, config.device),
                per_job_bytes=per_job,
                shared_kv_bytes=shared,
                job_cap=batch if shared or hierarchical(here) else None,
            )
        )
    return tables


@dataclass(frozen=True)
class Capacity:
    """Largest number of concurrent jobs of one context, and which bound binds.

    ``host_limit`` is ``None`` when the config keeps no host tier (all-resident).
    ``binding`` is ``device``, ``host``, ``device+host`` (equal limits), ``max_batch``
    (the device limit is the ``max_batch`` cap, not memory) or ``max_batch+host``.
    """

    max_jobs: int
    device_limit: int
    host_limit: int | None
    binding: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def max_concurrent_jobs(
    model: ModelConfig, config: EngineConfig, hardware: Hardware, context: int
) -> Capacity:
    """How many jobs of ``context`` positions fit at once on ``hardware``.

    Device limit: data mode sums each device's :attr:`DeviceMemory.max_jobs`; pipeline
    mode takes the smallest stage's. Host limit: :func:`host_pool_bytes` //
    :func:`job_host_bytes`.
    """
    tables = device_tables(model, config, hardware, 0, context)
    if hardware.parallel == "pipeline" and hardware.num_devices > 1:
        device_limit = min(t.max_jobs for t in tables)
    else:
        device_limit = sum(t.max_jobs for t in tables)
    per_job_host = job_host_bytes(model, config, context)
    host_limit = None
    if per_job_host:
        pool = host_pool_bytes(config, hardware)
        workers = 1 if hardware.parallel == "pipeline" else hardware.num_devices
        host_limit = workers * ((pool // workers) // per_job_host)  # each worker its share
    device = "max_batch" if all(t.capped for t in tables) else "device"
    if host_limit is None or device_limit < host_limit:
        return Capacity(device_limit, device_limit, host_limit, device)
    binding = "host" if host_limit < device_limit else f"{device}+host"
    return Capacity(host_limit, device_limit, host_limit, binding)


def admit(
    model: ModelConfig,
    config: EngineConfig,
    context: int,
    *,
    device_free_bytes: int,
    host_free_bytes: int,
) -> str | None:
    """Scheduler admission check for one more job; ``None`` if it fits, else the reason.

    Parameters
    ----------
    context
        Prompt tokens plus ``max_tokens`` to generate.
    device_free_bytes
        Slab-pool and metadata bytes still unclaimed on the job's device.
    host_free_bytes
        Free bytes of the pinned host pool.
    """
    need_dev = job_device_bytes(model, config, context)
    need_host = job_host_bytes(model, config, context)
    if need_host > host_free_bytes:
        return f"needs {need_host / GIB:.2f} GiB of host pool, {host_free_bytes / GIB:.2f} GiB free"
    if need_dev > device_free_bytes:
        return f"needs {need_dev / GIB:.2f} GiB on device, {device_free_bytes / GIB:.2f} GiB free"
    return None


# ----------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Plan:
    """The answer of :func:`plan`: tables, limits, and whether the request fits.

    ``reasons`` says why an infeasible request is refused; ``suggestions`` gives the
    nearest feasible settings (CLI flags); ``notes`` are warnings that do not refuse.
    """

    model: ModelConfig
    config: EngineConfig
    hardware: Hardware
    num_jobs: int
    context: int
    devices: tuple[DeviceMemory, ...]
    job_kv_bytes: int
    host_needed_bytes: int
    host_pool_bytes: int
    host_usable_bytes: int
    capacity: Capacity
    dense: Capacity
    dense_job_device_bytes: int
    gather_bytes_per_step: int
    gather_ms_per_step: float
    reasons: tuple[str, ...] = ()
    suggestions: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def feasible(self) -> bool:
        return not self.reasons

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: bytes as ints, the model and config as plain dicts."""
        return {
            "feasible": self.feasible,
            "weight_format": weight_format(self.config, self.model),
            "model": dataclasses.asdict(self.model),
            "config": self.config.to_dict(),
            "hardware": self.hardware.to_dict(),
            "num_jobs": self.num_jobs,
            "context": self.context,
            "devices": [d.to_dict() for d in self.devices],
            "job_kv_bytes": self.job_kv_bytes,
            "host": {
                "kv_host_dtype": self.config.kv_host_dtype,
                "job_bytes": self.host_needed_bytes // max(self.num_jobs, 1),
                "needed_bytes": self.host_needed_bytes,
                "pool_bytes": self.host_pool_bytes,
                "usable_bytes": self.host_usable_bytes,
            },
            "capacity": self.capacity.to_dict(),
            "dense_baseline": {
                **self.dense.to_dict(),
                "job_device_bytes": self.dense_job_device_bytes,
            },
            "decode_io_estimate": {
                "gather_bytes_per_step": self.gather_bytes_per_step,
                "gather_ms_per_step": self.gather_ms_per_step,
                "lru_miss_rate": LRU_MISS_RATE,
            },
            "reasons": list(self.reasons),
            "suggestions": list(self.suggestions),
            "notes": list(self.notes),
        }


def dense_baseline(config: EngineConfig) -> EngineConfig:
    """The same run with dense attention and every record resident on the device."""
    return config.replace(attention="dense", hierarchical=False)


def plan(
    model: ModelConfig,
    config: EngineConfig,
    hardware: Hardware,
    jobs: int,
    context: int,
) -> Plan:
    """Plan ``jobs`` concurrent jobs of ``context`` positions each.

    Parameters
    ----------
    model, config, hardware
        Shape, resolved run settings (validated here) and box.
    jobs
        Concurrent jobs (>= 1).
    context
        Positions per job: prompt plus generated tokens.

    Raises
    ------
    ConfigError
        Invalid model, config, hardware or arguments (not an infeasible request: that
        comes back as a :class:`Plan` with ``reasons``).
    """
    model.validate()
    config.validate()
    hardware.validate()
    if jobs < 1:
        raise ConfigError(f"jobs must be >= 1, got {jobs}")
    if context < 1:
        raise ConfigError(f"context must be >= 1 token, got {context}")
    tables = tuple(device_tables(model, config, hardware, jobs, context))
    capacity = max_concurrent_jobs(model, config, hardware, context)
    dense_cfg = dense_baseline(config)
    per_job_host = job_host_bytes(model, config, context)
    reasons = _refusals(tables, capacity, jobs, per_job_host, config, hardware)
    suggestions = (
        _suggestions(model, config, hardware, jobs, context, capacity)
        if reasons
        else []
    )
    gather = _gather_bytes_per_step(model, config, jobs, context)
    return Plan(
        model=model,
        config=config,
        hardware=hardware,
        num_jobs=jobs,
        context=context,
        devices=tables,
        job_kv_bytes=job_kv_bytes(model, config, context),
        host_needed_bytes=jobs * per_job_host,
        host_pool_bytes=host_pool_bytes(config, hardware),
        host_usable_bytes=host_usable_bytes(config, hardware),
        capacity=capacity,
        dense=max_concurrent_jobs(model, dense_cfg, hardware, context),
        dense_job_device_bytes=job_device_bytes(model, dense_cfg, context),
        gather_bytes_per_step=gather,
        gather_ms_per_step=gather / (hardware.host_link_gbps * 1e9) * 1e3,
        reasons=tuple(reasons),
        suggestions=tuple(suggestions),
        notes=tuple(_notes(model, config, hardware, jobs, context)),
    )


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _refusals(tables, capacity, jobs, per_job_host, config, hardware) -> list[str]:
    reasons = []
    for t in tables:
        if t.fixed_bytes > t.capacity_bytes:
            reasons.append(
                f"{t.device}: weights {_gib(t.weights_bytes)} + activations/scratch "
                f"{_gib(t.activation_bytes)} + communication {_gib(t.comm_bytes)} + reserve "
                f"{_gib(t.reserve_bytes)} exceed its {_gib(t.capacity_bytes)} before any KV"
            )
        elif t.free_bytes < 0:
            room = t.capacity_bytes - t.fixed_bytes
            holds = max(0, room - t.shared_kv_bytes) // max(t.per_job_bytes, 1)
            shared = (
                f"; the page metadata of the host pool alone is {_gib(t.shared_kv_bytes)}"
                if t.shared_kv_bytes > room
                else ""
            )
            reasons.append(
                f"{t.device}: {t.num_jobs} job(s) need {_gib(t.kv_slab_bytes + t.metadata_bytes)} "
                f"of hot KV slabs + page metadata but only "
                f"{_gib(room)} is left after weights, scratch and "
                f"reserve (its memory holds {holds} job(s); "
                f"{'max_batch' if t.capped else 'device memory'} allows "
                f"{capacity.device_limit} on all devices{shared})"
            )
    if capacity.host_limit is not None and jobs > capacity.host_limit:
        pool = host_pool_bytes(config, hardware)
        workers = 1 if hardware.parallel == "pipeline" else hardware.num_devices
        shares = (
            f"; each of the {workers} devices' workers holds a share of "
            f"{_gib(pool // workers)} for its {-(-jobs // workers)} job(s)"
            if workers > 1
            else ""
        )
        reasons.append(
            f"host: {jobs} job(s) need {_gib(jobs * per_job_host)} of pinned KV but the host pool "
            f"holds {_gib(pool)} (host_pool_gb={config.host_pool_gb}, "
            f"usable host RAM {_gib(host_usable_bytes(config, hardware))}{shares}); host memory "
            f"allows {capacity.host_limit} job(s)"
        )
    return reasons


@dataclass(frozen=True)
class _Hint:
    """A suggested change: its text (a label, then CLI flags) and the plan it makes."""

    text: str
    config: EngineConfig
    hardware: Hardware
    context: int


def _suggestions(model, config, hardware, jobs, context, capacity) -> list[str]:
    """The nearest settings that fit, as CLI flags. Every hint is re-planned in full
    (devices, host, fixed parts) before it is offered: with it the ``jobs`` jobs fit, or,
    where only fewer do but more than ``--jobs`` alone allows, it also says ``--jobs N``
    (:func:`_replanned`); one that leaves no job running is dropped."""
    hints: list[_Hint] = []

    def hint(text, cfg=config, hw=hardware, ctx=context) -> None:
        hints.append(_Hint(text, cfg, hw, ctx))

    tables = device_tables(model, config, hardware, 0, context)
    if any(t.fixed_bytes > t.capacity_bytes for t in tables):
        hints.extend(_fixed_part_hints(model, config, hardware, jobs, context))
    if capacity.device_limit < jobs:
        hints.extend(_budget_hint(model, config, hardware, jobs, context))
        if config.max_batch < jobs:
            # max_batch caps the device limit below ``jobs`` whatever the memory: re-plan
            # the device hints with it raised to ``jobs`` and say so in each hint
            raised = config.replace(max_batch=jobs)
            if _fits(model, raised, hardware, jobs, context):  # the cap alone was in the way
                hint(f"more decode slots: --max-batch {jobs} (the devices hold them)", raised)
            else:
                for text, cfg in _device_hints(model, raised, hardware, jobs, context):
                    hint(text.replace(": ", f": --max-batch {jobs} ", 1), cfg)
        else:
            for text, cfg in _device_hints(model, config, hardware, jobs, context):
                hint(text, cfg)
    if capacity.host_limit is not None and capacity.host_limit < jobs:
        pool_gb = _pool_gb_for(model, config, hardware, jobs, context)
        needed = int(pool_gb * GIB)
        metadata = _metadata_cost(
            model, config, hardware, jobs, context, capacity, pool_gb
        )
        ram_gb = math.ceil(host_memory_needed_bytes(needed, config, hardware) / GIB)
        bigger = config.replace(host_pool_gb=float(pool_gb))
        if max(ram_gb, pool_gb) > MAX_HARDWARE_FIGURE:
            pass  # past what any flag takes: not a hint
        elif needed <= host_usable_bytes(config, hardware):
            hint(f"larger host pool: --host-pool {pool_gb} (fits in the host's RAM{metadata})", bigger)
        else:
            text = f"more host memory: --host-memory {ram_gb} --host-pool {pool_gb}"
            hint(text + (f" ({metadata[2:]})" if metadata else ""), bigger,
                 hardware.replace(host_memory_gb=float(ram_gb)))  # fmt: skip
        if config.kv_host_dtype == "bf16" and hierarchical(config):
            share = "a quarter of" if config.kv_dtype == "float32" else "half"
            hint(f"{share} the host KV bytes: --kv-host-dtype fp8 (fp8 host pages)",
                 config.replace(kv_host_dtype="fp8"))  # fmt: skip
        if config.kv_dtype == "float32":
            hint(
                "half the KV bytes: kv_dtype bfloat16 (here --kv-dtype bfloat16; for "
                "`hisparse run`, `kv_dtype: bfloat16` under a preset's or manifest's engine:)",
                config.replace(kv_dtype="bfloat16"),
            )
    replanned = _replanned(model, hints, jobs, capacity.max_jobs)
    out = [text for text, _ in replanned]
    if 1 <= capacity.max_jobs < jobs:
        out.insert(0, f"fewer jobs: --jobs {capacity.max_jobs}")
    if not any(every for _, every in replanned):  # none runs every job: the context that does

        def fitting(cfg, hw, ctx) -> tuple[str, EngineConfig] | None:
            return ("", cfg) if _feasible(model, cfg, hw, jobs, ctx) else None

        shorter = _shorter_context_hint(model, config, hardware, jobs, context, fitting)
        out.extend(h.text for h in shorter)
    return out


def _replanned(model, hints: list[_Hint], jobs: int, floor: int) -> list[tuple[str, bool]]:
    """``(text, True)`` for each of ``hints`` whose plan runs the ``jobs`` jobs;
    ``(text with " --jobs n" added to its flags, False)`` for one whose plan runs only
    ``n`` of them, ``floor < n < jobs`` (``floor``: what ``--jobs`` alone allows); the
    others are dropped."""
    out = []
    for h in hints:
        if _feasible(model, h.config, h.hardware, jobs, h.context):
            out.append((h.text, True))
            continue
        try:
            n = max_concurrent_jobs(model, h.config, h.hardware, h.context).max_jobs
        except ConfigError:
            continue
        if floor < n < jobs and _feasible(model, h.config, h.hardware, n, h.context):
            at = h.text.find(" (")
            at = len(h.text) if at < 0 else at
            out.append((f"{h.text[:at]} --jobs {n}{h.text[at:]}", False))
    return out


def _feasible(model, config, hardware, jobs, context) -> bool:
    """Whether :func:`plan` would accept ``jobs`` jobs of ``context`` positions."""
    try:
        config.validate()
        hardware.validate()
    except ConfigError:
        return False
    tables = device_tables(model, config, hardware, jobs, context)
    capacity = max_concurrent_jobs(model, config, hardware, context)
    per_job_host = job_host_bytes(model, config, context)
    return not _refusals(tables, capacity, jobs, per_job_host, config, hardware)


def _pool_gb_for(model, config, hardware, jobs, context) -> int:
    """The smallest whole-GiB host pool whose shares (one per data worker:
    :func:`max_concurrent_jobs`) hold ``jobs`` jobs."""
    per_job = job_host_bytes(model, config, context)
    workers = 1 if hardware.parallel == "pipeline" else hardware.num_devices
    # each share is pool // workers bytes and must hold ceil(jobs / workers) jobs
    return math.ceil(workers * -(-jobs // workers) * per_job / GIB)


def _host_holds(model, config, hardware, jobs, context) -> bool:
    """Whether the host pool of ``config`` holds ``jobs`` jobs of ``context`` positions
    (no host tier: yes)."""
    try:
        config.validate()
    except ConfigError:
        return False
    limit = max_concurrent_jobs(model, config, hardware, context).host_limit
    return limit is None or limit >= jobs


def _metadata_cost(model, config, hardware, jobs, context, capacity, pool_gb) -> str:
    """``""``, or what a host pool of ``pool_gb`` GiB costs the devices when its page
    metadata (host pool / page_size, allocated with the pool) leaves room for fewer jobs
    than now (or than ``jobs``)."""
    if not hierarchical(config):
        return ""
    bigger = config.replace(host_pool_gb=float(pool_gb))
    wanted = min(jobs, capacity.device_limit)
    room = max_concurrent_jobs(model, bigger, hardware, context).device_limit
    if room >= wanted:
        return ""
    return (
        f"; its page metadata on the device (host pool / {config.page_size}) then leaves "
        f"room for {room} job(s)"
    )


def _smaller_pool(model, config, hardware, jobs, context) -> EngineConfig | None:
    """The config with the smallest whole-GiB ``host_pool_gb`` below the current one whose
    pool still holds ``jobs`` jobs (each data worker its share); ``None`` when no smaller
    pool does or the config has no host tier. Hierarchical caches keep the page metadata
    of every host pool page on the device (``host pool / page_size`` bytes), so a pool
    larger than the jobs need costs device memory."""
    per_job = job_host_bytes(model, config, context)
    if not per_job:
        return None
    gb = max(1, math.ceil(jobs * per_job / GIB))
    while gb < config.host_pool_gb:
        candidate = config.replace(host_pool_gb=float(gb))
        limit = max_concurrent_jobs(model, candidate, hardware, context).host_limit
        if limit is not None and limit >= jobs:
            return candidate
        gb += 1
    return None


def _fits(model, config, hardware, jobs, context) -> bool:
    """Whether ``jobs`` jobs of ``context`` positions fit on the devices."""
    return max_concurrent_jobs(model, config, hardware, context).device_limit >= jobs


def _buffer_flags(config: EngineConfig) -> str:
    return f"--device-buffer {config.device_buffer_tokens} --top-k-tokens {config.top_k}"


def _device_hints(model, config, hardware, jobs, context) -> list[tuple[str, EngineConfig]]:
    """Device-bound plans, each as (text, config): a smaller hot buffer (per-job slabs), a
    host pool cut to what the jobs need (the page metadata of every host pool page is on
    the device), both; only when none of those fits at the current page size, larger pages
    with the fidelity cost named. With each, ``jobs`` jobs fit on the devices."""
    hints = []
    smaller = _smaller_buffer(model, config, hardware, jobs, context)
    if smaller is not None:
        hints.append((f"smaller hot buffer: {_buffer_flags(smaller)}", smaller))
    pool = _smaller_pool(model, config, hardware, jobs, context)
    if pool is not None:
        flag = f"--host-pool {pool.host_pool_gb:g}"
        why = f"(its page metadata on the device is host pool / {config.page_size})"
        if _fits(model, pool, hardware, jobs, context):
            hints.append((f"smaller host pool: {flag} {why}", pool))
        else:
            both = _smaller_buffer(model, pool, hardware, jobs, context)
            if both is not None:
                hints.append(
                    (f"smaller host pool and hot buffer: {flag} {_buffer_flags(both)} {why}", both)
                )
    if hints:
        return hints
    for page_size in (s for s in PAGE_SIZES if s > config.page_size):
        for base in (config, pool):
            if base is None:
                continue
            larger = _smaller_buffer(
                model, base.replace(page_size=page_size), hardware, jobs, context
            )
            if larger is not None:
                flags = f"--page-size {page_size} {_buffer_flags(larger)}"
                if larger.host_pool_gb != config.host_pool_gb:
                    flags += f" --host-pool {larger.host_pool_gb:g}"
                return [
                    (
                        f"larger pages: {flags} (a looser selection, fewer needles found: "
                        "docs/performance.md, \"Fidelity eval on the GPU\")",
                        larger,
                    )
                ]
    return hints


def _fixed_part_hints(model, config, hardware, jobs, context) -> list[_Hint]:
    """Ways to shrink what a device holds before any KV: int4 weights, a pipeline split,
    a shorter context (prefill keeps T x H hidden states and one layer's K/V); each with
    the host pool cut to the jobs' need (:func:`_smaller_pool`) where it fits only so.
    With each, one job fits on the devices (:func:`_suggestions` re-plans them all)."""
    hints = []

    def fitting(cfg, hw, ctx) -> tuple[str, EngineConfig] | None:
        """``("", cfg)`` if one job fits as is, the host-pool flag and its config if it
        fits with the pool cut to ``jobs`` jobs' need, ``None`` if neither."""
        if _fits(model, cfg, hw, 1, ctx):
            return "", cfg
        pool = _smaller_pool(model, cfg, hw, jobs, ctx)
        if pool is not None and _fits(model, pool, hw, 1, ctx):
            return f" --host-pool {pool.host_pool_gb:g}", pool
        return None

    if weight_format(config, model) == "float":
        found = fitting(config.replace(weight_format="int4"), hardware, context)
        if found is not None:
            pool, cfg = found
            text = f"int4 weights: weight_format int4{',' if pool else ''}{pool}"
            hints.append(_Hint(text, cfg, hardware, context))
    if hardware.num_devices > 1 and hardware.parallel == "data":
        split = hardware.replace(parallel="pipeline")
        found = fitting(config, split, context)
        if found is not None:
            pool, cfg = found
            hints.append(
                _Hint(f"split the layers across the devices: --parallel pipeline{pool}", cfg,
                      split, context)  # fmt: skip
            )
    hints.extend(_shorter_context_hint(model, config, hardware, jobs, context, fitting))
    return hints


def _budget_hint(model, config, hardware, jobs, context) -> list[_Hint]:
    """With ``memory_budget_gb`` below the devices' memory: the smallest budget, in steps
    of 0.01 GiB up to that memory, with which ``jobs`` jobs fit on the devices, as a hint;
    with the host pool raised to the jobs' need where it holds fewer (:func:`_pool_gb_for`),
    else cut to it where only that makes them fit (:func:`_smaller_pool`); ``[]`` when
    none does."""
    budget = config.memory_budget_gb
    if budget is None or budget >= hardware.memory_gb:
        return []
    if _host_holds(model, config, hardware, jobs, context):
        bases = [config, _smaller_pool(model, config, hardware, jobs, context)]
    else:
        need_gb = _pool_gb_for(model, config, hardware, jobs, context)
        bases = [config.replace(host_pool_gb=float(need_gb))]
    top = math.floor(hardware.memory_gb * 100)
    for base in bases:
        if base is None:
            continue

        def fits(k: int, base=base) -> bool:
            return _fits(model, base.replace(memory_budget_gb=k / 100), hardware, jobs, context)

        if not fits(top):
            continue
        lo, hi = math.floor(budget * 100), top  # lo does not fit, hi does
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        pool = "" if base is config else f" --host-pool {base.host_pool_gb:g}"
        text = f"a larger budget: --memory-budget {hi / 100:g}{pool}"
        return [_Hint(text, base.replace(memory_budget_gb=hi / 100), hardware, context)]
    return []


def _shorter_context_hint(model, config, hardware, jobs, context, fitting) -> list[_Hint]:
    """The longest of ``context / 2, / 4, ...`` at which ``fitting(config, hardware, ctx)``
    (``("", config)`` or a ``--host-pool`` flag and its config) holds and the host pool
    holds ``jobs`` jobs, as a hint; ``[]`` when none down to one page does."""
    shorter = context // 2
    while shorter >= config.page_size:
        found = fitting(config, hardware, shorter)
        if found is not None and _host_holds(model, found[1], hardware, jobs, shorter):
            pool, cfg = found
            text = f"a shorter context: --context {format_context(shorter)}{pool}"
            return [_Hint(text, cfg, hardware, shorter)]
        shorter //= 2
    return []


def _smaller_buffer(model, config, hardware, jobs, context) -> EngineConfig | None:
    """The largest device_buffer at ``config``'s page size (and top_k <= buffer / 2) that
    lets ``jobs`` fit on the devices; ``None`` if none does (:func:`largest_buffer`)."""
    return largest_buffer(config, lambda cfg: _fits(model, cfg, hardware, jobs, context))


def largest_buffer(config: EngineConfig, fits) -> EngineConfig | None:
    """``config`` with the largest ``device_buffer`` at its page size, at most its own, for
    which ``fits(candidate)`` holds, ``top_k`` lowered to at most half of it where needed;
    ``None`` if none does before the buffer can no longer hold one step's selection (the
    sink and window pages: :meth:`EngineConfig.validate`)."""
    page_size = config.page_size
    buffer = config.device_buffer_tokens // page_size * page_size
    while buffer >= page_size:
        top_k = min(config.top_k, max(page_size, buffer // 2 // page_size * page_size))
        try:
            candidate = config.replace(device_buffer=buffer, top_k=top_k)
            candidate.validate()
        except ConfigError:
            return None
        if fits(candidate):
            return candidate
        buffer -= page_size
    return None


def smallest_budget_gb(need_bytes: int, device: str) -> float:
    """The smallest ``memory_budget_gb``, in steps of 0.01 GiB, that leaves ``need_bytes``
    after its reserve (:func:`device_reserve_bytes` on ``device``)."""

    def room(gb: float) -> int:
        budget = int(gb * GIB)
        return budget - device_reserve_bytes(budget, device)

    need = max(need_bytes, 0)
    least = max(need / (1 - DEVICE_RESERVE_FRACTION), need + _reserve_floor(device))
    gb = math.ceil(least / GIB * 100) / 100
    while room(gb) < need_bytes and gb < MAX_HARDWARE_FIGURE:
        gb = round(gb + 0.01, 2)
    return gb


def _gather_bytes_per_step(model, config, jobs, context) -> int:
    """Estimated host->device bytes of one decode step: each (job, layer, KV head) of the
    at most ``max_batch`` jobs that decode at once misses :data:`LRU_MISS_RATE` of its
    selected pages (0 when the hot buffer holds every page, or when a CPU device reads
    the pool in place: ``cpu_direct_reads``)."""
    if all_resident(config) or context_pages(config, context) <= config.buffer_pages:
        return 0  # every page stays resident after its first load
    direct = config.cpu_direct_reads and str(config.device).startswith("cpu")
    if direct and config.kv_host_dtype != "fp8":
        return 0  # nothing is copied (engine.decode.attention.DecodeAttention.direct)
    pages = config.max_selected_pages
    decoding = min(jobs, config.max_batch)
    selected = decoding * pages * model.num_layers * model.num_kv_heads * host_record_bytes(model, config)
    return int(selected * LRU_MISS_RATE)


def _notes(model, config, hardware, jobs, context) -> list[str]:
    notes = []
    unmeasured = _cpu_fp16_head_bytes(
        model, config, weight_format(config, model), unmeasured_only=True
    )
    if unmeasured:
        notes.append(
            f"the weights count an fp16 copy of the LM head ({_gib(unmeasured)}) that a run "
            "keeps only where this machine measures it faster; none has measured it yet (the "
            "first run does, and later plans count what it found)"
        )
    if jobs > config.max_batch:
        notes.append(
            f"jobs={jobs} > max_batch={config.max_batch}: only {config.max_batch} decode at once"
        )
    if context > model.max_position and config.context_policy == "refuse":
        notes.append(
            f"context {context} exceeds {model.name or 'the model'}'s trained "
            f"{model.max_position} tokens: the engine refuses unless context_policy is "
            "extend, truncate or chunk"
        )
    if (
        config.memory_budget_gb is not None
        and config.memory_budget_gb > hardware.memory_gb
    ):
        notes.append(
            f"memory_budget_gb={config.memory_budget_gb} is above the device's "
            f"{hardware.memory_gb} GiB; the device's memory is used"
        )
    if int(config.host_pool_gb * GIB) > host_usable_bytes(config, hardware):
        notes.append(
            f"host_pool_gb={config.host_pool_gb} is more than the usable host RAM "
            f"({_gib(host_usable_bytes(config, hardware))}); the pool cannot be pinned in full"
        )
    return notes
