"""LOOK-M (Wan et al., EMNLP Findings 2024, arXiv 2406.18139; code github.com/SUSTechBruce/LOOK-M) on the visual
span: text-prior eviction by accumulated prefill attention, then the evicted visual KV merged into the kept.

Eviction (the paper's text-prior KV-pair eviction, sec. 3.2):

    A_s[j] = sum over prefill queries i and heads h of A_h[i, j]        (accumulated attention, as H2O)
    A_s[j] += max(A_s)  for every text entry j                           (text prior: text ranks first)
    keep the recent window and the top-k of A_s

Here text is never evicted (the trimvlm protocol), which is exactly what the text prior does whenever the
budget covers the text; so among the visual entries the ranking is A_s alone. LOOK-M's recent window is the
tail of the whole sequence, i.e. the prompt text after the image in a VLM prompt, already kept here: `recent`
therefore defaults to 0 (a fraction of each sample's visual budget given to its most recent visual entries, as
`kv=h2o` does, is available as an option). A_s comes from the attention probe's column sums (the same
`AttentionProbe(colsum=True)` H2O reads; its score products are method FLOPs).

Merge (sec. 3.3, "KV pairs merging"): per layer and KV head, every evicted visual entry e is assigned to its most
similar kept visual entry by key cosine similarity, c(e) = argmax_c cos(k_e, k_c), and keys and values of each
kept entry c with its group E_c = {e : c(e) = c}, n_c = |E_c|, become

    averaged:  k_c' = (k_c + sum_{e in E_c} k_e) / (1 + n_c)
    pivotal:   k_c' = (k_c + sum_{e in E_c} (k_e + k_c) / 2) / (1 + n_c)     (the default: the paper's LOOK-M
               run script, text-prior-pivot-merge, and its best-reported variant)
    weighted:  k_c' = (k_c + sum_{e in E_c} s_e k_e) / (1 + sum_{e in E_c} s_e),  s_e = max(cos(k_e, k_c), 0)

(the same for v with the same groups), through the shared merge kernel (`kernels.merge.nearest_kept` for the
assignment, whose similarity products are method FLOPs, and `merge_groups` for the weighted means: pivotal is
the weighted mean with weight 1 + n_c / 2 on k_c and 1/2 on each k_e). Merged entries keep their original
position (their RoPE rotation and `source`).

Deviations, and why:
- One shot at the prefill/decode boundary on the visual span (LOOK-M also compresses once, after the prefill;
  its decode-time cache is not re-compressed here, as for every trimvlm policy).
- One kept set per layer for all heads (the cache holds one set per layer), ranked by A_s summed over heads;
  LOOK-M's code ranks per head. The merge assignment is still per KV head, as in the code.
- Merge targets are the kept *visual* entries only: text KV is never touched by a trimvlm KV policy. In the
  authors' code an evicted entry may also merge into a kept text entry.
- `weighted` normalises by 1 + sum s_e (a weighted mean); the authors' code divides s_e-scaled sums by 1 + n_c
  and merges only the evicted entries whose similarity is above the mean, which shrinks merged keys' norms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from trimvlm.kernels.merge import merge_groups, nearest_kept
from trimvlm.kv.base import KVPolicy, LayerView, heavy_and_recent
from trimvlm.options import option, require_choice, require_number
from trimvlm.protocol import register

MERGES = ("pivotal", "averaged", "weighted", "none")


@register("kv", "lookm")
@dataclass
class LookM(KVPolicy):
    """Options: `merge` (`pivotal` (default), `averaged`, `weighted` or `none`: how evicted visual KV is folded
    into the kept), `recent` (fraction of the visual budget for the most recent visual entries, default 0),
    `keep`."""

    merge: str = option("pivotal", require_choice, allowed=MERGES)
    recent: float = option(0.0, require_number, low=0, high=1)

    colsum: ClassVar[bool] = True  # H2O's column sums: the attention from every prefill query

    def scores(self, view: LayerView) -> torch.Tensor:
        return heavy_and_recent(view.attention.float(), view, self.recent)

    def compensate(self, cache, masks: dict[int, torch.Tensor]) -> None:
        if self.merge == "none":
            return
        for i, keep in masks.items():
            e = cache.layers[i]
            kept = keep & e.visual & e.valid
            evicted = e.visual & e.valid & ~keep
            if not bool(evicted.any()) or not bool(kept.any()):
                continue
            e.key, e.value = self.merged(e.key, e.value, kept, evicted)

    def merged(self, key, value, kept, evicted):
        """New (key, value) [B, Hk, K, hd]: every kept entry merged with the evicted entries assigned to it."""
        b, hk, k, hd = key.shape
        flat = lambda t: t.reshape(b * hk, k, hd)  # noqa: E731
        kept_u = kept[:, None].expand(b, hk, k).reshape(b * hk, k)
        mask_u = (kept | evicted)[:, None].expand(b, hk, k).reshape(b * hk, k)
        assign = nearest_kept(flat(key), mask_u, kept_u)  # [B*Hk, K]: per KV head, by key cosine
        ev = mask_u & ~kept_u
        one = torch.ones(b * hk, k, dtype=torch.float64, device=key.device)
        if self.merge == "averaged":
            weight = one
        elif self.merge == "pivotal":
            n_c = torch.zeros_like(one).scatter_add_(1, assign, ev.double())
            weight = torch.where(kept_u, 1 + n_c / 2, one / 2)
        else:  # weighted: s_e = cos(k_e, k_c(e)) >= 0
            kn = torch.nn.functional.normalize(flat(key).double(), dim=-1)
            target = kn.gather(1, assign[..., None].expand(-1, -1, hd))
            s = (kn * target).sum(-1).clamp(min=0)  # element-wise (the products ran in nearest_kept)
            weight = torch.where(kept_u, one, s)
        out = []
        for t in (key, value):
            m, _ = merge_groups(flat(t), kept_u, assign, weight, mask_u)
            out.append(m.to(t.dtype).reshape(b, hk, k, hd))
        return out[0], out[1]
