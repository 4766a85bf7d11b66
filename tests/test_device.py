"""The GPU path: everything the runner creates is made on the model's device, in its dtype.

No GPU is needed to prove the device half: the model and its inputs stay on the CPU while torch's default
device is `meta`, so any tensor the runner, a method or a readout creates without an explicit `device=` lands
on meta, and the run fails (meta tensors hold no data) or its results change. Every run must pass and give
exactly the results of the same run without the default device. Preprocessing (image processor, tokenizer)
builds its tensors on the host by design (`adapters.base.on_host`) and hands the batch to the model's device.

Families: Qwen3-VL (deepstack), Qwen3.5 (hybrid: Gated DeltaNet layers), LLaVA, and the tiled Idefics3 and
InternVL. Qwen2.5-VL is left out: transformers' own vision tower (`get_vision_window_index`) makes its
window index with a device-less `torch.arange`, which is right on CUDA (a CPU index into a CUDA tensor is
allowed) but cannot run under a meta default device.
"""

import contextlib

import pytest
import torch
from conftest import AVAILABLE, ragged_batch

from trimvlm.errors import RecipeError
from trimvlm.plan import make_plan
from trimvlm.scoring.request import ScoreRequest

FAMILIES = [f for f in ("qwen3_vl", "qwen3_5", "llava", "idefics3", "internvl") if f in AVAILABLE]
RECIPES = [
    "",
    "tokens=density:keep=0.5:layer=1",
    "tokens=fastv:keep=0.5:layer=1",
    "tokens=random:keep=0.5",
    "tokens=tome:keep=0.5",
    "tokens=dart:keep=0.5",
    "tokens=prumerge:keep=0.5",
    "tokens=visionzip:keep=0.5",
    "kv=snapkv:keep=0.25",
    "kv=snapkv:keep=0.25:per_head=true",
    "kv=h2o:keep=0.25",
    "kv=random:keep=0.5",
    "kv=density:keep=0.25",
    "tokens=density:keep=0.5:layer=1,kv=density:keep=0.25",
    "depth=tail:budget=1:scope=all",
]
EXECUTORS = ["independent", "batched", "segments", "tree", "tree-merged"]
CANDIDATES = [["red", "red circle", "blue"], ["two three four", "two three five", "one"], ["yes", "yes no"]]


@contextlib.contextmanager
def meta_default():
    """torch's default device is `meta` inside: a device-less factory call makes a tensor without data."""
    with torch.device("meta"):
        yield


def _applies(vlm, recipe) -> bool:
    """Whether the recipe fits this tiny model (methods reading attention need an attention layer at L-1)."""
    try:
        make_plan(recipe, vlm.runner)
    except RecipeError:
        return False
    return True


def _same_generation(a, b):
    assert a.tokens == b.tokens
    assert a.texts == b.texts
    assert dict(a.costs.flops) == dict(b.costs.flops)
    assert dict(a.costs.method_flops) == dict(b.costs.method_flops)
    assert (a.costs.kv_bytes, a.costs.kv_bytes_peak) == (b.costs.kv_bytes, b.costs.kv_bytes_peak)


@pytest.mark.parametrize("family", FAMILIES)
def test_prepare_builds_on_the_host_and_hands_over_to_the_model_device(vlms, family):
    vlm = vlms(family)
    images, prompts = ragged_batch()
    with meta_default():
        prep = vlm.prepare(images, prompts)
    tensors = [prep.input_ids, prep.attention_mask]
    tensors += [v for v in prep.model_inputs.values() if isinstance(v, torch.Tensor)]
    assert all(t.device == vlm.adapter.device for t in tensors)
    assert prep.model_inputs["pixel_values"].dtype == vlm.adapter.model.dtype


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_makes_every_tensor_on_the_model_device(vlms, family):
    vlm = vlms(family)
    images, prompts = ragged_batch()
    ran = 0
    for recipe in RECIPES:
        if not _applies(vlm, recipe):
            continue
        ref = vlm.generate(images, prompts, recipe=recipe, max_new_tokens=3)
        with meta_default():
            got = vlm.generate(images, prompts, recipe=recipe, max_new_tokens=3)
        _same_generation(ref, got)
        ran += 1
    assert ran >= 9
    # seeded sampling: the generator lives on the model's device
    ref = vlm.generate(images, prompts, max_new_tokens=3, temperature=1.0, top_p=0.9, seed=5)
    with meta_default():
        got = vlm.generate(images, prompts, max_new_tokens=3, temperature=1.0, top_p=0.9, seed=5)
    _same_generation(ref, got)


def _logits(batch) -> list[list[float]]:
    return [r.logits for r in batch.results]


def _max_diff(a, b) -> float:
    pairs = zip(_logits(a), _logits(b), strict=True)
    return max(abs(x - y) for la, lb in pairs for x, y in zip(la, lb, strict=True))


@pytest.mark.parametrize("family", FAMILIES)
def test_score_makes_every_tensor_on_the_model_device(vlms, family, merged_tree):
    vlm = vlms(family)
    images, prompts = ragged_batch()
    reqs = [ScoreRequest(images[i], prompts[i], c) for i, c in enumerate(CANDIDATES)]
    for recipe in [None, "tokens=density:keep=0.5:layer=1"]:
        base = vlm.score(reqs, readout="loglik", executor="independent", recipe=recipe)
        for ex in EXECUTORS:
            ref = vlm.score(reqs, readout="loglik", executor=ex, recipe=recipe)
            with meta_default():
                got = vlm.score(reqs, readout="loglik", executor=ex, recipe=recipe)
            assert _logits(got) == _logits(ref), (family, ex, recipe)
            assert [r.chosen for r in got.results] == [r.chosen for r in ref.results]
            assert got.tokens == ref.tokens
            assert _max_diff(got, base) <= 1e-4, (family, ex, recipe)


def test_head_readout_on_the_model_device():
    """The demo model's decision head, loaded lazily inside the meta region, still holds its weights."""
    import trimvlm
    from trimvlm.testing import random_image

    reqs = [ScoreRequest(random_image(4, (64, 64)), "how many blue ?", ["0", "1", "2", "3"])]
    ref = trimvlm.load("demo").score(reqs, readout="head", executor="batched")
    vlm = trimvlm.load("demo")
    with meta_default():
        got = vlm.score(reqs, readout="head", executor="batched")
    assert next(vlm.head.parameters()).device == vlm.adapter.device
    assert got[0].logits == ref[0].logits and got[0].abstain_logit == ref[0].abstain_logit


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5", "idefics3"])
def test_bfloat16_runs_generate_and_score(tiny_dir, family):
    """bf16 weights: the masks, merges and states the runner makes follow the model's dtype; KV is half."""
    import trimvlm

    if family not in AVAILABLE:
        pytest.skip(f"no tiny {family}")
    vlm = trimvlm.load(tiny_dir(family), dtype=torch.bfloat16)
    fp32 = trimvlm.load(tiny_dir(family))
    images, prompts = ragged_batch()
    for recipe in ["", "tokens=density:keep=0.5:layer=1", "tokens=tome:keep=0.5", "kv=snapkv:keep=0.25",
                   "tokens=density:keep=0.5:layer=1:size_weighted=true,kv=density:keep=0.25"]:  # fmt: skip
        out = vlm.generate(images, prompts, recipe=recipe, max_new_tokens=3)
        assert len(out.texts) == 3 and all(isinstance(t, str) for t in out.texts)
        assert all(len(t) >= 1 for t in out.tokens)
        ref = fp32.generate(images, prompts, recipe=recipe, max_new_tokens=1)
        assert 2 * out.costs.kv_bytes == ref.costs.kv_bytes
    reqs = [ScoreRequest(images[i], prompts[i], c) for i, c in enumerate(CANDIDATES)]
    base = vlm.score(reqs, executor="independent")
    for ex in ["batched", "segments", "tree"]:
        got = vlm.score(reqs, executor=ex)
        assert _max_diff(got, base) <= 5e-2, (family, ex)
