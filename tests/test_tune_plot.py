"""`trimvlm tune`'s frontier plot: labels that do not overlap, budgets marked, winners highlighted, the short
names explained."""

import json
from pathlib import Path

from trimvlm.evals.plot import label_points as _label_points
from trimvlm.tune.report import SHORT_FORMS, plot

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


def test_labels_of_crowded_points_take_different_offsets():
    from matplotlib.figure import Figure

    ax = Figure(figsize=(6, 4)).subplots()
    ax.scatter([0.0, 1.0], [0.0, 100.0])
    _label_points(ax, [((0.5, 50.0), f"recipe {k}") for k in range(4)] + [((0.9, 10.0), "alone")])
    offsets = [a.xyann[1] for a in ax.texts]
    assert len(set(offsets[:4])) == 4  # four labels on one point: four offsets
    assert offsets[4] == offsets[0]  # a point far from the others keeps the nearest offset


def test_the_plot_marks_budgets_and_winners_and_explains_short_names(tmp_path, monkeypatch):
    import matplotlib.figure

    rep = json.loads((RESULTS / "tune-demo" / "tune.json").read_text())
    saved = {}
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, path, **kw: saved.setdefault("fig", fig))
    plot(rep, tmp_path / "frontier.png")
    fig = saved["fig"]
    flops = fig.axes[0]
    budgets = sorted(line.get_xdata()[0] for line in flops.get_lines() if line.get_linestyle() == "--")
    assert budgets == [0.65, 0.75, 0.85]
    texts = " ".join(t.get_text() for t in fig.texts)
    assert SHORT_FORMS in texts and "tokens=cdpruner:layer=0:keep=0.375" in texts
    stars = [c for c in flops.collections if c.get_label() == "best per budget"]
    assert len(stars) == 1
