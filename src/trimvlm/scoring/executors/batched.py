"""`batched` (FastJEV's S, shared context anchoring): every candidate of every request in one batch.

Each row reads its request's prefix cache as a shared part, never copied: attention combines [prefix KV | own
KV] in one softmax with the prefix rows broadcast over their branches, recurrent layers start from the prefix's
states as read-only views (rows of different requests run in separate calls), and the branches are leaves: their
final recurrent/conv states and their own KV are never stored.
"""

from __future__ import annotations

import torch

from trimvlm.scoring.executors.common import Work, leaf_cache, run_paths


def run(work: Work) -> torch.Tensor:
    return run_paths(work, lambda owner: leaf_cache(work, owner))
