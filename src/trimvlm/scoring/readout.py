"""Readouts: the language-model features of every candidate (FastJEV's candidate-preserving readout) and the
scores made from them.

Each predictor state is projected to the vocabulary once (the prefix's last token, and every trie node that has
children), at most `CHUNK` rows at a time, normalised over the full vocabulary; a candidate's token log-probs
are gathered along its path. Scored tokens: everything after the open marker (the candidate's tokens and its
close marker: ending the answer is part of it). Features per candidate
(docs/references.md#branches-features-and-the-decision-head): sum / 10, mean, count / 10, log-softmax of the
sums across the request's candidates, first-token log-prob read from z_q, a valid flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trimvlm.scoring.executors.common import Work

CHUNK = 128
N_FEATURES = 6


@dataclass
class Features:
    """Per request r: z_q [D], u [N, D], feats [N, 6], sums/means/counts/greedy [N]."""

    z_q: list[torch.Tensor]
    u: list[torch.Tensor]
    feats: list[torch.Tensor]
    sums: list[torch.Tensor]
    means: list[torch.Tensor]
    counts: list[torch.Tensor]
    greedy: list[torch.Tensor]
    answer_sums: list[torch.Tensor] = field(default_factory=list)  # [N]: without the close marker's tokens
    answer_greedy: list[torch.Tensor] = field(default_factory=list)


def token_logprobs(work: Work, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob, is-argmax) of every node's token given its history, on the states' device."""
    f = work.forest
    ad = work.runner.adapter
    n, dev = f.num_nodes, states.device
    lp = torch.zeros(n, dtype=torch.float64, device=dev)  # sums of many log-probs: accumulate in double
    greedy = torch.zeros(n, dtype=torch.bool, device=dev)
    parent = torch.tensor(f.parent, dtype=torch.long, device=dev)
    token = torch.tensor(f.token, dtype=torch.long, device=dev)
    first = parent < 0
    if bool(first.any()):  # predicted by the prefix's last token: the prefill logits
        rows = torch.tensor(f.request, dtype=torch.long, device=dev)[first]
        lsm = torch.log_softmax(work.prefix.logits.double(), dim=-1)
        lp[first] = lsm[rows, token[first]]
        greedy[first] = lsm[rows].argmax(-1) == token[first]
    predictors = sorted({p for p in f.parent if p >= 0})
    slot = torch.full((n,), -1, dtype=torch.long, device=dev)
    slot[torch.tensor(predictors, dtype=torch.long, device=dev)] = torch.arange(len(predictors), device=dev)
    child_slot = torch.where(first, torch.full_like(parent, -1), slot[parent.clamp(min=0)])
    for a in range(0, len(predictors), CHUNK):
        rows = torch.tensor(predictors[a : a + CHUNK], dtype=torch.long, device=dev)
        work.meter.add("branch", ad.head_flops(1, len(rows)))
        lsm = torch.log_softmax(ad.lm_head(states[rows]).double(), dim=-1)
        sel = (child_slot >= a) & (child_slot < a + len(rows))
        local = child_slot[sel] - a
        lp[sel] = lsm[local, token[sel]]
        greedy[sel] = lsm[local].argmax(-1) == token[sel]
    return lp, greedy


def features(work: Work, states: torch.Tensor, first_counted: int, n_close: int = 0) -> Features:
    """Every request's features, on the states' device (the model's); `n_close`: the close marker's tokens, left
    out of `answer_sums` / `answer_greedy`."""
    f, dev = work.forest, states.device
    lp, greedy = token_logprobs(work, states)
    prefix_lsm = torch.log_softmax(work.prefix.logits.double(), dim=-1)
    out = Features([], [], [], [], [], [], [])
    for r, paths in enumerate(f.paths):
        scored = [torch.tensor(p[first_counted:], dtype=torch.long, device=dev) for p in paths]
        sums = torch.stack([lp[s].sum() for s in scored])
        counts = torch.tensor([len(s) for s in scored], dtype=torch.float64, device=dev)
        means = sums / counts
        first_tok = torch.tensor([f.token[p[first_counted]] for p in paths], dtype=torch.long, device=dev)
        first_lp = prefix_lsm[r, first_tok]
        feats = torch.stack(
            [sums / 10, means, counts / 10, torch.log_softmax(sums, 0), first_lp, torch.ones_like(sums)],
            dim=-1,
        )
        out.z_q.append(work.prefix.seq.hidden[r, -1].float())
        out.u.append(states[torch.tensor([p[-1] for p in paths], dtype=torch.long, device=dev)].float())
        out.feats.append(feats)
        out.sums.append(sums)
        out.means.append(means)
        out.counts.append(counts)
        out.greedy.append(torch.stack([greedy[s].all() for s in scored]))
        answer = [s[: len(s) - n_close] for s in scored]
        out.answer_sums.append(torch.stack([lp[s].sum() for s in answer]))
        out.answer_greedy.append(torch.stack([greedy[s].all() for s in answer]))
    return out
