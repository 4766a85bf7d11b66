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

    def has_children(self) -> list[bool]:
        out = [False] * self.num_nodes
        for p in self.parent:
            if p >= 0:
                out[p] = True
        return out

    def position(self, node: int) -> int:
        return self.starts[self.request[node]] + self.depth[node]

    def levels(self) -> int:
        return 1 + max((c.level for c in self.chains), default=-1)


def build_forest(suffixes: list[list[list[int]]], starts: list[int], *, merge: bool) -> Forest:
    """`suffixes[r][i]` = token ids of candidate i of request r (markers included); `starts[r]` = the position
    of its first token."""
    f = Forest(request=[], parent=[], token=[], depth=[], paths=[], starts=list(starts))
    for r, cands in enumerate(suffixes):
        index: dict[tuple, int] = {}
        req_paths = []
        for toks in cands:
            parent, path = -1, []
            for d, t in enumerate(toks):
                key = (parent, int(t), starts[r] + d)
                node = index.get(key) if merge else None
                if node is None:
                    node = len(f.token)
                    f.request.append(r)
                    f.parent.append(parent)
                    f.token.append(int(t))
                    f.depth.append(d)
                    if merge:
                        index[key] = node
                path.append(node)
                parent = node
            req_paths.append(path)
        f.paths.append(req_paths)
    _cut_chains(f)
    return f


def _cut_chains(f: Forest) -> None:
    n = f.num_nodes
    kids: list[list[int]] = [[] for _ in range(n)]
    for node, p in enumerate(f.parent):
        if p >= 0:
            kids[p].append(node)
    ends = {path[-1] for req in f.paths for path in req if path}
    f.chain_of = [-1] * n
    f.index_in_chain = [-1] * n
    for node in range(n):  # parents first: a chain starts where its parent's chain ended
        p = f.parent[node]
        if p >= 0 and f.chain_of[p] >= 0:
            c = f.chains[f.chain_of[p]]
            continues = c.nodes[-1] == p and len(kids[p]) == 1 and p not in ends
            if continues:
                f.chain_of[node], f.index_in_chain[node] = f.chain_of[p], len(c.nodes)
                c.nodes.append(node)
                continue
        parent_chain = f.chain_of[p] if p >= 0 else -1
        level = f.chains[parent_chain].level + 1 if parent_chain >= 0 else 0
        f.chains.append(Chain(nodes=[node], parent=parent_chain, request=f.request[node], level=level))
        cid = len(f.chains) - 1
        if parent_chain >= 0:
            f.chains[parent_chain].children.append(cid)
        f.chain_of[node], f.index_in_chain[node] = cid, 0


def rows_tensor(rows: list[list[int]], pad: int = -1, left: bool = True) -> torch.Tensor:
    """A padded [R, T] long tensor of ragged rows (left padding by default, the runner's convention)."""
    t = max((len(r) for r in rows), default=0)
    if left:
        padded = [[pad] * (t - len(r)) + list(r) for r in rows]
    else:
        padded = [list(r) + [pad] * (t - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.long).reshape(len(rows), t)
