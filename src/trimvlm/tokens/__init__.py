"""Prefill visual-token reducers (`tokens=` in a recipe). Importing this package registers every method in
trimvlm.registry: density (TwinPrune), divprune, fastv, tome, dart, prumerge, visionzip, random, pool, cdpruner,
holov, downsample. See docs/tokens.md."""

from trimvlm.tokens import (  # noqa: F401
    cdpruner,
    dart,
    density,
    divprune,
    downsample,
    fastv,
    holov,
    pool,
    prumerge,
    random,
    sparsevlm,
    tome,
    visionzip,
)
from trimvlm.tokens.base import Selection, TokenReducer, VisualView  # noqa: F401
