"""What a demo model's training scaffolds have reached, logged with every validation (`train_log.jsonl`,
`"scaffolds"`), so that a run whose answers stay near chance says where the chain breaks:

- `content_objects`: share of the visual tokens that show an object or a glyph whose LM-head logits name it
  (argmax over the words the scaffold names tokens with: colours, glyphs, the background word);
- `pair_objects`: share of the tokens that carry a (colour, shape) pair target (the tokens showing an object)
  whose pair probe names it;
- `teacher_keys` / `teacher_sink`: at the answer position, the attention mass of the teacher's head on the
  question's evidence tokens and on the sink, averaged over the teacher's "cells" layers and over the questions
  that have evidence (the target puts 1 / (k + 1) on each of k keys and the sink).

Computed on a few validation images, with its own random stream (the training stream is not touched), in eval
mode with gradients on (the teacher's attention function records weights only then) and no backward pass.
"""

from __future__ import annotations

import numpy as np
import torch

HEALTH_IMAGES = 8


def scaffold_health(run, enc, samples, aux_layer: int) -> dict[str, float | None]:
    """The four figures above for `samples` (the run's model, teacher and probe as they are now)."""
    model, teacher, probe = run.model, run.teacher, run.probe
    batch = enc.train_batch(samples, np.random.default_rng(0))
    looks = batch.pop("looks")
    del batch["asks"], batch["names"]
    was_training = model.training
    model.eval()
    if teacher is not None and teacher.rows_only:
        teacher.expect(looks)
    try:
        with torch.enable_grad():
            out = model(**batch, output_hidden_states=True)
    finally:
        model.train(was_training)
        if teacher is not None:
            teacher.query = None
    weights = {}
    if teacher is not None:
        weights, teacher.weights = teacher.weights, {}
    with torch.no_grad():
        targets = enc.cell_targets(samples)
        keys, sink = _teacher_mass(teacher, weights, looks)
        return {
            "content_objects": _content_accuracy(out.logits, targets["content"], enc),
            "pair_objects": _pair_accuracy(model, probe, out, targets["pair"], aux_layer),
            "teacher_keys": keys,
            "teacher_sink": sink,
        }


def _content_accuracy(logits: torch.Tensor, content: torch.Tensor, enc) -> float | None:
    n = content.shape[1]
    words = torch.unique(content[content >= 0])
    background = enc.vocab[enc.background]
    shown = (content >= 0) & (content != background)
    if not bool(shown.any()):
        return None
    named = words[logits[:, 1 : 1 + n][..., words].argmax(-1)]
    return float((named == content)[shown].float().mean())


def _pair_accuracy(model, probe, out, pair: torch.Tensor, aux_layer: int) -> float | None:
    if probe is None:
        return None
    carried = (pair >= 0) & (pair != probe.n_pairs)
    if not bool(carried.any()):
        return None
    h = model.model.language_model.norm(out.hidden_states[aux_layer])[:, 1 : 1 + pair.shape[1]]
    return float((probe.linear(h).argmax(-1) == pair)[carried].float().mean())


def _teacher_mass(teacher, weights: dict, looks) -> tuple[float | None, float | None]:
    layers = [layer for layer in weights if teacher.roles[layer] == "cells"] if teacher is not None else []
    rows = [i for i, look in enumerate(looks) if look.keys]
    if not layers or not rows:
        return None, None
    at = torch.tensor([look.row for look in looks]), torch.tensor([look.at for look in looks])
    keys, sink = [], []
    for layer in layers:
        w = teacher.weights_of(weights[layer], *at, teacher.head)
        keys += [float(w[i, list(looks[i].keys)].sum()) for i in rows]
        sink += [float(w[i, 0]) for i in rows]
    return float(np.mean(keys)), float(np.mean(sink))
