"""Reports stay readable with many recipes (the 70-recipe token table): one row per recipe in the terminal, and
a plot whose legend names every recipe, inside the figure, each with its own colour and marker."""

from pathlib import Path

import pytest

from trimvlm.evals.report import SavedResult, pareto_figure, print_report, recipe_style

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


def test_styles_do_not_repeat_before_200_recipes():
    styles = [recipe_style(k) for k in range(200)]
    assert len(set(styles)) == 200
    assert recipe_style(0)[0] == "*"


def test_the_legend_names_every_recipe_inside_the_figure(many):
    fig = pareto_figure(many)
    fig.canvas.draw()
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == many.labels
    box, frame = legend.get_window_extent(), fig.bbox
    assert box.x0 >= frame.x0 - 1 and box.x1 <= frame.x1 + 1 and box.y0 >= frame.y0 - 1 and box.y1 <= frame.y1 + 1
