"""Selection kernels shared by the prefill reducers and the KV policies: one `keep` semantics (how many entries
a kept fraction leaves) and one top-k mask."""

from __future__ import annotations

import math

import torch


def keep_count(n, keep: float, minimum: int = 0):
    """ceil(n * keep), clamped to [min(minimum, n), n], for an int or a tensor of counts. A 1e-9 slack keeps
    float products such as 0.1 * 30 or (1 - 0.8) * 10 from rounding up. Token reducers keep at least one token
    per image (`minimum=1`); a KV policy may keep none (keep = 0, "Dall")."""
    if isinstance(n, torch.Tensor):
        k = torch.ceil(n.double() * keep - 1e-9).long()
        return torch.minimum(k.clamp(min=0), n.long()).clamp(min=0).maximum(n.long().clamp(max=minimum))
    return max(min(minimum, n), min(n, max(0, math.ceil(n * keep - 1e-9))))


def topk_mask(scores: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[R, N] bool: per row the k[r] highest scores among `mask` (NaN ranks last; ties: lower index first)."""
    s = torch.nan_to_num(scores.float(), nan=-math.inf).masked_fill(~mask, -math.inf)
    order = torch.sort(s, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(
        1, order, torch.arange(s.shape[1], device=s.device).expand_as(order)
    )
    return mask & (rank < k.to(rank.device)[:, None])
