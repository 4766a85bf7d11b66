"""score(): encode every request's prefix once (full backbone, or what the recipe's prefill methods leave),
run the candidates with the chosen executor, read them out."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trimvlm.errors import InputError
from trimvlm.runtime.meter import Meter
from trimvlm.runtime.plan import Plan
from trimvlm.scoring.executors import EXECUTORS, MERGED, NAMES, choose
from trimvlm.scoring.executors.common import Work
from trimvlm.scoring.layout import Layout, check_length
from trimvlm.scoring.readout import Features, features
from trimvlm.scoring.request import READOUTS, CandidateScore, ScoreBatch, ScoreRequest, ScoreResult
from trimvlm.scoring.trie import build_forest


def check_executor(executor: str) -> None:
    if executor not in NAMES:
        raise InputError(f"unknown executor {executor!r}; allowed: {', '.join(NAMES)}")


def check_choice(executor: str, readout: str, head) -> None:
    check_executor(executor)
    if readout not in READOUTS:
        raise InputError(f"unknown readout {readout!r}; allowed: {', '.join(READOUTS)}")
    if readout == "head" and head is None:
        raise InputError(
            "readout 'head' needs a trained decision head next to the checkpoint (decision_head.safetensors); "
            "train one with `trimvlm train-head`, or use readout 'loglik'"
        )


@dataclass
class Prefilled:
    """Every request's prefix, encoded once (full backbone, or what the recipe's prefill methods leave), with
    what the candidate branches need. Branch runs only read it, so one `Prefilled` serves many of them
    (calibration runs the branches once per skipped layer off the same prefixes)."""

    requests: list[ScoreRequest]
    layout: Layout
    suffixes: list[list[list[int]]]  # [request][candidate] -> suffix token ids (markers included)
    plan: object  # trimvlm.plan.Plan
    prefix: object  # trimvlm.runtime.runner.PrefillOutput
    starts: list[int]  # per request: the position of every suffix's first token
    meter: Meter


@torch.no_grad()
def prefill_requests(vlm, requests: list[ScoreRequest], *, plan: Plan | None = None, meter=None) -> Prefilled:
    """Check the requests and encode their prefixes once: `Runner.prefill(batch, plan)` (the plan's prefill
    methods and its KV step at the boundary; `trimvlm.plan.make_plan` builds it from a recipe)."""
    runner, ad = vlm.runner, vlm.adapter
    for i, r in enumerate(requests):
        r.check(i)
    layout = Layout.for_adapter(ad)
    suffixes = [[layout.encode(ad.tokenizer, c, k) for k, c in enumerate(r.candidates)] for r in requests]
    plan = plan or Plan()
    plan.refuse_routes("candidate scoring")
    meter = meter or Meter(device=runner.device)
    prepared = vlm.prepare([r.images for r in requests], [r.question for r in requests], plan=plan)
    starts = ad.next_positions(prepared).tolist()  # checked before any model work
    for r, sfx in enumerate(suffixes):
        for k, s in enumerate(sfx):
            check_length(layout, starts[r], s, r, k)
    pre = runner.prefill(prepared, plan, meter=meter)
    starts = pre.next_pos.tolist()
    return Prefilled(list(requests), layout, suffixes, plan, pre, starts, meter)


@torch.no_grad()
def run_branches(vlm, prefilled: Prefilled, *, executor: str = "auto", skip_branch=None, meter=None):
    """The candidate branches off already encoded prefixes (never written). Returns (Work, node states,
    Features, the executor that ran). `skip_branch` overrides the recipe's candidate-branch skip set; `meter`
    defaults to the prefill's."""
    runner = vlm.runner
    check_executor(executor)
    meter = meter or prefilled.meter
    suffixes, starts = prefilled.suffixes, prefilled.starts
    forest = None
    if executor == "auto":
        merged = build_forest(suffixes, starts, merge=True)
        executor = choose(merged)
        forest = merged if executor in MERGED else None
    forest = forest or build_forest(suffixes, starts, merge=executor in MERGED)
    plan = prefilled.plan
    skip = plan.skip_branch if skip_branch is None else frozenset(int(i) for i in skip_branch)
    runner.check_layers(skip, "skipped layer")
    work = Work(runner=runner, prefix=prefilled.prefix, forest=forest, skip=skip, meter=meter, plan=plan)
    with meter.timer("branch"), meter.phase_memory("branch"):
        states = EXECUTORS[executor](work)
        feats = features(work, states, prefilled.layout.first_counted, len(prefilled.layout.close_ids))
    return work, states, feats, executor


@torch.no_grad()
def run_scoring(
    vlm, requests: list[ScoreRequest], *, executor: str = "auto", plan=None, meter=None, skip_branch=None
):
    """Prefill + candidates. Returns (Work, node states, Features, the executor that ran). `skip_branch`
    overrides the recipe's candidate-branch skip set (calibration skips one layer at a time)."""
    check_executor(executor)  # before the prefix is encoded
    prefilled = prefill_requests(vlm, requests, plan=plan, meter=meter)
    return run_branches(vlm, prefilled, executor=executor, skip_branch=skip_branch)


def score_requests(
    vlm, requests: list[ScoreRequest], *, readout="loglik", executor="auto", plan=None, track_memory=False
) -> ScoreBatch:
    head = vlm.head
    check_choice(executor, readout, head)
    meter = Meter(device=vlm.adapter.model.device, track_tensors=track_memory)
    meter.start_memory()
    work, _, feats, ran = run_scoring(vlm, requests, executor=executor, plan=plan, meter=meter)
    with meter.timer("branch"):
        results = read(requests, feats, readout, head, meter)
    meter.stop_memory()
    if meter.costs.peak_memory_kind == "cpu_peak_rss_growth":  # the process' RSS growth: not this call's
        meter.costs.peak_memory_bytes, meter.costs.peak_memory_kind = 0, "not measured (track_memory=True)"
    return ScoreBatch(
        results=results,
        costs=meter.costs,
        readout=readout,
        executor=ran,
        recipe=work.plan.label(),
        tokens={"logical": work.forest.logical_tokens, "unique": work.forest.num_nodes, "executed": work.executed},
    )


def read(requests, feats: Features, readout: str, head, meter) -> list[ScoreResult]:
    results = []
    for r, req in enumerate(requests):
        abstain = abstain_p = binary_p = None
        if readout == "head":
            meter.add("method", head.flops(len(req.candidates)))
            # LM features are accumulated in double on the model's device; the head has its own dtype and device
            p = next(head.parameters())
            logits, ab = (x[0] for x in head(*(t[r][None].to(p.device, p.dtype) for t in (feats.z_q, feats.u, feats.feats))))
            if req.binary:
                binary_p = float(torch.sigmoid(logits[0]))
                probs = torch.tensor([binary_p], device=logits.device)
                chosen = 0 if binary_p >= 0.5 else -1
            else:
                p = torch.softmax(torch.cat([logits, ab[None]]), 0)
                probs, abstain, abstain_p = p[:-1], float(ab), float(p[-1])
                top = int(p.argmax())
                chosen = -1 if top == len(req.candidates) else top
        else:
            logits = feats.sums[r]
            probs = torch.softmax(logits, 0)
            chosen = int(logits.argmax())
        cands = [
            CandidateScore(
                text=req.candidates[k],
                logit=float(logits[k]),
                prob=float(probs[k]),
                loglik_sum=float(feats.sums[r][k]),
                loglik_mean=float(feats.means[r][k]),
                n_tokens=int(feats.counts[r][k]),
                is_greedy=bool(feats.greedy[r][k]),
                answer_loglik=float(feats.answer_sums[r][k]),
                answer_greedy=bool(feats.answer_greedy[r][k]),
            )
            for k in range(len(req.candidates))
        ]
        results.append(ScoreResult(req.question, cands, chosen, abstain, abstain_p, binary_p))
    return results
