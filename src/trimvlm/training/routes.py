"""Router v2's routed variants (`trimvlm pick-routes`): at one budget each input runs one of several variants
(routes, each a `select=` method at price inf and its own aim), chosen by a linear switch over the mean of its
prompt's text-token embeddings (`router.route.prompt_features`, read before the first layer); each route's rows
run as a batch of their own (runtime/routes.py), so a route that reduces the tokens at layer 0 and one that
reduces them at layer 2 never pad one another.

The switch is fitted on validation items (the task's val split after the router's own inputs), never on
answers: each route runs on them at its aim (`variants.aimed`, as `pick-router` aims a variant), and an item
teaches the switch where some routes agree with the unpruned model's output and others do not (a softmax over
the routes against the agreeing ones, features standardised, an L2 penalty). The routed variant is then run on
the next `n_val` validation items beside the variant recorded for the budget, and recorded only where it answers
more of them; else the recorded variant stays. Before that check its routes' aims are scaled by the budget over
what the routed variant spent on the fitting and check items together (2 x `n_val` inputs: spend alone, no answer
read): each route's rows are padded to their own longest row, not the whole batch's, so the routed variant spends
less than its routes did alone, and one draw of `n_val` inputs spends about 1% more or less than another.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from trimvlm.errors import InputError
from trimvlm.evals.run import batches, run_eval
from trimvlm.evals.tasks import get_task
from trimvlm.recipe import parse_method
from trimvlm.router.budget import recorded_variant
from trimvlm.router.model import load_router, router_folder
from trimvlm.router.route import prompt_features
from trimvlm.runtime.meter import Meter
from trimvlm.training.calibration import seen_inputs
from trimvlm.training.variants import _accepted, aimed, reaimed, record_variants

L2 = 1e-2  # the switch's penalty on its (standardised) weights


def pick_routes(vlm, router: str, budget: float, selects: list[str], task: str, n_val: int,
                batch_size: int = 48) -> dict:  # fmt: skip
    """Fit the switch among `selects` at `budget`, check it against the recorded variant on fresh validation
    items, record it where it wins: {"recorded", "routed_accuracy", "single_accuracy", "items", "variant"}."""
    meta = load_router(router)[1]
    single = recorded_variant(meta, budget)
    if single is None or abs(float(single["budget"]) - budget) > 1e-9:
        raise InputError(f"router {router} records no variant at budget {budget}: run trimvlm pick-router first")
    single = {k: v for k, v in single.items() if k not in ("routes", "switch")}  # the one variant it runs alone
    cands = {s: f"router={router}:budget={budget}:select={s}:price=inf" for s in selects}
    ok = {s: r for s, r in cands.items() if _accepted(r, vlm.runner)}
    if len(ok) < 2:
        raise InputError(f"routes need two selectors the router runs at budget {budget}; it runs {sorted(ok)}")
    seen = seen_inputs(meta)
    val = get_task(task, limit=seen + 2 * n_val, seed=0, split="val")
    fit, check = (replace(val, records=val.records[a:b]) for a, b in ((seen, seen + n_val), (seen + n_val, None)))
    aims, res = aimed(vlm, fit, {r: budget for r in ok.values()}, budget, batch_size)
    base = res.predictions[0]
    agree = torch.tensor([[p == q for p, q in zip(res.predictions[res.labels.index(aims[r])], base, strict=True)]
                          for r in ok.values()]).T  # fmt: skip
    weight, bias = fit_switch(features(vlm, fit, batch_size), agree)
    routes = [{"select": s, "price": "inf", "aim": float(parse_method(aims[r]).options["aim"])} for s, r in ok.items()]
    routed = {**single, "routes": routes, "switch": {"weight": weight.tolist(), "bias": bias.tolist()}}
    folder = router_folder(router)
    record_variants(folder, [routed])
    # each route's rows are padded to their own longest row, not the batch's: the routed variant spends less than
    # its routes alone did; its aims scale by the budget over what it spends on the fitting and check items
    # together (spend only: no answer of a check item is read before the check)
    plain = f"router={router}:budget={budget}"
    both = replace(val, records=fit.records + check.records)
    ran = run_eval(vlm, both, [plain], batch_size=batch_size, warmup=False, memory="off", progress=False)
    spent = ran.row(ran.labels[1])["ratio"]["total_flops"]
    for r, recipe in zip(routes, ok.values(), strict=True):
        r["aim"] = float(f"{reaimed(vlm.runner, recipe, r['aim'], budget / spent):.6g}")  # a refused one stays
    record_variants(folder, [routed])
    got = run_eval(vlm, check, [plain, single["recipe"]], batch_size=batch_size,
                   warmup=False, memory="off", progress=False)  # fmt: skip
    rows = [got.row(label) for label in got.labels[1:]]
    won = rows[0]["accuracy"] > rows[1]["accuracy"]
    routed.update(val_accuracy=rows[0]["accuracy"], val_total_flops=rows[0]["ratio"]["total_flops"],
                  val_items=len(check.records))  # fmt: skip
    record_variants(folder, [routed if won else single])
    return {"recorded": won, "routed_accuracy": rows[0]["accuracy"], "single_accuracy": rows[1]["accuracy"],
            "items": len(check.records), "variant": routed}  # fmt: skip


@torch.no_grad()
def features(vlm, task, batch_size: int) -> torch.Tensor:
    """[N, D] the switch's features of the task's items (`prompt_features` of their embedded prompts)."""
    out = torch.zeros(len(task.records), vlm.adapter.text_config.hidden_size)
    for idx in batches(task, batch_size):
        recs = [task.records[i] for i in idx]
        prepared = vlm.prepare([list(r.images) for r in recs], [r.prompt_text() for r in recs])
        seq = vlm.runner.encode(prepared, Meter(device=vlm.runner.device), None)
        out[idx] = prompt_features(seq).cpu()
    return out


def fit_switch(x: torch.Tensor, agree: torch.Tensor, steps: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [k, D], bias [k]) of the switch argmax(weight @ x + bias) from features `x` [N, D] and `agree`
    [N, k] (route j agrees with the unpruned model on item n). Only items where the routes differ teach it; the
    target is uniform over the agreeing routes. Deterministic (LBFGS from zero)."""
    agree = agree.bool()
    some = agree.any(1) & ~agree.all(1)
    if int(some.sum()) == 0:
        raise InputError("the routes agree with the unpruned model on the same validation items: nothing tells "
                         "them apart (more --n-val, or other selectors)")  # fmt: skip
    xs, target = x[some].detach().double(), agree[some].double()
    target = target / target.sum(1, keepdim=True)
    mean, std = xs.mean(0), xs.std(0).clamp_min(1e-6)
    z = (xs - mean) / std
    w = torch.zeros(agree.shape[1], x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(agree.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

    def loss():
        opt.zero_grad()
        value = -(target * torch.log_softmax(z @ w.T + b, 1)).sum(1).mean() + L2 * (w**2).sum()
        value.backward()
        return value

    opt.step(loss)
    w_raw = (w / std).detach()
    return w_raw.float(), (b - w_raw @ mean).detach().float()
