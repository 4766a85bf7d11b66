"""One execution path: every product call is `Runner.prefill(prepared, plan)` (+ `step` / `branch`),
the vision tower runs once per batch and its FLOPs are counted on that run, and what a plan needs is built
once (a model's fingerprint, a router checkpoint)."""

import pytest
import torch
from conftest import AVAILABLE, RunnerCalls, ragged_batch

import trimvlm
from trimvlm.runtime.meter import Meter, flop_counter
from trimvlm.runtime.plan import Plan
from trimvlm.runtime.runner import Runner
from trimvlm.testing import random_image
from trimvlm.testing.decisions import DEMO_QUESTIONS


@pytest.mark.parametrize("family", AVAILABLE)
def test_vision_flops_counted_on_the_one_encode(tiny_adapter, family, monkeypatch):
    """The meter's vision line equals torch's FlopCounterMode on a plain encode of the same batch, and a
    prefill runs the vision tower exactly once, whether its shapes are new or remembered."""
    adapter = tiny_adapter(family)
    runner = Runner(adapter)
    images, prompts = ragged_batch()
    prep = adapter.prepare(images, prompts)
    with flop_counter() as fc, torch.no_grad():
        adapter.embed(prep)
    calls = RunnerCalls(runner, monkeypatch)
    try:
        for _ in range(2):  # a new shape, then a remembered one
            before = calls.vision
            meter = Meter()
            runner.prefill(prep, meter=meter)
            assert calls.vision - before == 1
            assert meter.costs.flops["vision"] == fc.get_total_flops() > 0
    finally:
        calls.close()


@pytest.fixture(scope="module")
def demo():
    return trimvlm.load("demo")


def test_generate_score_decide_take_the_one_runner_path(demo, monkeypatch):
    """Each call prefills once through `Runner.prefill` and encodes its images once (the decision request's
    prompts share one prefix, so its image is encoded once too)."""
    img = random_image(1, (96, 96))
    calls = RunnerCalls(demo.runner, monkeypatch)
    runs = {
        "generate": lambda: demo.generate(img, "how many red shapes ?", max_new_tokens=3),
        "generate kv": lambda: demo.generate(img, "how many ?", max_new_tokens=3, recipe="kv=h2o:keep=0.5"),
        "score": lambda: demo.score(img, "which shape ?", ["circle", "square", "triangle"]),
        "score tree": lambda: demo.score(img, "which ?", ["red circle", "red square"], executor="tree"),
        "decide": lambda: demo.decide({"state": "<a>", "questions": DEMO_QUESTIONS, "assets": {"<a>": img}}),
        "decide fastv": lambda: demo.decide(
            {"state": "<a>", "questions": DEMO_QUESTIONS, "assets": {"<a>": img}}, recipe="tokens=fastv:keep=0.5"
        ),
    }
    try:
        for name, run in runs.items():
            p, v = calls.prefills, calls.vision
            run()
            assert (calls.prefills - p, calls.vision - v) == (1, 1), name
    finally:
        calls.close()


def test_chat_route_takes_the_one_runner_path(demo, monkeypatch):
    """A chat completion through the server (a real uvicorn server in this process, plain HTTP): the request is
    prepared once, prefilled once through `Runner.prefill` and its image encoded once; its answer is
    `vlm.generate`'s."""
    import base64
    import io

    from conftest import live, need_extra

    httpx = need_extra("fastapi", "uvicorn", "httpx")
    from trimvlm.serve.limits import CacheSizes
    from trimvlm.serve.state import ServerState

    img = random_image(4, (96, 96))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "how many red shapes ?"}]}],
            "max_tokens": 4}  # fmt: skip
    want = demo.generate(img, "how many red shapes ?", max_new_tokens=4).texts[0]
    prepares, real = [], demo.adapter.prepare
    monkeypatch.setattr(demo.adapter, "prepare", lambda *a, **kw: prepares.append(1) or real(*a, **kw))
    calls = RunnerCalls(demo.runner, monkeypatch)
    try:
        with live(ServerState(demo, model_id="demo", caches=CacheSizes(vision_mb=0, prefix_mb=0, request_mb=0))) as (base, _):
            got = httpx.post(base + "/v1/chat/completions", json=body, timeout=120).json()
        assert got["choices"][0]["message"]["content"] == want
        assert (len(prepares), calls.prefills, calls.vision) == (1, 1, 1)
    finally:
        calls.close()


def test_decision_tails_time_and_flops_on_one_line(demo):
    """A shared-prefix decision books its question tails' FLOPs and time on the same (branch) line."""
    img = random_image(2, (96, 96))
    res = demo.decide({"state": "<a>", "questions": DEMO_QUESTIONS, "assets": {"<a>": img}}, return_costs=True)
    c = res.costs
    assert c.flops["branch"] > 0 and c.seconds["branch"] > 0
    assert set(c.seconds) == {k for k, v in c.flops.items() if v > 0}


def test_a_plan_applies_its_kv_step_inside_prefill(tiny_adapter):
    """The KV step at the boundary is the plan's: callers never call it themselves."""
    from trimvlm.plan import make_plan

    adapter = tiny_adapter("qwen3_vl")
    runner = Runner(adapter)
    prep = adapter.prepare(*ragged_batch())
    full = runner.prefill(prep)
    out = runner.prefill(prep, make_plan("kv=streamingllm:keep=0.25", runner))
    n_full = (full.cache.layers[0].visual & full.cache.layers[0].valid).sum(1)
    n_kept = (out.cache.layers[0].visual & out.cache.layers[0].valid).sum(1)
    assert torch.equal(n_kept, torch.ceil(n_full * 0.25).long())
    assert torch.equal(runner.prefill(prep, Plan()).logits, full.logits)


def test_fingerprint_and_router_checkpoint_are_built_once(demo, monkeypatch):
    import trimvlm.depth.base as base
    from trimvlm.plan import make_plan
    from trimvlm.router import model as router_model

    seen = []
    real = base._fingerprint
    monkeypatch.setattr(base, "_fingerprint", lambda adapter: seen.append(1) or real(adapter))
    base._FINGERPRINTS.pop(demo.adapter.model, None)
    router_model._read_router.cache_clear()
    plans = [make_plan("router=demo:token_keep=0.5:layers_skip=1", demo.runner) for _ in range(3)]
    assert len(seen) == 1
    assert router_model._read_router.cache_info().misses == 1
    assert all(p.hook is not None for p in plans)


@pytest.mark.parametrize("family", AVAILABLE)
def test_collate_equals_preparing_together(tiny_adapter, family):
    """Requests prepared alone and collated are the batch prepared at once (a server prepares once)."""
    adapter = tiny_adapter(family)
    images, prompts = ragged_batch()
    images[2] = images[2] + [random_image(9, (64, 64))]  # a sample with two images
    together = adapter.prepare(images, prompts)
    parts = adapter.collate([adapter.prepare([im], [p]) for im, p in zip(images, prompts, strict=True)])
    assert torch.equal(parts.input_ids, together.input_ids)
    assert torch.equal(parts.attention_mask, together.attention_mask)
    assert parts.model_inputs.keys() == together.model_inputs.keys()
    for k, v in together.model_inputs.items():
        assert torch.equal(parts.model_inputs[k], v) if isinstance(v, torch.Tensor) else parts.model_inputs[k] == v
    assert (parts.n_images, parts.tiles, parts.image_keys) == (together.n_images, together.tiles, together.image_keys)
