"""`trimvlm tune`'s CLI glue: load, search (`trimvlm.tune.search`), print the budgets' best recipes, write
the folder (`trimvlm.tune.report`)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from rich.console import Console

import trimvlm
from trimvlm.errors import InputError
from trimvlm.integrations.ray_eval import RayEvaluator
from trimvlm.terminal import Col, Sheet
from trimvlm.tune.budgets import budget_points
from trimvlm.tune.report import best_entries, candidates_run, write_report
from trimvlm.tune.search import Settings, check_splits, tune
from trimvlm.tune.space import load_space


def tune_command(model="demo", task="demo", budgets=(), *, data=None, space=None, out="runs/tune",
                 min_retention=None, n_val: int = 192, n_test: int = 600, seed: int = 0, batch_size: int = 48,
                 threads: int | None = None, console=None, load_kw: dict | None = None, ray: str | None = None,
                 workers: int | None = None) -> dict:  # fmt: skip
    """`trimvlm tune`. `ray` ("auto", "local" or HOST:PORT): every evaluation of the search sharded over
    `workers` Ray workers that load the model once for the whole search (integrations/ray_eval.RayEvaluator);
    the model is also loaded here, for the cost predictions and the rankings' calibration."""
    budget_points(budgets)  # bad budgets, splits and space files fail before the model loads
    check_splits(task, "val", "test", data)
    load_space(space)
    if threads is not None:
        torch.set_num_threads(threads)
    console = console or Console()
    if workers is not None and ray is None:
        raise InputError("--workers applies to a search sharded over Ray: give --ray auto, local or HOST:PORT too")
    vlm = trimvlm.load(model, **(load_kw or {}))
    pool = contextlib.nullcontext()
    if ray is not None:
        pool = RayEvaluator(model, workers=workers, ray_address=ray, load_kw=load_kw, progress=False)
    with pool as evaluate:
        rep = tune(vlm, task, list(budgets), space=space, out=out, n_val=n_val, n_test=n_test, seed=seed,
                   data=data, min_retention=min_retention, settings=Settings(batch_size=batch_size), console=console,
                   evaluate=evaluate)  # fmt: skip
    best = best_entries(rep)
    table = _best_table(console, f"tune {model} on {task}: best recipe per budget (test split, {rep['n_test']} "
                        "items)", [name for name, _ in best])  # fmt: skip
    for name, e in best:
        if e is None:
            table.row(name, "none fits", *["-"] * 5)
            continue
        t, r = e["test"], e["test"]["ratio"]
        table.row(name, e["spec"], f"{100 * t['accuracy']:.1f}%", f"{t['retention'] or 0:.3f}",
                      f"{r['total_flops']:.3f}x", f"{r['kv_bytes']:.3f}x", f"{r['latency_s']:.3f}x")  # fmt: skip
    console.print(table)
    base = next(e for e in rep["entries"] if e["spec"] == "baseline")["test"]
    console.print(f"baseline test accuracy {100 * base['accuracy']:.1f}%; candidates run {candidates_run(rep)}")
    for path in write_report(rep, Path(out)):
        console.print(f"[dim]wrote {path}[/]")
    return rep


def _best_table(console, title: str, labels: list[str]):
    """The budgets' best recipes: KV bytes and latency are default columns where a budget names them."""
    named = " ".join(labels)
    costs = (("flops", "total FLOPs"), ("kv_bytes", "KV bytes"), ("latency", "latency"))
    return Sheet(console, title, ["budget", "best recipe", Col("test accuracy", right=True), Col("retention", right=True),
                                  *(Col(h, right=True, wide=k not in named) for k, h in costs)])  # fmt: skip
