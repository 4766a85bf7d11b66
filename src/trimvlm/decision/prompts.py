"""A request -> its prompts, by transformers' own utilities (nothing here rewrites them):
`parse_questions` checks the questions, `DecisionConfig.prepare_inputs` renders and tokenizes one prompt per
question (or one for all, when the template reads `questions`) with the model's processor and drops the
sentinels, giving the marks; `label_token_ids` gives the label tokens a plain VLM is read at.

`prepare_request` is the CPU half of `decide` (no model forward): a server checks and tokenizes each request
as it arrives, then answers a batch of them with `decide.run`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from trimvlm.decision.config import resolve_config
from trimvlm.decision.errors import AssetError, DecisionError, QuestionError
from trimvlm.decision.limits import Limits
from trimvlm.decision.request import parse_request
from trimvlm.errors import InputError


@dataclass
class Prompt:
    """One rendered prompt: `inputs` the processor's tensors (a batch of one; sentinels and marks dropped),
    `marks` [n] the tokens before each `<|mark|>` (question j is read at token marks[j] - 1), `questions`
    transformers' `Question`s read in it (template order), `label_ids` per question its labels' token ids
    (plain VLMs; None for a decision head)."""

    inputs: dict[str, Any]
    marks: torch.Tensor
    questions: list
    label_ids: list[list[int]] | None

    @property
    def tokens(self) -> int:
        return int(self.inputs["input_ids"].shape[-1])


@dataclass
class PreparedRequest:
    """One checked request, tokenized: what a batch forward needs, and what it cost to get here."""

    prompts: list[Prompt]
    config: Any  # the DecisionConfig it was prepared with (its temperatures are applied after the forward)
    seconds: float = 0.0  # time spent parsing, decoding images and tokenizing
    names: list[str] = field(default_factory=list)  # question names, in answer order

    @property
    def input_tokens(self) -> int:
        return sum(p.tokens for p in self.prompts)

    @property
    def questions(self) -> int:
        return sum(len(p.questions) for p in self.prompts)


def prepare_request(vlm, request, *, decision_config=None, limits: Limits | None = None) -> PreparedRequest:
    """Check one System One request and tokenize its prompts (raises a `DecisionError` subclass, never a deep
    library error)."""
    from jinja2.exceptions import TemplateError
    from transformers.decision import label_token_ids, parse_questions

    t0 = time.perf_counter()
    limits = limits or Limits()
    config = resolve_config(vlm, decision_config)
    req = parse_request(request, limits)
    try:
        questions = parse_questions(req["questions"], config)
    except ValueError as e:
        raise QuestionError(str(e)) from e
    head = vlm.adapter.decision_head
    if head is not None:
        try:
            head.check(questions)
        except InputError as e:
            raise QuestionError(str(e)) from e
    proc = vlm.decision_processor
    if req["assets"] and getattr(proc, "image_processor", None) is None:
        raise AssetError("this model reads no images (a text-only backbone); send the request without assets")
    try:
        prompts = config.prepare_inputs(req, proc)
    except (ValueError, TypeError, TemplateError) as e:
        message = " ".join(str(e).split())[:400]
        if "image" in message.lower() and req["assets"]:
            raise AssetError(f"the images do not fit the prompt: {message}") from e
        raise DecisionError(f"the prompts could not be built from the decision config: {message}") from e
    tokenizer = getattr(proc, "tokenizer", proc)
    out = []
    for inputs, group in prompts:
        inputs = dict(inputs)
        marks = inputs.pop("marks")
        if len(marks) != len(group):
            raise DecisionError(
                f"the decision template wrote {len(marks)} <|mark|> for {len(group)} question(s) of one prompt; "
                "it must write one per question"
            )
        if int(marks.min()) < 1:
            raise DecisionError(
                "the decision template writes a <|mark|> before any token; one must precede it"
            )
        n = int(inputs["input_ids"].shape[-1])
        if limits.max_prompt_tokens is not None and n > limits.max_prompt_tokens:
            raise DecisionError(f"a prompt has {n} tokens, at most {limits.max_prompt_tokens}")
        check_context(vlm.adapter, inputs, group)
        try:
            ids = None if head is not None else [label_token_ids(tokenizer, tuple(q.labels)) for q in group]
        except ValueError as e:
            raise DecisionError(f"{e} Give labels that are single tokens of this model in the decision config "
                                "(`labels`)") from e
        out.append(Prompt(inputs=inputs, marks=marks, questions=list(group), label_ids=ids))
    names = [q.name for p in out for q in p.questions]
    return PreparedRequest(prompts=out, config=config, seconds=time.perf_counter() - t0, names=names)


def check_context(adapter, inputs: dict, group) -> None:
    """Refuse a prompt whose positions (M-RoPE: fewer than its tokens) run past the model's (`max_positions`)."""
    limit = adapter.max_positions
    if limit is None:
        return
    used = adapter.processed_positions(inputs)
    if used > limit:
        names = ", ".join(q.name for q in group)
        tokens = int(inputs["input_ids"].shape[-1])
        raise QuestionError(
            f"the prompt of question {names} takes {used:,} positions ({tokens:,} tokens), past this model's "
            f"{limit:,}; shorten its instructions or the state"
        )
