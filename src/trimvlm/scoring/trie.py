"""The candidate forest: every request's candidate suffixes as one trie per request (or as plain paths).

A node is one token occurrence. With `merge=True` two occurrences share a node only when their keys are equal:
key = (parent node, token, position ids), the parent identifying the whole history (FastJEV eq. 4), so equal
tokens after different histories stay separate. All candidates of a request start at the same position (the
prefix's next position), so a node's position is start + depth. With `merge=False` each candidate is its own
path (the layout of the `independent` and `batched` executors).

Nodes are numbered in creation order, so a parent always comes before its children. The trie is cut into
*chains* (FastJEV's segments): maximal runs of nodes that end at a fork, at a leaf or at a candidate boundary.
A chain's level is the number of chains above it; chains of one level depend only on chains of lower levels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import takewhile

import numpy as np
import torch


@dataclass
class Chain:
    nodes: list[int]
    parent: int  # chain id above it, -1 when it hangs off the request's prefix
    request: int
    level: int
    children: list[int] = field(default_factory=list)  # chain ids


@dataclass
class Forest:
    request: list[int]  # per node: its request
    parent: list[int]  # per node: parent node, -1 for the first token (predicted by the prefix)
    token: list[int]
    depth: list[int]  # 0 for a suffix's first token
    paths: list[list[list[int]]]  # [request][candidate] -> node ids along the suffix
    starts: list[int]  # per request: position of every suffix's first token
    chains: list[Chain] = field(default_factory=list)
    chain_of: list[int] = field(default_factory=list)  # per node: (chain id, index inside it)
    index_in_chain: list[int] = field(default_factory=list)

    @property
    def num_nodes(self) -> int:
        return len(self.token)

    @property
    def logical_paths(self) -> int:
        return sum(len(req) for req in self.paths)

    @property
    def logical_tokens(self) -> int:
        return sum(len(p) for req in self.paths for p in req)

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[num_nodes] position of every node (its request's start + its depth), on `device`."""
        starts = torch.tensor(self.starts, dtype=torch.long, device=device)
        request = torch.tensor(self.request, dtype=torch.long, device=device)
        return starts[request] + torch.tensor(self.depth, dtype=torch.long, device=device)

    def levels(self) -> int:
        return 1 + max((c.level for c in self.chains), default=-1)


def build_forest(suffixes: list[list[list[int]]], starts: list[int], *, merge: bool) -> Forest:
    """`suffixes[r][i]` = token ids of candidate i of request r (markers included); `starts[r]` = the position
    of its first token.

    Merging inserts a request's candidates in sorted order: the longest history a candidate shares with any
    earlier one is then its common prefix with the one just before it, and every token after that is a new
    node. Within a request a parent fixes the position, so this is the key (parent, token, position ids)."""
    f = Forest(request=[], parent=[], token=[], depth=[], paths=[], starts=list(starts))
    for r, cands in enumerate(suffixes):
        req_paths: list[list[int]] = [[] for _ in cands]
        order = sorted(range(len(cands)), key=lambda i: list(cands[i])) if merge else range(len(cands))
        prev: list[int] = []
        prev_path: list[int] = []
        for i in order:
            toks = [int(t) for t in cands[i]]
            same = takewhile(lambda ab: ab[0] == ab[1], zip(prev, toks, strict=False)) if merge else ()
            shared = sum(1 for _ in same)  # the tokens it shares with the candidate before it
            base, k = len(f.token), len(toks) - shared
            if k:
                f.request.extend([r] * k)
                f.parent.append(prev_path[shared - 1] if shared else -1)
                f.parent.extend(range(base, base + k - 1))
                f.token.extend(toks[shared:])
                f.depth.extend(range(shared, len(toks)))
            path = prev_path[:shared] + list(range(base, base + k))
            req_paths[i] = path
            prev, prev_path = toks, path
        f.paths.append(req_paths)
    _cut_chains(f)
    return f


def _cut_chains(f: Forest) -> None:
    """A node starts a chain when it has no parent, or its parent forks (not exactly one child) or ends a
    candidate. Chains are runs of consecutive node ids: a node with one child got it as the very next node
    (the path that created it went on at once), so a cumulative count of starts numbers them."""
    n = f.num_nodes
    parent = np.asarray(f.parent, dtype=np.int64).reshape(n)
    kids = np.bincount(parent[parent >= 0], minlength=n)
    ends = np.zeros(n, dtype=bool)
    ends[[path[-1] for req in f.paths for path in req if path]] = True
    start = np.ones(n, dtype=bool)
    has = parent >= 0
    start[has] = (kids[parent[has]] != 1) | ends[parent[has]]
    chain_of = np.cumsum(start) - 1
    first = np.flatnonzero(start)
    f.chain_of = chain_of.tolist()
    f.index_in_chain = (np.arange(n) - first[chain_of]).tolist() if n else []
    bounds = [*first.tolist(), n]
    f.chains = []
    for c in range(len(first)):
        a, b = bounds[c], bounds[c + 1]
        p = f.parent[a]
        pc = f.chain_of[p] if p >= 0 else -1
        level = f.chains[pc].level + 1 if pc >= 0 else 0
        f.chains.append(Chain(nodes=list(range(a, b)), parent=pc, request=f.request[a], level=level))
        if pc >= 0:
            f.chains[pc].children.append(c)


def rows_tensor(
    rows: list[list[int]], pad: int = -1, left: bool = True, device: torch.device | str = "cpu",
    width: int | None = None,
) -> torch.Tensor:
    """A padded [R, T] long tensor of ragged rows (left padding by default, the runner's convention), on
    `device`; T is `width` when given, else the longest row's length."""
    t = max((len(r) for r in rows), default=0) if width is None else width
    if left:
        padded = [[pad] * (t - len(r)) + list(r) for r in rows]
    else:
        padded = [list(r) + [pad] * (t - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.long, device=device).reshape(len(rows), t)
