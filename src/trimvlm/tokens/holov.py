"""HoloV: the budget split across spatial crops of the image (holistic allocation), selection inside each crop."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trimvlm.kernels.flops import bmm
from trimvlm.options import option, require_int, require_number
from trimvlm.protocol import register
from trimvlm.tokens.base import Selection, VisionAttentionReducer, VisualView


def crops_of(view: VisualView, crops: int) -> torch.Tensor:
    """[U, N] long: the crop of every token (-1 on pads): the unit's tokens in grid (raster) order cut into
    `crops` contiguous runs, the first N % crops one token longer (HoloV's code; a run is a horizontal band of
    the grid). A unit with fewer tokens than crops has one crop per token."""
    n = view.n[:, None]
    c = torch.minimum(n, torch.full_like(n, crops))
    size, extra = n // c, n % c
    i = torch.arange(view.mask.shape[1], device=n.device)[None]
    big = (size + 1) * extra  # tokens in the longer crops
    crop = torch.where(i < big, i // (size + 1), extra + (i - big) // size.clamp(min=1))
    return crop.masked_fill(~view.mask, -1)


def crop_variance(xn: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    """[U, N] float64: the variance of each token's cosine similarity to the other tokens of its crop (0 for a
    crop of one token and on pads). xn: [U, N, d] unit-norm features; size: [U, C] tokens per crop, the crops
    contiguous runs from token 0 (`crops_of`). All crops of all units in one batched product, each crop padded to
    the largest (its method FLOPs count the padded product it runs)."""
    u, n, d = xn.shape
    c = size.shape[1]
    m = max(int(size.max()), 1)
    j = torch.arange(m, device=xn.device)
    inside = j < size[..., None]  # [U, C, m]
    idx = torch.where(inside, (size.cumsum(1) - size)[..., None] + j, 0).view(u, c * m)
    xk = xn.gather(1, idx[..., None].expand(-1, -1, d)).view(u * c, m, d)
    sim = bmm(xk, xk.transpose(1, 2)).view(u, c, m, m)
    other = inside[..., :, None] & inside[..., None, :] & ~torch.eye(m, dtype=torch.bool, device=xn.device)
    cnt = other.sum(-1).clamp(min=1).double()
    mean = (sim * other).sum(-1) / cnt
    v = ((sim - mean[..., None]) ** 2 * other).sum(-1) / cnt  # [U, C, m]
    flat = (torch.arange(u, device=xn.device)[:, None] * n + idx).view(u, c, m)
    return xn.new_zeros(u * n).index_put_((flat[inside],), v[inside]).view(u, n)


def allocate(weight: torch.Tensor, cap: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[U, C] tokens per crop: floor(w_c K) with the remainder one each to the largest weights (HoloV's rule),
    then what a crop cannot hold (more than its `cap` tokens) goes on to the crops with room, by weight, so every
    unit keeps exactly k."""
    out = torch.minimum(torch.floor(weight * k[:, None]).long(), cap)
    order = torch.sort(weight, dim=1, descending=True, stable=True).indices
    while True:
        left = k - out.sum(1)
        if not bool((left > 0).any()):
            return out
        room = (cap - out).gather(1, order) > 0
        rank = room.long().cumsum(1) - 1
        add = room & (rank < left[:, None])
        out = out.scatter_add(1, order, add.long())


@register("tokens", "holov")
@dataclass
class HoloV(VisionAttentionReducer):
    """HoloV (Zou et al., NeurIPS 2025, arXiv 2510.02912; docs/references.md#holov), at LLM layer L = 0 on the
    projector's tokens, per image:

    1. crops: the tokens in grid order cut into `crops` (default 16, the code's) contiguous runs (bands of the
       grid);
    2. holistic token score inside crop c: s_i = alpha * a_i + beta * v_i * (mean_c |a| / mean_c |v|), with a_i
       the vision tower's attention to token i (the [CLS] row, or the mean attention received without [CLS], as
       `prumerge` / `visionzip`) and v_i the variance over the crop's other tokens j of cos(x_i, x_j) (x: the
       projector's outputs), scaled to the attention's magnitude within the crop; alpha = 1, beta = 0.09;
    3. holistic allocation: crop weight w_c = mean_c(s)^p / sum_c' mean_c'(s)^p (p = `power`, 1), K_c =
       floor(w_c K), the remainder one each to the largest weights;
    4. inside each crop, its K_c most attended tokens.

    With the per-crop scaling of step 2 (the code's), the crop score is (alpha + beta) * mean_c(a): the variance
    term cancels, and allocation follows the crops' mean attention; it is computed as defined (its products are
    method FLOPs). Deviations: a crop allotted more tokens than it holds keeps them all and the excess goes on to
    the crops with room by weight, so exactly K = ceil(N * keep) are kept (the code keeps fewer and pads zeros);
    the variance excludes the token itself (the code counts its zeroed diagonal in the sum of squares); a crop of
    one token scores its attention. Tiled families: crops inside each tile, the image's budget split over tiles
    as every method."""

    crops: int = option(16, require_int, minimum=1)
    alpha: float = option(1.0, require_number, low=0)
    beta: float = option(0.09, require_number, low=0)
    power: float = option(1.0, require_number, low=0, above=True)

    def choose(self, view: VisualView) -> Selection:
        att = view.attention.masked_fill(~view.mask, 0.0).double()
        crop = crops_of(view, self.crops)
        c = int(crop.max()) + 1
        onehot = F.one_hot(crop.clamp(min=0), c).masked_fill(~view.mask[..., None], 0).double()  # [U, N, C]
        size = onehot.sum(1)  # [U, C]
        var = crop_variance(F.normalize(view.features.double(), dim=-1, eps=1e-12), size.long())
        mean_a = (onehot * att[..., None].abs()).sum(1) / size.clamp(min=1)  # [U, C]
        mean_v = (onehot * var[..., None].abs()).sum(1) / size.clamp(min=1)
        scale = (mean_a / (mean_v + 1e-6)).gather(1, crop.clamp(min=0))
        score = self.alpha * att + self.beta * var * scale
        crop_score = (onehot * score[..., None]).sum(1) / size.clamp(min=1)
        w = crop_score.clamp(min=0) ** self.power * (size > 0)
        w = w / w.sum(1, keepdim=True).clamp(min=1e-300)
        per_crop = allocate(w, size.long(), view.k)  # [U, C]
        # the K_c most attended tokens of each crop: rank within the crop by attention
        order = torch.sort(att.masked_fill(~view.mask, float("-inf")), dim=1, descending=True, stable=True).indices
        crop_sorted = crop.gather(1, order)
        hot = F.one_hot(crop_sorted.clamp(min=0), c) * (crop_sorted >= 0)[..., None]  # [U, N, C]
        rank = (hot.cumsum(1) * hot).sum(-1) - 1  # place of each token within its crop, by attention
        take = (rank < per_crop.gather(1, crop_sorted.clamp(min=0))) & (crop_sorted >= 0)
        keep = torch.zeros_like(view.mask).scatter(1, order, take)
        return Selection(keep=keep & view.mask)
