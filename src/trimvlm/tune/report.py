"""What `trimvlm tune` writes to its folder:

- `tune.json`: the whole report (budgets, each point's ranking and best, every last-round entry with its
  validation and test figures, the frontier per cost axis, what was skipped and why, recipes run / considered);
  `tuned=DIR:budget=X` reads it;
- `best.yaml`: the best recipe of every budget point (a recipes file: `trimvlm eval --recipes DIR/best.yaml`),
  and `best-<budget>.yaml`, one recipe each (`--recipe DIR/best-total_flops-0.75.yaml`);
- `recipes/<n>.yaml`: one recipe per frontier entry;
- `frontier.md` (the test figures as a table) and `frontier.png` (accuracy against each cost axis).
Every recipe file carries `tuned_for`, the model's fingerprint: another model refuses it.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from trimvlm.evals.report import human
from trimvlm.tune.search import FRONTIER_AXES

TUNE_FILE = "tune.json"


def best_file(budget_label: str) -> str:
    """best-total_flops-0.75.yaml: the file of one budget point's best recipe (no = or , in the name)."""
    return "best-" + budget_label.replace("=", "-").replace(",", "_") + ".yaml"


def _recipe(entry: dict, fingerprint: str, name: str) -> dict:
    return {**entry["recipe"], "name": name, "tuned_for": fingerprint}


def write_report(rep: dict, out: str | Path) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    by_spec = {e["spec"]: e for e in rep["entries"]}
    written = [out / TUNE_FILE]
    written[0].write_text(json.dumps(rep, indent=2, default=str) + "\n")
    best = []
    for b in rep["budgets"]:
        if b["best"] is None:
            continue
        r = _recipe(by_spec[b["best"]], rep["fingerprint"], f"tuned-{b['label']}")
        best.append(r)
        path = out / best_file(b["label"])
        path.write_text(yaml.safe_dump(r, sort_keys=False, width=200))
        written.append(path)
    (out / "best.yaml").write_text(yaml.safe_dump({"recipes": best}, sort_keys=False, width=200))
    folder = out / "recipes"
    folder.mkdir(exist_ok=True)
    for i, spec in enumerate(dict.fromkeys(s for f in rep["frontier"].values() for s in f if s != "baseline")):
        path = folder / f"{i:02d}.yaml"
        path.write_text(yaml.safe_dump(_recipe(by_spec[spec], rep["fingerprint"], spec), sort_keys=False, width=200))
        written.append(path)
    (out / "frontier.md").write_text(markdown(rep))
    written += [out / "best.yaml", out / "frontier.md", plot(rep, out / "frontier.png")]
    return written


def _cell(e: dict) -> str:
    t = e.get("test")
    if not t:
        return "-"
    probes = t.get("by_probe", {})
    mm = " / ".join(f"{probes[p]['mismatch_pct']:.1f}" for p in ("prefill", "full") if p in probes)
    return f"{100 * t['accuracy']:.1f}% (mismatch {mm})"


def markdown(rep: dict) -> str:
    by_spec = {e["spec"]: e for e in rep["entries"]}
    lines = [f"# trimvlm tune: {rep['model'].get('family', '')} on {rep['task']}", "",
             f"Searched on {rep['n_val']} {rep['splits']['val']} items, reported on {rep['n_test']} "
             f"{rep['splits']['test']} items. Candidates run: {rep['ran']} of {rep['considered']} considered "
             f"({len(rep['skipped'])} skipped before running, {rep.get('left_out_by_beam', 0)} joint families "
             f"not formed by the beam; {rep['evaluated_recipes']} recipes evaluated, keep corrections included).", "",
             "| budget | best recipe | test accuracy (mismatch % prefill / full) | total FLOPs | KV bytes | latency |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for b in rep["budgets"]:
        e = by_spec.get(b["best"]) if b["best"] else None
        if e is None:
            lines.append(f"| {b['label']} | none fits | - | - | - | - |")
            continue
        ratio = e["test"]["ratio"]
        lines.append(f"| {b['label']} | `{e['spec']}` | {_cell(e)} | {ratio['total_flops']:.3f}x | "
                     f"{ratio['kv_bytes']:.3f}x | {ratio['latency_s']:.3f}x |")  # fmt: skip
    base = by_spec["baseline"]
    lines += ["", f"Baseline: {_cell(base)}, {human(base['test'].get('n', 0))} items.", "", "## Frontier (test figures)",
              "", "| recipe | on the frontier of | test accuracy | total FLOPs | KV bytes | latency |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for spec in dict.fromkeys(s for f in rep["frontier"].values() for s in f):
        e = by_spec[spec]
        axes = ", ".join(a for a in FRONTIER_AXES if spec in rep["frontier"][a])
        ratio = e["test"]["ratio"]
        lines.append(f"| `{spec}` | {axes} | {_cell(e)} | {ratio['total_flops']:.3f}x | {ratio['kv_bytes']:.3f}x | "
                     f"{ratio['latency_s']:.3f}x |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(rep: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(FRONTIER_AXES), figsize=(5 * len(FRONTIER_AXES), 4), squeeze=False)
    tested = [e for e in rep["entries"] if e.get("test")]
    for ax, axis in zip(axes[0], FRONTIER_AXES, strict=True):
        xs = [e["test"]["ratio"][axis] for e in tested]
        ys = [100 * e["test"]["accuracy"] for e in tested]
        ax.scatter(xs, ys)
        for e, x, y in zip(tested, xs, ys, strict=True):
            ax.annotate(e["family"], (x, y), fontsize=6)
        ax.set_xlabel(f"{axis} (ratio to baseline)")
        ax.set_ylabel("test accuracy %")
    fig.suptitle(f"trimvlm tune: {rep['task']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
