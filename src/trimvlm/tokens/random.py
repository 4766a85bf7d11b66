"""Random: a uniform random subset of each image's visual tokens, from a fixed seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trimvlm.kernels.select import topk_mask
from trimvlm.options import require_int
from trimvlm.registry import register
from trimvlm.tokens.base import Selection, TokenReducer, VisualView


@register("tokens", "random")
@dataclass
class Random(TokenReducer):
    """Keep K = ceil(N * keep) tokens of each image uniformly at random. The draw for an image depends only on
    (`seed`, the image's index within its sample, its token count), so a sample gets the same subset alone or
    in any batch."""

    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        require_int("seed", self.seed)

    def choose(self, view: VisualView) -> Selection:
        scores = torch.zeros(view.mask.shape, dtype=torch.float32)
        for u, (j, n) in enumerate(zip(view.image.tolist(), view.n.tolist(), strict=True)):
            gen = torch.Generator().manual_seed(int(self.seed) * 1_000_003 + j)
            scores[u, :n] = torch.rand(n, generator=gen)
        return Selection(keep=topk_mask(scores.to(view.mask.device), view.k, view.mask))
