"""What the demo's one training loop (trimvlm.demo.train) and each task's training module share: the `Spec` a
task brings to the loop, what both encoders share (`Encoder`) and the per-cell auxiliary loss through
the LM head (`aux_cell_loss`, read at decoder layer `AUX_POSITION_LAYER`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from trimvlm.demo.vocab import EOS, IMAGE_PAD, PAD, VISION_END, VISION_START
from trimvlm.scoring.trie import rows_tensor

AUX_POSITION_LAYER = 2
P_SINGLE_TURN = 0.2  # sequences cut to one turn: the exact evaluation format
PAD_MULTIPLE = 32


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


class Turn(NamedTuple):
    """One question of a training sequence: its sample, the sequence's `row` in the batch, where its prompt
    starts and the prompt's ids (the answer is predicted at `start + len(prompt) - 1`)."""

    sample: Any
    qa: Any
    row: int
    start: int
    prompt: list[int]

    @property
    def at(self) -> int:
        return self.start + len(self.prompt) - 1


class Ask(NamedTuple):
    """An existence or multiple-choice question's answer position (`row`, `at`) and the (colour, shape) pair
    classes it asks for (the pair probe's targets)."""

    row: int
    at: int
    pairs: list[int]


class Encoder:
    """What both tasks' encoders share: samples -> model inputs with the tokenizer's ids (no string
    tokenization), the turns of a training sequence, and the batch padding. A task's encoder writes `n_visual`
    (an image's visual tokens), `supervise` (one turn's teacher, probe and naming targets), `token_targets`."""

    def __init__(self, task, vocab: dict[str, int], processor, background: str):
        self.task, self.kinds, self.vocab, self.processor = task, task.KINDS, vocab, processor
        self.background = background  # the word a token showing nothing is named with
        self.pad, self.eos, self.image_pad = vocab[PAD], vocab[EOS], vocab[IMAGE_PAD]

    def span(self, n: int) -> list[int]:
        """The image's `n` visual tokens between <|vision_start|> and <|vision_end|>."""
        return [self.vocab[VISION_START]] + [self.image_pad] * n + [self.vocab[VISION_END]]

    def words(self, text: str) -> list[int]:
        return [self.vocab[w] for w in text.split()]

    def images(self, images):
        out = self.processor(images=images, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def turns(self, s, rng: np.random.Generator) -> list:
        """A sample's questions once each (a repeat could copy the earlier answer), shuffled; cut to one turn
        with probability P_SINGLE_TURN, else with the auxiliary turns last (no question can copy from them)."""
        seen: set[str] = set()
        qas = [q for q in s.qas if not (q.question in seen or seen.add(q.question))]
        aux = [q for q in qas if q.kind in self.task.AUX_KINDS]
        qas = [q for q in qas if q.kind not in self.task.AUX_KINDS]
        turns = [qas[int(i)] for i in rng.permutation(len(qas))]
        if rng.random() < P_SINGLE_TURN:
            return turns[:1]
        return turns + [aux[int(i)] for i in rng.permutation(len(aux))]

    def train_batch(self, samples, rng: np.random.Generator) -> dict:
        """Padded training inputs; the loss is on answer tokens and their end token. "looks" lists the
        teacher's `Look`s, "asks" the pair probe's `Ask`s, "names" what a task's positions name mid-way."""
        seqs, labs, looks, asks, names = [], [], [], [], []
        for s in samples:
            ids = self.span(self.n_visual(s.image))
            lab = [-100] * len(ids)
            for q in self.turns(s, rng):
                prompt = self.words(self.task.format_prompt(q.question))
                ans = self.words(q.answer) + [self.eos]
                start = len(ids)
                ids += prompt
                self.supervise(Turn(s, q, len(seqs), start, prompt), looks, asks, names)
                ids += ans
                lab += [-100] * len(prompt) + ans
            seqs.append(ids)
            labs.append(lab)
        batch = self._pad(seqs, labs, left=False, multiple=PAD_MULTIPLE)
        batch["pixel_values"], batch["image_grid_thw"] = self.images([s.image for s in samples])
        batch["looks"], batch["asks"], batch["names"] = looks, asks, names
        return batch

    def prompt_batch(self, items) -> dict:
        """items: list of (image, question); left-padded for generation."""
        seqs = [self.span(self.n_visual(im)) + self.words(self.task.format_prompt(q)) for im, q in items]
        batch = self._pad(seqs, None, left=True)
        batch["pixel_values"], batch["image_grid_thw"] = self.images([im for im, _ in items])
        return batch

    def cell_targets(self, samples) -> dict[str, torch.Tensor]:
        """Each sample's `token_targets` as [samples, tokens] tensors, -100 past an image's tokens."""
        per = [self.token_targets(s.scene) for s in samples]
        n = max(len(t["content"]) for t in per)
        return {k: rows_tensor([t[k] for t in per], -100, left=False, width=n) for k in per[0]}

    def _pad(self, seqs, labs, left: bool, multiple: int = 1) -> dict:
        n = max(len(s) for s in seqs)
        n = -(-n // multiple) * multiple  # few distinct shapes: CPU kernels are planned once per shape
        ids = rows_tensor(seqs, self.pad, left, width=n)
        out = {"input_ids": ids, "attention_mask": rows_tensor([[1] * len(s) for s in seqs], 0, left, width=n),
               "mm_token_type_ids": (ids == self.image_pad).long()}  # fmt: skip
        if labs is not None:
            out["labels"] = rows_tensor(labs, -100, left, width=n)
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
    # name the content there too, where the search by colour and shape reads its keys
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
