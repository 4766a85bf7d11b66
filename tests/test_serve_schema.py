"""`/v1/systemone` accepts and refuses what `transformers serve` does: one table of payloads, each checked against
transformers' own validation (`SystemOneHandler._validate_request`: its pydantic `SystemOneRequest`, strict, and
`parse_questions`) and sent to a real uvicorn server on 127.0.0.1. Refused: 422 on both sides, at the same
places; accepted: transformers validates it and trimvlm answers it (200). trimvlm's `recipe` extension is the one
documented difference."""

import base64
import io
import types

import numpy as np
import pytest
import torch
from conftest import live, need_extra

need_extra("fastapi", "uvicorn", "httpx")

import httpx  # noqa: E402

import trimvlm  # noqa: E402
from trimvlm.serve.limits import Batching  # noqa: E402
from trimvlm.serve.state import ServerState  # noqa: E402
from trimvlm.testing.decisions import DEMO_QUESTIONS as QUESTIONS  # noqa: E402


def png(seed: int) -> dict:
    from trimvlm.demo.task import make_scene, render

    buf = io.BytesIO()
    render(make_scene(np.random.default_rng(seed))).save(buf, format="PNG")
    return {"type": "image", "format": "png", "data_base64": base64.b64encode(buf.getvalue()).decode()}


NOUL = QUESTIONS["circle"]
ONE = {"a": NOUL}


def images(n: int) -> dict:
    """`n` referenced assets."""
    return {"state": {f"p{i}": f"<img-{i}>" for i in range(n)}, "assets": {f"<img-{i}>": png(i) for i in range(n)}}


# (name, payload, accepted): the verdicts are transformers' (checked below), trimvlm must give the same
TABLE = [
    ("minimal", {"model": "demo", "state": "x", "questions": ONE}, True),
    ("model left out (a pinned server)", {"state": "x", "questions": ONE}, True),
    ("three question types", {"model": "demo", "state": "x", "questions": QUESTIONS}, True),
    ("state an object", {"model": "demo", "state": {"a": 1, "b": [1, "x"]}, "questions": ONE}, True),
    ("state a list", {"model": "demo", "state": ["x", 2], "questions": ONE}, True),
    ("64 questions", {"model": "demo", "state": "x", "questions": {f"q{i}": NOUL for i in range(64)}}, True),
    ("an empty question name", {"model": "demo", "state": "x", "questions": {"": NOUL}}, True),
    ("one image", {"model": "demo", "questions": ONE, **images(1)}, True),
    ("four images", {"model": "demo", "questions": ONE, **images(4)}, True),
    ("no assets", {"model": "demo", "state": "x", "questions": ONE, "assets": {}}, True),
    ("model null", {"model": None, "state": "x", "questions": ONE}, False),
    ("model a number", {"model": 3, "state": "x", "questions": ONE}, False),
    ("no state", {"model": "demo", "questions": ONE}, False),
    ("state null", {"model": "demo", "state": None, "questions": ONE}, False),
    ("state a number", {"model": "demo", "state": 3, "questions": ONE}, False),
    ("state a boolean", {"model": "demo", "state": True, "questions": ONE}, False),
    ("no questions", {"model": "demo", "state": "x"}, False),
    ("zero questions", {"model": "demo", "state": "x", "questions": {}}, False),
    ("65 questions", {"model": "demo", "state": "x", "questions": {f"q{i}": NOUL for i in range(65)}}, False),
    ("questions a list", {"model": "demo", "state": "x", "questions": [NOUL]}, False),
    ("a question a string", {"model": "demo", "state": "x", "questions": {"a": "is it ?"}}, False),
    ("an unknown question type", {"model": "demo", "state": "x",
                                  "questions": {"a": {"type": "maybe", "instructions": "?"}}}, False),
    ("a choice without criteria", {"model": "demo", "state": "x",
                                   "questions": {"a": {"type": "choice", "instructions": "?"}}}, False),
    ("five images", {"model": "demo", "questions": ONE, **images(5)}, False),
    ("an asset a string", {"model": "demo", "state": "<a>", "questions": ONE,
                           "assets": {"<a>": png(0)["data_base64"]}}, False),
    ("assets a list", {"model": "demo", "state": "<a>", "questions": ONE, "assets": [png(0)]}, False),
    ("assets null", {"model": "demo", "state": "x", "questions": ONE, "assets": None}, False),
    ("an unknown field", {"model": "demo", "state": "x", "questions": ONE, "extra": 1}, False),
    ("a stream field", {"model": "demo", "state": "x", "questions": ONE, "stream": True}, False),
]  # fmt: skip


@pytest.fixture(scope="module")
def state():
    torch.set_num_threads(1)
    return ServerState(trimvlm.load("demo"), model_id="demo", batching=Batching(max_wait_ms=1))


@pytest.fixture(scope="module")
def url(state):
    with live(state) as (u, _):
        yield u


def transformers_verdict(body: dict, config, force_model="demo"):
    """transformers serve's validation of a System One body: None (accepted) or its 422 detail."""
    from fastapi import HTTPException
    from transformers.cli.serving.systemone import SystemOneHandler

    handler = types.SimpleNamespace(
        model_manager=types.SimpleNamespace(force_model=force_model), decision_config=config
    )
    try:
        SystemOneHandler._validate_request(handler, dict(body))
    except HTTPException as e:
        assert e.status_code == 422
        return e.detail
    return None


def places(detail) -> set:
    return {(tuple(d["loc"]), d["type"]) for d in detail}


@pytest.mark.parametrize("name,body,accepted", TABLE, ids=[t[0] for t in TABLE])
def test_the_table_is_transformers(state, url, name, body, accepted):
    from trimvlm.decision.config import resolve_config

    ref = transformers_verdict(body, resolve_config(state.vlm))
    assert (ref is None) == accepted, ref
    r = httpx.post(url + "/v1/systemone", json=body, timeout=120)
    if accepted:
        assert r.status_code == 200, r.text
        assert set(r.json()["answers"]) == set(body["questions"])
    else:
        assert r.status_code == 422, r.text
        assert places(r.json()["detail"]) == places(ref)


def test_an_unpinned_transformers_server_needs_the_model(state):
    """Without --force-model transformers refuses a body without `model`; trimvlm answers as a pinned server."""
    from trimvlm.decision.config import resolve_config

    detail = transformers_verdict({"state": "x", "questions": ONE}, resolve_config(state.vlm), force_model=None)
    assert places(detail) == {(("body", "model"), "missing")}


@pytest.mark.parametrize("raw", [b'{"state": "x", "questions": {', b"[1, 2]", b'"text"', b"null"])
def test_a_body_that_is_not_an_object_is_422_as_fastapis_dict_body(url, raw):
    """transformers' route takes `body: dict`: FastAPI refuses text that is not a JSON object with 422."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    ref = FastAPI()

    @ref.post("/v1/systemone")
    async def route(body: dict):  # transformers' signature
        return {}

    want = TestClient(ref).post("/v1/systemone", content=raw, headers={"content-type": "application/json"})
    got = httpx.post(url + "/v1/systemone", content=raw, headers={"content-type": "application/json"})
    assert want.status_code == got.status_code == 422
    assert {d["type"] for d in got.json()["detail"]} == {d["type"] for d in want.json()["detail"]}


def test_recipe_is_trimvlms_documented_extension(state, url):
    """`recipe` is taken out before transformers' schema reads the body: trimvlm answers, transformers refuses."""
    from trimvlm.decision.config import resolve_config

    body = {"model": "demo", "state": "x", "questions": ONE, "recipe": "tokens=density:keep=0.5:layer=1"}
    assert places(transformers_verdict(body, resolve_config(state.vlm))) == {(("body", "recipe"), "extra_forbidden")}
    r = httpx.post(url + "/v1/systemone", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["recipe"] == "tokens=density:keep=0.5:layer=1"


def test_schema_comes_before_the_400s(url):
    """transformers validates the whole body first: a body that is not of the schema is a 422 even when it also
    names another model or an unknown recipe (400s once the body is valid)."""
    bad = {"model": "gpt-4", "state": 3, "questions": ONE, "recipe": "tokens=nope"}
    assert httpx.post(url + "/v1/systemone", json=bad).status_code == 422
    assert httpx.post(url + "/v1/systemone", json=bad | {"state": "x"}).status_code == 400
