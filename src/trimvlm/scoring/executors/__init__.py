"""Candidate executors, all giving the scores of `independent`: name -> run(Work) -> node states."""

from __future__ import annotations

from trimvlm.scoring.executors import batched, independent, segments, tree

EXECUTORS = {
    "independent": independent.run,
    "batched": batched.run,
    "segments": segments.run,
    "tree": tree.run,
}
MERGED = {"segments", "tree"}  # executors that run the merged trie (the others run one path per candidate)
NAMES = (*EXECUTORS, "auto")
