"""The demo task generator: deterministic, answers recomputed from the scene, probe types, image geometry."""

import numpy as np
import pytest

from trimvlm.demo import task
from trimvlm.demo.model import VISUAL_TOKENS, build_image_processor
from trimvlm.demo.vocab import build_tokenizer
from trimvlm.errors import InputError


def _key(samples):
    return [
        (
            s.scene,
            [(q.kind, q.question, q.answer, q.candidates) for q in s.qas],
            np.asarray(s.image).tobytes(),
        )
        for s in samples
    ]


def test_same_seed_same_samples():
    assert _key(task.generate_split("val", 5, seed=3)) == _key(task.generate_split("val", 5, seed=3))


def test_splits_and_seeds_differ():
    base = _key(task.generate_split("train", 5))
    assert base != _key(task.generate_split("val", 5))
    assert base != _key(task.generate_split("test", 5))
    assert base != _key(task.generate_split("train", 5, seed=1))


def test_answers_recomputed_from_scene():
    for s in task.generate_split("test", 60):
        assert {q.kind for q in s.qas} == set(task.KINDS)
        for q in s.qas:
            assert q.answer == task.answer_for(s.scene, q.kind, q.params)
            ev = task.evidence_cells(s.scene, q.kind, q.params)
            if q.kind == "count":
                assert len(ev) == int(q.answer)
            if q.kind in ("exist", "mc"):
                assert bool(ev) == (q.answer != "no")
            assert q.answer in q.candidates
            assert 2 <= len(q.candidates) == len(set(q.candidates))


def test_answers_by_hand():
    scene = task.Scene(
        objects=[
            task.Obj(0, 1, "red", "square"),
            task.Obj(0, 5, "blue", "circle"),
            task.Obj(3, 1, "red", "circle"),
        ],
        text="A7",
        text_row=6,
        text_col=2,
    )
    assert task.answer_for(scene, "exist", {"color": "red", "shape": "circle"}) == "yes"
    assert task.answer_for(scene, "exist", {"color": "blue", "shape": "square"}) == "no"
    opts = [("green", "square"), ("blue", "circle"), ("red", "triangle"), ("yellow", "circle")]
    assert task.answer_for(scene, "mc", {"options": opts}) == "B"
    assert task.answer_for(scene, "color", {"row": 0, "col": 5}) == "blue"
    assert task.answer_for(scene, "color", {"row": 2, "col": 2}) == "grey"
    assert task.answer_for(scene, "count", {"color": "red"}) == "2"
    assert task.answer_for(scene, "count", {"color": "green"}) == "0"
    assert task.answer_for(scene, "list", {"axis": "row", "index": 0}) == "red blue"
    assert task.answer_for(scene, "list", {"axis": "col", "index": 1}) == "red red"
    assert task.answer_for(scene, "list", {"axis": "row", "index": 7}) == "none"
    assert task.answer_for(scene, "read", {}) == "A 7"
    cells = task.evidence_cells
    assert cells(scene, "exist", {"color": "red", "shape": "circle"}) == [(3, 1)]
    assert cells(scene, "exist", {"color": "blue", "shape": "square"}) == []
    assert cells(scene, "mc", {"options": opts}) == [(0, 5)]
    assert cells(scene, "count", {"color": "red"}) == [(0, 1), (3, 1)]
    assert cells(scene, "list", {"axis": "col", "index": 1}) == [(0, 1), (3, 1)]
    assert cells(scene, "color", {"row": 2, "col": 2}) == [(2, 2)]
    assert cells(scene, "read", {}) == [(6, 2), (6, 3)]


def test_probe_types_and_tokens():
    tok = build_tokenizer()
    unk = tok.unk_token_id
    assert set(task.KINDS.values()) == {"prefill", "full"}
    for s in task.generate_split("val", 30):
        for q in s.qas:
            assert q.probe == task.KINDS[q.kind]
            prompt_ids = tok(task.format_prompt(q.question))["input_ids"]
            answer_ids = tok(q.answer)["input_ids"]
            assert unk not in prompt_ids and unk not in answer_ids
            if q.probe == "prefill":
                assert len(answer_ids) == 1
                assert all(len(tok(c)["input_ids"]) == 1 for c in q.candidates)
            if q.kind == "mc":
                assert q.options is not None and len(q.options) == 4
                assert all(
                    f"{L} {o}" in q.question for L, o in zip(task.OPTION_LETTERS, q.options, strict=True)
                )


def test_image_is_64_visual_tokens():
    samples = task.generate_split("val", 2)
    assert all(s.image.size == (128, 128) and s.image.mode == "RGB" for s in samples)
    out = build_image_processor()(images=[s.image for s in samples], return_tensors="pt")
    grid = out["image_grid_thw"]
    assert grid.tolist() == [[1, 16, 16], [1, 16, 16]]
    assert int(grid[0].prod()) // 4 == VISUAL_TOKENS == 64


def test_unknown_split_raises():
    with pytest.raises(InputError, match="bogus"):
        task.generate_split("bogus", 3)
