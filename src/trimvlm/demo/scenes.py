"""The scenes task: images in the regime real VLM inputs live in, for the third demo model (`demo-scenes`).

An image is `h x w` visual tokens of `TOKEN_PX` pixels (patch 8, spatial merge 2), `h x w` between 160 and 400
and most often 256 (dynamic resolution, `SIZES`). Most of it is background that is smooth (a gradient) or
textured (faint stripes or a checker), and so redundant. On it lie 2 to 8 objects, each a coloured square,
circle, triangle or diamond 16 to 80 pixels across (one token to five), at any pixel offset, some of them
overlapping, plus a short string of 2 to 4 glyphs on a white box, each glyph one token or 2 x 2 tokens (the
box is aligned to the token grid). No two objects share both colour and shape, so "the red circle" names one.

Questions ask about objects, never about grid coordinates (`KINDS`): existence, count, the colour of the one
object of a shape, a spatial relation between two objects, the largest of 2 to 4 named objects (multiple
choice) and reading the text. Every answer is computed from the scene description (`Scene`), never from
pixels; the pixel maps (`label_map`) serve only the training scaffolds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageDraw

from trimvlm.demo import task as grid
from trimvlm.demo.task import GLYPH_CHARS, OPTION_LETTERS, QA, Sample, pick
from trimvlm.errors import InputError

TOKEN_PX = 16  # patch 8 x spatial merge 2
# (rows, cols) of visual tokens and their weights: 160 to 400 tokens, 256 most often.
SIZES: list[tuple[tuple[int, int], float]] = [
    ((16, 16), 4.0), ((14, 18), 1.0), ((18, 14), 1.0), ((15, 17), 1.0), ((17, 15), 1.0),
    ((12, 20), 0.5), ((20, 12), 0.5), ((10, 16), 0.5), ((16, 10), 0.5), ((13, 13), 0.5),
    ((18, 20), 0.5), ((20, 18), 0.5), ((20, 20), 0.5),
]  # fmt: skip
MIN_TOKENS = 160
MAX_TOKENS = 400

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (215, 40, 40),
    "green": (40, 165, 60),
    "blue": (45, 75, 220),
    "yellow": (235, 205, 35),
    "purple": (145, 55, 185),
}
COLOR_NAMES = list(COLORS)
SHAPES = ["square", "circle", "triangle", "diamond"]
AREA_FACTOR = {"square": 1.0, "circle": math.pi / 4, "triangle": 0.5, "diamond": 0.5}
OBJECT_SIZES = [16, 20, 24, 32, 40, 48, 64, 80]  # bounding-box side in pixels
MIN_OBJECTS, MAX_OBJECTS = 2, 8
RELATIONS = {"left": ("left", "of"), "right": ("right", "of"), "above": ("above",), "below": ("below",)}
RELATION_GAP = 24  # pixels between centres along the relation's axis
LARGEST_RATIO = 1.5  # the largest option's area over the second largest's

KINDS: dict[str, str] = {
    "exist": "prefill",
    "count": "prefill",
    "color": "prefill",
    "relation": "prefill",
    "largest": "prefill",
    "read": "full",
}
AUX_KINDS: dict[str, str] = {}
PROMPT_TEMPLATE = "{question} <ans>"


@dataclass
class Obj:
    color: str
    shape: str
    cx: int  # centre, pixels
    cy: int
    size: int  # bounding-box side, pixels

    @property
    def area(self) -> float:
        return AREA_FACTOR[self.shape] * self.size * self.size

    @property
    def name(self) -> str:
        return f"{self.color} {self.shape}"


@dataclass
class Scene:
    rows: int  # visual tokens
    cols: int
    background: dict  # {"kind": "gradient" | "stripes" | "checker", "a": rgb, "b": rgb, ...}
    objects: list[Obj]
    text: str
    text_row: int  # first token of the text box
    text_col: int
    glyph_scale: int  # tokens per glyph side (1 or 2)

    @property
    def width(self) -> int:
        return self.cols * TOKEN_PX

    @property
    def height(self) -> int:
        return self.rows * TOKEN_PX

    def text_tokens(self) -> list[tuple[int, int, str]]:
        """(row, col, glyph) of every token the text covers."""
        g = self.glyph_scale
        return [
            (self.text_row + dr, self.text_col + i * g + dc, ch)
            for i, ch in enumerate(self.text)
            for dr in range(g)
            for dc in range(g)
        ]

    def find(self, color: str | None = None, shape: str | None = None) -> list[Obj]:
        return [o for o in self.objects if color in (None, o.color) and shape in (None, o.shape)]


# --------------------------------------------------------------------------------------------- scenes


def _grey(rng: np.random.Generator, lo: int, hi: int) -> tuple[int, int, int]:
    v = int(rng.integers(lo, hi))
    tint = rng.integers(-6, 7, 3)
    return tuple(int(np.clip(v + t, 0, 255)) for t in tint)


class Box(NamedTuple):
    """A pixel box: left, top, right and bottom (exclusive)."""

    x0: int
    y0: int
    x1: int
    y1: int


def _bbox(o: Obj) -> Box:
    h = o.size // 2
    return Box(o.cx - h, o.cy - h, o.cx - h + o.size, o.cy - h + o.size)


def _overlap(a: Box, b: Box) -> int:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return max(0, w) * max(0, h)


def make_scene(rng: np.random.Generator) -> Scene:
    """A scene with at least two objects, one pair far enough apart for a relation, a shape present once."""
    while True:
        scene = _draw_scene(rng)
        objs = scene.objects
        if len(objs) >= MIN_OBJECTS and any(
            max(abs(a.cx - b.cx), abs(a.cy - b.cy)) >= RELATION_GAP for a in objs for b in objs
        ):
            return scene


def _draw_scene(rng: np.random.Generator) -> Scene:
    sizes, weights = zip(*SIZES, strict=True)
    p = np.array(weights) / sum(weights)
    rows, cols = sizes[int(rng.choice(len(sizes), p=p))]
    kind = pick(rng, ["gradient", "gradient", "stripes", "checker"])
    background = {"kind": kind, "a": _grey(rng, 95, 150), "b": _grey(rng, 150, 200),
                  "vertical": bool(rng.random() < 0.5), "period": int(pick(rng, [4, 6, 8]))}  # fmt: skip
    # the text: 2-4 glyphs, a glyph one token (or 2 x 2 tokens when it fits), the box on the token grid
    n_text = int(rng.integers(2, 5))
    scale = 2 if (rng.random() < 0.3 and n_text * 2 <= cols) else 1
    text = "".join(pick(rng, GLYPH_CHARS) for _ in range(n_text))
    text_row = int(rng.integers(0, rows - scale + 1))
    text_col = int(rng.integers(0, cols - n_text * scale + 1))
    text_box = Box(text_col * TOKEN_PX, text_row * TOKEN_PX,
                (text_col + n_text * scale) * TOKEN_PX, (text_row + scale) * TOKEN_PX)  # fmt: skip
    n_obj = int(rng.integers(MIN_OBJECTS, MAX_OBJECTS + 1))
    pairs = [(c, s) for c in COLOR_NAMES for s in SHAPES]
    order = rng.permutation(len(pairs))
    objects: list[Obj] = []
    for k in order:
        if len(objects) == n_obj:
            break
        color, shape = pairs[int(k)]
        for _ in range(40):  # a place that leaves every object mostly visible and its centre token its own
            size = int(pick(rng, OBJECT_SIZES))
            h = size // 2
            o = Obj(color, shape, int(rng.integers(h, cols * TOKEN_PX - size + h + 1)),
                    int(rng.integers(h, rows * TOKEN_PX - size + h + 1)), size)  # fmt: skip
            box = _bbox(o)
            if _overlap(box, text_box) > 0:
                continue
            if any(_overlap(box, _bbox(q)) > 0.25 * min(o.size, q.size) ** 2 for q in objects):
                continue
            if any(_token_of(o) == _token_of(q) for q in objects):
                continue
            objects.append(o)
            break
    if not [s for s in SHAPES if len([o for o in objects if o.shape == s]) == 1]:
        # the colour question needs a shape present once: the last object takes a shape nobody has
        last = objects[-1]
        free = [s for s in SHAPES if not any(o.shape == s for o in objects)]
        if free:
            last.shape = free[0]
        else:  # every shape present more than once: drop objects of the last one's shape but it
            objects = [o for o in objects if o.shape != last.shape or o is last]
    return Scene(rows=rows, cols=cols, background=background, objects=objects, text=text,
                 text_row=text_row, text_col=text_col, glyph_scale=scale)  # fmt: skip


def _token_of(o: Obj) -> tuple[int, int]:
    return o.cy // TOKEN_PX, o.cx // TOKEN_PX


def _draw_shape(d: ImageDraw.ImageDraw, o: Obj, fill) -> None:
    x0, y0, x1, y1 = _bbox(o)
    x1, y1 = x1 - 1, y1 - 1
    if o.shape == "square":
        d.rectangle([x0, y0, x1, y1], fill=fill)
    elif o.shape == "circle":
        d.ellipse([x0, y0, x1, y1], fill=fill)
    elif o.shape == "triangle":
        d.polygon([(o.cx, y0), (x1, y1), (x0, y1)], fill=fill)
    else:
        d.polygon([(o.cx, y0), (x1, o.cy), (o.cx, y1), (x0, o.cy)], fill=fill)


def _background(scene: Scene) -> Image.Image:
    bg = scene.background
    w, h = scene.width, scene.height
    a, b = np.array(bg["a"], dtype=np.float32), np.array(bg["b"], dtype=np.float32)
    if bg["kind"] == "gradient":
        t = np.linspace(0.0, 1.0, h if bg["vertical"] else w, dtype=np.float32)
        line = a[None] * (1 - t[:, None]) + b[None] * t[:, None]
        arr = np.broadcast_to(line[:, None] if bg["vertical"] else line[None], (h, w, 3))
    else:
        yy, xx = np.mgrid[0:h, 0:w]
        per = bg["period"]
        if bg["kind"] == "stripes":
            on = ((yy if bg["vertical"] else xx) // (per // 2)) % 2 == 0
        else:
            on = ((yy // per) + (xx // per)) % 2 == 0
        mid = (a + b) / 2
        arr = np.where(on[..., None], mid + 10, mid - 10)
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB")


def render(scene: Scene) -> Image.Image:
    img = _background(scene)
    d = ImageDraw.Draw(img)
    for o in scene.objects:
        _draw_shape(d, o, COLORS[o.color])
    grid.draw_glyphs(d, scene.text, scene.text_col * TOKEN_PX, scene.text_row * TOKEN_PX, scene.glyph_scale)
    return img


def label_map(scene: Scene) -> np.ndarray:
    """[height, width] int: 0 background, k + 1 where object k is the one seen (later objects on top)."""
    img = Image.new("I", (scene.width, scene.height), 0)
    d = ImageDraw.Draw(img)
    for k, o in enumerate(scene.objects):
        _draw_shape(d, o, k + 1)
    return np.asarray(img, dtype=np.int32)


def object_pixels(scene: Scene) -> np.ndarray:
    """[tokens, objects] int: per visual token (raster order), the pixels of each object seen in it."""
    lab = label_map(scene).reshape(scene.rows, TOKEN_PX, scene.cols, TOKEN_PX).transpose(0, 2, 1, 3)
    lab = lab.reshape(scene.rows * scene.cols, TOKEN_PX * TOKEN_PX)
    return np.stack([(lab == k + 1).sum(1) for k in range(len(scene.objects))], 1)


def object_tokens(scene: Scene, min_pixels: int = 32) -> list[list[int]]:
    """Per object, the visual tokens (raster order) where at least `min_pixels` of it are seen."""
    return [np.flatnonzero(seen >= min_pixels).tolist() for seen in object_pixels(scene).T]


def anchor_token(scene: Scene, o: Obj) -> int:
    """The visual token (raster index) holding the object's centre."""
    r, c = _token_of(o)
    return r * scene.cols + c


# --------------------------------------------------------------------------------------------- answers


def _relation_holds(a: Obj, b: Obj, rel: str) -> bool:
    return {"left": a.cx < b.cx, "right": a.cx > b.cx, "above": a.cy < b.cy, "below": a.cy > b.cy}[rel]


def _named(scene: Scene, name: str) -> Obj:
    color, shape = name.split()
    hits = scene.find(color, shape)
    if len(hits) != 1:
        raise ValueError(f"{name!r} does not name exactly one object of the scene")
    return hits[0]


def answer_for(scene: Scene, kind: str, params: dict) -> str:
    """Recompute the answer of a question from the scene description alone."""
    if kind == "exist":
        return "yes" if scene.find(params["color"], params["shape"]) else "no"
    if kind == "count":
        return str(len(scene.find(params.get("color"), params.get("shape"))))
    if kind == "color":
        hits = scene.find(shape=params["shape"])
        if len(hits) != 1:
            raise ValueError("a colour question names a shape present exactly once")
        return hits[0].color
    if kind == "relation":
        return "yes" if _relation_holds(_named(scene, params["a"]), _named(scene, params["b"]), params["rel"]) else "no"
    if kind == "largest":
        areas = [_named(scene, n).area for n in params["options"]]
        return OPTION_LETTERS[int(np.argmax(areas))]
    if kind == "read":
        return " ".join(scene.text)
    raise InputError(f"unknown scenes question kind {kind!r}; allowed: {', '.join(KINDS)}")


def evidence(scene: Scene, kind: str, params: dict) -> list[Obj]:
    """The objects a reader must look at to answer (empty: nothing matches; the text is not an object)."""
    if kind in ("exist", "count"):
        return scene.find(params.get("color"), params.get("shape"))
    if kind == "color":
        return scene.find(shape=params["shape"])
    if kind == "relation":
        return [_named(scene, params["a"]), _named(scene, params["b"])]
    if kind == "largest":
        return [_named(scene, n) for n in params["options"]]
    if kind == "read":
        return []
    raise InputError(f"unknown scenes question kind {kind!r}; allowed: {', '.join(KINDS)}")


def question_text(kind: str, params: dict) -> str:
    if kind == "exist":
        return f"is there a {params['color']} {params['shape']} ?"
    if kind == "count":
        what = params.get("color") or params.get("shape")
        return f"how many {what} ?"
    if kind == "color":
        return f"what color is the {params['shape']} ?"
    if kind == "relation":
        return f"is the {params['a']} {' '.join(RELATIONS[params['rel']])} the {params['b']} ?"
    if kind == "largest":
        opts = " ".join(f"{L} {n}" for L, n in zip(OPTION_LETTERS, params["options"], strict=False))
        return f"which is largest ? {opts}"
    if kind == "read":
        return "read text ?"
    raise InputError(f"unknown scenes question kind {kind!r}; allowed: {', '.join(KINDS)}")


def _draw_params(scene: Scene, kind: str, rng: np.random.Generator) -> dict:
    objs = scene.objects
    if kind == "exist":
        present = sorted((o.color, o.shape) for o in objs)
        absent = [(c, s) for c in COLOR_NAMES for s in SHAPES if (c, s) not in present]
        c, s = pick(rng, present if rng.random() < 0.5 else absent)
        return {"color": c, "shape": s}
    if kind == "count":
        if rng.random() < 0.5:
            return {"color": pick(rng, COLOR_NAMES)}
        return {"shape": pick(rng, SHAPES)}
    if kind == "color":
        return {"shape": pick(rng, [s for s in SHAPES if len(scene.find(shape=s)) == 1])}
    if kind == "relation":
        rels = list(RELATIONS)
        pairs = [(a, b, r) for a in objs for b in objs if a is not b for r in rels
                 if abs((a.cx - b.cx) if r in ("left", "right") else (a.cy - b.cy)) >= RELATION_GAP]  # fmt: skip
        want = rng.random() < 0.5
        pool = [(a, b, r) for a, b, r in pairs if _relation_holds(a, b, r) == want] or pairs
        a, b, r = pick(rng, pool)
        return {"a": a.name, "b": b.name, "rel": r}
    if kind == "largest":
        for _ in range(50):
            k = int(rng.integers(2, min(4, len(objs)) + 1))
            opts = [objs[int(i)] for i in rng.choice(len(objs), size=k, replace=False)]
            areas = sorted((o.area for o in opts), reverse=True)
            if areas[0] >= LARGEST_RATIO * areas[1]:
                return {"options": [o.name for o in opts]}
        # no clear winner drawn: the largest object against the smallest
        by_area = sorted(objs, key=lambda o: o.area)
        opts = [by_area[-1], by_area[0]]
        order = rng.permutation(2)
        return {"options": [opts[int(i)].name for i in order]}
    return {}


def _candidates(kind: str, answer: str, params: dict, rng: np.random.Generator) -> list[str]:
    if kind in ("exist", "relation"):
        return ["yes", "no"]
    if kind == "count":
        return [str(i) for i in range(MAX_OBJECTS + 1)]
    if kind == "color":
        return list(COLOR_NAMES)
    if kind == "largest":
        return OPTION_LETTERS[: len(params["options"])]
    cands = [answer]  # read: the right string and up to 3 near misses
    words = answer.split()
    for _ in range(30):
        if len(cands) >= 4:
            break
        alt = list(words)
        alt[int(rng.integers(len(alt)))] = pick(rng, GLYPH_CHARS)
        if " ".join(alt) not in cands:
            cands.append(" ".join(alt))
    return [cands[int(i)] for i in rng.permutation(len(cands))]


def make_qa(scene: Scene, kind: str, rng: np.random.Generator) -> QA:
    if kind not in KINDS:
        raise InputError(f"unknown scenes question kind {kind!r}; allowed: {', '.join(KINDS)}")
    params = _draw_params(scene, kind, rng)
    answer = answer_for(scene, kind, params)
    return QA(kind=kind, probe=KINDS[kind], question=question_text(kind, params), answer=answer,
              options=list(params["options"]) if kind == "largest" else None,
              candidates=_candidates(kind, answer, params, rng), params=params)  # fmt: skip


def make_sample(rng: np.random.Generator, per_kind: dict[str, int] | None = None) -> Sample:
    """One scene, its image and questions: one per kind in `KINDS` unless `per_kind` says otherwise."""
    scene = make_scene(rng)
    return Sample(image=render(scene), scene=scene, qas=grid.questions(scene, make_qa, KINDS, per_kind, rng))


SALT = 20261203  # the scenes task's seed streams, apart from the grid task's


def split_rng(split: str, seed: int = 0) -> np.random.Generator:
    """The split's own seed stream ("train", "val", "test")."""
    return grid.split_rng(split, seed, salt=SALT)


def generate_split(split: str, n: int, seed: int = 0) -> list[Sample]:
    """`n` samples of `split` ("train", "val", "test"); splits draw from disjoint seed streams."""
    return grid.draw(make_sample, split_rng(split, seed), n)


GRID_WORDS = max(max(r, c) for (r, c), _ in SIZES)  # r0.. / c0.. words of the training scaffold


format_prompt = grid.format_prompt  # the same PROMPT_TEMPLATE


def vocabulary_words() -> list[str]:
    """Every word the scenes task can produce (and the scaffold's position words), in a fixed order."""
    words = ["?", "<ans>", "is", "there", "a", "the", "how", "many", "what", "color", "which", "largest",
             "read", "text", "yes", "no", "background"]  # fmt: skip
    words += [w for rel in RELATIONS.values() for w in rel]
    words += COLOR_NAMES + SHAPES
    words += [str(i) for i in range(10)] + [ch for ch in GLYPH_CHARS if not ch.isdigit()] + OPTION_LETTERS
    words += [f"r{i}" for i in range(GRID_WORDS)] + [f"c{i}" for i in range(GRID_WORDS)]
    words += [f"s{s}" for s in OBJECT_SIZES]
    return list(dict.fromkeys(words))
