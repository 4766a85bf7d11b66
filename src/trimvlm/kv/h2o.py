"""H2O (heavy hitters) on the visual span: keep the visual entries that received the most attention during
prefill, plus a window of the most recent visual entries. docs/references.md#h2o.

The accumulated attention is H2O's: the attention each key received, summed over *all* prefill queries and
all heads (column sums of the causal softmax), recorded by the attention probe in query blocks, never as an
N x N matrix and without switching the model to eager attention (its score products are method FLOPs: one
more QK^T per attention layer). `rows=R` gives the cheap variant that sums only the last R query rows (heads
averaged); note that this is SnapKV without pooling, not H2O. A `recent` fraction of each sample's budget goes
to its most recent visual entries (H2O's equal heavy / recent split by default), the rest to the heavy
hitters. Deviation from the paper: H2O evicts step by step during generation with a fixed cache size; here,
as for every trimvlm policy, the heavy hitters are chosen once at the prefill/decode boundary, on the visual
span only, so that all policies are compared on the same footing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trimvlm.kv.base import KVPolicy, LayerView, heavy_and_recent
from trimvlm.options import option, require_int, require_number
from trimvlm.protocol import register


@register("kv", "h2o")
@dataclass
class H2OKV(KVPolicy):
    """Options: `rows` (None, the default: every prefill query, H2O's accumulated attention; an integer R:
    only the last R queries), `recent` (fraction of the kept visual entries reserved for the most recent
    ones, in [0, 1], default 0.5), `keep`."""

    rows: int | None = None
    recent: float = option(0.5, require_number, low=0, high=1)

    rows_option: ClassVar[str] = "rows"

    def __post_init__(self):
        super().__post_init__()
        if self.rows is not None:
            require_int("rows", self.rows, minimum=1, hint=" (or leave it unset: every prefill query)")

    @property
    def colsum(self) -> bool:
        return self.rows is None

    def scores(self, view: LayerView):
        att = view.attention.float()
        if att.dim() == 3:  # the last `rows` rows [B, n, K]
            att = (att * view.row_valid[..., None].float()).sum(1)
        return heavy_and_recent(att, view, self.recent)  # the recent window ranks above every heavy hitter
