"""The app in process (FastAPI's test client, no subprocess): a model error is a 500 and the next request is
answered; a decision model answers System One requests and refuses chat completions."""

import pytest
import torch
from conftest import need_extra

need_extra("fastapi", "httpx")

from fastapi.testclient import TestClient  # noqa: E402

import trimvlm  # noqa: E402
from trimvlm.serve.app import build_app  # noqa: E402
from trimvlm.serve.state import ServerState  # noqa: E402


@pytest.fixture(autouse=True)
def _one():
    torch.set_num_threads(1)


def test_model_error_is_500_and_the_server_goes_on(monkeypatch):
    """In process (FastAPI's test client): the batch runner raises for one request; it gets a 500, the next
    request is answered."""
    from fastapi.testclient import TestClient

    import trimvlm
    from trimvlm.serve import systemone
    from trimvlm.serve.app import build_app
    from trimvlm.serve.limits import Batching
    from trimvlm.serve.state import ServerState

    real = systemone.run

    def flaky(state, key, jobs):
        if any("boom" in j.prepared.names for j in jobs):
            raise RuntimeError("the model broke")
        return real(state, key, jobs)

    monkeypatch.setattr(systemone, "run", flaky)
    state = ServerState(trimvlm.load("demo"), model_id="demo", batching=Batching(max_wait_ms=1))
    req = {
        "state": "no image",
        "questions": {"boom": {"type": "noul", "instructions": "is there a red square ?"}},
    }
    good = {
        "state": "no image",
        "questions": {"ok": {"type": "noul", "instructions": "is there a red square ?"}},
    }
    with TestClient(build_app(state)) as c:
        r = c.post("/v1/systemone", json=req)
        assert r.status_code == 500 and "the model broke" in r.json()["detail"]
        r = c.post("/v1/systemone", json=good)
        assert r.status_code == 200 and r.json()["answers"]["ok"]["type"] == "noul"
        assert c.get("/health").json()["status"] == "ok"


def test_decision_model(tmp_path):
    """A JevForDecision checkpoint: System One requests equal vlm.decide; chat completions are a 400."""
    from trimvlm.testing.tiny_jev import tiny_jev

    vlm = trimvlm.load(tiny_jev(tmp_path / "jev", vision=False))
    req = {
        "state": {"message": "calm message"},
        "questions": {
            "spam": {"type": "noul", "instructions": "spam ?"},
            "tone": {"type": "choice", "instructions": "tone ?", "criteria": {"calm": None, "angry": None}},
        },
    }
    ref = vlm.decide(req)
    with TestClient(build_app(ServerState(vlm, model_id=str(tmp_path / "jev")))) as c:
        r = c.post("/v1/systemone", json=req | {"model": "jev"})
        assert r.status_code == 200, r.text
        got = r.json()["answers"]
        assert got["tone"]["choice"] == ref["tone"]["choice"]
        assert abs(got["spam"]["noul"] - ref["spam"]["noul"]) <= 1e-5
        assert all(
            abs(got["tone"]["probabilities"][k] - v) <= 1e-5 for k, v in ref["tone"]["probabilities"].items()
        )
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "decision model" in r.json()["detail"]
        assert c.get("/v1/models").json()["data"][0]["endpoints"] == ["/v1/systemone"]
