"""`trimvlm.tune(vlm, task, budgets)`: the best recipe for each cost budget, found on the validation split
(docs/tune.md describes the search). For every budget point (`tune.budgets`) and every family of the space
(`tune.space`):
1. **Prediction first.** The family's token `keep` is bisected on the predicted costs (`tune.predict`) over all
   the validation items; a family over budget even at the lowest keep is skipped before it runs. With a beam,
   round 0 runs the one-axis families first and the joint families are formed with its B best token families.
2. **Successive halving.** Round r runs the survivors on the first n_r items of a seeded permutation in one
   interleaved `run_eval` call with the baseline; a measured ratio is projected to all the validation items; a
   candidate over budget gets its keep re-bisected (at most `corrections` times), then it is dropped; the best
   1 / eta go on.
3. **Frontier.** The non-dominated last-round candidates per cost axis and each point's best are evaluated once
   on the test split (read only here).
Seeded (the item permutation), resumable (`tune.journal`), with a progress bar.
"""

from __future__ import annotations

import math
import random
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from trimvlm.depth.base import model_fingerprint
from trimvlm.errors import InputError, TrimVLMError
from trimvlm.evals.plot import Point, pareto_front
from trimvlm.evals.run import batches
from trimvlm.evals.tasks import TASKS, get_task
from trimvlm.plan import build_methods, make_plan
from trimvlm.progress import steps
from trimvlm.tune.budgets import RESULT_KEY, budget_points, fits, label
from trimvlm.tune.journal import Journal, spec_of
from trimvlm.tune.predict import predict, read_shapes
from trimvlm.tune.rankings import calibrate_rankings
from trimvlm.tune.space import Family, Space, load_space

FRONTIER_AXES = ("total_flops", "kv_bytes", "latency_s")


@dataclass
class Candidate:
    family: Family
    keep: float | None = None
    row: dict | None = None  # its measured row on the round's items
    offset: dict = field(default_factory=dict)  # axis -> measured - predicted ratio
    note: str = ""

    @property
    def recipe(self) -> dict:
        return self.family.recipe(self.keep, name=self.spec)

    @property
    def spec(self) -> str:
        return spec_of(self.family.recipe(self.keep))


@dataclass
class Settings:
    start: int = 24
    eta: int = 3
    tol: float = 0.01
    corrections: int = 3
    steps: int = 14
    batch_size: int = 48


class Search:
    def __init__(self, vlm, val, space: Space, journal: Journal, settings: Settings):
        self.vlm, self.val, self.space, self.journal, self.s = vlm, val, space, journal, settings
        self._shapes: dict[str, list] = {}
        self._pred: dict[tuple, object] = {}
        self.skipped: list[dict] = []  # (point, family, why): never run
        self.dropped: list[dict] = []  # (point, family, why): run, then left out (measured over budget)
        self.considered = 0
        self.full: list[int] | None = None  # all the validation items: the budget's item set (set by `point`)
        self.left_out = 0  # joint families the beam did not form (considered, never run)

    def shapes(self, idx):
        key = self.journal.items_key(idx)
        if key not in self._shapes:
            task = replace(self.val, records=[self.val.records[i] for i in idx])
            self._shapes[key] = read_shapes(self.vlm, task, batches(task, self.s.batch_size))
        return self._shapes[key]

    def predicted(self, recipe: dict, idx) -> dict | None:
        """Predicted ratios (result keys) of a recipe on the items `idx`, against the baseline's prediction;
        total FLOPs from the prefill prediction plus the baseline's measured decode. None: not predictable."""
        shapes = self.shapes(idx)
        if shapes is None:
            return None
        ik = self.journal.items_key(idx)
        p, base = self._predict(recipe, ik, shapes), self._predict({}, ik, shapes)  # each once per item set
        if p is None:
            return None
        bsum = self.journal.run([], idx)["baseline"]["sum"]
        extra = bsum["total_flops"] - bsum["prefill_flops"]
        return {"prefill_flops": p.prefill_flops / base.prefill_flops, "kv_bytes": p.kv_bytes / base.kv_bytes,
                "total_flops": (p.prefill_flops + extra) / bsum["total_flops"]}  # fmt: skip

    def _predict(self, recipe: dict, ik: str, shapes):
        """`predict` of the recipe (else of its `proxy`) on the item set `ik`, remembered."""
        key = (spec_of(recipe), ik)
        if key not in self._pred:
            self._pred[key] = predict(self.vlm, recipe, shapes) or predict(self.vlm, self.proxy(recipe), shapes)
        return self._pred[key]

    def proxy(self, recipe: dict) -> dict:
        """An estimate's stand-in for what the shapes cannot tell: a token reducer whose counts follow the data
        (or that changes the vision input) is costed as the shared rule at its layer, a KV policy with a
        per-layer split as the same keep in every layer. Its candidates are then measured and corrected."""
        methods, out = build_methods(recipe), dict(recipe)
        tokens, kv = methods.get("tokens"), methods.get("kv")
        if tokens is not None and not tokens.predictable:
            out["tokens"] = f"random:keep={tokens.ratio}:layer={tokens.at(self.vlm.runner)}"
        if kv is not None and not kv.predictable:
            out["kv"] = f"random:keep={kv.keep}"
        return out

    def over(self, pred: dict | None, point: dict, offset: dict) -> bool:
        return pred is not None and any(a in pred and pred[a] + offset.get(a, 0.0) > v for a, v in point.items() if a != "latency")

    def bisect(self, cand: Candidate, point: dict, idx) -> float | None:
        """The largest keep whose predicted ratios (with the candidate's measured offsets) meet the point, on all
        the validation items (`idx` where they are not known)."""
        fam, lo, hi = cand.family, self.space.keep_low, self.space.keep_high
        idx = self.budget_items(idx)

        def over(keep: float) -> bool:
            return self.over(self.predicted(fam.recipe(keep), idx), point, cand.offset)

        if over(lo):
            return None
        if self.predicted(fam.recipe(hi), idx) is None:  # a router, candidate items: measured only
            return cand.keep if cand.keep is not None else 0.5 * (lo + hi)
        if not over(hi):
            return hi
        grid = getattr(build_methods(fam.recipe(1.0)).get("tokens"), "keep_grid", None)
        if grid is not None:  # a method with discrete keeps (pooling: 1 / window area): the largest that fits
            return max((k for k in grid if lo <= k <= hi and not over(k)), default=None)
        for _ in range(self.s.steps):
            mid = round((lo + hi) / 2, 4)
            lo, hi = (lo, mid) if over(mid) else (mid, hi)
        return lo

    def start(self, point: dict, idx, families: list[Family]) -> list[Candidate]:
        out = []
        for fam in families:
            self.considered += 1
            cand = Candidate(fam)
            try:
                make_plan(fam.recipe(0.5 if fam.free else None), self.vlm.runner)  # the model's own checks
                if fam.free:
                    cand.keep = self.bisect(cand, point, idx)
                    why = None if cand.keep is not None else f"over budget at keep {self.space.keep_low} (predicted)"
                else:
                    over = self.over(self.predicted(fam.recipe(), self.budget_items(idx)), point, {})
                    why = "over budget (predicted)" if over else None
            except TrimVLMError as e:  # e.g. a layer this model cannot reduce at
                why = f"refused by the model: {e}"
            if why:
                self.skipped.append({"budget": label(point), "family": fam.name, "why": why})
            else:
                out.append(cand)
        return out

    def recheck(self, cands: list[Candidate], point: dict, idx) -> list[Candidate]:
        """Before a round runs: a candidate predicted over budget on all the validation items (with the offsets
        measured since its keep was set) gets a lower keep, or is skipped (the search never runs a recipe over a
        predicted budget)."""
        out = []
        for c in cands:
            if self.over(self.predicted(c.recipe, self.budget_items(idx)), point, c.offset):
                keep = self.bisect(c, point, idx) if c.family.free else None
                if keep is None:
                    self.skipped.append({"budget": label(point), "family": c.family.name,
                                         "why": "over budget on the next round's items (predicted)"})  # fmt: skip
                    continue
                c.keep = min(keep, c.keep)
            out.append(c)
        return out

    def measure(self, cands: list[Candidate], point: dict, idx) -> list[Candidate]:
        """Run the candidates on `idx`; re-bisect and re-run the ones over budget; those that fit."""
        done, pending = [], cands
        for attempt in range(self.s.corrections + 1):
            if not pending:
                break
            rows = self.journal.run([c.recipe for c in pending], idx)
            again = []
            for c in pending:
                c.row = rows[c.spec]
                if fits(self.projected(c, idx), point, self.s.tol):
                    done.append(c)
                elif c.family.free and attempt < self.s.corrections and self._correct(c, point, idx):
                    again.append(c)
                else:
                    self.dropped.append({"budget": label(point), "family": c.family.name,
                                         "why": f"measured over budget at keep {c.keep}"})  # fmt: skip
            pending = again
        return done

    def budget_items(self, idx) -> list[int]:
        """The items a budget is judged on: all the validation items (`idx`, a round's, before `point` says)."""
        return self.full or idx

    def projected(self, c: Candidate, idx) -> dict:
        """The candidate's measured ratios on `idx`, each predicted axis projected to all the validation items:
        measured - predicted(idx) + predicted(all); the measurement itself where idx is all of them or the axis
        is not predicted (latency, a router)."""
        ratio, full_idx = dict(c.row["ratio"]), self.budget_items(idx)
        if idx == full_idx:  # the last round: its items are all of them (the rounds are prefixes of one order)
            return ratio
        here, full = self.predicted(c.recipe, idx), self.predicted(c.recipe, full_idx)
        if here is None or full is None:
            return ratio
        for a in here:
            if ratio.get(RESULT_KEY[a]) is not None:
                ratio[RESULT_KEY[a]] += full[a] - here[a]
        return ratio

    def _correct(self, c: Candidate, point: dict, idx) -> bool:
        """A lower keep for a candidate measured over budget (False: none is left)."""
        pred = self.predicted(c.family.recipe(c.keep), idx) or {}
        old = new = c.keep
        for a in point:
            if a in pred:
                c.offset[a] = c.row["ratio"][RESULT_KEY[a]] - pred[a]
        lat = c.row["ratio"]["latency_s"]
        if "latency" in point and lat is not None and lat > point["latency"] + self.s.tol:
            new = old * point["latency"] / lat
        if pred:
            keep = self.bisect(c, point, idx)
            if keep is None:
                return False
            new = min(new, keep)
        if new >= old:  # measured over budget: the keep must go down
            new = old - max(0.005, 0.02 * old)
        if new < self.space.keep_low:
            return False
        c.keep = round(new, 4)
        return True

    def point(self, point: dict, rounds: list[list[int]], bar) -> list[Candidate]:
        """The candidates of the last round, best first. With a beam, round 0 runs the one-axis families first
        and the joint families are formed with the `beam` best token families only."""
        fams, beam = self.space.families(), self.space.beam
        self.full = rounds[-1]
        first = [f for f in fams if len(f.parts) == 1] if beam else fams
        cands = self.start(point, rounds[0], first)
        for r, idx in enumerate(rounds):
            bar.phase(f"{label(point)} · round {r + 1}/{len(rounds)}: {len(cands)} recipes x {len(idx)} items")
            cands = sorted(self.measure(self.recheck(cands, point, idx), point, idx), key=_rank)
            if r == 0 and beam:
                top = [c.family.parts["tokens"] for c in cands if set(c.family.parts) == {"tokens"}][:beam]
                joint = [f for f in fams if len(f.parts) > 1 and f.parts.get("tokens", top[0] if top else "") in top]
                self.considered += len(fams) - len(first) - len(joint)
                self.left_out += len(fams) - len(first) - len(joint)
                more = self.start(point, idx, joint)
                cands = sorted(cands + self.measure(self.recheck(more, point, idx), point, idx), key=_rank)
            if r + 1 < len(rounds):
                cands = cands[: max(1, math.ceil(len(cands) / self.s.eta))]
            bar.advance()
        return cands


def _rank(c: Candidate):
    return (-c.row["accuracy"], c.row["mismatch_pct"], c.row["ratio"]["total_flops"], c.spec)


def round_items(n: int, start: int, eta: int, seed: int) -> list[list[int]]:
    """Nested item subsets: the first n_r of a seeded permutation, n_0 = start, x eta, the last all n."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    sizes, m = [], min(start, n)
    while m < n:
        sizes.append(m)
        m *= eta
    sizes.append(n)
    return [order[:k] for k in sizes]


def frontier(entries: list[dict]) -> dict[str, list[str]]:
    """Per cost axis, the specs of the non-dominated entries (lower ratio, higher accuracy)."""
    out = {}
    for axis in FRONTIER_AXES:
        pts = [Point(e["spec"], e["val"]["ratio"][axis], e["val"]["accuracy"]) for e in entries]
        out[axis] = [entries[i]["spec"] for i in pareto_front(pts)]
    return out


def check_splits(task: str, val_split: str, test_split: str, data) -> None:
    entry = TASKS.get(str(task))
    if entry is None and data is None:
        raise InputError(f"task {task!r} has no validation split: tune searches a registered task's "
                         f"{val_split!r} split and reports on its {test_split!r} split (a JSONL file has no splits)")  # fmt: skip
    if entry is not None and not entry.reads_data and val_split not in entry.splits:
        allowed = ", ".join(entry.splits) or "none"
        raise InputError(f"task {task!r} has no validation split {val_split!r} (its splits: {allowed}); "
                         "tune never searches on the split it reports")  # fmt: skip
    if val_split == test_split:
        raise InputError(f"the validation and test splits must differ, both are {val_split!r}")


def tune(vlm, task: str, budgets, *, space=None, out=None, n_val: int = 192, n_test: int = 600, seed: int = 0,
         data=None, val_split: str = "val", test_split: str = "test", min_retention: float | None = None,
         settings: Settings | None = None, progress: bool = True, console=None, on_run=None,
         evaluate=None) -> dict:  # fmt: skip
    """Search the space for the best recipe at each budget point; returns the report (`tune.report` writes
    it). `on_run(n)` is called after each evaluation call (n recipes run). `evaluate(task, recipes, **kw)`:
    where every evaluation runs (default run_eval in this process; a `RayEvaluator` shards them over Ray
    workers, with the same predictions and FLOPs, so the same frontier when the budgets are FLOPs or KV bytes)."""
    points = budget_points(budgets)
    if min_retention is not None and not 0 < min_retention <= 1:
        raise InputError(f"min_retention must be in (0, 1], got {min_retention!r}")
    check_splits(task, val_split, test_split, data)
    settings = settings or Settings()
    fp = model_fingerprint(vlm.adapter)
    out = None if out is None else Path(out)
    rankings = (out if out is not None else Path(tempfile.mkdtemp(prefix="trimvlm-tune-"))) / "rankings"
    space = load_space(space, rankings=rankings)
    val = get_task(task, limit=n_val, seed=seed, split=val_split, data=data, progress=False)
    journal = Journal(vlm, val, out, batch_size=settings.batch_size, fingerprint=fp, on_run=on_run,
                      evaluate=evaluate)  # fmt: skip
    rounds = round_items(len(val.records), settings.start, settings.eta, seed)
    with steps(f"tune {task}", len(points) * len(rounds) + 1, console, progress, "calibrating the rankings",
               unit="round") as bar:  # fmt: skip
        calibrate_rankings(vlm, space, val, rankings)
        search = Search(vlm, val, space, journal, settings)
        results, entries = [], {}  # per budget point its candidates' ranking; every final candidate's entry
        for p in points:
            final = search.point(p, rounds, bar)
            results.append({"budget": p, "label": label(p), "ranking": [c.spec for c in final]})
            for c in final:
                entries.setdefault(c.spec, {"spec": c.spec, "family": c.family.name, "keep": c.keep,
                                            "recipe": c.family.recipe(c.keep), "val": c.row})  # fmt: skip
        bar.phase(f"baseline x {len(rounds[-1])} validation items")
        base_row = journal.run([], rounds[-1])["baseline"]
        entries_l = [{"spec": "baseline", "family": "baseline", "keep": None, "recipe": {"name": "baseline"},
                      "val": base_row}, *entries.values()]  # fmt: skip
        front = frontier(entries_l)
        chosen = list(dict.fromkeys([s for f in front.values() for s in f] + [r["ranking"][0] for r in results if r["ranking"]]))
        chosen = [s for s in chosen if s != "baseline"]
        test = get_task(task, limit=n_test, seed=seed, split=test_split, data=data, progress=False)
        bar.phase(f"test split: {len(chosen) + 1} recipes x {len(test.records)} items")
        res = journal.evaluate(test, [{**entries[s]["recipe"], "name": s} for s in chosen],
                               batch_size=settings.batch_size, progress=False)
        bar.advance()
    _add_test(entries_l, [*chosen, "baseline"], res)
    _add_best(results, entries_l, min_retention)
    return {"model": vlm.info() | {"fingerprint": fp}, "fingerprint": fp, "task": str(task),
            "splits": {"val": val_split, "test": test_split}, "n_val": len(val.records), "n_test": len(test.records),
            "seed": seed, "space": space.path, "budgets": results, "entries": entries_l, "frontier": front,
            "min_retention": min_retention, "settings": vars(settings) | {"rounds": [len(r) for r in rounds]},
            "considered": search.considered, "ran": search.considered - len(search.skipped) - search.left_out,
            "left_out_by_beam": search.left_out,
            "evaluated_recipes": len(journal.ran), "skipped": search.skipped, "dropped": search.dropped,
            "touched_val_items": len(journal.touched)}  # fmt: skip


def _add_test(entries: list[dict], specs: list[str], res) -> None:
    """The test split's figures of the entries evaluated on it (`specs`), from its result `res`."""
    groups = [g for g in ("prefill", "full") if any(r["group"] == g for r in res.rows)]
    for e in entries:
        if e["spec"] in specs:
            row = res.row(e["spec"])
            e["test"] = {k: row[k] for k in ("accuracy", "mismatch_pct", "retention", "n", "ratio")}
            e["test"]["by_probe"] = {g: {k: res.row(e["spec"], g)[k] for k in ("accuracy", "mismatch_pct")}
                                     for g in groups}  # fmt: skip


def _add_best(results: list[dict], entries: list[dict], min_retention: float | None) -> None:
    """Each budget point's best (the first of its ranking), and whether it keeps `min_retention` on the test."""
    for r in results:
        r["best"] = r["ranking"][0] if r["ranking"] else None
        best = next((e for e in entries if e["spec"] == r["best"]), None)
        r["meets_min_retention"] = None if min_retention is None or best is None else \
            (best["test"]["retention"] or 0) >= min_retention
