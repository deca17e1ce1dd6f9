"""Pipeline parallelism: the model's layers in contiguous stages, one process per stage.

Stage ``i`` of ``n`` holds layers ``engine.capacity.planner.stage_layers(L, n)[i]``: their weights,
KV pool pages, page metadata and hot-buffer slabs (``LlamaModel(layers=...)``,
``KVCache(layers=...)``); stage 0 also holds the token embedding, the last stage the final
norm and the LM head. Every stage has the same number of pool pages (sized from the whole
model, so the stages together use ``host_pool_gb``) and the same slab count, so identical
allocate / release sequences give identical page and slab ids on every stage.

Roles
-----
* Stage 0, :class:`PipelineEngine` (an :class:`~engine.serve.engine.Engine`), runs the scheduler
  (``Engine.run``: admission, layer-major prefill turns, decode steps) over its layers and
  broadcasts every decision that touches another stage's state as a small command:

  ``("open", seq_id, reserve_tokens, sampling, seed, job_id)``  allocate pages and slabs;
  the last stage makes the request's sampling generator (seeded as ``Engine`` seeds it);
  ``("close", seq_id)``  release them;
  ``("prefill", seq_id, layer, T)``  run ``layer`` (held by a later stage) over the prompt;
  ``("decode", step, groups)``  one decode step, ``groups`` the micro-batches as lists of
  ``(seq_id, seq_len)``;
  ``("memory",)``  every stage sends stage 0 its :class:`~engine.events.MemorySnapshot`
  (``gather_object``), which stage 0 yields with its own;
  ``("end",)``  ``Engine.run`` ended: close the selection trace files;
  ``("exit",)``.
* Stages 1 .. n-1, :class:`StageFollower`, execute the commands in order.
* The last stage samples and sends the tokens (with the summed hit / miss counters) back to
  stage 0.

Transport
---------
Commands go out with ``torch.distributed.broadcast_object_list`` from stage 0 on a gloo
group. Activations go point to point between neighbouring stages with ``isend`` / ``recv``:
over NCCL when every stage has a GPU of its own, otherwise over gloo (CUDA tensors staged
through host memory; NCCL refuses two ranks on one GPU). Both sides of a transfer post it
while handling the same command, so no transfer ever waits on a later broadcast.

Prefill
-------
One layer per scheduler turn, as in ``Engine``. Stage 0 runs its own layers; for a later
stage's layer it broadcasts ``prefill``: at a stage boundary the previous stage sends the
prompt's hidden states ``[T, H]`` to the next; the owner runs the layer and keeps the
hidden states; after the model's last layer the last stage samples the first token and
sends it to stage 0. Decode steps of other requests run between these turns.

Decode micro-batch schedule
---------------------------
Each decode step splits the batch into ``micro_batches`` (2) contiguous groups A and B.
With two stages::

    stage 0:  | A: embed, layers [0, a) | B: layers [0, a) |              | recv tokens A, B
    stage 1:                            | A: layers [a, L), sample | B: layers [a, L), sample |

Stage 0 sends A's activations asynchronously and computes B while stage 1 computes A, so
a step takes about 3 half-batch stage times instead of 4; with M micro-batches and S stages,
(M + S - 1) / M stage times of the whole batch instead of S. Consecutive steps do not
overlap (stage 0 needs the step's tokens before embedding the next), which would need an
asynchronous decode turn in the scheduler.

Memory budget and traces
------------------------
With ``memory_budget_gb`` each stage sizes its cache from the budget for its own layers
(:func:`engine.capacity.budget.stage_sizing`: the planner's table for that stage: its weights,
activations with the logits only on the last stage, hand-off buffers, reserve); the
stages exchange their sizings (``all_gather_object``) and all build the smallest pool and
``max_batch`` so page and slab ids stay identical; a stage that has no room fails every
stage's start with the reasons. With ``trace_path`` (one file per stage, named by
:func:`engine.serve.workers.worker_config`) each stage records the selections of its layers,
under the model's layer index; the header's ``layers`` names them, and ``hisparse
replay`` reads the stage files together.

Any failure inside a pipelined prefill or decode (including a lost peer) raises
:class:`StageError`, which ``Engine.run`` does not catch: the stages are no longer in
lockstep, so the stage process ends and the parent (``engine.serve.workers``) reports it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from engine import events as ev
from engine.capacity.planner import stage_layers
from engine.config import ConfigError, EngineConfig, SamplingParams
from engine.decode.sampling import make_generator, sample
from engine.serve.engine import Engine, Request, StepHandle

MICRO_BATCHES = 2


class StageError(Exception):
    """A pipelined step failed; the stages may be out of lockstep (not a RuntimeError, so
    ``Engine.run`` lets it end the stage process)."""


class StageLink:
    """The ``torch.distributed`` plumbing of one stage.

    Parameters
    ----------
    rank, world_size : this stage and the stage count
    device : this stage's compute device
    init_method : rendezvous URL shared by the stages (``file://...``)
    nccl : activations over NCCL (every stage on its own GPU); otherwise gloo
    """

    def __init__(
        self, rank: int, world_size: int, device: torch.device, init_method: str, nccl: bool
    ):
        backend = "nccl" if nccl else "gloo"
        if nccl and device.index is not None:
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
        self.control = dist.new_group(backend="gloo") if nccl else dist.group.WORLD
        self.rank, self.world_size, self.device = rank, world_size, device
        self.wire = device if nccl else torch.device("cpu")
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def broadcast(self, command: tuple | None = None) -> tuple:
        """Stage 0 sends ``command``; every other stage receives and returns it."""
        box = [command]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every stage's ``obj`` (picklable), in stage order, on every stage."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        """Every stage's ``obj``, in stage order, on stage 0 (``None`` elsewhere)."""
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out

    def isend(self, tensor: torch.Tensor, dst: int) -> None:
        """Start sending ``tensor`` to stage ``dst``; :meth:`flush` waits for it."""
        wire = tensor.to(self.wire).contiguous()
        self._pending.append((dist.isend(wire, dst), wire))

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int) -> torch.Tensor:
        """Receive a ``shape`` / ``dtype`` tensor from stage ``src`` onto this stage's device."""
        buf = torch.empty(tuple(shape), dtype=dtype, device=self.wire)
        dist.recv(buf, src)
        return buf.to(self.device)

    def flush(self) -> None:
        """Wait until every started send is done."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def close(self) -> None:
        self.flush()
        dist.destroy_process_group()


def sample_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> list[int]:
    """One token per row of float32 ``logits [B, V]``, as ``Engine.decode_step`` samples."""
    greedy = logits.argmax(dim=-1).tolist()
    return [
        greedy[i] if p.temperature == 0 else sample(logits[i], p, g)
        for i, (p, g) in enumerate(zip(params, generators, strict=True))
    ]


def split_batch(batch: list, parts: int) -> list[list]:
    """``batch`` in at most ``parts`` contiguous, non-empty groups (sizes differ by <= 1)."""
    parts = max(1, min(parts, len(batch)))
    base, extra = divmod(len(batch), parts)
    groups, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        groups.append(batch[start:end])
        start = end
    return groups


class PipelineEngine(Engine):
    """Stage 0: the scheduler of :class:`~engine.serve.engine.Engine` over layers ``ranges[0]``,
    driving stages ``1 .. n-1`` (see the module docstring).

    Parameters
    ----------
    link : this stage's :class:`StageLink`; ranges : every stage's layers (``n >= 2``);
    other parameters as :class:`~engine.serve.engine.Engine` (``tracer`` records stage 0's
    layers, ``cache`` holds them). The last stage samples, unmasked: ``Job.json_keys`` is
    not enforced here (such replies are only validated afterwards).
    """

    constrains_json = False

    def __init__(
        self, model, tokenizer, config, ops, context_limit, tracer=None, cache=None, *,
        link, ranges, **identity,
    ):
        super().__init__(model, tokenizer, config, ops, context_limit, tracer, cache, **identity)
        self.link = link
        self.ranges: list[range] = list(ranges)
        self.last_stage = len(self.ranges) - 1
        self.micro_batches = MICRO_BATCHES
        self.async_decode = False  # a step goes through every stage: launched and read at once

    # ----- cache lockstep ----------------------------------------------------------
    def _open(self, job, seed: int) -> Request:
        req = super()._open(job, seed)
        reserve = len(job.prompt_ids) + job.sampling.max_tokens
        self._command("open", req.seq_id, reserve, job.sampling, seed, job.id)
        return req

    def _close(self, req: Request) -> None:
        super()._close(req)
        self._command("close", req.seq_id)

    def _command(self, *command) -> None:
        try:
            self.link.broadcast(command)
        except Exception as e:  # noqa: BLE001 - a lost stage ends the pipeline
            raise StageError(f"pipeline command {command[0]!r} failed: {e}") from e

    # ----- execution ---------------------------------------------------------------
    @torch.inference_mode()
    def prefill_layer(self, req: Request) -> None:
        if req.next_layer in self.model.layer_range:
            super().prefill_layer(req)  # stage 0 never holds the last layer
            return
        try:
            self._remote_prefill_layer(req)
        except Exception as e:  # noqa: BLE001
            raise StageError(f"pipelined prefill of layer {req.next_layer} failed: {e}") from e

    def prefill_layer_chunks(self, req: Request) -> Iterator[int]:
        """One whole layer per scheduler turn: the stages take prefill commands a layer
        at a time (no chunked turns across a pipeline)."""
        self.prefill_layer(req)
        yield len(req.job.prompt_ids)

    def _remote_prefill_layer(self, req: Request) -> None:
        layer, t = req.next_layer, len(req.job.prompt_ids)
        self.link.broadcast(("prefill", req.seq_id, layer, t))
        if layer == self.ranges[1].start:  # hand the prompt's hidden states to stage 1
            self.link.isend(req.hidden, 1)
            self.link.flush()
            req.hidden = None
        req.next_layer += 1
        if req.next_layer == self.model_config.num_layers:
            token = self.link.recv((1,), torch.int64, self.last_stage)
            req.generated.append(int(token[0]))
            req.t_first = time.monotonic()
            req.phase = "decode"
            self.cache.seqs[req.seq_id].num_tokens = t

    @torch.inference_mode()
    def launch_step(self, batch: list[Request], prev: StepHandle | None = None) -> StepHandle:
        """The pipelined step run to its end (the run loop's launch): a handle whose tokens
        are final (sampled by the last stage; ``logits`` ``None``). ``prev`` is unused:
        pipelined steps are never chained."""
        t0 = time.monotonic()
        tokens = self.decode_step(batch)
        counters = [self.attn.hits, self.attn.misses, self.attn.prefetched]
        out = torch.stack([torch.tensor(tokens, dtype=torch.int64), *counters])
        handle = StepHandle(list(batch), self.step, None, None, out, None, t0)
        handle.t_done = time.monotonic()
        return handle

    @torch.inference_mode()
    def decode_step(self, batch: list[Request]) -> list[int]:
        """One pipelined decode step of ``batch`` in micro-batches; returns the tokens."""
        try:
            return self._pipelined_step(batch)
        except Exception as e:  # noqa: BLE001
            raise StageError(f"pipelined decode step failed: {e}") from e

    def _pipelined_step(self, batch: list[Request]) -> list[int]:
        m = self.model
        self.step += 1
        groups = split_batch(batch, self.micro_batches)
        layout = [[(r.seq_id, r.num_tokens + 1) for r in g] for g in groups]
        self.link.broadcast(("decode", self.step, layout))
        if self.tracer is not None:
            self.tracer.bind({r.seq_id: r.job.id for r in batch})
        for group in groups:
            lens = [r.num_tokens + 1 for r in group]
            plan = self.attn.plan([r.seq_id for r in group], lens, self.step)
            tokens = torch.tensor([r.generated[-1] for r in group], dtype=torch.long)
            h = self.decode_layers(plan, m.embed_tokens(tokens))
            self.link.isend(h, 1)
            counters = [self.attn.hits, self.attn.misses, self.attn.prefetched]
            self.link.isend(torch.stack(counters), 1)
        out = [self.link.recv((4, len(g)), torch.int64, self.last_stage).cpu() for g in groups]
        self.link.flush()
        tokens_hits_misses = torch.cat(out, dim=1)
        self.attn.hits, self.attn.misses, self.attn.prefetched = tokens_hits_misses[1:]
        for r in batch:
            self.cache.seqs[r.seq_id].num_tokens += 1
        return tokens_hits_misses[0].tolist()

    def memory_snapshot(self) -> ev.MemorySnapshot:
        """Stage 0's device and its layers' share of the host pool (``stage`` 0)."""
        return dataclasses.replace(super().memory_snapshot(), stage=0)

    def memory_snapshots(self) -> list[ev.MemorySnapshot]:
        """One snapshot per stage, in stage order (``stage`` set): each stage's device and
        its layers' share of the host pool (``engine.serve.workers`` sums the shares)."""
        self._command("memory")
        try:
            return list(self.link.gather(self.memory_snapshot()) or [])
        except Exception as e:  # noqa: BLE001 - a lost stage ends the pipeline
            raise StageError(f"pipeline memory report failed: {e}") from e

    def _end_run(self) -> Iterator[ev.Event]:
        """Tell the other stages the run ended (they close their trace files), then close
        stage 0's and report every stage's memory."""
        self._command("end")
        yield from super()._end_run()

    def shutdown(self) -> None:
        """Tell the other stages to exit and leave the process group."""
        self.link.broadcast(("exit",))
        self.link.close()


class StageFollower:
    """Stages 1 .. n-1: execute stage 0's commands on this stage's layers.

    Parameters
    ----------
    engine : an :class:`~engine.serve.engine.Engine` over this stage's layers (its cache and
        execution helpers are used; its scheduler is not)
    link : this stage's :class:`StageLink`; ranges : every stage's layers
    """

    def __init__(self, engine: Engine, link: StageLink, ranges: Sequence[range]):
        self.engine, self.link = engine, link
        self.rank = link.rank
        self.layers = ranges[link.rank]
        self.is_last = link.rank == len(ranges) - 1
        self.hidden: dict[int, torch.Tensor] = {}
        self.sampling: dict[int, tuple[SamplingParams, torch.Generator]] = {}
        self.job_ids: dict[int, str] = {}

    def serve(self) -> None:
        """Execute commands until ``exit``."""
        handlers = {
            "open": self._open,
            "close": self._close,
            "prefill": self._prefill,
            "decode": self._decode,
            "memory": self._memory,
            "end": self._end,
        }
        while True:
            command = self.link.broadcast()
            if command[0] == "exit":
                self._end()
                self.link.close()
                return
            handlers[command[0]](*command[1:])

    def _open(
        self, seq_id: int, reserve: int, sampling: SamplingParams, seed: int, job_id: str = ""
    ) -> None:
        self.engine.cache.allocate(seq_id, reserve)
        self.job_ids[seq_id] = job_id or str(seq_id)
        if self.is_last:
            self.sampling[seq_id] = (sampling, make_generator(sampling, seed))

    def _close(self, seq_id: int) -> None:
        self.engine.cache.release(seq_id)
        self.hidden.pop(seq_id, None)
        self.sampling.pop(seq_id, None)
        self.job_ids.pop(seq_id, None)

    def _memory(self) -> None:
        snap = dataclasses.replace(self.engine.memory_snapshot(), stage=self.rank)
        self.link.gather(snap)

    def _end(self) -> None:
        tracer = self.engine.tracer
        if tracer is not None and hasattr(tracer, "close"):
            tracer.close()

    @torch.inference_mode()
    def _prefill(self, seq_id: int, layer: int, t: int) -> None:
        eng, m = self.engine, self.engine.model
        if layer == self.layers.stop:  # the next stage starts here: hand over
            self.link.isend(self.hidden.pop(seq_id), self.rank + 1)
            self.link.flush()
            return
        if layer not in self.layers:
            return
        if layer == self.layers.start:
            h = self.link.recv((t, m.config.hidden_size), m.dtype, self.rank - 1)
        else:
            h = self.hidden.pop(seq_id)
        h = eng.prefill_hidden(seq_id, layer, h)
        if layer < m.config.num_layers - 1:
            self.hidden[seq_id] = h
            return
        eng.cache.seqs[seq_id].num_tokens = t
        token = self._sample([seq_id], m.logits(h[-1:]))
        self.link.isend(torch.tensor(token), 0)
        self.link.flush()

    @torch.inference_mode()
    def _decode(self, step: int, layout: list[list[tuple[int, int]]]) -> None:
        eng, m = self.engine, self.engine.model
        if eng.tracer is not None:
            eng.tracer.bind({s: self.job_ids.get(s, str(s)) for g in layout for s, _ in g})
        for group in layout:
            ids, lens = [s for s, _ in group], [n for _, n in group]
            plan = eng.attn.plan(ids, lens, step)
            h = self.link.recv((len(ids), m.config.hidden_size), m.dtype, self.rank - 1)
            stats = self.link.recv((3, len(ids)), torch.int64, self.rank - 1)
            h = eng.decode_layers(plan, h)
            stats = stats + torch.stack([eng.attn.hits, eng.attn.misses, eng.attn.prefetched])
            if self.is_last:
                tokens = torch.tensor([self._sample(ids, m.logits(h))])
                self.link.isend(torch.cat([tokens, stats.cpu()]), 0)
            else:
                self.link.isend(h, self.rank + 1)
                self.link.isend(stats, self.rank + 1)
        self.link.flush()
        for group in layout:
            for seq_id, _ in group:
                eng.cache.seqs[seq_id].num_tokens += 1

    def _sample(self, seq_ids: list[int], logits: torch.Tensor) -> list[int]:
        params = [self.sampling[s][0] for s in seq_ids]
        generators = [self.sampling[s][1] for s in seq_ids]
        return sample_rows(logits, params, generators)


def load_stage(
    config: EngineConfig,
    model: str | None,
    rank: int,
    world_size: int,
    init_method: str,
    nccl: bool,
    job_tokens: int | None = None,
) -> PipelineEngine | StageFollower:
    """Load stage ``rank`` of ``world_size``: only its layers are placed; joins the process
    group. Stage 0 returns the :class:`PipelineEngine`, the others a :class:`StageFollower`.

    With ``config.memory_budget_gb`` the stage's cache is sized from the budget (see the
    module docstring; the split is the engine's ``budget_sizing``), for requests of
    ``job_tokens`` (:func:`engine.load.sized_tokens`); with ``config.trace_path`` the stage records its layers' selections there.

    Raises
    ------
    ConfigError
        Fewer than 2 stages, more stages than the model has layers, or a memory budget
        that leaves some stage no room (every stage raises, naming the stages).
    """
    from engine.load import place_model, sized_tokens

    placed = place_model(config, model, stage=(rank, world_size))
    llm = placed.model
    ranges = [range(a, b) for a, b in stage_layers(llm.config.num_layers, world_size)]
    link = StageLink(rank, world_size, llm.device, init_method, nccl)
    cache, sizing = None, None
    if config.memory_budget_gb is not None:
        tokens = sized_tokens(placed.context_limit, job_tokens)
        config, cache, sizing = stage_budget_cache(llm, config, tokens, link)
    tracer = stage_tracer(placed.name, llm, config)
    kwargs = {"tracer": tracer, "cache": cache, "budget_sizing": sizing}
    if rank == 0:
        return PipelineEngine.from_placed(placed, config, link=link, ranges=ranges, **kwargs)
    engine = Engine.from_placed(placed, config, **kwargs)
    return engine if rank == 0 else StageFollower(engine, link, ranges)


def stage_budget_cache(llm, config: EngineConfig, context_limit: int, link: StageLink):
    """The budget-sized cache of this stage's layers, agreed with the other stages.

    Every stage computes :func:`engine.capacity.budget.stage_sizing` for its layers and shares it
    (``all_gather_object``); each then builds the smallest pool and ``max_batch`` of all
    (:func:`engine.capacity.budget.common_sizing`).

    Returns
    -------
    (config with the agreed ``max_batch``, :class:`engine.kv.cache.KVCache`,
    :class:`engine.capacity.budget.KVSizing`)

    Raises
    ------
    ConfigError
        Some stage has no room; on every stage, naming each stage that has none.
    """
    from engine.capacity.budget import budget_cache, common_sizing, stage_sizing

    r = llm.layer_range
    try:
        mine: Any = stage_sizing(
            llm.config, config, llm.weight_bytes, context_limit, (r.start, r.stop)
        )
    except ConfigError as e:
        mine = f"stage {link.rank} (layers {r.start}-{r.stop - 1}, {link.device}): {e}"
    everyone = link.all_gather(mine)
    errors = [s for s in everyone if isinstance(s, str)]
    if errors:
        raise ConfigError("; ".join(errors))
    sizing = common_sizing(mine, everyone, llm.config, config, context_limit)
    return budget_cache(llm, config, context_limit, sizing=sizing)


def stage_tracer(model_name: str, llm, config: EngineConfig):
    """A :class:`engine.measure.trace.TraceWriter` at ``config.trace_path`` whose header
    names this stage's layers; ``None`` without a trace path."""
    path = config.trace_path
    if not path:
        return None
    from engine.measure.trace import TraceHeader, TraceWriter

    r = llm.layer_range
    header = TraceHeader.for_engine(model_name, llm.config, config, layers=(r.start, r.stop))
    return TraceWriter(path, header)
