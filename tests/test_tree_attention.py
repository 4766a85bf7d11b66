"""A tree's attention: rows that share their context (prefix row and ancestors) read it in one call
per run (`runtime.tree.context_runs`); past MAX_CONTEXT_RUNS runs (or too few rows per run) each row gathers
its ancestors. Both paths
give the scores of `independent`, and each is the one that ran."""

import pytest
from conftest import AVAILABLE
from test_scoring import CASES, _max_diff, _requests

from trimvlm.runtime import attention, tree

TOL = 1e-4
pytestmark = pytest.mark.usefixtures("merged_tree")


@pytest.mark.parametrize("family", AVAILABLE)
@pytest.mark.parametrize("case", ["nested", "batch", "duplicates_prefixes"])
@pytest.mark.parametrize("max_runs", [0, 1000])  # every tree on the gather path; every one fused
def test_tree_attention_paths_equal_independent(vlms, family, case, max_runs, monkeypatch):
    vlm = vlms(family)
    reqs = _requests(CASES[case])
    ref = vlm.score(reqs, readout="loglik", executor="independent")
    monkeypatch.setattr(tree, "MAX_CONTEXT_RUNS", max_runs)
    monkeypatch.setattr(tree, "MIN_ROWS_PER_RUN", 1)
    fused = []
    real = attention._tree_attention
    monkeypatch.setattr(attention, "_tree_attention", lambda *a: fused.append(1) or real(*a))
    got = vlm.score(reqs, readout="loglik", executor="tree-merged")
    assert got.tokens["executed"] < got.tokens["logical"]  # the trie merged: rows had ancestors
    assert _max_diff(ref, got) <= TOL, (family, case, max_runs)
    assert bool(fused) == (max_runs > 0)  # the fused context ran only when runs were allowed
