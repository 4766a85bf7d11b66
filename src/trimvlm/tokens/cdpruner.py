"""CDPruner: a conditional DPP over each image's visual tokens, its MAP found by fast greedy inference."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from trimvlm.kernels import jit
from trimvlm.kernels.flops import bmm
from trimvlm.protocol import register
from trimvlm.tokens.base import Selection, TokenReducer, VisualView


def relevance(xn: torch.Tensor, mask: torch.Tensor, tn: torch.Tensor, tmask: torch.Tensor) -> torch.Tensor:
    """[U, N] relevance of every visual token to the instruction, min-max normalised per unit to [0, 1]:
    r_i = mean_m cos(x_i, t_m) over the instruction tokens m (unit-normalised xn [U, N, D], tn [U, M, D])."""
    sim = bmm(xn, tn.transpose(1, 2))  # [U, N, M]
    tm = tmask.to(sim.dtype)
    r = (sim * tm[:, None, :]).sum(-1) / tm.sum(-1, keepdim=True).clamp(min=1)
    lo = r.masked_fill(~mask, float("inf")).amin(1, keepdim=True)
    hi = r.masked_fill(~mask, float("-inf")).amax(1, keepdim=True)
    return ((r - lo + 1e-6) / (hi - lo).clamp(min=1e-12)).masked_fill(~mask, 0.0)


def dpp_greedy(
    xn: torch.Tensor, quality: torch.Tensor, mask: torch.Tensor, k: torch.Tensor, eps: float = 1e-5
) -> torch.Tensor:
    """[U, kmax] the greedy MAP picks of the DPP with kernel L_ij = q_i <x_i, x_j> q_j (xn [U, N, D], quality
    [U, N]), k[u] picks per unit (later columns repeat the last pick), by the fast greedy inference of Chen et al.
    (NeurIPS 2018, Algorithm 1): with d_i^2 = L_ii, pick j = argmax d_i^2 (= argmax of the log-det gain
    log det L_{S+i} - log det L_S), then for every i: e_i = (L_ji - <c_j, c_i>) / d_j, c_i <- [c_i, e_i],
    d_i^2 <- d_i^2 - e_i^2. One kernel row per pick ([U, D] x [D, N]) and one [t] x [t, N] product: O(N (D + t))
    per pick, O(k N) memory, no N x N matrix and no determinant. When every remaining gain is below `eps` times
    its L_ii (the kernel's rank, at most D, is spent, or the rest are duplicates), the remaining picks follow
    `quality` (Chen et al. stop there; the budget here is exact), so rounding noise never decides a pick."""
    u, n, _ = xn.shape
    kmax = int(k.max())
    d2 = (quality * quality * (xn * xn).sum(-1)).masked_fill(~mask, float("-inf"))
    floor = d2.clamp(min=0) * eps  # below it a gain is rounding noise (the kernel's rank is spent)
    fallback = quality - 2.0  # ... then the most relevant remaining token, deterministically
    c = xn.new_zeros(u, kmax, n)
    picks = torch.zeros(u, kmax, dtype=torch.long, device=xn.device)
    if jit.compiled(xn, quality, cpu=True) and kmax > 0:
        return _greedy_compiled(xn, quality, k, d2, floor, fallback, c, picks)
    rows = torch.arange(u, device=xn.device)
    for t in range(kmax):
        j = torch.where(d2 > floor, d2, torch.where(torch.isinf(d2), d2, fallback)).argmax(1)
        active = t < k
        picks[:, t] = torch.where(active, j, picks[:, t - 1] if t else j)
        row = bmm(xn[rows, j][:, None, :], xn.transpose(1, 2))[:, 0]  # <x_j, x_i>
        lj = quality[rows, j][:, None] * row * quality
        if t:
            lj = lj - bmm(c[rows, :t, j][:, None, :], c[:, :t])[:, 0]
        e = lj / d2[rows, j].clamp(min=1e-12).sqrt()[:, None]
        real = active & (d2[rows, j] > floor[rows, j])  # a fallback pick adds nothing to the factorisation
        e = torch.where(real[:, None], e, torch.zeros_like(e))
        c[:, t] = e
        d2 = d2 - e * e
        d2[rows, j] = float("-inf")
    return picks


def _greedy_compiled(xn, quality, k, d2, floor, fallback, c, picks) -> torch.Tensor:
    """`dpp_greedy`'s loop with its O(N) work per pick compiled (`kernels.picks.dpp_step`): the same two counted
    products per pick on the same operands (the gathered rows written into buffers of the shapes the torch loop
    builds), the same float operations in the same order, so the same picks."""
    from trimvlm.kernels import picks as picks_kernel  # imports numba: on first use

    u, kmax, n = c.shape
    arr = [t.detach().contiguous().numpy() for t in (xn, quality, d2, floor, fallback)]
    xn_np, q_np, d2_np, floor_np, fb_np = arr
    k_np, c_np, picks_np = k.detach().cpu().numpy().astype(np.int64), c.numpy(), picks.numpy()
    j = np.zeros(u, dtype=np.int64)
    picks_kernel.dpp_first(d2_np, floor_np, fb_np, j)
    xj = torch.from_numpy(xn_np[np.arange(u), j][:, None, :].copy())  # [U, 1, D]
    cj = torch.zeros(u * kmax, dtype=xn.dtype)  # flat: [U, t] for pick t
    xt = xn.transpose(1, 2)
    tiny = d2_np.dtype.type(1e-12)
    cprod = row = None
    for t in range(kmax):
        row = bmm(xj, xt)[:, 0]  # <x_j, x_i>
        if t:
            cprod = bmm(cj[: u * t].view(u, 1, t), c[:, :t])[:, 0].numpy()
        picks_kernel.dpp_step(
            t, k_np, j, picks_np, q_np, row.numpy(), cprod if t else row.numpy(), d2_np, floor_np, fb_np,
            c_np, tiny, xn_np, xj.numpy(), cj.numpy(),
        )  # fmt: skip
    return picks


@register("tokens", "cdpruner")
@dataclass
class CDPruner(TokenReducer):
    """CDPruner (Zhang et al., NeurIPS 2025, arXiv 2506.10967; docs/references.md#cdpruner), per image:

    1. similarity: S_ij = cos(x_i, x_j) of the visual tokens (the projector's outputs at L = 0, as the paper);
    2. relevance to the instruction: r_i = mean_m cos(x_i, t_m) over the instruction's tokens t_m, min-max
       normalised over the image: r~_i = (r_i - min r + 1e-6) / (max r - min r);
    3. the conditional kernel L~ = diag(r~) S diag(r~), L~_ij = r~_i S_ij r~_j: a DPP over it trades relevance
       (the diagonal) against redundancy (the off-diagonal similarity);
    4. MAP inference: K = ceil(N * keep) greedy picks of max log det L~_S (Chen et al.'s fast greedy update,
       `dpp_greedy`: linear in the picks, no determinant recomputed). No merge.

    Deviations: (a) the paper scores relevance in CLIP's joint space (vision-tower patch embeddings against CLIP's
    text encoding of the instruction), and negates it for LLaVA's CLIP, an effect its authors saw in CLIP only;
    no family here ships a CLIP text tower, so relevance is taken in the LLM's space, between the visual tokens
    and the hidden states of the instruction's tokens entering layer L (their embeddings at L = 0: the text tokens
    after the sample's last image, the template's closing tokens included), not negated; (b) min-max per image
    where the code normalises over the whole batch (the result would change with the batch); (c) the optional
    `theta` reweighting of the code (commented out there) is not offered. Default L = 0 (the paper prunes before
    the LLM); any L works on that layer's hidden states. Method FLOPs: the relevance products (2 N M D), one kernel
    row per pick (2 N D) and the Cholesky update (2 t N at pick t), on each image's own N and M (`choose`)."""

    wants_text = True

    def choose(self, view: VisualView) -> Selection:
        """Each unit alone, on its own real tokens and instruction tokens (a [1, n, D] problem whatever the batch):
        batched products round differently with the batch's size and padding, and a greedy DPP turns a last-bit
        difference in a near-tie into another pick, so a unit's picks would depend on the rest of its batch."""
        dt = torch.promote_types(view.features.dtype, torch.float32)
        keep = torch.zeros_like(view.mask)
        for u in range(view.mask.shape[0]):
            cols = view.mask[u].nonzero()[:, 0]
            xn = F.normalize(view.features[u, cols].to(dt), dim=-1, eps=1e-12)[None]
            tn = F.normalize(view.text[u][view.text_mask[u]].to(dt), dim=-1, eps=1e-12)[None]
            real = xn.new_ones(xn.shape[:2], dtype=torch.bool)
            said = tn.new_ones(tn.shape[:2], dtype=torch.bool)
            k = view.k[u : u + 1]
            picks = dpp_greedy(xn, relevance(xn, real, tn, said), real, k)
            keep[u, cols[picks[0, : int(k)]]] = True
        return Selection(keep=keep)
