"""Budget kernel: split a fixed total of kept entries over layers in proportion to per-layer weights.

Used by the KV policies whose paper allocates a different budget to every layer (VL-Cache's sparsity-aware
allocation, AirCache's skew/strength allocation): whatever the weights, each sample keeps exactly the total it
was given (the sum of the uniform per-layer budgets), so every policy is compared at equal KV entries.
"""

from __future__ import annotations

import torch


def split_budget(weights: torch.Tensor, caps: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """[B, L] long: per row, integers k_l with sum_l k_l = min(total, sum_l caps_l) and 0 <= k_l <= caps_l,
    proportional to `weights` (>= 0; NaN counts 0) where no cap binds.

    Proportional share with caps (water-filling): a layer whose share exceeds its cap gets the cap and the rest
    is re-shared among the others, until no share exceeds its cap. Shares are then rounded down and the
    leftover units go to the largest fractional parts (ties: the lower layer). Layers of zero weight get
    nothing unless the positive-weight layers cannot hold the total; a row of all-zero weights is shared
    uniformly. float64 throughout, so the split does not depend on the batch."""
    w = torch.nan_to_num(weights.double(), nan=0.0).clamp(min=0)
    caps = caps.long().clamp(min=0)
    total = torch.minimum(total.long(), caps.sum(1))
    out = torch.zeros_like(caps)
    for b in range(w.shape[0]):
        out[b] = _split_row(w[b], caps[b], int(total[b]))
    return out


def _split_row(w: torch.Tensor, cap: torch.Tensor, total: int) -> torch.Tensor:
    capf = cap.double()
    share = torch.zeros_like(capf)
    for weight in (w * (cap > 0), (cap > 0).double()):  # the weights; then uniform for what they cannot hold
        free = (share < capf) & (weight > 0)
        left = total - float(share.sum())
        while left > 1e-9 and bool(free.any()):
            add = torch.zeros_like(capf)
            add[free] = left * weight[free] / float(weight[free].sum())
            over = free & (share + add >= capf - 1e-12)
            if bool(over.any()):  # these hit their caps: fill them, re-share the rest
                share[over] = capf[over]
                free &= ~over
            else:
                share = share + add
                break
            left = total - float(share.sum())
    k = torch.floor(share + 1e-9).long().minimum(cap)
    rest = total - int(k.sum())
    if rest > 0:
        frac = (share - k.double()).masked_fill(k >= cap, -1.0)
        order = torch.sort(-frac, stable=True).indices  # largest fraction first, lower layer on ties
        k[order[:rest]] += 1
    return k
