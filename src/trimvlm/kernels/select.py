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


TILE_STRIDE = 1 << 20  # token index offset per tile of a tiled image (a tile holds fewer tokens than this)


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _M1, _M2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic)."""
    x = (x ^ _lsr(x, 30)) * _M1
    x = (x ^ _lsr(x, 27)) * _M2
    return x ^ _lsr(x, 31)


def hashed_uniform(seed: int, key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """U[0, 1) per (seed, key, index), float64, a counter-based draw: the value of an element depends on
    nothing else (not on the batch, the other elements, or the order they are asked in). `key` identifies an
    image (its content fingerprint), `index` a token of it."""
    x = _mix(key.long() + _signed((int(seed) * _GOLDEN) % (1 << 64)))
    x = _mix(x + index.long())
    return _lsr(x, 11).double() / float(1 << 53)


def pool_keys(s: torch.Tensor, kernel: int, pool: str = "avg") -> torch.Tensor:
    """s [..., K] pooled along K with a same-length 1-D window of odd width `kernel` (1: as is); `avg` counts
    the padding in the window (an entry next to padding scores the same in a batch as alone), `max` ignores it.
    SnapKV's clustering of the observation window's scores."""
    if kernel == 1:
        return s
    shape = s.shape
    x = s.reshape(-1, 1, shape[-1])
    p = kernel // 2
    if pool == "avg":
        x = torch.nn.functional.avg_pool1d(x, kernel, stride=1, padding=p, count_include_pad=True)
    else:
        x = torch.nn.functional.max_pool1d(x, kernel, stride=1, padding=p)
    return x.reshape(shape)


def window_scores(att: torch.Tensor, rows: torch.Tensor, cand: torch.Tensor, kernel: int, pool: str) -> torch.Tensor:
    """[B, K] SnapKV's score of every cache entry: the attention it receives from the observation window's
    real query rows (att [B, n, K], heads averaged; rows [B, n] bool), summed over them, with every entry
    outside `cand` zeroed, then pooled along K (`pool_keys`). Per head: att [B, H, n, K], rows [B, 1, n] and
    cand [B, 1, K] give [B, H, K]."""
    s = (att.float() * rows[..., None]).sum(-2).masked_fill(~cand, 0.0)
    return pool_keys(s, kernel, pool)
