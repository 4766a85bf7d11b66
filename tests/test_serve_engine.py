"""The serving engine behind real clients: a uvicorn server in this process on 127.0.0.1 (so the tests can count
the runner's calls and hold the model between steps), talked to with the official `openai` client and plain
HTTP. Continuous batching, true streaming, cancellation, /metrics and access logs, disconnects during the
upload, graceful shutdown. No assert depends on how fast this machine is: steps are held on events, and a
test that the engine would fail waits on an event that never comes, then fails."""

import base64
import io
import json
import logging
import socket
import threading
import time

import numpy as np
import pytest
import torch
from conftest import RunnerCalls, live, need_extra

need_extra("fastapi", "uvicorn", "httpx", "openai", "prometheus_client")

import httpx  # noqa: E402
import openai  # noqa: E402

import trimvlm  # noqa: E402
from trimvlm.serve.limits import Batching  # noqa: E402
from trimvlm.serve.state import ServerState  # noqa: E402

WAIT_S = 120  # how long a held step waits for what the engine must deliver before it gives up (test fails)


@pytest.fixture(autouse=True)
def _one():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def demo():
    return trimvlm.load("demo")


def image(seed: int):
    from trimvlm.demo.task import make_scene, render

    return render(make_scene(np.random.default_rng(seed)))


def data_url(seed: int) -> str:
    buf = io.BytesIO()
    image(seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def messages(seed: int, prompt: str = "describe ?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(seed)}},
                                         {"type": "text", "text": prompt}]}]  # fmt: skip


def solo(demo, scene, prompt="describe ?", max_tokens=24, **sampling):
    """What `vlm.generate` gives the request alone."""
    return demo.generate(image(scene), prompt, max_new_tokens=max_tokens, **sampling)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


class HeldSteps:
    """Wraps the runner's `step` (one decode step of a running batch): records each call's rows, and before a
    call waits for `hold(rows)` (a callable returning an Event, or None) to be set."""

    def __init__(self, runner, monkeypatch):
        self.rows: list[int] = []
        self.hold = lambda rows: None
        self.timed_out = 0
        real = runner.step

        def step(tokens, *a, **kw):
            self.rows.append(tokens.shape[0])
            event = self.hold(tokens.shape[0])
            if event is not None and not event.wait(WAIT_S):
                self.timed_out += 1
            return real(tokens, *a, **kw)

        monkeypatch.setattr(runner, "step", step)


def wait_for(cond, what: str):
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def test_openai_client_metrics_and_access_log(demo, caplog):
    """The official client, plain and streamed, equals vlm.generate; /metrics (plain HTTP) counts them in
    Prometheus' format; each request is one JSON access-log line."""
    caplog.set_level(logging.INFO, logger="trimvlm.serve.access")
    ref = solo(demo, 3)
    with live(ServerState(demo, model_id="demo")) as (url, _):
        c = client(url)
        r = c.chat.completions.create(model="demo", messages=messages(3), max_tokens=24)
        assert r.choices[0].message.content == ref.texts[0]
        assert r.usage.completion_tokens == len(ref.tokens[0])
        assert 0 < r.usage.engine_ttft_s <= r.usage.server_ttft_s <= r.usage.server_latency_s
        chunks = list(c.chat.completions.create(model="demo", messages=messages(3), max_tokens=24, stream=True,
                                                stream_options={"include_usage": True}))  # fmt: skip
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref.texts[0]
        assert chunks[-1].usage.completion_tokens == len(ref.tokens[0])
        assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
        one = httpx.post(url + "/v1/chat/completions", json={"messages": messages(3), "max_tokens": 1}).json()
        assert one["choices"][0]["finish_reason"] == "length" and one["usage"]["completion_tokens"] == 1
        assert one["usage"]["decode_flops"] == 0 and one["choices"][0]["message"]["content"] == solo(
            demo, 3, max_tokens=1).texts[0]  # fmt: skip
        m = httpx.get(url + "/metrics")
        assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
        text = m.text
    assert 'trimvlm_requests_total{path="/v1/chat/completions",status="200"} 3.0' in text
    assert "trimvlm_time_to_first_token_seconds_count 3.0" in text
    stopped = r.choices[0].finish_reason == "stop"
    assert f"trimvlm_generated_tokens_total {2.0 * (len(ref.tokens[0]) + stopped) + 1}" in text  # stop tokens too
    for name in ("trimvlm_queue_depth", "trimvlm_running_requests", "trimvlm_decode_batch_size_bucket",
                 "trimvlm_tokens_per_second", "trimvlm_inter_token_seconds_count", "trimvlm_model_thread_cpu_seconds"):  # fmt: skip
        assert name in text
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "trimvlm.serve.access"]
    assert [(x["method"], x["path"], x["status"]) for x in lines[:3]] == [("POST", "/v1/chat/completions", 200)] * 3
    assert all(x["bytes"] > 0 and x["seconds"] > 0 for x in lines)


def test_a_request_arriving_while_another_decodes_gets_its_first_token_first(demo, monkeypatch):
    """A (greedy) is decoding; B (sampled, seeded) arrives: B's first token reaches its client before A's
    last one, B's rows ran in A's decode batch, and both equal what each gets alone. The steps are held:
    A's first step until B is queued, every step with both rows until B's client has B's first token (a
    server that made B wait for A would leave that step waiting, A would end first, and the test fails)."""
    ref_a = solo(demo, 3)
    ref_b = solo(demo, 4, temperature=0.8, top_p=0.9, seed=7)
    assert len(ref_a.tokens[0]) >= 6, "A must decode for several steps"
    state = ServerState(demo, model_id="demo")
    held = HeldSteps(demo.runner, monkeypatch)
    b_queued, b_first = threading.Event(), threading.Event()
    held.hold = lambda rows: b_queued if rows == 1 and not b_first.is_set() else (b_first if rows == 2 else None)
    seen, lock = [], threading.Lock()

    def stream(name, c, **kw):
        out = []
        for ch in c.chat.completions.create(model="demo", max_tokens=24, stream=True, **kw):
            piece = ch.choices[0].delta.content
            if piece:
                with lock:
                    if not out:
                        seen.append((name, "first"))
                out.append(piece)
                if name == "B":
                    b_first.set()
        with lock:
            seen.append((name, "end"))
        return "".join(out)

    with live(state) as (url, _):
        c = client(url)
        results = {}
        ta = threading.Thread(target=lambda: results.update(A=stream("A", c, messages=messages(3))))
        ta.start()
        wait_for(lambda: ("A", "first") in seen, "A's first token")
        tb = threading.Thread(target=lambda: results.update(B=stream(
            "B", c, messages=messages(4), temperature=0.8, top_p=0.9, seed=7)))  # fmt: skip
        tb.start()
        wait_for(lambda: state.batcher.waiting() > 0 or ("B", "first") in seen, "B to be queued")
        b_queued.set()
        ta.join(WAIT_S)
        tb.join(WAIT_S)
    assert held.timed_out == 0
    assert seen.index(("B", "first")) < seen.index(("A", "end")), seen
    assert max(held.rows) == 2  # B joined A's running decode batch
    assert results == {"A": ref_a.texts[0], "B": ref_b.texts[0]}


def test_chunks_arrive_one_step_apart(demo, monkeypatch):
    """Streaming: step k runs only once the client holds k chunks of text (each token of this answer adds
    text), so every token reached the client before the next was computed; the text equals the plain one."""
    from trimvlm.serve.reply import TextStream

    ref = solo(demo, 5)
    text = TextStream(demo.tokenizer)
    assert all(text.push(t) for t in ref.tokens[0]), "every token of this answer adds text"
    received, events = [0], [threading.Event() for _ in range(64)]
    held = HeldSteps(demo.runner, monkeypatch)
    held.hold = lambda rows: events[len(held.rows)]  # call k (1-based) waits for the client's k-th chunk
    with live(ServerState(demo, model_id="demo")) as (url, _):
        c = client(url)
        pieces = []
        for ch in c.chat.completions.create(model="demo", messages=messages(5), max_tokens=24, stream=True):
            if ch.choices[0].delta.content:
                pieces.append(ch.choices[0].delta.content)
                received[0] += 1
                events[received[0]].set()
        held.hold = lambda rows: None
        plain = c.chat.completions.create(model="demo", messages=messages(5), max_tokens=24)
    assert held.timed_out == 0
    assert len(pieces) == len(ref.tokens[0]) and "".join(pieces) == plain.choices[0].message.content == ref.texts[0]


def _raw_post(url: str, body: dict, path: str = "/v1/chat/completions") -> socket.socket:
    """A complete POST on a connection of its own, left open (the answer is not read)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n".encode()
              + f"content-length: {len(data)}\r\n\r\n".encode() + data)  # fmt: skip
    return s


def _held_server(demo, monkeypatch):
    """(the runner's call counter, decode steps held until `release` is set, the release event, a server
    state that batches at once, the count of requests cancelled while queued)."""
    calls = RunnerCalls(demo.runner, monkeypatch)
    held = HeldSteps(demo.runner, monkeypatch)
    release = threading.Event()
    held.hold = lambda rows: release
    state = ServerState(demo, model_id="demo", batching=Batching(max_wait_ms=0))

    def queued():
        return state.metrics.registry.get_sample_value("trimvlm_cancelled_requests_total", {"stage": "queued"}) or 0

    return calls, held, release, state, queued


def _close_queued(url: str, state, queued, bodies: list[dict], path: str = "/v1/chat/completions") -> None:
    """Queue `bodies` (raw connections) behind the held request, close them, and wait for the server to have
    seen every close."""
    socks = [_raw_post(url, body, path) for body in bodies]
    n = len(socks)
    wait_for(lambda: state.batcher.waiting() == n, f"{n} queued requests")
    for sock in socks:
        sock.close()
    wait_for(lambda: queued() == n, f"the server to see {n} closed connections")


def test_closed_queued_connections_are_never_computed(demo, monkeypatch):
    """While one request decodes (held), 16 more are queued (half streamed) and their connections closed:
    none of them reaches the model (the runner's prefills: only the first request's and the next one's),
    and the next request is served at once, alone, with the right answer."""
    ref_first, ref_next = solo(demo, 3).texts[0], solo(demo, 6).texts[0]  # before the runner's calls are counted
    calls, held, release, state, queued = _held_server(demo, monkeypatch)
    try:
        with live(state) as (url, _):
            c = client(url)
            first = {}
            t = threading.Thread(target=lambda: first.update(r=c.chat.completions.create(
                model="demo", messages=messages(3), max_tokens=24)))  # fmt: skip
            t.start()
            wait_for(lambda: held.rows, "the first request to decode")
            _close_queued(url, state, queued, [{"messages": messages(10 + i), "max_tokens": 24, "stream": i % 2 == 0}
                                               for i in range(16)])  # fmt: skip
            release.set()
            t.join(WAIT_S)
            assert first["r"].choices[0].message.content == ref_first
            nxt = c.chat.completions.create(model="demo", messages=messages(6), max_tokens=24)
            stats = httpx.get(url + "/health").json()
    finally:
        release.set()
        calls.close()
    assert nxt.choices[0].message.content == ref_next and nxt.usage.batch_requests == 1
    assert calls.prefills == 2  # the first request and the next one: 0 of the 16
    assert stats["dropped"] == 16 and stats["cancelled_running"] == 0


def test_a_running_request_whose_client_leaves_leaves_the_batch(demo, monkeypatch):
    """A streamed request whose client closes the connection mid-answer leaves the decode batch at the next
    step: the steps after it run without its row, and it is counted as cancelled while running."""
    held = HeldSteps(demo.runner, monkeypatch)
    gone = threading.Event()
    held.hold = lambda rows: gone if len(held.rows) == 2 else None
    state = ServerState(demo, model_id="demo")
    with live(state) as (url, _):
        with httpx.Client(base_url=url, timeout=300) as h:
            with h.stream("POST", "/v1/chat/completions",
                          json={"messages": messages(3), "max_tokens": 24, "stream": True}) as r:  # fmt: skip
                next(r.iter_lines())  # the role chunk: the request is decoding
        wait_for(lambda: state.metrics.registry.get_sample_value(
            "trimvlm_cancelled_requests_total", {"stage": "running"}) == 1, "the server to see the close")  # fmt: skip
        gone.set()
        wait_for(lambda: state.batcher.stats()["running"] == 0, "the row to leave")
        assert state.batcher.stats()["cancelled_running"] == 1
    assert len(held.rows) <= 3  # it left at the step after the close was seen; it did not decode to the end


def test_disconnect_during_upload_is_one_line(demo, caplog):
    """A client that closes the connection in the middle of its body: one warning line, no traceback, and
    the server goes on answering."""
    caplog.set_level(logging.INFO)
    with live(ServerState(demo, model_id="demo")) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 100000\r\n\r\n{\"messages\": [")  # fmt: skip
        time.sleep(0.1)
        s.close()
        wait_for(lambda: any("during the upload" in r.getMessage() for r in caplog.records), "the warning")
        r = client(url).chat.completions.create(model="demo", messages=messages(3), max_tokens=8)
        assert r.choices[0].message.content
    upload = [r for r in caplog.records if "during the upload" in r.getMessage()]
    assert len(upload) == 1 and upload[0].levelno == logging.WARNING and "\n" not in upload[0].getMessage()
    assert not [r for r in caplog.records if r.exc_info or "Exception in ASGI" in r.getMessage()]


def test_graceful_shutdown_drains_a_running_stream(demo, monkeypatch):
    """Shutting the server down while a stream is mid-answer: the stream is finished, whole, before it stops."""
    held = HeldSteps(demo.runner, monkeypatch)
    release = threading.Event()
    held.hold = lambda rows: release
    got = {}
    with live(ServerState(demo, model_id="demo")) as (url, server):
        c = client(url)

        def run():
            got["text"] = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                model="demo", messages=messages(3), max_tokens=24, stream=True))  # fmt: skip

        t = threading.Thread(target=run)
        t.start()
        wait_for(lambda: held.rows, "the stream to decode")
        server.should_exit = True  # what SIGTERM does
        release.set()
        t.join(WAIT_S)
    assert got["text"] == solo(demo, 3).texts[0]


def test_max_prefill_tokens_bounds_each_admission(demo, monkeypatch):
    """--max-prefill-tokens below two prompts: four requests queued together are prefilled one per step (four
    prefills, not one), each joins the running batch, and each equals its answer alone."""
    from trimvlm.serve.limits import ServerLimits

    refs = [solo(demo, 20 + i).texts[0] for i in range(4)]
    prompt = int(demo.prepare(image(20), "describe ?").attention_mask.sum())
    calls = RunnerCalls(demo.runner, monkeypatch)
    held = HeldSteps(demo.runner, monkeypatch)
    queued = threading.Event()
    held.hold = lambda rows: queued if len(held.rows) == 1 else None
    state = ServerState(demo, model_id="demo", limits=ServerLimits(max_prefill_tokens=prompt + prompt // 2))
    try:
        with live(state) as (url, _):
            c = client(url)
            out = {}

            def ask(i):
                out[i] = c.chat.completions.create(model="demo", messages=messages(20 + i), max_tokens=24)

            threads = [threading.Thread(target=ask, args=(0,))]
            threads[0].start()
            wait_for(lambda: held.rows, "the first request to decode")
            threads += [threading.Thread(target=ask, args=(i,)) for i in (1, 2, 3)]
            for t in threads[1:]:
                t.start()
            wait_for(lambda: state.batcher.waiting() == 3, "3 queued requests")
            queued.set()
            for t in threads:
                t.join(WAIT_S)
    finally:
        queued.set()
        calls.close()
    assert [out[i].choices[0].message.content for i in range(4)] == refs
    assert calls.prefills == 4 and max(held.rows) >= 3  # one admission per step, all in one decode batch


def test_closed_queued_system_one_connections_are_never_computed(demo, monkeypatch):
    """System One requests queued behind a decoding chat request (held), their connections closed: none of them
    reaches the model (one prefill: the chat request's), each counted as cancelled while queued."""
    calls, held, release, state, queued = _held_server(demo, monkeypatch)
    body = {"state": "a grid", "questions": {"q": {"type": "noul", "instructions": "is there a red circle ?"}}}
    try:
        with live(state) as (url, _):
            c = client(url)
            t = threading.Thread(target=lambda: c.chat.completions.create(model="demo", messages=messages(3),
                                                                          max_tokens=24))  # fmt: skip
            t.start()
            wait_for(lambda: held.rows, "the chat request to decode")
            _close_queued(url, state, queued, [body] * 4, "/v1/systemone")
            release.set()
            t.join(WAIT_S)
            answer = httpx.post(url + "/v1/systemone", json=body, timeout=300)
    finally:
        release.set()
        calls.close()
    assert answer.status_code == 200 and set(answer.json()["answers"]) == {"q"}
    assert calls.prefills == 2  # the chat request's and the last System One request's: 0 of the 4
