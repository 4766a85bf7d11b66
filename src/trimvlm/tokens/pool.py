"""Pool: average pooling of each image's visual-token grid (the plain baseline of the benchmark studies)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from trimvlm.protocol import register
from trimvlm.tokens.base import Selection, TokenReducer, VisualView


def strides(keep: float) -> tuple[int, int]:
    """(short, long) window sides of a pooling that keeps `keep` = 1 / (short * long) of a grid: the most square
    factorisation of 1 / keep (0.5: 1 x 2, 0.25: 2 x 2, 0.125: 2 x 4). ValueError unless 1 / keep is an
    integer."""
    s = round(1.0 / keep)
    if s < 1 or abs(s * keep - 1.0) > 1e-6:
        raise ValueError(
            f"pool keeps 1 / (window area) of each grid: keep must be 1 / an integer (1, 0.5, 0.25, 0.125, ...), "
            f"got {keep}"
        )
    short = max(d for d in range(1, math.isqrt(s) + 1) if s % d == 0)
    return short, s // short


def windows(view: VisualView, short: int, long: int) -> torch.Tensor:
    """[U, N] long: the pooling window of every token of the view (-1 on pads). Windows are `sh x sw` blocks of
    the unit's grid from its top-left corner, the longer side of the window along the longer side of the grid
    (width on square grids); border windows are cut by the grid (ceil division)."""
    h, w = view.grid[:, 0:1], view.grid[:, 1:2]
    wide = w >= h
    sh = torch.where(wide, short, long)
    sw = torch.where(wide, long, short)
    cells = view.cells.clamp(min=0)
    r, c = cells // w, cells % w
    per_row = (w + sw - 1) // sw
    win = (r // sh) * per_row + c // sw
    return win.masked_fill(~view.mask, -1)


@register("tokens", "pool")
@dataclass
class Pool(TokenReducer):
    """Average pooling of each image's grid of LLM visual tokens (the benchmark studies' "pooling" baseline:
    "Token Pruning in MLLMs: Are We Solving the Right Problem?", ACL Findings 2025;
    docs/references.md#pooling-and-downsampling).

    Each unit's grid (its own h x w in LLM tokens: Qwen-VL's merged 2x2 patches, LLaVA's 24 x 24, one tile of
    Idefics3 / InternVL) is cut into sh x sw windows from the top-left corner, sh * sw = 1 / keep, the most square
    factorisation with the longer side along the grid's longer side (keep 0.5: 1 x 2, 0.25: 2 x 2, 0.125: 2 x 4);
    every window becomes one token, the mean of its tokens:

        y_{a,b} = 1/|W_ab| sum_{(r, c) in W_ab} x_{r,c},   W_ab = [a sh, (a+1) sh) x [b sw, (b+1) sw) cut by the grid,

    which is `avg_pool2d(x, (sh, sw), ceil_mode=True)` on the grid (tested). The pooled token takes the place and
    the position ids of its window's first (top-left) token, as every reducer here keeps original positions; the
    deepstack features of Qwen3-VL are pooled with the same windows. Pooling is element-wise: no method FLOPs.

    Deviations: the kept count is the number of windows, ceil(h / sh) * ceil(w / sw), which equals the shared
    rule K = ceil(N * keep) whenever the window divides the grid (the demo's 8 x 8, LLaVA's 24 x 24 at 50 / 25 /
    12.5%) and exceeds it by the cut border windows otherwise; tiles are pooled on their own grids (the per-image
    budget split over tiles does not apply). `keep` must be 1 / an integer. Pooled tokens keep their window's first
    position where pooling before the LLM would renumber a shorter grid. Default L = 0 (before the first layer, as
    the studies pool the projector's output); any L works (the pooled hidden states then)."""

    merge: bool = True

    keep_grid: ClassVar[tuple[float, ...]] = tuple(1 / s for s in range(1, 65))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.merge is not True:
            raise ValueError("pool always averages each window (merge=true); for a strided subset use tokens=random")
        strides(self.ratio)

    def counts(self, view: VisualView) -> torch.Tensor:
        """The number of windows of each unit's grid holding a real token (see the class docstring), not the
        shared ceil(N * keep)."""
        win = windows(view, *strides(self.ratio))
        hit = torch.zeros(win.shape[0], win.shape[1] + 1, dtype=torch.bool, device=win.device)
        return hit.scatter_(1, torch.where(view.mask, win, win.shape[1]), True)[:, :-1].sum(1)

    def choose(self, view: VisualView) -> Selection:
        win = windows(view, *strides(self.ratio))
        u, n = win.shape
        ar = torch.arange(n, device=win.device)[None].expand(u, n)
        big = torch.full_like(win, n)
        first = big.scatter_reduce(1, win.clamp(min=0), torch.where(view.mask, ar, big), "amin", include_self=True)
        assign = first.gather(1, win.clamp(min=0))  # the first token of each token's window
        keep = view.mask & (assign == ar)
        return Selection(keep=keep, assign=torch.where(view.mask, assign, ar))  # the base's (size-)weighted mean
