"""H2O (heavy hitters) on the visual span: keep the visual entries that received the most attention during
prefill, plus a window of the most recent visual entries. REFERENCES.md section 3.

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

import torch

from trimvlm.kv.base import KVPolicy, LayerView, order_in_span
from trimvlm.options import is_number, require_int
from trimvlm.protocol import register
from trimvlm.runtime.attention import AttentionProbe


@register("kv", "h2o")
@dataclass
class H2OKV(KVPolicy):
    """Options: `rows` (None, the default: every prefill query, H2O's accumulated attention; an integer R:
    only the last R queries), `recent` (fraction of the kept visual entries reserved for the most recent
    ones, in [0, 1], default 0.5), `keep`."""

    rows: int | None = None
    recent: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        if self.rows is not None:
            require_int("rows", self.rows, minimum=1, hint=" (or leave it unset: every prefill query)")
        if not is_number(self.recent) or not 0 <= self.recent <= 1:
            raise ValueError(f"recent must be a number in [0, 1], got {self.recent!r}")

    @property
    def rows_wanted(self) -> int:
        return self.rows if self.rows is not None else 1

    def probe(self, runner, handoff) -> AttentionProbe | None:
        probe = super().probe(runner, handoff)
        if probe is not None and self.rows is None:
            probe = handoff.probes["kv"] = AttentionProbe(colsum=True)
        return probe

    def _attention_rows(self, layer, entry, handoff):
        if self.rows is not None:
            return super()._attention_rows(layer, entry, handoff)
        att, _ = super()._attention_rows(layer, entry, handoff)
        return att, None  # [B, K] column sums: no rows

    def scores(self, view: LayerView):
        att = view.attention.float()
        if att.dim() == 3:  # the last `rows` rows [B, n, K]
            att = (att * view.row_valid[..., None].float()).sum(1)
        _, from_end = order_in_span(view.candidates)
        n_recent = torch.floor(view.budget.double() * self.recent + 1e-9).long()
        is_recent = view.candidates & (from_end < n_recent[:, None])
        # the recent window ranks above every heavy hitter
        return att + is_recent.float() * (float(att.amax()) + 1.0)
