"""`depth=skip:layers=3+4:scope=all`: skip the named decoder blocks (a manual layer plan, no ranking).

Skipping means the layer-removed model: the result equals transformers' model with those blocks deleted from
its layer list and the later ones renumbered, whatever the family adds after a layer index included (Qwen3-VL's
deepstack features follow the executed blocks; docs/depth.md)."""

from __future__ import annotations

from dataclasses import dataclass

from trimvlm.depth.base import DepthMethod
from trimvlm.errors import RecipeError
from trimvlm.options import is_int
from trimvlm.protocol import register


def parse_layers(value) -> frozenset[int]:
    """`3+4` (the recipe string form), a single integer, or a list of integers -> the set of layer indices."""
    if is_int(value):
        items = [value]
    elif isinstance(value, list | tuple):
        items = list(value)
    elif isinstance(value, str) and value.strip():
        items = value.replace(" ", "").split("+")
    else:
        raise RecipeError(f"layers must name decoder layers, e.g. layers=3+4 (got {value!r})")
    out = []
    for x in items:
        if isinstance(x, str) and x.isdigit():
            x = int(x)
        if not is_int(x) or x < 0:
            raise RecipeError(f"layers must be non-negative layer indices joined by '+', e.g. 3+4; got {value!r}")
        out.append(x)
    return frozenset(out)


@dataclass
class Skip(DepthMethod):
    """Options: `layers` (indices joined by '+', e.g. `3+4`; at least one block must still run), `scope`
    (all | prefill | decode | candidates, default all)."""

    layers: str = ""
    scope: str = "all"

    def __post_init__(self):
        super().__post_init__()
        self.chosen = parse_layers(self.layers)

    def skipped(self, runner) -> frozenset[int]:  # each layer's range: checked by `DepthMethod.skips`
        if len(self.chosen) >= runner.num_layers:
            raise RecipeError(
                f"depth=skip names all {runner.num_layers} layers; at least one block must run"
            )
        return self.chosen


register("depth", "skip")(Skip)
