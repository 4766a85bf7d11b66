"""Tiny random-weight `JevForDecision` checkpoints, built offline from configs (tests, benchmarks).

The backbone's config is the tiny Qwen3.5 of `trimvlm.testing` (VL, or its text part alone); the head's
weights are drawn wider than transformers' init so that the option probabilities are far from uniform (an
equality test on near-uniform probabilities would prove little). The decision config saved with it has
temperatures per question type, so its logits processors are exercised.
"""

from __future__ import annotations

from pathlib import Path

import torch

# words of the JEV prompt and of the test requests, so that they are not all <unk>
JEV_WORDS = ["[", "]", "]:", ")", ":", "kind", "state", "options", "decision", "noul", "choice", "score", "true",
             "false", "calm", "angry", "spam", "urgent", "today", "week", "later", "message"]  # fmt: skip
TEMPERATURES = {"noul": 0.7, "choice": 1.3, "score": 2.0}


def tiny_jev(folder: str | Path, *, vision: bool = False, softcap: float | None = 5.0, seed: int = 0,
             layers: int = 4, hidden: int = 64) -> Path:  # fmt: skip
    """Write a `JevForDecision` over a tiny Qwen3.5 (with its vision tower when `vision`) to `folder`. Its
    template: JEV's own (text only) or, with `vision`, the demo's (images first)."""
    from transformers import JevConfig, JevForDecision
    from transformers.decision import DecisionConfig
    from transformers.models.jev.configuration_jev import JEV_TEMPLATE

    from trimvlm.decision.demo_template import DEMO_TEMPLATE
    from trimvlm.testing import builder, word_tokenizer

    folder = Path(folder)
    torch.manual_seed(seed)
    tok = word_tokenizer(JEV_WORDS)
    backbone, image_processor = builder("qwen3_5")(tok, hidden, layers, 4, 2, 32, 1)
    text_config = backbone.config if vision else backbone.config.text_config
    config = JevConfig(text_config=text_config.to_dict(), hidden_size=hidden, softcap=softcap)
    model = JevForDecision(config).eval()
    with torch.no_grad():
        torch.nn.init.normal_(model.proj.weight, std=0.5)
        torch.nn.init.normal_(model.proj.bias, std=0.5)
    model.decision_config = DecisionConfig(
        temperature=dict(TEMPERATURES),
        chat_template=DEMO_TEMPLATE if vision else JEV_TEMPLATE,
        noul_options=["false", "true"],
    )
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    if vision:
        image_processor.save_pretrained(folder)
    return folder


def tiny_jev_judge(folder: str | Path, *, seed: int = 0, softcap: float = 4.0) -> Path:
    """A checkpoint in the format of the JEV releases (e.g. autotrust/JEV-9B): the backbone's own checkpoint (a
    tiny Qwen3.5 `XForConditionalGeneration`, its `config.json`) with the head next to it: `head.safetensors`
    (the projection's weight), `judge_config.json` (the verbalizer slots and their ranges per question type,
    the softcap) and `calibration.json` (temperatures). `JevForDecision.from_pretrained` reads it."""
    import json

    from safetensors.torch import save_file

    from trimvlm.testing import tiny_checkpoint

    folder = tiny_checkpoint("qwen3_5", folder, seed=seed)
    verbalizers = ["yes", "no", "one", "two", "three", "red", "green", "blue", "black"]
    ranges = {"noul": [0, 2], "score": [2, 5], "choice": [5, 9]}
    generator = torch.Generator().manual_seed(seed)
    hidden = json.loads((folder / "config.json").read_text())["text_config"]["hidden_size"]
    weight = torch.randn(len(verbalizers), hidden, generator=generator) * 0.5
    save_file({"weight": weight}, str(folder / "head.safetensors"))
    slots = {"verbalizers": verbalizers, "num_slots": len(verbalizers), "ranges": ranges}
    (folder / "judge_config.json").write_text(json.dumps({"slots": slots, "softcap": softcap}))
    (folder / "calibration.json").write_text(json.dumps({"per_kind": dict(TEMPERATURES)}))
    return folder
