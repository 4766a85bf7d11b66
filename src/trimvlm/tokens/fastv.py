"""FastV: keep the visual tokens that receive the most attention from the last query token at layer L-1."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from trimvlm.kernels.select import TILE_STRIDE, hashed_uniform, topk_mask
from trimvlm.options import option, require_int, require_number
from trimvlm.protocol import register
from trimvlm.tokens.base import Selection, TokenReducer, VisualView


@register("tokens", "fastv")
@dataclass
class FastV(TokenReducer):
    """Rank each image's visual tokens by the attention they receive from the last query token in layer L-1
    (softmax over that layer's keys, heads averaged), keep the top K = ceil(N * keep). Only that one attention
    row is computed (an AttentionProbe on layer L-1); the model keeps running SDPA. Needs L >= 1 (default 2,
    FastV's K = 2).

    Noise-perturbed FastV (Pruning All-Rounder, docs/references.md#noise-perturbed-fastv): with
    `trials=T > 1`, T selections are tried: the plain ranking and T - 1 rankings of the scores plus Gaussian
    noise N(0, (noise * std)^2) (std of the image's scores; the draw is seeded per image, `seed`). Each is
    judged by the self-supervised criterion: the KL between the next-token distribution of the unpruned
    sequence and of the pruned one, both run through the remaining layers on a scratch cache; each sample
    keeps its best trial (never worse than plain FastV on that criterion). The look-ahead runs cost (T + 1) x
    the layers L.. of a prefill and are counted as method FLOPs."""

    noise: float = option(0.0, require_number, low=0, hint=" (in units of the scores' std)")
    trials: int = option(1, require_int, minimum=1)
    seed: int = option(0, require_int)

    attention: ClassVar[str] = "llm"
    default_layer = 2
    min_layer = 1

    def choose(self, view: VisualView) -> Selection:
        sel = Selection(keep=topk_mask(view.attention, view.k, view.mask))
        return sel if self.trials <= 1 or self.noise == 0 else self.search(view, sel)

    def search(self, view: VisualView, sel: Selection) -> Selection:
        """The noise-perturbed trials, each judged by the KL of the look-ahead (`view.finish`)."""
        target = torch.log_softmax(view.finish().double(), -1)
        att = view.attention.float()
        m = view.mask.float()
        n = m.sum(1, keepdim=True)
        mean = (att * m).sum(1, keepdim=True) / n
        std = (((att - mean) * m).pow(2).sum(1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()  # real tokens only
        index = view.cells.clamp(min=0) + view.tile[:, None] * TILE_STRIDE

        def kl_of(keep: torch.Tensor) -> torch.Tensor:  # [B]
            return (target.exp() * (target - torch.log_softmax(view.finish(keep).double(), -1))).sum(-1)

        best_keep, best_kl = sel.keep, kl_of(sel.keep)
        for t in range(1, self.trials):
            u1 = hashed_uniform(self.seed * 1009 + 2 * t, view.image_key[:, None], index).clamp(min=1e-12)
            u2 = hashed_uniform(self.seed * 1009 + 2 * t + 1, view.image_key[:, None], index)
            gauss = (torch.sqrt(-2 * torch.log(u1)) * torch.cos(2 * math.pi * u2)).float()  # Box-Muller
            keep = topk_mask(att + self.noise * std * gauss, view.k, view.mask)
            kl = kl_of(keep)
            better = kl < best_kl  # per sample
            best_kl = torch.where(better, kl, best_kl)
            best_keep = torch.where(better[view.sample][:, None], keep, best_keep)
        return Selection(keep=best_keep)
