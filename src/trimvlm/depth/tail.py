"""`depth=tail:budget=K:scope=candidates`: skip the K blocks just before the last one (layers L-1-K .. L-2).

The final block is kept on purpose: FastJEV (section 3.4, Figure 2) finds it the most decision-sensitive block
at every model size, so a "drop the last K" baseline would mostly measure the loss of that one block. This is the
depth-order baseline the calibrated `ranking` is compared with: the same budget, no measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

from trimvlm.depth.base import DepthMethod, check_budget
from trimvlm.options import option, require_int
from trimvlm.protocol import register


@dataclass
class Tail(DepthMethod):
    budget: int = option(0, require_int, minimum=0)
    scope: str = "candidates"

    def skipped(self, runner) -> frozenset[int]:
        n = runner.num_layers
        check_budget(self.budget, n)
        last = n - 1
        return frozenset(range(last - self.budget, last))


register("depth", "tail")(Tail)
