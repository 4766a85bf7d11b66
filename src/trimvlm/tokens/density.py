"""TwinPrune prefill reduction: spatial density + density-tilted farthest-point selection + bipartite merge.

Spec: docs/references.md#twinprune (the paper's section 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trimvlm.kernels.density import farthest_point, grid_density, masked_minmax, spatial_density
from trimvlm.kernels.select import topk_mask
from trimvlm.options import option, require_choice, require_int, require_number
from trimvlm.protocol import register
from trimvlm.tokens.base import Selection, TokenReducer, VisualView, picked


def view_density(view, window: int = 3, xn: torch.Tensor | None = None) -> torch.Tensor:
    """rho [U, N] of every token of a VisualView (each image on its own grid; grids of different sizes are
    padded into one [U, Hmax, Wmax, d] tensor with a mask, one vectorised call). 0 on pads. `xn`: the view's
    features already unit-normalised (the selection's copy, so they are normalised once)."""
    u, n, d = view.features.shape
    feats, normed = (view.features, False) if xn is None else (xn, True)
    hmax, wmax = (int(v) for v in view.grid.amax(0).tolist())
    full = bool((view.n == hmax * wmax).all()) and bool((view.grid == view.grid[:1]).all())
    if (
        full
        and n == hmax * wmax
        and torch.equal(view.cells, torch.arange(n, device=view.cells.device).expand(u, n))
    ):
        # every unit is a complete grid of the same size, in grid order: no scatter needed
        return spatial_density(feats.reshape(u, hmax, wmax, d), window, normalized=normed).reshape(u, n)
    return grid_density(feats, view.cells, view.grid, view.mask, window, normalized=normed)


def density_select(
    view: VisualView, *, beta: float, window: int, select: str = "fps", track_nearest: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """TwinPrune's selection on a view: (keep [U, N] bool, nearest kept [U, N] or None, rho [U, N])."""
    dt = torch.promote_types(view.features.dtype, torch.float32)
    xn = F.normalize(view.features.to(dt), dim=-1, eps=1e-12)  # once, for rho and the selection
    rho = view_density(view, window, xn)
    rt = masked_minmax(rho, view.mask)
    if select == "topk":
        return topk_mask(rt, view.k, view.mask), None, rho
    first = rt.argmax(1)
    tilt = (beta * rt.masked_fill(~view.mask, 0.0)).to(dt)
    picks, nearest = farthest_point(xn, view.mask, view.k, tilt, first, track_nearest=track_nearest)
    return picked(picks, view.k, view.mask), nearest, rho


@register("tokens", "density")
@dataclass
class Density(TokenReducer):
    """TwinPrune prefill compression (docs/references.md#twinprune).

    rho = spatial density on each image's grid (window `window`), min-max normalised to rho~; keep K tokens by
    density-tilted farthest-point selection `argmax(mind_j + beta * rho~_j)` on cosine distance, first pick
    argmax rho~ (`select=fps`), or simply the K highest rho~ (`select=topk`); then (`merge`, default on) each
    dropped token is merged into its most cosine-similar kept token (mean, or size-weighted mean).
    Default layer 3 (clamped to the model's last layer when it has fewer).

    rho goes with the selection (`Selection.rho`), so the plan's handoff holds it by original position for a
    decode-phase policy that reuses it.
    """

    merge: bool = True
    size_weighted: bool = False
    beta: float = option(1.0, require_number, low=0)
    window: int = option(3, require_int, minimum=1, odd=True, hint=" (3, 5, ...)")
    select: str = option("fps", require_choice, allowed=("fps", "topk"))

    default_layer = 3

    def choose(self, view: VisualView) -> Selection:
        keep, nearest, rho = density_select(
            view, beta=float(self.beta), window=self.window, select=self.select, track_nearest=self.merge
        )
        return Selection(keep=keep, assign=nearest, rho=rho)
