"""PruMerge: keep the attention outliers (IQR rule), fill the budget spatially, merge the rest into them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trimvlm.kernels.merge import nearest_kept
from trimvlm.kernels.select import topk_mask
from trimvlm.registry import register
from trimvlm.tokens.base import Selection, TokenReducer, VisualView


def iqr_outliers(scores: torch.Tensor, mask: torch.Tensor, whisker: float = 1.5) -> torch.Tensor:
    """[U, N] bool: scores above Q3 + whisker * (Q3 - Q1) of their row's masked entries."""
    s = scores.float().masked_fill(~mask, float("nan"))
    q1 = torch.nanquantile(s, 0.25, dim=1, keepdim=True)
    q3 = torch.nanquantile(s, 0.75, dim=1, keepdim=True)
    return (scores.float() > q3 + whisker * (q3 - q1)) & mask


def spread(cands: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """[U, N] bool: f[u] of row u's candidates, evenly spaced in index (grid) order."""
    m = cands.sum(1, keepdim=True).clamp(min=1)
    r = cands.long().cumsum(1) - 1  # rank among candidates
    fu = f[:, None]
    return cands & ((r + 1) * fu // m > r * fu // m)


@register("tokens", "prumerge")
@dataclass
class PruMerge(TokenReducer):
    """Scores: at L >= 1 the attention each visual token receives from the last query token in layer L-1
    (heads averaged; the LLM analogue of PruMerge's CLS attention, recorded by an AttentionProbe); at L = 0,
    where no LLM attention exists yet, the L2 norm of the token's features. Tokens above Q3 + 1.5 IQR are
    the outliers; the highest-scoring outliers are kept (at most K), and the rest of the budget is filled with
    tokens evenly spaced over the grid (PruMerge+'s spatial sampling), so exactly K = ceil(N * keep) remain.
    Every dropped token then merges into its most cosine-similar kept token, weighted by its score
    (`merge=false` only drops). Default layer 2."""

    layer: int | None = None
    merge: bool = True

    default_layer = 2

    def wants_attention(self, runner) -> bool:
        return self.at(runner) >= 1

    def probe(self, runner, handoff):
        return self._last_query_probe(runner, handoff) if self.at(runner) >= 1 else None

    def choose(self, view: VisualView) -> Selection:
        if view.attention is not None:
            scores = view.attention
        else:
            scores = view.features.float().norm(dim=-1)
        scores = scores.masked_fill(~view.mask, 0.0)
        out = iqr_outliers(scores, view.mask)
        top = topk_mask(scores, torch.minimum(out.sum(1), view.k), out)
        keep = top | spread(view.mask & ~top, view.k - top.sum(1))
        if not self.merge:
            return Selection(keep=keep)
        assign = nearest_kept(view.features, view.mask, keep)
        return Selection(keep=keep, assign=assign, weight=scores.clamp(min=1e-12) * view.size)
