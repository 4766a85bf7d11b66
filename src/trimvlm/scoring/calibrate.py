"""Decision-guided pruning (FastJEV's P, paper section 3.4): rank the decoder blocks by how much skipping each
one *in the candidate branches only* moves the relative candidate scores.

For every calibration input x (image, question, candidates; answer labels are never read):

    z(x)      the decision logits of the unpruned model, measured before any softmax: with the head readout
              [logit_1 .. logit_N, abstain] (a binary request: [logit, 0], the sigmoid's two-class form), with
              the loglik readout the N candidate log-likelihood sums
    z^(-l)(x) the same with block l skipped in the candidate branches; the prefix runs every block in both
    ctr(v) = v - mean(v) 1,  rms(v) = ||v||_2 / sqrt(m)
    d_l(x) = rms(ctr(z^(-l)(x) - z(x))) / max(1e-8, rms(ctr(z(x))))
    J_l    = mean of d_l(x) over the calibration set;  order = layers by ascending J_l, ties by layer index

Each batch of requests is prefilled once and its candidate branches are run L + 1 times off that same prefix
(never written by a branch run): once unpruned, once per skipped block. `trimvlm calibrate` writes the result
as a ranking file for `depth=ranking:file=...:budget=K:scope=candidates`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from trimvlm.depth.base import model_fingerprint
from trimvlm.errors import InputError
from trimvlm.options import is_int
from trimvlm.runtime.meter import Meter
from trimvlm.scoring.engine import check_choice, prefill_requests, read, run_branches
from trimvlm.scoring.request import READOUTS, ScoreRequest, ScoreResult

EPS = 1e-8
CALIBRATION_TASKS = ("demo", "demo-candidates")  # the demo task's candidate questions, val split
DEFAULT_BATCH = 16


def check_readout_name(readout: str) -> None:
    """A readout or `auto` (checked before any model is loaded)."""
    if readout != "auto" and readout not in READOUTS:
        raise InputError(f"unknown readout {readout!r}; allowed: auto, {', '.join(READOUTS)}")


def resolve_readout(vlm, readout: str) -> str:
    """`auto` is the head readout when the model has a trained decision head, else loglik."""
    check_readout_name(readout)
    if readout == "auto":
        return "head" if vlm.head is not None else "loglik"
    return readout


def decision_logits(result: ScoreResult, readout: str) -> np.ndarray:
    """z(x) of one scored request: the logits the decision is made from, abstention included (head)."""
    z = list(result.logits)
    if readout == "head":
        z.append(0.0 if result.abstain_logit is None else float(result.abstain_logit))
    return np.asarray(z, dtype=np.float64)


def ctr(v: np.ndarray) -> np.ndarray:
    return v - v.mean()


def rms(v: np.ndarray) -> float:
    return float(np.linalg.norm(v) / math.sqrt(v.size))


def sensitivity(z: np.ndarray, z_skip: np.ndarray) -> float:
    """d_l(x) = rms(ctr(z^(-l) - z)) / max(eps, rms(ctr(z)))."""
    return rms(ctr(z_skip - z)) / max(EPS, rms(ctr(z)))


def rank_layers(J: list[float]) -> list[int]:
    """Layers by ascending J_l (least sensitive first), ties by layer index."""
    return sorted(range(len(J)), key=lambda i: (J[i], i))


@torch.no_grad()
def calibrate(
    vlm,
    requests: list[ScoreRequest],
    readout: str = "auto",
    *,
    executor: str = "auto",
    batch_size: int = DEFAULT_BATCH,
    on_step: Callable[[], None] | None = None,
) -> dict:
    """J_l of every block and the ranking. `on_step` is called after each branch run (progress); there are
    ceil(len(requests) / batch_size) * (num_layers + 1) of them. Returns {num_layers, readout, executor, n,
    J, order, d} (d: d_l(x) per layer, per input, in request order)."""
    if not requests:
        raise InputError("calibration needs at least one input")
    if not is_int(batch_size) or batch_size <= 0:
        raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
    readout = resolve_readout(vlm, readout)
    head = vlm.head if readout == "head" else None
    check_choice(executor, readout, head)
    n_layers = vlm.runner.num_layers
    d: list[list[float]] = [[] for _ in range(n_layers)]
    ran = set()
    for a in range(0, len(requests), batch_size):
        batch = requests[a : a + batch_size]
        # once per batch; every branch run below reads it
        pre = prefill_requests(vlm, batch, meter=Meter(device=vlm.runner.device))
        runs = [frozenset()] + [frozenset({layer}) for layer in range(n_layers)]
        z = []
        for skip in runs:
            _, _, feats, name = run_branches(vlm, pre, executor=executor, skip_branch=skip)
            ran.add(name)
            z.append([decision_logits(r, readout) for r in read(batch, feats, readout, head, pre.meter)])
            if on_step is not None:
                on_step()
        for layer in range(n_layers):
            d[layer] += [sensitivity(z0, zs) for z0, zs in zip(z[0], z[layer + 1], strict=True)]
    J = [float(np.mean(v)) for v in d]
    return {
        "num_layers": n_layers,
        "readout": readout,
        "executor": ",".join(sorted(ran)),
        "n": len(requests),
        "J": J,
        "order": rank_layers(J),
        "d": d,
    }


def calibration_requests(task: str, n: int, seed: int) -> list[ScoreRequest]:
    """`n` unlabeled candidate questions of the demo task's val split (image-major, every kind in turn; the
    answers are never read)."""
    from trimvlm.demo import task as demo

    kinds = list(demo.KINDS)
    samples = demo.generate_split("val", math.ceil(n / len(kinds)), seed=seed)
    out = [
        ScoreRequest(images=s.image, question=qa.question, candidates=list(qa.candidates))
        for s in samples
        for qa in s.qas
        if qa.kind in demo.KINDS
    ]
    return out[:n]


def check_inputs(task: str, n, readout: str) -> None:
    if str(task) not in CALIBRATION_TASKS:
        raise InputError(
            f"unknown calibration task {task!r}; allowed: {', '.join(CALIBRATION_TASKS)} (the demo task's "
            "candidate questions, val split)"
        )
    if not is_int(n) or n < 1:
        raise InputError(f"n must be a positive number of calibration inputs, got {n!r}")
    check_readout_name(readout)


def calibrate_command(
    model: str | Path = "demo",
    task: str = "demo",
    n: int = 32,
    readout: str = "auto",
    seed: int = 0,
    json_out: str | Path | None = "rank.json",
    console=None,
    batch_size: int = DEFAULT_BATCH,
    load_kw: dict | None = None,
) -> dict:
    """`trimvlm calibrate`: rank `model`'s blocks on `n` unlabeled demo val inputs, write the ranking JSON
    {model, family, num_layers, readout, task, n, seed, J, order}, print a table. Returns the JSON's content."""
    import trimvlm

    check_inputs(task, n, readout)
    if not is_int(seed):
        raise InputError(f"seed must be an integer, got {seed!r}")
    if console is None:
        from rich.console import Console

        console = Console()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    vlm = trimvlm.load(model, **(load_kw or {}))
    resolved = resolve_readout(vlm, readout)
    check_choice("auto", resolved, vlm.head)
    requests = calibration_requests(task, n, seed)
    steps = math.ceil(len(requests) / batch_size) * (vlm.runner.num_layers + 1)
    with Progress(
        TextColumn("[bold]calibrate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as bar:
        job = bar.add_task("calibrate", total=steps)
        res = calibrate(vlm, requests, resolved, batch_size=batch_size, on_step=lambda: bar.advance(job))
    data = {
        "method": "candidates",
        "model": str(model),
        "fingerprint": model_fingerprint(vlm.adapter),
        "family": vlm.family,
        "num_layers": res["num_layers"],
        "readout": res["readout"],
        "task": str(task),
        "n": res["n"],
        "seed": seed,
        "J": res["J"],
        "order": res["order"],
    }
    if json_out is not None:
        path = Path(json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
    print_ranking(data, vlm.adapter.layer_types, console)
    if json_out is not None:
        console.print(f"wrote {json_out}")
    return data


def print_ranking(data: dict, layer_types: list[str], console) -> None:
    from rich.table import Table

    rank = {layer: k for k, layer in enumerate(data["order"])}
    t = Table(
        title=f"decision sensitivity J_l ({data['model']}, {data['readout']} readout, {data['n']} inputs)",
        title_justify="left",
    )
    for col in ("layer", "type", "J_l", "rank"):
        t.add_column(col, justify="left" if col == "type" else "right")
    for layer, j in enumerate(data["J"]):
        t.add_row(str(layer), layer_types[layer], f"{j:.4g}", str(rank[layer] + 1))
    console.print(t)
    console.print(f"order (least sensitive first): {data['order']}")
