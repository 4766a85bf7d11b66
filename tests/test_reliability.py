"""Reliability of the public path: bad input is refused up front with a TrimVLMError that says what is allowed,
real recipes run end to end with sane outputs, overlapping runs in threads equal sequential ones, and every
method module imports (an import error fails here, never a skip)."""

import importlib
import json
import pkgutil

import pytest
from conftest import declared_methods

import trimvlm
from trimvlm.errors import InputError, RecipeError
from trimvlm.evals.tasks import Record, Task, check_prefill_answers, get_task, load_jsonl
from trimvlm.plan import build_methods
from trimvlm.recipe import load_recipes, parse_method, parse_recipe
from trimvlm.registry import REGISTRIES
from trimvlm.runtime.attention import NAME
from trimvlm.runtime.generate import Sampling
from trimvlm.testing import concurrent_runs, random_image

TOKENS = "tokens=density:keep=0.5:layer=1"
KV = "kv=snapkv:keep=0.25"
BOTH = f"{TOKENS},{KV}"


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return trimvlm.load(tiny_dir("qwen3_vl"))


@pytest.fixture(scope="module")
def demo():
    return trimvlm.load("demo")


# --------------------------------------------------------------------------------------------- images


@pytest.mark.parametrize(
    "images, prompts, message",
    [
        (
            None,
            ["what is", "the colour"],
            r"images is None for a batch of 2 prompts: give a list with one entry",
        ),
        ("photo.png", ["what is", "the colour"], r"images is 'photo.png' for a batch of 2 prompts"),
        (
            [[random_image(1)]],
            "what is",
            r"an image must be a PIL image or a file path, got a value of type list",
        ),
        ([3], "what is", r"an image must be a PIL image or a file path, got a value of type int"),
        ([None], ["what is", "the colour"], r"got 1 image lists for 2 prompts"),
        (
            None,
            "<|image_pad|> what is",
            r"a prompt contains the image token '<\|image_pad\|>': pass the images",
        ),
        (None, ["what is", 3], r"prompts must be a string or a list of strings"),
    ],
)
def test_bad_images_and_prompts(tiny, images, prompts, message):
    with pytest.raises(InputError, match=message):
        tiny.generate(images, prompts, max_new_tokens=1)


def test_text_only_and_one_image_still_work(tiny):
    assert len(tiny.generate(None, "what is", max_new_tokens=1).texts) == 1
    res = tiny.generate([[random_image(1)], None], ["what is", "the colour"], max_new_tokens=1)
    assert len(res.texts) == 2


# --------------------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ({"temperature": float("inf")}, "temperature must be a finite number >= 0"),
        ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
        ({"temperature": "0.7"}, "temperature must be a finite number >= 0"),
        ({"top_p": "high"}, r"top_p must be a number in \(0, 1\]"),
        ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be a number in \(0, 1\]"),
        ({"top_p": float("nan")}, r"top_p must be a number in \(0, 1\]"),
        ({"seed": True}, "seed must be an integer"),
        ({"seed": 1.0}, "seed must be an integer"),
        ({"seed": "3"}, "seed must be an integer"),
        ({"seed": 2**64}, "seed must be an integer"),
        ({"max_new_tokens": True}, "max_new_tokens must be a positive integer"),
    ],
)
def test_bad_sampling(tiny, kw, message):
    with pytest.raises(InputError, match=message):
        tiny.generate(None, "what is", **kw)
    kw.pop("max_new_tokens", None)
    if kw:
        with pytest.raises(InputError, match=message):
            Sampling(**kw)


def test_good_sampling_values():
    Sampling(temperature=0.7, top_p=1.0, seed=-3)
    Sampling(temperature=1, top_p=0.01, seed=2**64 - 1)


# --------------------------------------------------------------------------------------------- recipes


def test_one_method_per_axis_and_option():
    with pytest.raises(RecipeError, match=r"gives tokens= twice; one method per axis \(tokens, kv, depth, router\)"):
        parse_recipe("tokens=fastv:keep=0.5,tokens=random:keep=0.5")
    with pytest.raises(RecipeError, match=r"gives kv= twice"):
        parse_recipe("kv=h2o:keep=0.5,tokens=fastv:keep=0.5,kv=h2o:keep=0.25")
    with pytest.raises(RecipeError, match=r"option 'keep' given twice"):
        parse_recipe("tokens=fastv:keep=0.5:keep=0.25")


def test_option_values_are_parsed_explicitly():
    opts = parse_method(
        "m:a=010:b=1e-1:c=.5:d=-3:e=TRUE:f=false:g=off:h=no:i=yes:j=on:k=0x10:l=nan:m=rank.json"
    ).options
    assert opts == {
        "a": 10, "b": 0.1, "c": 0.5, "d": -3, "e": True, "f": False, "g": "off", "h": "no", "i": "yes",
        "j": "on", "k": "0x10", "l": "nan", "m": "rank.json",
    }  # fmt: skip
    assert isinstance(opts["a"], int) and isinstance(opts["b"], float)
    m = build_methods("tokens=density:keep=1e-1:layer=02")["tokens"]
    assert (m.keep, m.layer) == (0.1, 2)
    with pytest.raises(RecipeError, match="merge must be true or false, got 'off'"):
        build_methods("tokens=density:keep=0.5:merge=off")
    with pytest.raises(RecipeError):  # nan is a string, and keep must be a number
        build_methods("kv=density:keep=nan")


def test_yaml_values_follow_the_same_rules(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(
        "- {name: a, tokens: {method: density, keep: 1e-1, layer: 010, merge: off}}\n"
        "- {name: 010, tokens: {method: random, keep: 0.5, seed: 012}, kv: 'density:keep=1e-1:reuse=False'}\n"
        "- {name: c, tokens: {method: density, keep: 0.5, merge: False, select: '010'}}\n"
    )
    with pytest.raises(RecipeError, match="merge must be true or false, got 'off'"):  # not YAML 1.1's False
        [build_methods(r) for r in load_recipes(path)]  # a recipe file is data; its methods are built by plan
    text = path.read_text().replace("merge: off", "merge: FALSE")
    path.write_text(text)
    with pytest.raises(RecipeError, match="select"):  # a quoted '010' stays the string '010'
        [build_methods(r) for r in load_recipes(path)]
    path.write_text(text.replace("select: '010'", "select: fps"))
    base, a, b, c = load_recipes(path)
    assert base.is_baseline
    assert a.tokens.options == {"keep": 0.1, "layer": 10, "merge": False}
    assert b.name == "10" and b.tokens.options["seed"] == 12
    assert b.kv.options == {"keep": 0.1, "reuse": False}
    assert c.tokens.options == {"keep": 0.5, "merge": False, "select": "fps"}
    js = tmp_path / "r.json"  # JSON numbers YAML 1.1 reads as strings (1e-1) are numbers here too
    js.write_text(
        json.dumps([{"name": "j", "kv": {"method": "density", "keep": 0.1}}]).replace("0.1", "1e-1")
    )
    assert load_recipes(js)[1].kv.options == {"keep": 0.1}


# --------------------------------------------------------------------------------------------- tasks


def _jsonl(tmp_path, records):
    (tmp_path / "img").mkdir(exist_ok=True)
    random_image(0).save(tmp_path / "img" / "ok.png")
    (tmp_path / "img" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_jsonl_undecodable_image_is_refused_at_load(tmp_path):
    path = _jsonl(tmp_path, [
        {"id": "good", "image": "img/ok.png", "question": "what is", "answer": "red"},
        {"id": "bad", "image": "img/broken.png", "question": "what is", "answer": "red"},
    ])  # fmt: skip
    with pytest.raises(InputError, match=r"t.jsonl:2: record bad: image .*broken.png cannot be decoded"):
        get_task(str(path))
    assert len(load_jsonl(path, limit=1).records) == 1  # only the records used are opened


def test_prefill_record_with_a_multi_token_answer(tiny, tmp_path):
    path = _jsonl(tmp_path, [
        {"id": "one", "image": "img/ok.png", "question": "what is the colour", "answer": "red", "probe": "prefill"},
        {"id": "two", "image": "img/ok.png", "question": "what is the shape", "answer": "red circle",
         "probe": "prefill"},
    ])  # fmt: skip
    task = load_jsonl(path)
    calls = []
    real = tiny.generate

    class Counting:
        tokenizer = tiny.tokenizer

        def generate(self, *a, **kw):
            calls.append(1)
            return real(*a, **kw)

    with pytest.raises(InputError, match=r"record two: answer 'red circle' is 2 tokens, .*first 1 generated"):
        trimvlm.evaluate(Counting(), task, [], warmup=False, progress=False)
    assert calls == []  # refused before the run starts
    check_prefill_answers(load_jsonl(path, limit=1), tiny.tokenizer)  # a one-token answer is fine
    full = Task("t", [Record("f", [], "q", ["red circle"], probe="full")])
    check_prefill_answers(full, tiny.tokenizer)  # full probes read the whole answer
    wider = Task("t", [Record("w", [], "q", ["red circle"], probe="prefill")], prefill_tokens=2)
    check_prefill_answers(wider, tiny.tokenizer)
    opt = Task("t", [Record("o", [], "q", ["red circle"], options=["blue", "red circle"], probe="prefill",
                            metric="option")])  # fmt: skip
    check_prefill_answers(opt, tiny.tokenizer)  # an option item is answered by its letter


def test_demo_task_answers_fit_the_prefill_probe(demo):
    check_prefill_answers(get_task("demo", limit=120), demo.tokenizer)


# --------------------------------------------------------------------------------------------- real recipes


def _demo_inputs(n=2):
    from trimvlm.demo.task import generate_split

    samples = generate_split("test", n, seed=0)
    return (
        [[s.image] for s in samples],
        [s.qas[0].question for s in samples],
        [s.qas[0].answer for s in samples],
    )


def test_generate_with_real_recipes(demo):
    images, prompts, answers = _demo_inputs()
    base = demo.generate(images, prompts, max_new_tokens=4)
    assert base.texts == answers  # the demo model answers these
    for recipe in (TOKENS, KV, BOTH):
        res = demo.generate(images, prompts, recipe=recipe, max_new_tokens=4)
        assert res.recipe == recipe and len(res.texts) == 2 and all(res.texts), recipe
        assert all(t in ("yes", "no") for t in res.texts), (recipe, res.texts)  # existence questions
        c, b = res.costs, base.costs
        assert c.total_flops > 0 and c.kv_bytes > 0
        if "tokens=" in recipe:
            assert c.prefill_flops < b.prefill_flops
        if "kv=" in recipe:
            assert c.kv_bytes < b.kv_bytes
    assert (
        demo.generate(images, prompts, recipe=BOTH).costs.kv_bytes
        < demo.generate(images, prompts, recipe=TOKENS).costs.kv_bytes
    )


def test_evaluate_with_real_recipes(demo):
    res = trimvlm.evaluate(demo, "demo", [TOKENS, KV, BOTH], limit=12, batch_size=12, progress=False)
    assert res.labels == ["baseline", TOKENS, KV, BOTH]
    assert res.row("baseline", "all")["accuracy"] >= 0.8
    assert all(len(p) == 12 for p in res.predictions)
    for li, label in enumerate(res.labels[1:], 1):
        row = res.row(label, "all")  # accuracy: the mean item score; mismatch: answers unlike the baseline's
        assert row["accuracy"] == pytest.approx(sum(res.scores[li]) / 12)
        diff = sum(p != q for p, q in zip(res.predictions[li], res.predictions[0], strict=True))
        assert row["mismatch_pct"] == pytest.approx(100 * diff / 12)
        if "tokens=" in label:
            assert row["ratio"]["prefill_flops"] < 1.0, label
        if "kv=" in label:
            assert row["ratio"]["kv_bytes"] < 1.0, label
    assert res.row(KV, "prefill")["mismatch_pct"] == 0.0  # decode eviction cannot change the first token


# --------------------------------------------------------------------------------------------- threads


def test_attention_is_selected_once_on_the_decoder_only(tiny, monkeypatch):
    """The runner selects its attention when it takes the model, on the decoder's config only (the vision tower and
    the top-level config keep SDPA); a run writes no config, and a run after a user changed the decoder's
    implementation selects it again and answers as before."""
    ad = tiny.adapter
    assert ad.text_config._attn_implementation == NAME
    assert ad.model.config._attn_implementation == "sdpa" and ad.model.config.vision_config._attn_implementation == "sdpa"
    ref = tiny.generate([random_image(5)], "what is the colour", recipe="tokens=fastv:keep=0.5:layer=1")
    sets = []
    cls = type(ad.text_model)
    real = cls.set_attn_implementation
    monkeypatch.setattr(cls, "set_attn_implementation", lambda self, *a, **kw: (sets.append(a), real(self, *a, **kw)))
    res = tiny.generate([random_image(5)], "what is the colour", recipe="tokens=fastv:keep=0.5:layer=1")
    assert sets == [] and res.tokens == ref.tokens
    ad.text_model.set_attn_implementation("eager")
    res = tiny.generate([random_image(5)], "what is the colour", recipe="tokens=fastv:keep=0.5:layer=1")
    assert sets == [("eager",), (NAME,)] and res.tokens == ref.tokens
    assert ad.text_config._attn_implementation == NAME


def test_two_threads_equal_sequential_runs(tiny):
    image = [random_image(5)]
    recipes = ["tokens=fastv:keep=0.5:layer=1", None, "kv=h2o:keep=0.25"]

    def run(recipe):
        res = tiny.generate(image, "what is the colour", recipe=recipe, max_new_tokens=6)
        return res.tokens, res.costs.prefill_flops, res.costs.kv_bytes

    expected = {r: run(r) for r in recipes}
    got = concurrent_runs(run, recipes, 12)
    for r in recipes:
        assert got[r] == [expected[r]] * 12, r
    assert tiny.adapter.text_config._attn_implementation == NAME  # selected once, never switched by a run
    assert tiny.adapter.model.config.vision_config._attn_implementation == "sdpa"


# --------------------------------------------------------------------------------------------- imports


@pytest.mark.parametrize(
    "package", ["trimvlm.tokens", "trimvlm.kv", "trimvlm.depth", "trimvlm.router", "trimvlm.scoring"]
)
def test_every_method_module_imports(package):
    pkg = importlib.import_module(package)
    names = [m.name for m in pkgutil.walk_packages(pkg.__path__, prefix=f"{package}.")]
    assert names
    for name in names:
        importlib.import_module(name)  # any exception fails the test: nothing is skipped
    from trimvlm.registry import describe_methods, load_methods

    load_methods()
    # the registry holds exactly the methods the source files declare (`register("axis", "name")`, read from
    # the files), and at least one per axis
    expected = declared_methods()
    assert all(expected.values()), expected
    assert {axis: set(reg) for axis, reg in REGISTRIES.items()} == expected
    listed = describe_methods()
    assert {axis: {m["name"] for m in ms} for axis, ms in listed.items()} == expected
    assert all(m["summary"] for ms in listed.values() for m in ms)
