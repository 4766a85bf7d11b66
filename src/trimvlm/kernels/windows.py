"""Spatial density's windows compiled (`kernels.jit`): per cell, the sum of its window neighbours' unit
vectors and its dot product with the cell's own, in one pass over the grid (the torch path makes a box sum, a
subtraction and a batched row product, each a pass over all N x d features). The same rho to rounding: the
sums run in another order."""

from __future__ import annotations

import numpy as np

from trimvlm.kernels.jit import njit


@njit(fastmath={"reassoc", "contract"})
def _dot(a, b):
    """<a, b> of two 1-D arrays, vectorised (lanes summed in the order the compiler picks, fixed per build)."""
    s = a.dtype.type(0)
    for e in range(a.shape[0]):
        s += a[e] * b[e]
    return s


@njit
def window_density(xn, valid, window, out, units):
    """rho [B, h, w] into `out` for the grids `units` of xn [B, h, w, d] (unit vectors; zero where not `valid`):
    rho = 1 - <x, sum of the valid window neighbours> / max(count, 1), 0 on cells that are not valid."""
    _, h, w, d = xn.shape
    r = window // 2
    acc = np.empty(d, dtype=xn.dtype)
    one = xn.dtype.type(1)
    for b in units:
        for i in range(h):
            for j in range(w):
                if not valid[b, i, j]:
                    out[b, i, j] = 0
                    continue
                acc[:] = 0
                cnt = 0
                for a in range(max(0, i - r), min(h, i + r + 1)):
                    for c in range(max(0, j - r), min(w, j + r + 1)):
                        if (a != i or c != j) and valid[b, a, c]:
                            cnt += 1
                            for e in range(d):
                                acc[e] += xn[b, a, c, e]
                out[b, i, j] = one - _dot(xn[b, i, j], acc) / xn.dtype.type(max(cnt, 1))


def compiled_density(xn, mask, window: int):
    """rho [B, h, w] of unit vectors xn [B, h, w, d] (a torch tensor on the CPU; mask [B, h, w] bool or None),
    the grids on the threads of `kernels.threads`; counted as the torch path's row products (2 N d)."""
    import torch

    from trimvlm.kernels.flops import count
    from trimvlm.kernels.threads import for_units

    b, h, w, d = xn.shape
    x = np.ascontiguousarray(xn.detach().numpy())
    valid = np.ones((b, h, w), dtype=np.bool_) if mask is None else np.ascontiguousarray(mask.numpy())
    out = np.empty((b, h, w), dtype=x.dtype)
    count(2 * b * h * w * d)
    for_units(lambda units: window_density(x, valid, window, out, units), np.arange(b), h * w * d * window)
    return torch.from_numpy(out)
