"""`decide`: System One requests -> answers, every prompt of every request in one batch through the runner.

    decide(vlm, requests)  =  run(vlm, [prepare_request(vlm, r) for r in requests])

`prepare_request` (prompts.py) checks and tokenizes one request on the CPU; `run` answers a list of prepared
requests with one forward and returns a `DecisionResult`: the answers, in the shape transformers'
`DecisionPipeline` returns, and per request its costs (costs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trimvlm.decision.costs import RequestCosts, grouped, request_costs, split
from trimvlm.decision.errors import DecisionError, RequestError
from trimvlm.decision.forward import run_prompts
from trimvlm.decision.limits import Limits
from trimvlm.decision.prompts import PreparedRequest, prepare_request
from trimvlm.decision.readout import answers, option_scores
from trimvlm.decision.shared import image_token, prefix_cuts, prefix_inputs, run_shared
from trimvlm.runtime.meter import Costs, Meter
from trimvlm.runtime.plan import Plan


@dataclass
class DecisionResult:
    answers: list[dict]  # per request: {question name: answer}, exactly as DecisionPipeline returns them
    usage: list[RequestCosts]  # per request: its share of the batch's costs
    costs: Costs  # the whole batch, measured as one run
    recipe: str

    def as_dict(self) -> dict:
        return {
            "answers": self.answers,
            "usage": [u.as_dict() for u in self.usage],
            "recipe": self.recipe,
            "costs": self.costs.as_dict(),
        }


def as_list(requests) -> tuple[list, bool]:
    """(requests, single): one request (a dict or its JSON) or a list of them."""
    if isinstance(requests, dict | str | bytes | bytearray):
        return [requests], True
    if isinstance(requests, list | tuple):
        if not requests:
            raise RequestError("no requests given")
        return list(requests), False
    raise RequestError(
        f"a request is a dict (or its JSON) or a list of them, got a {type(requests).__name__}"
    )


def decide(
    vlm,
    requests,
    plan: Plan,
    *,
    decision_config=None,
    limits: Limits | None = None,
    track_memory: bool = False,
) -> tuple[DecisionResult, bool]:
    """Prepare every request (an error names the request of a batch), then answer them in one forward with
    `plan` (`trimvlm.plan.decision_plan`: built before any request is tokenized, so a bad recipe fails first)."""
    items, single = as_list(requests)
    prepared = []
    for i, r in enumerate(items):
        try:
            prepared.append(prepare_request(vlm, r, decision_config=decision_config, limits=limits))
        except DecisionError as e:
            raise e.at(None if single else i) from e
    return run(vlm, prepared, plan, track_memory=track_memory), single


@torch.no_grad()
def run(vlm, prepared: list[PreparedRequest], plan: Plan, *, track_memory: bool = False) -> DecisionResult:
    """Answer prepared requests with one batch forward: request -> prepared batch -> `Runner.prefill(batch,
    plan)` -> readout (`plan`: from `trimvlm.plan.decision_plan`)."""
    if not prepared:
        raise RequestError("no requests given")
    prompts = [p for r in prepared for p in r.prompts]
    groups = [r.prompts for r in prepared]
    meter = Meter(device=vlm.runner.device, track_tensors=track_memory)
    cuts = prefix_cuts(vlm, groups)
    meter.start_memory()
    fwd = run_shared(vlm, groups, cuts, plan, meter) if cuts else run_prompts(vlm, prompts, plan, meter)
    before = meter.costs.flops.get("prefill", 0)
    with meter.timer("prefill"):
        scores = grouped(option_scores(vlm, prompts, fwd.hidden, meter), [len(r.prompts) for r in prepared])
        out = [answers(r.config, r.prompts, s) for r, s in zip(prepared, scores, strict=True)]
    meter.stop_memory()
    readout = split(meter.costs.flops["prefill"] - before, [r.questions for r in prepared])
    weights, vision_hits = encoded_images(vlm, groups, cuts, fwd)
    vision = split(meter.costs.flops.get("vision", 0), weights)
    usage = request_costs(prepared, fwd, meter.costs, vision, readout, vision_hits)
    return DecisionResult(answers=out, usage=usage, costs=meter.costs, recipe=plan.label())


def image_tokens(vlm, groups: list[list], cuts: list[int] | None) -> list[int]:
    """Per request, the image tokens the vision tower encoded for it (once per request with a shared prefix,
    once per prompt without): the weights of its share of the batch's one vision encode."""
    image = image_token(vlm)
    if image is None:
        return [0] * len(groups)
    encoded = [[prefix_inputs(g, c)] for g, c in zip(groups, cuts, strict=True)] if cuts else \
        [[p.inputs for p in g] for g in groups]  # fmt: skip
    return [sum(int((e["input_ids"] == image).sum()) for e in group) for group in encoded]


def encoded_images(vlm, groups: list[list], cuts: list[int] | None, fwd) -> tuple[list[int], list[int]]:
    """Per request, the weight of its share of the batch's vision FLOPs (its image tokens the tower encoded:
    none when its prefix was reused, fewer when the vision cache held some of its images) and how many of its
    images the vision cache held."""
    tokens = image_tokens(vlm, groups, cuts)
    reuse = fwd.reuse
    ran = list(range(len(groups))) if reuse is None else reuse.computed
    weights, hits = [0] * len(groups), [0] * len(groups)
    cache = vlm.adapter.vision_cache if vlm.adapter.caches_vision else None
    per_row = fwd.n_images
    if cuts is None:  # one row per prompt: a request's images are those of its prompts
        per_row = [sum(g) for g in grouped(per_row, [len(g) for g in groups])]
    counts = [per_row[r] for r in ran]
    seen = cache.last_hits if cache is not None else None
    if seen is None or len(seen) != sum(counts):  # nothing cached: each image ran
        seen = [False] * sum(counts)
    k = 0
    for r, n in zip(ran, counts, strict=True):
        found = sum(seen[k : k + n])
        k += n
        hits[r] = found
        weights[r] = tokens[r] * (n - found) * 1000 // max(n, 1)
    return weights, hits
