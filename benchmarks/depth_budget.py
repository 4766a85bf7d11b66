"""Recipes at matched total-FLOP budgets for the depth benchmark.

Every family has one free knob, the fraction of visual tokens kept; its skipped-layer count is fixed by the
budget. For each budget `TARGET:SKIP` the keep fraction of every family is bisected until the family's total
FLOP ratio (model + method, both probe kinds, against the baseline on the same items) on a calibration set
(the `--task`'s val split, never the test items) is within `--tol` of the target. Families:

- `fastv`: FastV alone (layer 2, no layers skipped: its whole budget goes to tokens);
- `fastv_noise`: noise-perturbed FastV (sigma 0.5, 4 trials: the trials' look-ahead FLOPs are method FLOPs,
  so it keeps fewer tokens at the same budget; where even keep 0.01 exceeds the budget, the file says so and
  leaves it out);
- `fastv+RANKER` for every static ranker (block-influence, sensitivity, greedy-kl from their ranking files;
  tail; random): the naive combination, FastV tokens plus the ranker's SKIP layers;
- `router`: the trained meta-router at SKIP layers (`--router` folder), its own FLOPs included.

The recipes file it writes is what `trimvlm eval --recipes` reads on the test items; the eval's table then
shows the realised ratios (the decode length can differ from the calibration set, so check them: they
should match within 2%).

    python benchmarks/depth_budget.py --model demo --budgets 0.75:1,0.6:2 --router docs/results/router-demo \
        --rankings docs/results/rank-demo-{method}.json --out benchmarks/recipes/depth-matched-demo.yaml
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import yaml

import trimvlm
from trimvlm.errors import TrimVLMError
from trimvlm.evals.run import run_eval
from trimvlm.evals.tasks import get_task

RANKED = ("block-influence", "sensitivity", "greedy-kl")
SHORT = {"block-influence": "bi", "sensitivity": "sens", "greedy-kl": "kl", "tail": "tail", "random": "random"}


def families(skip: int, rankings: str, router: str | None) -> dict[str, callable]:
    """name -> recipe dict for a keep fraction k: FastV alone and noise-perturbed (no layer skipped), with SKIP
    > 0 FastV plus every ranker's SKIP layers (and noise + block influence), and the router when given."""
    fastv, noise = "fastv:keep={k:.4f}:layer=2", "fastv:keep={k:.4f}:layer=2:noise=0.5:trials=4"
    out = {"fastv": lambda k: {"tokens": fastv.format(k=k)}, "fastv_noise": lambda k: {"tokens": noise.format(k=k)}}
    if skip:
        depths = {m: f"ranking:file={rankings.format(method=m)}:budget={skip}:scope=all" for m in RANKED}
        depths |= {"tail": f"tail:budget={skip}:scope=all", "random": f"random:budget={skip}:scope=all:seed=0"}
        for m, d in depths.items():
            out[f"fastv+{SHORT[m]}"] = lambda k, d=d: {"tokens": fastv.format(k=k), "depth": d}
        out["fastv_noise+bi"] = lambda k, d=depths["block-influence"]: {"tokens": noise.format(k=k), "depth": d}
    if router:
        out["router"] = lambda k: {"router": f"{router}:token_keep={k:.4f}:layers_skip={skip}"}
    return out


def ratios(vlm, task, recipes: dict[str, dict], batch_size: int) -> dict[str, float]:
    named = [{"name": n, **r} for n, r in recipes.items()]
    res = run_eval(vlm, task, named, batch_size=batch_size, warmup=False, memory="off", progress=False)
    return {n: res.row(n, "all")["ratio"]["total_flops"] for n in recipes}


def match(vlm, task, fams: dict, target: float, tol: float, batch_size: int, steps: int = 12):
    """(name -> (keep, calibration ratio), name -> its ratio at the smallest keep for the families that cannot
    reach the target at any keep): bisection on keep in [0.01, 1], all families in one eval per step."""
    infeasible = {}
    for n, f in fams.items():  # one at a time: a recipe the model refuses must not stop the others
        try:
            r = ratios(vlm, task, {n: f(0.01)}, batch_size)[n]
        except TrimVLMError as e:
            infeasible[n] = f"refused: {e}"
            continue
        if r > target + tol:
            infeasible[n] = f"total FLOPs {r:.4f}x even at keep 0.01"
    fams = {n: f for n, f in fams.items() if n not in infeasible}
    lo, hi = dict.fromkeys(fams, 0.01), dict.fromkeys(fams, 1.0)
    best: dict[str, tuple[float, float]] = {}
    for _ in range(steps):
        mid = {n: (lo[n] + hi[n]) / 2 for n in fams if n not in best or abs(best[n][1] - target) > tol / 4}
        if not mid:
            break
        got = ratios(vlm, task, {n: fams[n](k) for n, k in mid.items()}, batch_size)
        for n, k in mid.items():
            r = got[n]
            if n not in best or abs(r - target) < abs(best[n][1] - target):
                best[n] = (k, r)
            lo[n], hi[n] = (k, hi[n]) if r < target else (lo[n], k)
    return best, infeasible


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--task", default="demo", help="the calibration task (demo, scenes): its val split")
    ap.add_argument("--budgets", default="0.75:1,0.6:2", help="TARGET:SKIP,... (total FLOP ratio: layers skipped)")
    ap.add_argument("--rankings", default="docs/results/rank-demo-{method}.json")
    ap.add_argument("--router", default=None, help="trained router folder (trimvlm train-router)")
    ap.add_argument("--n", type=int, default=48, help="calibration items (val split)")
    ap.add_argument("--tol", type=float, default=0.01)
    ap.add_argument("--batch-size", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default=None, help="comma-separated family names to match (default: all)")
    ap.add_argument("--steps", type=int, default=12, help="bisection steps per budget")
    ap.add_argument("--quick", action="store_true", help="a smoke test in seconds: 8 items, budget 0.75:1, "
                    "families fastv and fastv+tail, 3 bisection steps, tolerance 0.05")  # fmt: skip
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.quick:
        a.n, a.batch_size, a.budgets, a.only, a.steps, a.tol = 8, 8, "0.75:1", "fastv,fastv+tail", 3, 0.05
    torch.set_num_threads(a.threads)
    vlm = trimvlm.load(a.model)
    task = get_task(a.task, limit=a.n, seed=0, split="val")
    recipes, notes = [], []
    for spec in a.budgets.split(","):
        target, skip = float(spec.split(":")[0]), int(spec.split(":")[1])
        fams = families(skip, a.rankings, a.router)
        if a.only:
            fams = {n: f for n, f in fams.items() if n in a.only.split(",")}
        best, infeasible = match(vlm, task, fams, target, a.tol, a.batch_size, a.steps)
        tag = f"B{round(100 * target)}"
        for n, r in infeasible.items():
            notes.append(f"{tag}_{n}: cannot meet the budget ({r}); not run")
            print(notes[-1], flush=True)
        for n, (k, r) in best.items():
            skipped = 0 if n in ("fastv", "fastv_noise") else skip
            recipes.append({"name": f"{tag}_{n}" + (f"_s{skipped}" if skipped else ""), **fams[n](k)})
            notes.append(f"{tag}_{n}: keep {k:.4f}, calibration total FLOPs {r:.4f}x (target {target})")
            print(notes[-1], flush=True)
    head = "".join(f"# {line}\n" for line in [
        f"Matched total-FLOP budgets, written by benchmarks/depth_budget.py --model {a.model} --task {a.task} "
        f"--budgets {a.budgets}", f"calibrated on {a.n} val items (tolerance {a.tol}); per recipe:", *notes,
    ])  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(head + yaml.safe_dump({"recipes": recipes}, sort_keys=False, width=200))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
