"""H2O (heavy hitters) on the visual span: keep the visual entries that received the most attention during
prefill, plus a window of the most recent visual entries. REFERENCES.md section 3.

The accumulated attention comes from a cheap partial attention: the softmax rows of the last `rows` prefill
queries (heads averaged), summed over those rows, recorded by the attention probe without switching the model to
eager attention. A `recent` fraction of each sample's budget goes to its most recent visual entries (H2O's
equal heavy / recent split by default); the rest to the heavy hitters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trimvlm.kv.base import KVPolicy, LayerView, order_in_span
from trimvlm.options import is_number, require_int
from trimvlm.registry import register


@register("kv", "h2o")
@dataclass
class H2OKV(KVPolicy):
    """Options: `rows` (last prefill queries whose attention is accumulated, default 64), `recent` (fraction of
    the kept visual entries reserved for the most recent ones, in [0, 1], default 0.5), `keep`."""

    rows: int = 64
    recent: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        require_int("rows", self.rows, minimum=1)
        if not is_number(self.recent) or not 0 <= self.recent <= 1:
            raise ValueError(f"recent must be a number in [0, 1], got {self.recent!r}")

    @property
    def rows_wanted(self) -> int:
        return self.rows

    def scores(self, view: LayerView):
        att, rv = view.attention, view.row_valid
        acc = (att.float() * rv[..., None].float()).sum(1)  # [B, K] attention received, summed over rows
        _, from_end = order_in_span(view.candidates)
        n_recent = torch.floor(view.budget.double() * self.recent + 1e-9).long()
        is_recent = view.candidates & (from_end < n_recent[:, None])
        # each row sums to 1, so acc <= rows: the recent window ranks above every heavy hitter
        return acc + is_recent.float() * (att.shape[-2] + 1)
