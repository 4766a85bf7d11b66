"""The `tree` executor's layouts, kept across calls for a repeated trie shape.

A layout (`tree_layout.plan_pieces`) depends only on the trie's shape and the layer mix: the chains (their
lengths, parents and requests; nodes are numbered in creation order, so chain lengths fix every node id), the
candidates' end nodes (a path is its end node's ancestry) and the mix (layer kinds, kernel granularity, the
measured call cost). Scoring the same candidate set again (a fixed label set or options over many images or
questions; the prefix plays no part) plans once. Keyed on that shape exactly, so a hit returns the layout
planning would have returned; at most SIZE shapes are kept (least recently used dropped)."""

from __future__ import annotations

import dataclasses

from trimvlm.runtime.lru import ByteLRU
from trimvlm.scoring.executors.tree_layout import LayerMix, Piece
from trimvlm.scoring.trie import Forest

SIZE = 64
_CACHE = ByteLRU(SIZE, "plan cache")  # shape key -> pieces, each entry of size 1: at most SIZE shapes


def planned(f: Forest, mix: LayerMix, planner) -> list[Piece]:
    """`planner(f, mix)`, from the cache when this shape and mix were planned before (a fresh copy: callers
    may hold it)."""
    chains = tuple((len(c.nodes), c.parent, c.request) for c in f.chains)
    ends = tuple(tuple(p[-1] if p else -1 for p in req) for req in f.paths)
    key = planner, dataclasses.astuple(mix), chains, ends
    pieces = _CACHE.get(key)
    if pieces is None:
        pieces = planner(f, mix)
        _CACHE.put(key, pieces, size=1)
    return [Piece(list(p.nodes), p.parent, p.request, p.level, list(p.children)) for p in pieces]


def stats() -> dict:
    """Shapes kept, and lookups that found their layout (hits) or planned it (misses), since the last clear."""
    s = _CACHE.stats()
    return {k: s[k] for k in ("entries", "hits", "misses")}


def clear() -> None:
    """Forget every layout and the counts."""
    global _CACHE
    _CACHE = ByteLRU(SIZE, "plan cache")
