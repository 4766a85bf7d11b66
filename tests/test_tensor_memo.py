"""runtime/tensor_memo.py and what decision/shared.py remembers with it: a request's prefix cut, its tails and
its prefix cache key, computed once for its tensors while they live unchanged."""

import numpy as np
import pytest
import torch

import trimvlm
from trimvlm.runtime.tensor_memo import remembered
from trimvlm.testing.decisions import DEMO_QUESTIONS


@pytest.fixture(autouse=True)
def _one():
    torch.set_num_threads(1)


def test_a_value_is_remembered_for_its_tensors_until_one_changes_or_is_freed():
    a, b = torch.arange(4), torch.ones(2)
    calls = []

    def f():
        calls.append(1)
        return len(calls)

    assert remembered("t", [a, b], f) == 1 and remembered("t", [a, b], f) == 1
    assert remembered("other tag", [a, b], f) == 2  # the tag is part of the key
    assert remembered("t", [a.clone(), b], f) == 3  # an equal copy is another tensor
    a.add_(1)  # written in place
    assert remembered("t", [a, b], f) == 4
    from trimvlm.runtime import tensor_memo

    n = len(tensor_memo._memo)
    del a
    assert len(tensor_memo._memo) < n  # forgotten with its tensor


def test_a_requests_cut_tails_and_prefix_key_are_computed_once_and_equal_a_fresh_computation(monkeypatch):
    from trimvlm.decision import prepare_request, shared
    from trimvlm.demo.task import make_scene, render
    from trimvlm.runtime.prefix_cache import PrefixCache

    demo = trimvlm.load("demo")
    image = render(make_scene(np.random.default_rng(7)))
    prompts = prepare_request(demo, {"state": "<a>", "questions": DEMO_QUESTIONS, "assets": {"<a>": image}}).prompts
    calls, real = [], shared.request_cut
    monkeypatch.setattr(shared, "request_cut", lambda p, image: calls.append(1) or real(p, image))
    cut = shared.prefix_cuts(demo, [prompts])
    assert shared.prefix_cuts(demo, [prompts]) == cut and len(calls) == 1
    assert cut == [real(prompts, int(demo.adapter.image_token_id))] and cut[0] > 64
    ids = [p.inputs["input_ids"].reshape(-1) for p in prompts]
    want = [tuple(x[cut[0] : int(p.marks.max())].tolist()) for x, p in zip(ids, prompts, strict=True)]
    assert shared.request_tails(prompts, cut[0]) == want == shared.request_tails(prompts, cut[0])
    key = PrefixCache.key("baseline", shared.prefix_inputs(prompts, cut[0]))
    assert shared.prefix_key("baseline", prompts, cut[0]) == key == shared.prefix_key("baseline", prompts, cut[0])
    assert shared.prefix_key("other", prompts, cut[0]) != key  # the recipe is part of the key
    prompts[0].inputs["input_ids"].add_(0)  # written in place (same values): its version changes
    assert shared.prefix_cuts(demo, [prompts]) == cut and len(calls) == 2
