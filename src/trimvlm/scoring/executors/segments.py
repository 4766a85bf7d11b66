"""`segments` (FastJEV's T as the paper runs it): the trie executed as chains (segments ending at a fork, a
leaf or a candidate boundary), level by level; the chains that hang off one parent run as one batch, starting
from the parent's cache: the request's prefix and the parent's path KV as shared parts (never copied per
child), recurrent layers from the parent's final states as read-only views. Only chains with children keep
their path KV and final states; leaves store nothing."""

from __future__ import annotations

from collections import defaultdict

import torch

from trimvlm.runtime.cache import KVCache, LayerKV, SharedPart
from trimvlm.scoring.executors.common import Work, run_rows


def run(work: Work) -> torch.Tensor:
    f = work.forest
    pre, dev = work.prefix.cache, work.device
    out = work.new_states()
    path_kv: dict[int, dict[int, LayerKV]] = {}  # chain -> its whole path's KV (ancestors + own), per layer
    finals: dict[int, dict[int, dict[str, torch.Tensor]]] = {}  # chain -> final recurrent states per layer
    for level in range(f.levels()):
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for cid, c in enumerate(f.chains):
            if c.level == level:
                groups[(c.request, c.parent)].append(cid)
        for (req, parent), cids in groups.items():
            n = len(cids)
            keep = any(f.chains[c].children for c in cids)
            parts = [SharedPart(pre.layers, torch.full((n,), req, dtype=torch.long, device=dev))]
            if parent < 0:
                states, state_owner = pre.states, torch.full((n,), req, dtype=torch.long, device=dev)
            else:
                parts.append(SharedPart(path_kv[parent], torch.zeros(n, dtype=torch.long, device=dev)))
                states, state_owner = finals[parent], torch.zeros(n, dtype=torch.long, device=dev)
            cache = KVCache.branching(
                parts, states, state_owner, keep_final_states=keep, num_layers=pre.num_layers
            )
            cache.keep_kv = keep
            nodes = run_rows(work, [f.chains[c].nodes for c in cids], cache, out)
            for r, cid in enumerate(cids):
                if f.chains[cid].children:
                    own = nodes[r] >= 0
                    path_kv[cid] = _path(path_kv.get(parent), cache, r, own)
                    finals[cid] = {
                        i: {k: v[r : r + 1] for k, v in st.items()} for i, st in cache.states.items()
                    }
        for c in [c for c in path_kv if f.chains[c].level < level]:  # no chain below level + 1 reads these
            path_kv.pop(c)
            finals.pop(c, None)
    return out


def _path(parent: dict[int, LayerKV] | None, cache: KVCache, row: int, own: torch.Tensor):
    """The path KV of one chain: its parent's path followed by its own valid entries (one row)."""
    out = {}
    for i, e in cache.layers.items():
        k, v = e.key[row : row + 1, :, own], e.value[row : row + 1, :, own]
        if parent is not None and i in parent:
            k = torch.cat([parent[i].key, k], dim=2)
            v = torch.cat([parent[i].value, v], dim=2)
        n = k.shape[2]
        ones = torch.ones(1, n, dtype=torch.bool, device=k.device)
        source = torch.full((1, n), -1, dtype=torch.long, device=k.device)
        out[i] = LayerKV(k, v, ones, torch.zeros_like(ones), source)
    return out
