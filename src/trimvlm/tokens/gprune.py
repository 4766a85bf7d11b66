"""G-Prune: visual tokens as the nodes of a similarity graph; importance propagated over it for a few
iterations, the most important kept."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trimvlm.kernels.flops import bmm
from trimvlm.kernels.select import topk_mask
from trimvlm.options import option, require_int, require_number
from trimvlm.protocol import register
from trimvlm.tokens.base import Selection, TokenReducer, VisualView


def propagate(
    x: torch.Tensor, mask: torch.Tensor, threshold: float, temperature: float, steps: int
) -> torch.Tensor:
    """[U, N] G-Prune's score per token of x [U, N, D] (pads: `mask` False, score -inf).

    A_ij = cos(x_i, x_j), kept where A_ij >= threshold (i, j real tokens; i itself always), else no edge;
    P = row-softmax of A / temperature over each row's edges; degree d_j = edges of j;
    s^(0)_i = ||x_i|| (feature norm), s^(t+1) = s^(t) P (T = `steps` iterations: s^(T) = s^(0) P^T);
    score_j = s^(T)_j / d_j."""
    dt = torch.promote_types(x.dtype, torch.float32)
    xn = F.normalize(x.to(dt), dim=-1, eps=1e-12)
    sim = bmm(xn, xn.transpose(1, 2))
    pair = mask[:, :, None] & mask[:, None, :]
    edge = pair & ((sim >= threshold) | torch.eye(x.shape[1], dtype=torch.bool, device=x.device)[None])
    logits = (sim / temperature).masked_fill(~edge, -math.inf)
    p = torch.softmax(logits.masked_fill(~mask[:, :, None], 0.0), dim=-1) * mask[:, :, None]
    s = (x.to(dt).norm(dim=-1) * mask)[:, None, :]  # [U, 1, N]
    for _ in range(steps):
        s = bmm(s, p)
    score = s[:, 0] / edge.sum(1).clamp(min=1)
    return score.masked_fill(~mask, -math.inf)


@register("tokens", "gprune")
@dataclass
class GPrune(TokenReducer):
    """G-Prune (Jiang et al., "What Kind of Visual Tokens Do We Need? Training-free Visual Token Pruning for
    Multi-modal Large Language Models from the Perspective of Graph", AAAI 2025), per image: a graph whose
    nodes are the visual tokens and whose weighted links join tokens of cosine similarity >= `threshold`
    (default 0.5); each node starts with its feature norm as information, the information flows along the
    row-softmax-normalised links (temperature `temperature`, default 0.03) for `steps` iterations (default 5),
    and each node's received information divided by its degree is its importance; the K = ceil(N * keep) most
    important are kept, the rest dropped (`propagate` has the formula). Defaults are the paper's released
    settings. Default layer 0 (the paper prunes the projector's outputs before the LLM); any layer works, on
    the hidden states entering it.

    Headline (the paper's): on LLaVA-NeXT, G-Prune removes 63.57 % of the FLOPs with accuracy drops of 0.95 %
    on VQAv2 and 2.34 % on TextVQA. Method FLOPs: the N x N similarity product and the `steps` products
    s P (N^2 each; the paper's P^T matrix power gives the same scores at more FLOPs)."""

    threshold: float = option(0.5, require_number, low=-1, high=1, hint=" (a cosine similarity)")
    temperature: float = option(0.03, require_number, low=0, above=True)
    steps: int = option(5, require_int, minimum=1)

    def choose(self, view: VisualView) -> Selection:
        score = propagate(
            view.features, view.mask, float(self.threshold), float(self.temperature), self.steps
        )
        return Selection(keep=topk_mask(score, view.k, view.mask))
