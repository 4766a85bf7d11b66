"""The `tree` executor's plan cache: a repeated trie shape is planned once, a hit is the layout
planning returns (a fresh copy), and a different shape, mix or planner is planned again."""

import dataclasses

from trimvlm.scoring.executors import plan_cache
from trimvlm.scoring.executors.tree_layout import LayerMix, plan_pieces
from trimvlm.scoring.trie import build_forest


def _forest(first: int, start: int = 10):
    cands = [[first] * 6 + [20 + i] + [3] * 7 for i in range(8)]
    return build_forest([cands], [start], merge=True)


def _counting(calls):
    def planner(f, mix):
        calls.append(1)
        return plan_pieces(f, mix)

    return planner


def _same(a, b):
    return [(p.nodes, p.parent, p.request, p.level, p.children) for p in a] == [
        (p.nodes, p.parent, p.request, p.level, p.children) for p in b
    ]


def test_repeated_shape_is_planned_once():
    plan_cache.clear()
    calls = []
    planner = _counting(calls)
    mix = LayerMix(attention=4, call_cost=4.0)
    f = _forest(1)
    first = plan_cache.planned(f, mix, planner)
    assert any(p.parent >= 0 for p in first)  # a merged layout, not plain rows
    first[0].nodes.append(-7)  # a caller's copy: the cache keeps its own
    again = plan_cache.planned(_forest(5, start=40), mix, planner)  # other tokens and prefix, same shape
    assert len(calls) == 1 and _same(again, plan_pieces(f, mix))
    plan_cache.planned(f, dataclasses.replace(mix, call_cost=400.0), planner)  # another mix
    shorter = build_forest([[[1] * 6 + [20 + i] + [3] * 5 for i in range(8)]], [10], merge=True)
    plan_cache.planned(shorter, mix, planner)  # another shape
    assert len(calls) == 3
    assert _same(plan_cache.planned(shorter, mix, planner), plan_pieces(shorter, mix)) and len(calls) == 3
    assert plan_cache.stats() == {"entries": 3, "hits": 2, "misses": 3}  # what /metrics reports


def test_cache_is_bounded():
    plan_cache.clear()
    mix = LayerMix(attention=1)
    for n in range(plan_cache.SIZE + 5):
        plan_cache.planned(build_forest([[[1, 2 + n], [1, 3 + n, 4]]], [0], merge=True), mix, plan_pieces)
        plan_cache.planned(build_forest([[[1] * (n + 1)]], [0], merge=True), mix, plan_pieces)
    assert len(plan_cache._CACHE) == plan_cache.SIZE
