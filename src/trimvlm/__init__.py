"""trimvlm: cheaper VLM inference without retraining, with honest measurements."""

from trimvlm.errors import TrimVLMError
from trimvlm.recipe import Recipe, parse_recipe
from trimvlm.vlm import VLM, GenerationResult, load

__version__ = "0.1.0"
__all__ = ["VLM", "GenerationResult", "Recipe", "TrimVLMError", "__version__", "load", "parse_recipe"]
