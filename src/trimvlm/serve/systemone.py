"""`POST /v1/systemone`: System One decision requests, as `transformers serve` takes and answers them.

Request: `{"model"?, "state", "questions": {name: question}, "assets"?: {placeholder: image}}`, plus trimvlm's
`recipe` extension (a recipe string; default: the server's). `model` may be left out (the server holds one
model); naming another is a 400, as in a pinned `transformers serve`.
Response: `{"model", "answers": {name: answer}, "usage": {"input_tokens", "output_tokens": 0, ...}}`, the answers
exactly as `vlm.decide` gives them for the request alone, `usage` with trimvlm's cost fields
(`decision.RequestCosts.usage()`) and the server's: `recipe`, `queue_s` (prepared -> its batch started),
`server_latency_s` (the body read -> the answer ready).

Each request is checked and tokenized by `decision.prepare_request` as it arrives (its errors: 422 / 400, see
errors.py); requests with the same recipe are then answered together by one `decision.run`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class DecideJob:
    prepared: object  # decision.PreparedRequest
    recipe: object  # the parsed recipe (the batch key holds its label)


async def handle(state, request) -> dict:
    with state.batcher.arrival() as arrival:  # the model thread waits for it while it is prepared
        return await _handle(state, request, arrival)


async def _handle(state, request, arrival) -> dict:
    t0 = time.perf_counter()
    body = await state.read_json(request)
    recipe = state.recipe("decide", body.pop("recipe", None))
    model = state.model_name(body)
    body.pop("model", None)
    from trimvlm.decision import prepare_request

    prepared = await state.prepare(
        prepare_request,
        state.vlm,
        body,
        decision_config=state.decision_config,
        limits=state.limits.decision(),
    )
    (answers, costs), job = await state.submit(
        ("decide", recipe.label), DecideJob(prepared, recipe.recipe), arrival
    )
    usage = costs.usage() | {
        "recipe": recipe.label,
        "queue_s": job.started - job.enqueued,
        "server_latency_s": time.perf_counter() - t0,
    }
    return {"model": model, "answers": answers, "usage": usage}


def run(state, key, jobs: list[DecideJob]) -> list:
    """On the model thread: every prompt of every request in one forward."""
    from trimvlm.decision import run as run_decisions
    from trimvlm.plan import decision_plan

    plan = decision_plan(jobs[0].recipe, state.vlm.runner)
    result = run_decisions(state.vlm, [j.prepared for j in jobs], plan)
    return list(zip(result.answers, result.usage, strict=True))
