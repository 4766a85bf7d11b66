"""Spatial density's window similarity compiled (`kernels.jit`): per cell, the sum of its valid window neighbours'
unit vectors, its dot with the cell's own vector and the neighbours' count, in one pass over the grid (the torch
path makes two box sums, a subtraction and a dot product, each a pass over all N x d features; here the sum of a
cell lives in one d-vector and is never written out). It runs as the torch op `trimvlm::window_dots`
(`kernels.density`), whose FLOPs torch's counter takes as the torch path's: the 2 * N * d of the dot products
(`flops.rowdot`). The same rho to rounding: the sums run in another order."""

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
    """For the grids `units` of xn [B, h, w, d]: sim [B, h, w] the dot of each valid cell's vector with the sum
    of its valid window neighbours' (itself excluded; 0 on cells that are not valid), cnt [B, h, w] how many
    neighbours there are."""
    _, h, w, d = xn.shape
    r = window // 2
    acc = np.empty(d, dtype=xn.dtype)
    for b in units:
        for i in range(h):
            for j in range(w):
                sim[b, i, j] = 0
                cnt[b, i, j] = 0
                if not valid[b, i, j]:
                    continue
                acc[:] = 0
                for a in range(max(0, i - r), min(h, i + r + 1)):
                    for c in range(max(0, j - r), min(w, j + r + 1)):
                        if (a != i or c != j) and valid[b, a, c]:
                            cnt[b, i, j] += 1
                            for e in range(d):
                                acc[e] += xn[b, a, c, e]
                sim[b, i, j] = _dot(acc, xn[b, i, j])


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
