"""Time the phases of a decode step without touching the normal path.

:func:`timed_ops` wraps every op of a :class:`kernels.dispatch.Ops` set and
:func:`timed_model` every linear layer of a :class:`engine.model.LlamaModel` (a shallow
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

from engine.model import LlamaModel
from engine.quant import Linear
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
    "dense_selection": "select",
    "resident_slot_list": "select",
    "append_kv": "append",
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
