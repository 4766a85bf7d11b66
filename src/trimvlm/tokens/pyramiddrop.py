"""PyramidDrop: the LLM split into stages; at the end of each stage the image tokens the last instruction token
attends to least are dropped, a fixed ratio of the previous stage's, a pyramid over depth."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from trimvlm.kernels.select import keep_count, topk_mask
from trimvlm.options import stage_layers
from trimvlm.protocol import register
from trimvlm.tokens.base import Selection, TokenReducer, VisualView, scaled_stages

PAPER_LAYERS = (8, 16, 24)  # LLaVA's 32 layers in 4 stages: tokens are dropped before layers 8, 16 and 24
PAPER_DEPTH = 32


def stage_counts(n0: torch.Tensor, keep: float, stages: int) -> list[torch.Tensor]:
    """Tokens each unit keeps after stage j = 1..S: K_j = ceil(N0 * lam^j) with lam = keep^(1/S) (each stage
    keeps lam of the previous stage's tokens), the last one exactly K = ceil(N0 * keep); at least 1."""
    lam = keep ** (1.0 / stages)
    out = [keep_count(n0, lam**j, minimum=1) for j in range(1, stages)]
    return out + [keep_count(n0, keep, minimum=1)]


@register("tokens", "pyramiddrop")
@dataclass
class PyramidDrop(TokenReducer):
    """PyramidDrop (Xing et al., CVPR 2025, arXiv 2410.17247), training-free inference use, per image:

    the decoder is split into S + 1 stages at layers l_1 < ... < l_S; before layer l_j (at the end of stage j)
    each visual token v scores the attention it receives from the last instruction token in layer l_j - 1
    (softmax over that layer's keys, heads averaged: the row a FastV probe records), and the image keeps the
    K_j best-scored of the tokens still live, K_j = ceil(N0 lam^j): every stage keeps the ratio lam of the
    previous stage's tokens. trimvlm's `keep` is what is left after the last stage, so lam = keep^(1/S): the
    paper's lam = 0.5 with its 3 drops is keep = 0.125.

    Stage layers: the paper's 8, 16, 24 of LLaVA's 32, scaled to this model's depth (round(l * depth / 32)),
    the first one at `layer` L when given (then L + round((l - 8) * depth / 32)); `layers=a-b-c` names them.
    Each stage's layer - 1 must be an attention layer (refused with the allowed layers otherwise), and L >= 1.

    Headline (the paper's): 40 % less training time and 55 % fewer inference FLOPs on LLaVA-NeXT at comparable
    performance; as a training-free plug-in, better accuracy than FastV at lower inference cost. Method FLOPs:
    the one attention row per stage (the probe's QK^T)."""

    predictable: ClassVar[bool] = False  # several reductions: the counts follow no single-layer rule
    attention: ClassVar[str] = "llm"

    layers: str = ""

    min_layer = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layers:
            stage_layers(self.layers, "8-16-24")

    def stages(self, runner) -> list[int]:
        """The layers the stages drop before, on this model."""
        if self.layers:
            return stage_layers(self.layers, "8-16-24")
        depth = runner.num_layers
        first = self.layer if self.layer is not None else max(1, round(PAPER_LAYERS[0] * depth / PAPER_DEPTH))
        return scaled_stages(first, depth, PAPER_LAYERS, PAPER_DEPTH)

    def counts(self, view: VisualView) -> torch.Tensor:
        n0 = view.grid[:, 0] * view.grid[:, 1]
        return torch.minimum(stage_counts(n0, self.ratio, view.stages)[view.stage], view.n)

    def choose(self, view: VisualView) -> Selection:
        return Selection(keep=topk_mask(view.attention, view.k, view.mask))
