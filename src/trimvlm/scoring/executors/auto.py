"""`auto`: pick the executor from the trie's shape.

Rule (measured by benchmarks/scoring_scan.py, docs/scoring.md): `tree` when the trie merges enough of the
candidate tokens (logical / unique >= MIN_SHARING), else `batched`, whose single call has the least overhead.
"""

from __future__ import annotations

from trimvlm.scoring.trie import Forest

MIN_SHARING = 1.1


def choose(merged: Forest, adapter=None) -> str:
    ratio = merged.logical_tokens / max(1, merged.num_nodes)
    return "tree" if ratio >= MIN_SHARING else "batched"
