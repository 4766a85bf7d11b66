"""VisPruner: important tokens by the vision tower's attention, plus diverse tokens left after removing the
duplicates among the rest by similarity."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trimvlm.kernels.flops import bmm
from trimvlm.kernels.select import topk_mask
from trimvlm.options import option, require_number
from trimvlm.protocol import register
from trimvlm.tokens.base import Selection, VisionAttentionReducer, VisualView


def remove_duplicates(x: torch.Tensor, rest: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[U, N] bool: per unit, `target[u]` of its `rest` tokens left after VisPruner's duplicate removal. Rounds
    until `target` remain: the remaining tokens, in grid order, alternate into A (1st, 3rd, ...) and B (2nd, 4th,
    ...); each a in A scores s_a = max_b cos(x_a, x_b); the min(|A|, remaining - target) tokens of A with the
    largest s_a (ties: the earlier token) are removed (a last lone token goes when none is wanted). x [U, N, D] is already L2-normalised."""
    left = rest.clone()
    for u in range(x.shape[0]):
        idx = torch.nonzero(left[u]).flatten()
        while idx.numel() > int(target[u]):
            a, b = idx[0::2], idx[1::2]
            if b.numel() == 0:  # one token left and none wanted: nothing to compare it with, it goes
                left[u, a[int(target[u]) :]] = False
                break
            s = bmm(x[u, a][None], x[u, b].T[None])[0].amax(1)
            r = min(a.numel(), idx.numel() - int(target[u]))
            order = torch.sort(s, descending=True, stable=True).indices
            left[u, a[order[:r]]] = False
            idx = torch.nonzero(left[u]).flatten()
    return left


@register("tokens", "vispruner")
@dataclass
class VisPruner(VisionAttentionReducer):
    """VisPruner (Zhang et al., "Beyond Text-Visual Attention: Exploiting Visual Cues for Effective Token Pruning
    in VLMs", ICCV 2025), at LLM layer L = 0, per image with budget K = ceil(N * keep):

    1. important tokens: the K_imp = round(K * important) tokens with the largest visual attention, the vision
       tower's [CLS] attention in its penultimate layer (`vision_layer`, default -2; heads averaged);
    2. diverse tokens: from the other N - K_imp tokens, duplicates are removed by similarity until
       K_div = K - K_imp remain (`remove_duplicates`): each round splits the remaining tokens alternately into
       A and B, and removes the tokens of A most cosine-similar to their nearest token of B (the image features,
       here the projector's outputs entering layer 0);
    3. keep important + diverse; the rest are dropped (no merge).

    Default `important=0.5` (VisPruner's important ratio). Headline (the paper's): VisPruner cuts the FLOPs of
    LLaVA-1.5-7B by 91 % and its inference latency by 75 % with comparable performance, above VisionZip and
    FasterVLM at every reduction ratio it reports.

    Towers without [CLS] (Qwen-VL, SigLIP): the mean attention each patch receives stands for the [CLS] row
    (as `tokens=fastervlm`, `tokens=visionzip`). Deviations: the similarity uses the projector's outputs (the
    paper's features before it where the projector is per patch; the same grouping of tokens); the number
    removed per round, min(|A|, remaining - K_div), is this implementation's reading of the paper's iterative
    removal. Method FLOPs: the A x B similarity products of every round."""

    important: float = option(
        0.5, require_number, low=0, high=1, hint=" (the share of the budget kept by attention)"
    )

    def choose(self, view: VisualView) -> Selection:
        n_imp = torch.round(view.k.double() * self.important).long().minimum(view.k)
        imp = topk_mask(view.attention, n_imp, view.mask)
        xn = F.normalize(view.features.float(), dim=-1, eps=1e-12)
        div = remove_duplicates(xn, view.mask & ~imp, view.k - n_imp)
        return Selection(keep=imp | div)
