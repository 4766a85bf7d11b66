"""trimvlm: cheaper VLM inference without retraining, with honest measurements."""

from trimvlm.errors import TrimVLMError
from trimvlm.recipe import Recipe, parse_recipe
from trimvlm.vlm import VLM, GenerationResult, load


def evaluate(vlm, task="demo", recipes=None, **kw):
    """Run recipes (baseline always first) over a task: accuracy, mismatch vs uncompressed, costs."""
    from trimvlm.evals.run import run_eval

    return run_eval(vlm, task, recipes, **kw)


def tune(vlm, task="demo", budgets=("total_flops=0.5",), **kw):
    """The best recipe for each cost budget, searched on the task's validation split (trimvlm.tune.search)."""
    from trimvlm.tune.search import tune as _tune

    return _tune(vlm, task, list(budgets), **kw)


__version__ = "0.8.0"
__all__ = [
    "VLM",
    "GenerationResult",
    "Recipe",
    "TrimVLMError",
    "__version__",
    "evaluate",
    "load",
    "parse_recipe",
    "tune",
]
