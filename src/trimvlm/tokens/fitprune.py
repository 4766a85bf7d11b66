"""FitPrune: a pruning recipe (visual tokens removed after each layer) fitted on a small calibration set so that
the attention the visual tokens receive stays close to the unpruned model's, for a given budget."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, NamedTuple

import torch

from trimvlm.errors import RecipeError
from trimvlm.kernels.select import keep_count, topk_mask
from trimvlm.protocol import register
from trimvlm.runtime.attention import AttentionProbe
from trimvlm.runtime.plan import Plan
from trimvlm.tokens.base import Selection, TokenReducer, VisualView, instruction

ALL_ROWS = 1 << 30  # an AttentionProbe that records every query row of the prompt
PRECISION = 0.01  # the binary search on alpha stops at this width (the paper's)


class Stats(NamedTuple):
    """One calibration input's attention statistics per layer (None: a layer without attention weights)."""

    cross: list[list[float] | None]  # per layer, per visual token: mean over instruction queries of max_h A
    self_: list[list[float] | None]  # per layer, per visual token: (1/N) sum over visual queries of max_h A


def received(att: torch.Tensor, cols: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FitPrune's two distributions of one sample's attention probabilities att [H, S, S] (all query rows) over
    an image's visual tokens V (`cols` [N] long, their columns), with `text` [S] bool the instruction's query
    rows T: cross_v = (1/|T|) sum_{t in T} max_h A[h, t, v] and self_v = (1/N) sum_{u in V} max_h A[h, u, v]."""
    a = att.float().amax(0)  # heads: their maximum, as the paper's statistics
    cross = a[text][:, cols].sum(0) / max(1, int(text.sum()))
    self_ = a[cols][:, cols].sum(0) / max(1, cols.numel())
    return cross, self_


def deletion_order(cross: torch.Tensor, self_: torch.Tensor) -> torch.Tensor:
    """[n] keep score (higher: deleted later) of n tokens: a token is deleted once it is among the lowest by both
    distributions, i.e. in ascending order of max(rank by cross, rank by self) (ranks ascending from 0; ties:
    the lower cross rank goes first, then the earlier token)."""
    n = cross.shape[0]
    rc = torch.empty(n, dtype=torch.float64, device=cross.device)
    rs = torch.empty_like(rc)
    ar = torch.arange(n, dtype=torch.float64, device=cross.device)
    rc[torch.sort(cross.double(), stable=True).indices] = ar
    rs[torch.sort(self_.double(), stable=True).indices] = ar
    return torch.maximum(rc, rs) * (n + 1) + rc


@torch.no_grad()
def statistics(runner, prepared) -> list[Stats]:
    """Per sample of a prepared batch, the unpruned model's attention statistics in every layer."""
    probe = AttentionProbe(last=ALL_ROWS, layers=None, per_head=True)
    out = runner.prefill(prepared, Plan(probe=probe))
    seq = out.seq
    stats = []
    for b, text in enumerate(instruction(seq)):
        vis = seq.visual[b] & seq.valid[b]
        cross, self_ = [], []
        for i in range(runner.num_layers):
            att = probe.results.get(i)
            got = att is not None and bool(vis.any())
            c, s = received(att[b], torch.nonzero(vis).flatten(), text) if got else (None, None)
            cross.append(c.tolist() if got else None)
            self_.append(s.tolist() if got else None)
        stats.append(Stats(cross, self_))
    return stats


def _deletable(scores: torch.Tensor, alive: torch.Tensor, total: float, alpha: float) -> torch.Tensor:
    """[N] bool: the largest set of the lowest-scored alive tokens whose removal leaves the alive tokens at least
    (1 - alpha) of `total` (the unpruned layer's mass), at least one token left."""
    idx = torch.nonzero(alive).flatten()
    order = idx[torch.sort(scores[idx].double(), stable=True).indices]
    left = float(scores[idx].double().sum()) - torch.cumsum(scores[order].double(), 0)
    n = int((left >= (1 - alpha) * total - 1e-12).sum().clamp(max=max(0, idx.numel() - 1)))
    out = torch.zeros_like(alive)
    out[order[:n]] = True
    return out


def simulate(stats: list[Stats], alpha: float, keep: float) -> tuple[bool, list[float]]:
    """FitPrune's fit at one alpha: layer by layer, each input deletes the tokens deletable by both distributions
    (`_deletable`), until the budget is met assuming no more pruning: the mean over layers of the alive
    fraction of visual tokens <= keep. (reached, alive fraction after each layer, averaged over the inputs)."""
    depth = len(stats[0].cross)
    alive = [torch.ones(len(next(c for c in s.cross if c is not None)), dtype=torch.bool) for s in stats]
    used, fractions = 0.0, []
    for i in range(depth):
        now = sum(float(a.double().mean()) for a in alive) / len(alive)
        if (used + now * (depth - i)) / depth <= keep + 1e-12:
            return True, fractions + [now] * (depth - i)
        for a, s in zip(alive, stats, strict=True):
            if s.cross[i] is None:
                continue
            c, f = torch.tensor(s.cross[i]), torch.tensor(s.self_[i])
            drop = _deletable(c, a, float(c.sum()), alpha) & _deletable(f, a, float(f.sum()), alpha)
            a &= ~drop
        used += now
        fractions.append(sum(float(a.double().mean()) for a in alive) / len(alive))
    return False, fractions


def fit(stats: list[Stats], keep: float) -> list[float]:
    """The alive fraction after each layer for budget `keep`: binary search for the smallest alpha in [0, 1]
    (to `PRECISION`) whose recipe meets the budget; the most pruning (alpha = 1) when none does."""
    lo, hi = 0.0, 1.0
    best = simulate(stats, hi, keep)[1]
    while hi - lo > PRECISION + 1e-9:
        mid = (lo + hi) / 2
        ok, fractions = simulate(stats, mid, keep)
        if ok:
            hi, best = mid, fractions
        else:
            lo = mid
    return best


def read_statistics(path) -> dict:
    """The calibration file `trimvlm calibrate --method fitprune` writes: `num_layers` and `inputs` (per input,
    `cross` and `self`: per layer a list of floats per visual token, or null for a layer without attention)."""
    p = Path(path)
    if not p.exists():
        raise RecipeError(
            f"fitprune statistics file not found: {p} (write one with `trimvlm calibrate --method fitprune`)"
        )
    try:
        data = json.loads(p.read_text())
        stats = [Stats(x["cross"], x["self"]) for x in data["inputs"]]
        depth = int(data["num_layers"])
    except (ValueError, KeyError, TypeError) as e:
        raise RecipeError(
            f"{p} is not a fitprune statistics file (needs 'num_layers' and 'inputs'): {e}"
        ) from e
    if not stats:
        raise RecipeError(f"{p} holds no calibration inputs")
    return {"num_layers": depth, "stats": stats}


@register("tokens", "fitprune")
@dataclass
class FitPrune(TokenReducer):
    """FitPrune (Ye et al., "Fit and Prune: Fast and Training-free Visual Token Pruning for Multi-modal Large
    Language Models", AAAI 2025, arXiv 2409.10197).

    Calibration (`trimvlm calibrate --method fitprune`, on unlabeled val inputs; `statistics`): the unpruned
    model's attention in every layer l, heads reduced by their maximum, gives two distributions over each
    image's visual tokens: cross^l_v (from the instruction's tokens, mean over them) and self^l_v (from the
    visual tokens, sum over them / N), and their totals W^l.

    Fit (`fit`, when the plan is made, for this recipe's budget): for an alpha in [0, 1], layer by layer each
    input deletes the alive tokens that are among the lowest by both distributions, as many as leave the alive
    ones at least (1 - alpha) W^l of each; pruning stops at the first layer where the budget is met assuming no
    more pruning. The smallest alpha that meets the budget (binary search to 0.01, the paper's) gives the
    recipe: the fraction of visual tokens alive after each layer, averaged over the inputs.

    Inference: after layer l where the recipe prunes, each image keeps K = ceil(N0 * fraction_l) of its tokens,
    deleting those first whose max(rank by cross, rank by self) is lowest (`deletion_order`: the tokens in the
    low set of both distributions), from the layer's own attention (every query row of the prompt recorded for
    that layer, per head: method FLOPs).

    Budget: `keep` is the mean over the decoder layers of the fraction of visual tokens alive (the paper's
    budget is the FLOPs of the visual tokens; with the same fraction in every layer both are the same, and this
    one does not depend on the model's sizes). Headline (the paper's): -54.9 % FLOPs on LLaVA-NeXT with a
    0.5 % accuracy drop; the recipe is found in about 5 minutes.

    Deviations: tokens are dropped before layer l + 1 (the paper drops them inside layer l, after its
    attention, so layer l's MLP skips them too); the recipe is a fraction of each image's tokens (the paper: a
    count for LLaVA's fixed 576); the statistics are the unpruned model's at every alpha (the paper re-runs the
    pruned layers for each alpha); a layer without attention weights (Gated DeltaNet) never prunes."""

    predictable: ClassVar[bool] = False  # the kept counts follow the calibration file
    attention: ClassVar[str] = "llm"  # every query row of the prompt, per head
    query_rows: ClassVar[int] = ALL_ROWS
    per_head: ClassVar[bool] = True

    file: str = ""
    # per plan, set by `stages` and read by each stage: layer it drops before -> the alive fraction from there on
    fractions: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    min_layer = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer is not None:
            raise ValueError(
                f"fitprune prunes at the layers its fitted recipe names: drop layer= (got {self.layer!r})"
            )
        if not self.file:
            raise ValueError(
                "fitprune needs file=PATH: the statistics written by `trimvlm calibrate --method fitprune`"
            )

    def recipe(self, runner) -> list[float]:
        """The alive fraction of visual tokens after each layer, fitted for this budget on this model."""
        data = read_statistics(self.file)
        if data["num_layers"] != runner.num_layers:
            raise RecipeError(f"fitprune statistics {self.file} are of a model with {data['num_layers']} layers; "
                              f"this one has {runner.num_layers}: calibrate this model")  # fmt: skip
        return fit(data["stats"], self.ratio)

    def stages(self, runner) -> dict[int, float]:
        """layer it drops before -> the alive fraction from there on (kept in `fractions` for the stages)."""
        out, prev = {}, 1.0
        for i, f in enumerate(self.recipe(runner)[: runner.num_layers - 1]):
            if f < prev - 1e-12:
                out[i + 1] = f
            prev = f
        self.fractions = out
        return out

    def counts(self, view: VisualView) -> torch.Tensor:
        n0 = view.grid[:, 0] * view.grid[:, 1]
        return torch.minimum(keep_count(n0, self.fractions[view.layer], minimum=1), view.n)

    def choose(self, view: VisualView) -> Selection:
        order = torch.full(view.mask.shape, -math.inf, dtype=torch.float64, device=view.mask.device)
        for u in range(view.mask.shape[0]):
            n = int(view.n[u])
            cross, self_ = received(view.rows[u], view.cols[u, :n], view.row_text[u])
            order[u, :n] = deletion_order(cross, self_)
        return Selection(keep=topk_mask(order, view.k, view.mask))
