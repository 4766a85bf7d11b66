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

from collections import defaultdict

import torch

from trimvlm.runtime.layers import ATTENTION
from trimvlm.runtime.tree import RecurrentCall, TreeSchedule
from trimvlm.scoring.executors import batched
from trimvlm.scoring.executors.call_cost import call_cost
from trimvlm.scoring.executors.common import Work, run_rows
from trimvlm.scoring.executors.plan_cache import planned
from trimvlm.scoring.executors.tree_layout import LayerMix, Piece, plan_pieces, recurrent_rows, worth_planning
from trimvlm.scoring.trie import rows_tensor


def schedule(
    pieces: list[Piece], order: list[int], device: torch.device | str = "cpu", mix: LayerMix | None = None
) -> TreeSchedule:
    """`order`: piece ids in row order. Flat indices are into the [R * W] left-padded layout. Every tensor is
    made on `device` (the model's: the runner indexes its keys and states with them)."""
    width = max(len(pieces[p].nodes) for p in order)
    row_of = {p: r for r, p in enumerate(order)}

    def flat(p: int) -> list[int]:
        n = len(pieces[p].nodes)
        base = row_of[p] * width + width - n
        return list(range(base, base + n))

    anc: dict[int, list[int]] = {}
    for p in sorted(order, key=lambda p: pieces[p].level):  # parents first
        parent = pieces[p].parent
        anc[p] = [] if parent < 0 else anc[parent] + flat(parent)
    ancestors = rows_tensor([anc[p] for p in order], device=device)
    calls, tokens = [], 0
    rrows = recurrent_rows(pieces, mix)
    for level in range(1 + max(level for _, level in rrows)):
        leaves, inner = [], defaultdict(list)
        for ids, lv in rrows:
            if lv == level:
                n = sum(len(pieces[p].nodes) for p in ids)
                (inner[n] if pieces[ids[-1]].children else leaves).append(ids)
        for group, keep in [(leaves, False)] + [(g, True) for g in inner.values()]:
            if not group:
                continue
            nodes = rows_tensor(
                [[i for p in ids for i in flat(p)] for ids in group], left=False, device=device
            )
            calls.append(
                RecurrentCall(
                    nodes=nodes,
                    chain=torch.tensor([ids[-1] for ids in group], dtype=torch.long, device=device),
                    parent=torch.tensor(
                        [pieces[ids[0]].parent for ids in group], dtype=torch.long, device=device
                    ),
                    owner=torch.tensor(
                        [pieces[ids[0]].request for ids in group], dtype=torch.long, device=device
                    ),
                    keep=keep,
                )
            )
            tokens += nodes.numel()
    return TreeSchedule(ancestors=ancestors, calls=calls, tokens_run=tokens)


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


def run_pieces(work: Work, pieces: list[Piece], mix: LayerMix) -> torch.Tensor:
    """Run one layout: exactly `batched` when it is one plain row per candidate, else the tree schedule."""
    if all(p.parent < 0 and not p.children for p in pieces) and len(pieces) == work.forest.logical_paths:
        return batched.run(work)
    out = work.new_states(work.prefix.seq.hidden.shape[-1])
    # rows grouped by request (prefix rows are contiguous runs), levels in order inside a request
    order = sorted(range(len(pieces)), key=lambda p: (pieces[p].request, pieces[p].level, p))
    owner = torch.tensor([pieces[p].request for p in order], dtype=torch.long, device=work.device)
    cache = work.prefix.cache.share_prefix(owner, keep_final_states=False)
    cache.keep_kv = False
    cache.tree = schedule(pieces, order, device=work.device, mix=mix)
    run_rows(work, [pieces[p].nodes for p in order], cache, out)
    return out
