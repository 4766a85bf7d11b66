"""`trimvlm calibrate --method NAME`: rank a model's layers on unlabeled inputs of a task of the harness's
registry (its val split) and write the one ranking file (trimvlm.depth.calibration.ranking_data) that
`depth=ranking:file=...:budget=K` loads.

Methods: `candidates` (FastJEV's decision sensitivity J_l, the skip confined to the candidate branches:
trimvlm.scoring.calibrate; candidate items), every registered layer ranker (trimvlm.depth: block-influence,
sensitivity, greedy-kl; generation records), and every registered token reducer that is fitted on calibration
statistics (a `statistics(runner, prepared)` function in its module: tokens=fitprune; generation records; the
file holds the statistics, the reducer fits its recipe for the recipe's budget). Inputs are checked before the
model loads.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from rich.console import Console

import trimvlm
from trimvlm.depth.base import model_fingerprint
from trimvlm.depth.calibration import RANKERS, prepare_batches, rank, ranking_data, write_ranking
from trimvlm.errors import InputError
from trimvlm.evals.report import write_text
from trimvlm.evals.tasks import calibration_items
from trimvlm.options import is_int
from trimvlm.progress import steps
from trimvlm.scoring.calibrate import calibrate, check_readout_name, resolve_readout
from trimvlm.terminal import Col, Sheet

CANDIDATES = "candidates"


def _token_statistics() -> dict:
    """name -> the `statistics(runner, prepared)` function of each token reducer fitted on calibration data."""
    from trimvlm.registry import REGISTRIES, load_methods

    load_methods()
    found = {name: getattr(sys.modules[cls.__module__], "statistics", None) for name, cls in REGISTRIES["tokens"].items()}
    return {name: fn for name, fn in found.items() if callable(fn)}


def check_method(method: str) -> None:
    if method != CANDIDATES and method not in RANKERS and method not in _token_statistics():
        allowed = [CANDIDATES, *sorted(RANKERS), *sorted(_token_statistics())]
        raise InputError(f"unknown calibration method {method!r}; allowed: {', '.join(allowed)}")


def token_statistics(vlm, method: str, items, batch_size: int, about: dict, model: str, on_step=None) -> dict:
    """The statistics file of token reducer `method`: its `statistics` over the prepared batches of `items`."""
    inputs = []
    for prepared in prepare_batches(vlm, items, batch_size):
        inputs += [{"cross": s.cross, "self": s.self_} for s in _token_statistics()[method](vlm.runner, prepared)]
        if on_step is not None:
            on_step()
    return {"method": method, "model": str(model), "family": vlm.family, "fingerprint": model_fingerprint(vlm.adapter),
            "num_layers": vlm.runner.num_layers, "calibration": {**about, "n": len(items)}, "inputs": inputs}  # fmt: skip


def calibrate_command(
    method: str = CANDIDATES,
    model: str | Path = "demo",
    task: str = "demo",
    n: int = 32,
    readout: str = "auto",
    seed: int = 0,
    json_out: str | Path | None = "rank.json",
    console=None,
    batch_size: int = 16,
    load_kw: dict | None = None,
) -> dict:
    """Rank `model`'s layers with `method` on `n` unlabeled val inputs of `task`, print a table, write the
    ranking file to `json_out` (None: not written). `readout` (auto | loglik | head) applies to `candidates`.
    Returns the file's content."""
    check_method(method)
    check_readout_name(readout)
    if not is_int(seed):
        raise InputError(f"seed must be an integer, got {seed!r}")
    items = calibration_items(task, n, seed, candidates=method == CANDIDATES)
    console = console or Console()
    vlm = trimvlm.load(model, **(load_kw or {}))
    about = {"task": str(task), "split": "val", "seed": seed}
    data = _measure(console, vlm, method, items, batch_size, about, readout, str(model))
    if method in _token_statistics():
        if json_out is not None:
            path = write_text(json.dumps(data) + "\n", json_out)
            console.print(f"wrote {path} ({len(data['inputs'])} inputs); use it as the recipe "
                          f"tokens={method}:file={path}:keep=K (K: the budget)")  # fmt: skip
        return data
    print_ranking(data, vlm.adapter.layer_types, console)
    if json_out is not None:
        path = write_ranking(data, json_out)
        scope = ":scope=candidates" if method == CANDIDATES else ""
        console.print(f"wrote {path}; use it as the recipe depth=ranking:file={path}:budget=K{scope} (the K "
                      f"best-ranked blocks skipped{' in the candidate branches' if scope else ''})")  # fmt: skip
    return data


def _measure(console, vlm, method: str, items, batch_size: int, about: dict, readout: str, model: str) -> dict:
    """The file's content of `method` on `items`, a progress step per batch or pass."""
    batches = math.ceil(len(items) / batch_size)
    detail = f"{len(items)} inputs in {batches} batches"
    if method in _token_statistics():
        with steps(method, batches, console, phase=detail, unit="batch") as bar:
            return token_statistics(vlm, method, items, batch_size, about, model, on_step=bar.advance)
    if method == CANDIDATES:
        with steps(method, batches * (vlm.runner.num_layers + 1), console, unit="pass",
                   phase=f"{len(items)} inputs, a pass per layer and batch") as bar:  # fmt: skip
            res = calibrate(vlm, [it.request() for it in items], resolve_readout(vlm, readout),
                            batch_size=batch_size, on_step=bar.advance)  # fmt: skip
        return ranking_data(vlm, method, res["J"], res["order"], about | {"n": res["n"], "readout": res["readout"]},
                            model)  # fmt: skip
    with steps(method, RANKERS[method].steps(batches, vlm.runner.num_layers), console, phase=detail) as bar:
        return rank(vlm, method, items, batch_size, on_step=bar.advance, calibration=about, model=model)


def print_ranking(data: dict, layer_types: list[str], console) -> None:
    what = "J_l" if data["method"] == CANDIDATES else RANKERS[data["method"]].what
    cal = data["calibration"]
    readout = f", {cal['readout']} readout" if "readout" in cal else ""
    t = Sheet(console, f"{data['method']}: {what} ({data['model']}{readout}, {cal['n']} inputs)",
              [Col(c, right=c != "type") for c in ("layer", "type", what, "rank")])  # fmt: skip
    place = {layer: k for k, layer in enumerate(data["order"])}
    for layer, score in enumerate(data["scores"]):
        t.row(str(layer), layer_types[layer], f"{score:.4g}", str(place[layer] + 1))
    console.print(t)
    console.print(f"order (skipped first to last): {data['order']}")
