"""`independent`: the reference (FastJEV's C). Every candidate runs from its own copy of its request's prefix
cache (KV and recurrent states copied per candidate), as one batch through the plain cache path: no shared
parts, no trie, nothing read that another candidate wrote."""

from __future__ import annotations

from trimvlm.scoring.executors.common import Work, request_rows, run_rows


def run(work: Work) -> object:
    f = work.forest
    out = work.new_states(work.prefix.seq.hidden.shape[-1])
    rows = [path for paths in f.paths for path in paths]
    cache = work.prefix.cache.copy_rows(request_rows(f, f.paths, device=work.device))
    run_rows(work, rows, cache, out)
    return out
