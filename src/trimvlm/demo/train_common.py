"""What the demo's one training loop (trimvlm.demo.train) and each task's training module share: the `Spec` a
task brings to the loop, the batch padding of both encoders (`Padding`) and the per-cell auxiliary loss through
the LM head (`aux_cell_loss`, read at decoder layer `AUX_POSITION_LAYER`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

AUX_POSITION_LAYER = 2
MID_CONTENT = True


class Look(NamedTuple):
    """Where the attention teacher points one answer position (`row`, position `at`), by layer role: the
    evidence key positions (`keys`, the "cells" layers), the question's attribute words (`words`), the right
    option's letter and words (`option`); where the next head looks at the "cells" and "words" layers (a second
    object: `second`, `second_words`) and at the "verdict" layers (a yes/no decided by matching: the asked word
    when it agrees with what was found, else the sink). An empty list asks nothing of those layers."""

    row: int
    at: int
    keys: Sequence[int]
    words: Sequence[int]
    option: Sequence[int]
    second: Sequence[int] = ()
    second_words: Sequence[int] = ()
    verdict: Sequence[int] = ()


class Ask(NamedTuple):
    """An existence or multiple-choice question's answer position (`row`, `at`) and the (colour, shape) pair
    classes it asks for (the pair probe's targets)."""

    row: int
    at: int
    pairs: list[int]


class Padding:
    """An encoder's batch padding: it reads the encoder's `pad` and `image_pad` ids."""

    def _pad(self, seqs, labs, left: bool, multiple: int = 1) -> dict:
        n = max(len(s) for s in seqs)
        n = -(-n // multiple) * multiple  # few distinct shapes: CPU kernels are planned once per shape
        ids = torch.full((len(seqs), n), self.pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), n), dtype=torch.long)
        labels = torch.full((len(seqs), n), -100, dtype=torch.long)
        for i, s in enumerate(seqs):
            sl = slice(n - len(s), n) if left else slice(0, len(s))
            ids[i, sl] = torch.tensor(s)
            mask[i, sl] = 1
            if labs is not None:
                labels[i, sl] = torch.tensor(labs[i])
        out = {
            "input_ids": ids,
            "attention_mask": mask,
            "mm_token_type_ids": (ids == self.image_pad).long(),
        }
        if labs is not None:
            out["labels"] = labels
        return out


def aux_cell_loss(model, out, targets: dict[str, torch.Tensor]) -> torch.Tensor:
    """Training-only dense supervision of the visual tokens through the model's own LM head.

    The logits at visual positions are never used to generate, so they are free to name the cell under
    each token (colour or glyph or "grey", and the shape); the hidden state after decoder layer
    `AUX_POSITION_LAYER`, read through the final norm and LM head, names the token's row and column words.
    This gives the vision tower a direct signal and puts the content and the coordinates of each cell in
    words the decoder already uses for questions and answers.
    """
    ce = torch.nn.functional.cross_entropy
    n = targets["content"].shape[1]
    vis = slice(1, 1 + n)  # right after <|vision_start|>
    logits = out.logits[:, vis].float()
    v = logits.shape[-1]
    loss = ce(logits.reshape(-1, v), targets["content"].reshape(-1))
    loss = loss + 0.5 * ce(logits.reshape(-1, v), targets["shape"].reshape(-1), ignore_index=-100)
    lm = model.model.language_model
    mid = model.lm_head(lm.norm(out.hidden_states[AUX_POSITION_LAYER][:, vis])).float()
    loss = loss + 0.5 * ce(mid.reshape(-1, v), targets["row"].reshape(-1))
    loss = loss + 0.5 * ce(mid.reshape(-1, v), targets["col"].reshape(-1))
    if MID_CONTENT:  # name the content there too, where the search by colour and shape reads its keys
        loss = loss + 0.5 * ce(mid.reshape(-1, v), targets["content"].reshape(-1))
        loss = loss + 0.25 * ce(mid.reshape(-1, v), targets["shape"].reshape(-1), ignore_index=-100)
    return loss


@dataclass(frozen=True)
class Spec:
    """What a demo task brings to the one training loop: its generator module (`split_rng`,
    `generate_split`), encoder, tokenizer, config builder, training samples, auxiliary loss, number of
    (colour, shape) pair classes for the probe, attention-teacher layers, image processor and the extra
    `trimvlm.json` entries of its checkpoint."""

    task: Any
    encoder: Callable[[], Any]
    tokenizer: Callable[[], Any]
    build_config: Callable[..., Any]
    train_samples: Callable[[np.random.Generator, int], list]
    aux_loss: Callable[..., torch.Tensor]
    n_pairs: int
    image_processor: Callable[[], Any]
    teacher: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
