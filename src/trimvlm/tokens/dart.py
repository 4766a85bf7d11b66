"""DART: pivot tokens by feature norm, then keep the tokens least similar to the pivots (drop duplicates)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trimvlm.kernels.select import topk_mask
from trimvlm.options import require_int
from trimvlm.registry import register
from trimvlm.tokens.base import Selection, TokenReducer, VisualView


@register("tokens", "dart")
@dataclass
class DART(TokenReducer):
    """Per image: the `pivots` tokens with the largest L`norm` norm of their hidden state are kept as pivots;
    of the others, the K - pivots tokens whose highest cosine similarity to any pivot is lowest are kept
    (near-duplicates of the pivots are dropped). With K <= pivots only the top-norm tokens are kept. Cost
    O(N * pivots * d). Default layer 0."""

    pivots: int = 8
    norm: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        require_int("pivots", self.pivots, minimum=1)
        if self.norm not in (1, 2) or isinstance(self.norm, bool):
            raise ValueError(f"norm must be 1 or 2, got {self.norm!r}")

    def choose(self, view: VisualView) -> Selection:
        x = view.features.float()
        norms = x.norm(p=self.norm, dim=-1)
        p = torch.minimum(view.k, torch.full_like(view.k, self.pivots))
        piv = topk_mask(norms, p, view.mask)
        pmax = int(p.max())
        pidx = torch.sort(piv.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :pmax]
        pval = piv.gather(1, pidx)
        xn = F.normalize(x, dim=-1, eps=1e-12)
        xp = xn.gather(1, pidx[..., None].expand(-1, -1, xn.shape[-1]))
        sim = torch.bmm(xn, xp.transpose(1, 2)).masked_fill(~pval[:, None], float("-inf")).amax(-1)
        rest = topk_mask(-sim, view.k - p, view.mask & ~piv)
        return Selection(keep=piv | rest)
