"""The `tree` executor's schedule and its run of one layout (`run_pieces`), apart from `tree.run` so that
`call_cost` can time layouts with them while `tree.run` asks `call_cost` for the measured price.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch

from trimvlm.runtime.tree import RecurrentCall, TreeSchedule
from trimvlm.scoring.executors.common import Work, leaf_cache, run_batched, run_rows
from trimvlm.scoring.executors.tree_layout import LayerMix, Piece, recurrent_rows
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
    longs = functools.partial(torch.tensor, dtype=torch.long, device=device)
    rrows = recurrent_rows(pieces, mix)
    for level in range(1 + max(row.level for row in rrows)):
        leaves, inner = [], defaultdict(list)
        for row in rrows:
            if row.level == level:
                n = sum(len(pieces[p].nodes) for p in row.ids)
                (inner[n] if pieces[row.ids[-1]].children else leaves).append(row.ids)
        for group, keep in [(leaves, False)] + [(g, True) for g in inner.values()]:
            if not group:
                continue
            nodes = rows_tensor(
                [[i for p in ids for i in flat(p)] for ids in group], left=False, device=device
            )
            firsts = [pieces[ids[0]] for ids in group]
            calls.append(
                RecurrentCall(
                    nodes=nodes,
                    chain=longs([ids[-1] for ids in group]),
                    parent=longs([p.parent for p in firsts]),
                    owner=longs([p.request for p in firsts]),
                    keep=keep,
                )
            )
            tokens += nodes.numel()
    return TreeSchedule(ancestors=ancestors, calls=calls, tokens_run=tokens)


def run_pieces(work: Work, pieces: list[Piece], mix: LayerMix) -> torch.Tensor:
    """Run one layout: exactly `batched` when it is one plain row per candidate, else the tree schedule."""
    if all(p.parent < 0 and not p.children for p in pieces) and len(pieces) == work.forest.logical_paths:
        return run_batched(work)
    out = work.new_states()
    # rows grouped by request (prefix rows are contiguous runs), levels in order inside a request
    order = sorted(range(len(pieces)), key=lambda p: (pieces[p].request, pieces[p].level, p))
    owner = torch.tensor([pieces[p].request for p in order], dtype=torch.long, device=work.device)
    cache = leaf_cache(work, owner)
    cache.tree = schedule(pieces, order, device=work.device, mix=mix)
    run_rows(work, [pieces[p].nodes for p in order], cache, out)
    return out
