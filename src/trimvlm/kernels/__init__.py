"""Neutral numeric kernels that `tokens/`, `kv/`, `depth/` and `router/` share (methods never import each other):
density and farthest-point selection, merges, top-k masks and budgets, and the method-FLOP counter."""

from trimvlm.kernels.density import farthest_point, masked_minmax, spatial_density
from trimvlm.kernels.flops import count, counting
from trimvlm.kernels.merge import best_match, merge_groups, nearest_kept
from trimvlm.kernels.select import keep_count, topk_mask

__all__ = [
    "best_match",
    "count",
    "counting",
    "farthest_point",
    "keep_count",
    "masked_minmax",
    "merge_groups",
    "nearest_kept",
    "spatial_density",
    "topk_mask",
]
