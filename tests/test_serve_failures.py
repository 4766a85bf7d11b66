"""Failure paths of the serving engine, held on events (never on timing): a model error in the middle of a decode
batch answers each request of that batch with an error and the server goes on serving; a shutdown that cannot
drain in time answers the requests still running and waiting (503), and a request after it is refused (503)."""

import threading

import pytest
from conftest import live, need_extra

need_extra("fastapi", "uvicorn", "httpx", "openai", "prometheus_client")

import httpx  # noqa: E402

from trimvlm.serve.limits import Batching  # noqa: E402
from trimvlm.serve.state import ServerState  # noqa: E402

from test_serve_engine import WAIT_S, messages, solo, wait_for  # noqa: E402  isort: skip

pytestmark = pytest.mark.usefixtures("one_thread")  # (the demo model: conftest's `demo`)


def _post(url, out, name, **kw):
    body = {"messages": messages(3), "max_tokens": 24} | kw
    out[name] = httpx.post(url + "/v1/chat/completions", json=body, timeout=WAIT_S)


def _a_decodes_then(url, state, out, others: str) -> list[threading.Thread]:
    """A is sent and decodes (its steps held by the test); then `others` are sent and wait in the queue."""
    threads = [threading.Thread(target=_post, args=(url, out, "A"))]
    threads[0].start()
    wait_for(lambda: state.batcher.engine.running == 1, "A to decode")
    for name in others:
        threads.append(threading.Thread(target=_post, args=(url, out, name)))
        threads[-1].start()
    wait_for(lambda: state.batcher.waiting() == len(others), f"{others} to be queued")
    return threads


def test_a_model_error_mid_batch_answers_each_of_its_requests_and_the_server_goes_on(demo, monkeypatch):
    """A decodes (its steps held); B and C are queued, admitted, and join A's batch; that batch's step raises:
    A, B and C each get a 500 naming the error; then D is answered as alone."""
    state = ServerState(demo, model_id="demo", batching=Batching(max_wait_ms=0))
    real, gate, raised = demo.runner.step, threading.Event(), []

    def step(tokens, *a, **kw):
        if tokens.shape[0] == 1 and not gate.is_set():
            assert gate.wait(WAIT_S)
        if tokens.shape[0] == 3 and not raised:
            raised.append(1)
            raise RuntimeError("the accelerator fell over")
        return real(tokens, *a, **kw)

    monkeypatch.setattr(demo.runner, "step", step)
    out = {}
    with live(state) as (url, _):
        threads = _a_decodes_then(url, state, out, "BC")
        gate.set()
        for t in threads:
            t.join(WAIT_S)
        d = httpx.post(url + "/v1/chat/completions", json={"messages": messages(3), "max_tokens": 24}, timeout=WAIT_S)
    assert raised == [1]
    for name in "ABC":
        assert out[name].status_code == 500 and "the accelerator fell over" in out[name].text, name
    assert d.status_code == 200 and d.json()["choices"][0]["message"]["content"] == solo(demo, 3).texts[0]
    assert state.batcher.engine.failed == 1


def test_a_shutdown_answers_the_running_and_waiting_requests(demo, monkeypatch):
    """A decodes with its steps held, B waits: the server is told to stop and cannot drain; A and B are answered
    503 (the server is shutting down), the model thread ends, and a request after it gets 503 at once."""
    state = ServerState(demo, model_id="demo", batching=Batching(max_wait_ms=0, max_batch=1))
    real, gate = demo.runner.step, threading.Event()

    def step(tokens, *a, **kw):
        assert gate.wait(WAIT_S)
        return real(tokens, *a, **kw)

    monkeypatch.setattr(demo.runner, "step", step)
    out = {}
    with live(state) as (url, _):
        threads = _a_decodes_then(url, state, out, "B")  # max_batch 1: B cannot join
        closing = threading.Thread(target=state.close, kwargs={"timeout": 0.05})
        closing.start()
        wait_for(lambda: state.batcher._abort, "the drain to be given up")
        gate.set()  # A's step ends; the next turn answers A and B
        closing.join(WAIT_S)
        for t in threads:
            t.join(WAIT_S)
        assert not state.batcher.alive
        late = httpx.post(url + "/v1/chat/completions", json={"messages": messages(3)}, timeout=WAIT_S)
    for r in (out["A"], out["B"], late):
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
