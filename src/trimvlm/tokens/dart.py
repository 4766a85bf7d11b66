"""DART (duplication-aware token reduction): pivots by key norm, then per pivot the tokens least like it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trimvlm.kernels import jit
from trimvlm.kernels.flops import bmm
from trimvlm.kernels.select import topk_mask
from trimvlm.options import option, require_choice, require_int
from trimvlm.protocol import register
from trimvlm.tokens.base import Selection, TokenReducer, VisualView


@register("tokens", "dart")
@dataclass
class DART(TokenReducer):
    """DART (Wen et al. 2025; docs/references.md#dart), before decoder layer L (default 2), per image:

    1. pivots: the `pivots` tokens (default 8) with the largest L2 norm of their key states in layer L
       (`pivot=key`, the paper's default: the keys layer L computes from the hidden states entering it, before
       RoPE, which does not change a norm; computed for the visual tokens only, counted as method FLOPs), or of
       their hidden states (`pivot=hidden`);
    2. the rest of the budget, K - pivots, is split evenly over the pivots (the first pivots, in norm order,
       take the remainder); pivot j keeps the tokens least cosine-similar to it, on the hidden states, among
       those no earlier pivot kept: near-duplicates of a pivot are dropped.
    With K <= pivots only the top-norm pivots are kept. Time O(N * pivots * d)."""

    pivots: int = option(8, require_int, minimum=1)
    pivot: str = option("key", require_choice, allowed=("key", "hidden"))

    default_layer = 2

    @property
    def wants_keys(self) -> bool:
        return self.pivot == "key"

    def choose(self, view: VisualView) -> Selection:
        x = view.features.float()
        basis = view.keys if self.pivot == "key" else view.features
        norms = basis.float().norm(dim=-1)
        p = torch.minimum(view.k, torch.full_like(view.k, self.pivots))
        keep = topk_mask(norms, p, view.mask)
        pmax = int(p.max())
        order = torch.sort(norms.masked_fill(~keep, float("-inf")), dim=1, descending=True, stable=True)
        pidx = order.indices[:, :pmax]  # pivots of each unit, largest norm first
        xn = F.normalize(x, dim=-1, eps=1e-12)
        xp = xn.gather(1, pidx[..., None].expand(-1, -1, xn.shape[-1]))
        sim = bmm(xn, xp.transpose(1, 2))  # [U, N, pmax] cosine of every token to every pivot
        rest = view.k - p
        j = torch.arange(pmax, device=p.device)[None]
        shares = torch.div(rest, p.clamp(min=1), rounding_mode="floor")[:, None] + (j < (rest % p.clamp(min=1))[:, None])
        shares = torch.where(j < p[:, None], shares, torch.zeros_like(shares))  # [U, pmax] tokens per pivot
        if jit.compiled(sim, cpu=True):  # the pivots' passes compiled, one selection per pivot (kernels.picks)
            from trimvlm.kernels.picks import top_share

            top_share(sim.detach().numpy(), keep.numpy(), view.mask.cpu().numpy(), shares.numpy())
            return Selection(keep=keep)
        for j in range(pmax):
            keep |= topk_mask(-sim[:, :, j], shares[:, j], view.mask & ~keep)
        return Selection(keep=keep)
