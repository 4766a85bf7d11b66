"""`POST /v1/systemone`: System One decision requests, as `transformers serve` takes and answers them
(docs/serving.md, "POST /v1/systemone"): transformers' own schema checks the request (422), `model` may name
only this server's, `recipe` is trimvlm's extension; each request is prepared as it arrives
(`decision.prepare_request`, through the request cache) and requests of one recipe are answered together by
one `decision.run`, each answer what `vlm.decide` gives the request alone.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from typing import NamedTuple

from transformers.decision import parse_questions

from trimvlm import decision
from trimvlm.decision.config import resolve_config
from trimvlm.plan import decision_plan
from trimvlm.runtime.lru import ByteLRU, digest, nbytes
from trimvlm.serve import INSTALL, MissingExtraError
from trimvlm.serve.errors import parse_json, schema_error, validated
from trimvlm.serve.jobs import JobKey
from trimvlm.serve.reply import answered, served


class Ready(NamedTuple):
    """A request prepared (`decision.PreparedRequest`), whether it was found in the request cache, its key there
    (None: the cache is off)."""

    request: object
    cached: bool
    key: bytes | None


class Decided(NamedTuple):
    """A request's answer from its batch: its answers, its costs (`decision.RequestCosts`), whether it was a copy
    of another request of the batch (computed once)."""

    answers: dict
    costs: object
    coalesced: bool


@dataclass
class DecideJob:
    prepared: object  # decision.PreparedRequest
    recipe: object  # the parsed recipe (the batch key holds its label)
    body: bytes | None = None  # the request cache's key of its body (None: the cache is off, never coalesced)


async def handle(state, request, arrival):
    t0 = time.perf_counter()
    raw = await state.read_body(request)
    tag, seen, prepared = state.seen_bodies.recall(raw)
    if prepared is not None:  # a body seen before, found prepared: its checks passed then and pass again
        model, recipe = seen.model, state.recipes.get("decide", seen.recipe)
        ready = Ready(found_request(prepared, t0), True, seen.key)
    else:
        body = parse_json(raw)
        extension = body.pop("recipe", None)
        check_schema(state, body)
        model = state.model_name(body)
        recipe = state.recipes.get("decide", extension)
        body.pop("model", None)
        ready = await state.prepare(prepare_cached, state, body)
        if tag is not None:
            state.seen_bodies.bodies.put(tag, Seen(model, extension, ready.key), 1)
    job = state.batcher.enqueue(JobKey("decide", recipe.label), DecideJob(ready.request, recipe.recipe, ready.key),
                                arrival)  # fmt: skip
    done = await answered(state, request, job)  # (a batch that has started runs to its end)
    sizes = {f"{name}_cache_bytes": 0 if st is None else st["bytes"] for name, st in state.cache_stats().items()}
    usage = done.costs.usage() | sizes | {"request_cached": ready.cached, "request_coalesced": done.coalesced}
    usage |= served(recipe.label, job, t0)
    from fastapi.responses import JSONResponse

    # (a JSONResponse: without the `jsonable_encoder` walk FastAPI gives a dict; the answer is JSON types)
    return JSONResponse({"model": model, "answers": done.answers, "usage": usage})


class Seen(NamedTuple):
    """A body answered before, known by its bytes' digest: what its checks gave (the same bytes give the same
    again: the schema, the model, the recipe field), and its request cache key."""

    model: str
    recipe: object  # its `recipe` field (None: the server's)
    key: bytes


SEEN = 1 << 16  # bodies remembered by their digest (~200 bytes each), least recently seen forgotten first


class SeenBodies:
    """The System One bodies answered before, by their bytes' digest (at most SEEN: a `ByteLRU` of one unit per
    entry), and their prepared requests in the server's request cache (`cache`; None: off, nothing is
    remembered). On /metrics: `trimvlm_seen_bodies` (entries), `trimvlm_seen_body_hits_total`."""

    def __init__(self, cache: ByteLRU | None, metrics):
        self.cache, self.bodies = cache, ByteLRU(SEEN, "seen bodies")
        self.hits = metrics.counter(
            "trimvlm_seen_body_hits", "System One bodies answered from their digest (not parsed or prepared again)"
        )
        metrics.gauge("trimvlm_seen_bodies", "System One bodies remembered by their digest (bounded by entries)",
                      fn=lambda: len(self.bodies))  # fmt: skip

    def __len__(self) -> int:
        return len(self.bodies)

    def recall(self, raw: bytes) -> tuple[bytes | None, Seen | None, object]:
        """(the body's digest, what was seen of it, its prepared request or None): with the request cache
        on, a body whose bytes were answered before and whose prepared request is still cached is not parsed,
        checked or keyed again, and not sent to the preparation thread (on the event loop: a digest and two
        lookups). One whose prepared request was evicted is prepared again (and remembered again)."""
        if self.cache is None:
            return None, None, None
        tag = hashlib.blake2b(raw, digest_size=16).digest()
        seen = self.bodies.get(tag)
        prepared = None if seen is None else self.cache.get(seen.key)
        if prepared is not None:
            self.hits.inc()
        return tag, seen, prepared


def found_request(found, t0: float):
    """A prepared request found in the request cache: its `preprocess_s` is the lookup's."""
    return dataclasses.replace(found, seconds=time.perf_counter() - t0)


def prepare_cached(state, body: dict) -> Ready:
    """`decision.prepare_request` of the body (`Ready`): through the server's request
    cache when it is on, a body seen before (the same JSON, keys in any order) is not parsed, decoded or
    tokenized again (its `preprocess_s` is the lookup's)."""
    t0 = time.perf_counter()
    cache = state.request_cache
    key = None if cache is None else digest("request", json.dumps(body, sort_keys=True, ensure_ascii=False))
    found = None if key is None else cache.get(key)
    if found is not None:
        return Ready(found_request(found, t0), True, key)
    prepared = decision.prepare_request(
        state.vlm, body, decision_config=state.decision_config, limits=state.limits.decision()
    )
    if key is not None:
        cache.put(key, prepared, nbytes([(p.inputs, p.marks) for p in prepared.prompts]))
    return Ready(prepared, False, key)


def request_model():
    """transformers' `SystemOneRequest` (transformers/cli/serving/systemone.py): the schema `transformers serve`
    validates a System One request with."""
    try:
        from transformers.cli.serving.systemone import SystemOneRequest
    except (ImportError, NameError) as e:  # the module defines it only when serving's extras are installed
        msg = f"/v1/systemone needs transformers' serving schema (pydantic, openai): {INSTALL}"
        raise MissingExtraError(msg) from e
    return SystemOneRequest


def check_schema(state, body: dict) -> None:
    """422 for what `transformers serve` refuses with 422: its `SystemOneRequest.model_validate(body,
    strict=True)` (a missing `model` filled with the server's, as a pinned server does), then `parse_questions`
    with the server's decision config."""
    request = validated(request_model(), {"model": state.model_id} | body, strict=True)
    try:
        parse_questions(request.questions, resolve_config(state.vlm, state.decision_config))
    except ValueError as e:
        raise schema_error(str(e), "questions") from e


def run(state, key, jobs: list[DecideJob]) -> list:
    """On the model thread: every prompt of every request in one forward; its `Decided` per job.

    Identical requests of one batch (the same body, by the request cache's key, and the same recipe: the batch
    key) are computed once (request coalescing): the copies get the same answers, and, as for a cache hit,
    costs of what ran for them: no FLOPs and no KV bytes of their own (`request_coalesced`). With the request
    cache off, nothing is coalesced."""
    first: dict[object, int] = {}  # body key -> index of its first job among the jobs run
    which = [first.setdefault(object() if j.body is None else j.body, len(first)) for j in jobs]
    runs = [jobs[which.index(i)] for i in range(len(first))]
    plan = decision_plan(jobs[0].recipe, state.vlm.runner)
    result = decision.run(state.vlm, [j.prepared for j in runs], plan)
    out = []
    for pos, (i, j) in enumerate(zip(which, jobs, strict=True)):
        answers, costs = result.answers[i], result.usage[i]
        copied = which.index(i) != pos  # not the job it was computed for
        if copied:
            answers = copy.deepcopy(answers)
            costs = dataclasses.replace(costs, preprocess_s=j.prepared.seconds, **FREE)
        out.append(Decided(answers, costs, copied))
    return out


# what a coalesced copy of a request did not cost
FREE = dict.fromkeys(("vision_flops", "layer_flops", "readout_flops", "method_flops", "kv_bytes", "state_bytes"), 0)
