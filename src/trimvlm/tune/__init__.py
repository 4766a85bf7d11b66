"""`trimvlm tune`: the best recipe for a cost budget (docs/tune.md). `tune(vlm, task, budgets, ...)` searches
the space on the validation split and reports the frontier on the test split; `report.write_report` writes it."""

from trimvlm.tune.search import Settings, tune

__all__ = ["Settings", "tune"]
