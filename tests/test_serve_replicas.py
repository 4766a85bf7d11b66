"""`trimvlm serve --replicas N --ray ADDRESS` (serve/replicas.py): 2 CPU replicas of the demo model as a Ray Serve
deployment on a local Ray (started here, 2 CPUs), behind one HTTP route. Every answer (System One, chat plain
and streamed, a bad request's status) equals the single-process server's; the two replicas both run. Needs Ray
Serve (`pip install "trimvlm[ray]"`): skipped without Ray unless TRIMVLM_REQUIRE_EXTRAS is set."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import free_port, need_extra, optional

from trimvlm.testing.cli import assert_one_line_error, run_cli

ray, _ = optional("ray", 'pip install "trimvlm[ray]"')
serve, needs_ray = optional("ray.serve", 'Ray Serve: pip install "trimvlm[ray]"')
pytestmark = pytest.mark.own_process  # a Ray driver's threads stay in its process: a child pytest's (own_process.py)


@needs_ray
def test_two_replicas_answer_as_the_single_process_server():
    need_extra("fastapi", "uvicorn", "httpx", "openai", "prometheus_client")
    import httpx
    from conftest import live
    from test_serve import chat_request, decide_request
    from test_serve_engine import client

    import trimvlm
    from trimvlm.serve.replicas import APP_NAME, start_replicas
    from trimvlm.serve.state import ServerState
    from trimvlm.testing.decisions import assert_same_answers

    torch.set_num_threads(1)
    asks = [("/v1/systemone", decide_request(i)) for i in range(3)]
    asks += [("/v1/chat/completions", chat_request(i, max_tokens=16)) for i in range(4)]
    asks += [("/v1/chat/completions", {"messages": [{"role": "system", "content": "x"}]})]  # a 400
    asks += [("/v1/systemone", {"state": "x", "questions": {}})]  # a 422

    def answers(url: str) -> list:
        out = [None] * len(asks)

        def one(i):
            r = httpx.post(url + asks[i][0], json=asks[i][1], timeout=300)
            body = r.json()
            if r.status_code == 200:
                body = body["answers"] if "answers" in body else body["choices"][0]["message"]["content"]
            out[i] = (r.status_code, body)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(asks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        streamed = client(url).chat.completions.create(stream=True, **chat_request(0, max_tokens=16))
        return out + ["".join(ch.choices[0].delta.content or "" for ch in streamed)]

    with live(ServerState(trimvlm.load("demo"), model_id="demo")) as (url, _):
        ref = answers(url)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        url = start_replicas("demo", replicas=2, port=free_port(), threads=1)
        status = serve.status().applications[APP_NAME].deployments["TrimvlmServer"]
        assert status.replica_states.get("RUNNING") == 2, status
        got = answers(url)
        pids = set()  # which replica answers is Ray's choice: asked 32 at a time, until both have (or 4 times)
        for _ in range(4):
            with ThreadPoolExecutor(16) as ex:
                pids |= set(ex.map(lambda _: httpx.get(url + "/health", timeout=60).json()["pid"], range(32)))
            if len(pids) == 2:
                break
    finally:
        serve.shutdown()
        ray.shutdown()
    assert [s for s, _ in ref[:-1]] == [200] * 7 + [400, 422]
    assert [s for s, _ in got[:-1]] == [s for s, _ in ref[:-1]]
    for (_, a), (_, b) in zip(got[:3], ref[:3], strict=True):  # System One: the batches differ,
        assert_same_answers(a, b)  # so the probabilities agree to float rounding (1e-5)
    assert got[3:] == ref[3:]  # the chat texts (plain and streamed) and the error bodies: equal
    assert len(pids) == 2  # both replicas answer behind the one route


def test_replicas_need_ray_and_a_positive_count():
    need_extra("fastapi", "uvicorn")
    assert_one_line_error(run_cli("serve", "--replicas", 2), "--replicas 2 runs replicas on Ray: give --ray")
    assert_one_line_error(run_cli("serve", "--replicas", 0, "--ray", "local"),
                          "--replicas must be a positive number of model replicas")  # fmt: skip
