"""Decision-guided pruning (FastJEV's P, paper section 3.4): rank the decoder blocks by how much skipping each
one *in the candidate branches only* moves the relative candidate scores.

For every calibration input x (image, question, candidates; answer labels are never read):

    z(x)      the decision logits of the unpruned model, measured before any softmax: with the head readout
              [logit_1 .. logit_N, abstain] (a binary request: [logit, 0], the sigmoid's two-class form), with
              the loglik readout the N candidate log-likelihood sums
    z^(-l)(x) the same with block l skipped in the candidate branches; the prefix runs every block in both
    ctr(v) = v - mean(v) 1,  rms(v) = ||v||_2 / sqrt(m)  (`_rms_ctr`: rms(ctr(v)))
    d_l(x) = rms(ctr(z^(-l)(x) - z(x))) / max(1e-8, rms(ctr(z(x))))
    J_l    = mean of d_l(x) over the calibration set;  order = layers by ascending J_l, ties by layer index

Each batch of requests is prefilled once and its candidate branches are run L + 1 times off that same prefix
(never written by a branch run): once unpruned, once per skipped block. `trimvlm calibrate` (trimvlm.cli_calibrate)
writes the result as a ranking file for `depth=ranking:file=...:budget=K:scope=candidates`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from trimvlm.errors import InputError
from trimvlm.options import is_int
from trimvlm.runtime.meter import Meter
from trimvlm.scoring.engine import check_choice, prefill_requests, read, run_branches
from trimvlm.scoring.request import READOUTS, ScoreRequest, ScoreResult

EPS = 1e-8
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


def _rms_ctr(v: np.ndarray) -> float:
    return float(np.linalg.norm(v - v.mean()) / math.sqrt(v.size))


def sensitivity(z: np.ndarray, z_skip: np.ndarray) -> float:
    """d_l(x) = rms(ctr(z^(-l) - z)) / max(eps, rms(ctr(z)))."""
    return _rms_ctr(z_skip - z) / max(EPS, _rms_ctr(z))


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
