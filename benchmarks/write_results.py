"""Write every figure table and figure of README.md and docs/ from the results files in docs/results/
(`make results`).

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

A marker with `figure=KIND` holds a figure instead: `make results` draws `docs/results/NAME.png` (or
`png=PATH`, relative to docs/results/, without `.png`) from the results file and writes the image link between
the markers (`alt=` its text, also the figure's title). Kinds: `pareto` (an eval result: `trimvlm.evals.plot`;
`rows` = the recipes named in colour, default the baseline and the frontier's), `scoring` (a candidate-scoring
file, the same figure) and `tune` (`trimvlm tune`'s tune.json: its frontier plot). The PNG keeps a digest of the
results file and the marker's arguments; a figure whose digest differs is drawn again (`--redraw`: every one).

`python benchmarks/write_results.py` rewrites the tables and figures in place; `--check` writes nothing and exits
1 when a table differs from what its results file gives, a figure is missing or was drawn from another file or
other arguments, or a PNG in docs/results/ is no marker's figure (tests/test_results_tables.py runs it).
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import NamedTuple

from trimvlm.evals import plot
from trimvlm.evals.intervals import wilson
from trimvlm.evals.report import SavedResult, ci_text, diff_text, markdown_table, summary_table
from trimvlm.evals.run import compare
from trimvlm.tune.report import frontier_figure

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
    """A budget table's entry: accuracy [its 95% interval] (mismatch % prefill / full; realised total-FLOP ratio),
    then, where the file holds it, the paired difference against the tuned recipe in points with its interval."""
    mm = e["mismatch_pct"]
    iv = f" [{ci_text(e['interval'])}]" if e.get("interval") else ""
    cell = f"{100 * e['accuracy']:.1f}%{iv} ({mm['prefill']:.1f} / {mm['full']:.1f}; {e['total_flops']:.3f}x)"
    return cell + (f"; vs tuned {diff_text(e['vs_tuned'])}" if e.get("vs_tuned") else "")


def budget_table(data: dict, args: dict) -> str:
    """`benchmarks/budget_table.py`'s file: one row per budget, one column per contender."""
    contenders = [c.strip() for c in args.get("cols", "tuned; fastv; naive; router v1; router v2").split(";")]
    head = ["budget", *contenders]
    rows = [[f"{int(r['budget'][1:]) / 100:.2f}x", *(_acc_cell(r[c]) if r.get(c) else "-" for c in contenders)]
            for r in data["rows"]]  # fmt: skip
    return markdown_table(head, rows)


def tune_table(data: dict, args: dict) -> str:
    """`trimvlm tune`'s tune.json: the best recipe per budget and its figures on the held-out test items:
    accuracy with its 95% Wilson interval, realised total-FLOP and latency ratios against the baseline."""
    by_spec = {e["spec"]: e for e in data["entries"]}
    rows = []
    for b in data["budgets"]:
        e = by_spec.get(b["best"]) if b["best"] else None
        test = (e or {}).get("test") or {}
        if not test:
            rows.append([b["label"], f"`{e['spec']}`" if e else "none fits", "-", "-", "-"])
            continue
        iv = wilson(round(test["accuracy"] * test["n"]), test["n"])
        ratio = test["ratio"]
        rows.append([b["label"], f"`{e['spec']}`", f"{100 * test['accuracy']:.1f}% [{100 * iv.low:.1f}-{100 * iv.high:.1f}]",
                     f"{ratio['total_flops']:.3f}x", f"{ratio['latency_s']:.2f}x"])  # fmt: skip
    n_test = data.get("n_test", "?")
    head = ["budget", f"best recipe ({data['n_val']} validation items searched)",
            f"test accuracy [95% CI] ({n_test} items)", "total FLOPs", "latency"]  # fmt: skip
    return markdown_table(head, rows)


def paired_table(data: dict, args: dict) -> str:
    """Paired comparisons on the same items: `pairs` ("A vs B; C vs D"), `group` (all, a kind or a probe; default
    all), or `groups` ("all; count; relation": a row per group and pair, the group named in a first column). Each
    row: both accuracies, A - B in points with its 95% paired-bootstrap interval, McNemar's exact p-value, and the
    verdict: "A ahead" or "B ahead" only where the interval excludes zero and p < 0.05."""
    result = SavedResult(data)
    groups = [g.strip() for g in args.get("groups", args.get("group", "all")).split(";") if g.strip()]
    rows, ns = [], set()  # ns: the items compared (one group: one count)
    for group in groups:
        for pair in (x for x in args["pairs"].split(";") if x.strip()):
            a, b = (x.strip() for x in pair.split(" vs "))
            paired = compare(result, a, b, group)
            ns.add(paired.n)
            d = paired.diff
            shown = paired.p_value < 0.05  # and the interval excludes zero: both tests agree
            verdict = f"{a} ahead" if shown and d.low > 0 else f"{b} ahead" if shown and d.high < 0 else "no difference shown"
            acc = [100 * result.row(x, group)["accuracy"] for x in (a, b)]
            rows.append([*([f"{group} ({paired.n})"] if "groups" in args else []), a, b, f"{acc[0]:.1f}", f"{acc[1]:.1f}",
                         f"{100 * d.estimate:+.1f} ({100 * d.low:+.1f}, {100 * d.high:+.1f})", f"{paired.p_value:.3g}",
                         verdict])  # fmt: skip
    items = "" if "groups" in args else f", {ns.pop() if ns else 0} items"
    head = ["A", "B", "A acc", "B acc", f"A - B, points (95% CI{items})", "p", "verdict"]
    return markdown_table([*(["group (items)"] if "groups" in args else []), *head], rows)


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


TABLES = {"rows": rows_table, "pivot": pivot_table, "budget": budget_table, "tune": tune_table, "scoring": scoring_table, "scan": scan_table, "paired": paired_table}


# --------------------------------------------------------------------------------------------- figures


def scoring_figure(data: dict, args: dict):
    """A candidate-scoring file as a Pareto figure: accuracy against the candidate branch's FLOPs."""
    points = [plot.Point(r["recipe"], r["ratio"]["branch_flops"], 100 * r["accuracy"]) for r in data["results"]]
    panel = plot.Panel(f"{len(data['items'])} candidate items", "candidate-branch FLOPs / baseline", points)
    title = args.get("alt") or f"trimvlm eval: {data['task']['name']}, accuracy against cost"
    return plot.figure(title, [[panel]], _named(args))


def pareto_figure(data: dict, args: dict):
    return plot.eval_figure(SavedResult(data), _named(args), args.get("alt"))


def _named(args: dict) -> list[str] | None:
    return [x.strip() for x in args["rows"].split(";") if x.strip()] if args.get("rows") else None


FIGURES = {"pareto": pareto_figure, "scoring": scoring_figure, "tune": lambda data, args: frontier_figure(data)}


class Figure(NamedTuple):
    """One figure marker: the PNG it names and the digest of what it is drawn from."""

    name: str
    args: dict
    png: Path
    digest: str


def figure_of(name: str, args: dict, results: Path) -> Figure:
    if args["figure"] not in FIGURES:
        raise SystemExit(f"results:{name}: figure={args['figure']!r}; figure is one of {', '.join(FIGURES)}")
    source = (results / f"{name}.json").read_bytes() + json.dumps(args, sort_keys=True).encode()
    png = results / f"{args.get('png', name)}.png"
    return Figure(name, args, png, hashlib.sha256(source).hexdigest()[:16])


def drawn_from(png: Path) -> str | None:
    """The digest a PNG was drawn from (its `Source` text), None if it is missing or has none."""
    from PIL import Image

    if not png.is_file():
        return None
    with Image.open(png) as im:
        return im.text.get("Source")


def draw(f: Figure, results: Path) -> None:
    fig = FIGURES[f.args["figure"]](json.loads((results / f"{f.name}.json").read_text()), f.args)
    plot.save(fig, f.png, source=f.digest)


def figures(text: str, results: Path) -> list[Figure]:
    out = []
    for m in MARKER.finditer(text):
        args = _args(m)
        if "figure" in args:
            out.append(figure_of(m["name"], args, results))
    return out


def _link(f: Figure, doc: Path) -> str:
    alt = f.args.get("alt", f"{f.name}: accuracy against cost")
    return f"![{alt}]({Path(os.path.relpath(f.png, doc.parent)).as_posix()})"


# --------------------------------------------------------------------------------------------- documents


def render(name: str, args: dict, results: Path) -> str:
    path = results / f"{name}.json"
    data = json.loads(path.read_text())
    if "table" in args:
        return TABLES[args["table"]](data, args)
    if isinstance(data.get("results"), list) and data["results"] and "group_type" in data["results"][0]:
        return eval_table(data, args)
    return rows_table(data, args)


def _args(m: re.Match) -> dict:
    return dict(a.split("=", 1) for a in shlex.split(m["args"]))


def rewrite(text: str, results: Path, doc: Path | None = None) -> str:
    """`text` with every marker's table (or figure link, relative to `doc`'s folder) written again."""

    def one(m: re.Match) -> str:
        args = _args(m)
        if "figure" in args:
            body = _link(figure_of(m["name"], args, results), doc or results.parent / "page.md")
        else:
            body = render(m["name"], args, results)
        return m.group(1) + body + "\n" + m.group(5)

    return MARKER.sub(one, text)


def stale_figures(root: Path, results: Path, every: bool = False) -> tuple[list[Figure], list[Path]]:
    """(the figures whose PNG is missing or drawn from something else (`every`: all of them), the PNGs in
    docs/results/ that no figure marker names)."""
    figs = [f for doc in documents(root) for f in figures(doc.read_text(), results)]
    named = {f.png for f in figs}
    orphans = sorted(p for p in results.glob("*.png") if p not in named)
    return [f for f in figs if every or drawn_from(f.png) != f.digest], orphans


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table or figure differs")
    ap.add_argument("--root", type=Path, default=ROOT, help="the repository (README.md, docs/)")
    ap.add_argument("--redraw", action="store_true", help="draw every figure, not only the stale ones")
    a = ap.parse_args(argv)
    results = a.root / "docs" / "results"
    stale = []
    for doc in documents(a.root):
        old = doc.read_text()
        new = rewrite(old, results, doc)
        if new == old:
            continue
        stale.append(doc)
        if a.check:
            rel = str(doc.relative_to(a.root))
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True), rel, rel))
        else:
            doc.write_text(new)
            print(f"wrote {doc.relative_to(a.root)}")
    return _figures(a.root, results, a.check, bool(stale), a.redraw)


def _figures(root: Path, results: Path, check: bool, tables_stale: bool, every: bool = False) -> int:
    redraw, orphans = stale_figures(root, results, every)
    for f in redraw:
        if check:
            print(f"{f.png.relative_to(root)}: missing or not drawn from {f.name}.json as its marker says")
        else:
            draw(f, results)
            print(f"drew {f.png.relative_to(root)}")
    for p in orphans:
        print(f"{p.relative_to(root)}: no page's figure marker draws it (embed it with figure=..., or delete it)")
    if check and (tables_stale or redraw):
        print("README.md or docs/ differ from docs/results/: run `make results`", file=sys.stderr)
    return 1 if (check and (tables_stale or redraw)) or orphans else 0


if __name__ == "__main__":
    raise SystemExit(main())
