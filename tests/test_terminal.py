"""Terminal output: the default tables fit 100 columns with no cell cut, --wide shows every column, piped
output keeps its lines bounded, and the progress bar shows the elapsed time, the rate and the phase."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from trimvlm.evals.report import COST_COLUMNS, SavedResult, print_report
from trimvlm.progress import Steps, progress
from trimvlm.terminal import PIPED_WIDTH, Col, Sheet, Terminal

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
LONG = "tokens=density:keep=0.5:layer=2"  # an inline recipe's label, as `trimvlm eval --recipe` names it


def _renamed(result: SavedResult, names: dict[str, str], keep: int) -> SavedResult:
    """The first `keep` recipes of `result`, some renamed."""
    data = dict(result.data)
    data["recipes"] = [{**r, "label": names.get(r["label"], r["label"])} for r in data["recipes"][:keep]]
    kept = {r["label"] for r in data["recipes"]}
    data["results"] = [{**r, "recipe": names.get(r["recipe"], r["recipe"])} for r in data["results"]]
    data["results"] = [r for r in data["results"] if r["recipe"] in kept]
    return SavedResult(data)


def _render(result, width: int = 100, wide: bool = False) -> str:
    console = Terminal(wide=wide, width=width, file=io.StringIO(), record=True)
    print_report(result, console)
    return console.export_text()


@pytest.fixture(scope="module")
def kv():
    return SavedResult.load(RESULTS / "kv-demo-ablation.json")


@pytest.mark.parametrize("case", ["two recipes, one long label", "eight recipes", "seventy recipes"])
def test_default_tables_fit_100_columns_with_no_cell_cut(kv, case):
    if case == "seventy recipes":
        result = SavedResult.load(RESULTS / "tokens-demo.json")
    else:
        result = _renamed(kv, {kv.labels[1]: LONG}, 2 if case.startswith("two") else 8)
    text = _render(result)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 100 and "…" not in text
    for label in result.labels:  # each recipe's name whole on one line (not folded)
        assert any(f" {label} " in line for line in lines), label
    ratio = text[text.index("cost / baseline") :]
    for heading in ("retention %", "FLOPs", "KV bytes", "latency", "peak mem"):
        assert heading in ratio, heading
    last = result.labels[-1]
    row = result.row(last)
    cells = [f"{row['ratio'][k]:.2f}x" for k in ("total_flops", "kv_bytes", "latency_s")]
    line = next(x for x in ratio.splitlines() if f" {last} " in x and " all " in x)
    assert all(c in line for c in cells), (line, cells)
    heads = " ".join(x for x in ratio.splitlines() if x.startswith("┃"))
    assert "KV peak" not in heads and "method share" not in heads  # --wide's


def test_wide_shows_every_column(kv):
    result = _renamed(kv, {}, 3)
    text = _render(result, wide=True)
    costs = text[text.index("costs per item") : text.index("cost / baseline")]
    for _, heading in COST_COLUMNS:
        assert heading in costs, heading
    assert "method FLOPs" in costs and "method share" in text[text.index("cost / baseline") :]
    assert "…" not in text and max(map(len, text.splitlines())) > 100  # at its natural width


def test_a_narrow_column_wraps_its_heading_before_any_cell_is_folded():
    console = Console(width=40, file=io.StringIO(), record=True)
    sheet = Sheet(console, None, ["recipe", Col("prefill mismatch %", right=True), Col("hidden", wide=True)])
    sheet.row("a_long_recipe_name", "12.5", "x")
    console.print(sheet)
    text = console.export_text()
    assert "a_long_recipe_name" in text and "12.5" in text and "hidden" not in text
    assert max(map(len, text.splitlines())) <= 40 and "…" not in text


def _cli_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return env | extra


def test_the_cli_at_100_columns_cuts_no_cell():
    """`trimvlm eval` (COLUMNS=100, as in a terminal of 100 columns): every line fits, nothing is cut."""
    from typer.testing import CliRunner

    from trimvlm.cli import app

    args = ["eval", "--model", "demo", "--task", "demo", "--limit", "12", "--recipe", LONG]
    res = CliRunner().invoke(app, args, env={"COLUMNS": "100"})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(map(len, lines)) <= 100 and "…" not in res.output, res.output
    assert any(f" {LONG} " in line and "x " in line for line in lines)  # its ratios, on one line


def test_piped_output_lines_are_bounded():
    """Piped (no terminal, no COLUMNS): laid out at 100 columns, text and tables alike (the methods' prose ran to
    400 characters on one line, its table to 314)."""
    res = subprocess.run([sys.executable, "-m", "trimvlm.cli", "methods"], capture_output=True, text=True,
                         env=_cli_env(), timeout=300, stdin=subprocess.DEVNULL)  # fmt: skip
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert max(map(len, lines)) <= PIPED_WIDTH
    assert "…" not in res.stdout  # folded, never cut
    assert any(len(x) > 80 for x in lines if not x.startswith(("┏", "┃", "│", "└", "├", "┡")))  # wraps at 100


def test_progress_shows_elapsed_rate_and_phase():
    now = [100.0]
    console = Console(width=100, file=io.StringIO(), record=True)
    bar = progress(console, get_time=lambda: now[0])
    steps = Steps(bar, bar.add_task("eval demo", total=4, detail="warm-up: baseline", unit="batch"))
    now[0] += 3.0
    steps.advance()
    steps.phase("baseline · exist (prefill)")
    now[0] += 3.0
    console.print(bar.make_tasks_table(bar.tasks))
    line = console.export_text().splitlines()[0]
    assert "eval demo" in line and "1/4" in line and "0:00:06" in line, line
    assert "6 s/batch" in line and "baseline · exist (prefill)" in line, line


def test_eval_shows_its_phase():
    """The eval's bar names the recipe and the kind of items running; its last frame stays."""
    import trimvlm
    from trimvlm.evals.run import run_eval
    from trimvlm.evals.tasks import get_task

    console = Console(width=100, file=io.StringIO(), record=True)
    task = get_task("demo", limit=6, seed=0)
    run_eval(trimvlm.load("demo"), task, [{"name": "half", "tokens": "density:keep=0.5:layer=2"}], batch_size=8,
             console=console)  # fmt: skip
    line = next(x for x in console.export_text().splitlines() if x.startswith("eval demo"))
    assert " · " in line and ("baseline" in line or "half" in line) and "batch" in line, line


def test_a_failed_job_leaves_no_bar():
    from trimvlm.progress import steps

    console = Console(width=100, file=io.StringIO(), record=True)
    with pytest.raises(ValueError), steps("eval demo", 3, console, phase="warm-up") as bar:
        bar.advance()
        raise ValueError("bad input")
    assert "eval demo" not in console.export_text()
    with steps("eval demo", 3, console, phase="warm-up") as bar:
        bar.advance()
    text = console.export_text()
    assert "eval demo" in text and "1/3" in text
