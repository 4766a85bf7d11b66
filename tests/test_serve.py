"""`trimvlm serve` over HTTP: a real uvicorn server in a subprocess (the demo model, one thread, a free port on
127.0.0.1), talked to with httpx. Answers equal `vlm.decide` / `vlm.generate` in this process; concurrent
requests are batched and equal their answers alone; bad requests get their status code and reason, and the
server goes on answering."""

import base64
import io
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from conftest import need_extra, reserved_port

need_extra("fastapi", "uvicorn", "httpx")

import httpx  # noqa: E402

import trimvlm  # noqa: E402
from trimvlm.testing.decisions import DEMO_QUESTIONS as QUESTIONS  # noqa: E402
from trimvlm.testing.decisions import assert_same_answers as assert_same  # noqa: E402

MAX_TOKENS = 48  # the server's --max-new-tokens
MAX_BODY_MB = 1


@pytest.fixture(autouse=True)
def _one():
    torch.set_num_threads(1)


def scene(seed: int):
    from trimvlm.demo.task import make_scene, render

    return render(make_scene(np.random.default_rng(seed)))


def b64(seed: int) -> str:
    buf = io.BytesIO()
    scene(seed).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def asset(seed: int) -> dict:
    return {"type": "image", "format": "png", "data_base64": b64(seed)}


def decide_request(i: int) -> dict:
    """Requests of different question counts and images (none, one, two)."""
    names = list(QUESTIONS)[: 1 + i % 3]
    req = {"model": "demo", "questions": {n: QUESTIONS[n] for n in names}}
    if i % 4 == 3:
        return req | {"state": "no image here"}
    if i % 4 == 2:
        return req | {
            "state": {"left": "<a>", "right": "<b>"},
            "assets": {"<a>": asset(i), "<b>": asset(i + 50)},
        }
    return req | {"state": {"photo": "<img>"}, "assets": {"<img>": asset(i)}}


PROMPTS = ["describe ?", "how many red ?", "list row r1 ?", "read text ?", "is there a blue circle ?"]


def chat_request(i: int, **kw) -> dict:
    content = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(100 + i)}},
        {"type": "text", "text": PROMPTS[i % len(PROMPTS)]},
    ]
    return {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": 24} | kw


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server's base URL; the subprocess is killed at the end of the module, whatever happened."""
    with reserved_port() as port:  # held while the server runs: no other process is given it
        log = open(
            tmp_path_factory.mktemp("serve") / "server.log", "w+"
        )  # a file: a pipe could fill and block it
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        cmd = [
            sys.executable, "-m", "trimvlm.cli", "serve", "--model", "demo", "--port", str(port), "--threads", "1",
            "--max-batch", "32", "--max-wait-ms", "5000", "--max-new-tokens", str(MAX_TOKENS),
            "--max-body-mb", str(MAX_BODY_MB), "--log-level", "warning",
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 180
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    pytest.fail(f"the server exited ({proc.returncode}):\n{log.read()[-4000:]}")
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail("the server did not answer /health within 180 s")
                time.sleep(0.3)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            log.close()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def demo():
    return trimvlm.load("demo")


def local_answers(demo, req: dict, recipe=None):
    """`vlm.decide` in this process, on the request as the server reads it (no `model` key)."""
    body = {k: v for k, v in req.items() if k not in ("model", "recipe")}
    return demo.decide(body, recipe=recipe, return_costs=True)


def local_generate(demo, req: dict, recipe=None):
    """`vlm.generate` (greedy) in this process on the images and text of a chat request."""
    content = req["messages"][0]["content"]
    images = [_decode(p["image_url"]["url"]) for p in content if p["type"] == "image_url"]
    prompt = "\n".join(p["text"] for p in content if p["type"] == "text")
    return demo.generate(images, prompt, max_new_tokens=req["max_tokens"], recipe=recipe)


def local_text(demo, req: dict, recipe=None) -> str:
    return local_generate(demo, req, recipe).texts[0]


def _decode(url: str):
    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")


def sse(text: str) -> list:
    """The `data:` payloads of a server-sent event stream (JSON decoded, `[DONE]` kept as text)."""
    out = []
    for block in text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---- the endpoints ----


def test_health_and_models(client):
    h = client.get("/health")
    assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["max_batch"] == 32
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["demo"]


def test_systemone_equals_decide(client, demo):
    for i in range(4):
        req = decide_request(i)
        r = client.post("/v1/systemone", json=req)
        assert r.status_code == 200, r.text
        body = r.json()
        ref = local_answers(demo, req)
        assert body["model"] == "demo" and set(body) == {"model", "answers", "usage"}
        assert_same(body["answers"], ref.answers[0])
        u, v = body["usage"], ref.usage[0]
        assert u["input_tokens"] == v.input_tokens and u["output_tokens"] == 0
        assert u["images"] == v.images and u["vision_flops"] == v.vision_flops
        for k in (
            "model_flops",
            "method_flops",
            "kv_bytes",
            "latency_s",
            "queue_s",
            "batch_requests",
            "recipe",
        ):
            assert k in u, k


def test_systemone_recipe_is_cheaper(client, demo):
    req = decide_request(40) | {"recipe": "tokens=density:keep=0.25:layer=1"}  # a state no test sent before
    r = client.post("/v1/systemone", json=req).json()
    base = client.post("/v1/systemone", json=decide_request(40)).json()  # its prefix: another recipe's
    ref = local_answers(demo, req, recipe=req["recipe"])
    assert_same(r["answers"], ref.answers[0])
    assert r["usage"]["recipe"] == "tokens=density:keep=0.25:layer=1"
    assert r["usage"]["layer_flops"] < base["usage"]["layer_flops"]
    assert r["usage"]["kv_bytes"] < base["usage"]["kv_bytes"]


def test_chat_equals_generate(client, demo):
    for i in range(3):
        req = chat_request(i)
        r = client.post("/v1/chat/completions", json=req)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion" and body["model"] == "demo"
        choice = body["choices"][0]
        assert choice["message"]["role"] == "assistant"
        ref = local_generate(demo, req)
        assert choice["message"]["content"] == ref.texts[0]
        assert choice["finish_reason"] in ("stop", "length")
        u = body["usage"]
        assert (
            u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and u["completion_tokens"] >= 1
        )
        c = ref.costs  # one request at a time: a batch of one, whose costs are the local generate's
        assert (u["decode_flops"], u["vision_flops"], u["kv_bytes"]) == (
            c.decode_flops,
            c.flops["vision"],
            c.kv_bytes,
        )


def test_the_readme_server_example_waits_and_asks_about_the_scene(server, demo, tmp_path):
    """README.md's server block, pasted into bash against this server (its first line starts the server): it
    polls /health, sends scene.png as a data URL, and prints the answer `vlm.generate` gives on that image."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "trimvlm serve" in b)
    assert "/health" in block and block.index("/health") < block.index("/v1/chat/completions")
    pasted = "\n".join(line for line in block.splitlines() if "trimvlm serve" not in line)
    pasted = pasted.replace("localhost:8000", server.removeprefix("http://"))
    scene(7).save(tmp_path / "scene.png")
    env = dict(os.environ, PATH=f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}")
    ran = subprocess.run(["bash", "-euo", "pipefail", "-c", pasted], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    answer = json.loads(ran.stdout)
    question = re.search(r'"text": "([^"]+)"', block).group(1)
    max_tokens = int(re.search(r'"max_tokens": (\d+)', block).group(1))
    assert answer["usage"]["vision_flops"] > 0  # the image was sent
    expected = demo.generate(scene(7), question, max_new_tokens=max_tokens).texts[0]
    assert answer["choices"][0]["message"]["content"] == expected


def test_chat_text_only_and_recipe(client, demo):
    recipe = "tokens=density:keep=0.25:layer=1"
    req = chat_request(0, recipe=recipe)
    r = client.post("/v1/chat/completions", json=req).json()
    assert r["choices"][0]["message"]["content"] == local_text(demo, req, recipe=recipe)
    assert r["usage"]["recipe"] == recipe
    text = {"messages": [{"role": "user", "content": "describe ?"}], "max_tokens": 8}
    r = client.post("/v1/chat/completions", json=text).json()
    assert (
        r["choices"][0]["message"]["content"] == demo.generate(None, "describe ?", max_new_tokens=8).texts[0]
    )


def test_sampled_completion_equals_generate(client, demo):
    """temperature > 0, sent alone: the same seed gives what vlm.generate gives (a sampled row draws from its
    own seeded generator, so it may share a decode batch: tests/test_serve_engine.py)."""
    req = chat_request(0, temperature=0.8, top_p=0.9, seed=7)
    r = client.post("/v1/chat/completions", json=req).json()
    images = [_decode(req["messages"][0]["content"][0]["image_url"]["url"])]
    ref = demo.generate(images, PROMPTS[0], max_new_tokens=24, temperature=0.8, top_p=0.9, seed=7).texts[0]
    assert r["choices"][0]["message"]["content"] == ref and r["usage"]["batch_requests"] == 1


def test_streaming_equals_non_streaming(client):
    for i in (0, 2, 3):
        req = chat_request(i)
        plain = client.post("/v1/chat/completions", json=req).json()
        r = client.post("/v1/chat/completions", json=req | {"stream": True})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r.text)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert text == plain["choices"][0]["message"]["content"]
        last = chunks[-1]
        assert last["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
        assert last["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]


# ---- batching ----


def _burst(server: str, path: str, bodies: list[dict]) -> list[httpx.Response]:
    """All bodies at once, each from its own connection."""

    def one(body):
        with httpx.Client(base_url=server, timeout=300) as c:
            return c.post(path, json=body)

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, bodies))


def test_32_concurrent_decisions_equal_alone(server, client, demo):
    reqs = [decide_request(i % 8) for i in range(32)]
    refs = {i: local_answers(demo, decide_request(i)).answers[0] for i in range(8)}
    before = client.get("/health").json()
    rs = _burst(server, "/v1/systemone", reqs)
    assert [r.status_code for r in rs] == [200] * 32
    for i, r in enumerate(rs):
        assert_same(r.json()["answers"], refs[i % 8])
    sizes = [r.json()["usage"]["batch_requests"] for r in rs]
    assert max(sizes) > 1, sizes  # the server batched them
    after = client.get("/health").json()
    assert after["requests"] - before["requests"] == 32 and after["batches"] - before["batches"] < 32


def test_32_concurrent_completions_equal_alone(server, demo):
    """Mixed max_tokens and recipes: each batch holds requests that can share one generate."""
    recipe = "tokens=density:keep=0.5:layer=1"
    kinds = [{}, {"max_tokens": 6}, {"recipe": recipe}, {"stream": True}]
    reqs = [chat_request(i % 8, **kinds[i % 4]) for i in range(32)]
    refs = {}
    rs = _burst(server, "/v1/chat/completions", reqs)
    assert [r.status_code for r in rs] == [200] * 32
    sizes = []
    for req, r in zip(reqs, rs, strict=True):
        key = (req["messages"][0]["content"][1]["text"], req["messages"][0]["content"][0]["image_url"]["url"],
               req["max_tokens"], req.get("recipe"))  # fmt: skip
        if key not in refs:
            refs[key] = local_text(demo, req, recipe=req.get("recipe"))
        if req.get("stream"):
            chunks = sse(r.text)[:-1]
            got = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
            usage = chunks[-1]["usage"]
        else:
            got, usage = r.json()["choices"][0]["message"]["content"], r.json()["usage"]
        assert got == refs[key], (req, got, refs[key])
        assert usage["recipe"] == (recipe if req.get("recipe") else "baseline")
        sizes.append(usage["batch_requests"])
    assert max(sizes) > 1, sizes


# ---- bad requests: the status code, the reason, and the next request is answered ----


def _raw(client, path, content: bytes):
    return client.post(path, content=content, headers={"content-type": "application/json"})


BAD = [
    ("/v1/systemone", b'{"state": "x", "questions": {', 422, "JSON decode error"),
    ("/v1/systemone", {"state": "x", "questions": {"a": {"type": "maybe", "instructions": "?"}}}, 422, "type"),
    ("/v1/systemone", {"state": "x", "questions": {f"q{i}": QUESTIONS["circle"] for i in range(65)}}, 422,
     "at most 64 items"),
    ("/v1/systemone", {"state": "x", "questions": QUESTIONS, "extra": 1}, 422, "Extra inputs are not permitted"),
    ("/v1/systemone", {"state": "<img>", "questions": QUESTIONS,
                       "assets": {"<img>": {"type": "image", "format": "png", "data_base64": "bm90IGFuIGltYWdl"}}},
     400, "not a decodable image"),
    ("/v1/systemone", {"state": "<img>", "questions": QUESTIONS, "assets": {"<img>": {
        "type": "image", "format": "png", "data_base64": "https://example.com/a.png"}}}, 400, "URL"),
    *[("/v1/systemone", {"state": "<img>", "questions": QUESTIONS, "assets": {"<img>": {
        "type": "image", "format": "png", "data_base64": path}}}, 400, "file paths are not accepted")
      for path in (__file__, __file__ + ".missing")],  # a file on the server or not: the same answer, none read
    ("/v1/systemone", {"state": "x", "questions": QUESTIONS, "recipe": "tokens=nope:keep=0.5"}, 400,
     "unknown tokens method"),
    ("/v1/systemone", {"state": "x", "questions": QUESTIONS, "recipe": "kv=density:keep=0.5"}, 400, "kv="),
    ("/v1/systemone", {"model": "gpt-4", "state": "x", "questions": QUESTIONS}, 400, "answers for 'demo'"),
    ("/v1/systemone", {"state": "x", "questions": QUESTIONS, "recipe": "depth=ranking:file=/etc/passwd:budget=1"},
     400, "reads files on the server"),
    ("/v1/chat/completions", b"[1, 2", 422, "JSON decode error"),
    ("/v1/chat/completions", {"messages": "hi"}, 422, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temprature": 1}, 422,
     "temprature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "describe ?"}], "max_tokens": 100000}, 400,
     f"at most {MAX_TOKENS}"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "describe ?"}], "max_tokens": 0}, 422,
     "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "describe ?"}]}]}, 400, "not a decodable image"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}]}]}, 400, "never fetches"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "describe ?"}], "recipe": "tokens=zzz"}, 400,
     "unknown tokens method"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "describe ?"},
                                           {"role": "system", "content": "be nice"}]}, 400, "system messages come first"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "describe ?"},
                                           {"role": "assistant", "content": "red"}]}, 400, "ending with the user turn"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "42"}]}, 400, "role 'tool'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]},
     400, "stop: up to 4"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     "top_logprobs: set logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 21}, 422, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 2.5}, 422,
     "presence_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "   "}]}, 400, "empty prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 17}, 400, "n=17"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "red " * 1100}]}, 400, "1,024 positions"),
    ("/v1/systemone", {"state": "red " * 1100, "questions": QUESTIONS}, 422, "past this model's 1,024"),
]  # fmt: skip


@pytest.mark.parametrize(
    "path,body,status,reason", BAD, ids=[f"{i}-{b[0].split('/')[-1]}" for i, b in enumerate(BAD)]
)
def test_bad_request(client, path, body, status, reason):
    r = _raw(client, path, body) if isinstance(body, bytes) else client.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()
    assert reason in json.dumps(err["detail"]) and reason in err["error"]["message"], err
    if status == 422:
        assert isinstance(err["detail"], list) and err["detail"][0]["loc"][0] == "body"
    ok = client.post("/v1/systemone", json=decide_request(0))
    assert ok.status_code == 200, ok.text


def test_body_too_large(client):
    big = b'{"state": "' + b"x" * (MAX_BODY_MB * 1024 * 1024 + 10) + b'", "questions": {}}'
    r = _raw(client, "/v1/systemone", big)
    assert r.status_code == 413 and "at most" in r.json()["detail"]
    assert client.post("/v1/chat/completions", json=chat_request(1)).status_code == 200


def test_a_bad_request_in_a_burst_fails_alone(server, demo):
    """Bad requests sent together with good ones: they are refused before batching, the others are answered."""
    bad = {"state": "<img>", "questions": QUESTIONS,
           "assets": {"<img>": {"type": "image", "format": "png", "data_base64": "bm90IGFuIGltYWdl"}}}  # fmt: skip
    reqs = [decide_request(i) if i % 3 else bad for i in range(12)]
    rs = _burst(server, "/v1/systemone", reqs)
    for i, r in enumerate(rs):
        if i % 3:
            assert r.status_code == 200
            assert_same(r.json()["answers"], local_answers(demo, decide_request(i)).answers[0])
        else:
            assert r.status_code == 400
