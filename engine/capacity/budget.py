"""Size the KV cache for a per-device memory budget (``memory_budget_gb``).

The planner (:mod:`engine.capacity.planner`) answers "how many jobs fit" from shapes alone; this
module turns the same arithmetic into the sizes :class:`engine.kv.cache.KVCache` is built
with, so ``hisparse run --memory-budget`` and ``hisparse bench`` hold the same budget:

    room = budget - weights - activations - communication - reserve

* weights: the bytes of the placed model (:attr:`engine.model.llama.LlamaModel.weight_bytes`);
* activations: :func:`engine.capacity.planner.activation_bytes` for ``max_batch`` decode rows and
  the layer-by-layer prefill of one ``context_limit``-token prompt;
* communication: pipeline stages only, :func:`engine.capacity.planner.stage_comm_bytes`;
* reserve: :func:`engine.capacity.planner.device_reserve_bytes` (max(5 %, 1 GiB) on CUDA,
  5 % on a CPU).

A pipeline stage (:func:`stage_sizing`) holds only its layers ``L_d``: its weights, the
KV, page metadata and slabs of those layers, the logits only on the last stage, plus
the hand-off buffers; this is the planner's table for that stage
(:func:`engine.capacity.planner.device_tables`). Every stage must build the same page and slab
counts, so the stages take the smallest of their sizings (:func:`common_sizing`).

All-resident (``attention=dense`` or ``hierarchical=False``): the KV pool lives on the
device, so it gets ``room // (page + page metadata)`` pages and admission stops when they
run out (the capacity wall). Hierarchical: the pool is in host memory
(``host_pool_gb``); the device holds its page metadata plus, per admitted request, one
slab of ``device_buffer`` slots per (layer, KV head) with its page table and LRU state,
so ``max_batch`` becomes ``(room - metadata) // per-request bytes`` (capped at the
configured ``max_batch``).

The dense attention reference (``kernels.sparse_attention.dense_decode_attention_ref``)
materialises each layer's gathered K/V while it runs; that transient is not budgeted
(a paged dense kernel would not need it), so a dense run's measured peak can exceed
the budget by about two layers' worth of the batch's KV.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from engine.capacity.planner import (
    activation_bytes,
    device_reserve_bytes,
    largest_buffer,
    smallest_budget_gb,
    stage_comm_bytes,
)
from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.kv.sizing import (  # noqa: F401 - re-exported for the bench and scripts
    GIB,
    LRU_BYTES_PER_SLOT,
    PAGE_TABLE_ENTRY_BYTES,
    cache_device_bytes,
    default_pool_pages,
    hierarchical,
    meta_page_bytes,
    per_request_device_bytes,
    pool_page_bytes,
    record_bytes,
    shared_device_bytes,
)


@dataclass(frozen=True)
class KVSizing:
    """How a budget was split; every figure in bytes except the counts.

    ``num_pool_pages`` and ``max_batch`` are what the cache is built with;
    ``device_kv_bytes`` is what that cache allocates on the device (pool when
    all-resident, page metadata, hot buffer, page tables and LRU state).
    ``layers`` is a pipeline stage's ``[start, end)`` (``None``: the whole model), and
    ``page_bytes`` / ``meta_page_bytes`` / ``per_request_device_bytes`` are for those
    layers; ``comm_bytes`` is the stage's hand-off buffers (0 outside a pipeline).
    """

    budget_bytes: int
    weights_bytes: int
    activation_bytes: int
    reserve_bytes: int
    room_bytes: int
    pool_on_device: bool
    num_pool_pages: int
    max_batch: int
    device_kv_bytes: int
    page_bytes: int
    meta_page_bytes: int
    per_request_device_bytes: int
    comm_bytes: int = 0
    layers: tuple[int, int] | None = None

    def max_jobs(self, pages_per_job: int) -> int:
        """Requests of ``pages_per_job`` pages that fit at once (pool and slabs)."""
        by_pool = self.num_pool_pages // max(pages_per_job, 1)
        return by_pool if self.pool_on_device else min(by_pool, self.max_batch)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)














def size_kv_for_budget(
    model: ModelConfig,
    config: EngineConfig,
    weights_bytes: int,
    context_limit: int,
    num_pool_pages: int | None = None,
    *,
    layers: tuple[int, int] | None = None,
    comm_bytes: int = 0,
    pool_shares: int = 1,
) -> KVSizing:
    """Split ``config.memory_budget_gb`` between the fixed parts and the KV cache.

    Parameters
    ----------
    model, config : shape and settings (``memory_budget_gb`` must be set)
    weights_bytes : bytes of the weights on the device
    context_limit : most tokens per request (sizes page tables and the prefill scratch)
    num_pool_pages : hierarchical only: host pool pages (default from ``host_pool_gb``,
        whole-model pages, as :class:`engine.kv.cache.KVCache` counts them)
    layers : ``[start, end)`` of the layers on this device (a pipeline stage); default
        all. Metadata, slabs and the device pool count these layers only; the logits
        scratch counts only when the stage holds the last layer.
    comm_bytes : pipeline hand-off buffers on this device (bytes)
    pool_shares : how many data-parallel workers split the user's ``host_pool_gb``;
        ``config.host_pool_gb`` is this worker's share. A refusal speaks in the user's
        setting (the total, and that it is split) and its ``--host-pool`` is the total.

    Returns
    -------
    KVSizing

    Raises
    ------
    ConfigError
        No budget set, or not even one page (all-resident) / one request (hierarchical)
        fits after weights, activations and reserve; the message gives the figures and
        the changes that fit one request of ``context_limit`` tokens, each checked with
        this arithmetic (the smallest budget; hierarchical: a smaller host pool, a smaller
        hot buffer, where they make room: :func:`_one_request_fixes`).
    """
    if config.memory_budget_gb is None:
        raise ConfigError("size_kv_for_budget needs memory_budget_gb")
    budget = int(config.memory_budget_gb * GIB)
    start, end = layers if layers is not None else (0, model.num_layers)
    nl = end - start
    head = end == model.num_layers
    act = activation_bytes(model, config, context_limit, config.max_batch, head=head)
    reserve = device_reserve_bytes(budget, config.device)
    room = budget - weights_bytes - act - comm_bytes - reserve
    page, meta = pool_page_bytes(model, config, nl), meta_page_bytes(model, config, nl)
    max_pages = -(-context_limit // config.page_size)
    comm = f" + communication {comm_bytes / GIB:.2f} GiB" if comm_bytes else ""
    fixed = (
        f"weights {weights_bytes / GIB:.2f} GiB + activations {act / GIB:.2f} GiB{comm} + "
        f"reserve {reserve / GIB:.2f} GiB"
    )
    stage = {"comm_bytes": comm_bytes, "layers": (start, end) if layers is not None else None}
    if not hierarchical(config):
        pages = max(room, 0) // (page + meta)
        if pages < 1:
            one_request = budget_for_pages(
                model, config, weights_bytes, context_limit, max_pages, layers=layers,
                comm_bytes=comm_bytes,
            )  # fmt: skip
            raise ConfigError(
                f"memory_budget_gb={config.memory_budget_gb}: {fixed} leave no room for a KV "
                f"page; what fits one {context_limit}-token request: memory_budget_gb "
                f"{one_request:g} (--memory-budget {one_request:g})"
            )
        return KVSizing(
            budget,
            weights_bytes,
            act,
            reserve,
            room,
            True,
            pages,
            config.max_batch,
            cache_device_bytes(model, config, pages, max_pages, nl),
            page,
            meta,
            0,
            **stage,
        )
    pages = num_pool_pages if num_pool_pages is not None else default_pool_pages(model, config)
    per_req = per_request_device_bytes(model, config, max_pages, nl)
    shared = shared_device_bytes(model, config, pages, nl)
    batch = min(config.max_batch, max(room - shared, 0) // per_req)
    if batch < 1:
        fixes = _one_request_fixes(
            model, config, weights_bytes + act + comm_bytes, room, pages, max_pages, nl,
            pool_shares,
        )  # fmt: skip
        split = (
            f" (host_pool_gb {config.host_pool_gb * pool_shares:g} split across "
            f"{pool_shares} devices: {config.host_pool_gb:g} on this one)"
            if pool_shares > 1
            else ""
        )
        raise ConfigError(
            f"memory_budget_gb={config.memory_budget_gb}: {fixed} + page metadata of "
            f"{pages} host pool pages{split} {pages * meta / GIB:.2f} GiB leave no room for "
            f"the hot buffer of one request ({per_req / 2**20:.1f} MiB); what fits one "
            f"{context_limit}-token request: " + "; or ".join(fixes)
        )
    sized = config.replace(max_batch=batch)
    return KVSizing(
        budget,
        weights_bytes,
        act,
        reserve,
        room,
        False,
        pages,
        batch,
        cache_device_bytes(model, sized, pages, max_pages, nl),
        page,
        meta,
        per_req,
        **stage,
    )


def budget_for_pages(
    model: ModelConfig,
    config: EngineConfig,
    weights_bytes: int,
    context_limit: int,
    num_pages: int,
    *,
    layers: tuple[int, int] | None = None,
    comm_bytes: int = 0,
) -> float:
    """The smallest ``memory_budget_gb`` (0.01 GiB steps) whose all-resident pool holds
    ``num_pages`` pages: :func:`size_kv_for_budget`'s arithmetic (same parameters) run
    backwards, so that budget sizes at least that pool."""
    start, end = layers if layers is not None else (0, model.num_layers)
    nl, head = end - start, end == model.num_layers
    act = activation_bytes(model, config, context_limit, config.max_batch, head=head)
    page = pool_page_bytes(model, config, nl) + meta_page_bytes(model, config, nl)
    return smallest_budget_gb(weights_bytes + act + comm_bytes + num_pages * page, config.device)


def _one_request_fixes(
    model: ModelConfig,
    config: EngineConfig,
    fixed_bytes: int,
    room: int,
    pages: int,
    max_pages: int,
    nl: int,
    pool_shares: int = 1,
) -> list[str]:
    """The changes with which a hierarchical cache of ``config`` fits one request of
    ``max_pages`` pages, each checked with the sizing's arithmetic: the smallest budget
    (always); a host pool whose page metadata leaves room for the request's hot buffer
    while it still holds the request's pages; a hot buffer small enough for the room the
    metadata leaves (``top_k`` at most half of it); failing both, the two together (the
    smallest pool that holds the request, the largest buffer beside it). A pool of fewer
    than ``max_pages`` pages holds no request whatever the device has, so there each
    change comes with the pool raised to the smallest that does.
    ``fixed_bytes``: weights, activations and communication; ``room``: the budget less
    those and the reserve. ``pool_shares``: as :func:`size_kv_for_budget`'s; the host
    pools named are the totals the user sets, each device's share said beside them."""
    per_req = per_request_device_bytes(model, config, max_pages, nl)
    least = pool_gb_holding(model, config, max_pages, 2 * max_pages, False, pool_shares)
    raised = pages < max_pages and least is not None  # the pool must grow first
    if raised:
        pages = least[1]
    shared = shared_device_bytes(model, config, pages, nl)

    def fix(what: str, flags: str) -> str:
        if raised:
            what += f" with host_pool_gb {least[0]:g}{each(least[0])} for one request's "
            what += f"{max_pages} pages"
            flags += f" --host-pool {least[0]:g}"
        return f"{what} ({flags})"

    def each(total_gb: float) -> str:  # the data-parallel devices' shares, where split
        if pool_shares == 1:
            return ""
        return f" split across {pool_shares} devices ({total_gb / pool_shares:g} each)"

    gb = smallest_budget_gb(fixed_bytes + shared + per_req, config.device)
    fixes = [fix(f"memory_budget_gb {gb:g}", f"--memory-budget {gb:g}")]
    pool = None
    if not raised:
        most = max_pool_pages(model, config, room - per_req, nl)
        pool = pool_gb_holding(model, config, max_pages, most, True, pool_shares)
        if pool is not None:
            its = f"its {pool[1]} pages"
            if pool_shares > 1:
                its = f"{each(pool[0]).lstrip()}, whose {pool[1]} pages"
            fixes.append(
                f"host_pool_gb {pool[0]:g} (--host-pool {pool[0]:g}; {its} hold one "
                f"request's {max_pages})"
            )
    buffer = _buffer_fitting(model, config, room - shared, max_pages, nl)
    if buffer is not None:
        fixes.append(fix(*buffer))
    elif pool is None and not raised and least is not None and least[1] < pages:
        left = room - shared_device_bytes(model, config, least[1], nl)
        both = _buffer_fitting(model, config, left, max_pages, nl)
        if both is not None:
            what, flags = both
            fixes.append(
                f"{what} with host_pool_gb {least[0]:g}{each(least[0])} "
                f"({flags} --host-pool {least[0]:g})"
            )
    return fixes


def pool_gb_holding(
    model: ModelConfig,
    config: EngineConfig,
    least: int,
    most: int,
    down: bool,
    shares: int = 1,
) -> tuple[float, int] | None:
    """A ``host_pool_gb`` of few digits (``(gb, pages)``) whose pool holds between ``least``
    and ``most`` pages (:func:`engine.kv.sizing.default_pool_pages`), rounded down from
    ``most`` pages (``down``) or up from ``least``; ``None`` when none does. With
    ``shares`` data-parallel workers ``gb`` is the total they split and ``pages`` one
    worker's (of ``gb / shares``)."""
    if most < least or least < 1:
        return None
    page_bytes = pool_page_bytes(model, config)  # host_pool_gb counts whole-model pages
    target = (most if down else least) * page_bytes / GIB * shares
    for digits in (2, 3, 4, 5, 6):
        scale = 10**digits
        gb = (math.floor(target * scale) if down else math.ceil(target * scale)) / scale
        if gb <= 0:
            continue
        held = default_pool_pages(model, config.replace(host_pool_gb=gb / shares))
        if least <= held <= most:
            return gb, held
    return None


def _buffer_fitting(
    model: ModelConfig, config: EngineConfig, room: int, max_pages: int, nl: int
) -> tuple[str, str] | None:
    """The largest hot buffer (:func:`engine.capacity.planner.largest_buffer`) whose slabs
    for one request of ``max_pages`` pages fit in ``room`` bytes, as (settings, flags);
    ``None`` when none does."""
    if room <= 0:
        return None
    smaller = largest_buffer(
        config, lambda cfg: per_request_device_bytes(model, cfg, max_pages, nl) <= room
    )
    if smaller is None:
        return None
    what = f"device_buffer {smaller.device_buffer_tokens}"
    flags = f"--device-buffer {smaller.device_buffer_tokens}"
    if smaller.top_k != config.top_k:
        what += f", top_k {smaller.top_k}"
        flags += f" --top-k-tokens {smaller.top_k}"
    return what, flags


def max_pool_pages(model: ModelConfig, config: EngineConfig, room: int, nl: int) -> int:
    """The most host pool pages whose device-side share (:func:`shared_device_bytes`:
    their page metadata, superpages and staging rows over ``nl`` layers) fits in
    ``room`` bytes; 0 when not even one does."""
    if shared_device_bytes(model, config, 1, nl) > room:
        return 0
    lo, hi = 1, 2
    while shared_device_bytes(model, config, hi, nl) <= room:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if shared_device_bytes(model, config, mid, nl) <= room:
            lo = mid
        else:
            hi = mid
    return lo


def stage_sizing(
    model: ModelConfig,
    config: EngineConfig,
    weights_bytes: int,
    context_limit: int,
    layers: tuple[int, int],
) -> KVSizing:
    """:func:`size_kv_for_budget` for one pipeline stage holding ``layers`` (``[start,
    end)``): its layers' KV, metadata and slabs, logits only on the last stage, and the
    hand-off buffers :func:`engine.capacity.planner.stage_comm_bytes` for ``max_batch`` rows, as the
    planner's table for that stage counts them.

    Raises
    ------
    ConfigError
        The budget leaves this stage no room (message as :func:`size_kv_for_budget`).
    """
    comm = stage_comm_bytes(model, config, config.max_batch)
    return size_kv_for_budget(
        model, config, weights_bytes, context_limit, layers=layers, comm_bytes=comm
    )


def common_sizing(
    sizing: KVSizing,
    everyone: list[KVSizing],
    model: ModelConfig,
    config: EngineConfig,
    context_limit: int,
) -> KVSizing:
    """``sizing`` (this stage's) limited to the smallest pool pages and ``max_batch`` of
    ``everyone`` (every stage's, this one included), so all stages build caches with the
    same page and slab ids; ``device_kv_bytes`` is recomputed for the smaller sizes."""
    pages = min(s.num_pool_pages for s in everyone)
    batch = min(s.max_batch for s in everyone)
    start, end = sizing.layers if sizing.layers is not None else (0, model.num_layers)
    max_pages = -(-context_limit // config.page_size)
    device_kv = cache_device_bytes(
        model, config.replace(max_batch=batch), pages, max_pages, end - start
    )
    return dataclasses.replace(
        sizing, num_pool_pages=pages, max_batch=batch, device_kv_bytes=device_kv
    )


def budget_cache(
    model,
    config: EngineConfig,
    context_limit: int,
    num_pool_pages: int | None = None,
    sizing: KVSizing | None = None,
    pool_shares: int = 1,
):
    """Build the budget-sized cache for a placed model.

    Parameters
    ----------
    model : :class:`engine.model.llama.LlamaModel` (its ``config``, ``device``, ``weight_bytes``,
        ``layer_range``: a pipeline stage's cache holds only those layers)
    config : settings with ``memory_budget_gb``
    context_limit : most tokens per request
    num_pool_pages : hierarchical host pool pages (default from ``host_pool_gb``)
    sizing : a sizing already computed (a pipeline stage's, from :func:`stage_sizing` and
        :func:`common_sizing`); default :func:`size_kv_for_budget` for the whole model
    pool_shares : data-parallel workers splitting ``host_pool_gb`` (:func:`size_kv_for_budget`)

    Returns
    -------
    (config with the sized ``max_batch``, :class:`engine.kv.cache.KVCache`, :class:`KVSizing`)

    Raises
    ------
    ConfigError
        The budget leaves no room (see :func:`size_kv_for_budget`).
    """
    from engine.kv.cache import KVCache

    if sizing is None:
        sizing = size_kv_for_budget(
            model.config, config, model.weight_bytes, context_limit, num_pool_pages,
            pool_shares=pool_shares,
        )  # fmt: skip
    sized = config.replace(max_batch=sizing.max_batch)
    max_pages = -(-context_limit // config.page_size)
    layers = getattr(model, "layer_range", None)
    extra = {"layers": layers} if layers is not None else {}
    cache = KVCache(
        model.config, sized, model.device, max_pages, num_pool_pages=sizing.num_pool_pages, **extra
    )
    return sized, cache, sizing


