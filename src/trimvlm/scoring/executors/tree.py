"""`tree`: every unique trie node once per executed layer, in as few calls as the trie allows.

The chunk is all chains of all requests, one row per chain ([C, L], left-padded), each node at its original
position; chains longer than the width that packs the layout best are cut into pieces (a long shared run next
to short leaves would otherwise pad every leaf row to its length). An attention layer is one call: a node attends to its request's prefix (a shared part, never
copied), to its chain's ancestor nodes (their keys are computed by this same call and gathered per chain) and
causally to its own chain, which is exactly the history it has in a separate evaluation. A recurrent layer
cannot scan a tree, so it runs the chains level by level from their parents' final states: one call per level
for the leaves (right-padded: padding after a chain's end changes nothing before it) and one per chain length
for chains with children (their final states are kept and must not see padding).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from trimvlm.runtime.tree import RecurrentCall, TreeSchedule
from trimvlm.scoring.executors.common import Work, run_rows
from trimvlm.scoring.trie import Forest, chain_ancestors, packed_width, recut, rows_tensor


def order_chains(f: Forest) -> list[int]:
    """Chains grouped by request (so prefix rows are contiguous runs), levels in order inside a request."""
    return sorted(range(len(f.chains)), key=lambda c: (f.chains[c].request, f.chains[c].level, c))


def schedule(f: Forest, order: list[int]) -> TreeSchedule:
    width = max(len(f.chains[c].nodes) for c in order)
    flat = {}  # node -> flat index in the [C * L] layout (left padding)
    for r, cid in enumerate(order):
        nodes = f.chains[cid].nodes
        for j, node in enumerate(nodes):
            flat[node] = r * width + (width - len(nodes)) + j
    ancestors = rows_tensor([[flat[a] for a in chain_ancestors(f, cid)] for cid in order])
    calls, tokens = [], 0
    for level in range(f.levels()):
        leaves, inner = [], defaultdict(list)
        for cid in order:
            c = f.chains[cid]
            if c.level == level:
                (inner[len(c.nodes)] if c.children else leaves).append(cid)
        for group, keep in [(leaves, False)] + [(g, True) for g in inner.values()]:
            if not group:
                continue
            nodes = rows_tensor([[flat[n] for n in f.chains[c].nodes] for c in group], left=False)
            calls.append(
                RecurrentCall(
                    nodes=nodes,
                    chain=torch.tensor(group, dtype=torch.long),
                    parent=torch.tensor([f.chains[c].parent for c in group], dtype=torch.long),
                    owner=torch.tensor([f.chains[c].request for c in group], dtype=torch.long),
                    keep=keep,
                )
            )
            tokens += nodes.numel()
    return TreeSchedule(ancestors=ancestors, calls=calls, tokens_run=tokens)


def run(work: Work) -> torch.Tensor:
    f = work.forest
    f = recut(f, packed_width(f))  # long chains in pieces: little padding in the [chains, width] layout
    out = work.new_states(work.prefix.seq.hidden.shape[-1])
    order = order_chains(f)
    owner = torch.tensor([f.chains[c].request for c in order], dtype=torch.long)
    cache = work.prefix.cache.share_prefix(owner, keep_final_states=False)
    cache.keep_kv = False
    cache.tree = schedule(f, order)
    run_rows(work, [f.chains[c].nodes for c in order], cache, out)
    return out
