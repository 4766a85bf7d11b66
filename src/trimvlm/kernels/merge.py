"""Merge kernels: the most similar kept token of every token, best bipartite matches, weighted group means.
Every similarity product is counted as method FLOPs (`kernels.flops`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trimvlm.kernels.flops import bmm


def nearest_kept(
    features: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor, chunk: int = 256
) -> torch.Tensor:
    """[U, N] long: for every token the index of its most cosine-similar kept token of the same unit (a kept
    token maps to itself). Computed in row chunks: memory O(chunk * K), never an N x N matrix."""
    u, n, _ = features.shape
    dt = torch.promote_types(features.dtype, torch.float32)
    xn = F.normalize(features.to(dt), dim=-1, eps=1e-12)
    kmax = int(keep.sum(1).max())
    kidx = torch.sort(keep.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :kmax]  # [U, K]
    kval = keep.gather(1, kidx)
    xk = xn.gather(1, kidx[..., None].expand(-1, -1, xn.shape[-1]))
    out = torch.empty(u, n, dtype=torch.long, device=features.device)
    for s in range(0, n, chunk):
        sim = bmm(xn[:, s : s + chunk], xk.transpose(1, 2))
        sim = sim.masked_fill(~kval[:, None], float("-inf"))
        out[:, s : s + chunk] = kidx.gather(1, sim.argmax(-1))
    ar = torch.arange(n, device=features.device)[None].expand(u, n)
    return torch.where(keep, ar, torch.where(mask, out, ar))


def merge_groups(
    x: torch.Tensor, keep: torch.Tensor, assign: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted mean of each kept token and the tokens assigned to it.

    x [U, N, D]; keep, mask [U, N] bool; assign [U, N] long (target index of each dropped token; ignored for
    kept ones, which are their own target); weight [U, N]. Returns (merged [U, N, D] in float32 or better,
    equal to x bit for bit wherever no token was merged in, and `members` [U, N] long: how many real tokens
    each kept token now groups)."""
    n = x.shape[1]
    ar = torch.arange(n, device=x.device)[None].expand_as(keep)
    tgt = torch.where(keep | ~mask, ar, assign)
    dt = torch.promote_types(x.dtype, torch.float32)
    w = weight.to(dt) * mask.to(dt)
    num = torch.zeros(x.shape, dtype=dt, device=x.device).scatter_add_(
        1, tgt[..., None].expand_as(x), x.to(dt) * w[..., None]
    )
    den = torch.zeros(keep.shape, dtype=dt, device=x.device).scatter_add_(1, tgt, w)
    members = torch.zeros_like(tgt).scatter_add_(1, tgt, mask.long())
    merged = num / den.clamp(min=torch.finfo(dt).tiny)[..., None]
    use = (keep & (members > 1))[..., None]
    return torch.where(use, merged, x.to(dt)), members


def best_match(xn: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, chunk: int = 128):
    """For each `rows` token the most cosine-similar `cols` token: (similarity [U, N], index [U, N]); -inf /
    0 off `rows`. Row chunks keep memory at O(chunk * N)."""
    u, n, _ = xn.shape
    best = torch.full((u, n), float("-inf"), dtype=xn.dtype, device=xn.device)
    idx = torch.zeros(u, n, dtype=torch.long, device=xn.device)
    for s in range(0, n, chunk):
        sim = bmm(xn[:, s : s + chunk], xn.transpose(1, 2)).masked_fill(~cols[:, None], float("-inf"))
        v, i = sim.max(-1)
        best[:, s : s + chunk], idx[:, s : s + chunk] = v, i
    return best.masked_fill(~rows, float("-inf")), idx.masked_fill(~rows, 0)
