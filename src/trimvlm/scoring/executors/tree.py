"""`tree`: every unique trie node once per executed layer (up to the nodes the layout chooses to run twice),
in as few calls as the trie allows.

The chunk is all rows of all requests ([R, W], left-padded; `tree_layout` decides the rows: trie chains, short
shared chains absorbed into their children, long ones cut into pieces), each node at its original position.
An attention layer is one call: a node attends to its request's prefix (a shared part, never copied), to its
row's ancestor nodes (their keys are computed by this same call and gathered per row) and causally within its
row, which is exactly the history it has in a separate evaluation. A recurrent layer cannot scan a tree, so it
runs the rows level by level from their parents' final states: one call per level for the leaves
(right-padded: padding after a row's end changes nothing before it) and one per length for rows with children
(their final states are kept and must not see padding).
"""

from __future__ import annotations

import torch

from trimvlm.runtime.layers import ATTENTION
from trimvlm.scoring.executors.call_cost import call_cost
from trimvlm.scoring.executors.common import Work
from trimvlm.scoring.executors.plan_cache import planned
from trimvlm.scoring.executors.tree_layout import LayerMix, plan_pieces, worth_planning
from trimvlm.scoring.executors.tree_schedule import run_pieces


def run(work: Work) -> torch.Tensor:
    mix = layer_mix(work)
    if worth_planning(work.forest):
        mix.call_cost = call_cost(work, mix)  # measured once per model, device, threads and skip set
    return run_pieces(work, planned(work.forest, mix, plan_pieces), mix)  # planned once per trie shape


def layer_mix(work: Work) -> LayerMix:
    """The executed layers' kinds and the recurrent kernel's granularity (call cost not measured yet)."""
    ad = work.runner.adapter
    run = [t for i, t in enumerate(ad.layer_types) if i not in work.skip]
    return LayerMix(
        attention=sum(t == ATTENTION for t in run), recurrent=sum(t != ATTENTION for t in run),
        chunk=ad.recurrent_chunk, short=getattr(ad, "recurrent_max_len", 0),
    )  # fmt: skip
