"""`independent`: the reference (FastJEV's C). Every candidate runs from its own copy of its request's prefix
cache (KV and recurrent states copied per candidate), as one batch through the plain cache path: no shared
parts, no trie, nothing read that another candidate wrote."""

from __future__ import annotations

from trimvlm.scoring.executors.common import Work, run_paths


def run(work: Work) -> object:
    return run_paths(work, work.prefix.cache.copy_rows)
