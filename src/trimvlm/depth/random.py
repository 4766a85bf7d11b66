"""`depth=random:budget=K:seed=S:scope=candidates`: skip K blocks drawn at random (seeded), any block allowed.

The draw is a seeded permutation of all L layers and the first K are skipped, so the sets are nested across
budgets (budget K+1 skips budget K's layers and one more), like a ranking: a random ranking to compare the
calibrated one with. The permutation depends only on the seed and the layer count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trimvlm.depth.base import DepthMethod, check_budget
from trimvlm.options import option, require_int
from trimvlm.protocol import register


@dataclass
class RandomDepth(DepthMethod):
    budget: int = option(0, require_int, minimum=0)
    seed: int = option(0, require_int, minimum=0)
    scope: str = "candidates"

    def skipped(self, runner) -> frozenset[int]:
        n = runner.num_layers
        check_budget(self.budget, n)
        return frozenset(int(i) for i in np.random.default_rng([int(self.seed), 7411]).permutation(n)[: self.budget])


register("depth", "random")(RandomDepth)
