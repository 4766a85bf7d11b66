"""Reports stay readable with many recipes (the 70-recipe token table): one row per recipe in the terminal, and
a plot that names the baseline and the recipes a reader is pointed to (by default the front's) in their own
colours and markers, in a legend inside the figure, and draws every other recipe as a grey dot."""

from pathlib import Path

import pytest
from matplotlib.colors import to_hex

from trimvlm.evals import plot
from trimvlm.evals.plot import styles
from trimvlm.evals.report import SavedResult, pareto_figure, print_report

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


@pytest.fixture(scope="module")
def many():
    result = SavedResult.load(RESULTS / "tokens-demo.json")
    assert len(result.labels) == 70
    return result


def test_many_recipes_print_one_accuracy_row_per_recipe(many):
    from rich.console import Console

    console = Console(record=True, width=240)
    print_report(many, console)
    text = console.export_text()
    head = text[: text.index("costs per item")]
    rows = [line for line in head.splitlines() if line.startswith("│")]
    assert [r.split("│")[1].strip() for r in rows] == many.labels
    expected = many.row("dart k50 L2", "full")["accuracy"]  # 94.5 in the results file
    dart = next(r for r in rows if r.split("│")[1].strip() == "dart k50 L2")
    assert f"{100 * expected:.1f}" in dart and all(c.strip() for c in dart.split("│")[1:-1])


def test_few_recipes_keep_one_column_per_recipe(many):
    from rich.console import Console

    few = SavedResult({**many.data, "recipes": many.data["recipes"][:3]})
    console = Console(record=True, width=240)
    print_report(few, console)
    assert "demo: accuracy %" in console.export_text() and "(3 recipes)" not in console.export_text()


def test_named_recipes_get_distinct_saturated_styles(many):
    style = styles(many.labels[: plot.MAX_NAMED])
    assert len(style) == plot.MAX_NAMED and style["baseline"][0] == "*"
    assert len({c for _, c in style.values()}) == plot.MAX_NAMED  # no colour twice
    assert plot.OTHER["color"] not in {c for _, c in style.values()}


SHOWN = ["density k25 L2", "fastv k25 L2", "random k25 L0"]


def test_the_legend_names_the_baseline_and_the_shown_recipes_inside_the_figure(many):
    fig = pareto_figure(many, SHOWN)
    fig.canvas.draw()
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == ["baseline", *SHOWN, "Pareto front", "other recipes"]
    box, frame = legend.get_window_extent(), fig.bbox
    assert box.x0 >= frame.x0 - 1 and box.x1 <= frame.x1 + 1 and box.y0 >= frame.y0 - 1 and box.y1 <= frame.y1 + 1
    ax = fig.axes[0]
    grey = [c for c in ax.collections if len(c.get_offsets()) > 1]  # the recipes not named: one grey collection
    assert len(grey) == 1 and len(grey[0].get_offsets()) == len(many.labels) - 1 - len(SHOWN)
    assert to_hex(grey[0].get_facecolor()[0]) == plot.OTHER["color"]


def test_by_default_the_legend_names_the_fronts_recipes(many):
    fig = pareto_figure(many)
    names = [t.get_text() for t in fig.legends[0].get_texts()][:-2]
    assert names[0] == "baseline" and 2 < len(names) <= plot.MAX_NAMED
    panels = [p for row in plot.eval_panels(many) for p in row]
    front = {p.points[i].label for p in panels for i in plot.pareto_front(p.points)}
    assert set(names[1:]) <= front


def test_points_on_one_spot_are_set_side_by_side_and_front_names_say_how_many_share_it():
    pts = [plot.Point("a", 1.0, 50.0), plot.Point("b", 1.0, 50.0), plot.Point("c", 1.0, 50.0), plot.Point("d", 0.5, 9)]
    assert plot._dodge(pts) == [0.0, -7.0, 7.0, 0.0]  # the first (the baseline) in the middle of its run
    near = [plot.Point("e", 0.99, 50.0), plot.Point("f", 1.0, 50.0), plot.Point("g", 1.5, 50.0)]
    assert plot._dodge(near, (0.02, 1.0)) == [-3.5, 3.5, 0.0]  # within `near` of each other: side by side
    assert plot._front_name(pts[0], pts) == "a (+2 same)" and plot._front_name(pts[3], pts) == "d"


def test_a_name_that_is_not_a_recipe_is_refused(many):
    with pytest.raises(ValueError, match="densty k25 L2: not a recipe of this result; its recipes: baseline, "):
        pareto_figure(many, ["densty k25 L2"])


def test_a_few_recipes_are_all_named(many):
    few = SavedResult({**many.data, "recipes": many.data["recipes"][:4]})
    names = [t.get_text() for t in pareto_figure(few).legends[0].get_texts()]
    assert names == [*few.labels, "Pareto front", "other recipes"]
