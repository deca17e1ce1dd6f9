"""Several devices behind one engine surface: data-parallel workers or a layer pipeline.

:class:`ParallelEngine` has the surface front ends use (:class:`engine.serve.base.BatchEngine`:
``tokenizer``, ``config``, ``run(jobs)``, ``cancel()``, ``prompt_limit()``, ``close()``) and yields one merged stream
of :mod:`engine.events`, so the CLI and the dashboard work unchanged.
:func:`engine.load.load_engine` returns one when ``config.devices`` names more than one
device (``config.parallel``: ``data``, the default, or ``pipeline``).

Process layout
--------------
The parent (the front end's process) loads only the tokenizer. It starts one process per
device with ``torch.multiprocessing`` (spawn); every worker has ``NCCL_NVLS_ENABLE=0`` in
its environment and ignores SIGINT (Ctrl-C reaches the parent, which forwards a cancel).

* ``data``: worker ``i`` loads the whole model on ``devices[i]`` (``load_engine`` with
  ``device=devices[i]`` and ``host_pool_gb / n``: its own slab pool and share of the host
  pool) and runs its own :class:`~engine.serve.engine.Engine`. No collectives are needed.
* ``pipeline``: stage ``i`` holds ``stage_layers(L, n)[i]`` (:mod:`engine.serve.pipeline`); stage
  0 schedules and drives the others over ``torch.distributed`` (gloo on CPU, NCCL between
  distinct GPUs). Only stage 0 takes jobs.

Queue and protocol
------------------
Jobs come from one queue, the ``jobs`` iterable, held by the parent: a worker pulls a job
when its engine has room. Each worker feeds its ``Engine.run`` with a generator
(:class:`_JobFeed`) that asks the parent for a job (``want``), blocks for the answer while
its engine is idle and yields ``None`` ("nothing yet") while it is busy; ``Engine.run`` draws
from it only when nothing waits for admission and the batch has room. The parent answers
each request with the next job from ``jobs``, drawn only then (prompts are built lazily),
or with ``stop`` (the sentinel) once ``jobs`` is exhausted or the run is cancelled. The
queue lives in the parent rather than in a shared ``multiprocessing.Queue`` because a
process killed while it waits in ``Queue.get`` dies holding the queue's lock and blocks the
survivors; every pipe below has one reader and one writer.

Messages, one duplex pipe per worker::

    parent -> worker   ("run",) | ("job", Job) | ("stop",) | ("cancel",) | ("exit",)
    worker -> parent   ("ready", info) | ("want",) | ("event", Event) | ("done",)
                       | ("error", traceback)

The parent waits on every pipe and every process sentinel at once
(``multiprocessing.connection.wait``), passes events on in arrival order (a
:class:`JobPlaced` before a job's first event names its worker; ``MemorySnapshot.device``
is made unique per worker and its host pool figures summed over workers), and notices a
dead worker as soon as its process ends.

Failure handling
----------------
A worker that dies (non-zero exit, a signal, an exception) is reported with a
:class:`WorkerDied` event, and each job it held (sent to it and not finished) fails with
``"worker N (device) died: ..."``. Those jobs are not re-queued: a job that crashed its
worker (out of memory, a bad document) would crash the next one too, and the results log
records the failure so the next ``hisparse run`` retries it. In ``data`` mode the other
workers carry on and take the remaining jobs; once no worker is left the remaining jobs
fail. In ``pipeline`` mode one lost stage breaks the pipeline: the other stages are
stopped and stage 0's jobs fail with the lost stage named.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import tempfile
import time
import traceback
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from engine import events as ev
from engine.config import ConfigError, EngineConfig

MODES = ("data", "pipeline")
WORKER_ENV = {"NCCL_NVLS_ENABLE": "0"}
POLL_S = 0.2
JOIN_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class JobPlaced(ev.Event):
    """``job_id`` was handed to worker ``worker`` on ``device`` (before its first event)."""

    job_id: str
    worker: int
    device: str


@dataclass(frozen=True)
class WorkerDied(ev.Event):
    """Worker ``worker`` on ``device`` ended unexpectedly; ``job_ids`` fail with ``error``."""

    worker: int
    device: str
    error: str
    job_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker process loads: rank ``rank`` of ``world_size`` on ``device``."""

    rank: int
    world_size: int
    device: str
    mode: str
    config: EngineConfig
    model: str | None
    init_method: str = ""
    nccl: bool = False
    job_tokens: int | None = None  # the run's longest job: what a budget sizes for

    @property
    def label(self) -> str:
        return f"worker {self.rank} ({self.device})"


def parse_devices(devices: str | Iterable[str]) -> list[str]:
    """``"cpu,cpu"`` or ``["cuda:0", "cuda:1"]`` -> a list of device names."""
    items = devices.split(",") if isinstance(devices, str) else list(devices)
    return [str(d).strip() for d in items if str(d).strip()]


def worker_trace_path(path: str, rank: int) -> str:
    """Worker ``rank``'s trace file for ``--trace path``: ``run.jsonl`` -> ``run.w1.jsonl``
    (``run.jsonl.gz`` -> ``run.w1.jsonl.gz``)."""
    root, ext = os.path.splitext(str(path))
    if ext == ".gz":
        root, inner = os.path.splitext(root)
        ext = inner + ext
    return f"{root}.w{rank}{ext}"


def worker_config(
    config: EngineConfig, device: str, rank: int, devices: list[str], mode: str
) -> EngineConfig:
    """The config one worker loads: its device, its share of the host pool and of
    ``max_batch`` (``data``; a pipeline stage sizes its pool from its layers), the host's cores split between the
    workers when ``num_threads`` is unset, its own trace file
    (:func:`worker_trace_path`: a data worker records its jobs, a pipeline stage its
    layers), and no ``devices`` / ``parallel``. ``memory_budget_gb`` stays: it caps each
    worker's device (a pipeline stage sizes it for its layers)."""
    changes: dict[str, Any] = {"device": device, "devices": (), "parallel": "data"}
    if config.trace_path:
        changes["trace_path"] = worker_trace_path(config.trace_path, rank)
    if mode == "data":
        changes["host_pool_gb"] = config.host_pool_gb / len(devices)
        # max_batch is the whole box's, as the planner reads it (ceil(max_batch / n) rows
        # per device), so the run admits what `hisparse plan` shows.
        changes["max_batch"] = -(-config.max_batch // len(devices))
    if config.num_threads is None:  # the workers share the host's cores
        changes["num_threads"] = max(1, (os.cpu_count() or 1) // len(devices))
    return config.replace(**changes)


# ----------------------------------------------------------------------------- worker side


def _worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of a worker process."""
    os.environ.update(WORKER_ENV)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = _load(spec)
        info = _info(engine, spec)
        _reset_peaks(spec.device)  # the snapshots' peaks are the runs', not the load's
        conn.send(("ready", info))
        from engine.serve.pipeline import StageFollower

        if isinstance(engine, StageFollower):  # a pipeline stage other than 0
            engine.serve()
            return
        _serve(engine, conn)
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    except BaseException:  # noqa: BLE001 - report everything, then exit non-zero
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1) from None


def _load(spec: WorkerSpec) -> Any:
    import torch

    device = torch.device(spec.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    if spec.mode == "pipeline":
        from engine.serve.pipeline import load_stage

        stage = (spec.rank, spec.world_size, spec.init_method, spec.nccl, spec.job_tokens)
        return load_stage(spec.config, spec.model, *stage)
    from engine.load import load_engine

    # a data worker holds host_pool_gb / world_size: its refusals name the user's total
    shares = spec.world_size if spec.mode == "data" else 1
    return load_engine(spec.config, spec.model, job_tokens=spec.job_tokens, pool_shares=shares)


def _info(engine: Any, spec: WorkerSpec) -> dict[str, Any]:
    """What a worker tells the parent once loaded (``ParallelEngine.workers[i].info``):
    its limits and shape, its layers, its budget split (``budget_sizing``, a dict of
    :class:`engine.capacity.budget.KVSizing`, or ``None``), and on CUDA the peaks of loading
    (``load_peak_allocated`` / ``load_peak_reserved``, bytes)."""
    from engine.serve.pipeline import StageFollower

    inner = engine.engine if isinstance(engine, StageFollower) else engine
    sizing = inner.budget_sizing
    info = {
        "pid": os.getpid(),
        "prompt_limit": inner.prompt_limit(),
        "model_config": inner.model_config,
        "model_name": inner.model_name,
        "weight_format": inner.weight_format,
        "weights_info": inner.weights_info,
        "layers": (inner.model.layer_range.start, inner.model.layer_range.stop),
        "max_batch": inner.config.max_batch,
        "host_pool_bytes": inner.cache.pool_bytes_total,
        "budget_sizing": sizing.to_dict() if sizing is not None else None,
        "trace_path": inner.config.trace_path,
    }
    import torch

    device = torch.device(spec.device)
    if device.type == "cuda":
        info["load_peak_allocated"] = torch.cuda.max_memory_allocated(device)
        info["load_peak_reserved"] = torch.cuda.max_memory_reserved(device)
    return info


def _reset_peaks(device_name: str) -> None:
    import torch

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _serve(engine: Any, conn: Connection) -> None:
    """Run one ``Engine.run`` per ``run`` command until ``exit``."""
    while True:
        kind, *_ = conn.recv()
        if kind == "exit":
            if hasattr(engine, "shutdown"):
                engine.shutdown()
            return
        if kind == "run":
            feed = _JobFeed(conn, engine)
            for event in engine.run(feed):
                feed.track(event)
                conn.send(("event", event))
                feed.pump(block=False)
            conn.send(("done",))
        # a "cancel" or "stop" arriving after a run ended is stale: ignore it


class _JobFeed:
    """A worker's view of the shared job queue, as the ``jobs`` iterable of ``Engine.run``.

    It asks the parent for one job at a time (``want``); while the engine has nothing
    running it blocks for the answer, otherwise it yields ``None`` and looks again on the
    next draw. ``stop`` (the sentinel) or ``cancel`` ends it.
    """

    def __init__(self, conn: Connection, engine: Any):
        self.conn, self.engine = conn, engine
        self.jobs: deque[ev.Job] = deque()
        self.active: set[str] = set()
        self.asked = False
        self.stopped = False

    def __iter__(self) -> Iterator[ev.Job | None]:
        while True:
            if self.jobs:
                yield self.jobs.popleft()
                continue
            if self.stopped:
                return
            if not self.asked:
                self.conn.send(("want",))
                self.asked = True
            self.pump(block=not self.active)
            if not self.jobs and not self.stopped:
                yield None

    def pump(self, block: bool) -> None:
        """Handle the parent's messages; with ``block`` wait for at least one."""
        while block or self.conn.poll():
            block = False
            kind, *args = self.conn.recv()
            if kind == "job":
                self.jobs.append(args[0])
                self.asked = False
            elif kind == "stop":
                self.stopped = True
            elif kind == "cancel":
                self.stopped = True
                self.engine.cancel()
            elif kind == "exit":  # the parent is closing mid-run
                raise SystemExit(0)

    def track(self, event: ev.Event) -> None:
        """Keep the set of this worker's jobs that are queued or running."""
        if isinstance(event, ev.JobQueued):
            self.active.add(event.job_id)
        elif isinstance(event, ev.JobFailed):
            self.active.discard(event.job_id)
        elif isinstance(event, ev.JobFinished):
            self.active.discard(event.result.job_id)


# ----------------------------------------------------------------------------- parent side


@dataclass(eq=False)
class _Worker:
    """The parent's handle on one worker process."""

    spec: WorkerSpec
    process: Any
    conn: Connection
    info: dict[str, Any] = field(default_factory=dict)
    alive: bool = True
    in_run: bool = False
    wants: bool = False
    jobs: set[str] = field(default_factory=set)
    error: str = ""

    @property
    def label(self) -> str:
        return self.spec.label

    def send(self, *message: Any) -> None:
        try:
            self.conn.send(message)
        except OSError:  # a dead worker; its sentinel reports it
            pass


class ParallelEngine:
    """Several worker processes behind the single-engine surface (module docstring).

    Parameters
    ----------
    config : the run settings (``device`` is replaced per worker); the engine's ``config``
        is them with the ``max_batch`` its workers admit once loaded
    model : model path, ``None`` for the embedded model, or ``synthetic:NAME``
    devices : one device per worker, e.g. ``["cuda:0", "cuda:1"]`` or ``["cpu", "cpu"]``
    mode : ``data`` or ``pipeline``
    tokenizer : reuse an already loaded tokenizer (default: load it from ``model``)
    job_tokens : the run's longest job (prompt + max_tokens), which a memory budget sizes
        each worker's requests for (:func:`engine.load.load_engine`); default the context
        limit

    Raises
    ------
    ConfigError
        Unknown mode, no device, or a pipeline of fewer than two devices.
    RuntimeError
        A worker failed to load (its error is in the message); the others are stopped.
    """

    def __init__(
        self,
        config: EngineConfig,
        model: str | None,
        devices: str | Iterable[str],
        mode: str = "data",
        tokenizer: Any = None,
        job_tokens: int | None = None,
    ):
        devices = parse_devices(devices)
        _check_layout(devices, mode)
        config.validate()
        self.config, self.model, self.devices, self.mode = config, model, devices, mode
        self.job_tokens = job_tokens
        self._cancel = False
        self._rendezvous = tempfile.mkdtemp(prefix="hisparse-dist-") if mode == "pipeline" else ""
        self._pool: dict[int, tuple[int, int, int]] = {}
        self.workers: list[_Worker] = []
        try:
            for rank in range(len(devices)):
                self.workers.append(self._start(rank))
            if tokenizer is None:
                from engine.load import load_tokenizer

                tokenizer = load_tokenizer(model, config.tokenizer)[0]
            self.tokenizer = tokenizer
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        info = self.workers[0].info
        # what the workers admit at once (a budget may size each below its share): the
        # stages agree on one; data workers add up, never past the max_batch asked for
        batches = [w.info["max_batch"] for w in self.workers]
        batch = batches[0] if mode == "pipeline" else sum(batches)
        self.config = config.replace(max_batch=min(config.max_batch, batch))
        self.model_config = info["model_config"]
        self.model_name = info["model_name"]
        self.weight_format = info["weight_format"]
        self.weights_info = info["weights_info"]
        self._prompt_limit = info["prompt_limit"]

    # ----- public API --------------------------------------------------------------
    @property
    def trace_paths(self) -> list[str]:
        """The workers' selection trace files (``--trace``), in worker order; empty
        without a trace. ``hisparse replay`` reads them together."""
        return [w.info["trace_path"] for w in self.workers if w.info.get("trace_path")]

    def prompt_limit(self) -> int:
        """Most tokens (prompt + max_tokens) a request may hold."""
        return self._prompt_limit

    def cancel(self) -> None:
        """Stop handing out jobs; running jobs end ``cancelled`` (safe in a signal handler)."""
        self._cancel = True

    def run(self, jobs: Iterable[ev.Job]) -> Iterator[ev.Event]:
        """Process ``jobs`` on the workers; yield their events as one stream."""
        source = iter(jobs)
        takers = self._takers()
        for w in takers:
            w.send("run")
            w.in_run, w.wants = True, False
        exhausted, cancel_sent = False, False
        try:
            while any(w.in_run for w in takers):
                if self._cancel and not cancel_sent:
                    cancel_sent = True
                    for w in takers:
                        if w.in_run:
                            w.send("cancel")
                yield from self._receive(takers)
                exhausted = yield from self._serve_wants(takers, source, exhausted)
        except BaseException:
            self.close()  # abandoned mid-run: the workers' state is unknown
            raise
        if not exhausted:
            yield from self._fail_unplaced(source)

    def close(self) -> None:
        """Stop every worker (``exit``, then terminate / kill stragglers); idempotent.

        Workers still inside a run (the run was abandoned) are killed: their state is
        unknown, and in a pipeline so is every stage's. Workers still loading (no
        ``ready`` yet: Ctrl-C during the load, or another worker failed to load) are
        terminated at once: they hold nothing to keep, and would read ``exit`` only once
        loaded (a Ctrl-C waited for every worker's whole load, up to
        :data:`JOIN_TIMEOUT_S`); a pipeline with a stage still loading never ran, so its
        loaded stages go too (an ``exit`` would wait on the missing stage).
        """
        abandoned = any(w.alive and w.in_run for w in self.workers)
        loading = any(w.alive and not w.info for w in self.workers)
        for w in self.workers:
            if not w.alive:
                continue
            if not w.info or (loading and self.mode == "pipeline"):
                w.process.terminate()
            elif abandoned and (self.mode == "pipeline" or w.in_run):
                w.process.kill()
            elif self.mode == "data" or w.spec.rank == 0:
                w.send("exit")  # stage 0 passes it on to the other stages
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for w in self.workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                w.process.terminate()
                w.process.join(2.0)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(2.0)
            w.alive = w.in_run = False
            w.conn.close()
        if self._rendezvous:
            shutil.rmtree(self._rendezvous, ignore_errors=True)
            self._rendezvous = ""

    def __enter__(self) -> ParallelEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- start-up ----------------------------------------------------------------
    def _start(self, rank: int) -> _Worker:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        device = self.devices[rank]
        spec = WorkerSpec(
            rank=rank,
            world_size=len(self.devices),
            device=device,
            mode=self.mode,
            config=worker_config(self.config, device, rank, self.devices, self.mode),
            model=self.model,
            init_method=f"file://{self._rendezvous}/store" if self._rendezvous else "",
            nccl=_use_nccl(self.devices) if self.mode == "pipeline" else False,
            job_tokens=self.job_tokens,
        )
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        process = ctx.Process(
            target=_worker_main, args=(spec, child_conn), name=f"hisparse-{spec.label}", daemon=True
        )
        process.start()
        child_conn.close()
        return _Worker(spec, process, parent_conn)

    def _wait_ready(self) -> None:
        waiting = {w.conn: w for w in self.workers}
        while waiting:
            ready = wait([*waiting, *(w.process.sentinel for w in waiting.values())])
            for w in list(waiting.values()):
                if w.conn in ready or w.process.sentinel in ready:
                    message = _recv(w)
                    if message is None or message[0] != "ready":
                        w.alive = False
                        raise RuntimeError(
                            f"{w.label} failed to start: {_death_reason(w, message)}"
                        )
                    w.info = message[1]
                    del waiting[w.conn]

    # ----- the run loop ------------------------------------------------------------
    def _takers(self) -> list[_Worker]:
        """Workers that take jobs: every live one (data) or stage 0 of an intact pipeline."""
        if self.mode == "pipeline":
            return self.workers[:1] if all(w.alive for w in self.workers) else []
        return [w for w in self.workers if w.alive]

    def _receive(self, takers: list[_Worker]) -> Iterator[ev.Event]:
        """Wait up to ``POLL_S`` for messages or deaths and handle them."""
        live = [w for w in self.workers if w.alive]
        ready = wait([*(w.conn for w in live), *(w.process.sentinel for w in live)], POLL_S)
        for w in live:
            if w.conn in ready:
                while w.alive and w.conn.poll():
                    message = _recv(w)
                    if message is None:
                        yield from self._on_death(w, None)
                        break
                    yield from self._on_message(w, message)
            if w.alive and w.process.sentinel in ready:
                yield from self._on_death(w, _drain(w))

    def _on_message(self, w: _Worker, message: tuple) -> Iterator[ev.Event]:
        kind = message[0]
        if kind == "want":
            w.wants = True
        elif kind == "done":
            w.in_run = w.wants = False
        elif kind == "error":
            w.error = message[1]
        elif kind == "event":
            yield from self._pass_event(w, message[1])

    def _pass_event(self, w: _Worker, event: ev.Event) -> Iterator[ev.Event]:
        if isinstance(event, ev.JobFinished):
            w.jobs.discard(event.result.job_id)
        elif isinstance(event, ev.JobFailed):
            w.jobs.discard(event.job_id)
        elif isinstance(event, ev.MemorySnapshot):
            event = self._relabel(w, event)
        yield event

    def _relabel(self, w: _Worker, snap: ev.MemorySnapshot) -> ev.MemorySnapshot:
        """Unique device names (``cuda:0#1`` when two workers share ``cuda:0``); host pool
        figures summed over the workers (a pipeline's stage 0 passes on every stage's
        snapshot, ``stage`` naming it)."""
        rank = snap.stage if snap.stage >= 0 else w.spec.rank
        self._pool[rank] = (snap.host_pool_used, snap.host_pool_total, snap.host_pool_pinned)
        device = snap.device
        if self.devices.count(self.devices[rank]) > 1:
            device = f"{snap.device}#{rank}"
        used, total, pinned = (sum(p[i] for p in self._pool.values()) for i in range(3))
        return dataclasses.replace(
            snap, device=device, host_pool_used=used, host_pool_total=total, host_pool_pinned=pinned
        )

    def _on_death(self, w: _Worker, pending: list[tuple] | None) -> Iterator[ev.Event]:
        """Report ``w``'s death (after the messages it sent first) and fail its jobs; in a
        pipeline every stage goes, and every stage that had ended is named."""
        for message in pending or ():
            yield from self._on_message(w, message)
        w.process.join(JOIN_TIMEOUT_S)
        lost = [w]
        if self.mode == "pipeline":
            time.sleep(POLL_S)  # let a stage that failed because of w end too
            for v in self.workers:
                if v is w or not v.alive:
                    continue
                if v.process.is_alive():
                    v.process.kill()
                    v.process.join(JOIN_TIMEOUT_S)
                else:
                    lost.append(v)
                for message in _drain(v):  # stage 0's last events, a stage's error
                    yield from self._on_message(v, message)
        error = "; ".join(f"{v.label} died: {_death_reason(v, None)}" for v in lost)
        held = sorted(
            {j for v in self.workers for j in v.jobs} if self.mode == "pipeline" else w.jobs
        )
        for v in self.workers if self.mode == "pipeline" else [w]:
            v.alive = v.in_run = v.wants = False
            v.jobs.clear()
        now = time.monotonic()
        yield WorkerDied(now, w.spec.rank, w.spec.device, error, tuple(held))
        for job_id in held:
            yield ev.JobFailed(now, job_id, f"{error} (the job was not re-queued)")

    def _serve_wants(
        self, takers: list[_Worker], source: Iterator[ev.Job], exhausted: bool
    ) -> Iterator[ev.Event]:
        """Answer each worker's request with the next job, or ``stop`` when there is none."""
        for w in takers:
            if not (w.alive and w.in_run and w.wants):
                continue
            w.wants = False
            job = None if exhausted or self._cancel else next(source, None)
            if job is None:
                exhausted = exhausted or not self._cancel
                w.send("stop")
                continue
            w.jobs.add(job.id)
            yield JobPlaced(time.monotonic(), job.id, w.spec.rank, w.spec.device)
            w.send("job", job)
        return exhausted

    def _fail_unplaced(self, source: Iterator[ev.Job]) -> Iterator[ev.Event]:
        """Jobs never handed out: cancelled, or no worker was left to take them."""
        if self._cancel:
            error = "cancelled before admission"
        else:
            dead = "; ".join(f"{w.label} died" for w in self.workers if not w.alive)
            error = f"not run: no worker left ({dead or 'none started'})"
        for job in source:
            yield ev.JobFailed(time.monotonic(), job.id, error)


def run_parallel(
    config: EngineConfig,
    model: str | None,
    devices: list[str],
    mode: str,
    jobs: Iterable[ev.Job],
) -> Iterator[ev.Event]:
    """Start the workers, process ``jobs``, yield the merged events, stop the workers."""
    with ParallelEngine(config, model, devices, mode) as engine:
        yield from engine.run(jobs)


def _check_layout(devices: list[str], mode: str) -> None:
    if mode not in MODES:
        raise ConfigError(f"parallel={mode!r} is not one of {', '.join(MODES)}")
    if not devices:
        raise ConfigError("devices: give at least one device")
    if mode == "pipeline" and len(devices) < 2:
        raise ConfigError("parallel=pipeline needs at least two devices")


def _use_nccl(devices: list[str]) -> bool:
    """NCCL for activations when every stage has a GPU of its own (NCCL refuses two ranks
    on one GPU); gloo otherwise."""
    gpus = [d if ":" in d else f"{d}:0" for d in devices]
    return all(d.startswith("cuda") for d in gpus) and len(set(gpus)) == len(gpus)


def _drain(w: _Worker) -> list[tuple]:
    """Messages a dead worker sent before it ended (they are still in the pipe)."""
    messages = []
    while True:
        try:
            if not w.conn.poll():
                return messages
        except OSError:
            return messages
        message = _recv(w)
        if message is None:
            return messages
        messages.append(message)


def _recv(w: _Worker) -> tuple | None:
    """One message from ``w``; ``None`` when its pipe is closed or a message was cut off."""
    try:
        return w.conn.recv()
    except Exception:  # noqa: BLE001 - EOF, or an unpickling error of a message cut off by a kill
        return None


def _death_reason(w: _Worker, message: tuple | None) -> str:
    """Why ``w`` ended: its error's last line, the signal that killed it, or its exit code."""
    if message is not None and message[0] == "error":
        w.error = message[1]
    if w.error:
        lines = [line for line in w.error.strip().splitlines() if line.strip()]
        return lines[-1] if lines else "error"
    w.process.join(JOIN_TIMEOUT_S)
    code = w.process.exitcode
    if code is None:
        return "stopped responding"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
