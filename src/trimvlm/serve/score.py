"""`POST /v1/score`: candidate scoring in vLLM's score shape (`text_1` one question, `text_2` its candidates,
trimvlm's `images`, `readout`, `executor` and `recipe`), answered by `vlm.score` (docs/serving.md, "POST
/v1/score"). Requests with the same readout, executor and recipe run as one call; with the loglik readout those
on the same images and question share one prefix, each request's probabilities those of its own candidates.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import NamedTuple

import torch
from pydantic import Field

from trimvlm.decision.costs import split
from trimvlm.scoring.executors import NAMES
from trimvlm.scoring.request import READOUTS, CandidateScore, ScoreRequest, ScoreResult
from trimvlm.serve.chat import _Strict, decode_image
from trimvlm.serve.errors import check, parse_json, validated
from trimvlm.serve.jobs import JobKey
from trimvlm.serve.reply import answered, served


class ScoreBody(_Strict):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    images: list[str] = Field(default_factory=list)
    readout: str = "loglik"
    executor: str = "auto"
    recipe: str | None = None


@dataclass
class ScoreJob:
    images: list  # decoded
    question: str
    candidates: list[str]
    recipe: object
    prefix: tuple  # what its prefix is made of: its images' data URLs and question (requests that share it)


class Scored(NamedTuple):
    """A request's answer from its batch: its `scoring.request.ScoreResult` and its usage."""

    result: object
    usage: dict


def parse(body: dict, limits) -> ScoreBody:
    req = validated(ScoreBody, body)
    check(isinstance(req.text_1, str), "text_1: one question per request (a string)")
    check(req.text_1.strip(), "text_1: an empty question")
    cands = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    check(cands and all(isinstance(c, str) and c.strip() for c in cands),
          "text_2: one or more non-empty candidate strings")
    check(len(cands) <= limits.max_candidates,
          f"text_2: {len(cands)} candidates, at most {limits.max_candidates} per request")
    check(len(req.images) <= limits.max_images,
          f"too many images: {len(req.images)}, at most {limits.max_images} per request")
    check(req.readout in READOUTS, f"readout {req.readout!r}: one of {', '.join(READOUTS)}")
    check(req.executor in NAMES, f"executor {req.executor!r}: one of {', '.join(NAMES)}")
    req.text_2 = cands
    return req


async def handle(state, request, arrival) -> dict:
    t0 = time.perf_counter()
    body = parse_json(await state.read_body(request))
    req = parse(body, state.limits)
    model = state.model_name(body)
    recipe = state.recipes.get("score", req.recipe)
    state.need_lm_head()
    check(req.readout != "head" or state.vlm.head is not None,
          "readout 'head': this model has no trained decision head; use readout 'loglik'")
    images = await state.prepare(lambda: [decode_image(i + 1, u, state.limits) for i, u in enumerate(req.images)])
    job = ScoreJob(images, req.text_1, req.text_2, recipe.recipe, (*req.images, req.text_1))
    queued = state.batcher.enqueue(JobKey("score", recipe.label, req.readout, req.executor), job, arrival)
    scored = await answered(state, request, queued)
    data = [{
        "index": k, "object": "score", "score": c.prob, "text": c.text, "logit": c.logit, "logprob": c.loglik_sum,
        "logprob_mean": c.loglik_mean, "tokens": c.n_tokens, "greedy": c.is_greedy,
    } for k, c in enumerate(scored.result.candidates)]  # fmt: skip
    usage = scored.usage | served(recipe.label, queued, t0)
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "chosen": scored.result.chosen, "abstain_prob": scored.result.abstain_prob,
            "usage": usage}  # fmt: skip


def run(state, key, jobs: list[ScoreJob]) -> list:
    """On the model thread: the batch's requests as one `vlm.score` call; its `Scored` per job. With
    the loglik readout, jobs on the same prefix are one request over the union of their candidates."""
    readout, executor = key.readout, key.executor
    groups: dict[tuple, list[int]] = {}
    for i, j in enumerate(jobs):
        groups.setdefault(j.prefix if readout == "loglik" else (i,), []).append(i)
    requests, where = [], {}
    for members in groups.values():
        cands = list(dict.fromkeys(c for i in members for c in jobs[i].candidates))
        first = jobs[members[0]]
        for i in members:
            where[i] = (len(requests), {c: k for k, c in enumerate(cands)}, len(members))
        requests.append(ScoreRequest(first.images or None, first.question, cands))
    out = state.vlm.score(requests, readout=readout, executor=executor, recipe=jobs[0].recipe)
    c, n = out.costs, len(jobs)
    shares = {
        "vision_flops": c.flops.get("vision", 0), "prefill_flops": c.flops.get("prefill", 0),
        "branch_flops": c.flops.get("branch", 0), "method_flops": c.method_total_flops, "kv_bytes": c.kv_bytes,
    }  # fmt: skip
    shares = {k: split(v, [1] * n) for k, v in shares.items()}
    results = []
    for i, j in enumerate(jobs):
        r, index, shared = where[i]
        got = out.results[r]
        if readout == "loglik" and [x.text for x in got.candidates] != j.candidates:  # its own candidates' softmax
            mine = [got.candidates[index[cand]] for cand in j.candidates]
            probs = torch.softmax(torch.tensor([m.loglik_sum for m in mine], dtype=torch.float64), 0).tolist()
            cands = [CandidateScore(**{**vars(m), "logit": m.loglik_sum, "prob": p}) for m, p in zip(mine, probs, strict=True)]
            got = ScoreResult(question=got.question, candidates=cands, chosen=max(range(len(cands)),
                              key=lambda k: cands[k].logit))  # fmt: skip
        usage = {k: v[i] for k, v in shares.items()}
        usage |= {"candidates": len(j.candidates), "executor": out.executor, "readout": readout,
                  "batch_requests": n, "shared_prefix_requests": shared}
        results.append(Scored(got, usage))
    return results
