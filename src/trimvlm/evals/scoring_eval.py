"""Candidate evaluation (FastJEV's protocol on the demo task): score every question's candidates with each recipe
and compare with the unpruned model.

Task `demo-candidates`: the demo task's test split, one question of every kind per image (image-major, like the
`demo` generation task), each with its fixed candidate list (exist: yes/no, mc: A-D, colour: five colours and
grey, count: 0-7, list / read: the answer and three near misses in a seeded order). The chosen candidate is the
argmax of the decision logits (head readout: an abstention counts as wrong); `readout="auto"` is the head when
the model has a trained decision head, else the candidates' log-likelihood.

Per recipe (the baseline, nothing skipped, always first):
- accuracy per kind and over all items;
- mean score retention: the unweighted mean over kinds of accuracy / baseline accuracy (the paper's definition:
  ratios before rounding, not clipped at 100%; a kind the baseline gets 0% on has no ratio and is left out);
- agreement: the fraction of items whose chosen candidate equals the baseline's (also per kind);
- cost ratios to the baseline on the same items: candidate-branch FLOPs (`costs.flops["branch"]`, the LM-head
  projections of the branch states included), total FLOPs, latency (the meter's timed phases), branch latency,
  wall time of the whole call. Recipes are interleaved batch by batch in this one process, the first recipe
  rotating, after an untimed warm-up: every recipe on two items, then every batch once with the baseline. The
  latter matters: the first call on a new batch pays one-time costs that are not inference (the runner counts
  the vision tower's FLOPs with FlopCounterMode the first time it sees a batch's input shapes and ids, inside
  the timed `vision` phase, and shape-keyed kernel set-up), which would otherwise fall on whichever recipe
  runs a batch first.
- per ranker (a depth method with its options other than `budget`): the largest tested budget whose mean
  retention is >= 90%.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from trimvlm.errors import InputError
from trimvlm.evals.report import MARKERS, _ratio, pareto_front, versions, write_outputs, write_text
from trimvlm.evals.run import _model_info, _progress, normalize_recipes
from trimvlm.evals.tasks import check_limit
from trimvlm.evals.tasks.demo import demo_questions
from trimvlm.options import is_int
from trimvlm.recipe import Recipe

RETENTION_TARGET = 0.9
COST_KEYS = ("branch_flops", "prefill_flops", "total_flops", "latency_s", "branch_s", "wall_s")


@dataclass
class CandidateItem:
    id: str
    image: Any
    question: str
    candidates: list[str]
    answer: int  # index of the right candidate
    kind: str


@dataclass
class CandidateTask:
    name: str
    items: list[CandidateItem]
    info: dict = field(default_factory=dict)

    def kinds(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for it in self.items:
            out[it.kind] = out.get(it.kind, 0) + 1
        return out


CandidateTaskBuilder = Callable[..., CandidateTask]  # (limit: int | None, seed: int) -> CandidateTask
CANDIDATE_TASKS: dict[str, CandidateTaskBuilder] = {}


def register_candidate_task(name: str):
    def deco(fn: CandidateTaskBuilder) -> CandidateTaskBuilder:
        CANDIDATE_TASKS[name] = fn
        return fn

    return deco


def is_candidate_task(name) -> bool:
    return str(name) in CANDIDATE_TASKS


def get_candidate_task(name: str, limit: int | None = None, seed: int = 0) -> CandidateTask:
    limit = check_limit(limit)
    if str(name) not in CANDIDATE_TASKS:
        raise InputError(f"unknown candidate task {name!r}; known: {', '.join(sorted(CANDIDATE_TASKS))}")
    return CANDIDATE_TASKS[str(name)](limit=limit, seed=seed)


@register_candidate_task("demo-candidates")
def demo_candidate_task(limit: int | None = None, seed: int = 0, split: str = "test") -> CandidateTask:
    """`limit` candidate questions (default 300) of the demo task's `split`, one of every kind per image."""
    samples, questions = demo_questions(limit, seed, split)
    items = [
        CandidateItem(
            id=qid,
            image=s.image,
            question=qa.question,
            candidates=list(qa.candidates),
            answer=qa.candidates.index(qa.answer),
            kind=qa.kind,
        )
        for qid, s, qa in questions
    ]
    return CandidateTask(
        name="demo-candidates",
        items=items,
        info={"split": split, "seed": seed, "n_images": len(samples), "questions_per_kind": 1},
    )


# --------------------------------------------------------------------------------------------- run


def depth_info(recipe: Recipe, runner) -> dict | None:
    """What a recipe's depth axis skips: method, budget, ranker key, the candidate layers skipped."""
    if recipe.depth is None:
        return None
    from trimvlm.plan import make_plan

    spec = recipe.depth
    # the ranker: the method and its options other than the budget (the default scope `candidates` unnamed)
    opts = {k: v for k, v in spec.options.items() if k != "budget" and (k, v) != ("scope", "candidates")}
    shown = [f"{k}={Path(str(v)).name if k == 'file' else v}" for k, v in sorted(opts.items())]
    others = [f"{a}={getattr(recipe, a)}" for a in ("tokens", "kv") if getattr(recipe, a) is not None]
    ranker = spec.method + (f"[{', '.join(shown)}]" if shown else "") + "".join(f"+{o}" for o in others)
    plan = make_plan(recipe, runner)
    return {
        "method": spec.method,
        "budget": spec.options.get("budget", 0),
        "ranker": ranker,
        "skipped_branch": sorted(plan.skip_branch),
        "skipped_prefill": sorted(plan.skip_prefill),
    }


@dataclass
class CandidateEvalResult:
    task: CandidateTask
    recipes: list[Recipe]
    chosen: list[list[int]]  # [recipe][item], -1 = abstained
    rows: list[dict]  # one per recipe
    largest_budget: dict[str, dict]  # ranker -> {budget, retention}; budget None when none reaches 90%
    settings: dict

    @property
    def labels(self) -> list[str]:
        return [r.label() for r in self.recipes]

    def row(self, label: str) -> dict:
        for r in self.rows:
            if r["recipe"] == label:
                return r
        raise KeyError(label)

    def to_dict(self) -> dict:
        t = self.task
        return {
            "task": {"name": t.name, "items": len(t.items), "kinds": t.kinds(), **t.info},
            "settings": self.settings,
            "recipes": [
                {"label": r.label(), "recipe": r.model_dump(exclude_none=True), "depth": row["depth"]}
                for r, row in zip(self.recipes, self.rows, strict=True)
            ],
            "results": self.rows,
            "largest_budget_90": self.largest_budget,
            "items": [
                {
                    "id": it.id,
                    "kind": it.kind,
                    "question": it.question,
                    "candidates": it.candidates,
                    "answer": it.answer,
                }
                for it in t.items
            ],
            "chosen": {label: c for label, c in zip(self.labels, self.chosen, strict=True)},
        }


def _batches(task: CandidateTask, batch_size: int) -> list[list[int]]:
    groups: dict[str, list[int]] = {}
    for i, it in enumerate(task.items):
        groups.setdefault(it.kind, []).append(i)
    return [idx[b : b + batch_size] for idx in groups.values() for b in range(0, len(idx), batch_size)]


def run_candidate_eval(
    vlm,
    task: CandidateTask | str,
    recipes: Sequence[str | dict | Recipe] | None = None,
    *,
    limit: int | None = None,
    batch_size: int = 16,
    seed: int = 0,
    readout: str = "auto",
    executor: str = "auto",
    warmup: bool = True,
    progress: bool = True,
    console=None,
) -> CandidateEvalResult:
    """Score every item's candidates with every recipe (baseline first), interleaved batch by batch."""
    from trimvlm.scoring.calibrate import resolve_readout
    from trimvlm.scoring.engine import check_choice
    from trimvlm.scoring.request import ScoreRequest

    if not is_int(batch_size) or batch_size <= 0:
        raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
    if isinstance(task, str):
        task = get_candidate_task(task, limit=limit, seed=seed)
    elif limit is not None:
        task = replace(task, items=task.items[: check_limit(limit)])
    if not task.items:
        raise InputError(f"task {task.name!r} has no items")
    readout = resolve_readout(vlm, readout)
    check_choice(executor, readout, vlm.head)
    recipes = normalize_recipes(recipes)
    depths = [depth_info(r, vlm.runner) for r in recipes]  # bad budgets / files fail before any run
    items = task.items
    n_rec, n_items = len(recipes), len(items)
    batches = _batches(task, batch_size)
    chosen = [[-1] * n_items for _ in recipes]
    sums = [{k: 0.0 for k in COST_KEYS} for _ in recipes]
    ran: list[set[str]] = [set() for _ in recipes]

    def call(r: int, idx: list[int]):
        reqs = [ScoreRequest(items[i].image, items[i].question, list(items[i].candidates)) for i in idx]
        t0 = time.perf_counter()
        res = vlm.score(reqs, readout=readout, executor=executor, recipe=recipes[r])
        return res, time.perf_counter() - t0

    if warmup:  # untimed: one-time costs of every recipe, and of every batch's shapes, fall here
        for r in range(n_rec):
            call(r, batches[0][:2])
        for idx in batches:
            call(0, idx)
    with _progress(progress, console) as bar:
        job = bar.add_task(f"eval {task.name}", total=len(batches) * n_rec, recipe="")
        for b, idx in enumerate(batches):
            for j in range(n_rec):
                r = (b + j) % n_rec  # rotate which recipe goes first
                bar.update(job, recipe=recipes[r].label())
                res, wall = call(r, idx)
                for i, out in zip(idx, res.results, strict=True):
                    chosen[r][i] = out.chosen
                c = res.costs
                sums[r]["branch_flops"] += c.flops.get("branch", 0)
                sums[r]["prefill_flops"] += c.prefill_flops
                sums[r]["total_flops"] += c.total_flops
                sums[r]["latency_s"] += sum(c.seconds.values())
                sums[r]["branch_s"] += c.seconds.get("branch", 0.0)
                sums[r]["wall_s"] += wall
                ran[r].add(res.executor)
                bar.advance(job)

    rows = _rows(task, recipes, depths, chosen, sums, ran)
    settings = {
        "seed": seed,
        "batch_size": batch_size,
        "readout": readout,
        "executor": executor,
        "warmup": warmup,
        "order": "interleaved: every recipe on each batch, rotating the first recipe batch by batch",
        "retention": "unweighted mean over kinds of accuracy / baseline accuracy; not clipped",
        "model": _model_info(vlm),
    }
    return CandidateEvalResult(
        task=task,
        recipes=recipes,
        chosen=chosen,
        rows=rows,
        largest_budget=largest_budgets(rows),
        settings=settings,
    )


def _rows(task, recipes, depths, chosen, sums, ran) -> list[dict]:
    items = task.items
    kinds = list(task.kinds())
    by_kind = {k: [i for i, it in enumerate(items) if it.kind == k] for k in kinds}
    base = chosen[0]

    def acc(r, idx):
        return sum(chosen[r][i] == items[i].answer for i in idx) / len(idx)

    def agree(r, idx):
        return sum(chosen[r][i] == base[i] for i in idx) / len(idx)

    rows = []
    every = list(range(len(items)))
    for r, recipe in enumerate(recipes):
        per_kind = {}
        ratios = []
        for k, idx in by_kind.items():
            a, a0 = acc(r, idx), acc(0, idx)
            ratio = a / a0 if a0 > 0 else None
            if ratio is not None:
                ratios.append(ratio)
            per_kind[k] = {"n": len(idx), "accuracy": a, "retention": ratio, "agreement": agree(r, idx)}
        cost_ratio = {k: (sums[r][k] / sums[0][k] if sums[0][k] else None) for k in COST_KEYS}
        rows.append(
            {
                "recipe": recipe.label(),
                "depth": depths[r],
                "n": len(items),
                "kinds": per_kind,
                "accuracy": acc(r, every),
                "retention": sum(ratios) / len(ratios) if ratios else None,
                "retention_kinds": len(ratios),
                "agreement": agree(r, every),
                "abstained": sum(c < 0 for c in chosen[r]),
                "costs": {"sum": dict(sums[r]), "per_item": {k: v / len(items) for k, v in sums[r].items()}},
                "ratio": cost_ratio,
                "executor": ",".join(sorted(ran[r])),
            }
        )
    return rows


def largest_budgets(rows: list[dict], target: float = RETENTION_TARGET) -> dict[str, dict]:
    """Per ranker: the largest tested budget with mean retention >= target (None when none reaches it)."""
    out: dict[str, dict] = {}
    for row in rows:
        d = row["depth"]
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


# --------------------------------------------------------------------------------------------- reports


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _skipped(row: dict) -> str:
    d = row["depth"]
    if d is None:
        return "-"
    return ",".join(map(str, d["skipped_branch"])) or "none"


def print_candidate_report(result: CandidateEvalResult, console=None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    kinds = list(result.task.kinds())
    t = Table(
        title=f"{result.task.name}: accuracy % per kind, retention / agreement vs baseline, cost ratios",
        title_justify="left",
    )
    for col in ("recipe", "skipped", *kinds, "all", "retention %", "agree %", "branch FLOPs", "latency"):
        t.add_column(
            col, justify="left" if col in ("recipe", "skipped") else "right", no_wrap=col == "recipe"
        )
    for row in result.rows:
        t.add_row(
            escape(row["recipe"]),
            _skipped(row),
            *(_pct(row["kinds"][k]["accuracy"]) for k in kinds),
            _pct(row["accuracy"]),
            _pct(row["retention"]),
            _pct(row["agreement"]),
            _ratio(row["ratio"]["branch_flops"]),
            _ratio(row["ratio"]["latency_s"]),
        )
    console.print(t)
    if result.largest_budget:
        lb = Table(title="largest tested budget with >= 90% mean retention", title_justify="left")
        for col in ("ranker", "budgets tested", "largest budget", "retention %"):
            lb.add_column(col, justify="left" if col == "ranker" else "right")
        for ranker, e in result.largest_budget.items():
            lb.add_row(
                escape(ranker),
                ",".join(map(str, e["tested"])),
                "-" if e["budget"] is None else str(e["budget"]),
                _pct(e["retention"]),
            )
        console.print(lb)
    base = result.rows[0]["costs"]["per_item"]
    console.print(
        f"[dim]readout {result.settings['readout']}; baseline per item: branch {base['branch_flops'] / 1e6:.2f} "
        f"MFLOP, prefill {base['prefill_flops'] / 1e6:.2f} MFLOP, {1e3 * base['latency_s']:.2f} ms[/dim]"
    )


def candidate_markdown(result: CandidateEvalResult) -> str:
    kinds = list(result.task.kinds())
    head = ["recipe", "skipped", *kinds, "all", "retention %", "agreement %", "branch FLOPs", "total FLOPs",
            "latency", "branch latency"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result.rows:
        cells = [row["recipe"], _skipped(row)]
        cells += [_pct(row["kinds"][k]["accuracy"]) for k in kinds]
        cells += [_pct(row["accuracy"]), _pct(row["retention"]), _pct(row["agreement"])]
        cells += [_ratio(row["ratio"][k]) for k in ("branch_flops", "total_flops", "latency_s", "branch_s")]
        lines.append("| " + " | ".join(cells) + " |")
    if result.largest_budget:
        lines += ["", "| ranker | budgets tested | largest budget with >= 90% retention | retention % |",
                  "|---|---|---|---|"]  # fmt: skip
        for ranker, e in result.largest_budget.items():
            budget = "-" if e["budget"] is None else str(e["budget"])
            tested = ",".join(map(str, e["tested"]))
            lines.append(f"| {ranker} | {tested} | {budget} | {_pct(e['retention'])} |")
    return "\n".join(lines) + "\n"


def write_candidate_markdown(result: CandidateEvalResult, path: str | Path) -> Path:
    return write_text(candidate_markdown(result), path)


def plot_candidates(result: CandidateEvalResult, path: str | Path) -> Path:
    """Left: mean retention vs budget, one line per ranker (the 90% line dashed). Right: accuracy vs
    candidate-branch FLOPs ratio, the same colour per ranker, each point labelled with its budget; the
    baseline is the black star, recipes without a depth method are plain points; Pareto front in grey."""
    from matplotlib.figure import Figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(12, 4.4), layout="constrained")
    left, right = fig.subplots(1, 2)
    rankers: dict[str, list[tuple[int, float, float, float]]] = {}  # (budget, retention, FLOPs ratio, acc)
    others, pts = [], []
    for k, row in enumerate(result.rows):
        x = row["ratio"]["branch_flops"]
        x, y = (1.0 if x is None else x), 100 * row["accuracy"]
        pts.append((x, y))
        if row["depth"] is not None and row["retention"] is not None:
            d = row["depth"]
            rankers.setdefault(d["ranker"], []).append((d["budget"], 100 * row["retention"], x, y))
        elif k > 0:
            others.append((row["recipe"], x, y))
    for k, (ranker, rp) in enumerate(rankers.items()):
        rp.sort()
        style = {"color": f"C{k % 10}", "marker": MARKERS[(k + 1) % len(MARKERS)], "alpha": 0.85}
        left.plot([p[0] for p in rp], [p[1] for p in rp], label=ranker, **style)
        right.plot([p[2] for p in rp], [p[3] for p in rp], label=ranker, ls=":", **style)
        for budget, _, x, y in rp:
            right.annotate(str(budget), (x, y), textcoords="offset points", xytext=(4, 3 + 7 * k), fontsize=7,
                           color=style["color"])  # fmt: skip
    for name, x, y in others:
        right.scatter([x], [y], s=40, label=name, zorder=3)
    right.scatter([pts[0][0]], [pts[0][1]], s=160, marker="*", color="black", zorder=5, label="baseline")
    front = [pts[n] for n in pareto_front(pts)]
    if len(front) > 1:
        right.step([p[0] for p in front], [p[1] for p in front], where="post", color="grey", alpha=0.4)
    left.axhline(100 * RETENTION_TARGET, color="grey", ls="--", lw=1)
    left.set_xlabel("candidate layers skipped (budget)")
    left.set_ylabel("mean retention (%)")
    left.set_title("mean retention vs budget (90% dashed)", fontsize=10)
    left.xaxis.get_major_locator().set_params(integer=True)
    left.grid(alpha=0.3)
    if rankers:
        left.legend(fontsize=8)
    right.set_xlabel("candidate-branch FLOPs / baseline")
    right.set_ylabel("accuracy (%)")
    right.set_title(
        f"accuracy vs branch FLOPs ({len(result.task.items)} questions; labels: budget)", fontsize=10
    )
    right.grid(alpha=0.3)
    right.set_xlim(left=0, right=max(1.1, right.get_xlim()[1]))
    right.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"trimvlm eval: {result.task.name} ({result.settings['readout']} readout)")
    fig.savefig(path, dpi=110)
    return path


def write_candidate_json(result: CandidateEvalResult, path: str | Path) -> Path:
    return write_text(json.dumps({"versions": versions(), **result.to_dict()}, indent=1) + "\n", path)


def candidate_eval_command(
    model,
    task: str,
    recipes: list,
    limit: int | None,
    json_out=None,
    plot_out=None,
    batch_size: int = 16,
    seed: int = 0,
    readout: str = "auto",
    executor: str = "auto",
    progress: bool = True,
    console=None,
    markdown_out=None,
    load_kw: dict | None = None,
) -> dict:
    """`trimvlm eval --task demo-candidates`: run, print, write the JSON / PNG / Markdown. Returns the JSON."""
    import trimvlm
    from trimvlm.scoring.calibrate import check_readout_name

    check_readout_name(readout)
    the_task = get_candidate_task(task, limit=limit, seed=seed)
    chosen = normalize_recipes(recipes)
    vlm = trimvlm.load(model, **(load_kw or {}))
    result = run_candidate_eval(
        vlm, the_task, chosen, batch_size=batch_size, seed=seed, readout=readout, executor=executor,
        progress=progress, console=console,
    )  # fmt: skip
    print_candidate_report(result, console=console)
    outputs = [
        (json_out, write_candidate_json),
        (plot_out, plot_candidates),
        (markdown_out, write_candidate_markdown),
    ]
    write_outputs(result, console, outputs)
    return {"versions": versions(), **result.to_dict()}
