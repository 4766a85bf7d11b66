"""PruMerge (LLaVA-PruMerge) and PruMerge+: the vision tower's [CLS] attention outliers (IQR rule), filled to the
budget, every other token merged into its most key-similar kept token, weighted by attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trimvlm.kernels.merge import nearest_kept
from trimvlm.kernels.select import topk_mask
from trimvlm.options import option, require_bool
from trimvlm.protocol import register
from trimvlm.tokens.base import Selection, VisionAttentionReducer, VisualView


def iqr_outliers(scores: torch.Tensor, mask: torch.Tensor, whisker: float = 1.5) -> torch.Tensor:
    """[U, N] bool: scores above Q3 + whisker * (Q3 - Q1) of their row's masked entries."""
    s = scores.float().masked_fill(~mask, float("nan"))
    q1 = torch.nanquantile(s, 0.25, dim=1, keepdim=True)
    q3 = torch.nanquantile(s, 0.75, dim=1, keepdim=True)
    return (scores.float() > q3 + whisker * (q3 - q1)) & mask


def spread(cands: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """[U, N] bool: f[u] of row u's candidates, evenly spaced in index (grid) order."""
    m = cands.sum(1, keepdim=True).clamp(min=1)
    r = cands.long().cumsum(1) - 1  # rank among candidates
    fu = f[:, None]
    return cands & ((r + 1) * fu // m > r * fu // m)


@register("tokens", "prumerge")
@dataclass
class PruMerge(VisionAttentionReducer):
    """LLaVA-PruMerge, as its paper defines it, at LLM layer L = 0 (on the projector's tokens).

    Scores: the vision tower's attention in layer `vision_layer` (default -2, the penultimate), recorded by a
    `VisionProbe` while the images are encoded: on towers with a [CLS] token (CLIP in LLaVA, InternViT) the
    attention from [CLS] to each patch, heads averaged; on towers without one (Qwen-VL, SigLIP in LLaVA and
    Idefics3) the mean attention each patch receives (column mean of the softmax over the image's query
    patches, heads averaged) -- the paper has no [CLS]-free variant, this is trimvlm's. Where the projector merges
    several patches into one LLM token (Qwen-VL 2x2, pixel shuffles) the token's score is their sum.

    Selection: the IQR outliers (score > Q3 + 1.5 IQR, per image) are the tokens PruMerge keeps. trimvlm's budget
    is exact, K = ceil(N * keep) per image (PruMerge's own count is adaptive): with more than K outliers the K
    highest are kept; with fewer, the budget is filled
    - plain PruMerge: with the next-highest scores (so the kept set is the top K by score, the outliers first);
    - PruMerge+ (`plus=true`): with tokens spatially uniform over the grid among the non-outliers (evenly spaced
      in row-major order, as PruMerge+'s arithmetic index sequence).

    Merge (`merge=true`, default): every dropped token joins its most key-similar kept token (cosine of that vision
    layer's keys, heads concatenated as PruMerge's k_proj output), and each kept token becomes the
    attention-weighted mean of itself and the tokens that joined it. Deviations from the paper's code: the
    merge is a partition (each dropped token goes to one kept token) with a normalised weighted mean, where the
    code adds the attention-weighted sum of each kept token's 32 key-nearest tokens (kept ones included) to it;
    it merges the projector's outputs (LLM tokens) rather than the vision features before the projector; the
    attention is the layer's multi-head one (heads averaged) where the code recomputes a single-head softmax of
    the concatenated q and k; and the layer is the penultimate one as the paper says (the code hooks CLIP-L's
    last layer, index 23)."""

    merge: bool = True
    plus: bool = option(False, require_bool)

    def choose(self, view: VisualView) -> Selection:
        scores = view.attention.masked_fill(~view.mask, 0.0)
        out = iqr_outliers(scores, view.mask)
        if self.plus:
            top = topk_mask(scores, torch.minimum(out.sum(1), view.k), out)
            keep = top | spread(view.mask & ~top, view.k - top.sum(1))
        else:
            keep = topk_mask(scores, view.k, view.mask)  # the outliers are the highest scores: all kept first
        if not self.merge:
            return Selection(keep=keep)
        assign = nearest_kept(view.keys, view.mask, keep)
        return Selection(keep=keep, assign=assign, weight=scores.clamp(min=1e-12) * view.size)
