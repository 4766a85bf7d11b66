"""`router=PATH:token_keep=0.25:layers_skip=2` (v1) or `router=PATH:budget=0.75` (v2, router/budget.py): run a
trained meta-router per input and execute its layout.

Before decoder layer K (the checkpoint's `layer`, 0 by default: before the first layer) the router reads each
sample's visual tokens (at K = 0 the projector's output, else the hidden states entering layer K) and its text
tokens, and scores every visual token and every candidate layer. Then, per sample,
- each image keeps its K = ceil(N_image * token_keep) highest-scoring tokens (the others are physically
  dropped, through the same gather as every token reducer);
- the `layers_skip` candidate layers with the lowest keep scores are not run, for this sample, in the prefill
  and the decode (a per-sample layer plan: each layer runs on the rows that keep it).
The router's own FLOPs are method FLOPs. Its checkpoint names the model it was trained for (a fingerprint);
another model's router is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from trimvlm.depth.base import model_fingerprint
from trimvlm.errors import RecipeError
from trimvlm.kernels.select import topk_mask
from trimvlm.options import is_int, is_number
from trimvlm.protocol import Method, build, register
from trimvlm.router.budget import BudgetTable, recorded_variant
from trimvlm.router.model import load_router
from trimvlm.runtime.plan import LayerPlan, Plan, RouteGroup
from trimvlm.tokens.base import Selection, TokenReducer, VisualView


@dataclass
class RouterTokens(TokenReducer):
    """The token half of a router layout: keep each image's highest router scores (`Handoff.router`)."""

    attention: ClassVar[str] = "router"

    def choose(self, view: VisualView) -> Selection:
        return Selection(keep=topk_mask(view.attention, view.k, view.mask))


def prompt_features(seq) -> torch.Tensor:
    """[B, D] float32: the mean of each row's text-token embeddings (what a routed variant's switch reads, before
    the first layer runs)."""
    text = (seq.valid & ~seq.visual).to(torch.float32)
    total = (seq.hidden.float() * text[..., None]).sum(1)
    return total / text.sum(1, keepdim=True).clamp_min(1.0)


def _packed(hidden: torch.Tensor, mask: torch.Tensor):
    """([B, n, D] the masked positions of every row first, in order; [B, n] their mask; [B, n] their columns)."""
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices
    n = int(mask.sum(1).max()) if mask.numel() else 0
    cols = order[:, :n]
    packed = hidden.gather(1, cols[..., None].expand(-1, -1, hidden.shape[-1]))
    return packed, mask.gather(1, cols), cols


@register("router", "PATH", by_path=True)
@dataclass
class Router(Method):
    """The learned meta-router (PAR): per input, a token selection and a layer plan (`router=PATH|demo:...`).

    `router=M:budget=B` alone runs the variant (select, price) recorded in the checkpoint for the calibrated
    budget nearest B (`trimvlm pick-router` chooses it on validation items and records it); giving select= or
    price= overrides it, and a router without recorded variants runs its own scores at the calibrated price.
    """

    path: str
    token_keep: float | None = None  # v1: the fixed keep (0.25 when neither it nor budget is given)
    layers_skip: int | None = None  # v1: the fixed number of candidate layers skipped (2 by default)
    budget: float | None = None  # v2: a total-FLOP budget, the layout chosen per input (router/budget.py)
    # v2: which tokens: the router's scores ("router"), or a registered token method (NAME or NAME@L); None: the
    # recorded variant's, else "router"
    select: str | None = None
    # v2: lambda, nats per unit of total-FLOP ratio (auto: calibrated; inf: no skip); None: the recorded
    # variant's, else auto
    price: float | str | None = None
    # v2: the budget the keep and price are calibrated for (None: budget scaled by the recorded variant's aim, which
    # pick-router sets so that the spend measured on validation items meets its budget; else budget itself)
    aim: float | None = None

    excludes: ClassVar[tuple[str, ...]] = ("tokens", "depth")  # it picks the tokens and the layers itself

    def __post_init__(self):
        self.variant = None  # the recorded variant the plain recipe took: {"budget", "select", "price", "aim"}
        if self.budget is not None and self.select is None and self.price is None and is_number(self.budget):
            self.take_variant()
        self.select = "router" if self.select is None else self.select
        self.price = "auto" if self.price is None else self.price
        if self.budget is not None:
            if self.token_keep is not None or self.layers_skip is not None:
                raise RecipeError("router budget= chooses the keep and the skipped layers per input; do not give "
                                  "token_keep or layers_skip with it")  # fmt: skip
            if not is_number(self.budget) or not 0 < self.budget <= 1:
                raise RecipeError(f"router budget must be a total-FLOP ratio in (0, 1], got {self.budget!r}")
            self.aim = self.budget if self.aim is None else self.aim
            if not is_number(self.aim) or not 0 < self.aim <= 1:
                raise RecipeError(f"router aim must be a total-FLOP ratio in (0, 1], got {self.aim!r}")
        elif self.aim is not None:
            raise RecipeError("router aim= applies with budget= (v2)")
        if self.price != "auto":
            if self.budget is None:
                raise RecipeError("router price= applies with budget= (v2)")
            try:
                self.price = float(self.price)
            except (TypeError, ValueError):
                raise RecipeError(f"router price must be a number, inf or auto, got {self.price!r}") from None
            if math.isnan(self.price):
                raise RecipeError("router price must be a number, inf or auto, got nan")
        if self.select != "router" and self.budget is None:
            raise RecipeError("router select= applies with budget= (v2); v1 keeps the router's own token scores")
        self.token_keep = 0.25 if self.token_keep is None else self.token_keep
        self.layers_skip = 2 if self.layers_skip is None else self.layers_skip
        if not is_number(self.token_keep) or not 0 < self.token_keep <= 1:
            raise RecipeError(f"router token_keep must be in (0, 1], got {self.token_keep!r}")
        if not is_int(self.layers_skip) or self.layers_skip < 0:
            raise RecipeError(f"router layers_skip must be an integer >= 0, got {self.layers_skip!r}")
        self.model, self.meta = load_router(self.path)
        n = len(self.meta["candidate_layers"])
        if self.layers_skip > n:
            raise RecipeError(f"router layers_skip={self.layers_skip} exceeds its {n} candidate layers")
        self.layer = int(self.meta.get("layer", 0))
        self.table = None
        if self.budget is not None:
            if "budget" not in self.meta:
                raise RecipeError(f"router {self.path} is a v1 router (one fixed keep and layer count); budget= "
                                  "needs one trained on several budgets (trimvlm train-router --keeps ...)")  # fmt: skip
            self.table = BudgetTable(self.meta["budget"])
            if self.select != "router":  # the method at its own layer; the router's FLOPs only where it runs
                at = self.selector(0.5).layer
                try:
                    self.table = BudgetTable(self.meta["budget"], layer=at, select=self.select_key)
                except ValueError as e:
                    raise RecipeError(f"router select={self.select}: {e} (a method acting by the router's layer "
                                      f"{self.layer})") from None  # fmt: skip
            low = self.table.lowest(self._price)
            if self.aim < low - 1e-9:
                raise RecipeError(f"router {self.path} cannot meet budget {self.budget}: its cheapest layouts cost "
                                  f"{low:.3f}x on its calibration inputs")  # fmt: skip
        self.routes = self.switch = None
        if self.variant is not None and "routes" in self.variant:
            self.take_routes()

    def take_variant(self) -> None:
        """select=, price= and (unless given) aim= from the variant recorded for the budget nearest this one; its
        aim scales with the budget (aim / its budget)."""
        self.variant = recorded_variant(load_router(self.path)[1], float(self.budget))
        if self.variant is not None:
            self.select, self.price = self.variant["select"], self.variant["price"]
            if self.aim is None and "aim" in self.variant:
                self.aim = min(1.0, self.budget * float(self.variant["aim"]) / float(self.variant["budget"]))

    def take_routes(self) -> None:
        """A routed variant's routes (one `Router` per recorded route: its select=, price= and aim, scaled with
        the budget as the aim of a variant is) and the switch that sends each input to one of them."""
        scale = float(self.budget) / float(self.variant["budget"])
        self.routes = [Router(self.path, budget=self.budget, select=r["select"], price=r["price"],
                              aim=min(1.0, float(r["aim"]) * scale)) for r in self.variant["routes"]]  # fmt: skip
        sw = self.variant["switch"]
        self.switch = (torch.tensor(sw["weight"], dtype=torch.float32), torch.tensor(sw["bias"], dtype=torch.float32))

    def route(self, seq, runner) -> list[RouteGroup]:
        """The rows the switch sends to each route that takes any, and the route's plan for them."""
        w, b = self.switch
        choice = (prompt_features(seq) @ w.T.to(seq.hidden.device) + b.to(seq.hidden.device)).argmax(1).cpu()
        out = []
        for j, method in enumerate(self.routes):
            rows = torch.nonzero(choice == j).flatten()
            if rows.numel():
                plan = Plan()
                method.apply(plan, runner)
                out.append(RouteGroup(rows, plan))
        return out

    def check(self, runner) -> None:
        fp = model_fingerprint(runner.adapter)
        if self.meta.get("fingerprint") != fp:
            raise RecipeError(
                f"router {self.path} was trained for another model (fingerprint {self.meta.get('fingerprint')}, "
                f"this model's is {fp}): train one for it (trimvlm train-router)"
            )
        if self.layers_skip >= runner.num_layers:
            raise RecipeError(f"router layers_skip={self.layers_skip} must leave one of {runner.num_layers} layers")

    @property
    def _price(self) -> float | None:
        return None if self.price == "auto" else float(self.price)

    @property
    def select_key(self) -> str:
        """The selector's name in a held-out calibration (training/calibration.py): `router` or NAME@LAYER."""
        if self.select == "router":
            return "router"
        return f"{str(self.select).partition('@')[0]}@{self.selector(0.5).layer}"

    def selector(self, keep: float):
        """The token method `select=` names, at the router's layer and the budget's keep."""
        if self.select == "router":
            raise RecipeError("the router's own token scores are not a token method")
        name, at, layer = str(self.select).partition("@")
        if at and not (layer.isdigit() and int(layer) <= self.layer):
            raise RecipeError(f"router select={self.select}: the layer after @ must be an integer in 0..{self.layer} "
                              "(the method acts by the router's layer, where the layer plan is made)")  # fmt: skip
        opts = {"keep": keep} | ({"layer": int(layer)} if at else {})
        try:
            method = build("tokens", name, opts)
        except RecipeError as e:
            raise RecipeError(f"router select={self.select}: {e}") from e
        if method.layer is None:  # its default layer, at most the router's (the layer plan is made there)
            method.layer = min(method.default_layer, self.layer)
        return method

    def apply(self, plan, runner) -> None:
        """The method protocol: the router's hook before layer K fills one LayerPlan for prefill and decode.
        With `select=METHOD` that token method applies to the plan first (its probes, its hook) and the
        router's hook wraps it: the router decides the layers, the method the tokens."""
        self.check(runner)
        if self.routes is not None:
            if plan.after_prefill is not None or plan.probe is not None:
                raise RecipeError(f"router={self.path}:budget={self.budget} runs each input on one of its routes "
                                  "(a routed variant): kv= cannot be combined with it; give select= and price= to "
                                  "run one variant")  # fmt: skip
            plan.routes = self.route
            return
        keep, lam = self.layout()
        inner = None
        if self.select != "router" and keep < 1:
            self.selector(keep).apply(plan, runner)
            inner = plan.hook
        plan.hook, plan.skip_prefill = self.bind(runner, plan.handoff, keep, lam, inner)
        plan.skip_decode = plan.skip_prefill

    def layout(self) -> tuple[float, float | None]:
        """(the token keep, v2's layer price; None: v1's fixed layer count, or budget 1)."""
        if self.table is None:
            return float(self.token_keep), None
        if self.budget >= 1:
            return 1.0, None
        return self.table.choice(float(self.aim), self._price)

    def bind(self, runner, handoff, keep: float, lam: float | None, inner=None):
        """(the token hook, the LayerPlan it fills) for the plan; `inner`: the `select=` method's hook."""
        tokens = RouterTokens(keep=keep, layer=self.layer)
        layers = LayerPlan()
        cand = torch.tensor(self.meta["candidate_layers"], dtype=torch.long)

        def hook(i, seq, run):
            if i != self.layer or (self.budget is not None and self.budget >= 1):
                return seq if inner is None else inner(i, seq, run)  # budget 1: the router does not run
            if inner is not None and lam == math.inf:
                return inner(i, seq, run)  # it skips no layer at this price: its scores are not needed
            vis = seq.visual & seq.valid
            v, vm, vcols = _packed(seq.hidden, vis)
            t, tm, _ = _packed(seq.hidden, ~seq.visual & seq.valid)
            model = self.model.to(seq.hidden.device)
            s_v, s_l = model(v, vm, t, tm)
            scores = torch.full(seq.valid.shape, float("-inf"), device=seq.hidden.device)
            handoff.router = scores.scatter(1, vcols, s_v.float().masked_fill(~vm, float("-inf")))
            plan = torch.zeros(seq.batch, run.num_layers, dtype=torch.bool, device=seq.hidden.device)
            if lam is not None:  # v2: each input's layers under the budget's price
                z_l = torch.logit(s_l.double().clamp(1e-12, 1 - 1e-12))
                for b, sub in enumerate(self.table.skip(z_l, self.meta["candidate_layers"], keep, lam)):
                    plan[b, list(sub)] = True
            elif self.table is None and self.layers_skip:
                low = torch.topk(s_l, self.layers_skip, dim=1, largest=False).indices  # ties: torch's order
                plan.scatter_(1, cand.to(low.device)[low], True)
            layers.plan = plan
            if inner is not None:
                return inner(i, seq, run)
            return tokens.reduce(seq, run, handoff) if keep < 1 else seq

        return hook, layers

