"""Spatial density's window similarity compiled (`kernels.jit`): per cell, the sum of its cosine similarities to
its valid window neighbours and the neighbours' count. sum_n <x, x_n> is computed as the dots themselves, each
pair of neighbours once (it counts for both cells): (window^2 - 1) / 2 dots of d per cell, read from the cache,
where the torch path makes two box sums, a subtraction and a dot product, each a pass over all N x d features.
It runs as the torch op `trimvlm::window_dots` (`kernels.density`), whose FLOPs torch's counter takes as the torch
path's: the 2 * N * d of the dot products (`flops.rowdot`). The same rho to rounding: the sums run in another
order.
"""

from __future__ import annotations

import numpy as np

from trimvlm.kernels.jit import njit


@njit(fastmath={"reassoc", "contract"})
def _dot(a, b):
    """<a, b> of two 1-D arrays, the sum reassociated (vector lanes: one dependent add per element is 4x slower)."""
    s = a.dtype.type(0)
    for e in range(a.shape[0]):
        s += a[e] * b[e]
    return s


@njit
def window_dots(xn, valid, window, sim, cnt, units):
    """For the grids `units` of xn [B, h, w, d]: sim [B, h, w] the sum of each valid cell's dots with its valid
    window neighbours (itself excluded; 0 on cells that are not valid), cnt [B, h, w] how many neighbours there
    are. Each neighbouring pair's dot is computed once, from its first cell in row-major order, and added to
    both cells."""
    _, h, w, _ = xn.shape
    r = window // 2
    for b in units:
        sim[b] = 0
        cnt[b] = 0
        for i in range(h):
            for j in range(w):
                if not valid[b, i, j]:
                    continue
                for a in range(i, min(h, i + r + 1)):
                    for c in range(max(0, j - r), min(w, j + r + 1)):
                        if (a == i and c <= j) or not valid[b, a, c]:
                            continue  # itself, a neighbour whose pair came before, or not a token
                        dot = _dot(xn[b, i, j], xn[b, a, c])
                        sim[b, i, j] += dot
                        sim[b, a, c] += dot
                        cnt[b, i, j] += 1
                        cnt[b, a, c] += 1


def neighbour_dots(xn, valid, window: int):
    """(sim [B, h, w], count [B, h, w]) as torch tensors, for unit vectors xn [B, h, w, d] and the valid cells
    [B, h, w] bool (torch tensors on the CPU), the grids on the threads of `kernels.threads`."""
    import torch

    from trimvlm.kernels.threads import for_units

    b, h, w, d = xn.shape
    x = np.ascontiguousarray(xn.detach().numpy())
    valid = np.ascontiguousarray(valid.numpy())
    sim, cnt = np.empty((b, h, w), dtype=x.dtype), np.empty((b, h, w), dtype=x.dtype)
    for_units(lambda units: window_dots(x, valid, window, sim, cnt, units), np.arange(b), h * w * d * window)
    return torch.from_numpy(sim), torch.from_numpy(cnt)
