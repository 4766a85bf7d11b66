"""PyramidKV on the visual span: SnapKV's observation-window scores, with a KV budget per layer that decreases
with depth in an arithmetic pyramid, at the same total as a uniform budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from trimvlm.kernels.select import window_scores
from trimvlm.kv.base import KVPolicy, LayerView
from trimvlm.options import option, require_choice, require_int, require_number
from trimvlm.protocol import register


def pyramid_weights(m: int, beta: float) -> list[float]:
    """PyramidKV's per-layer share of the total over m attention layers (mean 1): the top layer gets
    1 / beta of the mean, the bottom one 2 - 1 / beta, and the layers between an arithmetic sequence."""
    top = 1.0 / beta
    bottom = 2.0 - top
    if m == 1:
        return [1.0]
    return [bottom - (bottom - top) * i / (m - 1) for i in range(m)]


@register("kv", "pyramidkv")
@dataclass
class PyramidKV(KVPolicy):
    """PyramidKV (Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
    Funneling", arXiv 2406.02069, 2024), one shot at the prefill/decode boundary on the visual entries.

    Budgets: with k_total the total a uniform policy keeps (sum over the m attention layers of
    ceil(N_post * keep) visual entries, per sample), the top layer keeps k^(m-1) = k_total / (beta m), the
    bottom one k^0 = 2 k_total / m - k^(m-1), and layer i in between k^0 - (k^0 - k^(m-1)) i / (m - 1)
    (`pyramid_weights`; `beta` default 20, the paper's). Integer shares summing exactly to k_total, capped at
    each layer's N_post (what a capped layer cannot hold goes to the others: `kernels.budget.split_budget`),
    so PyramidKV keeps the same KV bytes as `kv=snapkv` at the same keep.

    Scores within a layer: SnapKV's, the attention each visual entry receives from the last `window` prefill
    queries (default 32), summed over them, heads averaged, pooled along the cache with a `kernel`-wide window
    (default 5, `pool` avg or max); text entries, the observation window among them, are never evicted.

    Headline (the paper's): on LongBench, PyramidKV matches the full KV cache while keeping 12 % of it, and at
    0.7 % of the cache it beats the other compression methods by up to 20.5 points (TREC).

    Deviations: the budget applies to the visual entries only (text is never evicted in trimvlm); one kept set
    per layer for all heads (the cache's layout). In a padded batch see `kv=vlcache` (per-sample budgets,
    padding to the longest row)."""

    predictable: ClassVar[bool] = False  # per-layer budgets capped per sample: the KV bytes are measured
    rows_option: ClassVar[str] = "window"

    window: int = option(32, require_int, minimum=1)
    kernel: int = option(5, require_int, minimum=1, odd=True)
    pool: str = option("avg", require_choice, allowed=("avg", "max"))
    beta: float = option(20.0, require_number, low=1, hint=" (top layer budget = mean / beta)")

    def scores(self, view: LayerView) -> torch.Tensor:
        return window_scores(view.attention, view.row_valid, view.candidates, self.kernel, self.pool)

    def layer_weights(self, views: dict[int, LayerView]) -> dict[int, torch.Tensor]:
        order = sorted(views)
        w = pyramid_weights(len(order), float(self.beta))
        return {
            i: torch.full((views[i].budget.shape[0],), w[c], dtype=torch.float64) for c, i in enumerate(order)
        }
