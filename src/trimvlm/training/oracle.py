"""The oracle router: per input, the cheapest layout that answers it right; its accuracy under a budget is the
ceiling any router choosing among the same layouts can reach on those inputs.

A layout answers an input right when greedy decoding under it produces the reference answer: teacher-forced on
the reference tokens followed by the end token, cut to the tokens the task generates for that input (a prefill
probe: its first token; a full answer: up to the task's cap), the argmax at every one of those positions is the
forced token (`answer_target`, `answers_right`). The decoded text then equals the reference, so the task's
exact-match metrics score it right.

Under a budget B (a mean total-FLOP ratio over the inputs) the oracle picks one layout per input so that as many
inputs as possible are answered right (`oracle_at`). Input i costs at least base_i, its cheapest layout, and
answering it right costs w_i = (its cheapest right layout) - base_i more (infinite when none is right). Any choice
with S right inputs spends at least sum(base) + sum_{i in S} w_i, and the k smallest w_i have the smallest sum of
any k of them; so if any k inputs can be answered right within the budget, the k of smallest w_i can. Taking the
inputs in increasing w_i while the mean fits (the others at their cheapest layout) is therefore optimal (a
knapsack whose items all have value 1 is solved by its lightest items first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OracleChoice:
    """The oracle under one budget: per input its layout (-1: the budget is out of reach), how many it answers
    right and the mean cost it spends."""

    budget: float
    layout: list[int]
    right: int
    n: int
    mean_cost: float

    @property
    def accuracy(self) -> float | None:
        return self.right / self.n if self.reached else None

    @property
    def reached(self) -> bool:
        """Whether the budget is within reach (every input at its cheapest layout fits)."""
        return not self.layout or self.layout[0] >= 0


def answer_target(reference: torch.Tensor, stop_id: int, cap: int) -> torch.Tensor:
    """The tokens greedy decoding must produce for the reference answer [n]: the answer and its end token, cut
    to the `cap` tokens the task generates."""
    return torch.cat([reference, torch.tensor([stop_id], dtype=reference.dtype)])[:cap]


def answers_right(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[R] bool: per row of logits [R, n, V] (along the forced target [n]), whether its argmax is the target
    at every position."""
    return (logits.argmax(-1) == target.to(logits.device)[None]).all(-1).cpu()


def cheapest_right(right: torch.Tensor, cost: torch.Tensor) -> torch.Tensor:
    """[N] per input the cost of its cheapest right layout (inf: none is right); `right` [N, M] bool, `cost`
    [N, M] or [M]."""
    cost = cost.double().expand(right.shape)
    return cost.masked_fill(~right, float("inf")).amin(1)


def oracle_at(right: torch.Tensor, cost: torch.Tensor, budget: float, tol: float = 1e-9) -> OracleChoice:
    """The most inputs answered right with mean cost <= `budget` (module docstring: optimal by the lightest
    extra costs first). `right` [N, M] bool, `cost` [N, M] or [M]."""
    n = right.shape[0]
    cost = cost.double().expand(right.shape)
    base, cheap = cost.min(1)
    best = cost.masked_fill(~right, float("inf")).argmin(1)
    extra = cost.gather(1, best[:, None])[:, 0] - base
    extra = extra.masked_fill(~right.any(1), float("inf"))
    layout = cheap.clone()
    spent = float(base.sum())
    if spent > budget * n + tol:
        return OracleChoice(budget, [-1] * n, 0, n, spent / n)
    for i in torch.argsort(extra, stable=True).tolist():
        if spent + float(extra[i]) > budget * n + tol:
            break
        spent += float(extra[i])
        layout[i] = best[i]
    got = int(right.gather(1, layout[:, None]).sum())
    return OracleChoice(budget, layout.tolist(), got, n, spent / n)
