"""Benchmark loaders: each reads a tiny copy written in its real layout (parquet shards with embedded images
as Hugging Face datasets publish them, or <split>.jsonl + image files); bad copies fail with a clear error."""

from pathlib import Path

import pytest
from PIL import Image

from trimvlm.errors import InputError, TrimVLMError
from trimvlm.evals.tasks import benchmarks, get_task
from trimvlm.testing.benchmark_copies import image, pope_rows, write_jsonl, write_parquet, write_shards

SHORT = "\nAnswer the question using a single word or phrase."
LETTER = "\nAnswer with the option's letter from the given choices directly."


def _load(name, data, **kw):
    return get_task(name, data=data, progress=False, **kw)


def _size(img):
    if isinstance(img, Image.Image):
        return img.size
    with Image.open(img) as im:
        return im.size


# --------------------------------------------------------------------------------------------- POPE


def test_pope_parquet_shards(tmp_path):
    rows = pope_rows(6)
    data = write_shards(tmp_path / "POPE", "test", rows, shards=2)  # data/test-0000k-of-00002, 2 rows/group
    task = _load("pope", data)
    assert task.name == "pope" and len(task.records) == 6
    assert task.info["split"] == "test" and task.info["form"] == "parquet" and len(task.info["files"]) == 2
    for r, row in zip(task.records, rows, strict=True):
        assert r.id == row["question_id"]
        assert r.answers == [row["answer"]] and r.question == row["question"]
        assert r.prompt_text() == row["question"] + SHORT
        assert (r.probe, r.metric, r.kind) == ("prefill", "yesno", row["category"])
        assert isinstance(r.images[0], Image.Image)
        assert r.images[0].convert("RGB").tobytes() == row["image"].convert("RGB").tobytes()
    assert list(task.kinds()) == ["adversarial", "popular", "random"]


def test_pope_limit_and_seed_draw_a_subset_in_file_order(tmp_path):
    data = write_shards(tmp_path / "POPE", "test", pope_rows(6), shards=2)
    a = [r.id for r in _load("pope", data, limit=3, seed=1).records]
    assert a == [r.id for r in _load("pope", data, limit=3, seed=1).records]  # same seed, same items
    assert len(a) == 3 and a == sorted(a, key=lambda x: int(x[1:]))
    draws = {tuple(r.id for r in _load("pope", data, limit=3, seed=s).records) for s in range(6)}
    assert len(draws) > 1  # the seed chooses the subset
    assert len(_load("pope", data, limit=10).records) == 6


def test_pope_jsonl_and_images_reads_like_parquet(tmp_path):
    rows = pope_rows(4)
    from_parquet = _load("pope", write_shards(tmp_path / "pq", "test", rows, shards=1))
    folder = write_jsonl(tmp_path / "js", "test", rows)
    from_jsonl = _load("pope", folder)
    assert from_jsonl.info["form"] == "jsonl"
    for a, b in zip(from_parquet.records, from_jsonl.records, strict=True):
        assert (a.id, a.prompt_text(), a.answers, a.kind) == (b.id, b.prompt_text(), b.answers, b.kind)
        assert isinstance(b.images[0], Path) and _size(b.images[0]) == _size(a.images[0])
    assert len(_load("pope", folder / "test.jsonl").records) == 4  # the file itself also works


# --------------------------------------------------------------------------------------------- multiple choice


def test_scienceqa_img_keeps_rows_with_an_image(tmp_path):
    rows = [
        {"question": "Which is a mammal?", "choices": ["frog", "whale"], "answer": 1, "hint": "Look closely.",
         "subject": "natural science", "image": image(0)},
        {"question": "No picture here", "choices": ["a", "b"], "answer": 0, "hint": "", "subject": "language science",
         "image": None},
        {"question": "Which is hot?", "choices": ["ice", "snow", "fire"], "answer": 2, "hint": "",
         "subject": "natural science", "image": image(1)},
    ]  # fmt: skip
    data = tmp_path / "ScienceQA"
    write_parquet(data / "ScienceQA-IMG" / "test-00000-of-00001.parquet", rows)
    write_parquet(data / "ScienceQA-FULL" / "test-00000-of-00001.parquet", rows)
    task = _load("scienceqa_img", data)
    assert task.info["config"] == "ScienceQA-IMG" and task.info["rows"] == 2
    a, b = task.records
    assert a.prompt_text() == "Context: Look closely.\nWhich is a mammal?\nA. frog\nB. whale" + LETTER
    assert b.prompt_text() == "Which is hot?\nA. ice\nB. snow\nC. fire" + LETTER
    assert (a.answers, a.options, a.kind, a.probe, a.metric) == (["B"], ["frog", "whale"], "natural science",
                                                                  "prefill", "option")  # fmt: skip
    assert b.answers == ["C"] and a.id == "test-0" and b.id == "test-2"


def test_mmbench_options_hint_and_withheld_answers(tmp_path):
    rows = [
        {"index": 10, "question": "What is shown?", "hint": "A photo.", "A": "cat", "B": "dog", "C": "bird",
         "D": None, "answer": "B", "category": "x", "L2-category": "coarse perception", "image": image(0)},
        {"index": 11, "question": "Which colour?", "hint": "nan", "A": "red", "B": "blue", "C": "nan",
         "D": "nan", "answer": "A", "category": "y", "L2-category": "fine perception", "image": image(1)},
    ]  # fmt: skip
    data = tmp_path / "MMBench"
    write_parquet(data / "en" / "dev-00000-of-00001.parquet", rows)
    write_parquet(data / "cn" / "dev-00000-of-00001.parquet", rows)
    test_rows = [dict(r, answer=None) for r in rows]
    write_parquet(data / "en" / "test-00000-of-00001.parquet", test_rows)
    task = _load("mmbench", data)
    assert (task.info["config"], task.info["split"]) == ("en", "dev")
    a, b = task.records
    assert a.prompt_text() == (
        "A photo. What is shown? There are several options:\nA. cat\nB. dog\nC. bird\n" + LETTER
    )
    assert b.prompt_text() == "Which colour? There are several options:\nA. red\nB. blue\n" + LETTER
    assert (a.id, a.answers, a.options, a.kind) == ("10", ["B"], ["cat", "dog", "bird"], "coarse perception")
    with pytest.raises(InputError, match=r"no reference answer in column 'answer'.*withhold"):
        _load("mmbench", data, split="test")


def test_ai2d_answer_index_as_text(tmp_path):
    rows = [{"question": "Which stage comes first?", "options": ["egg", "larva", "pupa", "adult"], "answer": "1",
             "image": image(0)}]  # fmt: skip
    task = _load("ai2d", write_shards(tmp_path / "ai2d", "test", rows, shards=1))
    (r,) = task.records
    assert r.answers == ["B"] and r.options == ["egg", "larva", "pupa", "adult"]
    assert r.prompt_text() == "Which stage comes first?\nA. egg\nB. larva\nC. pupa\nD. adult" + LETTER
    bad = [dict(rows[0], answer="7")]
    with pytest.raises(InputError, match=r"answer '7' is not an option index 0\.\.3"):
        _load("ai2d", write_shards(tmp_path / "bad", "test", bad, shards=1))


# --------------------------------------------------------------------------------------------- open answers


def test_textvqa_ten_answers(tmp_path):
    answers = ["nokia"] * 7 + ["Nokia phone", "nokia.", "samsung"]
    rows = [{"question_id": 5, "question": "what brand is the phone?", "answers": answers, "image": image(0),
             "ocr_tokens": ["NOKIA"]}]  # fmt: skip
    data = tmp_path / "textvqa"
    write_shards(data, "validation", rows, shards=1)
    write_shards(data, "train", rows, shards=1)
    (r,) = _load("textvqa", data).records
    assert (r.id, r.answers, r.probe, r.metric) == ("5", answers, "full", "vqa")
    assert r.prompt_text() == "what brand is the phone?" + SHORT
    assert len(_load("textvqa", data, split="train").records) == 1


def test_docvqa_and_infovqa_from_one_copy(tmp_path):
    data = tmp_path / "DocVQA"
    doc = [
        {
            "questionId": 1,
            "question": "What is the date?",
            "answers": ["1/2/99", "jan 2 1999"],
            "image": image(0),
        }
    ]
    info = [{"questionId": 2, "question": "How many?", "answers": ["12"], "image": image(1)}]
    write_parquet(data / "DocVQA" / "validation-00000-of-00001.parquet", doc)
    write_parquet(data / "DocVQA" / "test-00000-of-00001.parquet", [dict(doc[0], answers=None)])
    write_parquet(data / "InfographicVQA" / "validation-00000-of-00001.parquet", info)
    d, i = _load("docvqa", data), _load("infovqa", data)
    assert [r.id for r in d.records] == ["1"] and [r.id for r in i.records] == ["2"]
    assert d.records[0].metric == "anls" and d.records[0].answers == ["1/2/99", "jan 2 1999"]
    assert d.max_new_tokens == 128 and d.records[0].probe == "full"
    assert len(_load("infovqa", data / "InfographicVQA").records) == 1  # the configuration's folder itself


def test_chartqa_and_mmvet(tmp_path):
    rows = [{"type": "human_test", "question": "What is the peak?", "answer": "42", "image": image(0)},
            {"type": "augmented_test", "question": "Which year?", "answer": "2019", "image": image(1)}]  # fmt: skip
    task = _load("chartqa", write_shards(tmp_path / "chartqa", "test", rows, shards=1))
    assert [r.kind for r in task.records] == ["human_test", "augmented_test"]
    assert task.records[0].metric == "relaxed" and task.max_new_tokens == 16
    vet = [{"question_id": "v1", "question": "What is x?", "answer": "-1<AND>-5", "capability": "math,ocr",
            "image": image(2)}]  # fmt: skip
    (r,) = _load("mmvet", write_shards(tmp_path / "mmvet", "test", vet, shards=1)).records
    assert r.prompt_text().startswith("First please perform reasoning, and think step by step")
    assert r.prompt_text().endswith(": \n\nWhat is x?")
    assert (r.metric, r.probe, r.answers) == ("open_match", "full", ["-1<AND>-5"])


def test_every_benchmark_is_registered():
    assert set(benchmarks()) == {"pope", "scienceqa_img", "mmbench", "ai2d", "textvqa", "docvqa", "infovqa",
                               "chartqa", "mmvet"}  # fmt: skip


# --------------------------------------------------------------------------------------------- bad input


def test_missing_folder_and_unknown_layout(tmp_path):
    with pytest.raises(InputError, match=r"benchmark data not found: .*nowhere does not exist"):
        _load("pope", tmp_path / "nowhere")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "README.md").write_text("hi")
    (tmp_path / "odd" / "test.csv").write_text("a,b")
    with pytest.raises(
        InputError,
        match=r"odd is not a known benchmark layout: expected parquet shards .*found: README.md, test.csv",
    ):
        _load("pope", tmp_path / "odd")


def test_parquet_without_the_image_column(tmp_path):
    rows = [{"question": "is there a cat?", "answer": "yes", "category": "random"}]
    data = tmp_path / "p"
    write_parquet(data / "data" / "test-00000-of-00001.parquet", rows)
    with pytest.raises(
        InputError,
        match=r"is not a POPE layout: column\(s\) image missing; expected question, answer, image "
        r"\(and, if present: category\); found: question, answer, category",
    ):
        _load("pope", data)


def test_record_without_an_image_and_broken_image(tmp_path):
    rows = pope_rows(3)
    rows[1]["image"] = None
    with pytest.raises(
        InputError, match=r"row 1 \(record q1\): no image in column 'image'; every POPE record"
    ):
        _load("pope", write_shards(tmp_path / "a", "test", rows, shards=1))
    jrows = pope_rows(2)
    folder = write_jsonl(tmp_path / "b", "test", jrows)
    (folder / "images" / "test-1.png").write_bytes(b"not a png")
    with pytest.raises(InputError, match=r"record q1\): image .*test-1.png cannot be decoded"):
        _load("pope", folder)
    (folder / "images" / "test-1.png").unlink()
    with pytest.raises(InputError, match=r"image file not found: .*test-1.png"):
        _load("pope", folder)


def test_unknown_task_split_and_config_errors(tmp_path):
    with pytest.raises(TrimVLMError, match=r"unknown task 'vqa9'; known tasks: demo, demo-candidates, demo-decisions, scenes, scenes-candidates, or a JSONL file .*: ai2d, "
                       r"chartqa, docvqa, infovqa, mmbench, mmvet, pope, scienceqa_img, textvqa"):  # fmt: skip
        get_task("vqa9")
    with pytest.raises(InputError, match=r"task 'pope' reads a local copy .*--data PATH"):
        get_task("pope")
    with pytest.raises(InputError, match=r"--data applies to the benchmarks .* not to task 'demo'"):
        get_task("demo", data=tmp_path)
    data = write_shards(tmp_path / "POPE", "test", pope_rows(2), shards=1)
    with pytest.raises(InputError, match=r"split 'val' not found in .*POPE; found: test"):
        _load("pope", data, split="val")
    write_shards(data, "train", pope_rows(2), shards=1, config="other")
    with pytest.raises(
        InputError, match=r"holds several configurations \(\(top level\), other\); pope reads one"
    ):
        _load("pope", data)
    two = write_shards(tmp_path / "two", "train", pope_rows(2), shards=1)
    write_shards(two, "val", pope_rows(2), shards=1)
    with pytest.raises(InputError, match=r"holds the splits train, val: choose one with --split"):
        _load("pope", two)


def test_image_struct_forms_and_broken_bytes(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trimvlm.testing.benchmark_copies import IMAGE, png

    data = tmp_path / "POPE"
    (data / "imgs").mkdir(parents=True)
    image(5).save(data / "imgs" / "5.png")
    same = png(image(1))
    images = [
        {"bytes": same, "path": None},
        {"bytes": None, "path": "imgs/5.png"},
        {"bytes": same, "path": "x"},
    ]
    table = pa.table({"question": ["is there a cat?"] * 3, "answer": ["yes", "no", "yes"],
                      "image": pa.array(images, type=IMAGE)})  # fmt: skip
    (data / "data").mkdir()
    pq.write_table(table, data / "data" / "test-00000-of-00001.parquet")
    a, b, c = (r.images[0] for r in _load("pope", data).records)
    assert isinstance(a, Image.Image) and a is c  # identical embedded bytes share one image
    assert b == data / "imgs" / "5.png" and _size(b) == image(5).size
    broken = pa.table({"question": ["q"], "answer": ["yes"], "image": pa.array([{"bytes": b"junk", "path": None}],
                                                                                   type=IMAGE)})  # fmt: skip
    pq.write_table(broken, data / "data" / "test-00000-of-00001.parquet")
    with pytest.raises(InputError, match=r"row 0 \(record test-0\): the embedded image cannot be decoded"):
        _load("pope", data)


def test_parquet_fixture_image_is_the_datasets_image_feature(tmp_path):
    """The fixture writer's image column is the `datasets` Image feature: datasets (lmms-eval's reader) decodes
    it to a PIL image, and trimvlm's own loader (pyarrow) reads the same file."""
    datasets = pytest.importorskip("datasets", reason="datasets comes with lmms-eval (`make lmms`)")
    from PIL import Image

    rows = pope_rows(4)
    folder = write_shards(tmp_path / "POPE", "test", rows, shards=1)
    (shard,) = (folder / "data").glob("*.parquet")
    ds = datasets.load_dataset("parquet", data_files={"test": str(shard)})["test"]
    assert isinstance(ds.features["image"], datasets.Image)
    first = ds[0]["image"]
    assert isinstance(first, Image.Image) and first.convert("RGB").size == rows[0]["image"].size
    assert first.convert("RGB").tobytes() == rows[0]["image"].convert("RGB").tobytes()
    task = get_task("pope", data=folder, split="test", progress=False)
    assert len(task.records) == 4 and task.records[0].images[0].size == rows[0]["image"].size
    assert task.records[0].images[0].convert("RGB").tobytes() == rows[0]["image"].convert("RGB").tobytes()
