"""`batched` (FastJEV's S, shared context anchoring): every candidate of every request in one batch.

Each row reads its request's prefix cache as a shared part, never copied: attention combines [prefix KV | own
KV] in one softmax with the prefix rows broadcast over their branches, recurrent layers start from the prefix's
states as read-only views (rows of different requests run in separate calls), and the branches are leaves: their
final recurrent/conv states and their own KV are never stored.
"""

from __future__ import annotations

import torch

from trimvlm.scoring.executors.common import Work, request_rows, run_rows


def run(work: Work) -> torch.Tensor:
    f = work.forest
    out = work.new_states(work.prefix.seq.hidden.shape[-1])
    rows = [path for paths in f.paths for path in paths]
    owner = request_rows(f, f.paths, device=work.device)
    cache = work.prefix.cache.share_prefix(owner, keep_final_states=False)
    cache.keep_kv = False
    run_rows(work, rows, cache, out)
    return out
