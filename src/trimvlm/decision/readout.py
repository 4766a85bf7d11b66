"""Option scores from the states read at the marks, then transformers' own steps to the answers.

- A decision model (`adapter.decision_head`, e.g. JEV's verbalizer head): its head on those states.
- Any other VLM: the LM head's logits of the options' label tokens there, as `DecisionPipeline` does for models
  that are not decision models (it computes the whole vocabulary at those rows and indexes the labels; here
  only the label rows of the head's weight are multiplied: the same numbers, fewer FLOPs).

Then `process_scores` (the decision config's temperature per question type) and `Question.answer` on the
softmax, both transformers'.
"""

from __future__ import annotations

import torch

from trimvlm.decision.costs import grouped


def option_scores(vlm, prompts: list, hidden: torch.Tensor, meter) -> list[list[torch.Tensor]]:
    """Per prompt, per question, the raw option scores; the readout's FLOPs go on the meter's prefill line."""
    ad = vlm.adapter
    questions = [q for p in prompts for q in p.questions]
    head = ad.decision_head
    if head is not None:
        meter.add("prefill", head.flops(hidden.shape[0]))
        flat = head.scores(hidden, questions)
    else:
        ids = sorted({i for p in prompts for qids in p.label_ids for i in qids})
        column = {t: c for c, t in enumerate(ids)}
        meter.add("prefill", 2 * hidden.shape[0] * hidden.shape[-1] * len(ids))
        logits = ad.lm_head_rows(hidden, ids)
        flat = [logits[j, [column[t] for t in qids]] for j, qids in enumerate(q for p in prompts for q in p.label_ids)]
    return grouped(flat, [len(p.questions) for p in prompts])


def answers(config, prompts: list, scores: list[list[torch.Tensor]]) -> dict:
    """One request's answers keyed by question name (in prompt order, as the pipeline's `postprocess`)."""
    from transformers.decision.modeling_utils import process_scores

    out = {}
    for p, s in zip(prompts, scores, strict=True):
        processed = process_scores(config, p.inputs["input_ids"], p.marks, p.questions, s)
        out |= {q.name: q.answer(x.softmax(-1).tolist()) for q, x in zip(p.questions, processed, strict=True)}
    return out
