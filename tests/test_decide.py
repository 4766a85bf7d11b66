"""`vlm.decide` answers System One requests as transformers' `DecisionPipeline` does (invariant 1), batched
across questions and requests (invariant 4), with recipes that lower the cost (invariant 5); decision-model
checkpoints (`JevForDecision`) load by path and are read through their head."""

import numpy as np
import pytest
import torch

import trimvlm
from trimvlm.testing import random_image
from trimvlm.testing.decisions import DEMO_QUESTIONS
from trimvlm.testing.decisions import assert_same_answers as assert_same


@pytest.fixture(autouse=True)
def _one():
    torch.set_num_threads(1)


def scene(seed: int, size: int = 128):
    from trimvlm.demo.task import make_scene, render

    im = render(make_scene(np.random.default_rng(seed)))
    return im if size == 128 else im.resize((size, size))


def pipeline(vlm, decision_config=None):
    """transformers' DecisionPipeline over the same weights: a fresh processor (own tokenizer copy), and for a
    decision model the model transformers itself loads from the folder."""
    from transformers import JevForDecision
    from transformers.pipelines import DecisionPipeline

    from trimvlm.decision.config import resolve_config

    proc = vlm.adapter.decision_processor()
    images = getattr(proc, "image_processor", None) is not None
    if vlm.adapter.decision_head is not None:
        model = JevForDecision.from_pretrained(vlm.adapter.folder).eval()
        cfg = None if decision_config is None else resolve_config(vlm, decision_config)
    else:
        model, cfg = vlm.adapter.model, resolve_config(vlm, decision_config)
    return DecisionPipeline(
        model=model, tokenizer=getattr(proc, "tokenizer", proc), processor=proc if images else None,
        decision_config=cfg,
    )  # fmt: skip


@pytest.fixture(scope="module")
def demo():
    return trimvlm.load("demo")


@pytest.fixture(scope="module")
def jev(tmp_path_factory):
    from trimvlm.testing.tiny_jev import tiny_jev

    made = {}

    def get(vision: bool):
        if vision not in made:
            made[vision] = trimvlm.load(tiny_jev(tmp_path_factory.mktemp(f"jev{int(vision)}"), vision=vision))
        return made[vision]

    return get


def jev_request(vision: bool, image_seed: int = 3, size=(64, 96), n: int = 3):
    questions = {
        "spam": {"type": "noul", "instructions": "spam ?", "criteria": {"true": "spam message", "false": None}},
        "tone": {"type": "choice", "instructions": "tone ?", "criteria": {"calm": "calm", "angry": None, "x": "urgent"}},
        "urgency": {"type": "score", "instructions": "urgent ?", "criteria": ["later", "week", "today"]},
        "again": {"type": "noul", "instructions": "calm message ?"},
    }  # fmt: skip
    req = {"state": {"message": "calm message <img>" if vision else "calm message"},
           "questions": dict(list(questions.items())[:n])}  # fmt: skip
    if vision:
        req["assets"] = {"<img>": random_image(image_seed, size)}
    return req


def test_demo_equals_pipeline_with_images(demo):
    req = {"state": {"photo": "<img>"}, "questions": DEMO_QUESTIONS, "assets": {"<img>": scene(0)}}
    ref = pipeline(demo)(req)
    got = demo.decide(req)
    assert_same(got, ref)
    assert got["circle"]["noul"] > 0.9 and got["yellow"]["score"] == pytest.approx(2, abs=0.1)  # trained demo


@pytest.mark.parametrize("vision", [False, True], ids=["text", "vl"])
def test_jev_equals_pipeline(jev, vision):
    vlm = jev(vision)
    assert vlm.adapter.decision_head is not None and vlm.adapter.decision_config.temperature
    req = jev_request(vision, n=4)
    assert_same(vlm.decide(req), pipeline(vlm)(req))


def test_one_prompt_for_all_questions(demo):
    """A template that reads `questions`: one prompt, a mark after each question, read mid-sequence."""
    from trimvlm.decision.demo_template import DEMO_LABELS

    template = (
        "{%- for part in state if part is mapping -%}<|vision_start|><|image_pad|><|vision_end|>{%- endfor -%}"
        "{%- for q in questions -%}{{ q.instructions }}{% if q.type == 'choice' %}{% for o in q.options %} "
        "{{ q.labels[loop.index0] }} {{ q.descriptions[loop.index0] or o }}{% endfor %}{% endif %} <ans><|mark|> "
        "{% endfor -%}"
    )
    cfg = {"labels": DEMO_LABELS, "chat_template": template}
    req = {"state": "<img>", "questions": DEMO_QUESTIONS, "assets": {"<img>": scene(1)}}
    got = demo.decide(req, decision_config=cfg, return_costs=True)
    assert got.usage[0].prompts == 1 and got.usage[0].questions == 3
    assert_same(got.answers[0], pipeline(demo, cfg)(req))


def test_batch_equals_each_alone(demo):
    """Requests with different question counts, image counts and sizes (and none) in one batch."""
    q = DEMO_QUESTIONS
    reqs = [
        {"state": "<a>", "questions": {"which": q["which"]}, "assets": {"<a>": scene(2)}},
        {
            "state": {"left": "<a>", "right": "<b>"},
            "questions": q,
            "assets": {"<a>": scene(3, 96), "<b>": scene(4)},
        },
        {"state": "no image here", "questions": {"yellow": q["yellow"], "circle": q["circle"]}},
    ]
    batch = demo.decide(reqs, return_costs=True)
    assert [u.prompts for u in batch.usage] == [1, 3, 2] and batch.usage[0].batch_prompts == 6
    assert [u.images for u in batch.usage] == [1, 6, 0]
    for r, got in zip(reqs, batch.answers, strict=True):
        assert_same(got, demo.decide(r), tol=1e-5)


def test_batch_equals_each_alone_hybrid_jev(jev):
    """Qwen3.5 (Gated DeltaNet layers): left padding across prompts of different lengths and images."""
    vlm = jev(True)
    reqs = [jev_request(True, 5, (64, 64), n=1), jev_request(True, 6, (96, 128), n=3)]
    reqs[1]["state"] = {"message": "angry message that is urgent today <img>"}
    batch = vlm.decide(reqs)
    for r, got in zip(reqs, batch, strict=True):
        assert_same(got, vlm.decide(r))


def test_costs_sum_to_the_batch(demo):
    reqs = [
        {"state": "<a>", "questions": DEMO_QUESTIONS, "assets": {"<a>": scene(5)}},
        {"state": "text", "questions": {"c": DEMO_QUESTIONS["circle"]}},
    ]
    res = demo.decide(reqs, return_costs=True)
    c = res.costs
    assert sum(u.model_flops for u in res.usage) == c.model_flops
    assert sum(u.kv_bytes for u in res.usage) == c.kv_bytes > 0
    assert res.usage[1].vision_flops == 0 < res.usage[0].vision_flops
    alone = demo.decide(reqs[0], return_costs=True).usage[0]
    assert alone.vision_flops == res.usage[0].vision_flops
    # input tokens: transformers serve's count (the prompts' tokens, sentinels dropped)
    pipe = pipeline(demo)
    prompts = pipe.preprocess(reqs[0])["prompts"]
    assert res.usage[0].input_tokens == sum(x["input_ids"].shape[-1] for x, _ in prompts)
    usage = res.usage[0].usage()
    assert (
        usage["output_tokens"] == 0
        and usage["latency_s"] > 0
        and usage["total_flops"] >= usage["model_flops"]
    )


def test_empty_recipe_equals_no_recipe(demo):
    req = {"state": "<a>", "questions": DEMO_QUESTIONS, "assets": {"<a>": scene(6)}}
    base = demo.decide(req)
    for recipe in ("", "baseline", trimvlm.Recipe(), {}):
        assert demo.decide(req, recipe=recipe) == base


@pytest.mark.parametrize("recipe", ["tokens=random:keep=0.25", "tokens=density:keep=0.25:layer=1"])
def test_token_reduction_lowers_flops(demo, recipe):
    req = {"state": "<a>", "questions": DEMO_QUESTIONS, "assets": {"<a>": scene(7)}}
    base = demo.decide(req, return_costs=True)
    cut = demo.decide(req, recipe=recipe, return_costs=True)
    assert cut.recipe == recipe
    # 64 of the prompt's visual tokens kept 16 from layer 0 (random) or 1 (density) of 6; the three questions'
    # tails (not reduced) run as branches off the one shared prefix
    assert cut.usage[0].layer_flops < 0.7 * base.usage[0].layer_flops
    assert cut.usage[0].total_flops < base.usage[0].total_flops
    assert cut.costs.kv_bytes < base.costs.kv_bytes
    assert list(cut.answers[0]) == list(base.answers[0])
    for a in cut.answers[0].values():
        probs = a.get("probabilities", {"t": a.get("noul", 0.5)})
        assert all(0 <= p <= 1 for p in probs.values())


def test_depth_plan_skips_layers(jev):
    vlm = jev(True)
    req = jev_request(True)
    base = vlm.decide(req, return_costs=True)
    cut = vlm.decide(req, recipe="depth=skip:layers=1", return_costs=True)
    assert cut.costs.layers_run["prefill"] == base.costs.layers_run["prefill"] - 1
    assert cut.usage[0].layer_flops < base.usage[0].layer_flops


def test_jev_checkpoint_detected_and_guarded(jev):
    from trimvlm.errors import UnsupportedModelError

    vlm = jev(False)
    assert vlm.info()["decision_head"] == "JevHead"
    with pytest.raises(UnsupportedModelError, match="decision model"):
        vlm.generate(None, "what is the colour")
    with pytest.raises(UnsupportedModelError, match="decision model"):
        vlm.score(None, "what is the colour", ["red", "blue"])


@pytest.mark.parametrize(
    "recipe",
    ["tokens=density:keep=0.25:layer=2", "tokens=fastv:keep=0.25:layer=2", "tokens=visionzip:keep=0.25:layer=0",
     "tokens=random:keep=0.5", "tokens=divprune:keep=0.25:layer=1"],
)  # fmt: skip
def test_recipe_batch_equals_each_alone(demo, recipe):
    """Every token reducer runs on decision batches (visual tokens of the assets' images; text-only rows are
    left alone) and gives each request what it gives it alone."""
    q = DEMO_QUESTIONS
    reqs = [
        {
            "state": {"left": "<a>", "right": "<b>"},
            "questions": q,
            "assets": {"<a>": scene(8, 96), "<b>": scene(9)},
        },
        {"state": "text only", "questions": {"circle": q["circle"]}},
        {"state": "<a>", "questions": {"which": q["which"]}, "assets": {"<a>": scene(10)}},
    ]
    batch = demo.decide(reqs, recipe=recipe, return_costs=True)
    assert batch.costs.method_total_flops > 0 or recipe.startswith("tokens=random")
    for r, got in zip(reqs, batch.answers, strict=True):
        assert_same(got, demo.decide(r, recipe=recipe))


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl", "qwen3_5", "llava"])
def test_families_equal_pipeline_and_batch(vlms, family):
    """Label-logit readout on the tiny random models of every wired family: equal to DecisionPipeline, and a
    batch (two images of different sizes; a text-only request) equal to each request alone."""
    from trimvlm.decision.demo_template import DEMO_TEMPLATE

    vlm = vlms(family)
    marker = "<|vision_start|><|image_pad|><|vision_end|>"
    cfg = {
        "chat_template": DEMO_TEMPLATE.replace(marker, vlm.adapter.chat_image_marker),
        "labels": {
            "noul": ["yes", "no"],
            "choice": ["red", "green", "blue"],
            "score": ["one", "two", "three"],
        },
        "temperature": {"choice": 0.5},
    }
    req = {
        "state": "<a> and <b>",
        "questions": {
            "n": {"type": "noul", "instructions": "is there a red circle"},
            "c": {"type": "choice", "instructions": "which colour", "criteria": {"x": None, "y": "blue"}},
            "s": {"type": "score", "criteria": ["a", "b", "c"]},
        },
        "assets": {"<a>": random_image(1, (64, 64)), "<b>": random_image(2, (96, 64))},
    }
    got = vlm.decide(req, decision_config=cfg)
    assert_same(got, pipeline(vlm, cfg)(req))
    other = {"state": "what is the colour", "questions": {"n": req["questions"]["n"]}}
    batch = vlm.decide([other, req], decision_config=cfg)
    assert_same(batch[1], got)
    assert_same(batch[0], vlm.decide(other, decision_config=cfg))


def test_unwired_family_is_refused(vlms):
    from trimvlm.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="not wired for the idefics3 family"):
        vlms("idefics3").decide({"state": "x", "questions": {"n": {"type": "noul"}}})


def test_jev_release_format(tmp_path):
    """A checkpoint that ships its JEV head next to the backbone's weights (judge_config.json, head.safetensors,
    calibration.json) loads by path and answers as transformers' JevForDecision."""
    import dataclasses

    from transformers import JevForDecision
    from transformers.pipelines import DecisionPipeline

    from trimvlm.testing.tiny_jev import tiny_jev_judge

    folder = tiny_jev_judge(tmp_path / "judge")
    vlm = trimvlm.load(folder)
    assert vlm.info()["decision_head"] == "JevHead"
    assert vlm.adapter.decision_config.labels["choice"] == ["red", "green", "blue", "black"]
    req = {
        "state": {"message": "what is the colour"},
        "questions": {
            "n": {"type": "noul", "instructions": "red"},
            "c": {"type": "choice", "criteria": {"x": None, "y": "blue", "z": "red"}},
            "s": {"type": "score", "criteria": ["a", "b", "c"]},
        },
    }
    model = JevForDecision.from_pretrained(folder).eval()
    # its decision config names a LoRA subfolder; this checkpoint has none (merged), so the pipeline loads none
    cfg = dataclasses.replace(model.decision_config, adapter=None)
    proc = vlm.adapter.decision_processor()
    ref = DecisionPipeline(model=model, tokenizer=proc.tokenizer, processor=proc, decision_config=cfg)(req)
    assert_same(vlm.decide(req), ref)
    (folder / "adapter").mkdir()
    from trimvlm.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="LoRA"):
        trimvlm.load(folder)


def test_questions_share_their_request_prefix_and_equal_the_unshared_forward(demo):
    """A request's prompts (one per question, each starting with the image) encode the image and the common
    prefix once; every question's state equals the plain per-prompt forward's."""
    from trimvlm.decision import prepare_request
    from trimvlm.decision.forward import run_prompts
    from trimvlm.decision.shared import prefix_cuts, run_shared
    from trimvlm.plan import make_plan
    from trimvlm.runtime.meter import Meter

    reqs = [{"state": "<a>", "questions": DEMO_QUESTIONS, "assets": {"<a>": scene(7)}},
            {"state": "<b>", "questions": {"c": DEMO_QUESTIONS["circle"]}, "assets": {"<b>": scene(8, 96)}}]  # fmt: skip
    prepared = [prepare_request(demo, r) for r in reqs]
    groups = [r.prompts for r in prepared]
    cuts = prefix_cuts(demo, groups)
    assert cuts is not None and all(c > 64 for c in cuts)  # past every one of the image's tokens
    plan = make_plan("", demo.runner)
    shared = run_shared(demo, groups, cuts, plan, Meter())
    plain = run_prompts(demo, [p for g in groups for p in g], plan, Meter())
    assert torch.allclose(shared.hidden, plain.hidden, atol=1e-5)
    assert shared.layer_flops < plain.layer_flops and shared.prepared.batch == 2
    res = demo.decide(reqs[0], return_costs=True)
    one = demo.runner.vision_flops(demo.adapter.prepare_processed([prepared[0].prompts[0].inputs]))
    assert res.usage[0].vision_flops == one  # the image is encoded once for its three questions


def test_per_request_layer_plans_run_on_the_shared_prefix(demo):
    """A per-sample layer plan (the router's kind) on the shared-prefix path: each request's prefix and its
    question tails skip that request's layers, and every state equals the plain forward with the plan repeated
    for the request's prompts."""
    from trimvlm.decision import prepare_request
    from trimvlm.decision.forward import run_prompts
    from trimvlm.decision.shared import prefix_cuts, run_shared
    from trimvlm.runtime.meter import Meter
    from trimvlm.runtime.plan import Plan

    reqs = [{"state": "<a>", "questions": DEMO_QUESTIONS, "assets": {"<a>": scene(7)}},
            {"state": "<b>", "questions": {"c": DEMO_QUESTIONS["circle"]}, "assets": {"<b>": scene(8, 96)}}]  # fmt: skip
    groups = [prepare_request(demo, r).prompts for r in reqs]
    skip = torch.zeros(2, demo.runner.num_layers, dtype=torch.bool)
    skip[0, 1], skip[1, 2] = True, True
    shared = run_shared(demo, groups, prefix_cuts(demo, groups), Plan(skip_prefill=skip), Meter())
    per_prompt = skip.repeat_interleave(torch.tensor([len(g) for g in groups]), dim=0)
    plain = run_prompts(demo, [p for g in groups for p in g], Plan(skip_prefill=per_prompt), Meter())
    none = run_prompts(demo, [p for g in groups for p in g], Plan(), Meter())
    assert torch.allclose(shared.hidden, plain.hidden, atol=1e-4)
    assert not torch.allclose(shared.hidden, none.hidden, atol=1e-3)  # the layers were really skipped


def test_router_decisions_take_the_shared_prefix_path(demo, monkeypatch):
    """`router=` in decide runs on the same shared-prefix path as its baseline: one prefix row per request,
    the router choosing each request's layout on its prefix (fewer FLOPs), and a batch answers each request as
    alone."""
    reqs = [{"state": "<a>", "questions": DEMO_QUESTIONS, "assets": {"<a>": scene(11)}},
            {"state": "<b>", "questions": DEMO_QUESTIONS, "assets": {"<b>": scene(12, 96)}}]  # fmt: skip
    real = demo.runner.prefill
    base = demo.decide(reqs, return_costs=True)
    # the router's own per-request layers, and the plain recipe (its recorded variant: a token method, no skip)
    for recipe in ("router=demo:budget=0.7:select=router:price=auto", "router=demo:budget=0.7"):
        rows = []
        monkeypatch.setattr(demo.runner, "prefill",
                            lambda prep, *a, rows=rows, **kw: rows.append(prep.batch) or real(prep, *a, **kw))  # fmt: skip
        batch = demo.decide(reqs, recipe=recipe, return_costs=True)
        assert rows == [2], recipe  # two requests of three questions each: two prefix rows, questions as branches
        assert batch.costs.total_flops < 0.9 * base.costs.total_flops
        for r, got in zip(reqs, batch.answers, strict=True):
            assert_same(got, demo.decide(r, recipe=recipe))
