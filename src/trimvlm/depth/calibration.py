"""Calibration of the layer rankers (`trimvlm calibrate --method NAME`, trimvlm.cli_calibrate): the unpruned
model's outputs on unlabeled inputs, and the one ranking-file format `depth=ranking:file=...:budget=K` loads.

Every ranker is a function `(runner, batches, on_step) -> (scores, order)` over prepared batches (one score per
layer; the order, first = skipped first) with a `steps(batches, layers)` count for the progress bar.

The ranking file (`ranking_data`; written by every method, FastJEV's candidate J_l included; read by
trimvlm.depth.ranking): `method`, `model`, `family`, `fingerprint` (a ranking is never applied to another
model), `num_layers`, `scores` (one per layer, the method's own measure), `order` (layers, first = skipped
first) and `calibration` (the inputs: task, split, n, seed, and the readout where one applies).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from trimvlm.depth.base import model_fingerprint
from trimvlm.errors import InputError
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


def rank(vlm, method: str, records, batch_size: int = 16, on_step=None, calibration: dict | None = None,
         model: str = "") -> dict:  # fmt: skip
    """Score and rank every block of `vlm` with ranker `method` on task `records` (answers are never read); the
    ranking file's content."""
    if method not in RANKERS:
        raise InputError(f"unknown calibration method {method!r}; allowed: candidates, {', '.join(sorted(RANKERS))}")
    scores, order = RANKERS[method].score(vlm.runner, prepare_batches(vlm, records, batch_size), on_step)
    return ranking_data(vlm, method, scores, order, {"n": len(records), **(calibration or {})}, model)


def ranking_data(vlm, method: str, scores, order, calibration: dict, model: str = "") -> dict:
    """The one ranking-file format (see the module docstring)."""
    return {"method": method, "model": str(model), "family": vlm.family, "fingerprint": model_fingerprint(vlm.adapter),
            "num_layers": vlm.runner.num_layers, "scores": [float(x) for x in scores], "order": [int(i) for i in order],
            "calibration": dict(calibration)}  # fmt: skip


def write_ranking(data: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
