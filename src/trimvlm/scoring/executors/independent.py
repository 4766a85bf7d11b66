"""`independent`: the reference. Each candidate runs alone from its own copy of its request's prefix cache."""

from __future__ import annotations

import torch

from trimvlm.scoring.executors.common import Work, run_rows


def run(work: Work) -> torch.Tensor:
    out = work.new_states(work.prefix.seq.hidden.shape[-1])
    for r, paths in enumerate(work.forest.paths):
        for path in paths:
            cache = work.prefix.cache.copy_rows(torch.tensor([r]))
            run_rows(work, [path], cache, out)
            del cache
    return out
