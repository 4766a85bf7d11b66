"""Calibration of the layer rankers (`trimvlm calibrate --method NAME`): unlabeled inputs of a task, the
unpruned model's outputs, and the ranking file `depth=ranking:file=...:budget=K` loads.

Every ranker is a function `(runner, batches, on_step) -> (scores, order)` over prepared batches (one score per
layer; the order, first = skipped first) with a `steps(batches, layers)` count for the progress bar. The ranking
file holds the method, the model's fingerprint (a ranking is never applied to another model), the layer
count, the scores, the order (first = skipped first) and the calibration inputs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from trimvlm.depth.base import model_fingerprint
from trimvlm.errors import InputError
from trimvlm.options import is_int
from trimvlm.runtime.plan import Plan


@dataclass(frozen=True)
class Ranker:
    name: str
    score: object  # (runner, batches, on_step) -> (scores: one per layer, order: first = skipped first)
    steps: object  # (n_batches, n_layers) -> int, progress steps
    what: str  # the score's name in the printed table


def ascending(scores: list[float]) -> list[int]:
    """Layers by ascending score, ties by layer index (the lowest is skipped first)."""
    return sorted(range(len(scores)), key=lambda i: (scores[i], i))


RANKERS: dict[str, Ranker] = {}


def register_ranker(ranker: Ranker) -> Ranker:
    RANKERS[ranker.name] = ranker
    return ranker


def calibration_records(task: str, n: int, seed: int):
    """`n` inputs of a generation task: the demo task's val split for "demo", else the task's own records."""
    from trimvlm.evals.tasks import demo_task, get_task

    if str(task) == "demo":
        return demo_task(limit=n, seed=seed, split="val").records[:n]
    return get_task(task, limit=n, seed=seed).records


def prepare_batches(vlm, records, batch_size: int) -> list:
    if not records:
        raise InputError("calibration needs at least one input")
    return [
        vlm.prepare([list(r.images) for r in records[a : a + batch_size]],
                    [r.prompt_text() for r in records[a : a + batch_size]])
        for a in range(0, len(records), batch_size)
    ]  # fmt: skip


@torch.no_grad()
def answer_logits(runner, prepared, skip=frozenset()) -> torch.Tensor:
    """[B, V] float64 next-token logits at each sample's answer position (its last prompt token), `skip`
    blocks not run."""
    return runner.prefill(prepared, Plan(skip_prefill=frozenset(skip))).logits.double()


def rank(vlm, method: str, records, batch_size: int = 16, on_step=None, calibration: dict | None = None) -> dict:
    """Score and rank every block of `vlm` with ranker `method` on task `records` (answers are never read)."""
    if method not in RANKERS:
        raise InputError(f"unknown calibration method {method!r}; allowed: candidates, {', '.join(sorted(RANKERS))}")
    r = RANKERS[method]
    batches = prepare_batches(vlm, records, batch_size)
    scores, order = r.score(vlm.runner, batches, on_step)
    scores = [float(s) for s in scores]
    return {
        "method": method,
        "fingerprint": model_fingerprint(vlm.adapter),
        "num_layers": vlm.runner.num_layers,
        "scores": scores,
        "order": order,
        "calibration": {"n": len(records), **(calibration or {})},
    }


def calibrate_command(method: str, model="demo", task="demo", n: int = 32, seed: int = 0, json_out="rank.json",
                      console=None, batch_size: int = 16, load_kw: dict | None = None) -> dict:  # fmt: skip
    """`trimvlm calibrate --method NAME`: rank every block on `n` unlabeled inputs, write the ranking JSON, print
    a table. Returns the JSON's content."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    import trimvlm

    if method not in RANKERS:
        raise InputError(f"unknown calibration method {method!r}; allowed: candidates, {', '.join(sorted(RANKERS))}")
    if not is_int(n) or n < 1:
        raise InputError(f"n must be a positive number of calibration inputs, got {n!r}")
    r = RANKERS[method]
    console = console or Console()
    vlm = trimvlm.load(model, **(load_kw or {}))
    records = calibration_records(task, n, seed)
    total = r.steps(-(-len(records) // batch_size), vlm.runner.num_layers)
    with Progress(TextColumn(f"[bold]{method}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as bar:  # fmt: skip
        job = bar.add_task(method, total=total)
        data = rank(vlm, method, records, batch_size, on_step=lambda: bar.advance(job),
                    calibration={"task": str(task), "seed": seed, "split": "val" if str(task) == "demo" else ""})  # fmt: skip
    data = {"model": str(model), "family": vlm.family, **data}
    t = Table(title=f"{method}: {r.what} ({model}, {len(records)} inputs)", title_justify="left")
    for col in ("layer", "type", r.what, "rank"):
        t.add_column(col, justify="left" if col == "type" else "right")
    place = {layer: k for k, layer in enumerate(data["order"])}
    for layer, s in enumerate(data["scores"]):
        t.add_row(str(layer), vlm.adapter.layer_types[layer], f"{s:.4g}", str(place[layer] + 1))
    console.print(t)
    console.print(f"order (skipped first to last): {data['order']}")
    if json_out is not None:
        path = Path(json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
        console.print(f"wrote {json_out}")
    return data
