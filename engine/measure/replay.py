"""Replay selection traces (:mod:`engine.measure.trace`) through hot-buffer policies.

Each (job, seq, layer, KV head) of a trace is one *stream*: per decode step, the set of
pages the indexer selected. A stream owns ``capacity`` slots, as a slab of the hot buffer
does (DESIGN.md). Each step, a selected page already in a slot is a **hit**; every other
selected page is a **miss** and takes a slot that holds no page selected in this step
(a page selected in the step is never evicted; misses are assigned in ascending page
order). Empty slots go first under every policy. Policies differ in which occupied,
unselected slot is evicted:

* ``lru`` — exactly :func:`kernels.resolve.resolve_ref`: hits refresh their slot's
  last-use step; victims in order of (last-use step, slot index) ascending. Replaying a
  trace with the engine's ``device_buffer`` gives the engine's own hit and miss counts.
* ``fifo`` — the earliest-loaded page first (hits do not refresh), ties by slot index.
* ``random`` — uniformly at random (``random.Random`` seeded per stream from ``seed``
  and the stream key, so results do not depend on stream order).
* ``belady`` — the page whose next selection in the stream is farthest in the future
  (never again counts as infinitely far), ties by slot index: Bélády's optimal offline
  policy, the lower bound on misses for this capacity.

Rates are per selected page: ``miss_rate = misses / accesses`` and
``warm_miss_rate = (misses - cold_misses) / accesses``, where a *cold* miss is the first
selection of a page in its stream (every policy pays it: slabs start empty).
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.measure.trace import TraceHeader, TraceRecord, read_traces

POLICIES = ("lru", "fifo", "random", "belady")

StreamKey = tuple[str, int, int, int]
"""(job, seq, layer, KV head)."""


@dataclass(frozen=True)
class ReplayResult:
    """Totals of one policy at one capacity over all streams of a trace.

    accesses: selected pages summed over streams and steps (records, as the engine's
    ``CacheStats.hits + misses``).
    """

    policy: str
    capacity_pages: int
    num_streams: int
    accesses: int
    misses: int
    cold_misses: int

    @property
    def hits(self) -> int:
        return self.accesses - self.misses

    @property
    def miss_rate(self) -> float:
        return self.misses / self.accesses if self.accesses else 0.0

    @property
    def warm_miss_rate(self) -> float:
        """Misses other than first selections, per selected page."""
        return (self.misses - self.cold_misses) / self.accesses if self.accesses else 0.0

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "hits": self.hits,
            "miss_rate": self.miss_rate,
            "warm_miss_rate": self.warm_miss_rate,
        }


def load_streams(records: Iterable[TraceRecord]) -> dict[StreamKey, list[list[int]]]:
    """Group trace records into streams: key -> selected pages per step, in trace order."""
    streams: dict[StreamKey, list[list[int]]] = {}
    for r in records:
        for head in range(len(r.words)):
            streams.setdefault((r.job, r.seq, r.layer, head), []).append(r.pages(head))
    return streams


def replay_stream(
    steps: Sequence[Iterable[int]],
    capacity: int,
    policy: str,
    rng: random.Random | None = None,
) -> tuple[int, int, int]:
    """Replay one stream.

    Parameters
    ----------
    steps : per step, the selected pages (duplicates count once)
    capacity : C, slots of the stream
    policy : one of :data:`POLICIES`
    rng : random source of the ``random`` policy (default ``random.Random(0)``)

    Returns
    -------
    (accesses, misses, cold_misses)

    Raises
    ------
    ValueError
        Unknown policy, or a step selecting more than ``capacity`` pages.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
    sets = [set(s) for s in steps]
    future = _use_steps(sets) if policy == "belady" else {}
    rng = rng or random.Random(0)
    slot_page = [-1] * capacity
    stamp = [-1] * capacity  # lru: last-use step; fifo: load step; -1 when empty
    where: dict[int, int] = {}
    seen: set[int] = set()
    accesses = misses = cold = 0
    for t, sel in enumerate(sets):
        if len(sel) > capacity:
            raise ValueError(f"step {t} selects {len(sel)} pages but capacity is {capacity}")
        missed = sorted(p for p in sel if p not in where)
        accesses += len(sel)
        misses += len(missed)
        cold += len(sel - seen)
        seen |= sel
        if policy == "lru":
            for p in sel:
                if p in where:
                    stamp[where[p]] = t
        if not missed:
            continue
        free = [s for s in range(capacity) if slot_page[s] not in sel]
        victims = _victims(policy, free, len(missed), slot_page, stamp, t, rng, future)
        for p, s in zip(missed, victims, strict=True):
            if slot_page[s] >= 0:
                del where[slot_page[s]]
            slot_page[s], stamp[s], where[p] = p, t, s
    return accesses, misses, cold


def _victims(policy, free, m, slot_page, stamp, t, rng, future) -> list[int]:
    """``m`` slots out of ``free`` (unselected slots, ascending) in eviction order."""
    if policy in ("lru", "fifo"):
        return heapq.nsmallest(m, free, key=lambda s: (stamp[s], s))
    empty = [s for s in free if slot_page[s] < 0]
    if len(empty) >= m:
        return empty[:m]
    occupied = [s for s in free if slot_page[s] >= 0]
    if policy == "random":
        return empty + rng.sample(occupied, m - len(empty))
    return empty + heapq.nsmallest(
        m - len(empty), occupied, key=lambda s: (-_next_use(future, slot_page[s], t), s)
    )


def _use_steps(sets: Sequence[set[int]]) -> dict[int, list[int]]:
    """Page -> ascending steps at which it is selected."""
    uses: dict[int, list[int]] = {}
    for t, sel in enumerate(sets):
        for p in sel:
            uses.setdefault(p, []).append(t)
    return uses


def _next_use(future: Mapping[int, list[int]], page: int, t: int) -> float:
    steps = future.get(page, [])
    i = bisect.bisect_right(steps, t)
    return steps[i] if i < len(steps) else math.inf


def replay(
    streams: Mapping[StreamKey, Sequence[Iterable[int]]],
    capacity: int,
    policy: str,
    seed: int = 0,
) -> ReplayResult:
    """Replay every stream with ``capacity`` slots under ``policy``; totals."""
    accesses = misses = cold = 0
    for key, steps in streams.items():
        rng = random.Random(f"{seed}:{key}") if policy == "random" else None
        a, m, c = replay_stream(steps, capacity, policy, rng)
        accesses, misses, cold = accesses + a, misses + m, cold + c
    return ReplayResult(policy, capacity, len(streams), accesses, misses, cold)


def capacities_from_multiples(header: TraceHeader, multiples: Iterable[float]) -> list[int]:
    """Capacities in pages: ``multiple x top_k_pages``, rounded to the nearest page."""
    return [max(1, round(m * header.top_k_pages)) for m in multiples]


def replay_trace(
    path: str | Path | Sequence[str | Path],
    capacities: Sequence[int],
    policies: Sequence[str] = POLICIES,
    seed: int = 0,
) -> tuple[TraceHeader, list[ReplayResult]]:
    """Read a trace once and replay it for each (policy, capacity), policies outermost.

    ``path`` may list the files of one run on several devices (one per worker, see
    :func:`engine.measure.trace.read_traces`); they are replayed as one trace.

    Raises
    ------
    ValueError
        Not a trace, headers that disagree, unknown policy, or a capacity below some
        step's selection.
    """
    paths = [path] if isinstance(path, (str, Path)) else list(path)
    header, records = read_traces(paths)
    streams = load_streams(records)
    results = [replay(streams, c, p, seed) for p in policies for c in capacities]
    return header, results
