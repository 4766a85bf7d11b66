"""Write every figure table of README.md and docs/ from the results files in docs/results/ (`make results`).

A table lives between two markers; the opening one names its results file (relative to docs/results/, without
`.json`) and, optionally, what to show:

    <!-- results:tokens-demo rows="baseline; density k25 L2" cols="recipe; full mismatch % = full mm %" -->
    (written by this script)
    <!-- /results -->

- `cols`: the columns, `;`-separated. For an eval result (`trimvlm eval --json`) they are headings of its
  Markdown summary (`trimvlm.evals.report.summary_table`); for any other file, keys of its rows (dotted for
  nested ones) with an optional format after a colon (`throughput_rps:.1f`, `accuracy:%` for a percentage,
  `speedup:x` for a ratio). `= heading` renames a column.
- `rows`: for an eval result, the recipe labels to keep (default: all); otherwise the key of the list of rows in
  the file (default `rows`).
- `where`: `key=value` filters on rows (`;`-separated, all must hold).
- `table`: `rows` (the generic rows renderer, also for an eval result), `pivot` (an eval result as a grid of
  recipes: `pattern`, `cell`), or a renderer for a file of its
  own shape (`budget`, `tune`, `scoring`, `scan`).

`python benchmarks/write_results.py` rewrites the tables in place; `--check` writes nothing and exits 1 when a
table differs from what its results file gives (tests/test_results_tables.py runs it).
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import shlex
import sys
from pathlib import Path

from trimvlm.evals.report import SavedResult, markdown_table, summary_table

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"(<!-- results:(?P<name>[\w./-]+)(?P<args>[^\n]*?)-->\n)(?P<body>.*?)(<!-- /results -->)", re.S)


def documents(root: Path = ROOT) -> list[Path]:
    """README.md and the docs pages (the per-run Markdown files under docs/results/ are not pages)."""
    return [root / "README.md", *sorted(p for p in (root / "docs").rglob("*.md") if "results" not in p.parts)]


# --------------------------------------------------------------------------------------------- cells


def _get(row: dict, key: str):
    if key in row:  # a key with a dot in it
        return row[key]
    for part in key.split("."):
        row = row[part]
    return row


def _fmt(value, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt.startswith("r") and isinstance(value, list | tuple):  # a spread [lo, hi]: "lo-hi"
        return "-".join(format(v, fmt[1:]) for v in value)
    if fmt == "%":
        return f"{100 * value:.1f}"
    if fmt == "x":
        return f"{value:.2f}x"
    if fmt:
        return format(value, fmt)
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _columns(spec: str | None) -> list[tuple[str, str]]:
    """'key:fmt = heading; ...' -> [(key:fmt, heading)]."""
    cols = []
    for part in (spec or "").split(";"):
        if part.strip():
            key, _, heading = part.partition("=")
            cols.append((key.strip(), heading.strip() or key.strip().split(":")[0]))
    return cols


def _matches(row: dict, where: str | None) -> bool:
    for cond in (where or "").split(";"):
        if cond.strip():
            key, _, value = cond.partition("=")
            if str(_get(row, key.strip())) != value.strip():
                return False
    return True


# --------------------------------------------------------------------------------------------- renderers


def eval_table(data: dict, args: dict) -> str:
    head, rows = summary_table(SavedResult(data))
    if args.get("rows"):
        by_label = {r[0]: r for r in rows}
        rows = [by_label[label.strip()] for label in args["rows"].split(";") if label.strip()]
    cols = _columns(args.get("cols")) or [(h, h) for h in head]
    index = [head.index(key) for key, _ in cols]
    return markdown_table([h for _, h in cols], [[r[i] for i in index] for r in rows])


def pivot_table(data: dict, args: dict) -> str:
    """An eval result as a grid: `pattern` (a regex on the recipe labels, groups named row... and col) puts each
    recipe in a row and a column, `cell` names the summary column shown; labels that do not match are left out.
    `rows` / `cols` (`;`-separated) fix their order, otherwise the order of first appearance."""
    head, rows = summary_table(SavedResult(data))
    at = head.index(args.get("cell", "full acc"))
    pattern = re.compile(args["pattern"])
    grid: dict[str, dict[str, str]] = {}
    cols: list[str] = []
    for r in rows:
        m = pattern.fullmatch(r[0])
        if m is None:
            continue
        row = " ".join(v for k, v in sorted(m.groupdict().items()) if k.startswith("row") and v)
        grid.setdefault(row, {})[m["col"]] = r[at]
        cols += [m["col"]] if m["col"] not in cols else []
    order = [x.strip() for x in args.get("rows", "").split(";") if x.strip()] or list(grid)
    cols = [x.strip() for x in args.get("cols", "").split(";") if x.strip()] or cols
    cells = [[row, *(grid.get(row, {}).get(c, "-") for c in cols)] for row in order]
    return markdown_table([args.get("corner", "recipe"), *cols], cells)


def rows_table(data: dict, args: dict) -> str:
    rows = [r for r in _get(data, args.get("rows", "rows")) if _matches(r, args.get("where"))]
    cols = _columns(args.get("cols")) or [(k, k) for k, v in rows[0].items() if not isinstance(v, dict | list)]
    cells = []
    for r in rows:
        line = []
        for key, _ in cols:
            key, _, fmt = key.partition(":")
            line.append(_fmt(_get(r, key), fmt))
        cells.append(line)
    return markdown_table([h for _, h in cols], cells)


def _acc_cell(e: dict) -> str:
    """A budget table's entry: accuracy (mismatch % prefill / full; realised total-FLOP ratio)."""
    mm = e["mismatch_pct"]
    return f"{100 * e['accuracy']:.1f}% ({mm['prefill']:.1f} / {mm['full']:.1f}; {e['total_flops']:.3f}x)"


def budget_table(data: dict, args: dict) -> str:
    """`benchmarks/budget_table.py`'s file: one row per budget, one column per contender."""
    contenders = [c.strip() for c in args.get("cols", "tuned; fastv; naive; router v1; router v2").split(";")]
    head = ["budget", *contenders]
    rows = [[f"{int(r['budget'][1:]) / 100:.2f}x", *(_acc_cell(r[c]) if r.get(c) else "-" for c in contenders)]
            for r in data["rows"]]  # fmt: skip
    return markdown_table(head, rows)


def tune_table(data: dict, args: dict) -> str:
    """`trimvlm tune`'s tune.json: the best recipe per budget. Its test figures are not repeated here: the budget
    tables (`benchmarks/budget_table.py`) measure the same recipes beside the other contenders."""
    by_spec = {e["spec"]: e for e in data["entries"]}
    rows = []
    for b in data["budgets"]:
        e = by_spec.get(b["best"]) if b["best"] else None
        rows.append([b["label"], f"`{e['spec']}`" if e else "none fits"])
    return markdown_table(["budget", f"best recipe ({data['n_val']} validation items searched)"], rows)


def scoring_table(data: dict, args: dict) -> str:
    """A candidate-scoring eval (`--task demo-candidates`): accuracy per kind, retention and costs."""
    base = data["results"][0]
    kinds = list(base["kinds"])
    head = ["recipe", "skipped", *kinds, "all", "retention %", "branch FLOPs", "total FLOPs"]
    keep = [x.strip() for x in args.get("rows", "").split(";") if x.strip()]
    rows = []
    for r, rec in zip(data["results"], data["recipes"], strict=True):
        if keep and r["recipe"] not in keep:
            continue
        depth = r.get("depth") or rec.get("depth")
        skipped = "-" if depth is None else ",".join(map(str, depth.get("skipped_branch") or [])) or "none"
        ratio = {k: r["costs"]["sum"][k] / base["costs"]["sum"][k] for k in ("branch_flops", "total_flops")}
        rows.append([r["recipe"], skipped, *(f"{100 * r['kinds'][k]['accuracy']:.1f}" for k in kinds),
                     f"{100 * r['accuracy']:.1f}", f"{100 * r['retention']:.1f}",
                     f"{ratio['branch_flops']:.2f}x", f"{ratio['total_flops']:.2f}x"])  # fmt: skip
    return markdown_table(head, rows)


def scan_table(data: dict, args: dict) -> str:
    """`benchmarks/scoring_scan.py`'s summary, one row per model."""
    cols = _columns(args.get("cols"))
    rows = []
    for model, s in data["summary"].items():
        rows.append([model, *(_fmt(_get(s, k.partition(":")[0]), k.partition(":")[2]) for k, _ in cols)])
    return markdown_table(["model", *(h for _, h in cols)], rows)


TABLES = {"rows": rows_table, "pivot": pivot_table, "budget": budget_table, "tune": tune_table, "scoring": scoring_table, "scan": scan_table}


def render(name: str, args: dict, results: Path) -> str:
    path = results / f"{name}.json"
    data = json.loads(path.read_text())
    if "table" in args:
        return TABLES[args["table"]](data, args)
    if isinstance(data.get("results"), list) and data["results"] and "group_type" in data["results"][0]:
        return eval_table(data, args)
    return rows_table(data, args)


# --------------------------------------------------------------------------------------------- documents


def rewrite(text: str, results: Path) -> str:
    def one(m: re.Match) -> str:
        args = dict(a.split("=", 1) for a in shlex.split(m["args"]))
        return m.group(1) + render(m["name"], args, results) + "\n" + m.group(5)

    return MARKER.sub(one, text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table differs")
    ap.add_argument("--root", type=Path, default=ROOT, help="the repository (README.md, docs/)")
    a = ap.parse_args(argv)
    results = a.root / "docs" / "results"
    stale = []
    for doc in documents(a.root):
        old = doc.read_text()
        new = rewrite(old, results)
        if new == old:
            continue
        stale.append(doc)
        if a.check:
            rel = str(doc.relative_to(a.root))
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True), rel, rel))
        else:
            doc.write_text(new)
            print(f"wrote {doc.relative_to(a.root)}")
    if a.check and stale:
        print(f"{len(stale)} file(s) differ from docs/results/: run `make results`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
