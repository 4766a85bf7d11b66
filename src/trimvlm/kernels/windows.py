"""Spatial density's window sums compiled (`kernels.jit`): per cell, the sum of its valid window neighbours' unit
vectors and their count, in one pass over the grid (the torch path makes two box sums and a subtraction, each a
pass over all N x d features). The dot product with the cell's own vector stays a counted torch product, so the
method FLOPs are torch's counter's on both paths. The same rho to rounding: the sums run in another order."""

from __future__ import annotations

import numpy as np

from trimvlm.kernels.jit import njit


@njit
def window_sums(xn, valid, window, acc, cnt, units):
    """For the grids `units` of xn [B, h, w, d]: acc [B, h, w, d] the sum of each valid cell's valid window
    neighbours (itself excluded; 0 on cells that are not valid), cnt [B, h, w] how many there are."""
    _, h, w, d = xn.shape
    r = window // 2
    for b in units:
        for i in range(h):
            for j in range(w):
                acc[b, i, j] = 0
                cnt[b, i, j] = 0
                if not valid[b, i, j]:
                    continue
                for a in range(max(0, i - r), min(h, i + r + 1)):
                    for c in range(max(0, j - r), min(w, j + r + 1)):
                        if (a != i or c != j) and valid[b, a, c]:
                            cnt[b, i, j] += 1
                            for e in range(d):
                                acc[b, i, j, e] += xn[b, a, c, e]


def neighbour_sums(xn, mask, window: int):
    """(acc [B, h, w, d], count [B, h, w]) as torch tensors, for unit vectors xn [B, h, w, d] (a torch tensor on
    the CPU; mask [B, h, w] bool or None), the grids on the threads of `kernels.threads`."""
    import torch

    from trimvlm.kernels.threads import for_units

    b, h, w, d = xn.shape
    x = np.ascontiguousarray(xn.detach().numpy())
    valid = np.ones((b, h, w), dtype=np.bool_) if mask is None else np.ascontiguousarray(mask.numpy())
    acc, cnt = np.empty_like(x), np.empty((b, h, w), dtype=x.dtype)
    for_units(lambda units: window_sums(x, valid, window, acc, cnt, units), np.arange(b), h * w * d * window)
    return torch.from_numpy(acc), torch.from_numpy(cnt)
