"""The engine: admission, layer-major chunked prefill interleaved with batched decode
steps, sampling and stop checks. It yields :mod:`engine.events` and never imports a UI.

Request lifecycle:
1. queued — ``Engine.run`` receives the job; a prompt over the context limit fails now.
2. admitted — when the KV pool has pages for prompt + max_tokens and the hot buffer a
   slab per KV head (no over-commit: pages are reserved up front).
3. prefill — one layer of the whole prompt per scheduler turn (chunked causal attention),
   K/V written to the KV pool page by page with page metadata; decode steps of the
   running batch go on between turns.
4. decode — every running request advances one token per step through
   :class:`engine.decode.attention.DecodeAttention`.
5. finished — stop token / stop string / max_tokens / the closing ``}`` of a JSON-constrained
   reply (``Job.json_keys``) (or cancelled / failed); pages and
   slabs are released and the next job is admitted.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine import events as ev
from engine.config import EngineConfig, job_seed
from engine.decode import audit as fidelity
from engine.decode import indexers
from engine.decode.attention import DecodeAttention, LinkTurns, StepPlan
from engine.decode.cuda_graph import DecodeGraphs, split_plan, table_width
from engine.decode.json_constraint import JsonConstraint, JsonConstraints
from engine.decode.sampling import make_generator, masked_greedy, sample
from engine.kv.cache import KVCache
from engine.model.llama import LlamaModel, prefill_attention
from engine.text.context import too_long_message

if TYPE_CHECKING:
    from engine.capacity.budget import KVSizing
    from engine.load import PlacedModel

_END = object()  # end-of-source marker for Engine._pull


@dataclass
class Request:
    """Mutable state of one admitted job."""

    job: ev.Job
    seq_id: int
    t_admit: float
    generator: torch.Generator
    phase: str = "prefill"
    hidden: torch.Tensor | None = None
    next_layer: int = 0
    generated: list[int] = field(default_factory=list)
    t_first: float = 0.0
    t_prefill_s: float = 0.0
    hits: int = 0
    misses: int = 0
    prefetched: int = 0
    finish_reason: str = ""
    text: str = ""
    logits: torch.Tensor | None = None
    closed: bool = False  # finished, failed or cancelled: its cache room is released
    prefill_iter: Iterator[int] | None = None  # the layer being prefilled across turns
    audit_at: frozenset[int] = frozenset()  # decode steps to audit (engine.decode.audit)
    audit: fidelity.AuditTally | None = None
    constraint: JsonConstraint | None = None  # Job.json_keys: the reply's JSON grammar

    @property
    def num_tokens(self) -> int:
        """Tokens whose K/V are in the cache (prompt + generated tokens already fed)."""
        return len(self.job.prompt_ids) + max(len(self.generated) - 1, 0)


@dataclass
class StepHandle:
    """A launched decode step whose results the host has not read yet.

    ``out`` int64 ``[4, B]`` holds, per row, the greedy token, hits, misses and prefetched
    records (pinned host memory filled by an asynchronous copy on CUDA; ``done`` is the
    event after that copy, ``None`` on CPU). ``logits`` float32 ``[B, V]`` (device) are
    valid until the next launch (a CUDA graph's static buffer) unless cloned. ``allowed``
    maps the rows of JSON-constrained requests to their bool ``[V]`` masks (host memory):
    their greedy token in ``out`` is already the masked argmax, and sampling applies it.
    """

    batch: list[Request]
    step: int
    logits: torch.Tensor | None  # None: the tokens in ``out`` are final (pipeline)
    greedy: torch.Tensor | None  # device int64 [B]
    out: torch.Tensor
    done: torch.cuda.Event | None
    t_launch: float
    audit: fidelity.AuditPass | None = None  # this step's audited rows (maybe in flight)
    allowed: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> bool [V] mask
    t_done: float = 0.0  # when the host saw the step done (end of launch on the CPU)
    captured: bool = False  # the launch captured a CUDA graph (a one-off per batch shape)


class Engine:
    """Batch generation over a KV hierarchy.

    Jobs with ``json_keys`` have their logits masked to the JSON grammar
    (:mod:`engine.decode.json_constraint`) before sampling; a step whose batch holds such
    a job is read before the next one is launched (the mask of a row's next token needs
    its last token), so it is never chained on the device.

    Parameters
    ----------
    model : placed model; tokenizer : ``engine.text.tokenizer.TextTokenizer``;
    config : validated :class:`EngineConfig`; ops : kernel set; context_limit : max
    tokens (prompt + generated) per request under the context policy; cache : a
    prebuilt :class:`KVCache` (sized for a memory budget by :mod:`engine.capacity.budget`, or
    shared with another engine over the same model, as :mod:`engine.measure.bench` does for
    its no-IO and instrumented passes); built from ``config`` when omitted;
    pool_shares : data-parallel workers splitting the user's ``host_pool_gb`` (``config``
    holds this worker's share), for messages that name it.
    """

    def __init__(
        self,
        model: LlamaModel,
        tokenizer,
        config: EngineConfig,
        ops,
        context_limit: int,
        tracer=None,
        cache: KVCache | None = None,
        *,
        model_name: str = "",
        weight_format: str = "",
        weights_info: str = "",
        budget_sizing: KVSizing | None = None,
        pool_shares: int = 1,
    ):
        self.model = model
        self.json = JsonConstraints(tokenizer, model.config.vocab_size)
        self.model_name = model_name or model.config.name
        self.weight_format = weight_format
        self.weights_info = weights_info
        self.load_marks: dict[str, float] = {}  # load steps' end times (ev.StartupTimes)
        self.budget_sizing = budget_sizing
        self.pool_shares = pool_shares  # data-parallel workers splitting host_pool_gb
        self.model_config = model.config
        self.tokenizer = tokenizer
        self.config = config
        self.ops = ops
        self.context_limit = context_limit
        max_pages = -(-context_limit // config.page_size)
        self.cache = (
            cache
            if cache is not None
            else KVCache(model.config, config, model.device, max_pages, layers=model.layer_range)
        )
        _check_dense_indexer(config, self.cache.pages_for(context_limit))
        self.attn = DecodeAttention(
            self.cache,
            config,
            ops,
            model.scale,
            tracer,
            softcap=model.attn_softcap,
            windows=[model.attn_window(i) for i in model.layer_range],
        )
        self.tracer = tracer
        self.step = 0
        self._cancel = False
        self._next_seq = 0
        self.eos_ids = frozenset(getattr(tokenizer, "eos_ids", ()) or ())
        self.keep_logits = False  # tests: keep each request's latest logits [V]
        # Two micro-batches per step (config.decode_overlap): on CUDA with the hierarchy,
        # where one's host gathers can overlap the other's compute (eager steps split the
        # same way, one after the other, so graph replays equal them bit for bit).
        self.split_batches = (
            config.decode_overlap and self.cache.hierarchical and model.device.type == "cuda"
        )
        why_not = DecodeGraphs.supported(self)
        self.graphs = DecodeGraphs(self) if not why_not else None
        self.graphs_off_reason = why_not
        # Asynchronous decode (config.async_decode): the step launched but not yet read.
        self.async_decode = (
            config.async_decode if config.async_decode is not None else model.device.type == "cuda"
        )
        # RoPE fused into the decode append where the model allows it (not Gemma's two
        # RoPE bases); fp8 records round from kv_dtype, so there only where it is the
        # activations' dtype (the fused kernel takes q, k and v in one dtype).
        self.fused_rope = getattr(model, "fused_rope", False) and (
            not self.cache.fp8 or self.cache.dtype == getattr(model, "dtype", None)
        )
        self._inflight: StepHandle | None = None
        self.auditor = (
            fidelity.Auditor(model, self.cache, ops, graphs=self.graphs is not None)
            if config.audit_steps
            else None
        )
        self._last_read = 0.0
        self._prefilled_since_read = False

    @classmethod
    def from_placed(cls, placed: PlacedModel, config: EngineConfig, **kwargs: Any) -> Engine:
        """The engine of a :class:`engine.load.PlacedModel` (``kwargs``: ``tracer``,
        ``cache``, ``budget_sizing`` and, for subclasses, their own arguments)."""
        return cls(
            placed.model,
            placed.tokenizer,
            config,
            placed.ops,
            placed.context_limit,
            model_name=placed.name,
            weight_format=placed.weight_format,
            weights_info=placed.weights_info,
            **kwargs,
        )

    # ----- public API (engine.serve.base.BatchEngine) -------------------------------
    def prompt_limit(self) -> int:
        """Most tokens (prompt + max_tokens) a request may hold."""
        return self.context_limit

    @property
    def trace_paths(self) -> list[str]:
        """The selection trace file (``--trace``), or none."""
        path = getattr(self.tracer, "path", None)
        return [str(path)] if path else []

    def cancel(self) -> None:
        """Stop admitting; running requests end with finish_reason ``cancelled``."""
        self._cancel = True

    def run(self, jobs: Iterable[ev.Job | None]) -> Iterator[ev.Event]:
        """Process ``jobs`` (continuous batching) and yield events as they happen.

        Jobs are drawn lazily: one more only when none waits for admission and fewer than
        ``max_batch`` run, so a blocking source (a worker's share of a job queue) is read
        only when there is room. Each drawn job yields ``JobQueued`` (or ``JobFailed`` if
        it can never run). A ``None`` item means "no job ready yet": the engine carries on
        and asks again on its next turn (a source should block rather than yield ``None``
        while nothing runs). After :meth:`cancel`, jobs still in ``jobs`` are drawn and
        failed ("cancelled before admission").
        """
        source = iter(jobs)
        queue: deque[ev.Job] = deque()
        running: list[Request] = []
        exhausted = False
        last_mem = 0.0
        while True:
            if not self._cancel and not exhausted:
                exhausted = yield from self._pull(source, queue, running)
            if not self._cancel:
                yield from self._admit(queue, running)
            if time.monotonic() - last_mem > 1.0:
                last_mem = time.monotonic()
                yield from self.memory_snapshots()
            if self._cancel:
                yield from self._drain(running)
                yield from self._finish_all(running, "cancelled")
                break
            if not queue and not running and exhausted:
                break
            yield from self._prefill_turn(running)
            yield from self._decode_turn(running)
        yield from self._drain(running)
        unadmitted = [*queue, *(() if exhausted else (j for j in source if j is not None))]
        for job in unadmitted:
            yield ev.JobFailed(time.monotonic(), job.id, "cancelled before admission")
        yield from self._end_run()

    def _end_run(self) -> Iterator[ev.Event]:
        """End of :meth:`run`: close the trace file and report memory once more (the peaks
        of the whole run)."""
        if self.auditor is not None:
            self.auditor.clear()
        if self.tracer is not None and hasattr(self.tracer, "close"):
            self.tracer.close()
        yield from self.memory_snapshots()

    # ----- scheduling --------------------------------------------------------------
    constrains_json = True  # whether Job.json_keys is enforced (not by the pipeline engine)

    def _check_job(self, job: ev.Job) -> str:
        need = len(job.prompt_ids) + job.sampling.max_tokens
        if not job.prompt_ids:
            return "empty prompt"
        if job.json_keys is not None and self.constrains_json:
            try:
                self.json.masks(job.json_keys)
            except ValueError as exc:
                return f"cannot constrain the reply to a JSON object: {exc}"
        if need > self.context_limit:
            return too_long_message(
                len(job.prompt_ids),
                job.sampling.max_tokens,
                self.context_limit,
                self.config.context_policy,
            )
        if self.cache.pages_for(need) > self.cache.max_pages_per_seq:  # a budget-sized cache
            sized = self.cache.max_pages_per_seq * self.cache.page_size
            return (
                f"prompt of {len(job.prompt_ids)} tokens + max_tokens {job.sampling.max_tokens} "
                f"needs {need} tokens, but memory_budget_gb sized this run's cache for jobs of "
                f"at most {sized} tokens (its longest job when it loaded); run the job again"
            )
        if not self.cache.fits_ever(need):
            return f"needs {self.cache.pages_for(need)} KV pool pages but {self._pool_said()}"
        return ""

    def _pool_said(self) -> str:
        """The KV pool's pages and the setting that sized them, for messages:
        ``memory_budget_gb`` where the budget sized an all-resident pool on the compute
        device, else ``host_pool_gb`` (the total, where data-parallel workers split it)."""
        pages = self.cache.num_pool_pages
        sizing = self.budget_sizing
        if sizing is not None and sizing.pool_on_device:
            return (
                f"the pool has {pages} (memory_budget_gb={self.config.memory_budget_gb}: "
                "all-resident attention keeps the pool on the compute device, sized by the "
                "budget; --memory-budget)"
            )
        if self.pool_shares > 1:
            total = self.config.host_pool_gb * self.pool_shares
            return (
                f"this device's share of the pool has {pages} "
                f"(host_pool_gb={total:g} split across {self.pool_shares} devices)"
            )
        return f"the pool has {pages} (host_pool_gb={self.config.host_pool_gb})"

    def _pull(
        self, source: Iterator, queue: deque, running: list[Request]
    ) -> Generator[ev.Event, None, bool]:
        """Draw jobs while none waits and the batch has room; returns True once ``source``
        is exhausted."""
        while not queue and len(running) < self.config.max_batch:
            job = next(source, _END)
            if job is _END:
                return True
            if job is None:
                return False
            err = self._check_job(job)
            if err:
                yield ev.JobFailed(time.monotonic(), job.id, err)
                continue
            queue.append(job)
            yield ev.JobQueued(time.monotonic(), job.id, len(job.prompt_ids))
        return False

    def _admit(self, queue: deque, running: list[Request]) -> Iterator[ev.Event]:
        while queue and len(running) < self.config.max_batch:
            job = queue[0]
            need = len(job.prompt_ids) + job.sampling.max_tokens
            if not self.cache.can_admit(need):
                return
            queue.popleft()
            req = self._open(job, job_seed(job.id))
            running.append(req)
            yield ev.JobAdmitted(req.t_admit, job.id, len(job.prompt_ids))

    def _open(self, job: ev.Job, seed: int) -> Request:
        """Reserve cache room for ``job`` (prompt + max_tokens) under the next seq id."""
        seq_id = self._next_seq
        self._next_seq += 1
        self.cache.allocate(seq_id, len(job.prompt_ids) + job.sampling.max_tokens)
        req = Request(job, seq_id, time.monotonic(), make_generator(job.sampling, seed))
        if job.json_keys is not None and self.constrains_json:
            req.constraint = self.json.new(job.json_keys)
        if self.config.audit_steps:
            req.audit = fidelity.AuditTally()
            req.audit_at = fidelity.audit_schedule(
                job.id, job.sampling.max_tokens, self.config.audit_steps, self.config.audit_seed
            )
        return req

    def _close(self, req: Request) -> None:
        """Return a request's cache room (and drop a prefill in progress), once no audit
        pass in flight reads its pages."""
        req.prefill_iter = None
        if self.auditor is not None:
            self.auditor.wait_seq(req.seq_id)
        self.cache.release(req.seq_id)

    def _prefill_turn(self, running: list[Request]) -> Iterator[ev.Event]:
        """Advance the first prefilling job by at most :attr:`prefill_turn_tokens` prompt
        tokens of its current layer (whole chunks, at least one; the whole layer when the
        budget is 0), so a long prompt does not hold the running batch's decode steps."""
        req = next((r for r in running if r.phase == "prefill"), None)
        if req is None:
            return
        budget = self.prefill_turn_tokens
        done = False
        self._prefilled_since_read = True
        try:
            t0 = time.monotonic()
            if req.prefill_iter is None:
                req.prefill_iter = self.prefill_layer_chunks(req)
            advanced = 0
            while budget == 0 or advanced < budget:
                try:
                    advanced += next(req.prefill_iter)
                except StopIteration:
                    done = True
                    break
            req.t_prefill_s += time.monotonic() - t0
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: fail this job, go on
            req.prefill_iter = None
            yield from self._fail(req, running, f"prefill failed: {e}")
            return
        if not done:
            return
        req.prefill_iter = None
        n = len(req.job.prompt_ids)
        yield ev.PrefillProgress(
            time.monotonic(), req.job.id, req.next_layer, self.model_config.num_layers, n
        )
        if req.phase == "decode":
            yield ev.FirstToken(req.t_first, req.job.id, req.t_first - req.t_admit)
            yield from self._check_finished(req, running)

    @property
    def prefill_turn_tokens(self) -> int:
        """Prompt tokens per prefill turn (``config.prefill_turn_tokens``; ``None`` or 0: a
        whole layer)."""
        return self.config.prefill_turn_tokens or 0

    def _decode_turn(self, running: list[Request]) -> Iterator[ev.Event]:
        """One decode step of the running batch.

        With :attr:`async_decode`, a step whose batch equals the one in flight is
        launched *before* the host reads the in-flight step (its tokens are fed on the
        device), so the host's reading, stop checks and events overlap the GPU's next
        step. A changed batch (a job finished, failed or joined) first reads the step in
        flight, then launches with the tokens known on the host.
        """
        batch = [r for r in running if r.phase == "decode"]
        prev, self._inflight = self._inflight, None
        if prev is not None and self._chainable(prev, batch):
            try:
                nxt = self.launch_step(batch, prev)
            except Exception as e:  # noqa: BLE001 - fail the batch's jobs, keep the engine
                yield from self._read(prev, running)
                for r in [r for r in batch if not r.closed]:
                    yield from self._fail(r, running, f"decode failed: {e}")
                return
            yield from self._read(prev, running)
            self._inflight = nxt
            return
        if prev is not None:
            yield from self._read(prev, running)
            batch = [r for r in running if r.phase == "decode"]
        if not batch:
            return
        try:
            handle = self.launch_step(batch)
        except Exception as e:  # noqa: BLE001 - fail the batch's jobs, keep the engine
            for r in batch:
                yield from self._fail(r, running, f"decode failed: {e}")
            return
        if self.async_decode and self._greedy_batch(batch):
            self._inflight = handle
        else:
            yield from self._read(handle, running)

    def _greedy_batch(self, batch: list[Request]) -> bool:
        """Whether every row's next token is the unconstrained argmax (the device can feed
        it on)."""
        return not self.keep_logits and all(
            r.job.sampling.temperature == 0 and r.constraint is None for r in batch
        )

    def _chainable(self, prev: StepHandle, batch: list[Request]) -> bool:
        return (
            self.async_decode
            and len(prev.batch) == len(batch)
            and all(a is b for a, b in zip(prev.batch, batch, strict=True))
            and self._greedy_batch(batch)
        )

    def _drain(self, running: list[Request]) -> Iterator[ev.Event]:
        """Read the step in flight, if any (end of run, cancel)."""
        prev, self._inflight = self._inflight, None
        if prev is not None:
            yield from self._read(prev, running)

    def _read(self, handle: StepHandle, running: list[Request]) -> Iterator[ev.Event]:
        """Wait for ``handle``'s step, append each live row's token and counters, yield
        its :class:`engine.events.DecodeStep` and finish the rows that stop. Rows closed
        since the launch (a job that finished at the step before) are skipped."""
        try:
            tokens, hits, misses, prefetched = self.read_step(handle)
        except Exception as e:  # noqa: BLE001 - e.g. a CUDA error surfacing at the sync
            if handle.audit is not None:
                handle.audit.owners = {}
            for r in [r for r in handle.batch if not r.closed]:
                yield from self._fail(r, running, f"decode failed: {e}")
            return
        step_s = handle.t_done - max(handle.t_launch, self._last_read)
        self._last_read = handle.t_done
        with_prefill, self._prefilled_since_read = self._prefilled_since_read, False
        live = []
        for r, tok, h, m, p in zip(handle.batch, tokens, hits, misses, prefetched, strict=True):
            if r.closed:
                continue
            r.generated.append(tok)
            if r.constraint is not None:
                r.constraint.advance(tok)
            r.hits += h
            r.misses += m
            r.prefetched += p
            live.append((r, h, m, p))
        if handle.audit is not None:  # its rows of jobs still running count
            handle.audit.owners = {r.seq_id: r for r, *_ in live}
        if not live:
            return
        rb = self.cache.record_bytes
        n_hits = sum(x[1] for x in live)
        n_miss = sum(x[2] for x in live)
        n_pre = sum(x[3] for x in live)
        yield ev.DecodeStep(
            time.monotonic(),
            handle.step,
            len(live),
            step_s,
            {r.job.id: len(r.generated) for r, *_ in live},
            {r.job.id: r.job.sampling.max_tokens for r, *_ in live},
            int(n_hits),
            int(n_miss),
            int(n_miss + n_pre) * rb,
            int(n_pre),
            with_prefill,
            handle.captured,
        )
        yield from self._audit_results()
        for r, *_ in live:
            yield from self._check_finished(r, running)

    def _audit_results(self, wait_seq: int | None = None) -> Iterator[ev.AuditStep]:
        """Tally and yield the audited rows whose figures have landed (and, waiting for
        them, those of ``wait_seq``): :meth:`engine.decode.audit.Auditor.retire`. A job
        that finished at the step before an audited one (its ride-along) is not counted."""
        if self.auditor is None:
            return
        for r, event, seconds in self.auditor.retire(wait_seq):
            r.audit.add(event.agree, event.kl, event.mass_kept)
            r.audit.seconds += seconds
            yield event

    def _check_finished(self, req: Request, running: list[Request]) -> Iterator[ev.Event]:
        """Finish ``req`` on its stop token, a stop string or ``max_tokens``.

        Stop strings are looked for in the decoded tail of the reply (the last
        :func:`_stop_window` tokens), the whole reply is decoded only when one may be
        there and at the end — not every step (that was quadratic in the reply's length).
        A stop string first present after token ``n`` contains text of token ``n``, so it
        lies in the tail; the cut is taken on the whole text, as before.
        """
        sp = req.job.sampling
        last = req.generated[-1]
        if last in self.eos_ids:
            req.generated.pop()
            req.finish_reason = "stop"
        stops = [s for s in sp.stop if s]
        cut = None
        text = None
        if stops:
            tail = self.tokenizer.decode(req.generated[-_stop_window(stops) :])
            if any(s in tail for s in stops):
                text = self.tokenizer.decode(req.generated)
                cut = _find_stop(text, stops)
        if cut is not None:
            text = text[:cut]
            req.finish_reason = "stop"
        elif not req.finish_reason and req.constraint is not None and req.constraint.done:
            req.finish_reason = "stop"  # the JSON object is complete
        elif not req.finish_reason and len(req.generated) >= sp.max_tokens:
            req.finish_reason = "length"
        if req.finish_reason:
            req.text = text if text is not None else self.tokenizer.decode(req.generated)
            yield from self._audit_results(req.seq_id)  # its audit complete in its result
            yield self._finish(req, running)

    def _finish(self, req: Request, running: list[Request]) -> ev.JobFinished:
        now = time.monotonic()
        self._close(req)
        req.closed = True
        running.remove(req)
        decode_s = now - req.t_first if req.t_first else 0.0
        n_dec = max(len(req.generated) - 1, 0)
        n_prompt = len(req.job.prompt_ids)
        text = (
            req.text if req.finish_reason != "cancelled" else self.tokenizer.decode(req.generated)
        )
        result = ev.JobResult(
            job_id=req.job.id,
            text=text,
            token_ids=tuple(req.generated),
            prompt_tokens=n_prompt,
            finish_reason=req.finish_reason,
            ttft_s=(req.t_first - req.t_admit) if req.t_first else 0.0,
            prefill_tok_s=n_prompt / req.t_prefill_s if req.t_prefill_s else 0.0,
            decode_tok_s=n_dec / decode_s if decode_s > 0 else 0.0,
            cache=ev.CacheStats(
                req.hits,
                req.misses,
                (req.misses + req.prefetched) * self.cache.record_bytes,
                req.prefetched,
            ),
            audit=req.audit.stats() if req.audit is not None else None,
        )
        return ev.JobFinished(now, result)

    def _finish_all(self, running: list[Request], reason: str) -> Iterator[ev.Event]:
        for r in list(running):
            r.finish_reason = reason
            yield from self._audit_results(r.seq_id)
            yield self._finish(r, running)

    def _fail(self, req: Request, running: list[Request], error: str) -> Iterator[ev.Event]:
        self._close(req)
        req.closed = True
        running.remove(req)
        yield ev.JobFailed(time.monotonic(), req.job.id, error)

    # ----- direct driving (tests, benchmarks) ---------------------------------------
    def open_request(self, job: ev.Job) -> Request:
        """Admit ``job`` now, outside :meth:`run`. Raises ``CacheFullError`` if it does not fit."""
        return self._open(job, 0)

    def prefill(self, req: Request) -> int:
        """Run every remaining prefill layer; returns the first sampled token."""
        while req.phase == "prefill":
            self.prefill_layer(req)
        return req.generated[-1]

    def close_request(self, req: Request) -> None:
        """Release the pages and slabs of a request opened with :meth:`open_request`."""
        self._close(req)

    def close(self) -> None:
        """Free the KV cache now (:meth:`KVCache.close`: pending copies are waited for, the
        pinned host pool is returned to the system). Not for an engine whose cache another
        engine still uses; the engine admits nothing afterwards. Closes the trace file too
        (``run`` already does); idempotent."""
        if self.tracer is not None and hasattr(self.tracer, "close"):
            self.tracer.close()
        self.cache.close()

    # ----- model execution ---------------------------------------------------------
    @torch.inference_mode()
    def prefill_layer(self, req: Request) -> None:
        """Run layer ``req.next_layer`` over the whole prompt in chunks; after the last
        layer sample the first token and switch the request to decode."""
        for _ in Engine.prefill_layer_chunks(self, req):  # not an override's schedule
            pass

    @torch.inference_mode()
    def prefill_layer_chunks(self, req: Request) -> Iterator[int]:
        """:meth:`prefill_layer` one chunk at a time: yields the prompt tokens of each
        chunk once its work is launched; the layer's end (its cache writes, and after
        the last layer the first token) runs when the generator is exhausted."""
        m = self.model
        t = len(req.job.prompt_ids)
        if req.hidden is None:
            req.hidden = m.embed_tokens(torch.tensor(req.job.prompt_ids, dtype=torch.long))
        h = yield from self.prefill_hidden_chunks(req.seq_id, req.next_layer, req.hidden)
        req.next_layer += 1
        if req.next_layer == self.model_config.num_layers:
            logits = m.logits(h[-1:])[0]
            req.logits = logits if self.keep_logits else None
            req.hidden = None
            allowed = self._allowed(req)
            req.generated.append(sample(logits, req.job.sampling, req.generator, allowed))
            if req.constraint is not None:
                req.constraint.advance(req.generated[-1])
            req.t_first = time.monotonic()
            req.phase = "decode"
            self.cache.seqs[req.seq_id].num_tokens = t
        else:
            req.hidden = h

    @torch.inference_mode()
    def prefill_hidden(self, seq_id: int, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Model layer ``layer`` (one this engine holds) over a whole prompt, in chunks
        (:meth:`prefill_hidden_chunks` run to its end): ``h [T, H]`` -> ``[T, H]``, after
        the model's last layer ``[1, H]``."""
        chunks = self.prefill_hidden_chunks(seq_id, layer, h)
        while True:
            try:
                next(chunks)
            except StopIteration as stop:
                return stop.value

    @torch.inference_mode()
    def prefill_hidden_chunks(
        self, seq_id: int, layer: int, h: torch.Tensor
    ) -> Generator[int, None, torch.Tensor]:
        """Model layer ``layer`` (one this engine holds) over a whole prompt, in chunks;
        yields each chunk's token count after launching its work, returns the output.
        ``h [T, H]`` (updated in place) -> the layer's output ``[T, H]``; after the model's
        last layer only the final position's ``[1, H]``. K/V go to the cache: with
        ``prefill_copy_stream`` each chunk's whole pages as soon as the chunk's K/V exist
        (:meth:`KVCache.write_prefill_chunk`, the copy overlapping the next chunk's
        compute), the partial last page with the last chunk; after the cache's last layer
        the compute stream waits for the copies (:meth:`KVCache.finish_prefill`). Without
        it, one blocking :meth:`KVCache.write_prefill` of the whole layer at the end.
        """
        m, cfg, cache = self.model, self.model_config, self.cache
        local = layer - cache.layer_offset
        t = h.shape[0]
        pos = torch.arange(t, device=m.device)
        kbuf = torch.empty(t, cfg.num_kv_heads, cfg.head_dim, dtype=m.dtype, device=m.device)
        vbuf = torch.empty_like(kbuf)
        last = layer == cfg.num_layers - 1
        chunk, page = self.config.prefill_chunk, cache.page_size
        chunked = self.config.prefill_copy_stream
        written = 0  # positions already handed to the cache (page-aligned)
        for s in range(0, t, chunk):
            e = min(s + chunk, t)
            q, k, v = m.qkv(layer, h[s:e], pos[s:e])
            kbuf[s:e], vbuf[s:e] = k, v
            end = e if e == t else e - e % page  # whole pages, the partial one at the end
            if chunked and end > written:
                cache.write_prefill_chunk(
                    seq_id, local, kbuf[written:end], vbuf[written:end], written
                )
                written = end
            if last and e < t:
                yield e - s
                continue  # only the final position's output is needed after the last layer
            a = prefill_attention(
                q, kbuf[:e], vbuf[:e], s, m.scale, m.attn_softcap, m.attn_window(layer)
            )
            if last:
                h = m.finish_layer(layer, h[t - 1 :], a[-1:])
            else:
                h[s:e] = m.finish_layer(layer, h[s:e], a)
            yield e - s
        if not chunked:
            cache.write_prefill(seq_id, local, kbuf, vbuf, 0)
        elif local == cache.num_layers - 1:
            cache.finish_prefill(seq_id)
        return h

    @torch.inference_mode()
    def decode_step(self, batch: list[Request]) -> list[int]:
        """Feed each request's last token, return the next token of each (one step,
        launched and read: :meth:`launch_step` then :meth:`read_step`)."""
        return self.read_step(self.launch_step(batch))[0]

    @torch.inference_mode()
    def launch_step(self, batch: list[Request], prev: StepHandle | None = None) -> StepHandle:
        """Launch one decode step of ``batch`` without waiting for it.

        Each request feeds its last token — or, with ``prev`` (the step just launched for
        the same batch, all rows greedy), the token ``prev`` computes, taken on the
        device. On CUDA with the Triton kernels the step replays a captured CUDA graph
        (:mod:`engine.decode.cuda_graph`); otherwise it launches eagerly. Both compute the
        same function of the same inputs. The cache counts the fed token at launch.
        """
        t_launch = time.monotonic()  # before the work: on the CPU the launch runs the step
        m = self.model
        self.step += 1
        seqs = self.cache.seqs
        lens = [seqs[r.seq_id].num_tokens + 1 for r in batch]
        seq_ids = [r.seq_id for r in batch]
        audited = [i for i, r in enumerate(batch) if self._fed_index(r) in r.audit_at]
        fed = None if prev is not None else [r.generated[-1] for r in batch]
        audit_tokens = self._audit_tokens(audited, fed, prev) if audited else None
        out = None
        captures = self.graphs.captures if self.graphs is not None else 0
        if self.graphs is not None and self.tracer is None:
            out = self.graphs.launch(seq_ids, fed, lens, self.step, prev.greedy if prev else None)
        if out is not None:
            logits, greedy, counters = out
            captured = self.graphs.last_capture
        else:
            width = None  # on CUDA the graphs' padded width, so eager == replay bit for bit
            if self.model.device.type == "cuda":
                width = table_width(self.cache, seq_ids)
            plan = self.attn.plan(seq_ids, lens, self.step, width)
            if self.tracer is not None:
                self.tracer.bind({r.seq_id: r.job.id for r in batch})
            if prev is not None:
                tokens = prev.greedy
            else:
                tokens = torch.tensor(fed, dtype=torch.long, device=m.device)
            self.attn.capture = [] if audited else None
            try:
                h = self.decode_batch(plan, m.embed_tokens(tokens), self.split_batches)
                captured = self.attn.capture or []
            finally:
                self.attn.capture = None
            logits = m.logits(h)
            greedy = logits.argmax(dim=-1)
            counters = [self.attn.hits, self.attn.misses, self.attn.prefetched]
        allowed = {i: a for i, r in enumerate(batch) if (a := self._allowed(r)) is not None}
        if allowed:  # built on the host while the device runs the step
            greedy = masked_greedy(logits, greedy, allowed)
        audit = None
        if audited:
            audit = self._audit(batch, audited, audit_tokens, logits, captured, lens)
        for sid in seq_ids:
            seqs[sid].num_tokens += 1
        if self.keep_logits:
            logits = logits.clone()
        rows = [greedy] + [c if c is not None else torch.zeros_like(greedy) for c in counters]
        stacked = torch.stack(rows)
        done = None
        if stacked.device.type == "cuda":
            host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
            host.copy_(stacked, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            stacked = host
        handle = StepHandle(list(batch), self.step, logits, greedy, stacked, done, t_launch, audit)
        handle.captured = self.graphs is not None and self.graphs.captures > captures
        if done is None:  # the CPU ran the step in the launch
            handle.t_done = time.monotonic()
        handle.allowed = allowed  # the JSON-constrained rows' masks, for sampling
        return handle

    def read_step(self, handle: StepHandle) -> tuple[list[int], list[int], list[int], list[int]]:
        """Wait for ``handle``'s step: (next token, hits, misses, prefetched records) per
        row. Greedy rows take the device's argmax; others sample from the step's logits
        with their own generator (valid only before the next launch)."""
        if handle.done is not None:
            handle.done.synchronize()
            handle.t_done = time.monotonic()
        greedy, hits, misses, prefetched = handle.out.tolist()
        if handle.logits is None:  # tokens already final (a pipeline's last stage sampled)
            return greedy, hits, misses, prefetched
        tokens = [
            greedy[i]
            if r.job.sampling.temperature == 0
            else sample(handle.logits[i], r.job.sampling, r.generator, handle.allowed.get(i))
            for i, r in enumerate(handle.batch)
        ]
        if self.keep_logits:
            for i, r in enumerate(handle.batch):
                r.logits = handle.logits[i]
        return tokens, hits, misses, prefetched

    def _allowed(self, req: Request) -> torch.Tensor | None:
        """Bool ``[V]`` (host) of the tokens ``req``'s JSON grammar allows next, given the
        tokens it may still generate; ``None`` for an unconstrained request."""
        if req.constraint is None:
            return None
        return req.constraint.allowed(req.job.sampling.max_tokens - len(req.generated))

    def _fed_index(self, req: Request) -> int:
        """Tokens generated when ``req``'s next step is launched (``len(generated)`` on a
        step launched after the last one was read; counted from the cache, so also on a
        chained launch): the index :mod:`engine.decode.audit` schedules by."""
        return self.cache.seqs[req.seq_id].num_tokens - len(req.job.prompt_ids) + 1

    def _audit_tokens(
        self, rows: list[int], fed: list[int] | None, prev: StepHandle | None
    ) -> torch.Tensor:
        """int64 ``[R]`` on the model's device: the tokens rows ``rows`` feed this step —
        taken from ``prev``'s greedy tokens on the device when the step is chained (no
        host sync; before this launch may overwrite that buffer)."""
        if prev is not None:
            index = fidelity.to_device(torch.tensor(rows, dtype=torch.long), prev.greedy.device)
            return prev.greedy.index_select(0, index)
        return fidelity.to_device(torch.tensor([fed[i] for i in rows]), self.model.device)

    def _audit(
        self,
        batch: list[Request],
        rows: list[int],
        tokens: torch.Tensor,
        logits: torch.Tensor,
        captured: list,
        lens: list[int],
    ) -> fidelity.AuditPass:
        """Start the audit of rows ``rows`` of the step just launched
        (:mod:`engine.decode.audit`): copy their sparse ``logits [B, V]`` rows and the
        step's captured queries and selections out of the step's buffers, then one dense
        pass for all of them (on CUDA on the auditor's stream, beside the next steps). It
        reads the pool only, after the step's writes, so the sparse state is untouched;
        its figures reach the requests when the step is read and they have landed
        (:meth:`_audit_results`)."""
        assert self.auditor is not None
        index = fidelity.to_device(torch.tensor(rows, dtype=torch.long), logits.device)
        return self.auditor.submit(
            [batch[i].seq_id for i in rows],
            [batch[i].job.id for i in rows],
            [self._fed_index(batch[i]) for i in rows],
            tokens,
            [lens[i] for i in rows],
            logits.index_select(0, index),
            fidelity.snapshot(captured, rows),
        )

    @torch.inference_mode()
    def decode_batch(
        self,
        plan: StepPlan,
        h: torch.Tensor,
        split: bool,
        sides: list[torch.cuda.Stream] | None = None,
    ) -> torch.Tensor:
        """:meth:`decode_layers` for ``plan``'s batch ``h [B, H]`` -> ``[B, H]``; when
        ``split`` (and B >= 2), as ``decode_micro_batches`` micro-batches of contiguous
        rows (:func:`engine.decode.cuda_graph.split_plan`), each a chain through every
        layer. With ``sides`` (one CUDA stream per micro-batch after the first) the chains
        run beside each other: the GPU then overlaps one chain's gathers (waiting on the
        host link) with the others' compute. With ``gather_turns`` (hierarchical) the
        chains are issued layer by layer, round robin, and their gathers take turns on
        the link (:class:`engine.decode.attention.LinkTurns`). The micro-batches own
        disjoint slabs, pages and counter rows, so they share no writable state; each
        row's result does not depend on the split.
        """
        b = len(plan.seq_ids)
        if not split or b < 2:
            return self.decode_layers(plan, h)
        groups = split_plan(plan, self.config.decode_micro_batches)
        hs = list(torch.split(h, [len(g.seq_ids) for g in groups]))
        if sides is None:
            return torch.cat([self.decode_layers(g, x) for g, x in zip(groups, hs, strict=True)])
        main = torch.cuda.current_stream()
        streams = [main, *sides[: len(groups) - 1]]
        for side in streams[1:]:
            side.wait_stream(main)
        if not (self.config.gather_turns and self.cache.hierarchical):
            for i in range(len(groups) - 1, -1, -1):  # the main stream's chain issued last
                with torch.cuda.stream(streams[i]):
                    hs[i] = self.decode_layers(groups[i], hs[i])
        else:  # issued layer by layer, so each gather can wait for the previous chain's
            turns = LinkTurns()
            for g in groups:
                g.link_turns = turns
            try:
                for layer in self.model.layer_range:
                    for i in range(len(groups) - 1, -1, -1):
                        with torch.cuda.stream(streams[i]):
                            hs[i] = self.decode_layer(groups[i], layer, hs[i])
            finally:  # each chain's late pool writes and prefetches land on its stream
                for stream in reversed(streams):
                    with torch.cuda.stream(stream):
                        self.cache.join_late()
        for side in streams[1:]:
            main.wait_stream(side)
        return torch.cat(hs)

    @torch.inference_mode()
    def decode_layers(self, plan: StepPlan, h: torch.Tensor) -> torch.Tensor:
        """This engine's layers for one decode step of ``plan``'s batch: ``h [B, H]`` ->
        ``[B, H]`` (each layer appends its K/V and attends through the cache; the RoPE of
        q and k is fused into the append where :attr:`fused_rope`)."""
        try:
            for layer in self.model.layer_range:
                h = self.decode_layer(plan, layer, h)
        finally:  # the step's late pool writes and prefetches land before anything else
            self.cache.join_late()
        return h

    def decode_layer(self, plan: StepPlan, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The model's ``layer`` for one decode step of ``plan``'s batch: ``h [B, H]`` ->
        ``[B, H]`` (see :meth:`decode_layers`, which also joins the late writes)."""
        m = self.model
        cache_layer = layer - self.cache.layer_offset
        if self.fused_rope:
            q, k, v = m.qkv(layer, h, plan.positions, rotate=False)
            a = self.attn.run(plan, cache_layer, q, k, v, m.rope_params)
        else:
            q, k, v = m.qkv(layer, h, plan.positions)
            a = self.attn.run(plan, cache_layer, q, k, v)
        return m.finish_layer(layer, h, a)

    def memory_snapshots(self) -> list[ev.MemorySnapshot]:
        """Snapshots of every device this engine drives (one here; a pipeline's stage 0
        adds the other stages')."""
        return [self.memory_snapshot()]

    def memory_snapshot(self) -> ev.MemorySnapshot:
        """Bytes by part on the compute device and of the KV pool, with the device's peaks
        (see :class:`engine.events.MemorySnapshot`)."""
        c, dev = self.cache, self.model.device
        peaks = {}
        if dev.type == "cuda":
            total = torch.cuda.get_device_properties(dev).total_memory
            act = torch.cuda.memory_allocated(dev)
            free, device_total = torch.cuda.mem_get_info(dev)
            peaks = {
                "peak_allocated": torch.cuda.max_memory_allocated(dev),
                "peak_reserved": torch.cuda.max_memory_reserved(dev),
                "device_used": device_total - free,
                "pinned_host": pinned_host_bytes(),
            }
        else:  # CPU: physical RAM; activations are not tracked separately
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            act = 0
        parts = self.model.weight_bytes + c.hot_buffer_bytes + c.metadata_bytes
        return ev.MemorySnapshot(
            time.monotonic(),
            str(dev),
            self.model.weight_bytes,
            c.hot_buffer_bytes,
            c.metadata_bytes,
            max(act - parts, 0),
            total,
            c.pool_bytes_used,
            c.pool_bytes_total,
            **peaks,
            host_pool_pinned=c.pool_bytes_pinned,
            host_pool_dtype=self.config.kv_host_dtype if c.hierarchical else "",
        )


def pinned_host_bytes() -> int:
    """Bytes torch's pinned host allocator holds in this process (its blocks are rounded
    up to powers of two); 0 without CUDA or where torch does not report it."""
    stats_fn = getattr(torch.cuda, "host_memory_stats", None)
    if stats_fn is None or not torch.cuda.is_available():
        return 0
    try:
        stats = stats_fn()
    except Exception:  # noqa: BLE001 - a torch without these statistics: not reported
        return 0
    for key in ("allocated_bytes.current", "reserved_bytes.current"):
        if key in stats:
            return int(stats[key])
    return 0


def _check_dense_indexer(config: EngineConfig, context_pages: int) -> None:
    """``indexer=dense`` under sparse attention selects every page of a context, so one
    step may select ``context_pages`` pages: the selection budget (top_k) and the hot
    buffer must hold them all.

    Raises
    ------
    ConfigError
        Naming the pages needed and the flags to change.
    """
    from engine.config import ConfigError

    if config.attention != "sparse" or indexers.get(config.indexer).ranks:
        return
    if config.max_selected_pages < context_pages or (
        config.hierarchical and config.buffer_pages < context_pages
    ):
        tokens = context_pages * config.page_size
        raise ConfigError(
            f"indexer=dense selects every page of the context ({context_pages} pages of "
            f"{config.page_size} tokens), but top_k={config.top_k} tokens holds "
            f"{config.max_selected_pages} pages and device_buffer={config.device_buffer_tokens} "
            f"tokens {config.buffer_pages}; set --top-k-tokens and --device-buffer to at least "
            f"{tokens}, or use --attention dense for dense attention"
        )


def _stop_window(stops: list[str]) -> int:
    """Tokens of a reply's tail that hold any stop string first completed by the last
    token: every token decodes to at least one byte and a character is at most four
    (UTF-8), plus slack for tokenizers that drop a leading space at the start of a text."""
    return 4 * max(len(s) for s in stops) + 8


def _find_stop(text: str, stops) -> int | None:
    idx = [text.find(s) for s in stops if s and s in text]
    return min(idx) if idx else None
