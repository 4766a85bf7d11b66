"""Run a list of recipes over one task: predictions, accuracy, mismatch vs the baseline, costs and ratios.

- The uncompressed baseline (the empty recipe, labelled "baseline") is always run, and first in the results.
- Items are grouped by (probe, kind) and cut into batches of `batch_size`; prefill probes generate
  `task.prefill_tokens` tokens (default 1), full-pipeline probes up to `task.new_tokens(probe, kind)`.
- Timing fairness: recipes are interleaved batch by batch in this one process: for each batch every recipe
  runs, and the order rotates from batch to batch, so warm caches, thermal state and background load fall on
  every recipe alike. An untimed warm-up call of every recipe on two items runs first, and the vision tower's
  FLOPs of each batch's input shape are counted before the batch, untimed, so no recipe pays for the count.
- Costs come from each call's `GenerationResult.costs` (the cost meter): prefill FLOPs (vision included),
  decode FLOPs, KV bytes held after prefill, latency (the meter's timed phases), wall time of the whole call
  (preprocessing included), peak memory (max over batches; on CPU a lower bound, see runtime/meter.py).
  Sums are over the group's batches; `per_item` divides by the group's items; `ratio` divides by the
  baseline's sum on the same items (None where the baseline's is 0).
- Results per recipe for every kind, every probe kind ("prefill" / "full") and "all": accuracy (the mean of
  the per-item scores of each item's own metric: VQA accuracy, ANLS, relaxed accuracy... for those
  metrics), mismatch % vs the baseline, and the metric's extras (yes/no F1, precision, recall, yes-ratio)
  in every group whose items share one metric.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from trimvlm.errors import InputError, RecipeError
from trimvlm.evals.metrics import get_metric
from trimvlm.evals.tasks import PROBES, Task, check_limit, check_prefill_answers, get_task
from trimvlm.options import is_int
from trimvlm.recipe import Recipe, parse_recipe

COST_KEYS = (
    "prefill_flops",  # the model's (vision included)
    "decode_flops",
    "method_prefill_flops",  # the methods' own work (selection, probes, merges), its own line
    "method_decode_flops",
    "method_flops",
    "total_flops",  # model + method
    "kv_bytes",
    "latency_s",
    "wall_s",
)
MAX_KEYS = ("kv_bytes_peak", "peak_memory_bytes")
RATIO_KEYS = COST_KEYS + ("peak_memory_bytes",)


def normalize_recipes(recipes: Sequence[str | dict | Recipe] | None) -> list[Recipe]:
    """Parse and validate recipes; the baseline (empty recipe labelled "baseline") is included and first."""
    parsed = [parse_recipe(r) for r in (recipes or [])]
    for r in parsed:
        r.build()  # unknown methods / options fail now, before any model runs
    base = [i for i, r in enumerate(parsed) if r.is_baseline and r.label() == "baseline"]
    if base:
        parsed.insert(0, parsed.pop(base[0]))
    else:
        parsed.insert(0, Recipe(name="baseline"))
    labels = [r.label() for r in parsed]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise RecipeError(f"duplicate recipe label(s) {dupes}: give each recipe a distinct name")
    return parsed


@dataclass
class _Acc:
    """Cost sums of one recipe over one set of items."""

    n: int = 0
    batches: int = 0
    sums: dict = field(default_factory=lambda: {k: 0.0 for k in COST_KEYS})
    maxes: dict = field(default_factory=lambda: {k: 0 for k in MAX_KEYS})
    peak_memory_kind: str = ""

    def add(self, costs, n_items: int, wall_s: float) -> None:
        self.n += n_items
        self.batches += 1
        self.sums["prefill_flops"] += costs.prefill_flops
        self.sums["decode_flops"] += costs.decode_flops
        self.sums["method_prefill_flops"] += costs.method_prefill_flops
        self.sums["method_decode_flops"] += costs.method_decode_flops
        self.sums["method_flops"] += costs.method_total_flops
        self.sums["total_flops"] += costs.total_flops
        self.sums["kv_bytes"] += costs.kv_bytes
        self.sums["latency_s"] += sum(costs.seconds.values())
        self.sums["wall_s"] += wall_s
        self.maxes["kv_bytes_peak"] = max(self.maxes["kv_bytes_peak"], costs.kv_bytes_peak)
        self.memory(costs)

    def memory(self, costs) -> None:
        """Take the peak memory of a call that measured it (a timed CPU call does not)."""
        if costs.peak_memory_kind in ("", "not_measured"):
            self.peak_memory_kind = self.peak_memory_kind or costs.peak_memory_kind
            return
        self.maxes["peak_memory_bytes"] = max(self.maxes["peak_memory_bytes"], costs.peak_memory_bytes)
        self.peak_memory_kind = costs.peak_memory_kind

    def merge(self, other: _Acc) -> None:
        self.n += other.n
        self.batches += other.batches
        for k in COST_KEYS:
            self.sums[k] += other.sums[k]
        for k in MAX_KEYS:
            self.maxes[k] = max(self.maxes[k], other.maxes[k])
        if other.peak_memory_kind not in ("", "not_measured") or not self.peak_memory_kind:
            self.peak_memory_kind = other.peak_memory_kind or self.peak_memory_kind

    def as_dict(self) -> dict:
        sums = {k: (int(v) if k not in ("latency_s", "wall_s") else v) for k, v in self.sums.items()}
        per_item = {k: (v / self.n if self.n else 0.0) for k, v in self.sums.items()}
        return {
            "items": self.n,
            "batches": self.batches,
            "sum": sums,
            "per_item": per_item,
            "max": dict(self.maxes),
            "peak_memory_kind": self.peak_memory_kind,
        }


@dataclass
class EvalResult:
    task: Task
    recipes: list[Recipe]
    predictions: list[list[str]]  # [recipe][item]
    scores: list[list[float]]  # [recipe][item]
    rows: list[dict]  # one per (recipe, group)
    settings: dict
    # per recipe: (probe, kind) -> the cost sums the rows were made from (a sharded run merges these)
    costs: list[dict] = field(default_factory=list, repr=False)

    @property
    def labels(self) -> list[str]:
        return [r.label() for r in self.recipes]

    def row(self, recipe: str, group: str) -> dict:
        for r in self.rows:
            if r["recipe"] == recipe and r["group"] == group:
                return r
        raise KeyError((recipe, group))

    def to_dict(self) -> dict:
        t = self.task
        return {
            "task": {"name": t.name, "items": len(t.records), "kinds": t.kinds(), **t.info},
            "settings": self.settings,
            "recipes": [
                {"label": r.label(), "recipe": r.model_dump(exclude_none=True)} for r in self.recipes
            ],
            "results": self.rows,
            "items": [
                {
                    "id": rec.id,
                    "kind": rec.kind,
                    "probe": rec.probe,
                    "metric": rec.metric,
                    "question": rec.question,
                    "answers": rec.answers,
                    "options": rec.options,
                }
                for rec in t.records
            ],
            "predictions": {
                label: {"texts": p, "scores": s}
                for label, p, s in zip(self.labels, self.predictions, self.scores, strict=True)
            },
        }


def _batches(task: Task, batch_size: int) -> list[tuple[list[int], int]]:
    """(item indices, max new tokens) per batch, grouped by (probe, kind) in order of first appearance."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, r in enumerate(task.records):
        groups.setdefault((r.probe, r.kind), []).append(i)
    out = []
    for (probe, kind), idx in groups.items():
        n_new = task.new_tokens(probe, kind)
        out += [(idx[b : b + batch_size], n_new) for b in range(0, len(idx), batch_size)]
    return out


def _progress(enabled: bool, console=None):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[recipe]}"),
        console=console,
        disable=not enabled,
        transient=False,
    )


def run_eval(
    vlm,
    task: Task | str,
    recipes: Sequence[str | dict | Recipe] | None = None,
    *,
    limit: int | None = None,
    batch_size: int = 16,
    seed: int = 0,
    max_new_tokens: int | None = None,
    warmup: bool = True,
    memory: str = "first",
    progress: bool = True,
    console=None,
    data: str | None = None,
    split: str | None = None,
    order_offset: int = 0,
) -> EvalResult:
    """Run every recipe (baseline first) over the task's items, interleaved batch by batch.

    `memory`: where peak memory comes from. On CUDA every timed call reads the allocator's peak. On CPU the
    tensor tracker would slow the timed calls, so peak memory is measured in separate, untimed calls on the
    same batches: `first` (default) the first batch of each probe kind (prefill / full), `all` every batch,
    `off` none (reported as not measured). The reported peak is the largest over the measured batches.
    `data` / `split`: the local copy a benchmark task named by a string is read from (see `get_task`).
    `order_offset`: the recipe order of batch b is the one of batch b + order_offset (a shard of a sharded run,
    trimvlm.evals.ray_eval, passes the index its first batch has in the whole task's batches)."""
    check_run_args(memory, batch_size, max_new_tokens)
    task = prepare_task(task, limit=limit, seed=seed, max_new_tokens=max_new_tokens, data=data, split=split,
                        progress=progress)  # fmt: skip
    if getattr(vlm, "tokenizer", None) is not None:  # before any item runs
        check_prefill_answers(task, vlm.tokenizer)
    recipes = normalize_recipes(recipes)
    records = task.records
    n_rec, n_items = len(recipes), len(records)
    batches = _batches(task, batch_size)
    preds: list[list[str]] = [[""] * n_items for _ in recipes]
    accs: list[dict[tuple[str, str], _Acc]] = [{} for _ in recipes]  # per recipe: (probe, kind) -> costs

    def call(r: int, idx: list[int], n_new: int, track: bool = False):
        images = [list(records[i].images) for i in idx]
        prompts = [records[i].prompt_text() for i in idx]
        kw = {"track_memory": True} if track else {}
        t0 = time.perf_counter()
        res = vlm.generate(images, prompts, recipe=recipes[r], max_new_tokens=n_new, seed=seed, **kw)
        return res, time.perf_counter() - t0

    device = getattr(getattr(vlm, "runner", None), "device", None)  # None: a stand-in without a runner
    on_cpu = device is not None and device.type != "cuda"
    measured: set[tuple] = set()

    if warmup:  # untimed: one-time costs (lazy init, allocator growth) of every recipe fall here
        idx, n_new = batches[0]
        for r in range(n_rec):
            call(r, idx[: min(len(idx), 2)], min(n_new, 2))
    with _progress(progress, console) as bar:
        job = bar.add_task(f"eval {task.name}", total=len(batches) * n_rec, recipe="")
        for b, (idx, n_new) in enumerate(batches):
            key = (records[idx[0]].probe, records[idx[0]].kind)
            if device is not None:  # the vision-FLOP count of a new input shape runs here, outside every timing
                vlm.runner.vision_flops(vlm.prepare([list(records[i].images) for i in idx],
                                                    [records[i].prompt_text() for i in idx]))  # fmt: skip
            for j in range(n_rec):
                r = (b + order_offset + j) % n_rec  # rotate which recipe goes first
                bar.update(job, recipe=recipes[r].label())
                res, wall = call(r, idx, n_new)
                for i, text in zip(idx, res.texts, strict=True):
                    preds[r][i] = text
                acc = accs[r].setdefault(key, _Acc())
                acc.add(res.costs, len(idx), wall)
                if on_cpu and (memory == "all" or (memory == "first" and (r, key[0]) not in measured)):
                    acc.memory(call(r, idx, n_new, track=True)[0].costs)  # untimed
                    measured.add((r, key[0]))
                bar.advance(job)

    scores = score_predictions(records, preds)
    rows = _rows(task, recipes, preds, scores, accs)
    settings = {
        "seed": seed,
        "batch_size": batch_size,
        "max_new_tokens": task.max_new_tokens,
        "prefill_tokens": task.prefill_tokens,
        "kind_max_new_tokens": task.kind_max_new_tokens,
        "warmup": warmup,
        "memory": memory if on_cpu else "every call (CUDA allocator)",
        "order": "interleaved: every recipe on each batch, rotating the first recipe batch by batch",
        "model": _model_info(vlm),
    }
    return EvalResult(
        task=task, recipes=recipes, predictions=preds, scores=scores, rows=rows, settings=settings, costs=accs
    )


def check_run_args(memory: str, batch_size, max_new_tokens) -> None:
    if memory not in ("first", "all", "off"):
        raise InputError(f"memory must be one of first, all, off; got {memory!r}")
    if not is_int(batch_size) or batch_size <= 0:
        raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
    if max_new_tokens is not None and (not is_int(max_new_tokens) or max_new_tokens <= 0):
        raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")


def prepare_task(task: Task | str, *, limit=None, seed=0, max_new_tokens=None, data=None, split=None,
                 progress=True) -> Task:  # fmt: skip
    """The task run_eval runs: built by name (or cut to `limit`), with `max_new_tokens` as its one cap."""
    if not isinstance(task, str) and (data is not None or split is not None):
        raise InputError("data and split apply to a task given by name; this task is already built")
    if isinstance(task, str):
        task = get_task(task, limit=limit, seed=seed, data=data, split=split, progress=progress)
    elif limit is not None:
        task = replace(task, records=task.records[: check_limit(limit)])
    if max_new_tokens is not None:  # one cap for every full-pipeline item
        task = replace(task, max_new_tokens=max_new_tokens, kind_max_new_tokens={})
    if not task.records:
        raise InputError(f"task {task.name!r} has no items")
    return task


def score_predictions(records, preds) -> list[list[float]]:
    """[recipe][item]: each item's score under its own metric."""
    return [
        [
            get_metric(rec.metric).score(p, rec.answers, rec.options)
            for p, rec in zip(pr, records, strict=True)
        ]
        for pr in preds
    ]


def _model_info(vlm) -> dict:
    info = {}
    try:
        info = dict(vlm.info())
    except Exception:  # a stand-in model without info()
        pass
    folder = getattr(getattr(vlm, "adapter", None), "folder", None)
    if folder is not None:
        info["folder"] = str(folder)
    return info


def _rows(task: Task, recipes, preds, scores, accs) -> list[dict]:
    records = task.records
    kinds = task.kinds()
    groups = []  # (name, type, item indices, which (probe, kind) cost keys belong to it)
    for k in kinds:
        groups.append(
            (k, "kind", [i for i, r in enumerate(records) if r.kind == k], lambda key, k=k: key[1] == k)
        )
    for p in PROBES:
        idx = [i for i, r in enumerate(records) if r.probe == p]
        if idx:
            groups.append((p, "probe", idx, lambda key, p=p: key[0] == p))
    groups.append(("all", "all", list(range(len(records))), lambda key: True))

    rows = []
    base_costs: dict[str, dict] = {}
    for r, recipe in enumerate(recipes):
        for name, gtype, idx, member in groups:
            acc = _Acc()
            for key, part in accs[r].items():
                if member(key):
                    acc.merge(part)
            costs = acc.as_dict()
            if r == 0:
                base_costs[name] = costs
            base = base_costs[name]
            ratio = {}
            for key in RATIO_KEYS:
                num = costs["sum"].get(key, costs["max"].get(key))
                den = base["sum"].get(key, base["max"].get(key))
                ratio[key] = (num / den) if den else None
            metrics = sorted({records[i].metric for i in idx})
            row = {
                "recipe": recipe.label(),
                "group": name,
                "group_type": gtype,
                "probe": name if gtype == "probe" else (kinds[name]["probe"] if gtype == "kind" else "mixed"),
                "metric": metrics[0] if len(metrics) == 1 else "mixed",
                "n": len(idx),
                "accuracy": sum(scores[r][i] for i in idx) / len(idx),
                "mismatch_pct": _mismatch(records, preds[r], preds[0], idx),
                "costs": costs,
                "ratio": ratio,
            }
            if len(metrics) == 1:  # a task-level summary (POPE's F1, yes-ratio) of every one-metric group
                m = get_metric(metrics[0])
                extra = m.summary(
                    [preds[r][i] for i in idx],
                    [records[i].answers for i in idx],
                    [records[i].options for i in idx],
                )
                row.update(extra)
            rows.append(row)
    return rows


def _mismatch(records, preds, base, idx) -> float:
    if not idx:
        return 0.0
    diff = 0
    for i in idx:
        m = get_metric(records[i].metric)
        diff += m.canonical(preds[i], records[i].options) != m.canonical(base[i], records[i].options)
    return 100.0 * diff / len(idx)
