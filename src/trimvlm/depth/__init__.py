"""Layer plans (`depth=` in a recipe): which decoder blocks to skip, and in which phase (scope)."""

from trimvlm.depth import block_influence, greedy_kl, random, ranking, sensitivity, skip, tail  # noqa: F401  (registers the methods)  # noqa: F401  (registers the rankers)
