"""What the runner needs to execute a candidate tree in one pass (built by `trimvlm.scoring`).

The chunk is laid out as chains (rows [C, L], left-padded): each row holds one chain's own nodes only. Attention
layers run every row at once; a node attends to the shared prefix, to its chain's ancestors (`ancestors`: flat
indices into the [C * L] layout, whose keys are computed in the same layer call) and causally within its chain.
Recurrent layers cannot scan a tree: they run `calls` in order, each a batch of chains starting from their
parent chain's final state (or the prefix's); only calls whose chains have children keep final states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RecurrentCall:
    nodes: torch.Tensor  # [R, T] flat indices into the [C * L] layout, -1 = padding after the chain's end
    chain: torch.Tensor  # [R] chain (row) of each entry, the key of its final state
    parent: torch.Tensor  # [R] parent chain, -1 when the chain starts at the prefix
    owner: torch.Tensor  # [R] prefix row (request) of each chain
    keep: bool  # chains with children: their final states are kept (and their rows hold no padding)


@dataclass
class TreeSchedule:
    ancestors: torch.Tensor  # [C, A] flat indices of each chain's ancestor nodes (root first), -1 = padding
    calls: list[RecurrentCall]
    tokens_run: int  # tokens one recurrent layer processes over all calls (padding included)

    @property
    def ancestor_valid(self) -> torch.Tensor:
        return self.ancestors >= 0
