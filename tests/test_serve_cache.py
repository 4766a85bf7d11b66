"""The cross-request caches (runtime/vision_cache.py, runtime/prefix_cache.py): exact (the answers with them equal
the answers without), honest (what a request did not run costs it 0 FLOPs), bounded in bytes, valid only for
the same recipe, and reported (`usage`, `/metrics`). Over HTTP: a real uvicorn server on 127.0.0.1."""

import base64
import io

import numpy as np
import pytest
import torch
from conftest import live, need_extra
from PIL import Image

import trimvlm
from trimvlm.testing.decisions import DEMO_QUESTIONS as QUESTIONS
from trimvlm.testing.decisions import assert_same_answers as assert_same

MiB = 1024 * 1024
REDUCE = "tokens=density:keep=0.5:layer=1"


@pytest.fixture(autouse=True)
def _one():
    torch.set_num_threads(1)


def scene(seed: int) -> Image.Image:
    from trimvlm.demo.task import make_scene, render

    return render(make_scene(np.random.default_rng(seed)))


def asset(seed: int) -> dict:
    buf = io.BytesIO()
    scene(seed).save(buf, format="PNG")
    return {"type": "image", "format": "png", "data_base64": base64.b64encode(buf.getvalue()).decode()}


def request(seed: int, words: str = "") -> dict:
    return {"state": {"photo": "<img>" + words}, "questions": QUESTIONS, "assets": {"<img>": asset(seed)}}


@pytest.fixture(scope="module")
def plain():
    return trimvlm.load("demo")  # no caches: the reference


@pytest.fixture
def cached():
    vlm = trimvlm.load("demo")
    vlm.use_caches(vision_bytes=64 * MiB, prefix_bytes=64 * MiB)
    return vlm


def test_off_unless_turned_on(plain):
    assert plain.cache_stats() == {"vision": None, "prefix": None}


@pytest.mark.parametrize("recipe", [None, REDUCE])
def test_decisions_equal_without_caches_and_a_repeat_costs_less(plain, cached, recipe):
    reqs = [request(0), request(1), request(0), {"state": "no image", "questions": QUESTIONS}]
    ref = plain.decide(reqs, recipe=recipe, return_costs=True)
    first = cached.decide(reqs, recipe=recipe, return_costs=True)
    again = cached.decide(reqs, recipe=recipe, return_costs=True)
    for r, a, b in zip(ref.answers, first.answers, again.answers, strict=True):
        assert_same(a, r)
        assert_same(b, r)
    # the first batch prefilled the distinct prefixes once: its third request is its first's
    assert [u.prefix_reused for u in first.usage] == [False, False, True, False]
    assert first.usage[2].vision_flops == first.usage[2].method_flops == 0
    assert all(u.prefix_reused and u.prefix_tokens_reused > 0 for u in again.usage)
    for u, v in zip(again.usage, ref.usage, strict=True):
        assert u.vision_flops == 0 and u.total_flops < v.total_flops and u.layer_flops < v.layer_flops
    assert again.costs.flops.get("vision", 0) == 0
    # the shares still add up to what ran
    assert sum(u.model_flops for u in first.usage) == first.costs.model_flops
    assert sum(u.total_flops for u in again.usage) == again.costs.total_flops


def test_requests_with_one_prefix_share_its_row_and_their_common_tails(plain, cached):
    """[A, A', B], A' the state of A with two of its questions: with the prefixes cached, A and A' read one
    prefix row and A' runs no tail of its own (both of its questions are A's): the branch pass costs what
    [A, B]'s does, and every answer equals the uncached one."""
    names = list(QUESTIONS)
    sub = request(0) | {"questions": {q: QUESTIONS[q] for q in names[1:]}}
    reqs = [request(0), sub, request(1)]
    cached.decide(reqs)  # the prefixes stored
    res = cached.decide(reqs, return_costs=True)
    for got, ref in zip(res.answers, plain.decide(reqs), strict=True):
        assert_same(got, ref)
    assert all(u.prefix_reused for u in res.usage)
    pair = cached.decide([request(0), request(1)], return_costs=True)
    assert res.costs.flops["branch"] == pair.costs.flops["branch"] > 0
    assert sum(u.layer_flops for u in res.usage) == res.costs.flops["branch"]


def test_a_cached_prefix_is_only_for_its_recipe(plain, cached):
    req = request(3)
    cached.decide(req, return_costs=True)
    other = cached.decide(req, recipe=REDUCE, return_costs=True)
    assert not other.usage[0].prefix_reused
    assert_same(other.answers[0], plain.decide(req, recipe=REDUCE))
    assert cached.decide(req, recipe=REDUCE, return_costs=True).usage[0].prefix_reused


def test_an_image_in_another_state_is_a_vision_hit(plain, cached):
    """A new state around a known image: the prefix is new, the image's features are not encoded again."""
    cached.decide(request(4))
    res = cached.decide(request(4, " red"), return_costs=True)
    u = res.usage[0]
    assert not u.prefix_reused and u.vision_cache_hits == 1 and u.vision_flops == 0 and u.layer_flops > 0
    assert_same(res.answers[0], plain.decide(request(4, " red")))


def test_hybrid_model_prefix_states(cached):
    """Qwen3.5 (Gated DeltaNet): a reused prefix carries its recurrent states."""
    ref = trimvlm.load("demo-qwen35")
    vlm = trimvlm.load("demo-qwen35")
    vlm.use_caches(vision_bytes=16 * MiB, prefix_bytes=16 * MiB)
    reqs = [request(5), request(6)]
    vlm.decide(reqs)
    again = vlm.decide(reqs, return_costs=True)
    assert all(u.prefix_reused for u in again.usage)
    for a, r in zip(again.answers, ref.decide(reqs), strict=True):
        assert_same(a, r)


def test_generate_reuses_image_features(plain, cached):
    im = scene(7)
    ref = plain.generate(im, "describe ?", max_new_tokens=12)
    a = cached.generate(im, "describe ?", max_new_tokens=12)
    b = cached.generate(scene(7), "list row r1 ?", max_new_tokens=12)  # the same pixels, another prompt
    assert a.texts == ref.texts and a.tokens == ref.tokens
    assert b.texts == plain.generate(im, "list row r1 ?", max_new_tokens=12).texts
    assert a.costs.flops["vision"] == ref.costs.flops["vision"] > 0 and b.costs.flops.get("vision", 0) == 0
    assert cached.cache_stats()["vision"]["hits"] == 1


def test_the_vision_cache_stays_under_its_bound_after_1000_images(plain):
    """1,000 distinct images through the runner's encode with a bound of ~40 images' features: the bytes held
    never exceed it, the oldest go first, and a recent image is still a hit."""
    from trimvlm.runtime.meter import Meter

    vlm = trimvlm.load("demo")
    one = 64 * vlm.adapter.text_config.hidden_size * 4 * 4  # an image's features, deepstack included (upper bound)
    bound = 40 * one
    vlm.use_caches(vision_bytes=bound)
    cache = vlm.adapter.vision_cache
    rng = np.random.default_rng(0)
    size = scene(0).size
    peak = 0
    for _ in range(20):  # 20 batches of 50
        ims = [Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)) for _k in range(50)]
        prepared = vlm.prepare([[im] for im in ims], ["describe ?"] * 50)
        vlm.runner.encode(prepared, Meter())
        peak = max(peak, cache.bytes)
        assert cache.bytes <= bound
    st = vlm.cache_stats()["vision"]
    assert st["misses"] == 1000 and st["evictions"] >= 1000 - st["entries"] > 0 and peak <= bound
    meter = Meter()
    vlm.runner.encode(prepared, meter)  # the last 50 are still held
    assert meter.costs.flops.get("vision", 0) == 0 and cache.stats()["hits"] == 50


def test_the_prefix_cache_stays_under_its_bound(cached):
    """Distinct states through `decide` with a bound of a few prefixes: never over it, least recent evicted."""
    from trimvlm.runtime.prefix_cache import PrefixCache

    def state(i: int) -> dict:  # 60 distinct two-word states in the demo's vocabulary
        return {"state": f"{i // 10} {i % 10}", "questions": QUESTIONS}

    cached.decide(state(0))
    one = cached.runner.prefix_cache.bytes
    cache = cached.runner.prefix_cache = PrefixCache(int(4.5 * one))
    for start in range(0, 60, 20):
        cached.decide([state(i) for i in range(start, start + 20)])
        assert 0 < cache.bytes <= cache.max_bytes
    assert len(cache) == 4 and cache.evictions == 56
    assert cached.decide(state(59), return_costs=True).usage[0].prefix_reused
    assert not cached.decide(state(0), return_costs=True).usage[0].prefix_reused


def test_over_http_a_repeat_is_a_hit_and_metrics_say_so(plain):
    need_extra("fastapi", "uvicorn", "httpx", "prometheus_client")
    import httpx

    from trimvlm.serve.limits import Batching
    from trimvlm.serve.state import ServerState

    state = ServerState(trimvlm.load("demo"), model_id="demo", batching=Batching(max_wait_ms=1))
    body = request(8) | {"model": "demo"}
    with live(state) as (url, _):
        a = httpx.post(url + "/v1/systemone", json=body, timeout=120).json()
        b = httpx.post(url + "/v1/systemone", json=body, timeout=120).json()
        metrics = httpx.get(url + "/metrics").text
    ref = plain.decide(request(8))
    assert_same(a["answers"], ref)
    assert_same(b["answers"], ref)
    ua, ub = a["usage"], b["usage"]
    assert not ua["prefix_reused"] and ub["prefix_reused"] and ub["vision_flops"] == 0
    assert not ua["request_cached"] and ub["request_cached"] and ub["preprocess_s"] < ua["preprocess_s"]
    assert ub["total_flops"] < ua["total_flops"] and ub["prefix_tokens_reused"] > 0
    assert 0 < ub["prefix_cache_bytes"] <= 512 * MiB and 0 < ub["vision_cache_bytes"] <= 256 * MiB
    assert 0 < ub["request_cache_bytes"] <= 256 * MiB
    assert "trimvlm_prefix_cache_hits 1.0" in metrics and "trimvlm_request_cache_hits 1.0" in metrics
    assert "trimvlm_vision_cache_bytes" in metrics


def test_no_caches_when_the_flags_are_0():
    need_extra("fastapi", "prometheus_client")
    from trimvlm.serve.limits import CacheSizes
    from trimvlm.serve.state import ServerState

    state = ServerState(trimvlm.load("demo"), model_id="demo", caches=CacheSizes(vision_mb=0, prefix_mb=0, request_mb=0))  # fmt: skip
    assert state.cache_stats() == {"vision": None, "prefix": None, "request": None}


@pytest.mark.parametrize("request_cache_mb", [256, 0])
def test_identical_requests_of_one_batch_are_computed_once(plain, monkeypatch, request_cache_mb):
    """Request coalescing: a batch of [A, A, B] runs A once (two requests reach the decision run) with the
    request cache on; the copy has A's answers and no FLOPs or KV of its own. With the cache off nothing is
    coalesced (three requests run). Every answer equals vlm.decide alone."""
    need_extra("fastapi", "uvicorn", "prometheus_client")
    from trimvlm import decision
    from trimvlm.serve import systemone
    from trimvlm.serve.jobs import JobKey
    from trimvlm.serve.limits import CacheSizes
    from trimvlm.serve.state import ServerState

    state = ServerState(trimvlm.load("demo"), model_id="demo", caches=CacheSizes(vision_mb=0, prefix_mb=0, request_mb=request_cache_mb))  # fmt: skip
    bodies = [request(1), request(1), request(2)]
    jobs = []
    for body in bodies:
        prepared, _, key = systemone.prepare_cached(state, body)
        jobs.append(systemone.DecideJob(prepared, None, key))
    ran, real = [], decision.run
    monkeypatch.setattr(decision, "run", lambda vlm, reqs, plan: ran.append(len(reqs)) or real(vlm, reqs, plan))
    out = systemone.run(state, JobKey("decide", "baseline"), jobs)
    on = request_cache_mb > 0
    assert ran == [2 if on else 3]
    assert [c for _, _, c in out] == [False, on, False]
    for (answers, _, _), ref in zip(out, plain.decide(bodies), strict=True):
        assert_same(answers, ref)
    copy = out[1][1].usage()
    assert (copy["total_flops"] == 0 and copy["kv_bytes"] == 0) if on else copy["total_flops"] > 0
    assert out[0][1].usage()["total_flops"] > 0


def test_a_large_tensor_is_hashed_once_while_it_lives_unchanged(monkeypatch):
    """The key of a large tensor is remembered for that tensor: asked again it is not hashed again; a copy has
    the same key; written in place, it is hashed again (a new key); freed, it is forgotten."""
    import gc

    from trimvlm.runtime import lru, tensor_memo

    t = torch.randn(256, 256)
    key = lru.digest("x", t)
    hashed = []
    real = lru._bytes
    monkeypatch.setattr(lru, "_bytes", lambda x: hashed.append(x.numel()) or real(x))
    assert lru.digest("x", t) == key and hashed == []  # remembered
    assert lru.digest("x", t.clone()) == key and hashed == [t.numel()]  # same bytes, same key
    t.add_(1)
    assert lru.digest("x", t) != key and len(hashed) == 2  # written in place: hashed again
    ident = id(t)
    del t
    gc.collect()
    assert ("digest", ident) not in tensor_memo._memo  # the one tensor memo (runtime/tensor_memo.py)


def test_a_repeated_chat_prompt_is_not_prefilled_again(plain):
    """Runner.prefill_prompts (runtime/prefix_cache.py): a chat prompt sent again is read from the prefix cache (no vision tower, no
    prefill: 0 FLOPs on both lines), alone and admitted together with new prompts; every answer (greedy and
    seeded sampling) equals vlm.generate alone. With --prefix-cache-mb 0 nothing is reused."""
    need_extra("fastapi", "uvicorn", "httpx", "openai", "prometheus_client")
    import threading

    import httpx
    from test_serve_engine import data_url

    from trimvlm.serve.limits import Batching, CacheSizes
    from trimvlm.serve.state import ServerState

    def body(scene_seed, prompt="describe ?", **kw):
        content = [{"type": "image_url", "image_url": {"url": data_url(scene_seed)}},
                   {"type": "text", "text": prompt}]  # fmt: skip
        return {"messages": [{"role": "user", "content": content}], "max_tokens": 16} | kw

    sampled = {"temperature": 0.8, "top_p": 0.9, "seed": 3}
    asks = [body(3), body(4, "read text ?", **sampled), body(3), body(5), body(4, "read text ?", **sampled)]
    refs = [plain.generate(scene(s), p, max_new_tokens=16, **kw).texts[0]
            for s, p, kw in [(3, "describe ?", {}), (4, "read text ?", sampled), (3, "describe ?", {}),
                             (5, "describe ?", {}), (4, "read text ?", sampled)]]  # fmt: skip
    for mb, reused in ((512, [False, False, True, False, True]), (0, [False] * 5)):
        state = ServerState(trimvlm.load("demo"), model_id="demo", batching=Batching(max_wait_ms=10_000), caches=CacheSizes(prefix_mb=mb))
        got = [None] * len(asks)
        with live(state) as (url, _):
            for i in (0, 1):  # stored
                got[i] = httpx.post(url + "/v1/chat/completions", json=asks[i], timeout=300).json()

            def one(i, got=got):
                got[i] = httpx.post(url + "/v1/chat/completions", json=asks[i], timeout=300).json()

            threads = [threading.Thread(target=one, args=(i,)) for i in (2, 3, 4)]  # one admission, mixed
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
        assert [g["choices"][0]["message"]["content"] for g in got] == refs
        assert [g["usage"]["prefix_reused"] for g in got] == reused
        for g, hit in zip(got, reused, strict=True):
            u = g["usage"]
            assert (u["vision_flops"] == u["prefill_flops"] == 0) == hit
            assert (u["prefix_tokens_reused"] == u["prompt_tokens"]) == hit


def test_found_and_new_prompts_are_assembled_into_one_batch(plain):
    """Runner.prefill_prompts over [A, B, A] with A stored before: A found twice, B prefilled; the batch's
    first logits and greedy continuations equal the plain prefill of the three prompts."""
    from trimvlm.plan import make_plan
    from trimvlm.runtime.generate import Decoding
    from trimvlm.runtime.meter import Meter
    from trimvlm.runtime.prefix_cache import PrefixCache

    runner = plain.runner
    a, b = plain.prepare(scene(3), "describe ?"), plain.prepare(scene(4), "read text ?")
    plan = make_plan(None, runner)

    def greedy(out, steps=8):
        dec, logits, seen = Decoding(runner, out.cache, out.next_pos.clone()), out.logits, []
        for _ in range(steps):
            tok = logits.argmax(-1)
            seen.append(tok.tolist())
            logits = dec.step(tok)
        return seen

    ref = runner.prefill(runner.adapter.collate([a, b, a]), plan)
    runner.prefix_cache = PrefixCache(64 * MiB)
    try:
        assert runner.prefill_prompts([a], plan, meter=Meter())[1] == [False]
        out, hits = runner.prefill_prompts([a, b, a], plan, meter=Meter())
    finally:
        runner.prefix_cache = None
    assert hits == [True, False, True]
    torch.testing.assert_close(out.logits, ref.logits, atol=2e-4, rtol=1e-4)
    assert torch.equal(out.next_pos, ref.next_pos)
    assert greedy(out) == greedy(ref)


def test_a_repeated_chat_request_is_not_prepared_again(plain, monkeypatch):
    """The request cache serves chat completions too: the same request (prompt, images, max_tokens, recipe)
    sent again is not decoded, processed or hashed again (`usage.request_cached`) and gets the same answer;
    another max_tokens is another request. With --request-cache-mb 0 nothing is found."""
    need_extra("fastapi", "uvicorn", "httpx", "prometheus_client")
    import httpx
    from test_serve_engine import data_url, image

    from trimvlm.serve import chat
    from trimvlm.serve.limits import CacheSizes
    from trimvlm.serve.state import ServerState

    decoded, real = [], chat.decode_image
    monkeypatch.setattr(chat, "decode_image", lambda *a: decoded.append(a[0]) or real(*a))

    def body(max_tokens):
        content = [{"type": "image_url", "image_url": {"url": data_url(3)}}, {"type": "text", "text": "describe ?"}]
        return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}

    for mb in (256, 0):
        decoded.clear()
        state = ServerState(trimvlm.load("demo"), model_id="demo", caches=CacheSizes(request_mb=mb))
        with live(state) as (url, _):
            got = [httpx.post(url + "/v1/chat/completions", json=body(n), timeout=300).json() for n in (16, 16, 12)]
        assert [g["usage"]["request_cached"] for g in got] == [False, mb > 0, False]
        assert len(decoded) == (2 if mb else 3)
        texts = [g["choices"][0]["message"]["content"] for g in got]
        assert texts[:2] == [plain.generate(image(3), "describe ?", max_new_tokens=16).texts[0]] * 2
        assert texts[2] == plain.generate(image(3), "describe ?", max_new_tokens=12).texts[0]


def test_a_body_sent_again_is_not_parsed_or_checked_again(plain, monkeypatch):
    """The same bytes again (request cache on): found by their digest, not parsed, schema-checked or sent to the
    preparation thread, and answered as the first time. The same JSON with its keys in another order is another
    body (checked again) but the same prepared request; a refused body is never remembered; with the request
    cache off nothing is remembered."""
    need_extra("fastapi", "uvicorn", "httpx", "prometheus_client")
    import json

    import httpx

    from trimvlm.serve import systemone
    from trimvlm.serve.limits import Batching, CacheSizes
    from trimvlm.serve.state import ServerState

    checks, real = [], systemone.check_schema
    monkeypatch.setattr(systemone, "check_schema", lambda state, body: checks.append(1) or real(state, body))
    body = request(9) | {"model": "demo", "recipe": ""}
    raw = json.dumps(body).encode()
    reordered = json.dumps(dict(reversed(list(body.items())))).encode()
    bad = json.dumps(body | {"questions": {}}).encode()
    post = {"headers": {"content-type": "application/json"}, "timeout": 120}
    for mb in (256, 0):
        checks.clear()
        state = ServerState(trimvlm.load("demo"), model_id="demo", batching=Batching(max_wait_ms=1), caches=CacheSizes(request_mb=mb))
        with live(state) as (url, _):
            out = [httpx.post(url + "/v1/systemone", content=c, **post) for c in (raw, raw, reordered, bad, bad)]
            metrics = httpx.get(url + "/metrics").text
        assert [r.status_code for r in out] == [200, 200, 200, 422, 422]
        assert f"trimvlm_seen_bodies {2.0 if mb else 0.0}" in metrics  # on /metrics: entries and hits
        assert f"trimvlm_seen_body_hits_total {1.0 if mb else 0.0}" in metrics
        assert len(checks) == (4 if mb else 5)  # the repeat of `raw` is not checked again (cache on)
        assert len(state.seen_bodies) == (2 if mb else 0)
        first, again, other = (r.json() for r in out[:3])
        assert again["answers"] == first["answers"] == other["answers"]
        assert again["model"] == first["model"] == "demo"
        assert [x["usage"]["request_cached"] for x in (first, again, other)] == [False, bool(mb), bool(mb)]
        assert_same(first["answers"], plain.decide(request(9)))


def test_the_answer_is_the_json_fastapi_would_send(plain):
    """The System One answer is sent as a plain `JSONResponse`, without FastAPI's `jsonable_encoder`: the bytes are
    the same for a real answer and usage."""
    need_extra("fastapi")
    from fastapi.encoders import jsonable_encoder
    from fastapi.responses import JSONResponse

    from trimvlm.decision import prepare_request
    from trimvlm.decision import run as run_decisions
    from trimvlm.plan import decision_plan
    from trimvlm.recipe import parse_recipe

    result = run_decisions(plain, [prepare_request(plain, request(3))], decision_plan(parse_recipe(""), plain.runner))
    content = {"model": "demo", "answers": result.answers[0], "usage": result.usage[0].usage() | {"recipe": "x"}}
    assert JSONResponse(content).body == JSONResponse(jsonable_encoder(content)).body


@pytest.mark.parametrize("recipe", ["", REDUCE])
def test_found_prefixes_of_different_lengths_are_assembled_as_before(cached, recipe):
    """Entries whose layers have one length are stored stacked (one tensor per field) and assembled with one copy
    per field and row; the batch equals the per-layer assembly exactly (left padding with the same fills). A
    reducer that drops tokens at a layer leaves layers of different lengths: those entries stay per layer."""
    from trimvlm.runtime import prefix_cache as pc

    one = request(0) | {"questions": {"circle": QUESTIONS["circle"]}}  # a one-question prefix: longer
    cached.decide([request(0), one, request(1, " and more words here")], recipe=recipe)
    entries = [stored.entry for stored, _ in cached.runner.prefix_cache._items.values()]
    assert len(entries) == 3 and len({e.layers[0].key.shape[2] for e in entries}) > 1
    assert all((e.stacked is not None) == (recipe == "") for e in entries)
    fast = pc.assemble(entries, cached.runner.num_layers)
    slow = pc.assemble([pc.PrefixEntry(**{**e.__dict__, "stacked": None}) for e in entries], cached.runner.num_layers)
    assert fast.cache.layers.keys() == slow.cache.layers.keys()
    for i, kv in slow.cache.layers.items():
        for n in pc.FILL:
            assert torch.equal(getattr(fast.cache.layers[i], n), getattr(kv, n)), (i, n)
