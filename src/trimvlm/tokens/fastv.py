"""FastV: keep the visual tokens that receive the most attention from the last query token at layer L-1."""

from __future__ import annotations

from dataclasses import dataclass

from trimvlm.kernels.select import topk_mask
from trimvlm.registry import register
from trimvlm.tokens.base import Selection, TokenReducer, VisualView


@register("tokens", "fastv")
@dataclass
class FastV(TokenReducer):
    """Rank each image's visual tokens by the attention they receive from the last query token in layer L-1
    (softmax over that layer's keys, heads averaged), keep the top K = ceil(N * keep). Only that one attention
    row is computed (an AttentionProbe on layer L-1); the model keeps running SDPA. Needs L >= 1 (default 2,
    FastV's K = 2)."""

    layer: int | None = None

    default_layer = 2
    min_layer = 1

    def _layer_why(self) -> str:
        return " (fastv ranks by the attention of layer L-1, so L >= 1)"

    def wants_attention(self, runner) -> bool:
        return True

    def probe(self, runner, handoff):
        return self._last_query_probe(runner, handoff)

    def choose(self, view: VisualView) -> Selection:
        return Selection(keep=topk_mask(view.attention, view.k, view.mask))
