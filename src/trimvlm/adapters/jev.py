"""Decision-model checkpoints: transformers' `JevForDecision` (a backbone and a verbalizer head).

The backbone (`JevForDecision.model`, e.g. a Qwen3.5 VL `Qwen3_5Model` or a text-only `Qwen3_5TextModel`) runs
through the adapter of its own family, which sees it through `DecisionBackbone`: the object that family's
adapter expects in place of an `XForConditionalGeneration` (`.model`, `.config`, dtype, device, embeddings).
There is no LM head: a decision model is read by its head (`JevHead`), so `generate` and `score` refuse it.

`JevHead` reads the head as `JevForDecision.forward` does, written here from its definition (trimvlm runs the
backbone, so the head is applied to the hidden states trimvlm computed): the final-normed hidden state at the
token before each `<|mark|>`, through `proj` (one row per verbalizer, in the weights' dtype), soft-capped
(`softcap * tanh(x / softcap)`) when the config has a softcap; the options of a question are the rows from the
offset of its type on, in order. The temperature processors come after, from the decision config
(`transformers.decision.modeling_utils.process_scores`, called by trimvlm.decision).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

from trimvlm.adapters import adapter_for
from trimvlm.errors import CheckpointError, InputError, UnsupportedModelError

# text-only backbone configs -> the family whose adapter runs them (its text stack, without images)
TEXT_BACKBONES = {"qwen3_5_text": "qwen3_5"}
DECISION_MODEL_TYPES = ("jev",)


def is_decision_checkpoint(folder: Path) -> bool:
    """A `JevForDecision` saved by transformers (`model_type` "jev"), or a checkpoint that ships a JEV head next to
    its weights (`head.safetensors` with the head's config files, read by `JevForDecision.from_pretrained`)."""
    try:
        data = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if data.get("model_type") in DECISION_MODEL_TYPES or "JevForDecision" in (
        data.get("architectures") or []
    ):
        return True
    from transformers import JevConfig

    return (folder / "head.safetensors").exists() and any(
        (folder / f).exists() for f in JevConfig.extra_config_files
    )


class DecisionBackbone:
    """What a family's adapter reads of an `XForConditionalGeneration`, over a decision model's backbone."""

    def __init__(self, decision_model):
        self.decision_model = decision_model
        backbone, cfg = decision_model.model, decision_model.config.text_config
        self.text_only = not hasattr(backbone, "language_model")
        if self.text_only:
            self.model = SimpleNamespace(language_model=backbone)
            self.config = SimpleNamespace(
                text_config=cfg, model_type=cfg.model_type, image_token_id=-1,
            )  # fmt: skip
        else:
            self.model, self.config = backbone, cfg
        self.generation_config = SimpleNamespace(eos_token_id=None)

    @property
    def device(self) -> torch.device:
        return self.decision_model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decision_model.dtype

    def get_input_embeddings(self):
        return self.decision_model.get_input_embeddings()

    @property
    def lm_head(self):
        raise UnsupportedModelError(
            "this checkpoint is a decision model (JevForDecision): it has no LM head to generate or score "
            "candidates with; ask it System One requests with vlm.decide / `trimvlm decide`"
        )


class JevHead:
    """The verbalizer head of a `JevForDecision`, applied to hidden states trimvlm computed."""

    def __init__(self, decision_model):
        self.proj = decision_model.proj
        self.softcap = decision_model.config.softcap
        self.offsets = dict(decision_model.config.offsets)
        self.num_verbalizers = decision_model.config.num_verbalizers

    def check(self, questions) -> None:
        """Every question's options fit in the head's rows (transformers' forward fails deep in torch if not)."""
        for q in questions:
            start = self.offsets[q.type]
            if start + len(q.options) > self.num_verbalizers:
                raise InputError(
                    f"question {q.name!r}: this decision head scores at most {self.num_verbalizers - start} "
                    f"options for a {q.type} question (rows {start}..{self.num_verbalizers - 1}), got "
                    f"{len(q.options)}"
                )

    def flops(self, rows: int) -> int:
        return 2 * rows * self.proj.in_features * self.proj.out_features

    def scores(self, hidden: torch.Tensor, questions) -> list[torch.Tensor]:
        """hidden [M, D]: the final-normed state before the mark of each of M questions -> per question the
        scores of its options (before the decision config's temperature)."""
        logits = self.proj(hidden.to(self.proj.weight.dtype))
        if self.softcap is not None:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return [logits[j, self.offsets[q.type] :][: len(q.options)] for j, q in enumerate(questions)]


def load_decision_adapter(folder: Path, dtype: torch.dtype, device: torch.device):
    """A `JevForDecision` checkpoint -> the adapter of its backbone's family, with the head and decision config."""
    from transformers import AutoImageProcessor, AutoTokenizer, JevForDecision

    try:
        model = JevForDecision.from_pretrained(folder, dtype=dtype).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{folder} is not a complete JevForDecision checkpoint (model, tokenizer): {e}"
        ) from e
    cfg = model.config.text_config
    if (
        getattr(cfg, "is_causal", True) is False
        or getattr(getattr(cfg, "text_config", None), "is_causal", True) is False
    ):
        raise UnsupportedModelError(
            f"{folder}: its backbone attends non-causally; trimvlm's runner runs causal decoders only"
        )
    subfolder = model.decision_config.adapter
    if subfolder and (folder / subfolder).exists():
        raise UnsupportedModelError(
            f"{folder}: its decision config loads a LoRA from {subfolder}/, which trimvlm does not apply; merge "
            "the LoRA into the weights (peft's merge_and_unload) and save the merged model"
        )
    family = TEXT_BACKBONES.get(cfg.model_type, cfg.model_type)
    adapter_cls = adapter_for(family)
    backbone = DecisionBackbone(model)
    image_processor = None
    if not backbone.text_only:
        try:
            image_processor = AutoImageProcessor.from_pretrained(folder, backend="pil")
        except OSError as e:
            raise CheckpointError(
                f"{folder}: the backbone reads images but no image processor is saved: {e}"
            ) from e
    adapter = adapter_cls(backbone, tokenizer, image_processor, folder=folder)
    adapter.decision_head = JevHead(model)
    adapter.decision_config = model.decision_config
    return adapter
