"""Block influence (ShortGPT, Men et al. 2024): how much each decoder block changes the hidden states.

    BI_l = 1 - mean_t cos(h_in_l(t), h_out_l(t))

over every real (non-padding) token t of the calibration inputs, where h_in_l enters block l and h_out_l is
what leaves it (what enters block l + 1, the family's per-layer adds included; the last block's output is the
final hidden state before the final norm). A block with a low BI barely turns its input: the first to skip.
The calibration runs the unpruned prefill once per batch and reads the states through the runner's layer hook
(nothing is patched). `trimvlm calibrate --method block-influence` writes the ranking, least influential
first, for `depth=ranking:file=...:budget=K`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trimvlm.depth.calibration import Ranker, ascending, register_ranker
from trimvlm.errors import InputError
from trimvlm.runtime.plan import Plan


def layer_states(runner, prepared) -> list[torch.Tensor]:
    """The hidden states [B, S, D] entering every block, plus the last block's output (num_layers + 1)."""
    states: list[torch.Tensor] = []

    def hook(i, seq, run):
        states.append(seq.hidden)
        return seq

    runner.prefill(prepared, Plan(hook=hook))
    return states


def block_influence(runner, batches, on_step: Callable[[], None] | None = None) -> list[float]:
    """BI_l of every block over the prepared `batches` (token-weighted over all real tokens)."""
    n = runner.num_layers
    sums = torch.zeros(n, dtype=torch.float64)
    count = 0
    for prepared in batches:
        states = layer_states(runner, prepared)
        valid = prepared.attention_mask.bool().to(states[0].device)
        for i in range(n):
            cos = torch.nn.functional.cosine_similarity(states[i].double(), states[i + 1].double(), dim=-1)
            sums[i] += cos[valid].sum().cpu()
        count += int(valid.sum())
        if on_step is not None:
            on_step()
    if count == 0:
        raise InputError("block influence needs calibration inputs with at least one token")
    return [float(1.0 - s / count) for s in sums]


def _ranked(runner, batches, on_step=None):
    scores = block_influence(runner, batches, on_step)
    return scores, ascending(scores)


register_ranker(Ranker("block-influence", _ranked, lambda batches, layers: batches, "BI_l"))
