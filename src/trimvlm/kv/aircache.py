"""AirCache (Huang, Zou, Wang, Xi, Xie, Wang; arXiv 2503.23956, ICCV 2025) on the visual span: visual entries
scored by an elite observation window of instruction tokens, and per-layer budgets adapted to the strength
and skewness of each layer's importance distribution.

Elite observation window (sec. 3.2): rather than all text queries or the last w of them (SnapKV), AirCache
observes with the instruction tokens that matter most, chosen by the self-attention among the instruction
tokens. With T the post-vision text queries of a sample (`kv.base.post_vision_rows`, heads averaged) and t* the
last of them (the query that predicts the first answer token):

    r[t]  = A[t*, t]                                           (how much the last instruction token reads t)
    E     = the ceil(|T| * elite) tokens of T with the highest r          (the elite window)
    I[v]  = mean over t in E of A[t, v]                                   (importance of visual entry v)

Layer budgets (sec. 3.3): per sample and layer, the strength S^l = sum_v I^l[v] (how much attention the
elite window puts on the image in that layer) and the skewness K^l = E[(I - mu)^3] / sigma^3 of I^l over the
layer's visual entries (0 when sigma = 0). A layer's share of the visual budget is

    w^l = S^l * (1 + max(K^l, 0)),

so layers that attend to the image strongly, and whose importance is concentrated on a few entries (where a
small kept set holds most of the mass), get more of it. The total is the one every trimvlm policy gets at this
keep, sum_l ceil(N_post^l * keep) visual entries per sample, split by `kernels.budget.split_budget` (capped at
each layer's N_post^l, integer shares summing exactly to the total): equal KV entries.

Sources and what is this implementation's reading: the elite window and the use of strength and skewness are
the paper's (abstract, sec. 3); r read off the last instruction token (r[t] = the mean attention t receives from
the later instruction queries favours sink-like template tokens), the default `elite` = 0.5 and the combination
w = S (1 + max(K, 0)) are this implementation's choices, to be checked against the paper's equations.
`budgets=uniform` (the elite scoring alone) is an ablation.

Deviations, and why:
- One shot at the prefill/decode boundary, one kept set per layer for all heads (the cache's layout).
- The budget applies to the visual entries only (text is never evicted in trimvlm).
- The observation rows are the last `rows` prefill queries (default 64; their QK^T is method FLOPs); a longer
  instruction is observed through its last `rows` tokens. A sample without post-vision text falls back to
  every recorded row. Padded batches: see `kv=vlcache` (per-sample budgets, padding to the longest row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from trimvlm.kernels.select import keep_count, topk_mask
from trimvlm.kv.base import KVPolicy, LayerView, observed_rows
from trimvlm.options import option, require_choice, require_int, require_number
from trimvlm.protocol import register

BUDGETS = ("adaptive", "uniform")


@register("kv", "aircache")
@dataclass
class AirCache(KVPolicy):
    """Options: `rows` (the most instruction queries observed, default 64), `elite` (fraction of the
    post-vision text queries kept as the elite window, in (0, 1], default 0.5), `budgets` (`adaptive`:
    strength/skewness split over the layers, or `uniform`), `keep`."""

    rows: int = option(64, require_int, minimum=1)
    elite: float = option(0.5, require_number, low=0, high=1, above=True)
    budgets: str = option("adaptive", require_choice, allowed=BUDGETS)

    rows_option: ClassVar[str] = "rows"

    def elite_rows(self, view: LayerView) -> torch.Tensor:
        """[B, n] bool: the elite observation window among the recorded rows."""
        att = view.attention.float()  # [B, n, K]
        b, n, k = att.shape
        post = observed_rows(view).to(att.device)
        last = torch.where(post, torch.arange(n, device=att.device), -1).amax(1).clamp(min=0)  # [B]
        # the last post-vision query's attention to each recorded row's token [B, n]
        relevance = att[torch.arange(b, device=att.device), last, k - n :]
        count = keep_count(post.sum(1), self.elite, minimum=1)
        return topk_mask(relevance, count, post)

    def scores(self, view: LayerView) -> torch.Tensor:
        """[B, K] the importance I[v]: the elite window's mean attention to each entry."""
        att = view.attention.float()
        elite = self.elite_rows(view).float()
        return (att * elite[..., None]).sum(1) / elite.sum(1, keepdim=True).clamp(min=1)

    def strength_skew(self, view: LayerView) -> tuple[torch.Tensor, torch.Tensor]:
        """[B] strength S (the elite window's attention mass on the visual entries) and skewness K of the
        importance over them."""
        imp = self.scores(view).double()
        cand = view.candidates.to(imp.device)
        n = cand.sum(1).clamp(min=1).double()
        x = imp * cand
        strength = x.sum(1)
        mu = strength / n
        dev = (imp - mu[:, None]) * cand
        sigma = (dev.pow(2).sum(1) / n).sqrt()
        skew = (dev.pow(3).sum(1) / n) / sigma.pow(3).clamp(min=1e-300)
        return strength, torch.where(sigma > 1e-12, skew, torch.zeros_like(skew))

    def layer_weights(self, views: dict[int, LayerView]):
        out = {}
        for i, v in views.items():
            strength, skew = self.strength_skew(v)
            out[i] = strength * (1 + skew.clamp(min=0))
        return out
