"""ToMe: bipartite soft matching, size-weighted merge of the best-matched pairs, repeated to the budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trimvlm.kernels.merge import best_match, merge_groups
from trimvlm.kernels.select import topk_mask
from trimvlm.protocol import register
from trimvlm.tokens.base import Selection, TokenReducer, VisualView


@register("tokens", "tome")
@dataclass
class ToMe(TokenReducer):
    """Bipartite soft matching (Bolya et al.). Live tokens alternate (grid order) into sets A and B; each A
    token is matched to its most cosine-similar B token; the r best-matched A tokens merge into their B
    partners (size-weighted mean). One round removes at most |A| tokens, so rounds repeat on the survivors
    until K = ceil(N * keep) remain. Matching reads features merged so far; the final value of each kept token
    is the size-weighted mean of every original token in its group (the same thing, since the mean is
    associative). `merge=false` drops the matched tokens instead. Time O(N^2 d) per round (all A-B pairs),
    memory O(N) rows at a time."""

    merge: bool = True
    size_weighted: bool = True

    def choose(self, view: VisualView) -> Selection:
        u, n, _ = view.features.shape
        ar = torch.arange(n, device=view.mask.device)[None].expand(u, n)
        alive = view.mask.clone()
        owner = ar.clone()  # current representative of every original token
        dt = torch.promote_types(view.features.dtype, torch.float32)
        cur = view.features.to(dt)
        size = view.size.to(dt)
        remaining = view.n.clone()
        while bool((remaining > view.k).any()):
            rank = alive.long().cumsum(1) - 1
            a = alive & (rank % 2 == 0)
            b = alive & (rank % 2 == 1)
            sim, match = best_match(F.normalize(cur, dim=-1, eps=1e-12), a, b)
            r = torch.minimum(remaining - view.k, a.sum(1)).clamp(min=0)
            go = topk_mask(sim, r, a)
            tgt = torch.where(go, match, ar)
            cur, _ = merge_groups(cur, ~go & alive, tgt, size, alive)
            size = torch.zeros_like(size).scatter_add_(1, tgt, size * alive)
            alive &= ~go
            owner = tgt.gather(1, owner)
            remaining = remaining - r
        return Selection(keep=alive, assign=owner)
