"""Density kernels shared by the prefill reducers and the KV policies (TwinPrune,
docs/references.md#spatial-density): spatial density rho on a patch grid, its normalisations, DivPrune's most
isolated token, and (from `kernels.farthest`) density-tilted farthest-point selection."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from trimvlm.kernels import jit
from trimvlm.kernels.farthest import BLOCK, farthest_point
from trimvlm.kernels.flops import bmm, rowdot
from trimvlm.kernels.flops import count as count_flops

__all__ = ["BLOCK", "farthest_point", "grid_density", "masked_minmax", "most_isolated", "spatial_density"]


def spatial_density(
    features: torch.Tensor,
    window: int = 3,
    *,
    grid: tuple[int, int] | None = None,
    mask: torch.Tensor | None = None,
    normalized: bool = False,
) -> torch.Tensor:
    """Spatial density rho of visual tokens on their patch grid (TwinPrune eq. in section 4.1).

        rho_ij = 1 - (1/|N_w(i,j)|) * sum_{(i',j') in N_w(i,j)} cos(x_ij, x_i'j')

    N_w(i,j) is the `window` x `window` neighbourhood of (i,j), clipped at the grid border, excluding (i,j)
    itself. High rho = locally non-redundant. Cost O(N * window^2 * d) time, O(N * d) memory (no N x N matrix).

    Args:
        features: one image `[h, w, d]`, a batch of same-size grids `[B, h, w, d]`, or flat tokens `[N, d]`
            / `[B, N, d]` in row-major grid order together with `grid=(h, w)`.
        window: odd window side w >= 1 (default 3). w = 1 has no neighbours.
        grid: `(h, w)` when `features` is flat.
        mask: optional bool, same leading shape as the returned rho: False marks cells that are not tokens
            (grids of different sizes padded into one tensor, or tokens already removed). Those cells are not
            neighbours of anyone (they leave the sum and the count |N_w|); their own rho is returned as 0.
        normalized: the features are unit vectors already (F.normalize with eps 1e-12, as here), so the
            caller's copy is used as is (the selection that follows needs the same vectors).

    Returns:
        rho (float32; float64 for float64 input) with the input's leading shape minus the feature axis: `[h, w]`, `[B, h, w]`, `[N]` or
        `[B, N]`. A token without any neighbour (a 1x1 grid, or window = 1) gets rho = 1. Not normalised; use
        `masked_minmax` for the min-max normalised rho~ in [0, 1].
    """
    if window < 1 or window % 2 == 0:
        raise ValueError(f"window must be an odd integer >= 1, got {window}")
    x = _grids(features, grid)
    b, h, w, _ = x.shape
    dt = torch.promote_types(x.dtype, torch.float32)
    xn = x.to(dt) if normalized else F.normalize(x.to(dt), dim=-1, eps=1e-12)
    m = None
    if mask is not None:
        m = mask.reshape(b, h, w).to(device=x.device, dtype=dt)
    if jit.compiled(xn, cpu=True):  # the window sums and dots in one pass per grid (kernels.windows)
        valid = xn.new_ones(b, h, w, dtype=torch.bool) if mask is None else mask.reshape(b, h, w).bool().cpu()
        count_flops(2 * b * h * w * xn.shape[-1])  # the dot products, as `rowdot` counts them
        sim, count = _window_dots(xn, valid, window)
    else:
        sim, count = _box_dots(xn, m, window)
    rho = 1.0 - sim / count.clamp(min=1.0)
    if m is not None:
        rho = rho * m
    return rho.reshape(features.shape[:-1])  # the caller's shape: one grid, or flat tokens


def grid_density(
    feats: torch.Tensor, cells: torch.Tensor, grid: torch.Tensor, mask: torch.Tensor, window: int = 3,
    normalized: bool = False,
) -> torch.Tensor:
    """rho [U, N] of units each on its own grid: unit u's real tokens (`mask` [U, N]) feats [U, N, d] sit at
    the row-major cells `cells` [U, N] of its (h, w) = grid[u]. Grids of different sizes are padded into one
    [U, Hmax, Wmax, d] tensor with a presence mask: one `spatial_density` call. 0 on pads."""
    u, n, d = feats.shape
    hmax, wmax = (int(v) for v in grid.amax(0).tolist())
    w, c = grid[:, 1:2], cells.clamp(min=0)
    flat = torch.where(mask, (c // w) * wmax + c % w, hmax * wmax)  # cell in the padded grid (pads: a spare)
    dt = torch.promote_types(feats.dtype, torch.float32)
    padded = feats.new_zeros(u, hmax * wmax + 1, d, dtype=dt)
    rows = torch.arange(u, device=flat.device)[:, None].expand(u, n)
    padded[rows[mask], flat[mask]] = feats[mask].to(dt)
    present = torch.zeros(u, hmax * wmax + 1, dtype=torch.bool, device=mask.device)
    present[rows[mask], flat[mask]] = True
    rho = spatial_density(
        padded[:, :-1].reshape(u, hmax, wmax, d), window, mask=present[:, :-1].reshape(u, hmax, wmax),
        normalized=normalized,
    )
    return rho.reshape(u, hmax * wmax).gather(1, flat.clamp(max=hmax * wmax - 1)).masked_fill(~mask, 0.0)


def _box_dots(xn: torch.Tensor, m: torch.Tensor | None, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per cell of xn [B, h, w, d] the summed cosine to its window neighbours and their count, by torch ops.

    Neighbours outside the grid (or masked by `m`) add 0 to both. Since sum_n cos(x, x_n) = <xn, sum_n xn_n>,
    the neighbours' unit vectors are summed first (a window box sum over each feature plane, minus the cell
    itself; element-wise work, uncounted as by torch's FlopCounterMode), then one dot product."""
    if m is not None:
        xn = xn * m[..., None]
    ones = m if m is not None else xn.new_ones(xn.shape[:-1])
    acc = _box_sum(xn.permute(0, 3, 1, 2), window).permute(0, 2, 3, 1).sub_(xn)  # in place: no fresh pages
    count = _box_sum(ones[:, None], window)[:, 0] - ones
    return rowdot(xn, acc), count  # the dots counted as method FLOPs: 2 * N * d


def _grids(x: torch.Tensor, grid: tuple[int, int] | None) -> torch.Tensor:
    """The features as [B, h, w, d] (one grid gets B = 1; flat tokens are laid on `grid`)."""
    if grid is not None:
        h, w = grid
        if x.shape[-2] != h * w:
            raise ValueError(f"{x.shape[-2]} tokens do not fill a {h}x{w} grid")
        x = x.reshape(*x.shape[:-2], h, w, x.shape[-1])
    if x.dim() not in (3, 4):
        raise ValueError(f"features must be [h, w, d] or [B, h, w, d] (or flat with grid), got {tuple(x.shape)}")
    return x[None] if x.dim() == 3 else x


def _box_sum(x: torch.Tensor, window: int) -> torch.Tensor:
    """Sum of each [h, w] plane of x [B, C, h, w] over the `window` x `window` box around every cell, clipped at
    the border (sum pooling with zero padding)."""
    return F.avg_pool2d(x, window, stride=1, padding=window // 2, divisor_override=1)


def masked_minmax(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Min-max normalise each row of x [U, N] over its `mask`ed entries to [0, 1]; -inf elsewhere."""
    x = x.float() if x.dtype not in (torch.float32, torch.float64) else x
    lo = x.masked_fill(~mask, float("inf")).amin(1, keepdim=True)
    hi = x.masked_fill(~mask, float("-inf")).amax(1, keepdim=True)
    out = (x - lo) / (hi - lo).clamp(min=1e-12)
    return out.masked_fill(~mask, float("-inf"))


def most_isolated(xn: torch.Tensor, mask: torch.Tensor, block: int = 256) -> torch.Tensor:
    """[U] per row the token farthest from its nearest other token in cosine distance,
    argmax_j min_{i != j} (1 - <xn_i, xn_j>), over the `mask`ed tokens (ties: the lowest index). A row with one
    token picks it. Row blocks of `block` x N distances; counted as method FLOPs."""
    u, n, _ = xn.shape
    nearest = torch.full((u, n), float("inf"), dtype=xn.dtype, device=xn.device)
    ar = torch.arange(n, device=xn.device)
    for s in range(0, n, block):
        d = 1.0 - bmm(xn[:, s : s + block], xn.transpose(1, 2))  # [U, b, N]
        d = d.masked_fill(~mask[:, None, :], float("inf"))
        d[:, ar[s : s + block] - s, ar[s : s + block]] = float("inf")  # not its own neighbour
        nearest[:, s : s + block] = d.amin(-1)
    lonely = torch.isinf(nearest) & mask  # a token with no other token in its row
    score = torch.where(lonely, torch.zeros_like(nearest), nearest).masked_fill(~mask, float("-inf"))
    return score.argmax(1)


@torch.library.custom_op("trimvlm::window_dots", mutates_args=())
def _window_dots(xn: torch.Tensor, valid: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled windows (`kernels.windows.neighbour_dots`) as a torch op, which torch's FlopCounterMode counts
    as 2 * N * d (the dots; the sums are element-wise work), as `rowdot` on the torch path."""
    from trimvlm.kernels.windows import neighbour_dots  # imports numba: on first use, not with trimvlm

    return neighbour_dots(xn, valid, window)


@_window_dots.register_fake
def _(xn, valid, window):
    return xn.new_empty(xn.shape[:-1]), xn.new_empty(xn.shape[:-1])


@register_flop_formula(torch.ops.trimvlm.window_dots)
def _window_dots_flops(xn_shape, *_, out_shape=None, **__) -> int:
    return 2 * math.prod(xn_shape)
