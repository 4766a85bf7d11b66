"""What `trimvlm tune` writes to its folder (docs/tune.md lists it): `tune.json` (the whole report, which
`tuned=DIR:budget=X` reads), `best.yaml` and `best-<budget>.yaml` (each point's best), `recipes/<n>.yaml` (one per
frontier entry), `frontier.md` and `frontier.png`. Every recipe file carries `tuned_for`, the model's
fingerprint: another model refuses it.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from trimvlm.evals.plot import label_points, save
from trimvlm.evals.report import human
from trimvlm.tune.budgets import RESULT_KEY
from trimvlm.tune.search import FRONTIER_AXES

TUNE_FILE = "tune.json"


def best_file(budget_label: str) -> str:
    """best-total_flops-0.75.yaml: the file of one budget point's best recipe (no = or , in the name)."""
    return "best-" + budget_label.replace("=", "-").replace(",", "_") + ".yaml"


def _recipe(entry: dict, fingerprint: str, name: str) -> dict:
    return {**entry["recipe"], "name": name, "tuned_for": fingerprint}


def _write(path: Path, data) -> Path:
    """`data` written to `path` (a str as it is, anything else as YAML); the path."""
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False, width=200))
    return path


def write_report(rep: dict, out: str | Path) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    by_spec = {e["spec"]: e for e in rep["entries"]}
    written = [_write(out / TUNE_FILE, json.dumps(rep, indent=2, default=str) + "\n")]
    best = {b["label"]: _recipe(by_spec[b["best"]], rep["fingerprint"], f"tuned-{b['label']}")
            for b in rep["budgets"] if b["best"] is not None}  # fmt: skip
    written += [_write(out / best_file(label), r) for label, r in best.items()]
    folder = out / "recipes"
    folder.mkdir(exist_ok=True)
    frontier = dict.fromkeys(s for f in rep["frontier"].values() for s in f if s != "baseline")
    written += [_write(folder / f"{i:02d}.yaml", _recipe(by_spec[s], rep["fingerprint"], s))
                for i, s in enumerate(frontier)]  # fmt: skip
    written += [_write(out / "best.yaml", {"recipes": list(best.values())}), _write(out / "frontier.md", markdown(rep)),
                plot(rep, out / "frontier.png")]  # fmt: skip
    for stale in [*out.glob(best_file("*")), *folder.glob("[0-9][0-9].yaml")]:  # an earlier search's, in this folder
        if stale not in written:
            stale.unlink()
    return written


def _cell(e: dict) -> str:
    t = e.get("test")
    if not t:
        return "-"
    probes = t.get("by_probe", {})
    mm = " / ".join(f"{probes[p]['mismatch_pct']:.1f}" for p in ("prefill", "full") if p in probes)
    return f"{100 * t['accuracy']:.1f}% (mismatch {mm})"


def _ratios(e: dict) -> str:
    """An entry's test ratios to the baseline: total FLOPs | KV bytes | latency."""
    return " | ".join(f"{e['test']['ratio'][k]:.3f}x" for k in ("total_flops", "kv_bytes", "latency_s"))


def candidates_run(rep: dict) -> str:
    """How many candidates ran of those considered, and how many recipes were evaluated."""
    return (f"{rep['ran']} of {rep['considered']} considered ({len(rep['skipped'])} skipped before running, "
            f"{rep.get('left_out_by_beam', 0)} joint families not formed by the beam; {rep['evaluated_recipes']} "
            "recipes evaluated, keep corrections included)")  # fmt: skip


def best_entries(rep: dict) -> list[tuple[str, dict | None]]:
    """Each budget point's label and the entry of its best recipe (None: no recipe fits it)."""
    by_spec = {e["spec"]: e for e in rep["entries"]}
    return [(b["label"], by_spec.get(b["best"]) if b["best"] else None) for b in rep["budgets"]]


def markdown(rep: dict) -> str:
    by_spec = {e["spec"]: e for e in rep["entries"]}
    lines = [f"# trimvlm tune: {rep['model'].get('family', '')} on {rep['task']}", "",
             f"Searched on {rep['n_val']} {rep['splits']['val']} items, reported on {rep['n_test']} "
             f"{rep['splits']['test']} items. Candidates run: {candidates_run(rep)}.", "",
             "| budget | best recipe | test accuracy (mismatch % prefill / full) | total FLOPs | KV bytes | latency |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name, e in best_entries(rep):
        lines.append(f"| {name} | none fits | - | - | - | - |" if e is None else
                     f"| {name} | `{e['spec']}` | {_cell(e)} | {_ratios(e)} |")  # fmt: skip
    base = by_spec["baseline"]
    lines += ["", f"Baseline: {_cell(base)}, {human(base['test'].get('n', 0))} items.", "", "## Frontier (test figures)",
              "", "| recipe | on the frontier of | test accuracy | total FLOPs | KV bytes | latency |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for spec in dict.fromkeys(s for f in rep["frontier"].values() for s in f):
        e = by_spec[spec]
        axes = ", ".join(a for a in FRONTIER_AXES if spec in rep["frontier"][a])
        lines.append(f"| `{spec}` | {axes} | {_cell(e)} | {_ratios(e)} |")
    return "\n".join(lines) + "\n"


SHORT_FORMS = ("short names: METHOD_lL = a token reducer before layer L; +bi / +sens / +kl / +tail / +random = "
               "a depth ranker (block influence, sensitivity, greedy KL, the blocks before the last, random) with "
               "_bN = N blocks skipped; +METHOD_kK = a KV policy keeping K")


def plot(rep: dict, path: Path) -> Path:
    """Write `frontier_figure` as PNG to `path`."""
    return save(frontier_figure(rep), path)


def frontier_figure(rep: dict):
    """Test accuracy against each cost axis. Every evaluated recipe is a grey dot; the frontier of that axis is
    a line with its points named; each budget is a dashed line on its axis, and its best recipe a red star named
    in full below the panels. The short names are explained in the figure."""
    from matplotlib.figure import Figure

    by_spec = {e["spec"]: e for e in rep["entries"]}
    tested = [e for e in rep["entries"] if e.get("test")]
    winners = {b["best"]: b["label"] for b in rep["budgets"] if b["best"]}
    fig = Figure(figsize=(6 * len(FRONTIER_AXES), 5.6))
    axes = fig.subplots(1, len(FRONTIER_AXES), squeeze=False)
    for ax, axis in zip(axes[0], FRONTIER_AXES, strict=True):
        pts = {e["spec"]: (e["test"]["ratio"][axis], 100 * e["test"]["accuracy"]) for e in tested}
        ax.scatter([x for x, _ in pts.values()], [y for _, y in pts.values()], s=14, color="0.7", zorder=2)
        front = [s for s in rep["frontier"].get(axis, []) if s in pts]
        front.sort(key=lambda s: pts[s][0])
        ax.plot([pts[s][0] for s in front], [pts[s][1] for s in front], "-o", color="C0", ms=4, zorder=3,
                label=f"frontier on {axis}")  # fmt: skip
        label_points(ax, [(pts[s], by_spec[s]["family"]) for s in front])
        for b in rep["budgets"]:
            for key, ratio in b["budget"].items():
                if RESULT_KEY[key] == axis:
                    ax.axvline(ratio, ls="--", color="C3", lw=0.8, zorder=1)
                    ax.text(ratio, 0.98, f"budget {ratio:g}x ", transform=ax.get_xaxis_transform(), fontsize=7,
                            color="C3", va="top", ha="right", rotation=90)  # fmt: skip
        for n, spec in enumerate(winners):
            if spec in pts:
                ax.scatter(*pts[spec], marker="*", s=180, color="C3", edgecolors="k", zorder=4,
                           label="best per budget" if n == 0 else None)  # fmt: skip
        ax.set_xlabel(f"{axis} (ratio to baseline, test split)")
        ax.set_ylabel("test accuracy %")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    best = "; ".join(f"{label}: {spec}" for spec, label in winners.items()) or "no budget met"
    fig.suptitle(f"trimvlm tune: {rep['task']} ({rep['n_val']} validation items searched, {rep['n_test']} test items)")
    fig.text(0.01, 0.06, f"best: {best}", fontsize=8, wrap=True)
    fig.text(0.01, 0.02, SHORT_FORMS, fontsize=7, color="0.3", wrap=True)
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    return fig
