"""Pick the kernel set for a device: Triton on CUDA, the PyTorch references elsewhere
(on a CPU device :data:`CPU_OPS`: the references with Quest's bounds as one GEMM).

The engine calls only :func:`get_ops`; every field of :class:`Ops` has the signature of
the matching ``*_ref`` function. The eviction policy is a seam: :data:`RESOLVERS` maps a
policy name (``EngineConfig.eviction``) to its resolve step, a reference and a kernel of
:func:`kernels.resolve.resolve_ref`'s signature; a new policy is one entry here plus its
two functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.append_kv import append_kv_ref
from kernels.gather import gather_ref
from kernels.oracle_scores import oracle_scores_ref
from kernels.quest_scores import quest_scores_matmul, quest_scores_ref
from kernels.resolve import resolve_ref
from kernels.rope_append import rope_append_ref
from kernels.select_topk import dense_selection, select_topk_ref
from kernels.slot_list import resident_slot_list
from kernels.sparse_attention import dense_decode_attention_ref, sparse_decode_attention_ref
from kernels.superpage_select import superpage_select_ref


@dataclass(frozen=True)
class Ops:
    """One implementation of each decode hot-path op (see the ``*_ref`` docstrings)."""

    name: str
    quest_scores: Callable
    oracle_scores: Callable
    select_topk: Callable
    superpage_select: Callable
    dense_selection: Callable
    resolve: Callable
    resident_slot_list: Callable
    gather: Callable
    sparse_decode_attention: Callable
    dense_decode_attention: Callable
    append_kv: Callable
    rope_append: Callable


REFERENCE_OPS = Ops(
    name="reference",
    quest_scores=quest_scores_ref,
    oracle_scores=oracle_scores_ref,
    select_topk=select_topk_ref,
    superpage_select=superpage_select_ref,
    dense_selection=dense_selection,
    resolve=resolve_ref,
    resident_slot_list=resident_slot_list,
    gather=gather_ref,
    sparse_decode_attention=sparse_decode_attention_ref,
    dense_decode_attention=dense_decode_attention_ref,
    append_kv=append_kv_ref,
    rope_append=rope_append_ref,
)

CPU_OPS = dataclasses.replace(REFERENCE_OPS, name="cpu", quest_scores=quest_scores_matmul)
"""The CPU path: :data:`REFERENCE_OPS` but for Quest's scores, computed as one GEMM per
(request, KV head) (:func:`kernels.quest_scores.quest_scores_matmul`: the same values up to
float32 summation order, ~3.5x faster on the CPU); the reference stays the oracle. The
hierarchical and the direct paths both run it, so they still agree bit for bit. (torch's
fused CPU attention in place of the reference's was measured and dropped: ~10% faster a
layer at 1 thread, ~10% slower a step at 2; docs/performance.md, "CPU decode: int4
products".)"""

PYTORCH_OPS = ("reference", "cpu")
"""Names of the kernel sets made of PyTorch ops (no Triton): :data:`REFERENCE_OPS`, :data:`CPU_OPS`."""


def _lru_triton() -> Callable:
    from kernels.resolve import resolve

    return resolve


RESOLVERS: dict[str, tuple[Callable, Callable[[], Callable]]] = {
    "lru": (resolve_ref, _lru_triton),
}
"""Eviction policy -> (reference resolve, loader of its Triton kernel)."""


def get_ops(
    device: torch.device | str, use_triton: bool | None = None, eviction: str = "lru"
) -> Ops:
    """Kernel set for ``device``.

    Parameters
    ----------
    device : compute device
    use_triton : ``None`` picks Triton exactly when ``device`` is CUDA; ``True`` forces it
        (e.g. under ``TRITON_INTERPRET=1`` in tests); ``False`` forces the PyTorch ops
        (:data:`CPU_OPS` on a CPU device, :data:`REFERENCE_OPS` elsewhere).
    eviction : the resolve step's eviction policy, a key of :data:`RESOLVERS`

    Raises
    ------
    ValueError
        An unknown eviction policy (naming the known ones).
    """
    if eviction not in RESOLVERS:
        raise ValueError(f"unknown eviction policy {eviction!r}; known: {', '.join(RESOLVERS)}")
    device = torch.device(device)
    if use_triton is None:
        use_triton = device.type == "cuda"
    ref, triton = RESOLVERS[eviction]
    if not use_triton:
        ops = CPU_OPS if device.type == "cpu" else REFERENCE_OPS
        return ops if ops.resolve is ref else dataclasses.replace(ops, resolve=ref)
    from kernels.triton_ops import TRITON_OPS

    kernel = triton()
    return TRITON_OPS if TRITON_OPS.resolve is kernel else dataclasses.replace(TRITON_OPS, resolve=kernel)
