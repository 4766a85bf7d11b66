"""VL-Cache (Tu, Vashchilenko, Lu, Xu; arXiv 2410.23317, ICLR 2025) on the visual span: modality-aware token
scoring by post-vision attention, and a sparsity-aware split of the cache budget over the layers.

Post-vision attention (sec. 3.2 / 4.2): the attention rows of the language queries that come after the last
visual token (the instruction that reads the image), A_post^l = A^l[t_post:, :]. Token score, per layer:

    s^l[j] = sum over post-vision queries i (and heads) of A^l[i, j]          (accumulated post-vision attention)

Layer-wise sparsity (sec. 3.1, eqs. 1-2, ThresholdFilter with p = 1 %): the fraction of the post-vision
attention entries, over the keys each query can see, that fall below p times their row's maximum,

    gamma^l = |{(h, i, j) : A^l_h[i, j] < p * max_j A^l_h[i, j]}| / |{(h, i, j) : j visible to i}|,

computed per sample, per head, averaged. Sparsity-aware allocation (sec. 4.1, Algorithm 1): each layer's share
of the cache budget is proportional to its density 1 - gamma^l. The total is the one every trimvlm policy
gets at this keep, sum_l ceil(N_post^l * keep) visual entries per sample (`kernels.budget.split_budget`, capped
at each layer's N_post^l, integer shares summing exactly to the total), so VL-Cache is compared at equal KV
entries; each sample's split is its own (the paper allocates per prompt at inference time).

Rows: the probe records the last `rows` prefill queries per layer (per head; their QK^T is method FLOPs), and
the post-vision ones among them are those after the sample's last visual entry (`kv.base.post_vision_rows`).
When the text after the image is longer than `rows`, only its last `rows` queries are read (default 64: every
post-vision query of the demo task and of short VQA prompts); a sample without post-vision rows (a prompt that
ends on its image) falls back to all the recorded rows.

Deviations, and why:
- The budget applies to the visual entries only (text is never evicted in trimvlm), so gamma^l allocates the
  visual budget; gamma^l itself is measured over every key the post-vision queries see, as in the paper.
- One kept set per layer for all heads (the cache's layout); s^l sums the heads.
- `budgets=uniform` (ceil(N_post * keep) in every layer: VL-Cache's scoring alone) is an ablation, not the
  paper's method.
- In a padded batch the per-layer KV tensors are as long as the longest kept row of that layer: with budgets
  that differ per sample and layer, padding can make a batch's KV bytes slightly larger than a uniform
  policy's (the kept entries per sample are equal; a batch of one has equal bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from trimvlm.kv.base import KVPolicy, LayerView, observed_rows
from trimvlm.options import option, require_choice, require_int, require_number
from trimvlm.protocol import register

BUDGETS = ("sparsity", "uniform")


@register("kv", "vlcache")
@dataclass
class VLCache(KVPolicy):
    """Options: `rows` (the most post-vision queries read, default 64), `threshold` (p of the ThresholdFilter,
    relative to each row's maximum, default 0.01), `budgets` (`sparsity`: VL-Cache's per-layer split, or
    `uniform`), `keep`."""

    rows: int = option(64, require_int, minimum=1)
    threshold: float = option(0.01, require_number, low=0, high=1, above=True, below=True)
    budgets: str = option("sparsity", require_choice, allowed=BUDGETS)

    rows_option: ClassVar[str] = "rows"
    per_head: ClassVar[bool] = True

    def scores(self, view: LayerView) -> torch.Tensor:
        att = view.attention.float()  # [B, H, n, K]
        post = observed_rows(view).to(att.device)
        return (att * post[:, None, :, None]).sum(dim=(1, 2))

    def sparsity(self, view: LayerView) -> torch.Tensor:
        """[B] gamma: the fraction of post-vision attention entries below threshold * their row's max."""
        att = view.attention.float()  # [B, H, n, K]
        b, h, n, k = att.shape
        post = observed_rows(view).to(att.device)
        col = torch.arange(k, device=att.device)
        row_col = torch.arange(k - n, k, device=att.device)
        causal = (col[None, :] <= row_col[:, None])[None]  # [1, n, K]: the keys each row can see
        seen = causal & view.entry.valid[:, None, :].to(att.device) & post[..., None]  # [B, n, K]
        low = att < self.threshold * att.amax(-1, keepdim=True)
        below = (low & seen[:, None]).sum(dim=(1, 2, 3)).double()
        total = (seen.sum(dim=(1, 2)) * h).double()
        return below / total.clamp(min=1)

    def layer_weights(self, views: dict[int, LayerView]):
        return {i: 1 - self.sparsity(v) for i, v in views.items()}
