"""What every executor shares: run a set of trie chains as one batch against a cache, write node states."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trimvlm.runtime.cache import KVCache
from trimvlm.runtime.meter import Meter
from trimvlm.runtime.runner import PrefillOutput, Runner
from trimvlm.scoring.trie import Forest, rows_tensor


@dataclass
class Work:
    """One executor run: the prefix (encoded once by the full backbone), the forest, the candidate layer plan."""

    runner: Runner
    prefix: PrefillOutput
    forest: Forest
    skip: frozenset[int]
    meter: Meter
    plan: object = None  # the trimvlm.plan.Plan the prefix was encoded with
    executed: int | None = None  # candidate tokens the executor ran (set by run_rows)

    @property
    def device(self) -> torch.device:
        """Where the prefix lives (the model's device): every tensor handed to the runner is made there."""
        return self.prefix.seq.hidden.device

    def new_states(self, dim: int) -> torch.Tensor:
        """[num_nodes, D] final-normed hidden state of every node, filled by the executor."""
        return torch.zeros(self.forest.num_nodes, dim, dtype=self.prefix.seq.hidden.dtype, device=self.device)


def chain_inputs(work: Work, rows: list[list[int]]):
    """tokens [R, T], positions [A, R, T], valid [R, T] and node ids [R, T] (-1 on padding) of node rows,
    left-padded, each node at its original position (start + depth)."""
    f, dev = work.forest, work.device
    nodes = rows_tensor(rows, device=dev)
    valid = nodes >= 0
    safe = nodes.clamp(min=0)
    tokens = torch.tensor(f.token, dtype=torch.long, device=dev)[safe].masked_fill(~valid, 0)
    pos = f.positions(device=dev)[safe]
    pos = pos.masked_fill(~valid, 0)
    positions = pos[None].expand(work.runner.adapter.rope_axes, -1, -1)
    return tokens, positions, valid, nodes


def run_rows(work: Work, rows: list[list[int]], cache: KVCache, out: torch.Tensor, **kw) -> torch.Tensor:
    """Run node rows as one batch against `cache`; write each node's final-normed state into `out`.
    Returns the node ids [R, T] of the batch layout."""
    tokens, positions, valid, nodes = chain_inputs(work, rows)
    seq = work.runner.step_hidden(
        tokens, positions, cache, valid=valid, skip=work.skip, meter=work.meter, phase="branch", **kw
    )
    out[nodes[valid]] = seq.hidden[valid].to(out.dtype)
    work.executed = (work.executed or 0) + int(valid.sum())
    return nodes


def request_rows(forest: Forest, paths_per_request, device: torch.device | str = "cpu") -> torch.Tensor:
    """[N] the request (prefix row) of every path, on `device`."""
    rows = [r for r, paths in enumerate(paths_per_request) for _ in paths]
    return torch.tensor(rows, dtype=torch.long, device=device)
