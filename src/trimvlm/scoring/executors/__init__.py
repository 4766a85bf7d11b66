"""Candidate executors, all giving the scores of `independent`: name -> run(Work) -> node states.

`auto` picks one from the trie's shape (`choose`; the rule measured by benchmarks/scoring_scan.py,
docs/scoring.md): `tree` when the trie merges enough of the candidate tokens (logical / unique >= MIN_SHARING),
else `batched`, whose single call has the least overhead.
"""

from __future__ import annotations

from trimvlm.scoring.executors import segments, tree
from trimvlm.scoring.executors.common import run_batched, run_independent
from trimvlm.scoring.trie import Forest

EXECUTORS = {
    "independent": run_independent,
    "batched": run_batched,
    "segments": segments.run,
    "tree": tree.run,
}
MERGED = {"segments", "tree"}  # executors that run the merged trie (the others run one path per candidate)
NAMES = (*EXECUTORS, "auto")
MIN_SHARING = 1.1


def choose(merged: Forest) -> str:
    ratio = merged.logical_tokens / max(1, merged.num_nodes)
    return "tree" if ratio >= MIN_SHARING else "batched"
