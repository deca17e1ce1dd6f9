"""Per-job fidelity audit (``EngineConfig.audit_steps``, ``hisparse run --audit N``).

For ``N`` decode steps of each job, chosen by :func:`audit_schedule`, the engine also
computes what dense attention would have given at that step and compares:

* **top-1 agreement** — the argmax of the sparse step's logits equals the dense one's;
* **KL(dense || sparse)** of the two next-token distributions (softmax of the float32
  logits at temperature 1, in nats);
* **mass kept** — per layer and query head, the share of the attention mass that the
  sparse step's query puts on its context (exact softmax over every key) which lies in
  the pages its selection read; averaged over layers and heads.

The dense forward is *teacher-forced on the sparse run's cache*: its queries and this
step's key/value come from a dense chain of hidden states through every layer, but the
keys and values of the earlier positions are the ones in the KV pool, written by the
sparse run (prefill is dense in both). It measures this step's selection error, not the
drift of a whole dense generation. It only reads the pool, after the step's writes have
landed, so the sparse decode — its tokens, hot-buffer slots, page tables and LRU stamps —
is the same with and without the audit.

How an audited step runs (:class:`Auditor`, driven by :class:`engine.serve.engine.Engine`):

1. **The sparse step as usual** — on CUDA a replay of its captured graph. With
   ``audit_steps`` on, every decode step keeps a reference to each layer's query and
   selection (:attr:`engine.decode.attention.DecodeAttention.capture`); inside a CUDA
   graph that pins their memory in the graph's pool, so each replay leaves its values
   there (no extra kernel, same kernels as without the audit).
2. **Snapshot** (:func:`snapshot`, compute stream, before the next step may overwrite
   those buffers): the audited rows' queries ``[L, R, Hq, D]``, selections, sparse
   logits and fed tokens — a handful of small copies.
3. **One dense pass for all audited rows** (:func:`dense_pass`): per layer the rows'
   records are gathered into one device buffer (``ops.gather``, the decode's miss
   loader: on CUDA it reads the pinned host pool through unified addressing), the mass
   kept is taken from it with the sparse queries
   (:func:`kernels.oracle_scores.oracle_scores_ref`, before the dense chain's own
   key/value overwrite this step's position), and the dense chain attends with the
   engine's ``dense_decode_attention``. Agreement and KL (:func:`compare_rows`) and the
   mass are left on the device as one ``[3, R]`` tensor. The pass is device work of
   fixed shapes (rows, block-table width bucket): on CUDA it is captured once per shape
   and replayed (:class:`Auditor`), some 2,000 kernel launches in one.
4. **Overlap** — on CUDA the pass runs on a side stream after the step; the next decode
   steps go on meanwhile. Its figures come back through pinned memory and an event;
   the engine reports them once they have landed (:meth:`Auditor.retire`) and waits for
   them before a job's result is written. A job's pages are never released while a pass
   reading them is in flight (:meth:`Auditor.wait_seq`). ``seconds``: on CUDA the
   device span of the pass on its stream (first to last kernel, waits for the host's
   launches included), split evenly among its rows; on the CPU the host time.

The per-row functions :func:`dense_step_logits` and :func:`mass_kept` are the plain
reference of the same figures (the tests' oracle for the batched pass). Both apply the
model's attention soft-cap and sliding window (Gemma), as a dense engine's step does;
until 2026-12-02 the audit's dense chain left them out.

Torch is imported on first use (:func:`audit_schedule` serves the CLI's test engine).
"""

from __future__ import annotations

import random
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.events import AuditStats, AuditStep

if TYPE_CHECKING:
    import torch


def audit_schedule(job_id: str, max_tokens: int, steps: int, seed: int) -> frozenset[int]:
    """The decode steps of job ``job_id`` to audit: at most ``steps`` indices in
    ``1 .. max_tokens - 1`` (decode step ``i`` feeds generated token ``i - 1`` and samples
    token ``i``; token 0 comes from prefill). The range is split into ``steps`` equal
    strata and one index is drawn in each with :class:`random.Random` seeded by
    ``(seed, job_id)``: spread over the decode, the same on every run. A job that stops
    early audits only the steps it reached."""
    span = max_tokens - 1
    n = min(steps, span)
    if n <= 0:
        return frozenset()
    rng = random.Random(f"{seed}:{job_id}")
    edges = [1 + (i * span) // n for i in range(n + 1)]
    return frozenset(rng.randrange(edges[i], edges[i + 1]) for i in range(n))


@dataclass
class AuditTally:
    """Running sums of one job's audited steps (see :class:`engine.events.AuditStats`)."""

    steps: int = 0
    agree: int = 0
    kl_sum: float = 0.0
    kl_max: float = 0.0
    mass_sum: float = 0.0
    seconds: float = 0.0

    def add(self, agree: bool, kl: float, mass: float) -> None:
        self.steps += 1
        self.agree += int(agree)
        self.kl_sum += kl
        self.kl_max = max(self.kl_max, kl)
        self.mass_sum += mass

    def stats(self) -> AuditStats:
        n = self.steps
        return AuditStats(
            steps=n,
            top1_agreement=self.agree / n if n else 1.0,
            kl_mean=self.kl_sum / n if n else 0.0,
            kl_max=self.kl_max,
            mass_kept_mean=self.mass_sum / n if n else 1.0,
            seconds=self.seconds,
        )


def context_kv(
    cache, seq_id: int, layer: int, num_tokens: int, device, dtype, values: bool = True
):
    """Keys and values of positions ``0 .. num_tokens - 1`` of ``seq_id`` in cache layer
    ``layer``, read from the KV pool: ``k, v [num_tokens, Hkv, D]`` in ``dtype`` on
    ``device`` (``v`` is ``None`` when not ``values``). Pool layout ``[P_pool, Hkv, 2, S,
    D]`` (:mod:`engine.kv.cache`); fp8 records (``kv_host_dtype=fp8``) are dequantised with
    their scale exponents (:func:`kernels.fp8_kv.fp8_dequantize_ref`), as the gather does.

    A host pool read for a CUDA ``device`` is copied run by run of consecutive pages
    (each inside one pinned chunk: :func:`engine.kv.cache.page_runs`), asynchronously on
    the current stream — not gathered on the host and copied from pageable memory, which
    cost ~80 ms per audited step of a 3K-token job on an H200 (2026-12-01)."""
    import torch

    from engine.kv.cache import page_runs
    from kernels.fp8_kv import FP8, fp8_dequantize_ref

    s = cache.page_size
    pages = cache.seqs[seq_id].pages[: -(-num_tokens // s)]
    pool = cache.pool[layer]
    scales = cache.host.scales[layer] if pool.dtype == FP8 else None
    device = torch.device(device)
    if pool.device.type == "cpu" and device.type == "cuda":
        runs = page_runs(pages, cache.copy_chunk_pages)

        def read(t):
            parts = [t[first : first + n].to(device, non_blocking=True) for _, first, n in runs]
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        rec = read(pool)
        sc = read(scales) if scales is not None else None
    else:
        index = torch.tensor(pages, dtype=torch.long, device=pool.device)
        rec = pool[index].to(device)
        sc = scales[index].to(device) if scales is not None else None
    rec = fp8_dequantize_ref(rec, sc, dtype) if sc is not None else rec.to(dtype)
    p, hkv, _, _, d = rec.shape  # [P, Hkv, 2, S, D]
    k = rec[:, :, 0].permute(0, 2, 1, 3).reshape(p * s, hkv, d)[:num_tokens]
    if not values:
        return k, None
    v = rec[:, :, 1].permute(0, 2, 1, 3).reshape(p * s, hkv, d)[:num_tokens]
    return k, v


def dense_step_logits(model, cache, seq_id: int, token: int, position: int) -> torch.Tensor:
    """float32 ``[V]``: the next-token logits of feeding ``token`` at ``position`` with
    dense attention in every layer over the job's pool records of positions
    ``0 .. position - 1`` plus the dense chain's own key/value at ``position`` (causal
    SDPA with the model's scale, soft-cap and window,
    :func:`engine.model.llama.prefill_attention`). Needs the whole model in this engine
    (no pipeline stage). The plain per-row reference of :func:`dense_pass`."""
    import torch

    from engine.model.llama import prefill_attention

    with torch.inference_mode():
        return _dense_chain(model, cache, seq_id, token, position, prefill_attention)


def _dense_chain(model, cache, seq_id, token, position, prefill_attention):
    import torch

    h = model.embed_tokens(torch.tensor([token], dtype=torch.long))
    pos = torch.tensor([position], dtype=torch.long, device=model.device)
    for layer in model.layer_range:
        q, k, v = model.qkv(layer, h, pos)
        kc, vc = context_kv(
            cache, seq_id, layer - cache.layer_offset, position, model.device, k.dtype
        )
        a = prefill_attention(
            q, torch.cat([kc, k]), torch.cat([vc, v]), position, model.scale,
            model.attn_softcap, model.attn_window(layer),
        )  # fmt: skip
        h = model.finish_layer(layer, h, a)
    return model.logits(h)[0]


def mass_kept(
    cache, seq_id: int, captured: dict[int, tuple[torch.Tensor, torch.Tensor]],
    num_tokens: int, scale: float,
) -> float:
    """Mean over layers and query heads of the exact attention mass inside the selected
    pages. ``captured``: cache layer -> (the sparse step's query ``[Hq, D]``, its
    selection bitmask int32 ``[Hkv, W]``); ``num_tokens`` counts the context including
    this step's token (already in the pool). A step with nothing captured (``dense``
    indexer or attention: every page read) keeps 1.0."""
    if not captured:
        return 1.0
    import torch

    from kernels.bitmask import unpack_bits

    with torch.inference_mode():
        return _mass_kept(cache, seq_id, captured, num_tokens, scale, unpack_bits)


def _mass_kept(cache, seq_id, captured, num_tokens, scale, unpack_bits) -> float:
    import torch

    s = cache.page_size
    total, n = 0.0, 0  # summed on the device: one host sync per step, not per layer
    for layer, (q, sel) in captured.items():
        k, _ = context_kv(cache, seq_id, layer, num_tokens, q.device, torch.float32, False)
        hq, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        logits = torch.einsum("hgd,thd->hgt", q.float().view(hkv, g, d), k) * scale
        prob = torch.softmax(logits, dim=-1)  # [Hkv, G, T]
        p = -(-num_tokens // s)
        page_of = torch.arange(num_tokens, device=q.device) // s
        chosen = unpack_bits(sel, p)[:, page_of]  # [Hkv, T]
        kept = (prob * chosen[:, None, :]).sum(-1)  # [Hkv, G]
        total = total + kept.sum()
        n += hq
    return float(total) / n


def compare(sparse_logits: torch.Tensor, dense_logits: torch.Tensor) -> tuple[bool, float]:
    """(top-1 agreement, KL(dense || sparse) in nats) of two float32 ``[V]`` logits."""
    agree, kl = compare_rows(sparse_logits[None], dense_logits[None])
    return bool(agree[0]), float(kl[0])


def compare_rows(sparse: torch.Tensor, dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``sparse, dense [R, V]`` logits: whether their argmax agrees (bool
    ``[R]``) and KL(dense || sparse) of their softmax at temperature 1 (float32 ``[R]``,
    nats, clamped at 0), on the logits' device (no host sync)."""
    import torch

    ls = torch.log_softmax(sparse.float(), -1)
    ld = torch.log_softmax(dense.float(), -1)
    kl = (ld.exp() * (ld - ls)).sum(-1).clamp(min=0.0)
    return sparse.argmax(-1) == dense.argmax(-1), kl


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor on ``device`` without a host sync: through pinned memory and
    an asynchronous copy on CUDA (a plain ``.to`` from pageable memory waits for the
    stream, i.e. for the decode step queued before it)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class Captured:
    """The sparse step's per-layer inputs of the audited rows (:func:`snapshot`):
    ``layers`` the cache layers captured (``L`` of them, ascending), ``q [L, R, Hq, D]``
    the queries after RoPE, ``selection`` int32 ``[L, R, Hkv, W]`` the bitmasks read."""

    layers: list[int]
    q: torch.Tensor
    selection: torch.Tensor


def snapshot(entries: list, rows: list[int]) -> Captured | None:
    """Copy rows ``rows`` of a step's captured queries and selections out of the step's
    buffers. ``entries``: ``(cache layer, row0, q [b, Hq, D], selection [b, Hkv, W])``
    as :meth:`engine.decode.attention.DecodeAttention.run` appended them (two chunks per
    layer, ``row0`` apart, when the batch ran as two micro-batches). ``None`` when
    nothing was captured (dense attention). A few kernels in all, on the current stream."""
    if not entries:
        return None
    import torch

    layers = sorted({e[0] for e in entries})
    starts = sorted({e[1] for e in entries})
    by = {(e[0], e[1]): e[2:] for e in entries}
    index = to_device(torch.tensor(rows, dtype=torch.long), entries[0][2].device)

    def rows_of(i: int) -> torch.Tensor:
        parts = [torch.stack([by[(layer, r0)][i] for layer in layers]) for r0 in starts]
        whole = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return whole.index_select(1, index)

    return Captured(layers, rows_of(0), rows_of(1))


def stage_plan(lens: torch.Tensor, width: int, num_kv_heads: int, page_size: int):
    """Where :func:`dense_pass` stages the records of ``R`` rows, all on the device from
    ``lens`` (int32 ``[R]``, context lengths) and static shapes only:

    * ``load_pages``, ``load_slots`` int32 ``[R, Hkv, W]``: the gather's load list
      (:func:`kernels.gather.gather_ref`) — request page ``p < ceil(len / S)`` of row
      ``r`` and KV head ``h`` to staging slot ``(r * W + p) * Hkv + h``, -1 past the
      context — so the staging buffer ``[R * W * Hkv, 2, S, D]`` viewed as a pool
      ``[R * W, Hkv, 2, S, D]`` holds row ``r``'s page ``p`` at page ``r * W + p``;
    * ``table`` int32 ``[R, W]``: that staged page of each row's page;
    * ``last_page``, ``last_row`` int64 ``[R]``: the staged page and its row holding each
      row's last position (``len - 1``).
    """
    import torch

    dev = lens.device
    r, hkv, s = lens.shape[0], num_kv_heads, page_size
    lens64 = lens.long()
    pages = torch.arange(width, device=dev)
    rows = torch.arange(r, device=dev)
    valid = (pages[None, :] < torch.div(lens64 + (s - 1), s, rounding_mode="floor")[:, None])
    table = rows[:, None] * width + pages[None, :]  # [R, W]
    slots = table[:, None, :] * hkv + torch.arange(hkv, device=dev)[None, :, None]
    load_pages = torch.where(valid, pages[None, :], -1)[:, None, :].expand(r, hkv, width)
    load_slots = torch.where(valid[:, None, :], slots, -1)
    last = lens64 - 1
    return (
        load_pages.to(torch.int32).contiguous(),
        load_slots.to(torch.int32).contiguous(),
        table.to(torch.int32),
        rows * width + torch.div(last, s, rounding_mode="floor"),
        last % s,
    )


def dense_pass(
    model,
    cache,
    ops,
    tokens: torch.Tensor,
    lens: torch.Tensor,
    block_table: torch.Tensor,
    captured: Captured | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The audit's dense forward of ``R`` rows at once and their mass kept; device work
    only, shapes fixed by the inputs' (no host sync: a CUDA graph can capture it).

    Parameters
    ----------
    model : the engine's whole model; cache : its KV hierarchy; ops : its kernel set;
    tokens : int64 ``[R]`` the token each row fed; lens : int32 ``[R]`` each row's
    context length including that token (its K/V already in the pool); block_table :
    int32 ``[R, W]`` each row's pool pages (-1 past them; ``W`` at least its pages);
    captured : the sparse step's queries and selections of these rows
    (:func:`snapshot`), ``None`` when nothing was selected (mass kept 1). All on the
    model's device.

    Returns
    -------
    (float32 ``[R, V]`` dense next-token logits, float32 ``[R]`` mass kept: the mean over
    the captured layers and query heads of the exact softmax mass of the sparse query
    over the whole context that lies in the selected pages), on the model's device.

    Per layer: gather the rows' records into one staging buffer (``ops.gather``, as the
    decode's misses: from the pinned host pool through unified addressing on CUDA; fp8
    records dequantised; :func:`stage_plan`), take the mass kept from it
    (``ops.oracle_scores`` with the sparse queries), overwrite each row's last position
    with the dense chain's own key/value, then ``ops.dense_decode_attention`` (the dense
    engine's attention, the model's soft-cap and sliding window included). Equal to
    :func:`dense_step_logits` and :func:`mass_kept` of each row within rounding.
    """
    import torch

    from kernels.bitmask import unpack_bits

    dev = model.device
    r, width = block_table.shape
    hkv, s, d = cache.model.num_kv_heads, cache.page_size, cache.model.head_dim
    load_pages, load_slots, table, last_page, last_row = stage_plan(lens, width, hkv, s)
    staging = torch.zeros(r * width * hkv, 2, s, d, dtype=cache.dtype, device=dev)
    records = staging.view(r * width, hkv, 2, s, d)
    # Rows of staging.view(-1, D) holding each row's last position: (page, head, k|v, row).
    heads = torch.arange(hkv, device=dev).view(1, hkv, 1)
    halves = torch.arange(2, device=dev).view(1, 1, 2)
    put = (((last_page.view(r, 1, 1) * hkv + heads) * 2 + halves) * s + last_row.view(r, 1, 1))
    put = put.flatten()  # [R * Hkv * 2]
    layer_of = {c: i for i, c in enumerate(captured.layers)} if captured is not None else {}
    kept = torch.zeros(r, dtype=torch.float32, device=dev)
    positions = lens.long() - 1
    h = model.embed_tokens(tokens)
    for layer in model.layer_range:
        local = layer - cache.layer_offset
        q, k, v = model.qkv(layer, h, positions)
        scale = {"pool_scale": cache.pool_scale[local]} if cache.host_fp8 else {}
        ops.gather(cache.pool[local], staging, block_table, load_pages, load_slots, **scale)
        i = layer_of.get(local)
        if i is not None:  # pages past the selection's words are past every context
            mass = ops.oracle_scores(captured.q[i], records, table, lens, model.scale)
            n = min(width, 32 * captured.selection.shape[-1])
            chosen = unpack_bits(captured.selection[i], n)
            kept += (mass[..., :n].clamp(min=0) * chosen).sum((1, 2))
        kv = torch.stack([k, v], dim=2).reshape(-1, d)  # [R * Hkv * 2, D]
        staging.view(-1, d).index_copy_(0, put, kv.to(staging.dtype))
        a = ops.dense_decode_attention(
            q, records.to(q.dtype), table, lens, model.scale, model.attn_softcap,
            model.attn_window(layer),
        )  # fmt: skip
        h = model.finish_layer(layer, h, a)
    if captured is None:
        kept.fill_(1.0)
    else:
        kept /= len(captured.layers) * captured.q.shape[2]
    return model.logits(h), kept


STAGING_BYTES = 256 << 20
"""Records staged per layer by one :func:`dense_pass` (bytes): rows beyond it go to
another pass of the same step (a row alone may exceed it)."""


def row_groups(row_bytes: list[int], limit: int) -> list[list[int]]:
    """Consecutive row indices grouped so that each group's ``row_bytes`` sum to at most
    ``limit`` (a row larger than ``limit`` forms a group of its own)."""
    groups: list[list[int]] = []
    total = 0
    for i, b in enumerate(row_bytes):
        if not groups or total + b > limit:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += b
    return groups


@dataclass
class AuditPass:
    """One step's audited rows, maybe still running (:meth:`Auditor.submit`).

    ``figures`` float32 ``[3, R]`` (host; pinned and filled asynchronously on CUDA):
    agreement (0/1), KL and mass kept per row. ``done`` is recorded after the copy that
    fills it (``None``: already filled); ``start`` opens the pass on its stream.
    ``keep`` holds the device tensors the pass reads until it has finished. ``owners``:
    seq id -> the engine's request, set when the step is read (rows of requests that
    closed before are left out)."""

    seq_ids: list[int]
    job_ids: list[str]
    steps: list[int]
    figures: torch.Tensor
    done: torch.cuda.Event | None
    start: torch.cuda.Event | None
    host_seconds: float
    keep: tuple = ()
    owners: dict | None = None

    def ready(self) -> bool:
        return self.done is None or self.done.query()

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()
        self.keep = ()

    @property
    def seconds(self) -> float:
        """The pass's time (see the module's step 4); valid once :meth:`ready`."""
        if self.done is None or self.start is None:
            return self.host_seconds
        return self.start.elapsed_time(self.done) / 1000.0


@dataclass
class _PassGraph:
    """A captured :func:`dense_pass` of one shape: its static inputs and output."""

    tokens: torch.Tensor  # int64 [R]
    lens: torch.Tensor  # int32 [R]
    table: torch.Tensor  # int32 [R, W]
    logits: torch.Tensor  # float32 [R, V], the sparse step's
    q: torch.Tensor | None  # [L, R, Hq, D]
    selection: torch.Tensor | None  # int32 [L, R, Hkv, Wsel]
    layers: list[int]
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None  # float32 [3, R]


class Auditor:
    """Runs an engine's audit passes (:func:`dense_pass`) and keeps those in flight.

    On CUDA the passes run on a side stream and, with ``graphs``, as CUDA graph replays:
    one graph per (rows, block-table width bucket, captured shape), captured after an
    eager warm-up (the first pass of that shape), at most ``max_graphs`` kept. The audit
    graphs have their own memory pool: they run beside the decode's graphs, not in turn.

    Parameters
    ----------
    model, cache, ops : the engine's; graphs : capture the passes in CUDA graphs
    (:meth:`engine.decode.cuda_graph.DecodeGraphs.supported` holds for the engine);
    max_graphs : captured shapes kept.
    """

    def __init__(self, model, cache, ops, graphs: bool = False, max_graphs: int = 4):
        import torch

        self.model, self.cache, self.ops = model, cache, ops
        cuda = model.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=model.device) if cuda else None
        self.use_graphs = cuda and graphs
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple, _PassGraph] = OrderedDict()
        self.pool = None
        self._capture_stream = None
        self.captures = 0
        self.replays = 0
        self.passes: list[AuditPass] = []

    def submit(
        self,
        seq_ids: list[int],
        job_ids: list[str],
        steps: list[int],
        tokens: torch.Tensor,
        num_tokens: list[int],
        sparse_logits: torch.Tensor,
        captured: Captured | None,
    ) -> AuditPass:
        """Start the audit of ``R`` rows of the step just launched: ``tokens`` int64
        ``[R]`` fed, ``num_tokens`` their context lengths, ``sparse_logits`` float32
        ``[R, V]`` the step's logits of those rows, ``captured`` their queries and
        selections — all owned by the pass (copies, not the step's buffers). On CUDA the
        pass waits for the work queued so far on the current stream (the step and its
        pool writes) and runs on :attr:`stream`; on the CPU it runs now."""
        import torch

        t0 = time.monotonic()
        start = done = None
        if self.stream is None:
            figures = self._figures(tokens, seq_ids, num_tokens, sparse_logits, captured)
            keep: tuple = ()
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.model.device))
            with torch.cuda.stream(self.stream):
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                dev = self._figures(tokens, seq_ids, num_tokens, sparse_logits, captured)
                figures = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
                figures.copy_(dev, non_blocking=True)
                done = torch.cuda.Event(enable_timing=True)
                done.record()
            keep = (tokens, sparse_logits, captured, dev)
        p = AuditPass(seq_ids, job_ids, steps, figures, done, start, time.monotonic() - t0, keep)
        self.passes.append(p)
        return p

    def _figures(self, tokens, seq_ids, num_tokens, sparse_logits, captured) -> torch.Tensor:
        """float32 ``[3, R]``: agreement, KL and mass kept of each row, one
        :func:`dense_pass` per group of rows whose staged records fit
        :data:`STAGING_BYTES` a layer."""
        import torch

        c = self.cache
        reserved = [len(c.seqs[sid].pages) for sid in seq_ids]
        row_bytes = [p * c.model.num_kv_heads * c.record_bytes for p in reserved]
        parts = []
        groups = row_groups(row_bytes, STAGING_BYTES)
        for g in groups:
            tok, logits, cap = tokens, sparse_logits, captured
            if len(groups) > 1:  # index on the device: no host sync
                idx = to_device(torch.tensor(g), tokens.device)
                tok, logits = tokens.index_select(0, idx), sparse_logits.index_select(0, idx)
                if cap is not None:
                    q, sel = cap.q.index_select(1, idx), cap.selection.index_select(1, idx)
                    cap = Captured(cap.layers, q, sel)
            rows = [seq_ids[i] for i in g]
            width = max(reserved[i] for i in g)
            if self.use_graphs or self.stream is not None:  # CUDA: eager == replay bit for bit
                # one graph per width bucket: a job replays the same one all its life
                from engine.decode.cuda_graph import width_bucket

                width = width_bucket(width, c.max_pages_per_seq)
            table = torch.full((len(g), width), -1, dtype=torch.int32)
            for j, sid in enumerate(rows):
                pages = c.seqs[sid].pages
                table[j, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            dev = self.model.device
            lens = to_device(torch.tensor([num_tokens[i] for i in g], dtype=torch.int32), dev)
            out = self._run(tok, lens, to_device(table, dev), logits, cap)
            parts.append(out.clone() if len(groups) > 1 else out)  # a replay's: static
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def _pass(self, tokens, lens, table, logits, captured) -> torch.Tensor:
        import torch

        dense, kept = dense_pass(self.model, self.cache, self.ops, tokens, lens, table, captured)
        agree, kl = compare_rows(logits, dense)
        return torch.stack([agree.float(), kl, kept])

    def _run(self, tokens, lens, table, logits, captured) -> torch.Tensor:
        """:meth:`_pass` — replayed from its CUDA graph where :attr:`use_graphs`."""
        if not self.use_graphs:
            return self._pass(tokens, lens, table, logits, captured)
        key = (
            tuple(table.shape),
            None if captured is None else (tuple(captured.layers), tuple(captured.selection.shape)),
        )
        g = self.graphs.get(key)
        if g is not None:
            self.graphs.move_to_end(key)
            self._load(g, tokens, lens, table, logits, captured)
            g.graph.replay()
            self.replays += 1
            return g.out
        g = self._static(key, tokens, lens, table, logits, captured)
        out = self._pass(*self._inputs(g))  # eager on the static inputs: warm-up, and result
        try:
            self._capture(g)
        except Exception as e:  # noqa: BLE001 - audit eagerly from now on
            self.use_graphs = False
            self.graphs.clear()
            warnings.warn(f"audit CUDA graphs disabled (capture failed: {e!r})", stacklevel=2)
        return out

    @staticmethod
    def _inputs(g: _PassGraph) -> tuple:
        cap = None if g.q is None else Captured(g.layers, g.q, g.selection)
        return g.tokens, g.lens, g.table, g.logits, cap

    def _load(self, g: _PassGraph, tokens, lens, table, logits, captured) -> None:
        """Copy a pass's inputs into ``g``'s static buffers (on the auditor's stream, after
        the last replay that read them)."""
        g.tokens.copy_(tokens)
        g.lens.copy_(lens)
        g.table.copy_(table)
        g.logits.copy_(logits)
        if captured is not None:
            g.q.copy_(captured.q)
            g.selection.copy_(captured.selection)

    def _static(self, key, tokens, lens, table, logits, captured) -> _PassGraph:
        """A new entry for ``key`` whose static inputs are copies of this pass's."""
        while len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)
        g = _PassGraph(
            tokens.clone(), lens.clone(), table.clone(), logits.clone(),
            None if captured is None else captured.q.clone(),
            None if captured is None else captured.selection.clone(),
            [] if captured is None else list(captured.layers),
        )  # fmt: skip
        self.graphs[key] = g
        return g

    def _capture(self, g: _PassGraph) -> None:
        """Capture :meth:`_pass` of ``g``'s static inputs on a capture stream (replays run
        on the auditor's), in the audit graphs' own memory pool. ``capture_begin`` rather
        than ``torch.cuda.graph``, whose entry synchronises the device (see
        :meth:`engine.decode.cuda_graph.DecodeGraphs._capture`)."""
        import torch

        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(device=self.model.device)
        stream = self._capture_stream
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self.pool)
            try:
                g.out = self._pass(*self._inputs(g))
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        g.graph = graph
        self.captures += 1

    def retire(self, wait_seq: int | None = None) -> list[tuple[object, AuditStep, float]]:
        """Passes whose step has been read and whose figures have landed — and, waited
        for, those holding ``wait_seq``'s rows: ``(owner, event, seconds)`` per row of a
        request still open at the read, in launch order. Retired passes are dropped."""
        out, left = [], []
        for p in self.passes:
            if p.owners is None or not (p.ready() or wait_seq in p.seq_ids):
                left.append(p)
                continue
            p.wait()
            values = p.figures.tolist()
            share = p.seconds / len(p.seq_ids)
            now = time.monotonic()
            for i, sid in enumerate(p.seq_ids):
                owner = p.owners.get(sid)
                if owner is not None:
                    agree, kl, kept = (values[0][i], values[1][i], values[2][i])
                    event = AuditStep(now, p.job_ids[i], p.steps[i], agree > 0.5, kl, kept)
                    out.append((owner, event, share))
        self.passes = left
        return out

    def wait_seq(self, seq_id: int) -> None:
        """Wait until no pass in flight reads ``seq_id``'s pages (before they are freed)."""
        for p in self.passes:
            if seq_id in p.seq_ids:
                p.wait()

    def clear(self) -> None:
        """Wait for every pass and drop them (end of a run)."""
        for p in self.passes:
            p.wait()
        self.passes = []
