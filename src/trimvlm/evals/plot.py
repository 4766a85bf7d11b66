"""Pareto figures: accuracy against cost ratios to the baseline. The recipes a reader is pointed to (the baseline
and the ones named; by default all of them up to 12, else the frontier's) get their own saturated colour and
marker and a legend entry; the Pareto front is a dark step line, and its points the legend does not name are
named beside them; every other recipe is a small light-grey dot with no legend entry. The legend sits inside the
image, below the panels. `trimvlm eval --plot`, `trimvlm demo`, `trimvlm tune` and `make results`
(benchmarks/write_results.py) draw with it."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

MARKERS = ["o", "s", "^", "D", "v", "P", "X", "<", ">", "p", "h"]
# saturated and told apart in print: tab10 without its grey (grey is for the recipes not named), navy and teal
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#17becf", "#8c564b", "#e377c2", "#bcbd22",
           "#000075", "#469990"]  # fmt: skip
BASELINE_STYLE = ("*", "#000000")
MAX_NAMED = 12  # named recipes beyond this are drawn grey (a legend longer than this is not read)
OTHER = {"s": 12, "color": "#c0c0c0", "zorder": 1, "linewidths": 0}
FRONT_COLOUR = "#404040"
PROBE_TITLES = {"prefill": "prefill-probe items", "full": "full-pipeline-probe items",
                "candidates": "candidate items"}  # fmt: skip
FLOPS_AXES = {"candidates": ("branch_flops", "branch FLOPs")}  # a probe's FLOPs axis (else model + method)


class Point(NamedTuple):
    """One recipe in one panel: its cost ratio `x`, its accuracy `y` (%), and optionally a second cost (drawn
    hollow, the same colour: the KV peak beside the KV bytes kept)."""

    label: str
    x: float
    y: float
    x_peak: float | None = None


class Panel(NamedTuple):
    title: str
    xlabel: str
    points: list[Point]


def pareto_front(points: list[Point]) -> list[int]:
    """Indices of the non-dominated points (lower cost x, higher accuracy y), sorted by x."""
    order = sorted(range(len(points)), key=lambda i: (points[i].x, -points[i].y))
    front, best = [], float("-inf")
    for i in order:
        if points[i].y > best:
            front.append(i)
            best = points[i].y
    return front


def styles(named: list[str]) -> dict[str, tuple[str, str]]:
    """label -> (marker, colour): the first (the baseline) a black star, then each colour with its own marker."""
    return {label: BASELINE_STYLE if k == 0 else (MARKERS[(k - 1) % len(MARKERS)], COLOURS[(k - 1) % len(COLOURS)])
            for k, label in enumerate(dict.fromkeys(named))}  # fmt: skip


def frontier_labels(panels: list[Panel], limit: int = MAX_NAMED) -> list[str]:
    """The recipes on any panel's Pareto front, the first panel's first, at most `limit`."""
    seen: dict[str, None] = {}
    for panel in panels:
        pts = [p for p in panel.points if p.x == p.x]
        for i in pareto_front(pts):
            seen.setdefault(pts[i].label)
    return list(seen)[:limit]


LABEL_OFFSETS = (9, -13, 20, -24, 31, -35, 42, -46)  # points above / below a point, nearest first


def label_points(ax, points: list[tuple[tuple[float, float], str]], colours: list[str] | None = None) -> None:
    """Name each point with the first vertical offset whose label does not land on one already placed (labels
    compared in axes fractions: within 0.12 across and 0.035 up or down is a collision)."""
    ax.autoscale_view()
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    height_pt = ax.figure.get_figheight() * 72 * ax.get_position().height
    placed: list[tuple[float, float]] = []
    for n, ((x, y), text) in enumerate(points):
        fx, fy = (x - x0) / ((x1 - x0) or 1), (y - y0) / ((y1 - y0) or 1)
        for dy in LABEL_OFFSETS:
            ly = fy + dy / height_pt
            if all(abs(fx - px) > 0.12 or abs(ly - py) > 0.035 for px, py in placed):
                break
        placed.append((fx, ly))
        colour = colours[n] if colours else "C0"
        ax.annotate(text, (x, y), xytext=(4, dy), textcoords="offset points", fontsize=7, color=colour,
                    arrowprops={"arrowstyle": "-", "color": colour, "lw": 0.4} if abs(dy) > 13 else None)  # fmt: skip


def _dodge(points: list[Point], near: tuple[float, float] = (5e-4, 0.05)) -> list[float]:
    """A horizontal shift in points per named point: named points closer than `near` (x, y; in data units) to
    the one before them in a run are set side by side, 7 points apart, the run centred on where it lies and the
    first point (the baseline) in its middle (the data are not moved; each marker's value is its own)."""
    order = sorted(range(len(points)), key=lambda i: (round(points[i].y / near[1]), points[i].x))
    runs: list[list[int]] = []
    for i in order:
        last = points[runs[-1][-1]] if runs else None
        if last is not None and abs(points[i].x - last.x) < near[0] and abs(points[i].y - last.y) < near[1]:
            runs[-1].append(i)
        else:
            runs.append([i])
    shift = [0.0] * len(points)
    for run in runs:
        if 0 in run:  # the first point (the baseline) keeps the middle of its run
            run.remove(0)
            run.insert(len(run) // 2, 0)
        for j, i in enumerate(run):
            shift[i] = 7.0 * (j - (len(run) - 1) / 2)
    return shift


def _named(ax, named: list[Point], style: dict[str, tuple[str, str]]) -> None:
    from matplotlib.transforms import offset_copy

    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    near = (0.014 * (x1 - x0), 0.025 * (y1 - y0))  # markers this close would cover one another
    for p, dx in zip(named, _dodge(named, near), strict=True):
        marker, colour = style[p.label]
        at = offset_copy(ax.transData, fig=ax.figure, x=dx, y=0, units="points")
        big = marker == BASELINE_STYLE[0]
        ax.scatter([p.x], [p.y], marker=marker, s=150 if big else 48, color=colour, edgecolors="white",
                   linewidths=0.6, zorder=4, transform=at, label=p.label)  # fmt: skip
        if p.x_peak is not None and abs(p.x_peak - p.x) > 0.01:
            ax.scatter([p.x_peak], [p.y], marker=marker, s=48, facecolors="none", edgecolors=colour, linewidths=1,
                       zorder=3, transform=at)  # fmt: skip


def draw_panel(ax, panel: Panel, style: dict[str, tuple[str, str]]) -> None:
    """Grey dots for the recipes not named, the front as a step line, the named recipes in their colours (the
    legend names them), and the front's other points named beside them."""
    pts = [p for p in panel.points if p.x == p.x]  # a cost not measured (NaN) is not drawn
    others = [p for p in pts if p.label not in style]
    ax.scatter([p.x for p in others], [p.y for p in others], **OTHER)
    front = [pts[i] for i in pareto_front(pts)]
    if len(front) > 1:
        ax.step([p.x for p in front], [p.y for p in front], where="post", color=FRONT_COLOUR, lw=1, alpha=0.8,
                zorder=2)  # fmt: skip
    ax.set_xlim(left=0, right=max(1.1, max((p.x for p in pts), default=1.0) * 1.05))
    lo, hi = min((p.y for p in pts), default=0.0), max((p.y for p in pts), default=100.0)
    span = max(hi - lo, 10.0)
    ax.set_ylim(max(-2.0, lo - 0.1 * span), hi + 0.12 * span)  # room for the names above
    ax.set_yticks([t for t in ax.get_yticks() if ax.get_ylim()[0] <= t <= 100])
    _named(ax, [p for p in pts if p.label in style], style)
    # the front's points the legend does not name (nor a named recipe on the same spot)
    unnamed = [p for p in front if not any(_same(p, q) for q in pts if q.label in style)]
    label_points(ax, [((p.x, p.y), _front_name(p, others)) for p in unnamed], [FRONT_COLOUR] * len(unnamed))
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel(panel.xlabel)
    ax.set_ylabel("accuracy (%)")
    ax.grid(alpha=0.3)


def _same(p: Point, q: Point) -> bool:
    """Two points on one spot (the figures' precision: 0.0005 in a ratio, 0.05 in an accuracy %)."""
    return abs(q.x - p.x) < 5e-4 and abs(q.y - p.y) < 0.05


def _front_name(p: Point, others: list[Point]) -> str:
    """A front point's name, with how many other recipes sit on the same spot."""
    same = sum(1 for q in others if q is not p and _same(p, q))
    return p.label + (f" (+{same} same)" if same else "")


def figure(title: str, rows: list[list[Panel]], named: list[str] | None = None):
    """A figure of panels (rows of them) with one legend below them: the `named` recipes (the first is the
    baseline; default: every recipe up to MAX_NAMED, else the baseline and the recipes on the fronts), the front
    and the grey dots. A bare Figure: it renders PNG with Agg, pyplot's global state untouched."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    panels = [p for row in rows for p in row]
    labels = [p.label for p in panels[0].points] if panels and panels[0].points else []
    unknown = [n for n in named or [] if n not in labels]
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not a recipe of this result; its recipes: {', '.join(labels)}")
    if named is None:  # every recipe where the legend can hold them, else the fronts'
        named = labels if len(labels) <= MAX_NAMED else frontier_labels(panels)
    named = list(dict.fromkeys([*labels[:1], *named]))
    style = styles(named[:MAX_NAMED])
    ncols = max(len(r) for r in rows)
    fig = Figure(figsize=(5.3 * ncols, 3.9 * len(rows) + 0.35 * (1 + len(style) // 4)), layout="constrained")
    grid = fig.subplots(len(rows), ncols, squeeze=False)
    for i, row in enumerate(rows):
        for j, panel in enumerate(row):
            draw_panel(grid[i][j], panel, style)
    handles = [Line2D([], [], ls="", marker=m, color=c, markersize=11 if m == "*" else 7, label=label)
               for label, (m, c) in style.items()]  # fmt: skip
    handles += [Line2D([], [], color=FRONT_COLOUR, lw=1, label="Pareto front"),
                Line2D([], [], ls="", marker="o", color=OTHER["color"], markersize=4, label="other recipes")]  # fmt: skip
    fig.legend(
        handles=handles, loc="outside lower center", ncol=min(len(handles), 5), fontsize=8, frameon=False
    )
    fig.suptitle(title)
    return fig


def eval_panels(result) -> list[list[Panel]]:
    """An eval result's panels: one row per probe kind, accuracy against FLOPs (model + method; candidate items:
    their branch FLOPs), KV bytes kept (hollow: the KV peak) and peak memory, each as a ratio to the baseline."""
    base = result.labels[0]
    probes = [r["group"] for r in result.rows if r["recipe"] == base and r["group_type"] == "probe"]
    rows = []
    for probe in probes:
        flops = FLOPS_AXES.get(probe, ("total_flops", "FLOPs (model + method)"))
        title = f"{PROBE_TITLES.get(probe, probe)} ({result.row(base, probe)['n']})"
        rows.append([Panel(title, f"{name} / baseline", _points(result, probe, key))
                     for key, name in (flops, ("kv_bytes", "KV bytes (hollow: KV peak)"),
                                       ("peak_memory_bytes", "peak memory"))])  # fmt: skip
    return rows


def _points(result, probe: str, key: str) -> list[Point]:
    out = []
    for k, label in enumerate(result.labels):
        row = result.row(label, probe)
        x = row["ratio"].get(key)
        if x is None:  # the baseline spent nothing of this kind either
            x = 1.0 if k == 0 else float("nan")
        peak = row["ratio"].get("kv_bytes_peak") if key == "kv_bytes" else None
        out.append(Point(label, x, 100 * row["accuracy"], peak))
    return out


def eval_figure(result, named: list[str] | None = None, title: str | None = None):
    """`figure` of an eval result (`EvalResult` or `SavedResult`), titled `title` (default: the task's name)."""
    return figure(title or f"trimvlm eval: {result.task.name}, accuracy against cost", eval_panels(result), named)


def plot_pareto(result, path: str | Path, named: list[str] | None = None) -> Path:
    """Write `eval_figure` as PNG to `path`."""
    return save(eval_figure(result, named), path)


def save(fig, path: str | Path, source: str = "") -> Path:
    """Write the figure as PNG with no timestamp or version in it (the same figure gives the same bytes);
    `source` is kept in its text chunk (`make results` records what it was drawn from)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": None, **({"Source": source} if source else {})})
    return path
