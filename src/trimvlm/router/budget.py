"""Router v2's budget rule: `router=PATH:budget=0.75` chooses each input's layout under a total-FLOP budget.

Per input x the router scores its visual tokens (s_v) and candidate layers (logits z_l, s_l = sigmoid(z_l)), as
in v1. Under budget B the checkpoint's calibration gives a token keep k_B and a price lambda_B (nats per unit of
total-FLOP ratio). Then, per input:
- every image keeps its top ceil(N * k_B) tokens by s_v (the same count for every input, so a batch pads no
  more than the baseline does);
- the candidate layers are taken in order of their skip preference -z_l (the lowest keep scores first), and
  layer j is skipped while -z_j > lambda_B * dc_j, dc_j the total-FLOP ratio that skipping it saves at keep
  k_B; at most `max_skip` layers. Skipping no layer is a choice like any other, and a single input may spend
  more or less than B.
Or the layers follow an anchor (S, tau): the static skip set S, from which an input deviates only where the
router's logit departs from its mean over the training inputs by more than tau (a layer of S is run for an
input whose z_j - mean_j > tau, a layer outside S skipped where z_j - mean_j < -tau). tau = inf is the static
layout S itself, so the router's choices include every static layout a fixed recipe could take.
The calibration (`calibrate`) picks (k_B, lambda_B) on the calibration inputs: for every lambda of a grid and
every anchor (S, tau) of a grid, the keep whose mean cost over those inputs (with the layers each input would
skip) equals B, and of those the one with the smallest mean measured KL to the unpruned model (the layouts'
measured KL, interpolated in k); a policy that stays more than `REACH` under B even at full keep only where none
can spend B. The calibration inputs are the checkpoint's held-out ones for the selector in use where it has them
(training/calibration.py: inputs it never trained on, KL with that selector's tokens), else its training inputs
(KL of FastV-ranked tokens).
Costs: `cost[k, subset]`, the predicted total-FLOP ratio of keeping k and skipping that subset (prefill
prediction, `tune.predict`, on the training inputs; the router's own FLOPs added). At B >= 1 nothing is pruned.
"""

from __future__ import annotations

import bisect
import math
from typing import NamedTuple

import torch


def recorded_variant(meta: dict, budget: float) -> dict | None:
    """The variant `router=M:budget=B` runs: of those recorded in the checkpoint (`budget.variants`, one per
    calibrated budget: {"budget", "select", "price"}), the one whose budget is nearest B (a tie: the lower
    budget, which spends less); None when none is recorded."""
    variants = meta.get("budget", {}).get("variants") or []
    return min(variants, key=lambda v: (abs(float(v["budget"]) - budget), float(v["budget"])), default=None)


def interp(grid: list[float], values: list[float], x: float) -> float:
    """Piecewise-linear interpolation of `values` over the sorted `grid` (clamped at the ends)."""
    if x <= grid[0]:
        return values[0]
    if x >= grid[-1]:
        return values[-1]
    j = bisect.bisect_right(grid, x)
    t = (x - grid[j - 1]) / (grid[j] - grid[j - 1])
    return values[j - 1] * (1 - t) + values[j] * t


class BudgetTable:
    """The checkpoint's `budget` section: the cost table over keeps x skip subsets and the calibrated choices."""

    def __init__(self, data: dict, layer: int | None = None, select: str = "router"):
        """`layer`: the tokens are reduced before that layer (a `select=` method's; None: the router's own). With
        a `select=` method the router runs only where its layer plan is needed, so a policy that never skips
        (lambda inf) is priced without the router's own FLOPs;
        `select`: the selector whose held-out KL calibrates, when the checkpoint has it (training/calibration.py:
        `router` or NAME@LAYER); else the training inputs' plain-ranking KL."""
        self.keeps = [float(k) for k in data["keeps"]]
        self.subsets = [tuple(s) for s in data["subsets"]]  # candidate-layer subsets, () first
        self.cost = data["cost"]  # [keep][subset] total-FLOP ratio (router FLOPs included)
        share = float(data.get("router_share", 0.0))
        self.idle_share = 0.0  # what a policy that never skips does not spend (the router does not run)
        if layer is not None:
            self.idle_share = share
            by_layer = data.get("cost_by_layer", {})
            if str(layer) not in by_layer:
                raise ValueError(f"no cost table for tokens reduced before layer {layer} (have {sorted(by_layer)})")
            self.cost = [[c + share for c in row] for row in by_layer[str(layer)]]
        self.max_skip = int(data["max_skip"])
        self.choices = {float(b): (float(k), _policy(lam)) for b, k, lam in data.get("choices", [])}
        if data.get("z") is not None:  # calibrated on demand, keyed (budget, price)
            self.choices = {(b, None): c for b, c in self.choices.items()}
        self.z = None if data.get("z") is None else torch.tensor(data["z"], dtype=torch.float64)  # [X, N]
        self.z_mean = None if self.z is None else self.z.mean(0)  # what an anchor's deviations are measured from
        self.kl = data.get("kl")  # [X][keep][subset]: measured KL of the training layouts
        self.cand = data.get("candidate_layers")
        held = data.get("held_out", {})
        self.held_out = select in held.get("kl", {})  # calibrated on inputs it never trained on, its own tokens
        if self.held_out:
            self.z = torch.tensor(held["z"], dtype=torch.float64)
            self.kl = held["kl"][select]

    def cost_of(self, keep: float, subset) -> float:
        """The predicted cost of `keep` with `subset` skipped: interpolated in keep; below the lowest keep of the
        table, extrapolated along its two lowest keeps (a budget the table's keeps cannot reach)."""
        j = self.subsets.index(tuple(sorted(subset)))
        col = [row[j] for row in self.cost]
        if keep < self.keeps[0] and len(self.keeps) > 1:
            slope = (col[1] - col[0]) / (self.keeps[1] - self.keeps[0])
            return col[0] - slope * (self.keeps[0] - keep)
        return interp(self.keeps, col, keep)

    def lowest(self, price: float | None = None) -> float:
        """The smallest mean cost the calibration inputs can reach (the cheapest keep, every layer it may skip,
        or the layers it skips at `price`)."""
        if self.z is None:
            return min(self.choices, default=math.inf)
        return self.mean_cost(self.z, self.cand, min(FLOOR, self.keeps[0]), -math.inf if price is None else price)

    def choice(self, budget: float, price: float | None = None) -> tuple[float, float]:
        """(keep, lambda) for a budget: calibrated on the stored training inputs for exactly this budget (or,
        for a table of precomputed choices, interpolated between them). `price`: lambda given, only the keep
        calibrated (the keep whose mean cost with that price's skips meets the budget)."""
        if self.z is not None:
            key = (budget, price)
            if key not in self.choices:
                got = calibrate(self, self.z, self.cand, self.kl_at, [budget], None if price is None else (price,))
                self.choices[key] = got[0][1:] if got else (self.keeps[0], -math.inf)
            return self.choices[key]
        grid = sorted(self.choices)
        ks = [self.choices[b][0] for b in grid]
        lams = [self.choices[b][1] for b in grid]
        return interp(grid, ks, budget), interp(grid, lams, budget)

    def skip(self, z_l: torch.Tensor, cand: list[int], keep: float, lam) -> list[tuple[int, ...]]:
        """Per row of layer logits z_l [B, N]: the candidate layers it skips (the threshold rule above, or the
        anchor (S, tau) when `lam` is one)."""
        if isinstance(lam, tuple):
            return self._anchored(z_l, cand, *lam)
        out = []
        for row in z_l.tolist():
            order = sorted(range(len(cand)), key=lambda j: (row[j], j))  # the lowest keep logit first
            chosen: list[int] = []
            for j in order[: self.max_skip]:
                saves = self.cost_of(keep, chosen) - self.cost_of(keep, [*chosen, cand[j]])
                if lam == -math.inf or -row[j] > lam * saves:
                    chosen.append(cand[j])
                else:
                    break
            out.append(tuple(sorted(chosen)))
        return out

    def _anchored(self, z_l: torch.Tensor, cand: list[int], static: tuple, tau: float) -> list[tuple[int, ...]]:
        dev = z_l.double() if self.z_mean is None else z_l.double() - self.z_mean
        out = []
        for row in dev.tolist():
            chosen = [c for j, c in enumerate(cand) if (row[j] <= tau if c in static else row[j] < -tau)]
            if len(chosen) > self.max_skip:  # the lowest logits first, as the threshold rule takes them
                chosen = sorted(chosen, key=lambda c: (row[cand.index(c)], c))[: self.max_skip]
            out.append(tuple(sorted(chosen)))
        return out

    def kl_at(self, x: int, keep: float, subset) -> float:
        j = self.subsets.index(tuple(sorted(subset)))
        return interp(self.keeps, [row[j] for row in self.kl[x]], keep)

    def mean_cost(self, z: torch.Tensor, cand, keep: float, lam: float) -> float:
        subsets = self.skip(z, cand, keep, lam)
        idle = self.idle_share if lam == math.inf else 0.0
        return sum(self.cost_of(keep, s) for s in subsets) / len(subsets) - idle


# prices (nats per unit of total-FLOP ratio); negative: skip even layers the router would keep, down to
# max_skip, so that tight budgets are reachable; inf: skip nothing
LAMBDAS = (-math.inf, -16.0, -8.0, -4.0, -2.0, -1.0, 0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, math.inf)
# a policy whose mean cost stays more than this fraction under the budget even at full keep (it skips more than
# the budget asks) is taken only where no policy can spend the budget: "meets the budget" is within 2%
REACH = 0.02
# the lowest keep a budget below the table's keeps is calibrated to (fractions of each image's tokens)
FLOOR = 0.02
# anchor deviations (logit units away from the training mean); inf: the static layout
TAUS = (math.inf, 4.0, 2.0, 1.0, 0.5)


def _policy(lam):
    """A stored price (a number) or anchor ([subset, tau])."""
    return (tuple(lam[0]), float(lam[1])) if isinstance(lam, list | tuple) else float(lam)


def policies(table: BudgetTable) -> list:
    """What `calibrate` chooses among by default: every price of the grid and every anchor (S, tau)."""
    return [*LAMBDAS, *((tuple(sub), tau) for sub in table.subsets for tau in TAUS)]


def calibrate(table: BudgetTable, z: torch.Tensor, cand, kl, budgets, lambdas=None) -> list[tuple[float, float, float]]:
    """(budget, keep, lambda) for each budget from the training inputs' layer logits z [X, N] and measured KL
    `kl(x, keep, subset)` (interpolated in keep). A budget no policy meets within the table's keeps is met below
    them (its costs extrapolated, down to keep FLOOR); budgets not even met there are left out."""
    out = []
    for b in budgets:
        best = None
        # below the table only where nothing meets b within it (once: a table starting at FLOOR has no below)
        for low in dict.fromkeys((table.keeps[0], min(FLOOR, table.keeps[0]))):
            for lam in lambdas or policies(table):
                got = _calibrated(table, z, cand, kl, b, lam, low)
                if got is not None and (best is None or (got.short, got.loss) < (best.short, best.loss - 1e-12)):
                    best = got
            if best is not None:
                out.append((float(b), best.keep, best.lam))
                break
    return out


class Calibrated(NamedTuple):
    """One policy's calibration at a budget: whether it cannot spend it, its mean KL, its keep and the policy."""

    short: bool
    loss: float
    keep: float
    lam: object


def _calibrated(table: BudgetTable, z, cand, kl, b: float, lam, low: float) -> Calibrated | None:
    """The keep in [low, 1] whose mean cost under policy `lam` meets budget b, or None when even `low` costs
    more."""
    lo, hi = low, 1.0
    if table.mean_cost(z, cand, lo, lam) > b:
        return None
    for _ in range(16):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if table.mean_cost(z, cand, mid, lam) <= b else (lo, mid)
    subsets = table.skip(z, cand, lo, lam)
    loss = sum(kl(x, lo, s) for x, s in enumerate(subsets)) / len(subsets)
    short = table.mean_cost(z, cand, lo, lam) < (1 - REACH) * b  # cannot spend the budget, even at keep 1
    return Calibrated(short, loss, lo, lam)
