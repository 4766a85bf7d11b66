"""Decision sensitivity of each block on the next-token logits at the answer position (the criterion of
docs/references.md#decision-guided-pruning-p, FastJEV's J_l, applied to generation):

    z(x) = the unpruned model's logits for the first answer token;  z^(-l)(x) the same with block l skipped
    d_l(x) = rms(ctr(z^(-l)(x) - z(x))) / max(1e-8, rms(ctr(z(x)))),  J_l = mean of d_l over the inputs

(ctr(v) = v - mean(v), rms(v) = ||v|| / sqrt(m)). Least sensitive first. Each batch is prefilled L + 1 times.
"""

from __future__ import annotations

import torch

from trimvlm.depth.calibration import Ranker, answer_logits, ascending, register_ranker

EPS = 1e-8


def _rms_ctr(v: torch.Tensor) -> torch.Tensor:
    c = v - v.mean(-1, keepdim=True)
    return c.pow(2).mean(-1).sqrt()


def sensitivity(runner, batches, on_step=None) -> tuple[list[float], list[int]]:
    n = runner.num_layers
    d: list[list[float]] = [[] for _ in range(n)]
    for prepared in batches:
        z = answer_logits(runner, prepared)
        if on_step is not None:
            on_step()
        scale = _rms_ctr(z).clamp(min=EPS)
        for layer in range(n):
            zs = answer_logits(runner, prepared, {layer})
            d[layer] += (_rms_ctr(zs - z) / scale).tolist()
            if on_step is not None:
                on_step()
    scores = [sum(v) / len(v) for v in d]
    return scores, ascending(scores)


register_ranker(Ranker("sensitivity", sensitivity, lambda batches, layers: batches * (layers + 1), "J_l"))
