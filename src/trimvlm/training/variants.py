"""Router v2's variant per budget: which tokens (`select=`) and which layer price (`price=`) the plain recipe
`router=M:budget=B` runs, chosen on validation items and recorded in the router checkpoint.

The candidates at a budget are the router's own token scores and (when given) the tuned recipe's token method
as `select=`, each at the calibrated price, price 0 and price inf (never skip a layer). Each runs on `n_val`
items of the task's val split after those the router trained and was calibrated on (which would favour its
own choices); the best validation accuracy wins (ties: lower mismatch). Candidates the router refuses (a
budget it cannot reach with that selector) are left out. The test split is never read.
"""

from __future__ import annotations

import json
from dataclasses import replace

PRICES = ("auto", 0, "inf")


def pick_variant(vlm, router: str, budget: float, method: str | None, task: str = "demo", n_val: int = 96,
                 batch_size: int = 48) -> dict:  # fmt: skip
    """{"budget", "select", "price", "val_accuracy", "val_items", "recipe"}: the best candidate on validation (each
    selector at each price of PRICES)."""
    from trimvlm.errors import InputError, TrimVLMError
    from trimvlm.evals.run import run_eval
    from trimvlm.evals.tasks import get_task
    from trimvlm.plan import make_plan
    from trimvlm.recipe import parse_method
    from trimvlm.router.model import load_router
    from trimvlm.training.calibration import seen_inputs

    ok = []
    for r in dict.fromkeys(f"router={router}:budget={budget}:select={sel}:price={p}"
                           for sel in ["router"] + ([method] if method else []) for p in PRICES):  # fmt: skip
        try:
            make_plan(r, vlm.runner)
            ok.append(r)
        except TrimVLMError:
            continue
    if not ok:
        raise InputError(f"router {router} runs no variant at budget {budget}: every one was refused")
    seen = seen_inputs(load_router(router)[1])
    val = get_task(task, limit=seen + n_val, seed=0, split="val")
    res = run_eval(vlm, replace(val, records=val.records[seen:]), ok, batch_size=batch_size, warmup=False,
                   memory="off", progress=False)  # fmt: skip
    best = max(ok, key=lambda r: (res.row(r)["accuracy"], -res.row(r)["mismatch_pct"]))
    opts = parse_method(best).options
    price = opts["price"]
    return {"budget": float(budget), "select": str(opts["select"]), "price": price if price == "auto" else str(price),
            "val_accuracy": res.row(best)["accuracy"], "val_items": len(val.records) - seen, "recipe": best}


def record_variants(folder, variants: list[dict]) -> None:
    """Write `variants` into the router checkpoint in `folder` (`budget.variants`, replacing earlier ones at
    the same budgets)."""
    from pathlib import Path

    from trimvlm.router.model import CONFIG

    path = Path(folder) / CONFIG
    meta = json.loads(path.read_text())
    kept = [v for v in meta["budget"].get("variants", []) if v["budget"] not in {w["budget"] for w in variants}]
    meta["budget"]["variants"] = sorted(kept + variants, key=lambda v: v["budget"])
    path.write_text(json.dumps(meta, indent=2) + "\n")
