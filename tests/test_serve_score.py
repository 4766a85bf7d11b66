"""`POST /v1/score` (vLLM's score shape, trimvlm's readouts): each candidate's score equals `vlm.score` on the same
inputs (<= 1e-5), for the loglik and head readouts, several executors and a recipe; requests of one batch on the
same images and question share one prefix and still get their own answers; bad requests get their status and
reason."""

import numpy as np
import pytest
from conftest import RunnerCalls, live, need_extra

need_extra("fastapi", "uvicorn", "httpx")

import httpx  # noqa: E402

from trimvlm.serve.jobs import JobKey  # noqa: E402
from trimvlm.serve.score import ScoreJob, run  # noqa: E402
from trimvlm.serve.state import ServerState  # noqa: E402

from test_serve_engine import data_url, image  # noqa: E402  isort: skip

pytestmark = pytest.mark.usefixtures("one_thread")  # (the demo model: conftest's `demo`)

TOL = 1e-5
CANDS = ["red circle", "blue square", "green triangle", "yellow"]


@pytest.fixture(scope="module")
def url(demo):
    with live(ServerState(demo, model_id="demo")) as (u, _):
        yield u


def _same(got: dict, ref) -> None:
    assert [d["text"] for d in got["data"]] == [c.text for c in ref.candidates]
    assert [d["index"] for d in got["data"]] == list(range(len(ref.candidates)))
    for d, c in zip(got["data"], ref.candidates, strict=True):
        assert abs(d["score"] - c.prob) <= TOL and abs(d["logprob"] - c.loglik_sum) <= TOL
        assert abs(d["logit"] - c.logit) <= TOL and d["tokens"] == c.n_tokens and d["greedy"] == c.is_greedy
    assert got["chosen"] == ref.chosen


@pytest.mark.parametrize("readout,executor,recipe", [
    ("loglik", "auto", None), ("loglik", "independent", None), ("loglik", "tree", "tokens=pool:keep=0.5"),
    ("head", "auto", None),
])  # fmt: skip
def test_score_equals_vlm_score(demo, url, readout, executor, recipe):
    ref = demo.score(image(3), "what is at r0 c5 ?", CANDS, readout=readout, executor=executor, recipe=recipe)
    body = {"model": "demo", "text_1": "what is at r0 c5 ?", "text_2": CANDS, "images": [data_url(3)],
            "readout": readout, "executor": executor} | ({"recipe": recipe} if recipe else {})  # fmt: skip
    r = httpx.post(url + "/v1/score", json=body, timeout=300)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["object"] == "list" and all(d["object"] == "score" for d in got["data"])
    _same(got, ref[0])
    u = got["usage"]
    c = ref.costs
    assert u["vision_flops"] == c.flops.get("vision", 0) or u["vision_flops"] == 0  # (the vision cache)
    assert u["branch_flops"] == c.flops.get("branch", 0) and u["prefill_flops"] == c.flops["prefill"]
    assert u["recipe"] == ref.recipe and u["executor"] == ref.executor and u["batch_requests"] == 1


def test_requests_on_one_prefix_share_it_and_get_their_own_answers(demo, monkeypatch):
    """One batch: two requests on the same image and question (different candidates, one shared), one on
    another image: one prefill of two prefixes; each answer equals vlm.score of that request alone."""
    state = ServerState(demo, model_id="demo")
    q = "what is at r0 c5 ?"
    plan = state.recipes.get("score", None).recipe
    jobs = [ScoreJob([image(3)], q, CANDS[:3], plan, (data_url(3), q)),
            ScoreJob([image(4)], q, CANDS[1:], plan, (data_url(4), q)),
            ScoreJob([image(3)], q, ["yellow", "red circle"], plan, (data_url(3), q))]  # fmt: skip
    refs = [demo.score(j.images, q, j.candidates)[0] for j in jobs]
    calls = RunnerCalls(demo.runner, monkeypatch)
    seen = []
    real = demo.score
    monkeypatch.setattr(demo, "score", lambda reqs, **kw: seen.append(len(reqs)) or real(reqs, **kw))
    try:
        out = run(state, JobKey("score", "baseline", "loglik", "auto"), jobs)
    finally:
        calls.close()
    assert seen == [2] and calls.prefills == 1  # two prefixes, one call, one prefill
    for (result, usage), ref in zip(out, refs, strict=True):
        _same({"data": [{"index": k, "text": c.text, "score": c.prob, "logprob": c.loglik_sum, "logit": c.logit,
                         "tokens": c.n_tokens, "greedy": c.is_greedy} for k, c in enumerate(result.candidates)],
               "chosen": result.chosen}, ref)  # fmt: skip
        assert usage["batch_requests"] == 3
    assert [u["shared_prefix_requests"] for _, u in out] == [2, 1, 2]


BAD = [
    ({"text_1": ["a", "b"], "text_2": ["x"]}, 400, "text_1: one question"),
    ({"text_1": "q ?", "text_2": []}, 400, "text_2"),
    ({"text_1": "q ?", "text_2": ["x"] * 65}, 400, "at most 64"),
    ({"text_1": "q ?", "text_2": ["x"], "readout": "vibes"}, 400, "readout 'vibes'"),
    ({"text_1": "q ?", "text_2": ["x"], "executor": "magic"}, 400, "executor 'magic'"),
    ({"text_1": "q ?", "text_2": ["x"], "images": ["http://example.com/a.png"]}, 400, "never fetches"),
    ({"text_1": "q ?", "text_2": ["x"], "recipe": "tuned=/etc:budget=0.5"}, 400, "recipe"),
    ({"text_1": "q ?", "text_2": ["x"], "temperature": 1}, 422, "temperature"),
    ({"text_2": ["x"]}, 422, "text_1"),
]


@pytest.mark.parametrize("body,status,reason", BAD)
def test_bad_score_requests(url, body, status, reason):
    r = httpx.post(url + "/v1/score", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert reason in r.json()["error"]["message"]
    ok = httpx.post(url + "/v1/score", json={"text_1": "is there a red circle ?", "text_2": ["yes", "no"],
                                             "images": [data_url(3)]}, timeout=300)  # fmt: skip
    assert ok.status_code == 200


def test_scene_images_differ():  # the two images of the sharing test are different scenes
    assert not np.array_equal(np.asarray(image(3)), np.asarray(image(4)))
