"""SnapKV on the visual span: score each visual entry by the attention it receives from the last `window`
prefill queries (the observation window), summed over those queries, pooled along the key axis with a 1-D
kernel, per layer. docs/references.md#snapkv.

Pooling runs over the cache order with every non-visual entry zeroed, so text attention (sinks, the prompt) does
not bleed into the visual span. `pool=avg` (SnapKV's and kvpress's default) counts the padding in the kernel, so
an entry next to padding scores the same in a batch as alone.

Per-head variant (`per_head=true`): each query head scores and ranks the entries on its own, and an entry's rank
is its best rank over the heads (ties: higher best-head score). The cache keeps one set of entries per layer for
all heads, so "top-k per head" becomes the largest union of the per-head top-m sets that fits the budget.
Always-keeping the observation window is moot here: the window holds the prompt's last tokens, and text is never
evicted (visual tokens inside the window compete like the others, so keep = 0 still drops them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from trimvlm.kernels.select import window_scores
from trimvlm.kv.base import KVPolicy, LayerView
from trimvlm.options import option, require_bool, require_choice, require_int
from trimvlm.protocol import register


@register("kv", "snapkv")
@dataclass
class SnapKV(KVPolicy):
    """Options: `window` (observation queries, default 32), `kernel` (odd pooling width, default 5; 1 = none),
    `pool` (`avg` or `max`), `per_head` (bool), `keep`."""

    window: int = option(32, require_int, minimum=1)
    kernel: int = option(5, require_int, minimum=1, odd=True)
    pool: str = option("avg", require_choice, allowed=("avg", "max"))
    per_head: bool = option(False, require_bool)

    rows_option: ClassVar[str] = "window"

    def scores(self, view: LayerView):
        att, rv = view.attention.float(), view.row_valid
        cand = view.candidates
        if att.dim() == 3:  # [B, n, K], heads averaged
            return window_scores(att, rv, cand, self.kernel, self.pool)
        s = window_scores(att, rv[:, None], cand[:, None], self.kernel, self.pool)  # per head: [B, H, K]
        k = s.shape[-1]
        ranked = s.masked_fill(~cand[:, None], -float("inf"))
        order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
        ar = torch.arange(k, device=order.device)
        rank = torch.empty_like(order).scatter_(-1, order, ar.expand_as(order))
        best_rank = rank.amin(1).float()  # [B, K]
        best = s.amax(1)
        tie = best / (best.amax(1, keepdim=True) + 1e-30) * 0.5  # in [0, 0.5]: only breaks rank ties
        return -best_rank + tie
