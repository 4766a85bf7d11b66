"""Layer plans (`depth=` in a recipe): which decoder blocks to skip, and in which phase (scope)."""

from trimvlm.depth import random, ranking, skip, tail  # noqa: F401  (registers the methods)
