"""The budget table: at each total-FLOP budget, the best tuned static recipe (`trimvlm tune`) against FastV
alone, the best naive FastV + ranker and the meta-router, all in one interleaved `trimvlm eval` on the test split.

Inputs: a tune folder (`--tuned runs/tune-demo`: its best recipe per budget) and a matched-budget recipes file
written by `benchmarks/depth_budget.py` (FastV alone, FastV + every ranker, the router, each bisected to the
budget on the validation split: names `B85_fastv`, `B85_fastv+bi_s1`, `B85_router_s1`...). Every entry shows
overall test accuracy, prefill / full-pipeline mismatch % and the realised total-FLOP ratio, so that "at the
same budget (within 2%)" can be checked in the table itself. Router v2 (the model's shipped v2 router, or
`--router2`) is its plain recipe `router=M:budget=B`: it runs the variant (select=, price=) that
`trimvlm pick-router` chose on validation items and recorded in the checkpoint (the test split is never read
for that choice); a router with no variant recorded runs its own scores at the calibrated price.

    python benchmarks/budget_table.py --model demo --tuned runs/tune-demo \
        --matched benchmarks/recipes/budget-matched-demo.yaml --limit 600 --markdown docs/results/budget-demo.md
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path

import torch
import yaml

import trimvlm
from trimvlm.evals.run import compare, run_eval
from trimvlm.evals.tasks import get_task
from trimvlm.recipe import load_recipes, tuned_recipe

COLUMNS = ("tuned", "fastv", "naive", "router v1", "router v2")


def recipes_for(tuned: Path, matched: Path, router2: str | None = None) -> tuple[list[dict], dict]:
    """(the recipes, budget tag -> column -> the recipe names competing for that cell). `router2`: a v2 router
    (its plain recipe at each budget), or None."""
    rep = json.loads((tuned / "tune.json").read_text())
    recipes, cells = [], {}
    matched_tags = {m.group(1) for r in load_recipes(matched) if (m := re.fullmatch(r"(B\d+)_.+", r.name or ""))}
    for b in rep["budgets"]:
        if b["best"] is None or set(b["budget"]) != {"total_flops"}:
            continue
        tag = f"B{round(100 * b['budget']['total_flops'])}"
        if tag not in matched_tags:  # only the budgets the matched file covers
            continue
        name = f"{tag}_tuned"
        # as `tuned=DIR:total_flops=B` reads it: a ranking file found in DIR/rankings when the folder has moved
        recipes.append(tuned_recipe(f"tuned={tuned}:total_flops={b['budget']['total_flops']}").model_copy(
            update={"name": name}))  # fmt: skip
        cells.setdefault(tag, {}).setdefault("tuned", []).append(name)
        if router2 is not None:
            recipes.append({"name": f"{tag}_router2", "router": f"{router2}:budget={b['budget']['total_flops']}"})
            cells[tag]["router v2"] = [f"{tag}_router2"]
    for r in load_recipes(matched):
        m = re.fullmatch(r"(B\d+)_(.+)", r.name or "")
        if not m:
            continue
        tag, fam = m.groups()
        col = "fastv" if fam == "fastv" else "router v1" if fam.startswith("router") else \
            "naive" if fam.startswith("fastv+") else None  # fmt: skip
        if col is None or tag not in cells:
            continue
        recipes.append({"name": r.name, **{a: str(getattr(r, a)) for a in ("tokens", "kv", "depth", "router")
                                           if getattr(r, a) is not None}})  # fmt: skip
        cells[tag].setdefault(col, []).append(r.name)
    return recipes, cells


def _best(res, names: list[str]) -> str:
    return max(names, key=lambda n: (res.row(n)["accuracy"], -res.row(n)["mismatch_pct"]))


def _cell(res, best: str, tuned: str | None, probes: list[str]) -> dict:
    """One contender's entry: accuracy with its 95% interval, mismatch %, the realised FLOP ratio, and its paired
    difference against the tuned static recipe on the same items."""
    r = res.row(best)
    mm = [res.row(best, p)["mismatch_pct"] for p in probes]
    spec = res.recipes[res.labels.index(best)].model_copy(update={"name": ""}).label()  # every axis that ran
    cell = {"recipe": best, "spec": spec, "accuracy": r["accuracy"], "interval": r["accuracy_interval"],
            "total_flops": r["ratio"]["total_flops"], "mismatch_pct": dict(zip(probes, mm, strict=True))}  # fmt: skip
    if tuned is not None and tuned != best:
        cell["vs_tuned"] = compare(res, best, tuned).as_dict()
    return cell


def table(res, cells) -> list[dict]:
    """A row per budget: each column's best cell against the budget's tuned recipe."""
    rows = []
    probes = [p for p in ("prefill", "full") if any(r["group"] == p for r in res.rows)]
    for tag, cols in cells.items():
        row = {"budget": tag}
        tuned = _best(res, cols["tuned"]) if cols.get("tuned") else None
        for col in COLUMNS:
            if cols.get(col):
                row[col] = _cell(res, _best(res, cols[col]), tuned, probes)
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    """The table's rows as Markdown, each cell naming the exact recipe that produced it."""
    lines = ["| budget | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for row in rows:
        out = [f"{int(row['budget'][1:]) / 100:.2f}x"]
        for e in (row.get(col) for col in COLUMNS):
            iv = e and e["interval"]
            out.append("-" if e is None else f"{100 * e['accuracy']:.1f}% [{100 * iv['low']:.1f}, "
                       f"{100 * iv['high']:.1f}] ({' / '.join(f'{x:.1f}' for x in e['mismatch_pct'].values())}; "
                       f"{e['total_flops']:.3f}x) `{e['spec']}`")  # fmt: skip
        lines.append("| " + " | ".join(out) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tuned", type=Path, help="a trimvlm tune --out folder")
    ap.add_argument("--matched", type=Path, help="benchmarks/depth_budget.py's recipes file")
    ap.add_argument("--router2", default=None, help="a v2 router (default: the model's shipped one, if it is v2), "
                    "run as its plain recipe router=M:budget=B (its variants recorded by trimvlm pick-router)")  # fmt: skip
    ap.add_argument("--task", default="demo", help="the test task (demo, scenes)")
    ap.add_argument("--limit", type=int, default=None, help="test items (default 200; --full: 600)")
    ap.add_argument("--full", action="store_true", help="600 test items, as the docs' tables (about 15 minutes)")
    ap.add_argument("--seed", type=int, default=0, help="the draw of test items (the docs: 0 and 23)")
    ap.add_argument("--batch-size", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="seconds: a tiny tune and depth_budget --quick, 16 items")
    ap.add_argument("--only", default=None, help="budget tags to run, comma-separated (e.g. B45): their rows replace "
                    "those of --json's file (the same model, items and seed); the other rows are kept")  # fmt: skip
    a = ap.parse_args(argv)
    a.limit = a.limit or (600 if a.full else 200)
    torch.set_num_threads(a.threads)
    vlm = trimvlm.load(a.model)
    if a.quick:
        a.tuned, a.matched, a.limit, a.batch_size = _quick(vlm, Path(tempfile.mkdtemp(prefix="budget-table-")))
    recipes, cells = recipes_for(a.tuned, a.matched, a.router2 or _shipped_v2(a.model))
    if a.only:
        only = {t.strip() for t in a.only.split(",")}
        cells = {t: c for t, c in cells.items() if t in only}
        recipes = [r for r in recipes if (r["name"] if isinstance(r, dict) else r.name).split("_")[0] in only]
    res = run_eval(vlm, get_task(a.task, limit=a.limit, seed=a.seed, split="test"), recipes, batch_size=a.batch_size,
                   progress=not a.quick)  # fmt: skip
    out = {"model": a.model, "items": a.limit, "seed": a.seed, "rows": table(res, cells)}
    if a.only and a.json:
        out = _merged(a.json, out)
    md = markdown(out["rows"])
    print(md)
    if a.markdown:
        a.markdown.write_text(md)
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")


def _merged(path: Path, new: dict) -> dict:
    """`path`'s table with the rows of `new` in place of its rows of the same budgets (same model, items, seed)."""
    old = json.loads(path.read_text())
    if [old.get(k) for k in ("model", "items", "seed")] != [new[k] for k in ("model", "items", "seed")]:
        raise SystemExit(f"{path} holds another table (model, items, seed): --only replaces rows of the same draw")
    fresh = {r["budget"]: r for r in new["rows"]}
    return {**old, "rows": [fresh.get(r["budget"], r) for r in old["rows"]]}


def _shipped_v2(model: str) -> str | None:
    from trimvlm.errors import TrimVLMError
    from trimvlm.router.model import load_router

    try:
        return model if "budget" in load_router(model)[1] else None
    except TrimVLMError:
        return None


def _quick(vlm, tmp: Path):
    """A tune at 0.75 on a two-method space and depth_budget's quick file (FastV, FastV + tail at 0.75)."""
    import importlib.util

    from trimvlm.tune import Settings, tune
    from trimvlm.tune.report import write_report

    space = tmp / "space.yaml"
    space.write_text(yaml.safe_dump({"tokens": [{"method": "fastv", "layer": [2]}, {"method": "random", "layer": [0]}],
                                     "combine": ["tokens"]}))  # fmt: skip
    rep = tune(vlm, "demo", ["total_flops=0.75"], space=space, out=tmp / "tune", n_val=16, n_test=8,
               settings=Settings(start=8, batch_size=8), progress=False)  # fmt: skip
    write_report(rep, tmp / "tune")
    spec = importlib.util.spec_from_file_location("depth_budget", Path(__file__).with_name("depth_budget.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--quick", "--out", str(tmp / "matched.yaml")])
    return tmp / "tune", tmp / "matched.yaml", 16, 16


if __name__ == "__main__":
    main()
