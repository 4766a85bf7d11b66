"""Prefill visual-token reducers (`tokens=` in a recipe), one per module. Importing this package imports every
module in it (`protocol.discover`: no list kept by hand), and each registers its method in trimvlm.registry.
See docs/tokens.md."""

from trimvlm.protocol import discover
from trimvlm.tokens.base import Selection, TokenReducer, VisualView  # noqa: F401

discover(__name__)
