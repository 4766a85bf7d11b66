"""Router v2's variant per budget: which tokens (`select=`) and which layer price (`price=`) the plain recipe
`router=M:budget=B` runs, chosen on validation items and recorded in the router checkpoint.

The candidates at a budget are the router's own token scores and (when given) the tuned recipe's token method
as `select=`, each at the calibrated price, price 0 and price inf (never skip a layer). Each runs on `n_val`
items of the task's val split after those the router trained and was calibrated on (which would favour its
own choices); the best validation accuracy wins (ties: lower mismatch). Candidates the router refuses (a
budget it cannot reach with that selector) are left out. The test split is never read.

The keep and price are calibrated on the checkpoint's calibration inputs against a predicted prefill cost; what an
input really spends (decode, its own image and prompt lengths) can differ by a few percent. So each candidate
runs once at its budget and once at an `aim` scaled by budget / the total-FLOP ratio it measured there, and the
variant records the aim that was run and the ratio it measured (`val_total_flops`): `router=M:budget=B` then
calibrates for B x aim / budget.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from trimvlm.errors import InputError, TrimVLMError
from trimvlm.evals.run import run_eval
from trimvlm.evals.tasks import get_task
from trimvlm.plan import make_plan
from trimvlm.recipe import parse_method
from trimvlm.router.model import CONFIG, load_router
from trimvlm.training.calibration import seen_inputs

PRICES = ("auto", 0, "inf")
ROUNDS = 2  # validation runs per candidate: at the budget, then at the aim its measured spend asks for


def pick_variant(vlm, router: str, budget: float, method: str | None, task: str = "demo", n_val: int = 96,
                 batch_size: int = 48, name: str | None = None) -> dict:  # fmt: skip
    """{"budget", "select", "price", "aim", "val_total_flops", "val_accuracy", "val_items", "recipe"}: the best
    candidate on validation (each selector at each price of PRICES, at its aim); `recipe` is the recipe that ran
    it, with the router named `name` (as the user gave it; default: `router`)."""
    ok = [r for r in dict.fromkeys(f"router={router}:budget={budget}:select={sel}:price={p}"
                                   for sel in ["router"] + ([method] if method else []) for p in PRICES)
          if _accepted(r, vlm.runner)]  # fmt: skip
    if not ok:
        raise InputError(f"router {router} runs no variant at budget {budget}: every one was refused")
    seen = seen_inputs(load_router(router)[1])
    val = get_task(task, limit=seen + n_val, seed=0, split="val")
    val = replace(val, records=val.records[seen:])
    aims, res = aimed(vlm, val, {r: float(budget) for r in ok}, float(budget), batch_size)
    best = max(ok, key=lambda r: (res.row(aims[r])["accuracy"], -res.row(aims[r])["mismatch_pct"]))
    row = res.row(aims[best])
    opts = parse_method(best).options
    price = opts["price"]
    aim = float(parse_method(aims[best]).options["aim"])
    return {"budget": float(budget), "select": str(opts["select"]), "price": price if price == "auto" else str(price),
            "aim": aim, "val_total_flops": row["ratio"]["total_flops"], "val_accuracy": row["accuracy"],
            "val_items": len(val.records), "recipe": aims[best].replace(f"router={router}:", f"router={name or router}:")}


def aimed(vlm, val, aims: dict, budget: float, batch_size: int, rounds: int = ROUNDS):
    """({candidate: its recipe at the aim found}, the last run): each candidate runs on the validation items at
    its aim in `aims` (pick_variant starts them at the budget), then at that aim scaled by budget / the spend it
    measured (capped at 1; kept where the router refuses that aim), `rounds` runs in all."""
    recipes, res = {}, None
    for _ in range(rounds):
        if res is not None:  # the aim the last run's spend asks for; one the router refuses keeps the one that ran
            aims = {r: reaimed(vlm.runner, r, a, budget / res.row(recipes[r])["ratio"]["total_flops"])
                    for r, a in aims.items()}  # fmt: skip
        recipes = {r: f"{r}:aim={a:.6g}" for r, a in aims.items()}
        res = run_eval(vlm, val, list(recipes.values()), batch_size=batch_size, warmup=False, memory="off",
                       progress=False)  # fmt: skip
    return recipes, res


def reaimed(runner, recipe: str, aim: float, scale: float) -> float:
    """`recipe`'s aim scaled by `scale` (capped at 1), or `aim` as it was where the router refuses the scaled one
    (below what its cheapest layouts cost)."""
    scaled = min(1.0, aim * scale)
    return scaled if _accepted(f"{recipe}:aim={scaled:.6g}", runner) else aim


def _accepted(recipe: str, runner) -> bool:
    """Whether the router takes `recipe` on this model (a budget or aim it cannot reach is refused)."""
    try:
        make_plan(recipe, runner)
        return True
    except TrimVLMError:
        return False


def record_variants(folder, variants: list[dict]) -> None:
    """Write `variants` into the router checkpoint in `folder` (`budget.variants`, replacing earlier ones at
    the same budgets)."""
    path = Path(folder) / CONFIG
    meta = json.loads(path.read_text())
    kept = [v for v in meta["budget"].get("variants", []) if v["budget"] not in {w["budget"] for w in variants}]
    meta["budget"]["variants"] = sorted(kept + variants, key=lambda v: v["budget"])
    path.write_text(json.dumps(meta, indent=2) + "\n")
