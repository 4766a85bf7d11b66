"""The one harness: a list of recipes over one task's items (generation records, candidate items, any item of
trimvlm.evals.items' protocol), interleaved batch by batch in one process.

- The uncompressed baseline (the empty recipe, labelled "baseline") is always run, and first in the results.
- Items are grouped by their `batch_key` (probe, kind, generation cap) and cut into batches of `batch_size`.
- Timing fairness: for each batch every recipe runs, the first recipe rotating from batch to batch, so warm
  caches, thermal state and background load fall on every recipe alike. An untimed warm-up call of every
  recipe on two items runs first; each batch's untimed work (the vision-FLOP count of a new input shape, a
  candidate batch's first call) runs before its recipes, outside every timing.
- Costs come from each call's `Costs` (the cost meter), accumulated per (probe, kind) by `CostAcc`: sums over
  the group's batches, `per_item` divides by its items, `ratio` by the baseline's sum on the same items (None
  where the baseline's is 0). Peak memory is the largest over the measured batches.
- Results per recipe for every kind, every probe and "all" (`rows`): accuracy (the mean of the items' scores),
  mismatch % and agreement vs the baseline, retention (accuracy / the baseline's; over several kinds the
  unweighted mean of the kinds' ratios, a kind the baseline gets 0% on left out), the item kind's extras
  (yes/no F1, abstentions) in every group of one metric. Per recipe with a depth method: what it skips, and per
  ranker the largest tested budget whose retention reaches 90% (`largest_budgets`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from trimvlm.errors import InputError, RecipeError
from trimvlm.evals.intervals import accuracy_interval, paired_difference
from trimvlm.evals.items import ItemsRun, RunOptions
from trimvlm.evals.tasks import GROUP_PROBES, PROBES, Task, check_limit, check_positive, get_task
from trimvlm.plan import build_methods, make_plan
from trimvlm.progress import steps
from trimvlm.recipe import Recipe, parse_recipe

SUM_KEYS = (
    "prefill_flops",  # the model's (vision included)
    "decode_flops",
    "branch_flops",  # candidate branches (their LM-head projections included)
    "method_prefill_flops",  # the methods' own work (selection, probes, merges), its own line
    "method_decode_flops",
    "method_flops",
    "total_flops",  # model + method
    "kv_bytes",  # KV held at the prefill/decode boundary, after any eviction
    "kv_bytes_peak",  # the most KV each call held (a cache before its eviction counts)
    "latency_s",  # the meter's timed phases
    "branch_s",
    "wall_s",  # the whole call, preprocessing included
)
RATIO_KEYS = SUM_KEYS + ("peak_memory_bytes",)
RETENTION_TARGET = 0.9
ORDER = "interleaved: every recipe on each batch, rotating the first recipe batch by batch"


def normalize_recipes(recipes: Sequence[str | dict | Recipe] | None) -> list[Recipe]:
    """Parse and validate recipes; the baseline (empty recipe labelled "baseline") is included and first."""
    parsed = [parse_recipe(r) for r in (recipes or [])]
    for r in parsed:
        build_methods(r)  # unknown methods / options fail now, before any model runs
    base = [i for i, r in enumerate(parsed) if r.is_baseline and r.label() == "baseline"]
    parsed.insert(0, parsed.pop(base[0]) if base else Recipe(name="baseline"))
    labels = [r.label() for r in parsed]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise RecipeError(f"duplicate recipe label(s) {dupes}: give each recipe a distinct name")
    return parsed


class CostKey(NamedTuple):
    """What the costs of a recipe are summed by: the items' probe and kind."""

    probe: str
    kind: str


@dataclass
class CostAcc:
    """The one cost accumulator: sums of one recipe's calls over a set of items."""

    n: int = 0
    batches: int = 0
    sums: dict = field(default_factory=lambda: dict.fromkeys(SUM_KEYS, 0.0))
    peak_memory_bytes: int = 0
    peak_memory_kind: str = ""
    executors: set = field(default_factory=set)

    def add(self, costs, n_items: int, wall_s: float, executor: str = "") -> None:
        """One call's `Costs` on `n_items` items, `wall_s` its whole call."""
        seconds = costs.seconds
        values = {"prefill_flops": costs.prefill_flops, "decode_flops": costs.decode_flops,
                  "branch_flops": costs.flops.get("branch", 0), "method_prefill_flops": costs.method_prefill_flops,
                  "method_decode_flops": costs.method_decode_flops, "method_flops": costs.method_total_flops,
                  "total_flops": costs.total_flops, "kv_bytes": costs.kv_bytes, "kv_bytes_peak": costs.kv_bytes_peak,
                  "latency_s": sum(seconds.values()), "branch_s": seconds.get("branch", 0.0), "wall_s": wall_s}  # fmt: skip
        self.merge(CostAcc(n_items, 1, values, executors={executor} - {""}))
        self.memory(costs)

    def memory(self, costs) -> None:
        """Take the peak memory of a call (or of another accumulator) that measured it (a timed CPU call does
        not)."""
        if costs.peak_memory_kind in ("", "not_measured"):
            self.peak_memory_kind = self.peak_memory_kind or costs.peak_memory_kind
            return
        self.peak_memory_bytes = max(self.peak_memory_bytes, costs.peak_memory_bytes)
        self.peak_memory_kind = costs.peak_memory_kind

    def merge(self, other: CostAcc) -> None:
        self.n += other.n
        self.batches += other.batches
        for k in SUM_KEYS:
            self.sums[k] += other.sums[k]
        self.memory(other)  # its peak, as a call's
        self.executors |= other.executors

    def as_dict(self) -> dict:
        sums = {k: (v if k.endswith("_s") else int(v)) for k, v in self.sums.items()}
        per_item = {k: (v / self.n if self.n else 0.0) for k, v in self.sums.items()}
        return {"items": self.n, "batches": self.batches, "sum": sums, "per_item": per_item,
                "max": {"peak_memory_bytes": self.peak_memory_bytes}, "peak_memory_kind": self.peak_memory_kind,
                "executor": ",".join(sorted(self.executors))}  # fmt: skip


@dataclass
class EvalResult:
    task: Task
    recipes: list[Recipe]
    predictions: list[list]  # [recipe][item]: a text, a chosen candidate...
    scores: list[list[float]]  # [recipe][item]
    rows: list[dict]  # one per (recipe, group)
    settings: dict
    depths: list[dict | None]  # per recipe: what its depth axis skips
    costs: list[dict] = field(default_factory=list, repr=False)  # per recipe: CostKey -> CostAcc

    @property
    def labels(self) -> list[str]:
        return [r.label() for r in self.recipes]

    def row(self, recipe: str, group: str = "all") -> dict:
        for r in self.rows:
            if r["recipe"] == recipe and r["group"] == group:
                return r
        raise KeyError((recipe, group))

    @property
    def items(self) -> list[dict]:
        """Each item's kind and probe (what `compare` groups by), as a saved result holds them."""
        return [{"kind": rec.kind, "probe": rec.probe} for rec in self.task.records]

    @property
    def largest_budget(self) -> dict:
        return largest_budgets([self.row(lb) for lb in self.labels], self.depths)

    def to_dict(self) -> dict:
        t = self.task
        return {
            "task": {"name": t.name, "items": len(t.records), "kinds": t.kinds(), **t.info},
            "settings": self.settings,
            "recipes": [{"label": r.label(), "recipe": r.model_dump(exclude_none=True), "depth": d}
                        for r, d in zip(self.recipes, self.depths, strict=True)],  # fmt: skip
            "results": self.rows,
            "largest_budget_90": self.largest_budget,
            "items": [rec.as_json() for rec in t.records],
            "predictions": {label: {"outputs": p, "scores": s}
                            for label, p, s in zip(self.labels, self.predictions, self.scores, strict=True)},  # fmt: skip
        }


def grouped(items, key) -> dict[tuple, list[int]]:
    """The items' indices by `key(item)`, in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(key(item), []).append(i)
    return groups


def batches(task: Task, batch_size: int) -> list[list[int]]:
    """Item indices per batch: grouped by the items' batch key in order of first appearance, cut to size."""
    groups = grouped(task.records, lambda r: (type(r).__name__, *r.batch_key(task)))
    return [idx[b : b + batch_size] for idx in groups.values() for b in range(0, len(idx), batch_size)]


def run_eval(
    vlm,
    task: Task | str,
    recipes: Sequence[str | dict | Recipe] | None = None,
    *,
    limit: int | None = None,
    batch_size: int = 16,
    seed: int = 0,
    max_new_tokens: int | None = None,
    readout: str = "auto",
    executor: str = "auto",
    warmup: bool = True,
    memory: str = "first",
    progress: bool = True,
    console=None,
    data: str | None = None,
    split: str | None = None,
    order_offset: int = 0,
) -> EvalResult:
    """Run every recipe (baseline first) over the task's items, interleaved batch by batch.

    `readout` / `executor`: how candidate items are scored (vlm.score). `memory`: where peak memory comes from.
    On CUDA every timed call reads the allocator's peak. On CPU the tensor tracker would slow the timed calls,
    so peak memory is measured in separate, untimed calls on the same batches: `first` (default) the first
    batch of each probe kind, `all` every batch, `off` none (reported as not measured). `data` / `split`: the
    local copy a benchmark task named by a string is read from (see `get_task`). `order_offset`: the recipe
    order of batch b is the one of batch b + order_offset (a shard of a sharded run,
    trimvlm.integrations.ray_eval)."""
    task = prepare_task(task, limit=limit, seed=seed, max_new_tokens=max_new_tokens, data=data, split=split,
                        progress=progress, memory=memory, batch_size=batch_size)  # fmt: skip
    recipes = normalize_recipes(recipes)
    opts = RunOptions(seed=seed, readout=readout, executor=executor)
    for cls in dict.fromkeys(type(r) for r in task.records):  # checks of every item kind, before any item runs
        opts = cls.prepare(vlm, task.records, task, opts)
    depths = [depth_info(r, vlm) for r in recipes]  # bad budgets / ranking files fail before any run
    device = getattr(getattr(vlm, "runner", None), "device", None)  # None: a stand-in without a runner
    on_cpu = device is not None and device.type != "cuda"  # CUDA: the allocator's peak of every timed call
    preds, accs = run_batches(vlm, task, recipes, batches(task, batch_size), opts, warmup=warmup,
                              memory=memory if on_cpu else "off", progress=progress, console=console,
                              order_offset=order_offset)  # fmt: skip
    settings = {"seed": seed, "batch_size": batch_size, "max_new_tokens": task.max_new_tokens,
                "prefill_tokens": task.prefill_tokens, "kind_max_new_tokens": task.kind_max_new_tokens,
                "readout": opts.readout, "executor": opts.executor, "warmup": warmup, "order": ORDER,
                "memory": memory if device is None or device.type != "cuda" else "every call (CUDA allocator)",
                "model": _model_info(vlm)}  # fmt: skip
    return finish(task, recipes, preds, accs, settings, depths)


def run_batches(vlm, task, recipes, batch_list, opts, *, warmup, memory, progress, console, order_offset):
    """The interleaved loop: per batch its untimed work, then every recipe (the first rotating), and the
    untimed memory calls `memory` asks for; returns the outputs [recipe][item] and per recipe the cost
    accumulators by (probe, kind)."""
    records = task.records
    n_rec = len(recipes)
    preds: list[list] = [[None] * len(records) for _ in recipes]
    accs: list[dict[CostKey, CostAcc]] = [{} for _ in recipes]
    measured: set[tuple] = set()

    def call(r: int, idx: list[int], track: bool = False) -> ItemsRun:
        items = [records[i] for i in idx]
        return type(items[0]).run(vlm, items, recipes[r], task, opts, track_memory=track)

    with steps(f"eval {task.name}", len(batch_list) * n_rec, console, progress, unit="batch") as bar:
        for r in range(n_rec) if warmup else ():  # untimed: one-time costs (lazy init, allocator growth) fall here
            bar.phase(f"warm-up: {recipes[r].label()}")
            call(r, batch_list[0][:2])
        for b, idx in enumerate(batch_list):
            first = records[idx[0]]
            key = CostKey(first.probe, first.kind)
            type(first).untimed(vlm, [records[i] for i in idx], task, opts)
            for j in range(n_rec):
                r = (b + order_offset + j) % n_rec  # rotate which recipe goes first
                bar.phase(f"{recipes[r].label()} · {first.kind} ({first.probe})")
                t0 = time.perf_counter()
                run = call(r, idx)
                seconds = time.perf_counter() - t0
                for i, out in zip(idx, run.outputs, strict=True):
                    preds[r][i] = out
                acc = accs[r].setdefault(key, CostAcc())
                acc.add(run.costs, len(idx), seconds, run.executor)
                if memory == "all" or (memory == "first" and (r, key.probe) not in measured):
                    acc.memory(call(r, idx, track=True).costs)  # untimed
                    measured.add((r, key.probe))
                bar.advance()
    return preds, accs


def finish(task, recipes, preds, accs, settings, depths) -> EvalResult:
    """Scores and result rows from the outputs and cost sums (a sharded run merges those first)."""
    scores = [[rec.score(p) for p, rec in zip(pr, task.records, strict=True)] for pr in preds]
    rows = result_rows(task, recipes, preds, scores, accs)
    return EvalResult(task=task, recipes=recipes, predictions=preds, scores=scores, rows=rows, settings=settings,
                      costs=accs, depths=depths)  # fmt: skip


def prepare_task(task: Task | str, *, limit=None, seed=0, max_new_tokens=None, data=None, split=None,
                 progress=True, memory="first", batch_size=16) -> Task:  # fmt: skip
    """run_eval's argument checks, then the task it runs: built by name (or cut to `limit`), with
    `max_new_tokens` as its one cap."""
    if memory not in ("first", "all", "off"):
        raise InputError(f"memory must be one of first, all, off; got {memory!r}")
    check_positive("batch_size", batch_size)
    check_positive("max_new_tokens", max_new_tokens, optional=True)
    if not isinstance(task, str) and (data is not None or split is not None):
        raise InputError("data and split apply to a task given by name; this task is already built")
    if isinstance(task, str):
        task = get_task(task, limit=limit, seed=seed, data=data, split=split, progress=progress)
    elif limit is not None:
        task = replace(task, records=task.records[: check_limit(limit)])
    if not task.records:
        raise InputError(f"task {task.name!r} has no items")
    if max_new_tokens is not None:  # one cap for every full-pipeline item
        if not any(r.probe in PROBES for r in task.records):
            raise InputError(f"max_new_tokens does not apply to the candidate task {task.name!r} (nothing is "
                             "generated)")  # fmt: skip
        task = replace(task, max_new_tokens=max_new_tokens, kind_max_new_tokens={})
    return task


def _model_info(vlm) -> dict:
    info = {}
    with suppress(Exception):  # a stand-in model without info()
        info = dict(vlm.info())
    folder = getattr(getattr(vlm, "adapter", None), "folder", None)
    if folder is not None:
        info["folder"] = str(folder)
    return info


def depth_info(recipe: Recipe, vlm) -> dict | None:
    """What a recipe's depth axis skips: method, budget, ranker key, the layers skipped per phase."""
    if recipe.depth is None or getattr(vlm, "runner", None) is None:
        return None
    spec = recipe.depth
    # the ranker: the method and its options other than the budget (the default scope `candidates` unnamed)
    opts = {k: v for k, v in spec.options.items() if k != "budget" and (k, v) != ("scope", "candidates")}
    shown = [f"{k}={Path(str(v)).name if k == 'file' else v}" for k, v in sorted(opts.items())]
    others = [f"{a}={getattr(recipe, a)}" for a in ("tokens", "kv") if getattr(recipe, a) is not None]
    ranker = spec.method + (f"[{', '.join(shown)}]" if shown else "") + "".join(f"+{o}" for o in others)
    plan = make_plan(recipe, vlm.runner)
    return {"method": spec.method, "budget": spec.options.get("budget", 0), "ranker": ranker,
            "skipped_branch": sorted(plan.skip_branch), "skipped_prefill": sorted(plan.skip_prefill)}  # fmt: skip


def _groups(task: Task) -> list[tuple[str, str, list[int]]]:
    """(name, type, item indices): every kind, every probe present, then all."""
    probes = grouped(task.records, lambda r: r.probe)
    kinds = [(k, "kind", idx) for k, idx in grouped(task.records, lambda r: r.kind).items()]
    return [*kinds, *((p, "probe", probes[p]) for p in GROUP_PROBES if p in probes),
            ("all", "all", list(range(len(task.records))))]  # fmt: skip


def result_rows(task: Task, recipes, preds, scores, accs) -> list[dict]:
    records, kinds = task.records, task.kinds()
    rows, base_costs = [], {}
    for r, recipe in enumerate(recipes):
        for name, gtype, idx in _groups(task):
            acc = CostAcc()
            for (probe, kind), part in accs[r].items():
                if gtype == "all" or name == (kind if gtype == "kind" else probe):
                    acc.merge(part)
            costs = acc.as_dict()
            base = base_costs.setdefault(name, costs)
            ratio = {}
            for key in RATIO_KEYS:
                num, den = (c["sum"].get(key, c["max"].get(key)) for c in (costs, base))
                ratio[key] = (num / den) if den else None
            metrics = sorted({records[i].metric for i in idx})
            same = sum(records[i].canonical(preds[r][i]) == records[i].canonical(preds[0][i]) for i in idx)
            mine = [scores[r][i] for i in idx]
            row = {"recipe": recipe.label(), "group": name, "group_type": gtype,
                   "probe": name if gtype == "probe" else (kinds[name]["probe"] if gtype == "kind" else "mixed"),
                   "metric": metrics[0] if len(metrics) == 1 else "mixed", "n": len(idx),
                   "accuracy": sum(mine) / len(idx),
                   "mismatch_pct": 100.0 * (len(idx) - same) / len(idx), "agreement": same / len(idx),
                   "retention": _retention(task, scores, r, idx), "costs": costs, "ratio": ratio,
                   "accuracy_interval": accuracy_interval(mine).as_dict()}  # fmt: skip
            if r > 0:  # paired against the baseline on the same items
                row["vs_baseline"] = paired_difference(mine, [scores[0][i] for i in idx], resamples=2000).as_dict()
            if len(metrics) == 1:  # a task-level summary (POPE's F1, abstentions) of every one-metric group
                row.update(type(records[idx[0]]).summary([records[i] for i in idx], [preds[r][i] for i in idx]))
            rows.append(row)
    return rows


def compare(result, a: str, b: str, group: str = "all"):
    """`a` against `b` on the same items of `group` (an `EvalResult` or a saved one's dict-like `SavedResult`):
    the paired difference of their scores, its interval and p-value."""
    labels = list(result.labels)
    for name in (a, b):
        if name not in labels:
            raise InputError(f"no recipe {name!r} in this result; it holds: {', '.join(labels)}")
    idx = group_items(result, group)
    sa, sb = (result.scores[labels.index(n)] for n in (a, b))
    return paired_difference([sa[i] for i in idx], [sb[i] for i in idx])


def row_interval(result, label: str, group: str = "all") -> dict | None:
    """A row's accuracy interval: the one it holds, else made from the result's saved per-item scores (results
    written before rows carried intervals); None where neither is there."""
    held = result.row(label, group).get("accuracy_interval")
    scores = result.scores[result.labels.index(label)] if label in result.labels else None
    if held is not None or not scores or not result.items:
        return held
    return accuracy_interval([scores[i] for i in group_items(result, group)]).as_dict()


def group_items(result, group: str) -> list[int]:
    """The item indices of a group ("all", a kind or a probe) of a result's task."""
    records = result.items
    if group == "all":
        return list(range(len(records)))
    idx = [i for i, rec in enumerate(records) if group in (rec["kind"], rec["probe"])]
    if not idx:
        kinds = sorted({rec["kind"] for rec in records} | {rec["probe"] for rec in records})
        raise InputError(f"no group {group!r}; groups: all, {', '.join(kinds)}")
    return idx


def _retention(task: Task, scores, r: int, idx: list[int]) -> float | None:
    """The unweighted mean over the kinds in `idx` of accuracy / the baseline's (kinds at 0% left out)."""
    ratios = []
    for kind in dict.fromkeys(task.records[i].kind for i in idx):
        of = [i for i in idx if task.records[i].kind == kind]
        a, a0 = (sum(scores[k][i] for i in of) for k in (r, 0))
        if a0 > 0:
            ratios.append(a / a0)
    return sum(ratios) / len(ratios) if ratios else None


def largest_budgets(rows: list[dict], depths: list, target: float = RETENTION_TARGET) -> dict[str, dict]:
    """Per ranker: the largest tested budget whose retention reaches `target` (None when none does); `rows`
    one per recipe (its "all" row), `depths` what each recipe's depth axis skips (None: no depth method)."""
    out: dict[str, dict] = {}
    for row, d in zip(rows, depths, strict=True):
        if d is None:
            continue
        entry = out.setdefault(d["ranker"], {"budget": None, "retention": None, "tested": []})
        entry["tested"].append(d["budget"])
        ret = row["retention"]
        if ret is not None and ret >= target and (entry["budget"] is None or d["budget"] > entry["budget"]):
            entry["budget"], entry["retention"], entry["recipe"] = d["budget"], ret, row["recipe"]
    for entry in out.values():
        entry["tested"] = sorted(set(entry["tested"]))
    return out
