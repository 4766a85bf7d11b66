"""The synthetic demo task: grid scenes with coloured shapes and a short drawn string.

A scene is an 8x8 grid of 16-pixel cells (a 128x128 RGB image). With Qwen3-VL's patch size 8 and spatial
merge size 2, one merged visual token covers exactly one cell, so an image is 64 visual tokens. Most cells
are uniform grey background (some with a faint repeated stripe pattern); a few cells hold a coloured shape,
and one row holds a short string of glyphs (black on white, one glyph per cell).

Every answer is computed from the scene description (`Scene`), never from the pixels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw

from trimvlm.errors import InputError

GRID = 8
CELL = 16
IMAGE_SIZE = GRID * CELL

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (50, 80, 225),
    "yellow": (235, 210, 40),
    "purple": (150, 60, 190),
}
COLOR_NAMES = list(COLORS)
BACKGROUND = "grey"
BACKGROUND_RGB = (128, 128, 128)
STRIPE_RGB = (142, 142, 142)
SHAPES = ["square", "circle", "triangle"]
GLYPH_CHARS = list("0123456789ABCDEF")
OPTION_LETTERS = ["A", "B", "C", "D"]
MAX_OBJECTS = 7

# 5x7 bitmaps, one string per row, '#' = ink.
_GLYPHS: dict[str, list[str]] = {
    "0": [".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."],
    "1": ["..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."],
    "2": [".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"],
    "3": ["####.", "....#", "....#", ".###.", "....#", "....#", "####."],
    "4": ["...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."],
    "5": ["#####", "#....", "####.", "....#", "....#", "#...#", ".###."],
    "6": ["..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."],
    "7": ["#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."],
    "8": [".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."],
    "9": [".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."],
    "A": ["..#..", ".#.#.", "#...#", "#...#", "#####", "#...#", "#...#"],
    "B": ["####.", "#...#", "#...#", "####.", "#...#", "#...#", "####."],
    "C": [".###.", "#...#", "#....", "#....", "#....", "#...#", ".###."],
    "D": ["###..", "#..#.", "#...#", "#...#", "#...#", "#..#.", "###.."],
    "E": ["#####", "#....", "#....", "####.", "#....", "#....", "#####"],
    "F": ["#####", "#....", "#....", "####.", "#....", "#....", "#...."],
}

KINDS: dict[str, str] = {
    "exist": "prefill",
    "mc": "prefill",
    "color": "prefill",
    "count": "prefill",
    "list": "full",
    "read": "full",
}
# Training-only auxiliary kinds: every object with explicit coordinates, in raster order ("describe"), and
# the coordinates of every object of a colour (and shape), in raster order ("where").
AUX_KINDS: dict[str, str] = {"describe": "full", "where": "full"}

PROMPT_TEMPLATE = "{question} <ans>"

SPLITS = {"train": 1, "val": 2, "test": 3}


@dataclass
class Obj:
    row: int
    col: int
    color: str
    shape: str


@dataclass
class Scene:
    objects: list[Obj]
    text: str  # glyph characters, e.g. "7A3"
    text_row: int
    text_col: int  # first cell of the string
    stripes: list[tuple[int, int]] = field(default_factory=list)  # background cells with the stripe pattern

    def text_cells(self) -> list[tuple[int, int]]:
        return [(self.text_row, self.text_col + i) for i in range(len(self.text))]

    def object_at(self, row: int, col: int) -> Obj | None:
        return next((o for o in self.objects if (o.row, o.col) == (row, col)), None)

    def find(self, color: str | None = None, shape: str | None = None) -> list[Obj]:
        return [o for o in self.objects if color in (None, o.color) and shape in (None, o.shape)]


@dataclass
class QA:
    kind: str
    probe: str  # "prefill" | "full"
    question: str
    answer: str
    options: list[str] | None
    candidates: list[str]
    params: dict = field(default_factory=dict)


@dataclass
class Sample:
    image: Image.Image
    scene: Scene
    qas: list[QA]


# --------------------------------------------------------------------------------------------- scenes


def pick(rng: np.random.Generator, items):
    """One of `items`, drawn uniformly."""
    return items[int(rng.integers(len(items)))]


def make_scene(rng: np.random.Generator) -> Scene:
    n_text = int(rng.integers(3, 5))
    text = "".join(GLYPH_CHARS[int(i)] for i in rng.integers(0, len(GLYPH_CHARS), n_text))
    text_row = int(rng.integers(0, GRID))
    text_col = int(rng.integers(0, GRID - n_text + 1))
    taken = {(text_row, text_col + i) for i in range(n_text)}
    free = [(r, c) for r in range(GRID) for c in range(GRID) if (r, c) not in taken]
    n_obj = int(rng.integers(3, MAX_OBJECTS + 1))
    picks = rng.choice(len(free), size=n_obj, replace=False)
    objects = [Obj(*free[p], pick(rng, COLOR_NAMES), pick(rng, SHAPES)) for p in sorted(picks.tolist())]
    occupied = taken | {(o.row, o.col) for o in objects}
    stripes: list[tuple[int, int]] = []
    if rng.random() < 0.6:  # a rectangular patch of repeated stripe texture on empty background
        r0, c0 = (int(x) for x in rng.integers(0, GRID - 1, 2))
        h, w = (int(x) for x in rng.integers(2, 5, 2))
        stripes = [
            (r, c)
            for r in range(r0, min(GRID, r0 + h))
            for c in range(c0, min(GRID, c0 + w))
            if (r, c) not in occupied
        ]
    return Scene(objects=objects, text=text, text_row=text_row, text_col=text_col, stripes=stripes)


def render(scene: Scene) -> Image.Image:
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND_RGB)
    d = ImageDraw.Draw(img)
    for r, c in scene.stripes:
        x, y = c * CELL, r * CELL
        for k in range(0, CELL, 4):
            d.line([(x, y + k), (x + CELL - 1, y + k)], fill=STRIPE_RGB)
    for o in scene.objects:
        x, y = o.col * CELL, o.row * CELL
        rgb = COLORS[o.color]
        if o.shape == "square":
            d.rectangle([x + 3, y + 3, x + 12, y + 12], fill=rgb)
        elif o.shape == "circle":
            d.ellipse([x + 2, y + 2, x + 13, y + 13], fill=rgb)
        else:
            d.polygon([(x + 8, y + 2), (x + 14, y + 13), (x + 1, y + 13)], fill=rgb)
    draw_glyphs(d, scene.text, scene.text_col * CELL, scene.text_row * CELL)
    return img


def draw_glyphs(d: ImageDraw.ImageDraw, text: str, x: int, y: int, scale: int = 1) -> None:
    """`text` from (x, y) rightwards, a glyph in black on a white box of `scale` x `scale` cells each."""
    side = CELL * scale
    for i, ch in enumerate(text):
        x0 = x + i * side
        d.rectangle([x0, y, x0 + side - 1, y + side - 1], fill=(245, 245, 245))
        for gy, line in enumerate(_GLYPHS[ch]):
            for gx, px in enumerate(line):
                if px == "#":
                    ix, iy = x0 + (3 + 2 * gx) * scale, y + (1 + 2 * gy) * scale
                    d.rectangle([ix, iy, ix + 2 * scale - 1, iy + 2 * scale - 1], fill=(0, 0, 0))


# --------------------------------------------------------------------------------------------- answers


def answer_for(scene: Scene, kind: str, params: dict) -> str:
    """Recompute the answer of a question from the scene description alone."""
    if kind == "exist":
        return "yes" if evidence_cells(scene, kind, params) else "no"
    if kind == "mc":
        present = {(o.color, o.shape) for o in scene.objects}
        hits = [i for i, (c, s) in enumerate(params["options"]) if (c, s) in present]
        if len(hits) != 1:
            raise ValueError("a multiple-choice question must have exactly one present option")
        return OPTION_LETTERS[hits[0]]
    if kind == "color":
        o = scene.object_at(params["row"], params["col"])
        return o.color if o is not None else BACKGROUND
    if kind == "count":
        return str(len(evidence_cells(scene, kind, params)))
    if kind == "list":  # the colours along the row or column, in order
        cells = sorted(evidence_cells(scene, kind, params))
        return " ".join(scene.object_at(r, c).color for r, c in cells) or "none"
    if kind == "read":
        return " ".join(scene.text)
    if kind == "describe":
        objs = sorted(scene.objects, key=lambda o: (o.row, o.col))
        return " ".join(f"r{o.row} c{o.col} {o.color} {o.shape}" for o in objs)
    if kind == "where":
        return " ".join(f"r{r} c{c}" for r, c in sorted(evidence_cells(scene, kind, params))) or "none"
    raise InputError(f"unknown question kind {kind!r}; allowed: {sorted(KINDS) + sorted(AUX_KINDS)}")


def evidence_cells(scene: Scene, kind: str, params: dict) -> list[tuple[int, int]]:
    """The cells a reader must look at to answer, from the scene description (empty: nothing matches)."""
    if kind == "exist":
        return [(o.row, o.col) for o in scene.find(params["color"], params["shape"])]
    if kind == "mc":
        wanted = {tuple(p) for p in params["options"]}
        return [(o.row, o.col) for o in scene.objects if (o.color, o.shape) in wanted]
    if kind == "color":
        return [(params["row"], params["col"])]
    if kind == "count":
        return [(o.row, o.col) for o in scene.find(params["color"])]
    if kind == "list":
        on_line = (lambda o: o.row) if params["axis"] == "row" else (lambda o: o.col)
        return [(o.row, o.col) for o in scene.objects if on_line(o) == params["index"]]
    if kind == "read":
        return scene.text_cells()
    if kind == "where":
        return [(o.row, o.col) for o in scene.find(params["color"], params.get("shape"))]
    if kind == "describe":
        return [(o.row, o.col) for o in scene.objects]
    raise InputError(f"unknown question kind {kind!r}; allowed: {sorted(KINDS) + sorted(AUX_KINDS)}")


def _question_text(kind: str, params: dict) -> str:
    if kind == "exist":
        return f"is there a {params['color']} {params['shape']} ?"
    if kind == "mc":
        opts = " ".join(f"{L} {c} {s}" for L, (c, s) in zip(OPTION_LETTERS, params["options"], strict=True))
        return f"which is present ? {opts}"
    if kind == "color":
        return f"color at r{params['row']} c{params['col']} ?"
    if kind == "count":
        return f"how many {params['color']} ?"
    if kind == "list":
        prefix = "r" if params["axis"] == "row" else "c"
        return f"list {params['axis']} {prefix}{params['index']} ?"
    if kind == "read":
        return "read text ?"
    if kind == "describe":
        return "describe ?"
    if kind == "where":
        what = params["color"] if params.get("shape") is None else f"{params['color']} {params['shape']}"
        return f"describe {what} ?"
    raise InputError(f"unknown question kind {kind!r}")


def _draw_params(scene: Scene, kind: str, rng: np.random.Generator) -> dict:
    present = {(o.color, o.shape) for o in scene.objects}
    all_pairs = [(c, s) for c in COLOR_NAMES for s in SHAPES]
    absent = [p for p in all_pairs if p not in present]
    if kind == "exist":
        pool = sorted(present) if (rng.random() < 0.5 and present) else absent
        c, s = pick(rng, pool)
        return {"color": c, "shape": s}
    if kind == "mc":
        right = pick(rng, sorted(present))
        wrong_idx = rng.choice(len(absent), size=3, replace=False)
        opts = [absent[int(i)] for i in wrong_idx]
        opts.insert(int(rng.integers(4)), right)
        return {"options": opts}
    if kind == "color":
        if rng.random() < 0.7:
            o = pick(rng, scene.objects)
            return {"row": o.row, "col": o.col}
        occupied = set(scene.text_cells()) | {(o.row, o.col) for o in scene.objects}
        empty = [(r, c) for r in range(GRID) for c in range(GRID) if (r, c) not in occupied]
        r, c = pick(rng, empty)
        return {"row": r, "col": c}
    if kind == "count":
        colors = sorted({o.color for o in scene.objects})
        pool = colors if rng.random() < 0.8 else COLOR_NAMES
        return {"color": pick(rng, pool)}
    if kind == "list":
        axis = "row" if rng.random() < 0.5 else "col"
        if rng.random() < 0.85:
            o = pick(rng, scene.objects)
            index = o.row if axis == "row" else o.col
        else:
            index = int(rng.integers(GRID))
        return {"axis": axis, "index": index}
    if kind == "where":
        if rng.random() < 0.7:
            o = pick(rng, scene.objects)
            color, shape = o.color, o.shape
        else:
            color, shape = pick(rng, COLOR_NAMES), pick(rng, SHAPES)
        return {"color": color, "shape": shape if rng.random() < 0.5 else None}
    return {}


def _candidates(scene: Scene, kind: str, answer: str, rng: np.random.Generator) -> list[str]:
    if kind == "exist":
        return ["yes", "no"]
    if kind == "mc":
        return list(OPTION_LETTERS)
    if kind == "color":
        return COLOR_NAMES + [BACKGROUND]
    if kind == "count":
        return [str(i) for i in range(MAX_OBJECTS + 1)]
    if kind in AUX_KINDS:
        return [answer]
    # multi-token kinds: the right answer and up to 3 near misses
    cands = [answer]
    words = answer.split()
    vocab = COLOR_NAMES if kind == "list" else GLYPH_CHARS
    for _ in range(30):
        if len(cands) >= 4:
            break
        if kind == "list" and (answer == "none" or rng.random() < 0.25):
            alt = (
                [pick(rng, vocab) for _ in range(int(rng.integers(1, 3)))]
                if answer == "none"
                else words[:-1] or ["none"]
            )
        else:
            alt = list(words)
            j = int(rng.integers(len(alt)))
            alt[j] = pick(rng, vocab)
        s = " ".join(alt)
        if s not in cands:
            cands.append(s)
    order = rng.permutation(len(cands))
    return [cands[int(i)] for i in order]


def make_qa(scene: Scene, kind: str, rng: np.random.Generator) -> QA:
    params = _draw_params(scene, kind, rng)
    answer = answer_for(scene, kind, params)
    options = [f"{c} {s}" for c, s in params["options"]] if kind == "mc" else None
    return QA(
        kind=kind,
        probe=KINDS.get(kind) or AUX_KINDS[kind],
        question=_question_text(kind, params),
        answer=answer,
        options=options,
        candidates=_candidates(scene, kind, answer, rng),
        params=params,
    )


def questions(scene, make_qa, kinds, per_kind: dict[str, int] | None, rng: np.random.Generator) -> list:
    """A scene's questions: one per kind of `kinds` unless `per_kind` says how many of each (the grid and
    scenes tasks both draw theirs this way)."""
    counts = per_kind if per_kind is not None else {k: 1 for k in kinds}
    return [make_qa(scene, kind, rng) for kind, n in counts.items() for _ in range(n)]


def make_sample(rng: np.random.Generator, per_kind: dict[str, int] | None = None) -> Sample:
    """One scene, its image and questions: one per kind in `KINDS` unless `per_kind` says otherwise."""
    scene = make_scene(rng)
    return Sample(image=render(scene), scene=scene, qas=questions(scene, make_qa, KINDS, per_kind, rng))


GRID_SALT = 20240601


def split_rng(split: str, seed: int = 0, salt: int = GRID_SALT) -> np.random.Generator:
    """The split's own seed stream (`salt` tells one task's streams from another's)."""
    if split not in SPLITS:
        raise InputError(f"unknown split {split!r}; allowed: {sorted(SPLITS)}")
    return np.random.default_rng([SPLITS[split], int(seed), salt])


def draw(make, rng: np.random.Generator, n: int) -> list:
    """`n` samples made by `make(rng)` one after another from one stream."""
    if n < 0:
        raise InputError(f"n must be >= 0, got {n}")
    return [make(rng) for _ in range(n)]


def generate_split(split: str, n: int, seed: int = 0) -> list[Sample]:
    """`n` samples of `split` ("train", "val", "test"); splits draw from disjoint seed streams."""
    return draw(make_sample, split_rng(split, seed), n)


def format_prompt(question: str) -> str:
    return PROMPT_TEMPLATE.format(question=question)


def vocabulary_words() -> list[str]:
    """Every word the task can produce, in a fixed order."""
    words = "? <ans> is there a which present color at how many list row col read text describe".split()
    words += ["yes", "no", "none", BACKGROUND]
    words += COLOR_NAMES + SHAPES
    words += [f"r{i}" for i in range(GRID)] + [f"c{i}" for i in range(GRID)]
    words += [str(i) for i in range(10)] + [ch for ch in GLYPH_CHARS if not ch.isdigit()]
    return list(dict.fromkeys(words + OPTION_LETTERS))
