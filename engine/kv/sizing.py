"""Every byte formula of the KV hierarchy, in one place.

The capacity planner (:mod:`engine.capacity.planner`), the budget split
(:mod:`engine.capacity.budget`) and the cache itself (:class:`engine.kv.cache.KVCache`)
all size records, pages, metadata, slabs, page tables and LRU state with these functions,
so what ``hisparse plan`` counts is what the cache allocates. Arithmetic only: no torch.

Shape symbols: ``L`` layers (``L_d`` on one pipeline stage), ``Hkv`` KV heads, ``D`` head
dim, ``T`` tokens, ``S`` page size, ``P = ceil(T / S)`` pages, ``b_kv`` bytes per KV
element. With ``kv_host_dtype=fp8`` (hierarchical) a host-pool record is ``2 x S x D`` fp8
bytes plus ``2 x S`` int8 scale exponents (:mod:`kernels.fp8_kv`); the page metadata stays
in ``kv_dtype``, and so does the hot buffer unless ``hot_buffer_dtype=fp8`` (then a slot
holds a record as the fp8 host pool stores it). Bytes everywhere; GiB (2**30 bytes) only in :data:`GIB`.
"""

from __future__ import annotations

from engine.config import (
    DTYPES,
    CacheFullError,
    ConfigError,
    EngineConfig,
    ModelConfig,
    env_overrides,
)

GIB = 1 << 30

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# KVCache per-slot LRU state: slot_page int32 + slot_last_use int64.
LRU_BYTES_PER_SLOT = 4 + 8

PAGE_TABLE_ENTRY_BYTES = 4


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (one of :data:`engine.config.DTYPES`)."""
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPE_BYTES[dtype]


def all_resident(config: EngineConfig) -> bool:
    """True when every record stays on the device (dense attention or no host tier)."""
    return config.attention == "dense" or not config.hierarchical


def context_pages(config: EngineConfig, context: int) -> int:
    """P = ceil(T / S): pages holding ``context`` positions."""
    return -(-context // config.page_size)


def kv_bytes_per_token(
    model: ModelConfig, config: EngineConfig, num_layers: int | None = None
) -> int:
    """K and V of one position over ``num_layers`` layers: L x Hkv x D x 2 x b_kv."""
    num_layers = model.num_layers if num_layers is None else num_layers
    return (
        num_layers
        * model.num_kv_heads
        * model.head_dim
        * 2
        * dtype_bytes(config.kv_dtype)
    )


def pages_for(num_tokens: int, page_size: int) -> int:
    """ceil(T / S): pages holding ``num_tokens`` positions."""
    return -(-num_tokens // page_size)


def hierarchical(config: EngineConfig) -> bool:
    """True when records live in the host pool and only a hot buffer on the device."""
    return config.attention == "sparse" and config.hierarchical


def record_bytes(model: ModelConfig, config: EngineConfig) -> int:
    """One record, K and V of one page, layer and KV head: ``2 x S x D x b_kv``."""
    return 2 * config.page_size * model.head_dim * dtype_bytes(config.kv_dtype)


def host_fp8(config: EngineConfig) -> bool:
    """True when the host pool stores fp8 records (hierarchical and ``kv_host_dtype=fp8``)."""
    return hierarchical(config) and config.kv_host_dtype == "fp8"


FP8_SCALE_BYTES = 1
"""One int8 scale exponent per (token, layer, KV head, K|V) row of an fp8 record."""


def host_record_bytes(model: ModelConfig, config: EngineConfig) -> int:
    """One record as the KV pool stores it and a miss moves over the link: fp8 host pool
    ``2 x S x (D + 1)`` (values and one exponent per row), else :func:`record_bytes`."""
    if host_fp8(config):
        return 2 * config.page_size * (model.head_dim + FP8_SCALE_BYTES)
    return record_bytes(model, config)


def hot_fp8(config: EngineConfig) -> bool:
    """True when the hot buffer holds fp8 records (``hot_buffer_dtype=fp8`` over an fp8
    host pool)."""
    return host_fp8(config) and config.hot_buffer_dtype == "fp8"


def slot_bytes(model: ModelConfig, config: EngineConfig) -> int:
    """One hot-buffer slot: ``2 x S x (D + 1)`` with an fp8 hot buffer (:func:`hot_fp8`),
    else :func:`record_bytes`."""
    if hot_fp8(config):
        return 2 * config.page_size * (model.head_dim + FP8_SCALE_BYTES)
    return record_bytes(model, config)


def meta_page_bytes(model: ModelConfig, config: EngineConfig, num_layers: int | None = None) -> int:
    """Page metadata of one pool page over ``num_layers`` layers (default all):
    ``L x Hkv x 2 x D x b_kv``."""
    nl = model.num_layers if num_layers is None else num_layers
    return nl * model.num_kv_heads * 2 * model.head_dim * dtype_bytes(config.kv_dtype)


def superpage_rows(config: EngineConfig, num_pool_pages: int) -> int:
    """Superpage metadata rows a cache of ``num_pool_pages`` keeps per layer with
    ``page_metadata=superpage`` (sparse attention): one per ``superpage_pages`` pool pages,
    plus one partial superpage per running job and one spare; 0 otherwise."""
    if config.page_metadata != "superpage" or config.attention != "sparse":
        return 0
    return -(-num_pool_pages // config.superpage_pages) + config.max_batch + 1


def superpage_bytes(
    model: ModelConfig, config: EngineConfig, num_pool_pages: int, num_layers: int | None = None
) -> int:
    """Device bytes of the superpage metadata (rows ``[L, rows, Hkv, 2, D]`` in ``kv_dtype``)
    and its int32 pool-page map, 0 without superpages (:func:`superpage_rows`)."""
    rows = superpage_rows(config, num_pool_pages)
    if not rows:
        return 0
    nl = model.num_layers if num_layers is None else num_layers
    row = model.num_kv_heads * 2 * model.head_dim * dtype_bytes(config.kv_dtype)
    return nl * rows * row + 4 * num_pool_pages


def pool_page_bytes(model: ModelConfig, config: EngineConfig, num_layers: int | None = None) -> int:
    """One pool page over ``num_layers`` layers (default all) and the KV heads:
    ``L x Hkv x record`` (:func:`host_record_bytes`)."""
    nl = model.num_layers if num_layers is None else num_layers
    return nl * model.num_kv_heads * host_record_bytes(model, config)


def per_request_device_bytes(
    model: ModelConfig,
    config: EngineConfig,
    max_pages_per_seq: int,
    num_layers: int | None = None,
) -> int:
    """Hierarchical only: the slabs of one request (``Hkv`` per layer, over ``num_layers``
    layers, default all) with their page tables and LRU state; 0 when all-resident."""
    if not hierarchical(config):
        return 0
    nl = model.num_layers if num_layers is None else num_layers
    slots = config.buffer_pages
    per_slab_layer = (
        slots * slot_bytes(model, config)
        + max_pages_per_seq * PAGE_TABLE_ENTRY_BYTES
        + slots * LRU_BYTES_PER_SLOT
    )
    return nl * model.num_kv_heads * per_slab_layer


def cache_device_bytes(
    model: ModelConfig,
    config: EngineConfig,
    num_pool_pages: int,
    max_pages_per_seq: int,
    num_layers: int | None = None,
) -> int:
    """Device bytes a :class:`engine.kv.cache.KVCache` of these sizes over ``num_layers``
    layers (default all) allocates."""
    meta = num_pool_pages * meta_page_bytes(model, config, num_layers)
    if not hierarchical(config):
        supers = superpage_bytes(model, config, num_pool_pages, num_layers)
        return meta + supers + num_pool_pages * pool_page_bytes(model, config, num_layers)
    per_req = per_request_device_bytes(model, config, max_pages_per_seq, num_layers)
    shared = shared_device_bytes(model, config, num_pool_pages, num_layers)
    return shared + config.max_batch * per_req


def default_pool_pages(model: ModelConfig, config: EngineConfig) -> int:
    """Pool pages from ``host_pool_gb``, as :class:`engine.kv.cache.KVCache` computes them."""
    return max(1, int(config.host_pool_gb * GIB) // pool_page_bytes(model, config))


def token_staging_bytes(model: ModelConfig, config: EngineConfig, num_layers: int | None = None) -> int:
    """The decode write-through staging rows ``[L_d, max_batch, Hkv, 2, D]`` that a
    pinned (hierarchical, CUDA) cache allocates with ``decode_write_stream``; 0 otherwise."""
    if not (hierarchical(config) and config.decode_write_stream and "cuda" in config.device):
        return 0
    nl = model.num_layers if num_layers is None else num_layers
    return nl * config.max_batch * model.num_kv_heads * 2 * model.head_dim * dtype_bytes(config.kv_dtype)


def shared_device_bytes(
    model: ModelConfig, config: EngineConfig, num_pool_pages: int, num_layers: int | None = None
) -> int:
    """Hierarchical: what the cache allocates on the device whatever the jobs: page
    metadata of every host pool page (and :func:`superpage_bytes`) plus
    :func:`token_staging_bytes`; 0 all-resident (there the metadata grows with the device
    pool, one page at a time)."""
    if not hierarchical(config):
        return 0
    meta = num_pool_pages * meta_page_bytes(model, config, num_layers)
    supers = superpage_bytes(model, config, num_pool_pages, num_layers)
    return meta + supers + token_staging_bytes(model, config, num_layers)


def job_device_bytes(
    model: ModelConfig, config: EngineConfig, context: int, num_layers: int | None = None
) -> int:
    """Device bytes one more job of ``context`` positions claims, as the cache allocates:
    hierarchical, one slab of ``device_buffer`` slots per (layer, KV head) with its page
    table and LRU state, whatever the job's length (:func:`per_request_device_bytes`);
    all-resident, its ``P`` pages of the device pool and their metadata."""
    pages = pages_for(context, config.page_size)
    if hierarchical(config):
        return per_request_device_bytes(model, config, pages, num_layers)
    return pages * (pool_page_bytes(model, config, num_layers) + meta_page_bytes(model, config, num_layers))


# ----------------------------------------------------------------------------- host memory


def available_host_bytes(declared_gb: float | None = None) -> int | None:
    """Host memory available for the KV pool, in bytes: ``declared_gb`` (GiB;
    ``EngineConfig.host_memory_gb``, from ``$HISPARSE_HOST_MEMORY_GB`` through
    :func:`engine.config.env_overrides` when not given) — for virtual machines whose memory
    grows on demand, where ``MemAvailable`` reads far below what can be used — else
    ``MemAvailable`` of ``/proc/meminfo`` (``None`` where it cannot be read).

    Raises
    ------
    ConfigError
        ``HISPARSE_HOST_MEMORY_GB`` is not a number (a ``ValueError``).
    ValueError
        The declared size is not positive.
    """
    if declared_gb is None:
        declared_gb = env_overrides().get("host_memory_gb")
    if declared_gb is not None:
        if declared_gb <= 0:
            raise ValueError(f"HISPARSE_HOST_MEMORY_GB={declared_gb!r} is not a positive number")
        return int(declared_gb * 2**30)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


HOST_POOL_SHARE = 0.9
"""Largest share of the available host memory (:func:`available_host_bytes`) the pool may take."""

LOAD_MARGIN_BYTES = 1 << 30
"""Host memory a model load takes besides weights kept on a CPU device: torch's libraries,
the interpreter's heap, read buffers. A check made before the load sets it aside (with
those weights) from ``MemAvailable``, which the load then lowers (:func:`check_host_memory`)."""


class HostMemoryError(CacheFullError):
    """The host pool does not fit in the memory available (:func:`check_host_memory`);
    ``available``: the bytes that were available, as read."""

    def __init__(self, message: str, available: int):
        super().__init__(message)
        self.available = available


def check_host_memory(
    pool_bytes: int, declared_gb: float | None = None, load_bytes: int = 0
) -> int | None:
    """Refuse a host pool larger than 90% (:data:`HOST_POOL_SHARE`) of the memory
    available now, less ``load_bytes`` when the figure is ``MemAvailable``.

    Parameters
    ----------
    pool_bytes
        Size of the whole host pool, in bytes.
    declared_gb
        ``EngineConfig.host_memory_gb`` (``HISPARSE_HOST_MEMORY_GB``), if declared.
    load_bytes
        What the model load will add to the memory in use, for a check made before it
        (weights kept on a CPU device and :data:`LOAD_MARGIN_BYTES`): ``MemAvailable``
        drops by about that much before the cache checks the pool again, with 0. A
        declared size is a fixed figure: nothing is set aside from it.

    Returns
    -------
    The available bytes read (``None`` where they cannot be read).

    Raises
    ------
    HostMemoryError
        Naming the pool size, what is available (and where that figure came from, and
        what was set aside for the load), the 90% rule and the settings to change
        (``--host-pool``, ``host_pool_gb``, ``HISPARSE_HOST_MEMORY_GB``).
    """
    if declared_gb is None:
        declared_gb = env_overrides().get("host_memory_gb")
    avail = available_host_bytes(declared_gb)
    load_bytes = 0 if declared_gb else load_bytes
    if avail is not None and pool_bytes > host_pool_limit(avail, load_bytes):
        source = f"HISPARSE_HOST_MEMORY_GB={declared_gb:g}" if declared_gb else "MemAvailable"
        if load_bytes:
            source += f", less {load_bytes / 2**30:.1f} GiB the model load will take"
        raise HostMemoryError(
            f"the host KV pool needs {pool_bytes / 2**30:.1f} GiB but only "
            f"{avail / 2**30:.1f} GiB of host memory is available ({source}), and the pool "
            f"may take at most {HOST_POOL_SHARE:.0%} of it "
            f"({host_pool_limit(avail, load_bytes) / 2**30:.1f} GiB); lower the pool with "
            "--host-pool GB (host_pool_gb in a preset or a manifest's defaults.engine; "
            "shared by all workers), or, where MemAvailable reads low (memory that grows on "
            "demand), declare the real size with HISPARSE_HOST_MEMORY_GB",
            avail,
        )
    return avail


def host_pool_limit(avail: int, load_bytes: int = 0) -> int:
    """The largest host pool, in bytes: :data:`HOST_POOL_SHARE` of ``avail`` less
    ``load_bytes`` (what the model load will still take of it; 0 once loaded)."""
    return int(HOST_POOL_SHARE * max(0, avail - load_bytes))
