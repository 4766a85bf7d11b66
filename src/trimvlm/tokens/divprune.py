"""DivPrune: plain max-min diversity (farthest-point) selection on the visual features, no merge."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trimvlm.kernels.density import farthest_point, most_isolated
from trimvlm.protocol import register
from trimvlm.tokens.base import Selection, TokenReducer, VisualView, picked


@register("tokens", "divprune")
@dataclass
class DivPrune(TokenReducer):
    """DivPrune (Alvar et al., CVPR 2025; docs/references.md#divprune): greedy max-min diversity on cosine
    distance D = 1 - cos over each image's visual features. First pick, DivPrune's own rule: the most isolated
    token, argmax_j min_{i != j} D[i, j] (the token farthest from its nearest neighbour); then
    s_t = argmax_{j not in S} min_{s in S} D[s, j]. TwinPrune's rule with beta = 0 differs only in the first pick
    (argmax of rho~ there). `merge=true` merges each dropped token into its nearest kept one (off by default, as
    in the paper). Default layer 0 (DivPrune prunes right after the projector). The first pick costs one pass
    over all N x N distances, in row blocks (O(N^2 d) time, O(block * N) memory), as the paper's does."""

    def choose(self, view: VisualView) -> Selection:
        dt = torch.promote_types(view.features.dtype, torch.float32)
        xn = F.normalize(view.features.to(dt), dim=-1, eps=1e-12)
        first = most_isolated(xn, view.mask)
        tilt = torch.zeros(view.mask.shape, dtype=dt, device=xn.device)
        picks, nearest = farthest_point(xn, view.mask, view.k, tilt, first, track_nearest=self.merge)
        return Selection(keep=picked(picks, view.k, view.mask), assign=nearest)
