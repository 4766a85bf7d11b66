"""The front end in processes of its own (`--api-workers`, serve/ipc.py): an API-side state whose scheduler is
the engine's over a connection. In this process (a pipe between an API state and an engine state, so the tests
can hold the model's steps): chat completions plain, streamed and with n, scores and System One decisions
equal the in-process answers; a client that leaves mid-stream leaves the engine's batch; /metrics holds the
engine's figures and the API's. Then `trimvlm serve --api-workers 2` for real: two API processes on one port
answer, and they stop when the engine process does."""

import asyncio
import contextlib
import multiprocessing
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading

import pytest
from conftest import live, need_extra, reserved_port

need_extra("fastapi", "uvicorn", "httpx", "openai", "prometheus_client")

import httpx  # noqa: E402
import torch  # noqa: E402

from trimvlm.serve.ipc import Event, Submit, bridge, dumps  # noqa: E402
from trimvlm.serve.recipes import RecipeOptions  # noqa: E402
from trimvlm.serve.state import ServerState  # noqa: E402
from trimvlm.serve.workers import shared_port  # noqa: E402

from test_serve import decide_request, local_answers  # noqa: E402  isort: skip
from test_serve_engine import HeldSteps, client, data_url, image, messages, wait_for  # noqa: E402  isort: skip
from trimvlm.testing.decisions import assert_same_answers as assert_same  # noqa: E402  isort: skip

pytestmark = pytest.mark.usefixtures("one_thread")


@contextlib.contextmanager
def shared_metrics():
    """prometheus_client's multiprocess mode for the metrics made inside, as `--api-workers` runs it (a folder
    of its own; the mode is chosen when prometheus_client is imported, so its value class is set here)."""
    from prometheus_client import values

    with tempfile.TemporaryDirectory() as folder, pytest.MonkeyPatch.context() as mp:
        mp.setenv("PROMETHEUS_MULTIPROC_DIR", folder)
        mp.setattr(values, "ValueClass", values.MultiProcessValue())
        yield


@contextlib.contextmanager
def joined(demo, **kw):
    """(the API-side state, the engine-side state, the engine's bridge thread for the API side), joined by a
    pipe, both made with `kw`, their metrics shared as across processes; the engine's scheduler running. Both
    states are closed on the way out."""
    with shared_metrics():
        engine = ServerState(demo, model_id="demo", **kw)
        engine.start()
        a, b = multiprocessing.Pipe()
        link = threading.Thread(target=bridge, args=(engine, a), daemon=True)
        link.start()
        api = ServerState(demo, model_id="demo", remote=(None, b""), **kw)
        api.batcher.start(b)
        try:
            yield api, engine, link
        finally:
            api.close()
            engine.close()


@pytest.fixture
def split(demo):
    """(the API-side state, the engine-side state), joined by a pipe (`joined`)."""
    with joined(demo) as (api, engine, _):
        yield api, engine


def test_answers_across_the_boundary_equal_in_process(demo, split):
    api, engine = split
    ref = demo.generate(image(3), "describe ?", max_new_tokens=16)
    sampled = [demo.generate(image(3), "describe ?", max_new_tokens=16, temperature=1.0, seed=4 + i).texts[0]
               for i in range(2)]  # fmt: skip
    with live(api) as (url, _):
        c = client(url)
        r = c.chat.completions.create(model="demo", messages=messages(3), max_tokens=16)
        chunks = list(c.chat.completions.create(model="demo", messages=messages(3), max_tokens=16, stream=True))
        n = c.chat.completions.create(model="demo", messages=messages(3), max_tokens=16, n=2, temperature=1.0, seed=4)
        score = httpx.post(url + "/v1/score", json={"text_1": "is there a red circle ?", "text_2": ["yes", "no"],
                                                    "images": [data_url(3)]}, timeout=300).json()  # fmt: skip
        decision = httpx.post(url + "/v1/systemone", json=decide_request(1), timeout=300).json()
        health = httpx.get(url + "/health").json()
        metrics = httpx.get(url + "/metrics").text
    assert r.choices[0].message.content == ref.texts[0]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.texts[0]
    assert [ch.message.content for ch in n.choices] == sampled
    want = demo.score(image(3), "is there a red circle ?", ["yes", "no"])[0]
    assert [d["score"] for d in score["data"]] == pytest.approx([x.prob for x in want.candidates], abs=1e-5)
    assert_same(decision["answers"], local_answers(demo, decide_request(1)).answers[0])
    assert health["status"] == "ok" and health["decode_steps"] > 0  # the engine's figures
    assert 'trimvlm_requests_total{path="/v1/chat/completions",status="200"} 3.0' in metrics  # the API's
    tokens = next(ln for ln in metrics.splitlines() if ln.startswith("trimvlm_generated_tokens_total"))
    assert float(tokens.split()[-1]) > 0  # the engine's
    cpu = next(ln for ln in metrics.splitlines() if ln.startswith("trimvlm_model_thread_cpu_seconds "))
    assert float(cpu.split()[-1]) > 0  # the engine's model thread, not the API process's (which has none)


def test_messages_carry_tensors_as_their_bytes():
    """A prepared request's tensors travel in the message itself (not as shared storage passed by file
    descriptor, a handshake per tensor) and come back equal: every dtype, views, empty and 0-d tensors."""
    x = torch.randn(6, 5)
    tensors = {"f32": x, "bf16": x.to(torch.bfloat16), "bool": x > 0, "view": x.t()[1:4], "empty": torch.empty(0, 3),
               "scalar": torch.tensor(7, dtype=torch.int64), "pixels": torch.randn(64, 1536)}  # fmt: skip
    msg = Submit(3, ("chat", "baseline"), tensors)
    wire = dumps([msg])
    assert len(wire) >= 64 * 1536 * 4  # the pixels' bytes are in the message
    (back,) = pickle.loads(wire)
    assert back.rid == 3 and back.key == ("chat", "baseline") and back.payload.keys() == tensors.keys()
    for name, t in tensors.items():
        got = back.payload[name]
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), name


def test_the_shared_port_streams_without_waiting_for_acks():
    """An API process's port: the connections asyncio accepts on it have Nagle's algorithm off (with it on, each
    streamed chunk waited for the client's delayed ACK: about 40 ms a request)."""
    sock = shared_port("127.0.0.1", 0)  # the kernel picks the port
    seen = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport):
            s = transport.get_extra_info("socket")
            seen.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def main():
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            for _ in range(500):
                if seen:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    asyncio.run(main())
    assert seen and seen[0] != 0


def test_a_steps_events_cross_in_one_message(demo, split, monkeypatch):
    """The engine sends what one model step made for an API process as one message: with n = 3 choices each
    step's three tokens arrive together (one message per step, not one per token)."""
    api, _ = split
    link, real = api.batcher.conn, api.batcher.conn.recv
    seen = []  # the Event count of every message the API process received

    def recv():
        msgs = real()
        seen.append(sum(isinstance(m, Event) for m in msgs))
        return msgs

    monkeypatch.setattr(link, "recv", recv)
    with live(api) as (url, _):
        body = {"messages": messages(3), "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 1}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300).json()
    events = sum(seen)
    assert events >= r["usage"]["completion_tokens"]  # every token (and each choice's end) crossed
    assert max(seen) >= 3 and len([k for k in seen if k]) < events / 2


def test_a_client_that_leaves_leaves_the_engines_batch(demo, split, monkeypatch):
    api, engine = split
    held = HeldSteps(demo.runner, monkeypatch)
    gone = threading.Event()
    held.hold = lambda rows: gone if len(held.rows) == 2 else None
    with live(api) as (url, _):
        with httpx.Client(base_url=url, timeout=300) as h:
            with h.stream("POST", "/v1/chat/completions",
                          json={"messages": messages(3), "max_tokens": 24, "stream": True}) as r:  # fmt: skip
                next(r.iter_lines())  # the role chunk: the request is decoding
        wait_for(lambda: api.metrics.registry.get_sample_value(
            "trimvlm_cancelled_requests_total", {"stage": "running"}) == 1, "the API process to see the close")  # fmt: skip
        rows = lambda: [r for g in engine.batcher.engine.groups.values() for r in g.rows]  # noqa: E731
        wait_for(lambda: all(r.job.cancelled for r in rows()), "the engine to be told (the bridge marks the job)")
        gone.set()
        wait_for(lambda: engine.batcher.stats()["running"] == 0, "the row to leave")
        assert engine.batcher.stats()["cancelled_running"] == 1
    assert len(held.rows) <= 3  # it left; it did not decode to the end


def test_api_workers_serve_on_one_port_and_stop_with_the_engine(demo):
    with reserved_port() as port:  # held while the server runs (its sockets share it: SO_REUSEADDR)
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "trimvlm.cli", "serve", "--model", "demo", "--port", str(port), "--threads", "1",
               "--api-workers", "2", "--log-level", "warning"]  # fmt: skip
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for(lambda: _up(url), "the API processes to answer /health")
            pids = set()
            for _ in range(8):  # the kernel spreads the connections over the processes
                with httpx.Client(base_url=url, timeout=300) as h:
                    r = h.post("/v1/chat/completions", json={"messages": messages(3), "max_tokens": 8})
                    assert r.status_code == 200, r.text
                    pids.add(h.get("/health").json()["pid"])
            assert r.json()["choices"][0]["message"]["content"] == demo.generate(
                image(3), "describe ?", max_new_tokens=8).texts[0]  # fmt: skip
            metrics = httpx.get(url + "/metrics", timeout=60).text  # every process's figures (multiprocess mode)
            assert 'trimvlm_requests_total{path="/v1/chat/completions",status="200"} 8.0' in metrics  # both API's
            tokens = next(ln for ln in metrics.splitlines() if ln.startswith("trimvlm_generated_tokens_total"))
            assert float(tokens.split()[-1]) >= 8  # the engine's
            workers = _children(proc.pid)
            assert len(workers) == 2 and pids <= set(workers)  # /health was answered by the API processes
        finally:
            proc.terminate()
            proc.wait(30)
    wait_for(lambda: not any(_alive(p) for p in workers), "the API processes to stop with the engine")


def _up(url) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(x) for x in out if _cmdline(int(x)).find("spawn_main") >= 0]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    return _cmdline(pid) != ""


def test_an_api_process_follows_the_engines_load(demo, tmp_path):
    """--tuned behind API processes: the rung is chosen with the engine's queue and measurements (set here)."""
    from test_serve_budgets import tune_folder

    folder = tune_folder(tmp_path / "t", demo)
    got = []
    with joined(demo, recipes=RecipeOptions(tuned=folder, slo_ttft_ms=200)) as (api, engine, _), live(api) as (url, _):
        for s_per_token in (1.0, 1e-9):  # every rung far past 200 ms; then all within it
            engine.load.tokens, engine.load.s_per_token, engine.load.step_s = 100, s_per_token, 0.0
            body = {"messages": messages(3), "max_tokens": 4}
            got.append(httpx.post(url + "/v1/chat/completions", json=body, timeout=300).json()["usage"]["recipe"])
    assert got == ["tuned-total_flops=0.4", "baseline"]


def test_closing_the_api_side_ends_its_reader_and_the_engines_bridge(demo):
    """An API process's batcher, closed, shuts its connection down: its reader thread and the engine's bridge
    thread for it both read EOF and return (a descriptor closed under their blocked reads kept both waiting)."""
    with joined(demo) as (api, engine, link):
        assert api.batcher.alive and link.is_alive()
        api.close()
        link.join(10)
        api.batcher._reader.join(10)
        assert not link.is_alive() and not api.batcher._reader.is_alive()
        assert engine.batcher.alive  # the engine keeps serving its other API processes
