"""Random: a uniform random subset of each image's visual tokens, from a fixed seed."""

from __future__ import annotations

from dataclasses import dataclass

from trimvlm.kernels.select import TILE_STRIDE, hashed_uniform, topk_mask
from trimvlm.options import option, require_int
from trimvlm.protocol import register
from trimvlm.tokens.base import Selection, TokenReducer, VisualView


@register("tokens", "random")
@dataclass
class Random(TokenReducer):
    """Keep K = ceil(N * keep) tokens of each image uniformly at random, a different subset per image from a
    fixed seed (docs/references.md#random). Token t of an image draws
    `hashed_uniform(seed, image fingerprint, t)`: the draw depends on the seed and the image itself (a
    fingerprint of its pixels), so different images get different subsets, and an image gets the same subset
    alone, in any batch, at any index. kv=random draws the same way, so `tokens=random` and `kv=random` with
    one seed rank an image's tokens alike."""

    seed: int = option(0, require_int)

    def choose(self, view: VisualView) -> Selection:
        index = view.cells.clamp(min=0) + view.tile[:, None] * TILE_STRIDE
        scores = hashed_uniform(self.seed, view.image_key[:, None], index)
        return Selection(keep=topk_mask(scores, view.k, view.mask))
