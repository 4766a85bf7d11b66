"""Prefill visual-token reducers (`tokens=` in a recipe). Importing this package registers every method in
trimvlm.registry: density (TwinPrune), divprune, fastv, tome, dart, prumerge, random. See docs/tokens.md."""

from trimvlm.tokens import dart, density, divprune, fastv, prumerge, random, tome, visionzip  # noqa: F401
from trimvlm.tokens.base import Selection, TokenReducer, VisualView  # noqa: F401
