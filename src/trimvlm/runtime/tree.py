"""What the runner needs to execute a candidate tree in one pass (built by `trimvlm.scoring`).

The chunk is laid out as chains (rows [C, L], left-padded): each row holds one chain's own nodes only. Attention
layers run every row at once; a node attends to the shared prefix, to its chain's ancestors (`ancestors`: flat
indices into the [C * L] layout, whose keys are computed in the same layer call) and causally within its chain.
Recurrent layers cannot scan a tree: they run `calls` in order, each a batch of chains starting from their
parent chain's final state (or the prefix's); only calls whose chains have children keep final states.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from trimvlm.runtime.cache import owner_runs

# Rows with the same prefix row and the same ancestors (the leaves of one fork) read one context: the prefix's
# keys and their ancestors' keys, in one attention call with their queries folded together (no per-row copy of
# the ancestors). That is one call per run of such rows; past MAX_CONTEXT_RUNS runs, or fewer than
# MIN_ROWS_PER_RUN rows per run on average (small calls cost more than the gather they save), the rows gather
# their ancestors per row instead (one call for all of them, next to the prefix's).
MAX_CONTEXT_RUNS = 8
MIN_ROWS_PER_RUN = 8


@dataclass
class RecurrentCall:
    nodes: torch.Tensor  # [R, T] flat indices into the [C * L] layout, -1 = padding after the chain's end
    chain: torch.Tensor  # [R] chain (row) of each entry, the key of its final state
    parent: torch.Tensor  # [R] parent chain, -1 when the chain starts at the prefix
    owner: torch.Tensor  # [R] prefix row (request) of each chain
    keep: bool  # chains with children: their final states are kept (and their rows hold no padding)


class ContextRun(NamedTuple):
    """A maximal run of chains [start, end) that read one prefix row and have the same ancestors."""

    start: int
    end: int
    row: int  # the prefix row they read
    ancestors: torch.Tensor  # [A] their ancestors' flat indices


@dataclass
class TreeSchedule:
    ancestors: torch.Tensor  # [C, A] flat indices of each chain's ancestor nodes (root first), -1 = padding
    calls: list[RecurrentCall]
    tokens_run: int  # tokens one recurrent layer processes over all calls (padding included)
    # the `owner` of the last `context_runs` call, and what it returned
    _owner: torch.Tensor | None = field(default=None, repr=False)
    _runs: list[ContextRun] | None = field(default=None, repr=False)

    def context_runs(self, owner: torch.Tensor) -> list[ContextRun] | None:
        """Each maximal run of rows that read the same prefix row and have the same ancestors; None past
        MAX_CONTEXT_RUNS runs or under MIN_ROWS_PER_RUN rows per run. Computed once per schedule (every
        attention layer asks with the same `owner`)."""
        if self._owner is not owner:
            self._owner, self._runs = owner, _runs(self.ancestors, owner)
        return self._runs


def _runs(ancestors: torch.Tensor, owner: torch.Tensor) -> list[ContextRun] | None:
    runs = owner_runs(torch.cat([owner[:, None], ancestors], dim=1))  # rows: (prefix row, ancestors)
    if len(runs) > min(MAX_CONTEXT_RUNS, ancestors.shape[0] / MIN_ROWS_PER_RUN):
        return None
    return [ContextRun(a, e, row[0], ancestors[a][ancestors[a] >= 0]) for a, e, row in runs]
