"""DPO over pruning layouts (docs/references.md#dpo-over-layouts).

A layout y is a set of chosen elements (visual tokens kept, candidate layers kept) among the router's scored
elements; its log-probability under the router's independent Bernoulli scores s:

    log pi(y | x) = sum_{e chosen} log s_e + sum_{e not chosen} log(1 - s_e)      (real elements only)

and the DPO loss of a (better y_w, worse y_l) pair against a frozen reference router pi_ref:

    L = -log sigmoid(beta * [(log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def layout_logprob_logits(logits: torch.Tensor, chosen: torch.Tensor, mask: torch.Tensor | None = None):
    """[B] log pi(layout) from the scores' logits z [B, E] (s = sigmoid(z); chosen [B, E] bool, mask [B, E] the
    real elements, besides the finite logits): log s = logsigmoid(z) and log(1 - s) = logsigmoid(-z), exact
    where computing it from clamped probabilities would cut the gradient off."""
    lp = F.logsigmoid(torch.where(chosen, logits, -logits))
    real = torch.isfinite(logits) if mask is None else mask & torch.isfinite(logits)
    return lp.masked_fill(~real, 0.0).sum(-1)


def dpo_loss(logp_w, logp_l, ref_w, ref_l, beta: float = 0.1) -> torch.Tensor:
    """Mean DPO loss over the pairs (all [P] tensors)."""
    return -F.logsigmoid(beta * ((logp_w - ref_w) - (logp_l - ref_l))).mean()
