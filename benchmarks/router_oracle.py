"""The oracle router beside router v2 and the tuned recipe: how much room a router has at each budget.

The layout space is what router v2 (`router=M:budget=B`) can choose: the token keeps of its checkpoint's cost
table together with the keep it calibrated for each budget, times every skip subset of its candidate layers (at
most its max_skip), the tokens chosen by the `select=` method recorded for that budget (e.g. density@0: that
method's recipe at the keep, its merge included); budgets whose variants select alike share one space. Every
layout runs on every test item in one layout trie per batch of items (training/layout_trie.py), teacher-forced
on the reference answer and its end token, cut to the tokens the task generates for the item; a layout answers
right when the argmax is the reference at every one of them
(training/oracle.py), i.e. greedy decoding gives the reference text.

Costs: per layout its total-FLOP ratio to the unpruned model as the router's own cost table computes it
(training/router.py `flop_table`: the prefill FLOPs `tune.predict` gives for the test items' shapes, vision
tower and LM head included, the tokens reduced at the selector's layer, layers skipped), plus the router's own
FLOPs as a share (`router_share` of the checkpoint: a per-input choice runs the router). The budget tables'
realised ratios also count the few decode steps; for router v2 they land within 0.03 of the budget.

The oracle at budget B: per item its cheapest right layout, the items taken by increasing extra cost while the
mean cost is <= B, the rest at the cheapest layout (optimal: training/oracle.py). `oracle (router keep)`: the
same with the keep fixed at the router's calibrated keep for B (only the layers chosen per input, as router v2
chooses them). Beside them, from a budget table (benchmarks/budget_table.py --json, same --seed and items), the
tuned recipe and router v2 and the router's share of the oracle's gain over the tuned recipe,
(router - tuned) / (oracle - tuned).

    OMP_NUM_THREADS=1 python benchmarks/router_oracle.py --model demo-scenes --task scenes --limit 600 --seed 0 \
        --table docs/results/budget-scenes.json --json docs/results/oracle-scenes.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import trimvlm
from trimvlm.evals.intervals import wilson
from trimvlm.evals.tasks import get_task
from trimvlm.router.route import Router
from trimvlm.training.layout_trie import Layout, run_trie
from trimvlm.training.oracle import answer_target, answers_right, cheapest_right, oracle_at
from trimvlm.training.router import flop_table


def layout_spaces(model: str, budgets: list[float]) -> list[dict]:
    """The router's layouts, one space per `select=` token method its budgets run (each budget's recorded
    variant): {"select", "routers": per budget its Router, "keeps", "subsets", "layer", "share"}."""
    routers = {b: Router(path=model, budget=b) for b in budgets}
    if any(r.select == "router" for r in routers.values()):
        raise SystemExit("the oracle runs a registered select= token method; a budget here runs the router's own scores")
    out = []
    for sel in dict.fromkeys(r.select for r in routers.values()):
        mine = {b: r for b, r in routers.items() if r.select == sel}
        one = next(iter(mine.values()))
        table = one.meta["budget"]
        keeps = sorted({float(k) for k in table["keeps"]} | {round(r.layout()[0], 6) for r in mine.values()})
        out.append({"select": sel, "routers": mine, "keeps": keeps, "subsets": [tuple(s) for s in table["subsets"]],
                    "layer": one.selector(0.5).layer, "share": float(table.get("router_share", 0))})  # fmt: skip
    return out


def measure(vlm, task, layouts: list[Layout], reducer, layer: int, batch: int) -> torch.Tensor:
    """[N, M] bool: whether each layout answers each item right."""
    stop = vlm.stop_ids()[0]
    out = []
    recs = task.records
    for a in range(0, len(recs), batch):
        part = recs[a : a + batch]
        prep = vlm.prepare([list(r.images) for r in part], [r.prompt_text() for r in part])
        targets = [answer_target(torch.tensor(vlm.tokenizer(r.answers[0], add_special_tokens=False)["input_ids"]),
                                 stop, task.new_tokens(r.probe, r.kind)) for r in part]  # fmt: skip
        got = run_trie(vlm.runner, prep, targets, None, layouts, layer, keep_logits=True, reducer=reducer)
        for b, t in enumerate(targets):
            out.append(answers_right(got.logits[got.leaf[b], -len(t) :], t))
        print(f"  {min(a + batch, len(recs))}/{len(recs)} items", flush=True)
    return torch.stack(out)


def _acc(o) -> dict:
    """An oracle's cell: accuracy with its Wilson interval and mean cost (None: the budget is out of reach)."""
    if not o.reached:
        return {
            "accuracy": None,
            "right": None,
            "mean_cost": o.mean_cost,
            "text": f"out of reach ({o.mean_cost:.3f}x)",
        }
    iv = wilson(o.right, o.n)
    return {"accuracy": o.accuracy, "low": iv.low, "high": iv.high, "right": o.right, "mean_cost": o.mean_cost,
            "text": f"{100 * o.accuracy:.1f}% [{100 * iv.low:.1f}, {100 * iv.high:.1f}]"}  # fmt: skip


def rows(right, cost, space: dict, layouts: list[Layout], table: dict | None) -> list[dict]:
    """One row per budget: the oracle, the oracle at the router's keep, the tuned recipe, router v2 and the
    router's share of the oracle's gain."""
    cells = {r["budget"]: r for r in (table or {}).get("rows", [])}
    out = []
    for b, router in space["routers"].items():
        o = oracle_at(right, cost, b)
        at = torch.tensor([abs(m.keep - round(router.layout()[0], 6)) < 1e-9 for m in layouts])
        ok = oracle_at(right[:, at], cost[at], b)
        row = {"budget": b, "oracle": _acc(o), "oracle_router_keep": _acc(ok) | {"keep": router.layout()[0]}}
        ref = cells.get(f"B{round(100 * b)}")
        out.append(row if ref is None else row | from_table(ref, o.accuracy))
    return out


def from_table(ref: dict, oracle: float | None) -> dict:
    """A row's fields read from the budget table's cell `ref`: the tuned recipe, router v2 and the router's
    share of the oracle's gain over the tuned recipe."""
    tuned, r2 = ref["tuned"], ref["router v2"]
    gain = None if oracle is None else oracle - tuned["accuracy"]
    return {"tuned": {"accuracy": tuned["accuracy"], "total_flops": tuned["total_flops"], "spec": tuned["spec"]},
            "router": {"accuracy": r2["accuracy"], "total_flops": r2["total_flops"]},
            "share": (r2["accuracy"] - tuned["accuracy"]) / gain if gain and gain > 0 else None}  # fmt: skip


def refresh(path: Path, table: dict) -> None:
    """Rewrite the table's fields of the oracle file `path` (measured before) from a newer budget table of the
    same draw: nothing is measured again."""
    out = json.loads(path.read_text())
    cells = {r["budget"]: r for r in table["rows"]}
    for row in out["rows"]:
        row.update(from_table(cells[f"B{round(100 * row['budget'])}"], row["oracle"]["accuracy"]))
    path.write_text(json.dumps(out, indent=2) + "\n")


def distribution(right, cost) -> dict:
    """The items' cheapest right layout costs: quantiles, and how many have none."""
    c = cheapest_right(right, cost)
    some = c[c.isfinite()]
    qs = (0.1, 0.25, 0.5, 0.75, 0.9)
    return {"none_right": int((~c.isfinite()).sum()), "mean": float(some.mean()) if len(some) else None,
            "quantiles": {str(q): float(some.quantile(q)) for q in qs} if len(some) else {},
            "at_or_below": {str(b): int((c <= b).sum()) for b in (0.3, 0.45, 0.6, 0.75, 1.0)}}  # fmt: skip


def by_kind(right, task, full: int) -> dict:
    """Per question kind: its items, the share the unpruned layout answers right and the share some layout does
    (where the oracle's lead over the unpruned model comes from)."""
    out = {}
    for kind in dict.fromkeys(r.kind for r in task.records):
        idx = [i for i, r in enumerate(task.records) if r.kind == kind]
        sub = right[idx]
        out[kind] = {"n": len(idx), "unpruned": float(sub[:, full].float().mean()),
                     "some_layout": float(sub.any(1).float().mean())}  # fmt: skip
    return out


def _right(a, vlm, task, layouts, space) -> tuple[torch.Tensor, float]:
    """Per item and layout, whether it answers right, and the seconds per item: read from `--right`'s file for
    this selector when it exists, else measured (and written there)."""
    path = None if a.right is None else a.right.with_name(f"{a.right.stem}-{space['select']}{a.right.suffix}")
    if path is not None and path.exists():
        got = torch.load(path)
        return got["right"], got["seconds_per_item"]
    selector = next(iter(space["routers"].values())).selector
    start = time.perf_counter()
    right = measure(vlm, task, layouts, selector, space["layer"], a.batch)
    per_item = (time.perf_counter() - start) / len(task.records)
    if path is not None:
        torch.save({"right": right, "seconds_per_item": per_item}, path)
    return right, per_item


def group(a, vlm, task, space: dict, table: dict | None) -> tuple[dict, list[dict]]:
    """One selector's layout space measured: (its summary, its budgets' rows)."""
    layouts = [Layout(k, 0, frozenset(s)) for k in space["keeps"] for s in space["subsets"]]
    grid = flop_table(vlm, task.records, space["keeps"], space["subsets"], space["layer"], a.eval_batch)
    by = grid["cost_by_layer"][str(space["layer"])]
    cost = torch.tensor([c + space["share"] for row in by for c in row], dtype=torch.float64)  # keep-major
    right, per_item = _right(a, vlm, task, layouts, space)
    full = next(i for i, m in enumerate(layouts) if m.keep >= 1 and not m.skip)
    summary = {"select": space["select"], "budgets": list(space["routers"]), "seconds_per_item": per_item,
               "keeps": space["keeps"], "subsets": [list(s) for s in space["subsets"]], "layouts": len(layouts),
               "cost": cost.tolist(), "unpruned_right": int(right[:, full].sum()),
               "by_kind": by_kind(right, task, full), "cheapest_right": distribution(right, cost)}  # fmt: skip
    return summary, [r | {"select": space["select"]} for r in rows(right, cost, space, layouts, table)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo-scenes")
    ap.add_argument("--task", default="scenes")
    ap.add_argument("--limit", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0, help="the draw of test items (as budget_table.py's)")
    ap.add_argument("--budgets", default="0.75,0.6,0.45")
    ap.add_argument(
        "--table", type=Path, default=None, help="budget_table.py's JSON for the same seed and items"
    )
    ap.add_argument("--batch", type=int, default=12, help="items per layout trie")
    ap.add_argument(
        "--eval-batch", type=int, default=100, help="the eval's batch size (its padding) for the costs"
    )
    ap.add_argument("--right", type=Path, default=None, help="a .pt file of the items' right layouts, one per selector "
                    "(NAME-SELECT.pt): read when it exists (nothing measured), else written")  # fmt: skip
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="a smoke test in seconds: 4 items, one budget")
    ap.add_argument("--refresh", action="store_true", help="only rewrite --json's tuned, router v2 and share "
                    "from --table (a newer budget table of the same draw); nothing is measured")  # fmt: skip
    a = ap.parse_args(argv)
    if a.refresh:
        return refresh(a.json, json.loads(a.table.read_text()))
    if a.quick:
        a.limit, a.batch, a.eval_batch, a.budgets, a.right = 4, 4, 4, "0.6", None
    torch.set_num_threads(a.threads)
    vlm = trimvlm.load(a.model)
    spaces = layout_spaces(a.model, [float(b) for b in a.budgets.split(",")])
    task = get_task(a.task, limit=a.limit, seed=a.seed, split="test")
    table = json.loads(a.table.read_text()) if a.table else None
    if table is not None and (table.get("items") != a.limit or table.get("seed", 0) != a.seed):
        print(
            f"note: {a.table} holds {table.get('items')} items of seed {table.get('seed', 0)}, not {a.limit} of {a.seed}"
        )
    groups, out_rows = [], []
    for space in spaces:
        summary, got = group(a, vlm, task, space, table)
        groups.append(summary)
        out_rows += got
    out = {"model": a.model, "task": a.task, "seed": a.seed, "items": len(task.records), "threads": a.threads,
           "groups": groups, "rows": sorted(out_rows, key=lambda r: -r["budget"])}  # fmt: skip
    print(json.dumps(out["rows"], indent=1), "\n" + ", ".join(f"{g['select']}: {g['seconds_per_item']:.2f} s per item"
                                                             for g in groups))  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
