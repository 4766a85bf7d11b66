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

    def new_states(self) -> torch.Tensor:
        """[num_nodes, D] final-normed hidden state of every node, filled by the executor."""
        hidden = self.prefix.seq.hidden
        return torch.zeros(self.forest.num_nodes, hidden.shape[-1], dtype=hidden.dtype, device=self.device)


def run_rows(work: Work, rows: list[list[int]], cache: KVCache, out: torch.Tensor, **kw) -> torch.Tensor:
    """Run node rows as one batch against `cache` (left-padded, each node at its original position: start +
    depth); write each node's final-normed state into `out`. Returns the node ids [R, T] (-1 on padding)."""
    f, dev = work.forest, work.device
    nodes = rows_tensor(rows, device=dev)
    valid = nodes >= 0
    safe = nodes.clamp(min=0)
    tokens = torch.tensor(f.token, dtype=torch.long, device=dev)[safe].masked_fill(~valid, 0)
    pos = f.positions(device=dev)[safe].masked_fill(~valid, 0)
    positions = pos[None].expand(work.runner.adapter.rope_axes, -1, -1)
    seq = work.runner.step_hidden(
        tokens, positions, cache, valid=valid, skip=work.skip, meter=work.meter, phase="branch", **kw
    )
    out[nodes[valid]] = seq.hidden[valid].to(out.dtype)
    work.executed = (work.executed or 0) + int(valid.sum())
    return nodes


def request_rows(paths_per_request, device: torch.device | str = "cpu") -> torch.Tensor:
    """[N] the request (prefix row) of every path, on `device`."""
    rows = [r for r, paths in enumerate(paths_per_request) for _ in paths]
    return torch.tensor(rows, dtype=torch.long, device=device)


def leaf_cache(work: Work, owner: torch.Tensor) -> KVCache:
    """Rows reading their prefix rows `owner` [R] as shared parts, never copied, as leaves: their final recurrent
    states and their own KV are not stored."""
    cache = work.prefix.cache.share_prefix(owner, keep_final_states=False)
    cache.keep_kv = False
    return cache


def run_paths(work: Work, cache_for) -> torch.Tensor:
    """Every candidate path as its own row, in one batch against `cache_for(owner)` (owner [N]: each path's
    prefix row): node states [num_nodes, D]."""
    f = work.forest
    out = work.new_states()
    rows = [path for paths in f.paths for path in paths]
    run_rows(work, rows, cache_for(request_rows(f.paths, device=work.device)), out)
    return out


def run_independent(work: Work) -> torch.Tensor:
    """`independent`: the reference (FastJEV's C). Every candidate runs from its own copy of its request's prefix
    cache (KV and recurrent states copied per candidate), as one batch through the plain cache path: no shared
    parts, no trie, nothing read that another candidate wrote."""
    return run_paths(work, work.prefix.cache.copy_rows)


def run_batched(work: Work) -> torch.Tensor:
    """`batched` (FastJEV's S, shared context anchoring): every candidate of every request in one batch.

    Each row reads its request's prefix cache as a shared part, never copied: attention combines [prefix KV | own
    KV] in one softmax with the prefix rows broadcast over their branches, recurrent layers start from the
    prefix's states as read-only views (rows of different requests run in separate calls), and the branches are
    leaves: their final recurrent/conv states and their own KV are never stored."""
    return run_paths(work, lambda owner: leaf_cache(work, owner))
