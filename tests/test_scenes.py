"""The scenes task and the demo-scenes architecture: a deterministic generator whose answers come from the
scene description, disjoint splits, ragged visual spans, and a Qwen2.5-VL checkpoint that transformers' own
`from_pretrained` reads and the runner reproduces (a small random-weight one built by the same code as the
shipped model)."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

import trimvlm
from trimvlm.demo import scenes
from trimvlm.demo.train_common import Look
from trimvlm.errors import InputError


def _describe(s):
    sc = s.scene
    return (sc.rows, sc.cols, sc.text, sc.text_row, sc.text_col, sc.glyph_scale,
            tuple((o.color, o.shape, o.cx, o.cy, o.size) for o in sc.objects))  # fmt: skip


def test_generator_is_deterministic_per_seed_and_split():
    a = scenes.generate_split("val", 6, seed=3)
    b = scenes.generate_split("val", 6, seed=3)
    assert [_describe(s) for s in a] == [_describe(s) for s in b]
    assert [[(q.question, q.answer) for q in s.qas] for s in a] == [[(q.question, q.answer) for q in s.qas] for s in b]
    assert all(np.array_equal(np.asarray(x.image), np.asarray(y.image)) for x, y in zip(a, b, strict=True))
    c = scenes.generate_split("val", 6, seed=4)
    assert [_describe(s) for s in a] != [_describe(s) for s in c]


def test_splits_are_disjoint():
    seen = {split: {_describe(s) for s in scenes.generate_split(split, 150)} for split in ("train", "val", "test")}
    assert not seen["train"] & seen["val"]
    assert not seen["train"] & seen["test"]
    assert not seen["val"] & seen["test"]


def test_scenes_have_the_field_regime():
    samples = scenes.generate_split("test", 100)
    tokens = [s.scene.rows * s.scene.cols for s in samples]
    assert min(tokens) >= 150 and max(tokens) <= 400
    assert 240 <= np.median(tokens) <= 260 and tokens.count(256) > len(tokens) // 5  # most near 256
    assert all(s.image.size == (s.scene.cols * 16, s.scene.rows * 16) for s in samples)
    counts = [len(s.scene.objects) for s in samples]
    assert min(counts) >= 2 and max(counts) <= 8
    # objects span from one token to several; the background is most of the image
    spans = [len(t) for s in samples for t in scenes.object_tokens(s.scene)]
    assert min(spans) <= 2 and max(spans) >= 16
    covered = np.mean([sum(map(len, scenes.object_tokens(s.scene))) / (s.scene.rows * s.scene.cols) for s in samples])
    assert covered < 0.35
    kinds = {q.kind for s in samples for q in s.qas}
    assert kinds == set(scenes.KINDS)


def test_answers_come_from_the_description_not_the_pixels(monkeypatch):
    a = scenes.generate_split("test", 20)
    monkeypatch.setattr(scenes, "render", lambda scene: Image.new("RGB", (16, 16)))
    b = scenes.generate_split("test", 20)
    assert [[q.answer for q in s.qas] for s in a] == [[q.answer for q in s.qas] for s in b]
    for s in a:
        for q in s.qas:
            assert scenes.answer_for(s.scene, q.kind, q.params) == q.answer
            assert q.answer in q.candidates


def test_answers_by_hand():
    red = scenes.Obj("red", "circle", cx=40, cy=40, size=32)
    blue = scenes.Obj("blue", "square", cx=200, cy=60, size=48)
    blue2 = scenes.Obj("blue", "triangle", cx=100, cy=200, size=16)
    sc = scenes.Scene(rows=16, cols=16, background={"kind": "gradient", "a": (100,) * 3, "b": (150,) * 3,
                      "vertical": True, "period": 4}, objects=[red, blue, blue2], text="7A",
                      text_row=15, text_col=0, glyph_scale=1)  # fmt: skip
    assert scenes.answer_for(sc, "exist", {"color": "red", "shape": "circle"}) == "yes"
    assert scenes.answer_for(sc, "exist", {"color": "red", "shape": "square"}) == "no"
    assert scenes.answer_for(sc, "count", {"color": "blue"}) == "2"
    assert scenes.answer_for(sc, "count", {"shape": "diamond"}) == "0"
    assert scenes.answer_for(sc, "color", {"shape": "square"}) == "blue"
    assert scenes.answer_for(sc, "relation", {"a": "red circle", "b": "blue square", "rel": "left"}) == "yes"
    assert scenes.answer_for(sc, "relation", {"a": "red circle", "b": "blue triangle", "rel": "below"}) == "no"
    # areas: circle 32^2 * pi/4 = 804, square 48^2 = 2304, triangle 16^2 / 2 = 128
    assert scenes.answer_for(sc, "largest", {"options": ["red circle", "blue square", "blue triangle"]}) == "B"
    assert scenes.answer_for(sc, "read", {}) == "7 A"


def test_unknown_question_kind_is_one_line_error():
    rng = scenes.split_rng("test")
    sc = scenes.make_scene(rng)
    with pytest.raises(InputError, match="unknown scenes question kind 'colour'; allowed: exist, count"):
        scenes.make_qa(sc, "colour", rng)
    with pytest.raises(InputError, match="unknown split"):
        scenes.generate_split("dev", 1)


@pytest.fixture(scope="module")
def tiny_scenes(tmp_path_factory):
    """A small random-weight demo-scenes checkpoint, written by the shipped model's own code."""
    from trimvlm.demo import model as dm
    from trimvlm.demo.scenes_train import SCENES_META, scenes_tokenizer

    tok = scenes_tokenizer()
    cfg = dm.build_scenes_config(tok, hidden=32, layers=3, heads=2, kv_heads=1, head_dim=16, vision_hidden=32,
                                 vision_depth=2)  # fmt: skip
    folder = tmp_path_factory.mktemp("scenes") / "ckpt"
    dm.save_checkpoint(dm.build_model(cfg, seed=0), folder, SCENES_META, tok, dm.build_image_processor("scenes"))
    return folder


def test_checkpoint_loads_with_from_pretrained_and_runner_equals_transformers(tiny_scenes):
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from trimvlm.runtime.generate import generate
    from trimvlm.runtime.runner import Runner

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_scenes).eval()
    AutoTokenizer.from_pretrained(tiny_scenes)
    AutoImageProcessor.from_pretrained(tiny_scenes)
    vlm = trimvlm.load(str(tiny_scenes))
    samples = scenes.generate_split("test", 3)
    prep = vlm.adapter.prepare([[s.image] for s in samples], [s.qas[k].question for k, s in enumerate(samples)])
    spans = prep.input_ids.eq(hf.config.image_token_id).sum(1).tolist()
    assert spans == [s.scene.rows * s.scene.cols for s in samples] and len(set(spans)) > 1  # ragged
    out = Runner(vlm.adapter).prefill(prep, all_logits=True)
    with torch.no_grad():
        ref = hf(input_ids=prep.input_ids, attention_mask=prep.attention_mask, **prep.model_inputs).logits
    valid = prep.attention_mask.bool()
    assert (out.logits - ref)[valid].abs().max().item() <= 1e-4
    tok = vlm.adapter.tokenizer
    ours = generate(Runner(vlm.adapter), prep, max_new_tokens=6, stop_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
    with torch.no_grad():
        theirs = hf.generate(input_ids=prep.input_ids, attention_mask=prep.attention_mask, **prep.model_inputs,
                             max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)[:, prep.input_ids.shape[1]:]  # fmt: skip
    assert torch.equal(ours.tokens[:, : theirs.shape[1]], theirs)


@pytest.mark.parametrize("recipe", ["tokens=density:keep=0.25:layer=0", "tokens=fastv:keep=0.25:layer=2"])
def test_ragged_batch_under_a_reducer_equals_each_image_alone(tiny_scenes, recipe):
    vlm = trimvlm.load(str(tiny_scenes))
    samples = scenes.generate_split("val", 3)
    images, prompts = [s.image for s in samples], [s.qas[0].question for s in samples]
    together = vlm.generate(images, prompts, recipe=recipe, max_new_tokens=4)
    alone = [vlm.generate([im], [p], recipe=recipe, max_new_tokens=4) for im, p in zip(images, prompts, strict=True)]
    assert together.tokens == [a.tokens[0] for a in alone]


def test_an_image_the_processor_refuses_is_a_one_line_error(tiny_scenes):
    vlm = trimvlm.load(str(tiny_scenes))
    with pytest.raises(InputError, match=r"refuses an image of this batch \(4000x16 pixels\).*aspect ratio"):
        vlm.generate([Image.new("RGB", (4000, 16))], ["read text ?"], max_new_tokens=2)


def test_train_demo_names_its_tasks(tmp_path):
    from trimvlm.testing.cli import assert_one_line_error, run_cli

    assert_one_line_error(run_cli("train-demo", "--task", "grid", "--steps", 1, "--out", tmp_path / "x"),
                          "unknown demo task 'grid'; allowed: demo, scenes")  # fmt: skip


def test_scenes_training_step_runs_and_resumes(tmp_path, monkeypatch):
    """Two steps of demo-scenes' training at a small width: the scaffolds run on ragged scenes and the state
    resumes to the same weights as an uninterrupted run."""
    from trimvlm.demo import train as tr
    from trimvlm.demo.scenes_train import SCENES_SPEC

    monkeypatch.setattr(tr, "VAL_IMAGES", 2)
    monkeypatch.setattr(tr, "TEST_IMAGES", 2)
    kw = dict(batch_size=2, threads=1, eval_every=100, save_every=1, progress=False, warmup=2, spec=SCENES_SPEC,
              model_kwargs={"hidden": 32, "layers": 6, "heads": 2, "kv_heads": 1, "head_dim": 16,
                            "vision_hidden": 32, "vision_depth": 2})  # fmt: skip
    tr.train_demo(tmp_path / "a", 2, work_dir=tmp_path / "wa", **kw)
    tr.train_demo(tmp_path / "b", 1, work_dir=tmp_path / "wb", **kw)
    tr.train_demo(tmp_path / "b", 2, work_dir=tmp_path / "wb", **kw)
    a = torch.load(tmp_path / "wa" / "train_state.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "wb" / "train_state.pt", weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    meta = (tmp_path / "a" / "trimvlm.json").read_text()
    assert '"task": "scenes"' in meta
    log = [json.loads(line) for line in (tmp_path / "wa" / "train_log.jsonl").read_text().splitlines()]
    health = next(r["scaffolds"] for r in log if "scaffolds" in r)  # logged with the validation at step 2
    assert set(health) == {"content_objects", "pair_objects", "teacher_keys", "teacher_sink"}
    assert all(v is not None and 0.0 <= v <= 1.0 for v in health.values()), health
    assert health["teacher_keys"] + health["teacher_sink"] <= 1.0 + 1e-6


def test_train_head_reads_the_checkpoints_task(tiny_scenes, tmp_path, monkeypatch):
    """`trimvlm train-head` on a scenes checkpoint trains on scenes questions (its trimvlm.json names the task);
    a task that is not a demo task is a one-line error."""
    import functools

    import trimvlm.cli_train as ct

    monkeypatch.setattr(ct, "TEST_IMAGES", 2)
    monkeypatch.setattr(ct, "Settings", functools.partial(ct.Settings, val_images=2, eval_every=2))
    meta = ct.train_head_command(str(tiny_scenes), tmp_path / "head", steps=2, items=12, seed=0)
    assert meta["task"] == "scenes" and set(meta["val_accuracy"]) >= set(scenes.KINDS) - {"read"}
    assert json.loads((tmp_path / "head" / "decision_head.json").read_text())["task"] == "scenes"
    with pytest.raises(InputError, match="--task must be one of demo, scenes"):
        ct.train_head_command(str(tiny_scenes), tmp_path / "h2", steps=2, items=12, seed=0, task="vqa")


def test_the_teachers_attention_keeps_padding_masks(tiny_scenes):
    """Under the attention teacher's own attention function (`rows_only`), a left-padded batch (how validation
    generates) gives each prompt the logits it has alone, as SDPA does."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from trimvlm.demo.scenes_train import ScenesEncoder
    from trimvlm.demo.train import AttentionTeacher

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_scenes).eval()
    AttentionTeacher(model, layers=(1,), word_layers=(0,), option_layers=(2,), rows_only=True)
    enc = ScenesEncoder()
    samples = scenes.generate_split("val", 3, seed=0)
    items = [(s.image, s.qas[0].question) for s in samples]
    batch = enc.prompt_batch(items)
    assert len({int(m.sum()) for m in batch["attention_mask"]}) > 1  # ragged: some rows are padded
    with torch.no_grad():
        together = model(**batch).logits[:, -1]
        for i, item in enumerate(items):
            alone = model(**enc.prompt_batch([item])).logits[0, -1]
            torch.testing.assert_close(together[i], alone, atol=1e-4, rtol=1e-4)


def test_each_read_word_looks_at_its_glyph():
    """The attention teacher's looks for a reading: answer word j (predicted one position after word j - 1) at
    the visual tokens of glyph j, which show that glyph."""
    from trimvlm.demo.scenes_train import ScenesEncoder, glyph_keys

    enc = ScenesEncoder()
    s = scenes.make_sample(np.random.default_rng(4), per_kind={"read": 1})
    batch = enc.train_batch([s], np.random.default_rng(0))
    keys = glyph_keys(s.scene)
    looks = [look for look in batch["looks"] if look.keys in keys]
    assert [look.keys for look in looks] == keys and len(keys) == len(s.scene.text)
    ids = batch["input_ids"][0]
    first = looks[0].at
    assert [look.at for look in looks] == list(range(first, first + len(keys)))
    assert enc.vocab.get(s.scene.text[0]) == int(ids[first + 1])  # the position after predicts word 0 ...
    tokens = {(1 + r * s.scene.cols + c): ch for r, c, ch in s.scene.text_tokens()}
    for glyph, look in zip(s.scene.text, looks, strict=True):
        assert {tokens[k] for k in look.keys} == {glyph}  # ... and each look's keys show its glyph


def test_a_relation_gathers_each_objects_words_with_its_own_head():
    """A relation's look: the teacher's head reads the first object's colour and shape words, the next head the
    second object's (a bag of four words cannot bind colours to shapes nor order the objects)."""
    from trimvlm.demo.scenes_train import ScenesEncoder

    enc = ScenesEncoder()
    s = scenes.make_sample(np.random.default_rng(5), per_kind={"relation": 1})
    q = next(q for q in s.qas if q.kind == "relation")
    batch = enc.train_batch([s], np.random.default_rng(0))
    look = next(look for look in batch["looks"] if look.second_words)
    ids = batch["input_ids"][0]
    a, b = q.params["a"].split(), q.params["b"].split()
    assert [int(ids[p]) for p in look.words] == [enc.vocab[w] for w in a]
    assert [int(ids[p]) for p in look.second_words] == [enc.vocab[w] for w in b]


def test_the_teachers_next_head_follows_the_seventh_list(tiny_scenes):
    """At a "words" layer the teacher's head is scored on a look's words and the next head on its `second_words`:
    the same first head scores far better with the next head on `second_words` than with it on the first."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from trimvlm.demo.train import AttentionTeacher

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_scenes)
    teacher = AttentionTeacher(model, layers=(1,), word_layers=(0,), option_layers=(2,))
    look = Look(0, 7, [], [2, 3], [], [], [4, 5])

    def loss(first, second):
        w = torch.full((1, 4, 8, 8), 1e-9)
        w[0, 0, 7, first] = 0.5
        w[0, 1, 7, second] = 0.5
        teacher.weights = {0: w}
        return float(teacher.loss([look]))

    assert loss([2, 3], [4, 5]) < 1.0 < loss([2, 3], [2, 3])


def test_glyph_tokens_carry_a_target_of_their_own():
    from trimvlm.demo.scenes_train import ScenesEncoder

    enc = ScenesEncoder()
    s = scenes.make_sample(np.random.default_rng(6), per_kind={"read": 1})
    glyph = enc.cell_targets([s])["glyph"][0]
    want = {r * s.scene.cols + c: enc.vocab[ch] for r, c, ch in s.scene.text_tokens()}
    assert {int(i): int(glyph[i]) for i in torch.nonzero(glyph >= 0).flatten()} == want


def test_a_relations_answer_position_names_the_relation_that_holds():
    """The mid-way name of a relation turn sits at its answer position and says what holds on the axis asked
    about: "yes" exactly when it is the relation asked."""
    from trimvlm.demo.scenes_train import ScenesEncoder, relation_truth

    enc = ScenesEncoder()
    id2w = {i: w for w, i in enc.vocab.items()}
    for seed in range(12):
        s = scenes.make_sample(np.random.default_rng(seed), per_kind={"relation": 1})
        q = next(q for q in s.qas if q.kind == "relation")
        assert (relation_truth(s.scene, q.params) == q.params["rel"]) == (q.answer == "yes")
        batch = enc.train_batch([s], np.random.default_rng(0))
        (row, at, word), = batch["names"]
        assert int(batch["labels"][row, at + 1]) == enc.vocab[q.answer]  # the next token is the answer
        assert id2w[word] == relation_truth(s.scene, q.params)


def test_a_relations_verdict_looks_at_the_asked_word_when_it_holds(tiny_scenes):
    """After the relation is named, the teacher's verdict layer points the answer position at the asked relation
    word when the answer is yes and at the sink (position 0) when it is no; the teacher scores that list there."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from trimvlm.demo.scenes_train import ScenesEncoder
    from trimvlm.demo.train import AttentionTeacher

    enc = ScenesEncoder()
    seen = set()
    for seed in range(16):
        s = scenes.make_sample(np.random.default_rng(seed), per_kind={"relation": 1})
        q = next(q for q in s.qas if q.kind == "relation")
        batch = enc.train_batch([s], np.random.default_rng(0))
        (look,) = [look for look in batch["looks"] if look.verdict]
        if q.answer == "yes":
            assert [int(batch["input_ids"][0, p]) for p in look.verdict] == [enc.vocab[q.params["rel"]]]
        else:
            assert look.verdict == [0]
        seen.add(q.answer)
    assert seen == {"yes", "no"}
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_scenes)
    teacher = AttentionTeacher(model, layers=(), word_layers=(), option_layers=(), verdict_layers=(1,))
    look = Look(0, 7, [], [], [], [], [], [5])

    def loss(at):
        w = torch.full((1, 4, 8, 8), 1e-9)
        w[0, 0, 7, at] = 1.0
        teacher.weights = {1: w}
        return float(teacher.loss([look]))

    assert loss(5) < 1e-6 < 5.0 < loss(0)


def test_demo_scenes_answers_scenes_items():
    """The shipped demo-scenes answers 24 test items of the scenes task (every kind, both probes) at >= 90%.
    Skipped only where the checkpoint is not in the install (`trimvlm.load` says so)."""
    import trimvlm
    from trimvlm.errors import CheckpointError

    try:
        vlm = trimvlm.load("demo-scenes")
    except CheckpointError as e:
        pytest.skip(str(e))
    res = trimvlm.evaluate(vlm, "scenes", limit=24, batch_size=24, progress=False, memory="off")
    groups = {r["group"]: r["n"] for r in res.rows if r["recipe"] == "baseline"}
    assert all(groups.get(kind) == 4 for kind in scenes.KINDS), groups  # every kind asked
    assert res.row("baseline", "all")["accuracy"] >= 0.9, res.rows


def test_commands_default_to_the_checkpoints_own_task(tiny_scenes, tmp_path):
    """Without --task a command evaluates the task the checkpoint was trained on (its trimvlm.json): a scenes
    checkpoint is not silently scored on the grid task, whose words its tokenizer does not know."""
    from trimvlm.loading import checkpoint_task
    from trimvlm.testing.cli import run_cli

    assert checkpoint_task("demo") == "demo"
    assert checkpoint_task(tiny_scenes) == "scenes"
    assert checkpoint_task(tmp_path) == "demo"  # a folder naming no task
    assert checkpoint_task(tmp_path / "missing") == "demo"  # loading it is what reports the missing folder
    res = run_cli("eval", "--model", tiny_scenes, "--limit", 6, "--batch-size", 6, "--json", tmp_path / "r.json")
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["task"]["name"] == "scenes"
    assert set(report["task"]["kinds"]) == set(scenes.KINDS)
