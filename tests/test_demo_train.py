"""Demo training machinery: teacher targets point at the right tokens, training is seeded and resumable."""

import numpy as np
import torch

from trimvlm.demo import task
from trimvlm.demo import train as tr
from trimvlm.demo.train_common import Look


def _scene_sample():
    scene = task.Scene(
        objects=[task.Obj(0, 1, "red", "square"), task.Obj(3, 1, "red", "circle"), task.Obj(5, 6, "blue", "circle")],
        text="A7",
        text_row=6,
        text_col=2,
    )  # fmt: skip
    exist = task.QA("exist", "prefill", "is there a red circle ?", "yes", None, ["yes", "no"],
                    {"color": "red", "shape": "circle"})  # fmt: skip
    opts = [("green", "square"), ("blue", "circle"), ("red", "triangle"), ("yellow", "circle")]
    mc = task.QA("mc", "prefill", task._question_text("mc", {"options": opts}), "B", None, list("ABCD"),
                 {"options": opts})  # fmt: skip
    return task.Sample(image=task.render(scene), scene=scene, qas=[exist, mc])


def test_teacher_targets_point_at_the_evidence():
    enc = tr.Encoder()
    id2w = {i: w for w, i in enc.vocab.items()}
    sample = _scene_sample()
    opts = sample.qas[1].params["options"]
    rng = np.random.default_rng(0)
    for _ in range(8):  # turn order is shuffled: check every look whatever the order
        batch = enc.train_batch([sample], rng)
        ids = batch["input_ids"][0].tolist()
        for look in batch["looks"]:
            b, p, keys, words, option = look.row, look.at, look.keys, look.words, look.option
            assert b == 0 and id2w[ids[p]] == "<ans>"
            if len(option):  # multiple choice: the right option is B = blue circle at r5 c6
                assert keys == [1 + 5 * 8 + 6]
                assert [id2w[ids[i]] for i in option] == ["B", "blue", "circle"]
                assert [id2w[ids[i]] for i in words] == ["green", "square", "blue", "circle", "red", "triangle",
                                                         "yellow", "circle"]  # fmt: skip
            else:  # existence: red circle at r3 c1
                assert keys == [1 + 3 * 8 + 1]
                assert [id2w[ids[i]] for i in words] == ["red", "circle"]
        for p, classes in ((a.at, a.pairs) for a in batch["asks"]):
            assert id2w[ids[p]] == "<ans>"
            want = (
                [tr.pair_class(*o) for o in opts] if len(classes) == 4 else [tr.pair_class("red", "circle")]
            )
            assert classes == want
        assert all(ids[k] == enc.image_pad for look in batch["looks"] for k in look.keys)


def test_teacher_loss_is_minimal_at_the_target():
    looks = [Look(0, 5, [2, 3], [1], []), Look(1, 5, [], [2, 4], [])]
    t = tr.AttentionTeacher.__new__(tr.AttentionTeacher)
    t.head, t.roles, t.rows_only = 0, {2: "cells"}, False
    w = torch.full((2, 1, 6, 6), 1e-9)
    w[0, 0, 5, [0, 2, 3]] = 1 / 3  # sink + both evidence cells
    w[1, 0, 5, 0] = 1.0  # nothing matches: all on the sink
    t.weights = {2: w}
    assert abs(t.loss(looks).item() - np.log(3) / 2) < 1e-4  # mean over looks of (log 3, 0): the minimum
    w2 = w.clone()
    w2[1, 0, 5] = 1 / 6
    t.weights = {2: w2}
    assert t.loss(looks).item() > np.log(3) / 2 + 0.5


def test_training_is_seeded_and_resumable(tmp_path, monkeypatch):
    monkeypatch.setattr(tr, "VAL_IMAGES", 2)
    monkeypatch.setattr(tr, "TEST_IMAGES", 2)
    kw = dict(batch_size=2, threads=1, eval_every=100, save_every=2, progress=False, warmup=2,
              model_kwargs={"hidden": 32, "layers": 6, "heads": 2, "kv_heads": 1, "head_dim": 16,
                            "vision_hidden": 32, "vision_depth": 1})  # fmt: skip
    tr.train_demo(tmp_path / "a", 4, work_dir=tmp_path / "wa", **kw)
    tr.train_demo(tmp_path / "b", 2, work_dir=tmp_path / "wb", **kw)
    tr.train_demo(tmp_path / "b", 4, work_dir=tmp_path / "wb", **kw)  # resumes at step 2
    a = torch.load(tmp_path / "wa" / "train_state.pt", weights_only=False)
    b = torch.load(tmp_path / "wb" / "train_state.pt", weights_only=False)
    assert a["step"] == b["step"] == 4
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    assert (tmp_path / "a" / "model.safetensors").exists()
