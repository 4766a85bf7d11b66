"""`depth=ranking:file=rank.json:budget=K:scope=candidates`: skip the first K layers of a saved ranking
(`trimvlm calibrate` writes one: layers ordered by decision sensitivity J_l, least sensitive first)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from trimvlm.depth.base import DepthMethod, check_budget, model_fingerprint
from trimvlm.errors import RecipeError
from trimvlm.options import option, require_int
from trimvlm.protocol import register


@dataclass
class Ranking(DepthMethod):
    file: str = ""
    budget: int = option(0, require_int, minimum=0)
    scope: str = "candidates"

    def __post_init__(self):
        super().__post_init__()
        if not self.file:
            raise RecipeError("depth=ranking needs file=PATH (a ranking written by `trimvlm calibrate`)")

    def skipped(self, runner) -> frozenset[int]:
        data = read_ranking(self.file)
        n = runner.num_layers
        if data["num_layers"] != n:
            raise RecipeError(
                f"ranking {self.file} was computed for a model with {data['num_layers']} layers; this model "
                f"has {n}: calibrate this model (`trimvlm calibrate`)"
            )
        fp = data["fingerprint"]
        if fp is not None and fp != model_fingerprint(runner.adapter):
            raise RecipeError(
                f"ranking {self.file} was computed for another model (fingerprint {fp}, this model's is "
                f"{model_fingerprint(runner.adapter)}): calibrate this model (`trimvlm calibrate`)"
            )
        check_budget(self.budget, n)
        order = data["order"]
        if len(set(order)) != len(order) or not all(0 <= i < n for i in order) or len(order) < self.budget:
            raise RecipeError(
                f"ranking {self.file}: 'order' must list at least {self.budget} distinct layers of 0..{n - 1}, "
                f"got {order}"
            )
        return frozenset(order[: self.budget])


def read_ranking(file) -> dict:
    """The ranking file's `order`, `num_layers` and `fingerprint` (the format: trimvlm.depth.calibration)."""
    path = Path(file)
    if not path.exists():
        raise RecipeError(f"ranking file not found: {path}")
    try:
        data = json.loads(path.read_text())
        order = [int(i) for i in data["order"]]
        num_layers = int(data["num_layers"])
    except (ValueError, KeyError, TypeError) as e:
        raise RecipeError(f"{path} is not a ranking file (needs 'order' and 'num_layers'): {e}") from e
    return {"order": order, "num_layers": num_layers, "fingerprint": data.get("fingerprint")}


register("depth", "ranking")(Ranking)
