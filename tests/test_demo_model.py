"""The shipped demo checkpoint: loads offline through trimvlm and transformers, and trimvlm's runner + harness
reproduce the accuracy transformers' own generate recorded for it (within 2 points, same 200 items)."""

import json

import pytest

import trimvlm
from trimvlm.loading import DEMO_DIR

FOLDER = DEMO_DIR / "qwen3vl"
pytestmark = pytest.mark.skipif(not (FOLDER / "config.json").exists(), reason="demo checkpoint not shipped")


def test_loads_through_transformers_from_pretrained():
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(FOLDER)
    tok = AutoTokenizer.from_pretrained(FOLDER)
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert model.config.text_config.num_hidden_layers >= 6
    assert tok.convert_tokens_to_ids("<|image_pad|>") == model.config.image_token_id


def test_runner_reproduces_the_recorded_accuracy():
    from trimvlm.evals.run import run_eval
    from trimvlm.evals.tasks import demo_task

    ref = json.loads((FOLDER / "trimvlm.json").read_text())["reference"]
    vlm = trimvlm.load("demo")
    assert vlm.adapter.visual_tokens(128, 128) >= 64
    task = demo_task(limit=ref["items"], seed=ref["seed"])
    res = run_eval(vlm, task, [None], limit=ref["items"], batch_size=50, seed=0, progress=False, warmup=False)
    overall = res.row("baseline", "all")["accuracy"]
    assert abs(overall - ref["overall"]) <= 0.02, (overall, ref["overall"])
