"""SparseVLM: text raters score the visual tokens inside the LLM, pruned progressively over several layers, the
pruned tokens partly recycled into a few merged ones."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from trimvlm.errors import RecipeError, TrimVLMError
from trimvlm.kernels.flops import matmul
from trimvlm.kernels.select import topk_mask
from trimvlm.options import require_int, stage_layers
from trimvlm.protocol import register
from trimvlm.runtime.sequence import LiveSeq
from trimvlm.tokens.base import Selection, TokenReducer, VisualView, after_attention_layers, scaled_stages

PAPER_LAYERS = (3, 7, 16)  # before these decoder layers: after the paper's layers 2, 6 and 15 of LLaVA's 32
PAPER_DEPTH = 32


def raters(seq: LiveSeq) -> list[torch.Tensor]:
    """Per sample, the original positions of its raters: of the text tokens after the sample's last image (the
    instruction), those whose relevance to the visual tokens is above the instruction's mean, relevance_m =
    mean_i softmax_m(<v_i, t_m>) over the sample's visual tokens i (the softmax over the instruction's tokens),
    on the hidden states entering the first layer. A sample without images has none."""
    out = []
    for b in range(seq.batch):
        vis = torch.nonzero(seq.visual[b] & seq.valid[b]).flatten()
        if vis.numel() == 0:
            out.append(torch.zeros(0, dtype=torch.long, device=seq.source.device))
            continue
        text = torch.nonzero(seq.valid[b] & ~seq.visual[b]).flatten()
        text = text[text > vis[-1]] if bool((text > vis[-1]).any()) else text
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

    layer: int | None = None
    layers: str = ""
    rows: int = 64
    merge: bool = True
    # per call, set before the first layer and read by the stages: the original positions of each sample's raters
    raters: list | None = field(default=None, init=False, repr=False, compare=False)

    default_layer = 3
    min_layer = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        require_int("rows", self.rows, 1)
        if self.merge is not True:
            raise ValueError("sparsevlm recycles pruned tokens by merging them (merge=true)")
        if self.layers:
            stage_layers(self.layers, "3-7-16")

    def layer_why(self) -> str:
        return " (sparsevlm ranks by the attention of layer L-1, so L >= 1)"

    def stages(self, runner) -> list[int]:
        """The layers the stages reduce before, on this model."""
        if self.layers:
            return stage_layers(self.layers, "3-7-16")
        return scaled_stages(self.at(runner), runner.num_layers, PAPER_LAYERS, PAPER_DEPTH)

    def check(self, runner) -> None:
        n, ok = runner.num_layers, after_attention_layers(runner)
        for lay in self.stages(runner):
            if lay not in ok:
                raise RecipeError(
                    f"tokens=sparsevlm: stage layer {lay} must be in 1..{n - 1} with an attention layer before it; "
                    f"allowed on this model: {ok}"
                )

    def wants_attention(self, runner) -> bool:
        return True

    def probe(self, runner, handoff):
        from trimvlm.runtime.attention import AttentionProbe

        if self.ratio >= 1:
            return None  # keep = 1: nothing is recorded, nothing runs
        handoff.probes["tokens"] = AttentionProbe(last=self.rows, layers={s - 1 for s in self.stages(runner)})
        return handoff.probes["tokens"]

    def hook(self, runner, handoff):
        stages = self.stages(runner)
        if self.ratio >= 1:
            return None

        def _hook(i: int, seq: LiveSeq, run) -> LiveSeq:
            if i == 0:  # the method's own state for this call's later stages
                self.raters = raters(seq) if bool(seq.visual.any()) else None
            return self.reduce(seq, run, handoff, layer=i) if i in stages else seq

        self._stage_of = {lay: j + 1 for j, lay in enumerate(stages)}
        self._n_stages = len(stages)
        return _hook

    def read_attention(self, view: VisualView, seq: LiveSeq, lay: int, handoff) -> torch.Tensor:
        probe = handoff.probes.get("tokens")
        res = None if probe is None else probe.results.pop(lay - 1, None)
        if res is None or self.raters is None:
            raise TrimVLMError(f"tokens=sparsevlm needs the raters and the attention of layer {lay - 1} recorded")
        r = res.shape[1]  # [B, r, S]: the last r query rows
        cols = torch.arange(seq.length - r, seq.length, device=res.device)
        src = seq.source[:, cols]  # [B, r] original position of each recorded row
        rate = torch.stack([torch.isin(src[b], self.raters[b]) for b in range(seq.batch)])  # [B, r]
        w = rate.to(res.dtype)
        score = (res * w[..., None]).sum(1) / w.sum(1, keepdim=True).clamp(min=1)  # [B, S] mean over raters
        return score[view.sample[:, None], view.cols].float().masked_fill(~view.mask, 0.0)

    def _counts(self, view: VisualView) -> tuple[torch.Tensor, torch.Tensor]:
        """(K_j selected, recycled clusters) per unit at this stage."""
        j = self._stage_of[view.layer]
        n0 = view.grid[:, 0] * view.grid[:, 1]
        final = torch.ceil(n0.double() * self.ratio - 1e-9).long().clamp(min=1)
        kj = torch.round(n0.double() * self.ratio ** (j / self._n_stages)).long()
        kj = final if j == self._n_stages else kj
        kj = torch.minimum(kj.clamp(min=1), view.n)
        deleted = view.n - kj
        cand = torch.where(deleted > 0, (0.3 * deleted).long() + 1, 0).minimum(deleted)
        clusters = torch.where(cand > 0, cand // 10 + 1, 0).minimum(cand)
        return kj, clusters

    def prepare(self, view: VisualView, runner, handoff) -> None:
        kj, clusters = self._counts(view)
        view.k = kj + clusters

    def choose(self, view: VisualView) -> Selection:
        kj, clusters = self._counts(view)
        score = view.attention
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
