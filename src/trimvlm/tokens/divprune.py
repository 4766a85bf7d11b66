"""DivPrune: plain max-min diversity (farthest-point) selection on the visual features, no merge."""

from __future__ import annotations

from dataclasses import dataclass

from trimvlm.registry import register
from trimvlm.tokens.base import Selection, TokenReducer, VisualView
from trimvlm.tokens.density import density_select


@register("tokens", "divprune")
@dataclass
class DivPrune(TokenReducer):
    """Farthest-point selection on cosine distance, `argmax_j mind_j`: TwinPrune's rule with beta = 0 and no
    merge (the first pick is argmax rho~ with window 3, as in density, so `divprune` equals
    `density:beta=0:merge=false` exactly). Default layer 0 (DivPrune prunes right after the projector)."""

    layer: int | None = None

    def choose(self, view: VisualView) -> Selection:
        keep, nearest, _ = density_select(view, beta=0.0, window=3, select="fps", track_nearest=self.merge)
        return Selection(keep=keep, assign=nearest)
