"""The shipped demo checkpoints: load offline through trimvlm and transformers, and trimvlm's runner + harness
reproduce the accuracy transformers' own generate recorded for each (within 2 points, same 200 items)."""

import json

import pytest

import trimvlm
from trimvlm.loading import DEMO_DIR, DEMO_MODELS

SHIPPED = {
    "demo": "Qwen3VLForConditionalGeneration",
    "demo-qwen35": "Qwen3_5ForConditionalGeneration",
    "demo-scenes": "Qwen2_5_VLForConditionalGeneration",
}
CASES = [
    pytest.param(name, cls, marks=pytest.mark.skipif(
        not (DEMO_DIR / DEMO_MODELS[name] / "config.json").exists(), reason=f"{name} checkpoint not shipped"))
    for name, cls in SHIPPED.items()
]  # fmt: skip


def test_the_main_demo_checkpoint_is_shipped():
    assert (DEMO_DIR / DEMO_MODELS["demo"] / "config.json").exists()


@pytest.mark.parametrize("name,cls", CASES)
def test_loads_through_transformers_from_pretrained(name, cls):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    folder = DEMO_DIR / DEMO_MODELS[name]
    model = AutoModelForImageTextToText.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    assert type(model).__name__ == cls
    assert model.config.text_config.num_hidden_layers >= 6
    assert tok.convert_tokens_to_ids("<|image_pad|>") == model.config.image_token_id


@pytest.mark.parametrize("name,cls", CASES)
def test_runner_reproduces_the_recorded_accuracy(name, cls):
    from trimvlm.evals.run import run_eval
    from trimvlm.evals.tasks import get_task
    from trimvlm.loading import checkpoint_task

    ref = json.loads((DEMO_DIR / DEMO_MODELS[name] / "trimvlm.json").read_text())["reference"]
    vlm = trimvlm.load(name)
    assert vlm.adapter.visual_tokens(128, 128) >= 64
    task = get_task(checkpoint_task(name), limit=ref["items"], seed=ref["seed"], split="test")
    res = run_eval(vlm, task, [None], limit=ref["items"], batch_size=50, seed=0, progress=False, warmup=False)
    overall = res.row("baseline", "all")["accuracy"]
    assert abs(overall - ref["overall"]) <= 0.02, (overall, ref["overall"])
