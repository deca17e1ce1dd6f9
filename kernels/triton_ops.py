"""The Triton kernel set, :data:`TRITON_OPS`, that :func:`kernels.dispatch.get_ops` returns
for CUDA devices (or on the CPU under ``TRITON_INTERPRET=1``, in tests).

Every op keeps its reference's signature. The decode hot path (append or RoPE + append,
Quest scores, top-k selection, two-level superpage selection, resolve, gather, sparse attention, all-resident slot lists)
runs without host synchronisation, so a decode step can be captured in a CUDA graph;
``oracle_scores`` (evaluation only) stays the PyTorch reference. ``dense_decode_attention`` is the sparse
kernel with every page selected, read in place (the dense baseline; the SDPA reference
stays the independent check in tests).
"""

from __future__ import annotations

from kernels.append_kv import append_kv
from kernels.dispatch import Ops
from kernels.gather import gather
from kernels.oracle_scores import oracle_scores_ref
from kernels.quest_scores import quest_scores
from kernels.resolve import resolve
from kernels.rope_append import rope_append
from kernels.select_topk import dense_selection, select_topk
from kernels.slot_list import resident_slot_list_triton
from kernels.sparse_attention import dense_decode_attention, sparse_decode_attention
from kernels.superpage_select import superpage_select

TRITON_OPS = Ops(
    name="triton",
    quest_scores=quest_scores,
    oracle_scores=oracle_scores_ref,
    select_topk=select_topk,
    superpage_select=superpage_select,
    dense_selection=dense_selection,
    resolve=resolve,
    resident_slot_list=resident_slot_list_triton,
    gather=gather,
    sparse_decode_attention=sparse_decode_attention,
    dense_decode_attention=dense_decode_attention,
    append_kv=append_kv,
    rope_append=rope_append,
)
