"""SparseVLM: text raters score the visual tokens inside the LLM, pruned progressively over several layers, the
pruned tokens partly recycled into a few merged ones."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from trimvlm.errors import TrimVLMError
from trimvlm.kernels.flops import matmul
from trimvlm.kernels.select import keep_count, topk_mask
from trimvlm.options import option, require_int, stage_layers
from trimvlm.protocol import register
from trimvlm.runtime.sequence import LiveSeq
from trimvlm.tokens.base import Selection, TokenReducer, VisualView, instruction, scaled_stages

PAPER_LAYERS = (3, 7, 16)  # before these decoder layers: after the paper's layers 2, 6 and 15 of LLaVA's 32
PAPER_DEPTH = 32


def raters(seq: LiveSeq) -> list[torch.Tensor]:
    """Per sample, the original positions of its raters: of the text tokens after the sample's last image (the
    instruction), those whose relevance to the visual tokens is above the instruction's mean, relevance_m =
    mean_i softmax_m(<v_i, t_m>) over the sample's visual tokens i (the softmax over the instruction's tokens),
    on the hidden states entering the first layer. A sample without images has none."""
    out = []
    for b, instr in enumerate(instruction(seq)):
        vis = torch.nonzero(seq.visual[b] & seq.valid[b]).flatten()
        if vis.numel() == 0:
            out.append(torch.zeros(0, dtype=torch.long, device=seq.source.device))
            continue
        text = torch.nonzero(instr).flatten()
        v, t = seq.hidden[b, vis].float(), seq.hidden[b, text].float()
        rel = torch.softmax(matmul(v, t.T), dim=-1).mean(0)  # [M]
        out.append(seq.source[b, text[rel > rel.mean()]] if rel.numel() > 1 else seq.source[b, text])
    return out


def dpc_knn(x: torch.Tensor, clusters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Density-peak clustering with k nearest neighbours (SparseVLM's recycling; k = clusters) of x [m, D]:
    d_ij = ||x_i - x_j|| / sqrt(D); density rho_i = exp(-mean of the k smallest d_ij^2 (itself included));
    delta_i = min d_ij over the denser j (the largest d when none); centers = the `clusters` largest rho * delta
    (ties to the lower index); every token joins its nearest center, a center itself. Returns (centers [c] long,
    assignment [m] long into centers)."""
    m, d = x.shape
    sq = (x * x).sum(-1)
    d2 = (sq[:, None] + sq[None, :] - 2 * matmul(x, x.T)).clamp(min=0)
    dist = d2.sqrt() / math.sqrt(d)
    dist = (dist + dist.T) / 2  # exactly symmetric, 0 on the diagonal: mutual neighbours tie exactly
    dist.fill_diagonal_(0.0)
    k = min(clusters, m)
    near = torch.topk(dist, k, dim=-1, largest=False).values
    rho = torch.exp(-(near**2).mean(-1))
    ar = torch.arange(m, device=x.device)
    denser = (rho[None, :] > rho[:, None]) | ((rho[None, :] == rho[:, None]) & (ar[None, :] < ar[:, None]))
    delta = torch.where(denser, dist, dist.max()).amin(-1)
    order = torch.sort(rho * delta, descending=True, stable=True).indices
    centers = order[:k]
    assign = dist[:, centers].argmin(-1)
    assign[centers] = torch.arange(k, device=x.device)
    return centers, assign


@register("tokens", "sparsevlm")
@dataclass
class SparseVLM(TokenReducer):
    """SparseVLM (Zhang et al., ICML 2025, arXiv 2410.04417; docs/references.md#sparsevlm), per image:

    1. raters (once, on the embeddings entering layer 0): the instruction's text tokens t_m whose relevance
       mean_i softmax_m(<v_i, t_m>) to the visual tokens v_i is above the mean (`raters`);
    2. at each stage, before decoder layer l_j (reading layer l_j - 1's attention, the raters' query rows, heads
       averaged): each visual token's score is its mean attention from the raters; the image keeps its K_j
       best-scored tokens, K_j = round(N keep^(j / S)) for the S stages (the last stage keeps K = ceil(N keep));
    3. recycling: of the tokens this stage deletes (D), the int(0.3 D) + 1 best-scored are clustered by density
       peaks (`dpc_knn`) into int(that / 10) + 1 clusters, each becoming one token, the mean of its cluster (it
       takes the place and position ids of its center); the other deleted tokens are dropped.

    Stages: before layers (3, 7, 16) of the paper's 32-layer LLaVA (after its layers 2, 6 and 15), i.e. the first at
    L (`layer`, default 3) and the later ones L + round((l - 3) * depth / 32), on this model's depth (distinct
    layers only; `layers=a-b-c` sets them). Every stage's layer l - 1 needs attention weights.

    Deviations: the paper's (and llmc's) token counts per stage are fixed tables for LLaVA's 576 tokens that make
    the *layer-averaged* count equal the budget; here the last stage keeps the shared K = ceil(N * keep) and the
    earlier ones a geometric schedule from N to K, so the recycled tokens (int(int(0.3 D) + 1) / 10) + 1 per stage)
    come on top of K; raters' attention rows are the last `rows` (64) query rows of the prompt (the instruction
    follows the image in every template; raters beyond them are not read); recycled tokens keep their center's
    position (the code appends them after the kept visual tokens); the density tie-break is by index (the code adds
    1e-6 noise). Method FLOPs: the rater products, the attention rows, the clustering distances."""

    predictable: ClassVar[bool] = False  # its stages keep counts that follow the raters: measured, never predicted
    attention: ClassVar[str] = "llm"

    layers: str = ""
    rows: int = option(64, require_int, minimum=1)
    merge: bool = True
    # per call, set before the first layer (`start`) and read by the stages: each sample's raters' original positions
    raters: list | None = field(default=None, init=False, repr=False, compare=False)

    default_layer = 3
    min_layer = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.merge is not True:
            raise ValueError("sparsevlm recycles pruned tokens by merging them (merge=true)")
        if self.layers:
            stage_layers(self.layers, "3-7-16")

    @property
    def query_rows(self) -> int:
        return self.rows

    def stages(self, runner) -> list[int]:
        """The layers the stages reduce before, on this model."""
        if self.layers:
            return stage_layers(self.layers, "3-7-16")
        return scaled_stages(super().stages(runner)[0], runner.num_layers, PAPER_LAYERS, PAPER_DEPTH)

    def start(self, seq: LiveSeq) -> None:
        self.raters = raters(seq) if bool(seq.visual.any()) else None

    def selected(self, view: VisualView) -> tuple[torch.Tensor, torch.Tensor]:
        """(K_j selected, recycled clusters) per unit at this stage."""
        j, s = view.stage + 1, view.stages
        n0 = view.grid[:, 0] * view.grid[:, 1]
        kj = torch.round(n0.double() * self.ratio ** (j / s)).long()
        kj = keep_count(n0, self.ratio, minimum=1) if j == s else kj  # the last stage: the shared K
        kj = torch.minimum(kj.clamp(min=1), view.n)
        deleted = view.n - kj
        cand = torch.where(deleted > 0, (0.3 * deleted).long() + 1, 0).minimum(deleted)
        clusters = torch.where(cand > 0, cand // 10 + 1, 0).minimum(cand)
        return kj, clusters

    def counts(self, view: VisualView) -> torch.Tensor:
        kj, clusters = self.selected(view)
        return kj + clusters

    def rated(self, view: VisualView) -> torch.Tensor:
        """[U, N] each token's mean attention from its sample's raters (the recorded rows that are raters)."""
        if self.raters is None:
            raise TrimVLMError("tokens=sparsevlm needs the raters chosen before layer 0 (`start`)")
        samples = view.sample.tolist()
        rate = torch.stack([torch.isin(src, self.raters[b]) for src, b in zip(view.row_source, samples, strict=True)])
        w = rate.to(view.rows.dtype)
        score = (view.rows * w[..., None]).sum(1) / w.sum(1, keepdim=True).clamp(min=1)  # [U, S]: raters' mean
        return score.gather(1, view.cols).float().masked_fill(~view.mask, 0.0)

    def choose(self, view: VisualView) -> Selection:
        kj, clusters = self.selected(view)
        score = self.rated(view)
        keep = topk_mask(score, kj, view.mask)
        deleted = view.mask & ~keep
        cand = topk_mask(score, torch.where(clusters > 0, (0.3 * deleted.sum(1)).long() + 1, 0), deleted)
        u, n = view.mask.shape
        ar = torch.arange(n, device=score.device)
        first = keep.long().argmax(1)  # a kept token the dropped, unrecycled ones point at (with weight 0)
        assign = torch.where(view.mask, first[:, None].expand(u, n), ar[None].expand(u, n)).clone()
        weight = torch.zeros(u, n, dtype=torch.float32, device=score.device)
        weight[keep] = 1.0
        for i in range(u):
            if int(clusters[i]) == 0:
                continue
            idx = torch.nonzero(cand[i]).flatten()
            centers, into = dpc_knn(view.features[i, idx].float(), int(clusters[i]))
            keep[i, idx[centers]] = True
            assign[i, idx] = idx[centers][into]
            weight[i, idx] = 1.0
        return Selection(keep=keep, assign=assign, weight=weight)
