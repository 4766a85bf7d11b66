"""Greedy KL layer removal: build the skip set one block at a time, each time adding the block whose removal
(together with those already removed) keeps the next-token distribution at the answer position closest to the
unpruned model's, in KL(p_full || p_pruned) averaged over the calibration inputs. The order is the order of
removal; a block's score is the mean KL at the step it was removed. The last block is never removed (at least
one must run); its score repeats the final step's. Cost: L (L + 1) / 2 prefills per batch.
"""

from __future__ import annotations

import torch

from trimvlm.depth.calibration import Ranker, answer_logits, register_ranker


def greedy_kl(runner, batches, on_step=None) -> tuple[list[float], list[int]]:
    n = runner.num_layers
    full = []
    for prepared in batches:
        full.append(torch.log_softmax(answer_logits(runner, prepared), -1))
        if on_step is not None:
            on_step()
    removed: list[int] = []
    scores = [float("inf")] * n
    while len(removed) < n - 1:
        best = None
        for layer in (i for i in range(n) if i not in removed):
            total, count = 0.0, 0
            for prepared, p in zip(batches, full, strict=True):
                q = torch.log_softmax(answer_logits(runner, prepared, {*removed, layer}), -1)
                total += float((p.exp() * (p - q)).sum(-1).sum())  # KL(p || q) of each input, summed
                count += p.shape[0]
                if on_step is not None:
                    on_step()
            kl = total / count
            if best is None or kl < best[1]:
                best = (layer, kl)
        removed.append(best[0])
        scores[best[0]] = best[1]
    kept = [i for i in range(n) if i not in removed]
    for i in kept:
        scores[i] = scores[removed[-1]] if removed else 0.0
    return scores, removed + kept


register_ranker(Ranker("greedy-kl", greedy_kl,
                       lambda batches, layers: batches * layers * (layers + 1) // 2, "KL at removal"))  # fmt: skip
