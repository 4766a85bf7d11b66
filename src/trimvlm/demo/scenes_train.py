"""Train demo-scenes: a 12-layer Qwen2.5-VL on the scenes task, with the demo's one training loop
(`train.train_demo`, seeded and resumable) and the scenes task's encoder and scaffolds.

What differs from the grid task: every sequence has its own visual span (160 to 400 tokens), and an object
covers many tokens, so the scaffolds name one token per object, its anchor (the token holding its centre);
docs/demo.md (demo-scenes) says what each scaffold names and where. None of this is in the saved model, a plain
`Qwen2_5_VLForConditionalGeneration`.

    trimvlm train-demo --task scenes --out src/trimvlm/demo/checkpoints/scenes --steps 11000 --threads 2
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from trimvlm.demo import scenes
from trimvlm.demo.model import build_image_processor, build_scenes_config
from trimvlm.demo.train_common import AUX_POSITION_LAYER, Ask, Encoder, Look, Spec, Turn, aux_cell_loss
from trimvlm.demo.vocab import build_tokenizer, build_vocab

TRAIN_TURNS = {"exist": 2, "count": 2, "color": 1, "relation": 2, "largest": 1, "read": 1}
RELATION_LAYER = 7  # after the teacher's object layers (2-4) and two more: where a relation is named
SEEN_PIXELS = 64  # a token shows an object when a quarter of its pixels do
N_PAIRS = len(scenes.COLOR_NAMES) * len(scenes.SHAPES)


class RelationName(NamedTuple):
    """A relation question's answer position (`row`, `at`) and the word of the relation that holds."""

    row: int
    at: int
    word: int


def pair_class(color: str, shape: str) -> int:
    return scenes.COLOR_NAMES.index(color) * len(scenes.SHAPES) + scenes.SHAPES.index(shape)


def glyph_keys(scene: scenes.Scene) -> list[list[int]]:
    """Per glyph of the text, in reading order, the sequence positions of its visual tokens (1 + raster index)."""
    n, tokens = scene.glyph_scale**2, scene.text_tokens()  # a glyph's tokens in a row
    return [[1 + r * scene.cols + c for r, c, _ in tokens[a : a + n]] for a in range(0, len(tokens), n)]


def relation_truth(scene: scenes.Scene, params: dict) -> str:
    """The relation that holds between a relation question's two objects on the axis it asks about."""
    a, b = (next(o for o in scene.objects if o.name == params[k]) for k in ("a", "b"))
    if params["rel"] in ("left", "right"):
        return "left" if a.cx < b.cx else "right"
    return "above" if a.cy < b.cy else "below"


def scenes_tokenizer():
    return build_tokenizer(scenes.vocabulary_words())


class ScenesEncoder(Encoder):
    """The scenes task's encoder: each image's own number of visual tokens."""

    def __init__(self):
        vocab = build_vocab(scenes.vocabulary_words())
        super().__init__(scenes, vocab, build_image_processor("scenes"), "background")
        self.attribute_ids = {self.vocab[w] for w in scenes.COLOR_NAMES + scenes.SHAPES}

    def n_visual(self, image) -> int:
        return (image.height // scenes.TOKEN_PX) * (image.width // scenes.TOKEN_PX)

    def _look(self, s, q, start: int, prompt: list[int]):
        """(keys for the teacher's first head, keys for its second head, option positions, pairs asked)."""
        anchor = {id(o): 1 + scenes.anchor_token(s.scene, o) for o in s.scene.objects}
        objs = scenes.evidence(s.scene, q.kind, q.params)
        second, option = [], []
        if q.kind == "read":
            keys = glyph_keys(s.scene)[0]
        elif q.kind == "relation":
            keys, second = [anchor[id(objs[0])]], [anchor[id(objs[1])]]
        elif q.kind == "largest":
            keys = [anchor[id(max(objs, key=lambda o: o.area))]]
            letter = start + prompt.index(self.vocab[q.answer])
            option = [letter, letter + 1, letter + 2]
        else:
            keys = [anchor[id(o)] for o in objs]
        if q.kind in ("exist", "count", "color"):  # every pair with the colour and shape named
            pairs = [pair_class(c, sh) for c in scenes.COLOR_NAMES for sh in scenes.SHAPES
                     if q.params.get("color") in (None, c) and q.params.get("shape") in (None, sh)]  # fmt: skip
        elif q.kind in ("relation", "largest"):
            pairs = [pair_class(o.color, o.shape) for o in objs]
        else:
            pairs = []
        return keys, second, option, pairs

    def supervise(self, turn: Turn, looks: list[Look], asks: list[Ask], names: list[RelationName]) -> None:
        """The teacher's `Look`s, the probe's `Ask` and a relation's `RelationName` for one turn."""
        s, q, start, prompt, row, at = turn.sample, turn.qa, turn.start, turn.prompt, turn.row, turn.at
        keys, second, option, pairs = self._look(s, q, start, prompt)
        words = [start + i for i, t in enumerate(prompt) if t in self.attribute_ids]
        second_words = []
        if q.kind == "relation" and len(words) == 4:  # a bag of four words cannot tell which colour goes with which shape,
            words, second_words = words[:2], words[2:]  # nor which object comes first: a head each
        verdict = []
        if q.kind == "relation":
            truth = relation_truth(s.scene, q.params)
            names.append(RelationName(row, at, self.vocab[truth]))
            asked = start + prompt.index(self.vocab[q.params["rel"]])
            verdict = [asked] if truth == q.params["rel"] else [0]  # yes: the asked word; no: the sink
        looks.append(Look(row, at, keys, words, option, second, second_words, verdict))
        if pairs:
            asks.append(Ask(row, at, pairs))
        if q.kind == "read":  # each later word (predicted at the word before it) looks at its glyph
            looks += [Look(row, at + j, glyph, [], []) for j, glyph in enumerate(glyph_keys(s.scene)) if j > 0]

    def token_targets(self, sc: scenes.Scene) -> dict[str, list[int]]:
        """Per visual token: content word, shape word, row and column words, pair class (of the object it shows;
        no pair on background and text), glyph on text tokens and size word at anchors."""
        v, m = self.vocab, sc.rows * sc.cols
        content, pair = [v[self.background]] * m, [N_PAIRS] * m
        shape, glyph, size = [-100] * m, [-100] * m, [-100] * m
        counts = scenes.object_pixels(sc)
        owner = np.where(counts.max(1) >= SEEN_PIXELS, counts.argmax(1), -1)  # per token the object it shows, or -1
        for t in np.flatnonzero(owner >= 0):
            o = sc.objects[owner[t]]
            content[t], shape[t], pair[t] = v[o.color], v[o.shape], pair_class(o.color, o.shape)
        for r, c, ch in sc.text_tokens():
            content[r * sc.cols + c], pair[r * sc.cols + c], glyph[r * sc.cols + c] = v[ch], N_PAIRS, v[ch]
        for o in sc.objects:
            size[scenes.anchor_token(sc, o)] = v[f"s{o.size}"]
        rows, cols = [v[f"r{t // sc.cols}"] for t in range(m)], [v[f"c{t % sc.cols}"] for t in range(m)]
        return {"content": content, "shape": shape, "row": rows, "col": cols, "pair": pair, "size": size, "glyph": glyph}


def train_samples(rng: np.random.Generator, n: int) -> list[scenes.Sample]:
    return [scenes.make_sample(rng, per_kind=TRAIN_TURNS) for _ in range(n)]


def scenes_aux_loss(model, out, targets: dict[str, torch.Tensor]) -> torch.Tensor:
    """The grid's per-token loss (content, shape, row, column) plus each anchor's size word at the key layer,
    each glyph token's glyph, and at a relation's answer position after `RELATION_LAYER` layers the relation
    that holds on the axis asked about (`relation_truth`: with both objects gathered, the comparison itself;
    the answer only says whether it is the one asked)."""
    loss = aux_cell_loss(model, out, targets)
    n = targets["size"].shape[1]
    lm = model.model.language_model
    mid = model.lm_head(lm.norm(out.hidden_states[AUX_POSITION_LAYER][:, 1 : 1 + n])).float()
    ce = torch.nn.functional.cross_entropy
    loss = loss + 0.5 * ce(mid.reshape(-1, mid.shape[-1]), targets["size"].reshape(-1))
    # glyph tokens are about 1% of the visual tokens, too few for the content term to teach reading: their own
    # mean, at the last layer and where the answer reads its keys
    glyph = targets["glyph"].reshape(-1)
    if bool((glyph >= 0).any()):
        final = out.logits[:, 1 : 1 + n].float()
        loss = loss + ce(final.reshape(-1, final.shape[-1]), glyph) + 0.5 * ce(mid.reshape(-1, mid.shape[-1]), glyph)
    names = targets.get("names") or []
    if names:  # a relation's answer position names the relation that holds, once both objects are gathered
        rows, pos = torch.tensor([x.row for x in names]), torch.tensor([x.at for x in names])
        words = torch.tensor([x.word for x in names])
        h = out.hidden_states[min(RELATION_LAYER, len(out.hidden_states) - 2)][rows, pos]  # (a small test model)
        loss = loss + ce(model.lm_head(lm.norm(h)).float(), words)
    return loss


SCENES_META = {
    "task": "scenes",
    "kinds": scenes.KINDS,
    "prompt_template": scenes.PROMPT_TEMPLATE,
    "image_size": None,
    "visual_tokens": [scenes.MIN_TOKENS, scenes.MAX_TOKENS],
}

SCENES_SPEC = Spec(
    task=scenes, encoder=ScenesEncoder, tokenizer=scenes_tokenizer,
    build_config=build_scenes_config, train_samples=train_samples,
    aux_loss=scenes_aux_loss, n_pairs=N_PAIRS, image_processor=lambda: build_image_processor("scenes"),
    teacher={"layers": (2, 3, 4), "word_layers": (1,), "option_layers": (5,), "verdict_layers": (RELATION_LAYER,),
             "rows_only": True}, meta=SCENES_META,
)  # fmt: skip
