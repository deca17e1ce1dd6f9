"""The Quest selection ops under their former module name: page scores
(:mod:`kernels.quest_scores`), the oracle's exact scores (:mod:`kernels.oracle_scores`) and
top-k selection (:mod:`kernels.select_topk`), one op per module since issue #18. Import
from those modules in new code."""

from kernels.oracle_scores import oracle_scores_ref
from kernels.quest_scores import (
    GROUP_COMBINES,
    combine_group_ref,
    quest_head_bounds_ref,
    quest_scores,
    quest_scores_ref,
)
from kernels.select_topk import dense_selection, select_topk, select_topk_ref

__all__ = [
    "GROUP_COMBINES",
    "combine_group_ref",
    "dense_selection",
    "oracle_scores_ref",
    "quest_head_bounds_ref",
    "quest_scores",
    "quest_scores_ref",
    "select_topk",
    "select_topk_ref",
]
