"""Reports of an `EvalResult`: rich tables in the terminal, a JSON file with every number, a Pareto PNG."""

from __future__ import annotations

import json
import platform
from pathlib import Path

from trimvlm.evals.run import EvalResult


def versions() -> dict[str, str]:
    import torch
    import transformers

    import trimvlm

    return {
        "trimvlm": trimvlm.__version__,
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


SUMMARY_ROWS = (("f1", "F1"), ("yes_ratio", "yes-ratio"))  # metric extras shown under their group's accuracy


def print_report(result: EvalResult, console=None) -> None:
    """Tables: accuracy / mismatch vs baseline per kind and probe kind; costs per item; cost ratios."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    labels = result.labels
    groups = [r for r in result.rows if r["recipe"] == labels[0]]
    summaries = [g for g in groups if g["group_type"] != "kind"]

    tables = [("accuracy %", 0)] + ([("mismatch % vs baseline", 1)] if len(labels) > 1 else [])
    for title, first in tables:
        t = Table(title=f"{result.task.name}: {title}", title_justify="left")
        t.add_column("kind", no_wrap=True)
        t.add_column("probe", no_wrap=True)
        t.add_column("metric", no_wrap=True)
        t.add_column("n", justify="right")
        for label in labels[first:]:
            t.add_column(escape(label), justify="right")
        for n, g in enumerate(groups):
            if g["group_type"] != "kind" and n > 0 and groups[n - 1]["group_type"] == "kind":
                t.add_section()
            rows = [result.row(label, g["group"]) for label in labels[first:]]
            if first == 0:
                cells = [f"{100 * r['accuracy']:.1f}" for r in rows]
            else:
                cells = [f"{r['mismatch_pct']:.1f}" for r in rows]
            kind = g["group"] if g["group_type"] == "kind" else "all"
            probe = "both" if g["group_type"] == "all" else g["probe"]
            style = "bold" if g["group_type"] != "kind" else None
            t.add_row(kind, probe, g["metric"], str(g["n"]), *cells, style=style)
            for key, name in SUMMARY_ROWS if first == 0 else ():
                if all(key in r for r in rows):
                    cells = (f"{100 * r[key]:.1f}" for r in rows)
                    t.add_row(f"{kind} {name}", probe, "", "", *cells, style="dim")
        console.print(t)

    cost = Table(title="costs per item (model FLOPs and the methods' own FLOPs on separate columns)",
                 title_justify="left")  # fmt: skip
    cols = ("recipe", "probe", "prefill FLOPs", "decode FLOPs", "method FLOPs", "KV bytes", "latency ms", "peak mem")
    for col in cols:
        cost.add_column(
            col, justify="left" if col in ("recipe", "probe") else "right", no_wrap=col in ("recipe", "probe")
        )
    for label in labels:
        for g in summaries:
            row = result.row(label, g["group"])
            per = row["costs"]["per_item"]
            cost.add_row(
                escape(label),
                g["group"],
                human(per["prefill_flops"]),
                human(per["decode_flops"]),
                human(per["method_flops"]),
                human(per["kv_bytes"], "B"),
                f"{1000 * per['latency_s']:.2f}",
                _peak(row["costs"]),
                style="bold" if g["group_type"] == "all" else None,
            )
        if len(summaries) > 1:
            cost.add_section()
    console.print(cost)

    if len(labels) > 1:
        keys = ("prefill_flops", "decode_flops", "total_flops", "kv_bytes", "latency_s", "peak_memory_bytes")
        ratio = Table(
            title="cost / baseline (same items, interleaved; FLOPs = model + method)", title_justify="left"
        )
        for col in (
            "recipe",
            "probe",
            "prefill FLOPs",
            "decode FLOPs",
            "FLOPs",
            "method share",
            "KV bytes",
            "latency",
            "peak mem",
        ):
            ratio.add_column(
                col,
                justify="left" if col in ("recipe", "probe") else "right",
                no_wrap=col in ("recipe", "probe"),
            )
        for label in labels[1:]:
            for g in summaries:
                row = result.row(label, g["group"])
                cells = [_ratio(row["ratio"][k]) for k in keys]
                cells.insert(3, _share(row["costs"]))
                ratio.add_row(
                    escape(label),
                    g["group"],
                    *cells,
                    style="bold" if g["group_type"] == "all" else None,
                )
            if len(summaries) > 1:
                ratio.add_section()
        console.print(ratio)
    kind = result.row(labels[0], "all")["costs"]["peak_memory_kind"]
    console.print(f"[dim]prefill/decode FLOPs: the model's; method FLOPs: the methods' own matmuls (selection, "
                  f"attention probes, merges); peak mem: {MEMORY_KINDS.get(kind, kind or 'not measured')}[/dim]")  # fmt: skip


MEMORY_KINDS = {
    "tensor_peak_over_start": "peak of live tensor bytes allocated during a call (CPU tensor tracker, in "
    "untimed calls on the same batches)",
    "cuda_allocator_peak_over_start": "CUDA allocator peak over the memory allocated at the call's start",
    "not_measured": "not measured",
}


def _peak(costs: dict) -> str:
    if costs.get("peak_memory_kind") in ("", "not_measured", None):
        return "n/m"
    return human(costs["max"]["peak_memory_bytes"], "B")


def _share(costs: dict) -> str:
    """The methods' share of the total FLOPs."""
    total = costs["sum"]["total_flops"]
    return f"{100 * costs['sum']['method_flops'] / total:.1f}%" if total else "-"


# --------------------------------------------------------------------------------------------- markdown


def markdown_summary(result: EvalResult) -> str:
    """One Markdown row per recipe: accuracy and mismatch % per probe type, cost ratios to the baseline."""
    probes = [
        g["group"] for g in result.rows if g["recipe"] == result.labels[0] and g["group_type"] == "probe"
    ]
    head = ["recipe"]
    for p in probes:
        head += [f"{p} acc", f"{p} mismatch %"]
    head += ["prefill FLOPs", "decode FLOPs", "total FLOPs", "method share", "KV bytes", "peak mem"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in result.labels:
        cells = [label]
        for p in probes:
            row = result.row(label, p)
            cells += [f"{100 * row['accuracy']:.1f}", f"{row['mismatch_pct']:.1f}"]
        row = result.row(label, "all")
        ratio = row["ratio"]
        cells += [_ratio(ratio[k]) for k in ("prefill_flops", "decode_flops", "total_flops")]
        cells += [_share(row["costs"]), _ratio(ratio["kv_bytes"]), _ratio(ratio["peak_memory_bytes"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def check_writable(*paths) -> None:
    """Refuse, before any work, an output path whose folder cannot be made or written (InputError)."""
    import os

    from trimvlm.errors import InputError

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
    from trimvlm.errors import InputError

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


# --------------------------------------------------------------------------------------------- plot


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the non-dominated points (lower cost x, higher accuracy y), sorted by x."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], float("-inf")
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


MARKERS = ["*", "o", "s", "^", "D", "v", "P", "X", "<", ">"]
PROBE_TITLES = {"prefill": "prefill-probe items", "full": "full-pipeline-probe items"}


def plot_pareto(result: EvalResult, path: str | Path) -> Path:
    """Accuracy against three cost axes: total FLOPs (model + method), KV bytes and peak memory, each as a
    ratio to the baseline; one point per recipe (the same colour and marker in every panel, named in the
    legend; the baseline is the star at 1.0), the Pareto front as a step line; one row of panels per probe kind
    (prefill / full). A panel whose cost was not measured stays empty."""
    from matplotlib.figure import (
        Figure,
    )  # a bare Figure renders PNG with Agg; pyplot's global state untouched

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    probes = [
        r["group"] for r in result.rows if r["recipe"] == result.labels[0] and r["group_type"] == "probe"
    ]
    axes_spec = (
        ("total_flops", "FLOPs (model + method) / baseline"),
        ("kv_bytes", "KV bytes / baseline"),
        ("peak_memory_bytes", "peak memory / baseline"),
    )
    fig = Figure(figsize=(15.5, 3.8 * max(1, len(probes))), layout="constrained")
    grid = fig.subplots(max(1, len(probes)), 3, squeeze=False)
    colors = [f"C{k % 10}" for k in range(len(result.labels))]
    for i, probe in enumerate(probes):
        for j, (key, xlabel) in enumerate(axes_spec):
            ax = grid[i][j]
            pts, shown = [], []
            for k, label in enumerate(result.labels):
                row = result.row(label, probe)
                x = row["ratio"][key]
                if x is None:  # the baseline spent nothing of this kind either
                    x = 1.0 if k == 0 else float("nan")
                y = 100 * row["accuracy"]
                ax.scatter(
                    [x],
                    [y],
                    s=140 if k == 0 else 60,
                    marker=MARKERS[k % len(MARKERS)],
                    color=colors[k],
                    alpha=0.85,
                    zorder=3 + k,
                    label=label,
                )
                if x == x:
                    pts.append((x, y))
                    shown.append(y)
            front = [pts[n] for n in pareto_front(pts)]
            if len(front) > 1:
                ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="grey", alpha=0.5)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("accuracy (%)")
            ax.set_title(
                f"{PROBE_TITLES.get(probe, probe)} ({result.row(result.labels[0], probe)['n']})", fontsize=10
            )
            ax.grid(alpha=0.3)
            ax.set_xlim(left=0, right=max(1.1, ax.get_xlim()[1]))
            if shown:
                ax.set_ylim(max(-2.0, min(shown) - 8), min(102.0, max(shown) + 8))
    handles, names = grid[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside right upper", fontsize=8, title="recipe")
    fig.suptitle(f"trimvlm eval: {result.task.name}, accuracy vs cost (Pareto front in grey)")
    fig.savefig(path, dpi=110)
    return path
