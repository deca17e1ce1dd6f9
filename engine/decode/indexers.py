"""The indexers: what picks the pages each KV head reads in a decode step.

One registry (:data:`INDEXERS`, keyed by ``EngineConfig.indexer``) holds every fact the
rest of the engine asks about an indexer: whether it ranks pages at all, whether its
scores read the host pool's records (so the step's pool writes must land first), and
whether it runs without host synchronisation (CUDA-graph safe). Adding an indexer is one
entry here plus its scoring kernel (``kernels/``, with its ``*_ref`` twin in
:class:`kernels.dispatch.Ops`); the step (:class:`engine.decode.attention.DecodeAttention`),
the CUDA graphs, the scheduler's checks and the config's validation read this table.

Torch-free at import (the config validates names against it before torch loads).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from engine.decode.attention import StepPlan
    from engine.kv.cache import KVCache

ScoreFn = Callable[..., "torch.Tensor"]
"""``(ops, cache, plan, layer, q, config, scale) -> float32 [B, Hkv, P_max]`` page scores
(``-inf`` past each request's pages); ``q`` is ``[B, Hq, D]`` after RoPE."""


@dataclass(frozen=True)
class Indexer:
    """One page-selection rule.

    Attributes
    ----------
    name : the ``indexer`` setting
    ranks : scores pages and keeps the top ``top_k`` (with sinks and the local window);
        ``False``: selects every page (needs a budget covering the whole context)
    reads_pool : its scores read the records in the pool (not the page metadata), so
        the step's new token must be in the pool before scoring
    graph_safe : runs without host synchronisation (a decode step with it can be a CUDA
        graph)
    score : page scores (see :data:`ScoreFn`); ``None`` when ``ranks`` is ``False``
    """

    name: str
    ranks: bool
    reads_pool: bool
    graph_safe: bool
    score: ScoreFn | None


def _quest(ops: Any, cache: KVCache, plan: StepPlan, layer: int, q, config, scale: float):
    """Quest's upper bound from each page's key min/max (Tang et al. 2024,
    arXiv:2406.10774), the query heads of a GQA group combined by ``config.group_combine``
    (:func:`kernels.quest_scores.quest_scores_ref`)."""
    meta = cache.meta[layer]
    return ops.quest_scores(
        q, meta, plan.block_table, plan.num_pages, config.group_combine, scale
    )


def _oracle(ops: Any, cache: KVCache, plan: StepPlan, layer: int, q, config, scale: float):
    """Exact attention logits, the best top-k any bound can approach (evaluation only)."""
    return ops.oracle_scores(q, cache.pool[layer], plan.block_table, plan.seq_lens, scale)


INDEXERS: dict[str, Indexer] = {
    "quest": Indexer("quest", ranks=True, reads_pool=False, graph_safe=True, score=_quest),
    "dense": Indexer("dense", ranks=False, reads_pool=False, graph_safe=True, score=None),
    "oracle": Indexer("oracle", ranks=True, reads_pool=True, graph_safe=False, score=_oracle),
}
"""Indexer name -> :class:`Indexer`."""


def get(name: str) -> Indexer:
    """The indexer called ``name``.

    Raises
    ------
    KeyError
        An unknown name (naming the known ones); ``EngineConfig.validate`` reports it first.
    """
    try:
        return INDEXERS[name]
    except KeyError:
        raise KeyError(f"unknown indexer {name!r}; known: {', '.join(INDEXERS)}") from None
