"""PyramidDrop: the LLM split into stages; at the end of each stage the image tokens the last instruction token
attends to least are dropped, a fixed ratio of the previous stage's, a pyramid over depth."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from trimvlm.errors import RecipeError
from trimvlm.kernels.select import keep_count, topk_mask
from trimvlm.options import stage_layers
from trimvlm.protocol import register
from trimvlm.runtime.attention import AttentionProbe
from trimvlm.runtime.sequence import LiveSeq
from trimvlm.tokens.base import Selection, TokenReducer, VisualView, after_attention_layers, scaled_stages

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

    layer: int | None = None
    layers: str = ""

    min_layer = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layers:
            stage_layers(self.layers, "8-16-24")

    def layer_why(self) -> str:
        return " (pyramiddrop ranks by the attention of layer L-1, so L >= 1)"

    def stages(self, runner) -> list[int]:
        """The layers the stages drop before, on this model."""
        if self.layers:
            return stage_layers(self.layers, "8-16-24")
        depth = runner.num_layers
        first = self.layer if self.layer is not None else max(1, round(PAPER_LAYERS[0] * depth / PAPER_DEPTH))
        return scaled_stages(first, depth, PAPER_LAYERS, PAPER_DEPTH)

    def at(self, runner) -> int:
        return min(self.stages(runner), default=self.layer or 1)

    def check(self, runner) -> None:
        ok = after_attention_layers(runner)
        if not self.stages(runner):
            raise RecipeError(
                f"tokens=pyramiddrop: layer {self.layer} leaves no stage on this model; allowed: {ok}"
            )
        for lay in self.stages(runner):
            if lay not in ok:
                raise RecipeError(f"tokens=pyramiddrop: stage layer {lay} needs an attention layer before it "
                                  f"(layer {lay - 1}); allowed on this model: {ok}")  # fmt: skip

    def wants_attention(self, runner) -> bool:
        return True

    def probe(self, runner, handoff):
        if self.ratio >= 1:
            return None
        handoff.probes["tokens"] = AttentionProbe(last=1, layers={s - 1 for s in self.stages(runner)})
        return handoff.probes["tokens"]

    def hook(self, runner, handoff):
        stages = self.stages(runner)
        if self.ratio >= 1:
            return None

        def _hook(i: int, seq: LiveSeq, run) -> LiveSeq:
            return self.reduce(seq, run, handoff, layer=i) if i in stages else seq

        return _hook

    def prepare(self, view: VisualView, runner, handoff) -> None:
        stages = self.stages(runner)
        n0 = view.grid[:, 0] * view.grid[:, 1]
        counts = stage_counts(n0, self.ratio, len(stages))[stages.index(view.layer)]
        view.k = torch.minimum(counts, view.n)

    def choose(self, view: VisualView) -> Selection:
        return Selection(keep=topk_mask(view.attention, view.k, view.mask))
