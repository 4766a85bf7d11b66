"""VisionZip: the most-attended tokens of the vision tower (dominant), plus a few contextual tokens that the
remaining ones merge into by key similarity."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trimvlm.kernels.merge import nearest_kept
from trimvlm.kernels.select import topk_mask
from trimvlm.options import option, require_int
from trimvlm.protocol import register
from trimvlm.tokens.base import Selection, VisionAttentionReducer, VisualView


def split(k: torch.Tensor, dominant: int, contextual: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dominant [U], contextual [U]) counts of each unit's budget k: round(k * d / (d + c)) dominant, the rest
    contextual; when both kinds are asked for and k >= 2, at least one of each."""
    d = torch.round(k.double() * dominant / (dominant + contextual)).long()
    if dominant and contextual:
        d = torch.where(k >= 2, d.clamp(min=1).minimum(k - 1), k)
    return d, k - d


def uniform_targets(rest: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """[U, N] bool: c[u] targets among row u's `rest` tokens, VisionZip's rule: the remaining tokens in grid
    order, every step-th from the first, step = max(1, R // c) for R remaining."""
    r = rest.long().cumsum(1) - 1  # rank among the remaining tokens
    step = (rest.sum(1) // c.clamp(min=1)).clamp(min=1)[:, None]
    return rest & (r % step == 0) & (r // step < c[:, None])


@register("tokens", "visionzip")
@dataclass
class VisionZip(VisionAttentionReducer):
    """VisionZip, as its paper defines it, at LLM layer L = 0 (on the projector's tokens).

    Scores: the vision tower's attention in layer `vision_layer` (default -2, the penultimate, VisionZip's
    choice), recorded by a `VisionProbe` while the images are encoded: the [CLS] row (heads averaged; the paper
    sums heads, the same ranking) on towers with [CLS] (CLIP in LLaVA, InternViT), and on towers without one
    (Qwen-VL, SigLIP in LLaVA and Idefics3) the mean attention each patch receives (column mean of the softmax
    over the image's query patches, heads averaged). An LLM token made of several patches (Qwen-VL 2x2 merge,
    pixel shuffles) scores their sum and keys their mean.

    Budget: exactly K = ceil(N * keep) tokens per image, split as the paper's LLaVA-1.5 default 54 dominant + 10
    contextual (of 576) scaled to K: round(K * dominant / (dominant + contextual)) dominant, the rest contextual
    (`dominant`, `contextual` set the split; at least one of each when K >= 2 and both are > 0).
    - dominant: the top tokens by attention received;
    - contextual: among the remaining tokens, in grid order, targets picked uniformly (every step-th, step =
      R // contextual, as VisionZip's code); every other remaining token joins its most key-similar target (cosine
      of the layer's keys averaged over heads, VisionZip's "metric") and the target becomes the mean of itself and
      the tokens that joined it (size-weighted with `size_weighted=true`). Dominant tokens are left unmerged. With
      no contextual token (K = 1 or `contextual=0`) the remaining tokens join their most key-similar dominant
      token instead (`merge=false` only drops them).

    Deviations: tokens are selected and merged after the projector (VisionZip works on the vision features
    before it; the selection is the same, a merge through a nonlinear projector is not); the contextual token is
    the plain mean of its group where VisionZip's code adds the group's mean to the target; the [CLS] token is
    never an LLM token here (VisionZip keeps it in the dominant set on CLIP)."""

    merge: bool = True
    dominant: int = option(54, require_int, minimum=0)
    contextual: int = option(10, require_int, minimum=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dominant + self.contextual == 0:
            raise ValueError("dominant + contextual must be > 0 (the split of the budget, default 54 + 10)")

    def choose(self, view: VisualView) -> Selection:
        scores = view.attention.masked_fill(~view.mask, 0.0)
        n_dom, n_ctx = split(view.k, self.dominant, self.contextual)
        dom = topk_mask(scores, n_dom, view.mask)
        targets = uniform_targets(view.mask & ~dom, n_ctx)
        keep = dom | targets
        if not self.merge:
            return Selection(keep=keep)
        into = torch.where(targets.any(1, keepdim=True), targets, keep)
        u, n, d = view.keys.shape
        keys = view.keys.view(u, n, view.key_heads, d // view.key_heads).mean(2)  # its metric: heads averaged
        return Selection(keep=keep, assign=nearest_kept(keys, view.mask, into))
