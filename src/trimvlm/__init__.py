"""trimvlm: cheaper VLM inference without retraining, with honest measurements."""

from trimvlm.errors import TrimVLMError
from trimvlm.recipe import Recipe, parse_recipe
from trimvlm.vlm import VLM, GenerationResult, load


def evaluate(vlm, task="demo", recipes=None, **kw):
    """Run recipes (baseline always first) over a task: accuracy, mismatch vs uncompressed, costs."""
    from trimvlm.evals.run import run_eval

    return run_eval(vlm, task, recipes, **kw)


__version__ = "0.1.0"
__all__ = [
    "VLM",
    "GenerationResult",
    "Recipe",
    "TrimVLMError",
    "__version__",
    "evaluate",
    "load",
    "parse_recipe",
]
