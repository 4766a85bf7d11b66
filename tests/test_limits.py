"""Limits are checked, never passed silently: a prompt, a token budget or a decision prompt past the model's
positions is refused with a one-line error before any model work; the demo decision template keeps a request's
state text. The positions are the real ones (M-RoPE: an image takes fewer positions than tokens)."""

import pytest
import torch
from conftest import ragged_batch

import trimvlm
from trimvlm.decision import QuestionError
from trimvlm.errors import InputError
from trimvlm.runtime.limits import check_generation
from trimvlm.runtime.runner import Runner
from trimvlm.testing import random_image


@pytest.fixture(autouse=True)
def _one():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def demo():
    return trimvlm.load("demo")


@pytest.fixture
def model_work(monkeypatch):
    """Counts the calls that start any model work on a VLM (embedding a batch, embedding new tokens)."""
    calls = []

    def spy(vlm):
        for name in ("embed", "embed_tokens"):
            real = getattr(vlm.adapter, name)
            monkeypatch.setattr(
                vlm.adapter, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k)
            )
        return calls

    return spy


def _refused(excinfo, *parts):
    message = str(excinfo.value)
    assert "\n" not in message
    for part in parts:
        assert part in message, message


def test_generate_refuses_a_prompt_past_the_positions(demo, model_work):
    calls = model_work(demo)
    assert demo.adapter.max_positions == 1024
    with pytest.raises(InputError) as e:
        demo.generate(None, "red " * 12_000, max_new_tokens=4)
    _refused(e, "the prompt (12,", "exceeds this model's 1,024 positions", "shorten the prompt")
    assert calls == []  # nothing embedded, nothing generated


def test_generate_refuses_max_new_tokens_past_the_positions_left(demo, model_work):
    calls = model_work(demo)
    prompt = "is there a red circle ?"
    used = int(demo.adapter.next_positions(demo.prepare(None, prompt))[0])
    with pytest.raises(InputError) as e:
        demo.generate(None, prompt, max_new_tokens=1024 - used + 1)
    _refused(e, f"+ max_new_tokens {1024 - used + 1:,} exceeds this model's 1,024 positions",
             f"lower max_new_tokens to at most {1024 - used:,}")  # fmt: skip
    assert calls == []
    assert demo.generate(None, prompt, max_new_tokens=2).tokens  # within the limit it answers


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5", "llava"])
def test_next_positions_are_the_runners(tiny_adapter, family):
    """The limit source: the positions the adapter computes before any model work are the prefill's."""
    adapter = tiny_adapter(family)
    prep = adapter.prepare(*ragged_batch())
    nxt = adapter.next_positions(prep)
    assert torch.equal(nxt, Runner(adapter).prefill(prep).next_pos)
    tokens = prep.attention_mask.sum(-1)
    assert bool((nxt < tokens).all()) if family != "llava" else torch.equal(nxt, tokens)  # M-RoPE: fewer


def test_generation_limit_reads_positions_not_tokens(tiny_adapter, monkeypatch):
    """On M-RoPE a batch whose tokens + budget exceed the limit but whose positions do not is answered; one
    position more is refused, naming the prompt of the batch."""
    adapter = tiny_adapter("qwen3_vl")
    prep = adapter.prepare(*ragged_batch())
    used = adapter.next_positions(prep)
    row = int(used.argmax())
    monkeypatch.setattr(adapter.text_config, "max_position_embeddings", int(used.max()) + 3)
    assert int(prep.attention_mask[row].sum()) + 3 > adapter.max_positions
    check_generation(adapter, prep, 3)
    with pytest.raises(InputError) as e:
        check_generation(adapter, prep, 4)
    _refused(e, f"prompt {row} (", f"{int(used.max()):,} positions) + max_new_tokens 4")


def test_decide_refuses_instructions_past_the_context(demo, model_work):
    calls = model_work(demo)
    long = {"type": "noul", "instructions": "is there a red circle " * 300}
    with pytest.raises(QuestionError) as e:
        demo.decide({"state": "<a>", "questions": {"short": {"type": "noul"}, "long": long},
                     "assets": {"<a>": random_image(0, (64, 64))}})  # fmt: skip
    _refused(e, "question long takes 1,", "past this model's 1,024", "shorten its instructions")
    assert calls == []


def test_decision_positions_are_the_runners(demo):
    """A decision prompt's positions, from the processor's output on the host, equal its prefill's."""
    from trimvlm.decision.prompts import prepare_request

    req = {"state": "<a> and <b>", "questions": {"n": {"type": "noul", "instructions": "is there a red circle ?"}},
           "assets": {"<a>": random_image(1, (64, 64)), "<b>": random_image(2, (96, 64))}}  # fmt: skip
    inputs = prepare_request(demo, req).prompts[0].inputs
    used = demo.adapter.processed_positions(inputs)
    assert used < inputs["input_ids"].shape[-1]
    assert used == int(demo.runner.prefill(demo.adapter.prepare_processed([inputs])).next_pos[0])


def test_demo_template_keeps_the_state_text(demo):
    """The state's text reaches the prompt (in order, after its images), and the answers are still
    DecisionPipeline's with the same config."""
    from test_decide import pipeline

    from trimvlm.decision.prompts import prepare_request
    from trimvlm.testing.decisions import assert_same_answers

    question = {"c": {"type": "noul", "instructions": "is there a red circle ?"}}
    req = {"state": {"note": "blue square <a>", "more": ["red", "circle"]}, "questions": question,
           "assets": {"<a>": random_image(3, (64, 64))}}  # fmt: skip
    ids = prepare_request(demo, req).prompts[0].inputs["input_ids"][0].tolist()
    text = demo.adapter.tokenizer.decode(ids).split("<|vision_end|>")[-1].split()
    assert text[:4] == ["blue", "square", "red", "circle"] and text[4:7] == ["is", "there", "a"]
    assert_same_answers(demo.decide(req), pipeline(demo)(req))
    plain = prepare_request(demo, {"state": {"photo": "<a>"}, "questions": question, "assets": req["assets"]})
    words = demo.adapter.tokenizer.decode(plain.prompts[0].inputs["input_ids"][0].tolist())
    assert words.split("<|vision_end|>")[-1].split()[:2] == ["is", "there"]  # images only: as before
