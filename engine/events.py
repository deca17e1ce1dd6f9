"""Jobs in, events out: the contract between the engine and any front end.

The engine never imports the CLI or Rich. A front end builds :class:`Job` objects, calls
``Engine.run(jobs)`` and renders the :class:`Event` objects it yields. Every event is a
frozen dataclass; ``dataclasses.asdict`` turns one into JSON-ready data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import SamplingParams


@dataclass(frozen=True)
class Job:
    """One unit of work: a prompt (already rendered with the chat template) to complete.

    prompt_ids: token ids of the full rendered prompt, ``[T]`` ints.
    key: opaque string identifying input content + settings (used for resume).
    json_keys: when set, the reply is constrained to one JSON object with exactly these
    keys, in this order (:mod:`engine.decode.json_constraint`); ``None``: free text.
    """

    id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    input_path: str = ""
    meta: dict = field(default_factory=dict)
    json_keys: tuple[str, ...] | None = None


@dataclass(frozen=True)
class CacheStats:
    """Hot-buffer traffic of one job (sums over layers, KV heads and steps).

    hits / misses count records (one page of one layer and KV head) that attention
    selected; ``prefetched`` counts records loaded ahead of selection (``prefetch_pages``);
    ``h2d_bytes`` is bytes copied host pool -> hot buffer by gathers (misses and
    prefetched records).
    """

    hits: int = 0
    misses: int = 0
    h2d_bytes: int = 0
    prefetched: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 1.0


@dataclass(frozen=True)
class AuditStats:
    """A job's fidelity audit (:mod:`engine.decode.audit`): over ``steps`` audited decode
    steps, the share whose sparse argmax equals dense attention's (``top1_agreement``),
    the mean and largest KL(dense || sparse) of the next-token distributions (nats), the
    mean share of the exact attention mass inside the selected pages (``mass_kept_mean``,
    0-1), and the seconds the audit took."""

    steps: int = 0
    top1_agreement: float = 1.0
    kl_mean: float = 0.0
    kl_max: float = 0.0
    mass_kept_mean: float = 1.0
    seconds: float = 0.0


@dataclass(frozen=True)
class JobResult:
    """Outcome of a finished job.

    finish_reason: ``stop`` (end-of-turn / EOS token or stop string), ``length``
    (max_tokens reached), ``error`` (see ``error``) or ``cancelled``.
    ttft_s: seconds from admission to the first generated token.
    decode_tok_s: generated tokens after the first / decode seconds.
    """

    job_id: str
    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    finish_reason: str
    ttft_s: float = 0.0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    cache: CacheStats = field(default_factory=CacheStats)
    error: str = ""
    audit: AuditStats | None = None


@dataclass(frozen=True)
class Event:
    """Base class of everything ``Engine.run`` yields. ``t`` is ``time.monotonic()``."""

    t: float


@dataclass(frozen=True)
class JobQueued(Event):
    job_id: str
    prompt_tokens: int


@dataclass(frozen=True)
class JobAdmitted(Event):
    job_id: str
    prompt_tokens: int


@dataclass(frozen=True)
class PrefillProgress(Event):
    """Prefill of ``job_id`` has done ``done`` of ``total`` units (layer x chunk work)."""

    job_id: str
    done: int
    total: int
    tokens: int


@dataclass(frozen=True)
class FirstToken(Event):
    job_id: str
    ttft_s: float


@dataclass(frozen=True)
class DecodeStep(Event):
    """One decode step of the whole batch.

    generated: per running job, tokens generated so far (after this step).
    step_s: seconds since the previous step was read (or this one launched).
    with_prefill: a prefill turn ran within ``step_s`` (the step shared the GPU with a
        new job's prefill).
    graph_capture: the step's launch captured a CUDA graph (once per batch shape: an
        eager warm-up and the capture ran within ``step_s``).
    Steps with neither are the batch's steady decode rate.
    """

    step: int
    batch_size: int
    step_s: float
    generated: dict[str, int]
    max_tokens: dict[str, int]
    hits: int = 0
    misses: int = 0
    h2d_bytes: int = 0
    prefetched: int = 0
    with_prefill: bool = False
    graph_capture: bool = False


@dataclass(frozen=True)
class AuditStep(Event):
    """One audited decode step of ``job_id`` (``--audit``): ``step`` is the job's decode
    step, ``agree`` whether sparse and dense picked the same top token, ``kl`` the
    KL(dense || sparse) in nats, ``mass_kept`` the share of attention mass selected."""

    job_id: str
    step: int
    agree: bool
    kl: float
    mass_kept: float


@dataclass(frozen=True)
class JobFinished(Event):
    result: JobResult


@dataclass(frozen=True)
class JobFailed(Event):
    job_id: str
    error: str


@dataclass(frozen=True)
class MemorySnapshot(Event):
    """Memory in bytes by part, per device (``device`` is e.g. ``cpu`` or ``cuda:0``).

    weights, hot_buffer (slab records), metadata: the bytes of those tensors;
    activations: allocated now less those parts (CUDA; 0 on CPU); total: the device's
    memory (CPU: physical RAM). host_pool_used / host_pool_total: the KV pool (host
    memory when hierarchical) of this engine's layers; host_pool_pinned: the part of it
    page-locked now (the pool is pinned in chunks as pages are handed out, see
    :mod:`engine.kv.host_pool`; the whole pool where it is not pinned lazily).

    CUDA only (0 on CPU): peak_allocated / peak_reserved are
    ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` of this process on the
    device (a worker resets them once its model is loaded, see :mod:`engine.serve.workers`);
    device_used is the device's total less ``cudaMemGetInfo``'s free bytes (every
    process, CUDA contexts included); pinned_host is what torch's pinned host allocator
    holds in this process (``torch.cuda.host_memory_stats``, power-of-two blocks; 0 where
    torch does not report it).

    stage: the pipeline stage that measured it (``-1`` outside a pipeline).
    host_pool_dtype: how the host pool stores records (``EngineConfig.kv_host_dtype``:
    ``bf16`` or ``fp8``); empty where the pool is on the device.
    """

    device: str
    weights: int
    hot_buffer: int
    metadata: int
    activations: int
    total: int
    host_pool_used: int
    host_pool_total: int
    peak_allocated: int = 0
    peak_reserved: int = 0
    device_used: int = 0
    pinned_host: int = 0
    stage: int = -1
    host_pool_pinned: int = 0
    host_pool_dtype: str = ""


@dataclass(frozen=True)
class StartupTimes(Event):
    """Where a run's start-up went: ``marks`` maps each step, in the order they happen, to
    the ``time.monotonic()`` at which it ended (``CLOCK_MONOTONIC``: one clock for every
    process of the machine, so a parent can subtract its own start). A front end adds its
    own steps (``hisparse run``: ``cli_ready``, ``config_resolved``, ``load_started``)
    to the engine's (:attr:`engine.serve.engine.Engine.load_marks`, set by
    :func:`engine.load.load_engine`): ``engine_imported`` (torch, Triton, the engine
    modules), ``metadata`` (GGUF header and tensor descriptions read), ``tokenizer``
    (built from the metadata), ``weights`` (tensors read), ``model`` (placed on the
    device), ``kernels`` (the kernel set chosen), ``engine`` (KV cache and engine built).
    ``t`` is when the front end reported them. Not yielded by ``Engine.run``."""

    marks: dict[str, float]
