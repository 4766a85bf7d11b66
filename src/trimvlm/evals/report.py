"""The one report module of an `EvalResult` (generation and candidate items alike): rich tables in the terminal,
a JSON file with every number, a Markdown summary; the Pareto PNG is drawn by `trimvlm.evals.plot`."""

from __future__ import annotations

import json
import os
import platform
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers
from rich.markup import escape

from trimvlm.errors import InputError
from trimvlm.evals.plot import eval_figure as pareto_figure  # noqa: F401 (the Pareto figure, importable here too)
from trimvlm.evals.plot import pareto_front, plot_pareto  # noqa: F401
from trimvlm.evals.run import EvalResult, row_interval
from trimvlm.terminal import Col, Sheet, Terminal, fits


def versions() -> dict[str, str]:
    return {
        "trimvlm": version("trimvlm"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def result_dict(result: EvalResult) -> dict:
    return {"versions": versions(), **result.to_dict()}


def write_json(result: EvalResult, path: str | Path) -> Path:
    return write_text(json.dumps(result_dict(result), indent=1) + "\n", path)


# --------------------------------------------------------------------------------------------- table


def human(x: float | None, unit: str = "") -> str:
    """1234567 -> '1.23M' (decimal prefixes); None -> '-'."""
    if x is None:
        return "-"
    for div, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{p}{unit}"
    return f"{x:.3g}{unit}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


SUMMARY_ROWS = (("f1", "F1"), ("predicted_yes_ratio", "predicted yes %"), ("abstained", "abstained"))  # a group's extras
COST_COLUMNS = (  # (key, heading): per item, and as a ratio to the baseline
    ("prefill_flops", "prefill FLOPs"),
    ("decode_flops", "decode FLOPs"),
    ("branch_flops", "branch FLOPs"),
    ("total_flops", "FLOPs"),
    ("kv_bytes", "KV bytes"),
    ("kv_bytes_peak", "KV peak"),
    ("latency_s", "latency"),
    ("peak_memory_bytes", "peak mem"),
)


DEFAULT_COSTS = ("total_flops", "kv_bytes", "latency_s", "peak_memory_bytes")  # the others: with --wide
COST_COLS = tuple(Col(h, right=True, wide=k not in DEFAULT_COSTS) for k, h in COST_COLUMNS)  # the tables' columns


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _per_item(key: str, costs: dict) -> str:
    if key == "peak_memory_bytes":  # "n/m": not measured
        not_measured = costs.get("peak_memory_kind") in ("", "not_measured", None)
        return "n/m" if not_measured else human(costs["max"]["peak_memory_bytes"], "B")
    v = costs["per_item"][key]
    return f"{1000 * v:.2f}" if key.endswith("_s") else human(v, "B" if key.startswith("kv") else "")


def _skipped(depth: dict | None) -> str:
    return "-" if depth is None else ",".join(map(str, depth["skipped_branch"] or depth["skipped_prefill"])) or "none"


def print_report(result: EvalResult, console=None) -> None:
    """Tables: accuracy and mismatch vs baseline per kind and probe; costs per item; retention and cost ratios;
    per ranker the largest budget reaching 90% retention. Their default columns fit 100 columns; a wide
    console (`trimvlm.terminal`, --wide) shows every column."""
    console = console or Terminal()
    labels = result.labels
    groups = [r for r in result.rows if r["recipe"] == labels[0]]
    summaries = [g for g in groups if g["group_type"] != "kind"]
    sheets = [] if len(labels) > WIDE else [_accuracy_columns(result, groups, console, 0)]
    if sheets and len(labels) > 1:
        sheets.append(_accuracy_columns(result, groups, console, 1))
    if not all(fits(console, s) for s in sheets):
        sheets = []
    for sheet in sheets or [_accuracy_rows(result, groups, console)]:
        console.print(sheet)
    _cost_tables(result, summaries, console)
    kind = result.row(labels[0])["costs"]["peak_memory_kind"]
    console.print(f"[dim]FLOPs: the model's (vision included) plus the methods' own (selection, attention probes, "
                  f"merges); KV bytes: held after any eviction, KV peak: the most held during a call; peak mem: "
                  f"{MEMORY_KINDS.get(kind, kind or 'not measured')}[/dim]")  # fmt: skip


WIDE = 6  # more recipes than this (or recipe columns wider than the console): one row per recipe


def _accuracy_columns(result: EvalResult, groups: list[dict], console, first: int) -> Sheet:
    """Accuracy % (`first` 0) or mismatch % vs the baseline (`first` 1) per kind and probe, one column per
    recipe."""
    labels = result.labels
    title = "accuracy %" if first == 0 else "mismatch % vs baseline"
    t = Sheet(console, f"{result.task.name}: {title}",
              ["kind", "probe", "metric", Col("n", right=True), *(Col(escape(x), right=True) for x in labels[first:])])  # fmt: skip
    for n, g in enumerate(groups):
        if g["group_type"] != "kind" and n > 0 and groups[n - 1]["group_type"] == "kind":
            t.section()
        rows = [result.row(label, g["group"]) for label in labels[first:]]
        cells = [_pct(r["accuracy"]) if first == 0 else f"{r['mismatch_pct']:.1f}" for r in rows]
        kind = g["group"] if g["group_type"] == "kind" else "all"
        probe = "every" if g["group_type"] == "all" else g["probe"]
        t.row(kind, probe, g["metric"], str(g["n"]), *cells, style="bold" if g["group_type"] != "kind" else None)
        if first == 0 and g["group_type"] == "all":
            t.row("all 95% CI", probe, "", "", *(ci_text(row_interval(result, lb)) for lb in labels[first:]),
                  style="dim")  # fmt: skip
            t.row("vs baseline", probe, "pts", "", *(diff_text(r.get("vs_baseline")) for r in rows), style="dim")
        for key, name in SUMMARY_ROWS if first == 0 else ():
            if all(key in r for r in rows):
                fmt = (lambda v: str(v)) if key == "abstained" else _pct
                t.row(f"{kind} {name}", probe, "", "", *(fmt(r[key]) for r in rows), style="dim")
    return t


def ci_text(interval: dict | None) -> str:
    """'93.6-96.9': a 95% interval in %, '-' where there is none."""
    return "-" if interval is None else f"{100 * interval['low']:.1f}-{100 * interval['high']:.1f}"


def diff_text(paired: dict | None) -> str:
    """'+1.2 (-0.3, 2.5)': a paired difference in points with its interval; '-' where there is none."""
    if paired is None:
        return "-"
    d = paired["diff"]
    return f"{100 * d['estimate']:+.1f} ({100 * d['low']:+.1f}, {100 * d['high']:+.1f})"


def _accuracy_rows(result: EvalResult, groups: list[dict], console) -> Sheet:
    """Many recipes: accuracy % per probe (per kind: with --wide), then mismatch % per probe, one row per
    recipe."""
    probes = [g for g in groups if g["group_type"] == "probe"]
    cols = [Col(f"{g['group']} acc", right=True, wide=g["group_type"] == "kind") for g in groups]
    cols += [Col("all 95% CI", right=True), Col("vs baseline (pts)", right=True, wide=True)]
    cols += [Col(f"{g['group']} mismatch", right=True) for g in probes]
    t = Sheet(console, f"{result.task.name}: accuracy % and mismatch % vs baseline ({len(result.labels)} recipes)",
              ["recipe", *cols])  # fmt: skip
    for label in result.labels:
        acc = [_pct(result.row(label, g["group"])["accuracy"]) for g in groups]
        mm = [f"{result.row(label, g['group'])['mismatch_pct']:.1f}" for g in probes]
        ci = [ci_text(row_interval(result, label)), diff_text(result.row(label).get("vs_baseline"))]
        t.row(escape(label), *acc, *ci, *mm, style="bold" if label == result.labels[0] else None)
    return t


def _cost_tables(result: EvalResult, summaries: list[dict], console) -> None:
    labels = result.labels
    cost = Sheet(console, "costs per item (latency in ms)",
                 ["recipe", "probe", *COST_COLS, Col("method FLOPs", right=True, wide=True)])  # fmt: skip
    ratio = Sheet(console, "cost / baseline (same items, interleaved; FLOPs = model + method)",
                  ["recipe", "probe", Col("skipped", right=True, wide=not any(result.depths)),
                   Col("retention %", right=True), *COST_COLS, Col("method share", right=True, wide=True)])  # fmt: skip
    for label, depth in zip(labels, result.depths, strict=True):
        for g in summaries:
            row = result.row(label, g["group"])
            style = "bold" if g["group_type"] == "all" else None
            cells = [_per_item(k, row["costs"]) for k, _ in COST_COLUMNS]
            cost.row(escape(label), g["group"], *cells, human(row["costs"]["per_item"]["method_flops"]), style=style)
            ratios = [_ratio(row["ratio"][k]) for k, _ in COST_COLUMNS]
            ratio.row(escape(label), g["group"], _skipped(depth), _pct(row["retention"]), *ratios,
                      _share(row["costs"]), style=style)  # fmt: skip
        for t in (cost, ratio) if len(summaries) > 1 else ():
            t.section()
    console.print(cost)
    if len(labels) > 1:
        console.print(ratio)
    if result.largest_budget:
        lb = Sheet(console, "largest tested budget with >= 90% mean retention",
                   ["ranker", "budgets tested", "largest budget", Col("retention %", right=True)])  # fmt: skip
        for ranker, *cells in _largest_budget_rows(result):
            lb.row(escape(ranker), *cells)
        console.print(lb)


MEMORY_KINDS = {
    "tensor_peak_over_start": "peak of live tensor bytes allocated during a call (CPU tensor tracker, in "
    "untimed calls on the same batches)",
    "cuda_allocator_peak_over_start": "CUDA allocator peak over the memory allocated at the call's start",
    "not_measured": "not measured",
}


def _share(costs: dict) -> str:
    """The methods' share of the total FLOPs."""
    total = costs["sum"]["total_flops"]
    return f"{100 * costs['sum']['method_flops'] / total:.1f}%" if total else "-"


# --------------------------------------------------------------------------------------------- markdown


def summary_table(result: EvalResult) -> tuple[list[str], list[list[str]]]:
    """The summary's heading and one row of cells per recipe: what it skips, accuracy and mismatch % per probe,
    retention, cost ratios to the baseline, the methods' share of the FLOPs."""
    probes = [g["group"] for g in result.rows if g["recipe"] == result.labels[0] and g["group_type"] == "probe"]
    head = ["recipe", "skipped", *(f"{p} {x}" for p in probes for x in ("acc", "acc 95% CI", "mismatch %")), "retention %",
            *(h for k, h in COST_COLUMNS if k != "total_flops"), "total FLOPs", "method share"]  # fmt: skip
    rows = []
    for label, depth in zip(result.labels, result.depths, strict=True):
        cells = [label, _skipped(depth)]
        for p in probes:
            row = result.row(label, p)
            cells += [_pct(row["accuracy"]), ci_text(row_interval(result, label, p)), f"{row['mismatch_pct']:.1f}"]
        row = result.row(label)
        keys = [k for k, _ in COST_COLUMNS if k != "total_flops"] + ["total_flops"]
        cells += [_pct(row.get("retention")), *(_ratio(row["ratio"].get(k)) for k in keys), _share(row["costs"])]
        rows.append(cells)
    return head, rows


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    """A Markdown table, one line per row, no trailing newline."""
    return "\n".join([_md_row(head), "|" + "---|" * len(head), *map(_md_row, rows)])


def markdown_summary(result: EvalResult) -> str:
    """One Markdown row per recipe (`summary_table`); then per ranker the largest budget reaching 90%
    retention."""
    lines = [markdown_table(*summary_table(result))]
    if result.largest_budget:
        head = ["ranker", "budgets tested", "largest budget with >= 90% retention", "retention %"]
        lines += ["", markdown_table(head, _largest_budget_rows(result))]
    return "\n".join(lines) + "\n"


class SavedResult:
    """An `EvalResult` read back from its JSON file (`write_json`), with what the Markdown writers read: rows,
    labels, depths, `row()` and the largest budgets."""

    def __init__(self, data: dict):
        self.data = data
        self.rows = data["results"]
        self.labels = [r["label"] for r in data["recipes"]]
        self.depths = [r.get("depth") for r in data["recipes"]]
        self.largest_budget = data.get("largest_budget_90") or {}
        self.task = SimpleNamespace(name=data["task"]["name"])
        self.items = data.get("items") or []
        predictions = data.get("predictions") or {}
        self.scores = [predictions.get(label, {}).get("scores") or [] for label in self.labels]

    @classmethod
    def load(cls, path: str | Path) -> SavedResult:
        return cls(json.loads(Path(path).read_text()))

    row = EvalResult.row  # the same look-up of a (recipe, group) row


def _largest_budget_rows(result) -> list[list[str]]:
    """Per ranker: its name, the budgets tested, the largest reaching 90% retention and that retention %."""
    return [[ranker, ",".join(map(str, e["tested"])), "-" if e["budget"] is None else str(e["budget"]),
             _pct(e["retention"])] for ranker, e in result.largest_budget.items()]  # fmt: skip


def _md_row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def check_writable(*paths) -> None:
    """Refuse, before any work, an output path whose folder cannot be made or written (InputError)."""
    for path in paths:
        if not path:
            continue
        path = Path(path)
        folder = next((p for p in [path.parent, *path.parent.parents] if p.exists()), Path("."))
        if path.is_dir():
            raise InputError(f"cannot write {path}: it is a folder")
        if not folder.is_dir():
            raise InputError(f"cannot write {path}: {folder} is a file, not a folder")
        if not os.access(folder, os.W_OK):
            raise InputError(f"cannot write {path}: {folder} is not writable")


def write_outputs(result, console, outputs) -> None:
    """Write `result` with each (path, writer) whose path is set, and say where it went."""
    for path, writer in outputs:
        if path:
            try:
                console.print(f"wrote {writer(result, path)}")
            except OSError as e:
                raise InputError(f"cannot write {path}: {e.strerror or e}") from e


def write_text(text: str, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def write_markdown(result: EvalResult, path: str | Path) -> Path:
    return write_text(markdown_summary(result), path)
