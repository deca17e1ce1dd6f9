"""Time the phases of a decode step without touching the normal path.

:func:`timed_ops` wraps every op of a :class:`kernels.dispatch.Ops` set and
:func:`timed_model` every linear layer of a :class:`engine.model.llama.LlamaModel` (a shallow
copy; the weights are shared) with a :class:`PhaseTimer`: CUDA events around each call on
CUDA (GPU time between the events, read after a synchronisation), ``perf_counter``
elsewhere. An engine built on them (sharing the measured engine's cache) gives the
breakdown; the engine that is timed for throughput keeps the plain ops.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from engine.model.llama import LlamaModel
from engine.weights.quant import Linear
from kernels.dispatch import Ops


class PhaseTimer:
    """Accumulates time per phase of wrapped calls: CUDA events on CUDA (GPU time between
    the events), ``perf_counter`` elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self._events: list[tuple[str, Any, Any]] = []
        self._cpu_ms: dict[str, float] = defaultdict(float)

    def wrap(self, phase: str, fn: Callable) -> Callable:
        """``fn`` timed under ``phase``."""

        def timed(*args, **kwargs):
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn(*args, **kwargs)
                end.record()
                self._events.append((phase, start, end))
                return out
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self._cpu_ms[phase] += (time.perf_counter() - t0) * 1e3
            return out

        return timed

    def totals_ms(self) -> dict[str, float]:
        """Milliseconds per phase since :meth:`reset` (synchronises the device)."""
        if not self.cuda:
            return dict(self._cpu_ms)
        torch.cuda.synchronize()
        out: dict[str, float] = defaultdict(float)
        for phase, start, end in self._events:
            out[phase] += start.elapsed_time(end)
        return dict(out)


class TimedLinear(Linear):
    """A linear layer whose calls are timed under ``weights``; attributes pass through."""

    def __init__(self, inner: Linear, timer: PhaseTimer):
        self.inner = inner
        self.call = timer.wrap("weights", inner.__call__)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(x)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes


OP_PHASES = {
    "sparse_decode_attention": "attention",
    "dense_decode_attention": "attention",
    "quest_scores": "select",
    "oracle_scores": "select",
    "select_topk": "select",
    "superpage_select": "select",
    "dense_selection": "select",
    "resident_slot_list": "select",
    "append_kv": "append",
    "rope_append": "append",  # the decode append with the RoPE of q and k fused in
    "resolve": "resolve",
    "gather": "gather",
}
PHASES = ("weights", "attention", "select", "append", "resolve", "gather")


def timed_ops(ops: Ops, timer: PhaseTimer) -> Ops:
    """A copy of ``ops`` with every op wrapped by ``timer`` (the normal set is untouched)."""
    wrapped = {name: timer.wrap(phase, getattr(ops, name)) for name, phase in OP_PHASES.items()}
    return dataclasses.replace(ops, name=f"{ops.name}+timed", **wrapped)


def timed_model(model: LlamaModel, timer: PhaseTimer) -> LlamaModel:
    """A shallow copy of ``model`` whose linears (and LM head) are timed."""
    proxy = copy.copy(model)
    names = ("wqkv", "wo", "w_gate_up", "w_down")
    proxy.layers = []
    for layer in model.layers:
        timed: dict[str, Any] = {f: TimedLinear(getattr(layer, f), timer) for f in names}
        proxy.layers.append(dataclasses.replace(layer, **timed))
    if model.lm_head is not None:
        proxy.lm_head = TimedLinear(model.lm_head, timer)
    return proxy


# Kernel-name patterns -> phase, for steps replayed from CUDA graphs (where the per-op
# CUDA events above cannot be placed): first match wins, lower-case substring match.
KERNEL_PHASES: tuple[tuple[str, str], ...] = (
    ("_sparse_decode_", "attention"),
    ("_quest_scores_kernel", "select"),
    ("_normmax_kernel", "select"),  # the group combine of the Quest bounds
    ("_topk_key_kernel", "select"),
    ("_select_pack_kernel", "select"),
    ("_normmax_rows_kernel", "select"),
    ("_refresh_tail_kernel", "select"),  # superpage selection (kernels/superpage_select.py)
    ("_candidate_bounds_kernel", "select"),
    ("_candidate_key_kernel", "select"),
    ("_forced_words_kernel", "select"),
    ("_pick_kernel", "select"),
    ("_top_superpages_kernel", "select"),
    ("_pick_candidates_kernel", "select"),
    ("_resident_slot_list_kernel", "select"),
    ("topk", "select"),
    ("radixsortkvinplace", "select"),  # torch.topk's sort of the selection keys
    ("_append_kv_kernel", "append"),
    ("_rope_append_kernel", "append"),
    ("_resolve_kernel", "resolve"),
    ("_gather_kernel", "gather"),
    ("_gather_fp8_kernel", "gather"),  # fp8 records dequantised as gathered
    ("_group_int4_linear_kernel", "weights"),
    ("int4", "weights"),
    ("tinygemm", "weights"),
    ("gemm", "weights"),
    ("gemv", "weights"),
    ("cutlass", "weights"),
    ("nvjet", "weights"),
    ("sm90_", "weights"),
)


def kernel_phase(name: str) -> str:
    """The phase of a GPU kernel by its name (:data:`KERNEL_PHASES`); ``other`` for the
    rest (norms, RoPE, embedding, casts, argmax)."""
    low = name.lower()
    return next((phase for pat, phase in KERNEL_PHASES if pat in low), "other")


def kernel_breakdown(run_step: Callable[[], None], steps: int) -> dict[str, Any]:
    """Per-step GPU kernel time by phase over ``steps`` calls of ``run_step`` (which may
    replay a CUDA graph), from the PyTorch profiler's CUDA kernel records (CUPTI).

    Returns ``{"breakdown_ms": {phase: ms per step, ..., "other": ..., "gpu_busy": sum of
    kernel time, "idle": wall - busy (launch gaps, host work), "total": wall ms per
    step}, "kernels": [(name, ms per step), ...] top 12, "all_kernels": [(name, phase, ms
    per step, launches per step), ...] every kernel, longest first, "alone_ms": {phase: ms
    per step during which only that phase's kernels run}, "active_ms": ms per step during
    which any kernel runs}``. Kernels on different streams that overlap are each counted
    in full in ``breakdown_ms``, so ``gpu_busy`` may exceed ``total``; ``alone_ms`` is what
    overlap leaves exposed (a gather running with no other chain's kernel beside it).
    """
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            run_step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    per_kernel: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    spans: list[tuple[float, float, str]] = []
    for evt in prof.events():
        if getattr(evt, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        per_kernel[evt.name] += evt.time_range.elapsed_us() / 1e3 / steps
        launches[evt.name] += 1
        low = evt.name.lower()
        phase = "other" if "memcpy" in low or "memset" in low else kernel_phase(evt.name)
        spans.append((evt.time_range.start, evt.time_range.end, phase))
    alone_us, active_us = exclusive_time(spans)
    phases: dict[str, float] = dict.fromkeys((*PHASES, "other"), 0.0)
    for name, ms in per_kernel.items():
        if "memcpy" in name.lower() or "memset" in name.lower():
            phases["other"] += ms
            continue
        phases[kernel_phase(name)] += ms
    busy = sum(phases.values())
    phases.update(gpu_busy=busy, idle=max(wall_ms - busy, 0.0), total=wall_ms)
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1])
    every = [
        (n[:120], kernel_phase(n), round(ms, 4), round(launches[n] / steps, 2)) for n, ms in ranked
    ]
    return {
        "breakdown_ms": phases,
        "kernels": [(n[:80], round(ms, 4)) for n, ms in ranked[:12]],
        "all_kernels": every,
        "alone_ms": {p: round(us / 1e3 / steps, 4) for p, us in sorted(alone_us.items())},
        "active_ms": round(active_us / 1e3 / steps, 4),
    }


def exclusive_time(spans: list[tuple[float, float, str]]) -> tuple[dict[str, float], float]:
    """Sweep kernel intervals ``[(start, end, phase), ...]`` (any time unit): the time
    during which only one phase's kernels run, per phase, and the time any kernel runs.

    >>> exclusive_time([(0, 4, "gather"), (2, 6, "attention"), (8, 9, "gather")])
    ({'gather': 3.0, 'attention': 2.0}, 7.0)
    """
    edges = sorted(
        [(s, 1, p) for s, e, p in spans if e > s] + [(e, -1, p) for s, e, p in spans if e > s],
        key=lambda x: (x[0], x[1]),
    )
    running: dict[str, int] = defaultdict(int)
    alone: dict[str, float] = defaultdict(float)
    active = 0.0
    last = None
    for t, delta, phase in edges:
        if last is not None and t > last:
            live = [p for p, n in running.items() if n > 0]
            if live:
                active += t - last
                if len(live) == 1:
                    alone[live[0]] += t - last
        running[phase] += delta
        last = t
    return dict(alone), float(active)
