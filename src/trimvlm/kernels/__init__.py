"""Neutral numeric kernels that `tokens/`, `kv/`, `depth/` and `router/` share (methods never import each other):
density and farthest-point selection, merges, top-k masks and budgets, and the method-FLOP counter."""

from trimvlm.kernels.density import farthest_point, masked_minmax, spatial_density
from trimvlm.kernels.merge import merge_groups
from trimvlm.kernels.select import topk_mask

__all__ = ["farthest_point", "masked_minmax", "merge_groups", "spatial_density", "topk_mask"]
