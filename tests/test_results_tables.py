"""The figure tables and figures in README.md and docs/ are what `make results` writes from docs/results/*.json."""

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _writer():
    spec = importlib.util.spec_from_file_location("write_results", ROOT / "benchmarks" / "write_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_tables_equal_what_make_results_writes(capsys):
    assert _writer().main(["--check"]) == 0, capsys.readouterr().out


def test_every_table_marker_names_an_existing_results_file():
    w = _writer()
    names = [m["name"] for doc in w.documents() for m in w.MARKER.finditer(doc.read_text())]
    assert len(names) >= 20
    missing = [n for n in names if not (ROOT / "docs" / "results" / f"{n}.json").is_file()]
    assert missing == []


def _copy(tmp_path: Path) -> Path:
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    for p in (ROOT / "docs").glob("*.md"):
        shutil.copy(p, tmp_path / "docs" / p.name)
    shutil.copytree(ROOT / "docs" / "results", tmp_path / "docs" / "results")
    return tmp_path


def test_one_changed_number_in_a_results_file_fails_the_check(tmp_path, capsys):
    root = _copy(tmp_path)
    w = _writer()
    assert w.main(["--check", "--root", str(root)]) == 0
    path = root / "docs" / "results" / "serve-load-idle.json"
    data = json.loads(path.read_text())
    data["cells"][_first_chat_cell(data)]["throughput_rps"] = 12.5  # the README's serving table shows it as 12.5
    path.write_text(json.dumps(data))
    assert w.main(["--check", "--root", str(root)]) == 1
    assert "| 12.5 |" in capsys.readouterr().out
    assert w.main(["--root", str(root)]) == 0  # `make results` rewrites the table ...
    assert "| batched | baseline | 32 | 12.5 |" in (root / "README.md").read_text()
    assert w.main(["--check", "--root", str(root)]) == 0  # ... and then the check passes


def _first_chat_cell(data: dict) -> int:
    """The README's serving table's first row: the batching server, chat, no recipe."""
    return next(i for i, c in enumerate(data["cells"])
                if (c["endpoint"], c["server"], c["recipe"]) == ("chat", "batched", "baseline"))  # fmt: skip


def test_a_hand_edited_table_fails_the_check(tmp_path):
    root = _copy(tmp_path)
    readme = root / "README.md"
    text = readme.read_text()
    data = json.loads((root / "docs" / "results" / "serve-load-idle.json").read_text())
    shown = f"| {data['cells'][_first_chat_cell(data)]['throughput_rps']:.1f} |"
    assert shown in text
    readme.write_text(text.replace(shown, shown.replace(" |", "1 |"), 1))
    assert _writer().main(["--check", "--root", str(root)]) == 1


def test_eval_tables_reproduce_the_eval_commands_own_markdown():
    """An eval result's table is `trimvlm eval --markdown`'s, read back from its JSON (no second writer)."""
    from trimvlm.evals.report import SavedResult, markdown_summary

    results = ROOT / "docs" / "results"
    for name in ("tokens-demo", "kv-demo"):
        assert markdown_summary(SavedResult.load(results / f"{name}.json")) == (results / f"{name}.md").read_text()


def test_every_figure_marker_draws_a_png_from_its_results_file_and_links_it():
    w = _writer()
    results = ROOT / "docs" / "results"
    figures = [(doc, f) for doc in w.documents() for f in w.figures(doc.read_text(), results)]
    assert len(figures) >= 12
    for doc, f in figures:
        assert w.drawn_from(f.png) == f.digest, f.png  # drawn from this results file with these arguments
        assert f"]({Path(os.path.relpath(f.png, doc.parent)).as_posix()})" in doc.read_text()


def test_a_changed_results_file_makes_its_figure_stale_until_make_results_draws_it(tmp_path, capsys):
    root = _copy(tmp_path)
    w = _writer()
    path = root / "docs" / "results" / "scoring-loglik.json"
    data = json.loads(path.read_text())
    data["results"][1]["accuracy"] = 0.5
    path.write_text(json.dumps(data))
    assert w.main(["--check", "--root", str(root)]) == 1
    assert "docs/results/scoring-loglik.png: missing or not drawn" in capsys.readouterr().out
    png = root / "docs" / "results" / "scoring-loglik.png"
    before = png.read_bytes()
    assert w.main(["--root", str(root)]) == 0  # draws that figure again (the tables did not change)
    assert png.read_bytes() != before and "drew docs/results/scoring-loglik.png" in capsys.readouterr().out
    assert w.main(["--check", "--root", str(root)]) == 0


def test_a_png_no_marker_draws_fails_the_check(tmp_path, capsys):
    root = _copy(tmp_path)
    shutil.copy(root / "docs" / "results" / "scoring.png", root / "docs" / "results" / "by-hand.png")
    assert _writer().main(["--check", "--root", str(root)]) == 1
    assert "docs/results/by-hand.png: no page's figure marker draws it" in capsys.readouterr().out


def test_an_unknown_figure_kind_is_refused(tmp_path):
    root = _copy(tmp_path)
    page = root / "docs" / "kv.md"
    page.write_text(page.read_text().replace("figure=pareto", "figure=paretto", 1))
    with pytest.raises(SystemExit, match="figure='paretto'; figure is one of pareto, scoring, tune"):
        _writer().main(["--check", "--root", str(root)])


def test_a_paired_table_over_groups_repeats_each_groups_own_table():
    """`groups=` gives, per group and pair, the row the single-group table gives, the group and its items first."""
    w = _writer()
    data = json.loads((ROOT / "docs" / "results" / "router-room-scenes.json").read_text())
    pairs = "router v2 vs density L2; router v2 vs tuned"
    grid = w.paired_table(data, {"pairs": pairs, "groups": "count; relation"}).splitlines()
    assert grid[0].startswith("| group (items) | A | B |")
    body = grid[2:]
    assert len(body) == 4
    for i, group in enumerate(["count", "relation"]):
        alone = w.paired_table(data, {"pairs": pairs, "group": group}).splitlines()[2:]
        n = sum(item["kind"] == group for item in data["items"])
        for j, row in enumerate(alone):
            assert body[2 * i + j] == f"| {group} ({n}) " + row
