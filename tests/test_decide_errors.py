"""Bad decision requests: a clear `TrimVLMError` subclass naming what was wrong, never a deep library error."""

import base64
import io
import json

import pytest
import torch

import trimvlm
from trimvlm.decision import AssetError, DecisionError, Limits, QuestionError, RequestError
from trimvlm.errors import InputError, RecipeError, TrimVLMError
from trimvlm.testing import random_image

NOUL = {"type": "noul", "instructions": "is there a red circle ?"}


@pytest.fixture(autouse=True)
def _one():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def demo():
    return trimvlm.load("demo")


@pytest.fixture(scope="module")
def jev_text(tmp_path_factory):
    from trimvlm.testing.tiny_jev import tiny_jev

    return trimvlm.load(tiny_jev(tmp_path_factory.mktemp("jevt"), vision=False))


def png_base64(seed=0) -> str:
    buf = io.BytesIO()
    random_image(seed, (32, 32)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_error_classes():
    for cls in (RequestError, QuestionError, AssetError):
        assert (
            issubclass(cls, DecisionError) and issubclass(cls, InputError) and issubclass(cls, TrimVLMError)
        )


@pytest.mark.parametrize(
    ("request_", "cls", "message"),
    [
        ("{not json", RequestError, "not valid JSON"),
        ([1, 2], RequestError, "request 0: a request is .*got a int"),  # a list of non-requests
        ({"questions": {"a": NOUL}}, RequestError, "no 'state'"),
        ({"state": "x", "questions": {}}, RequestError, "at least one"),
        ({"state": "x", "questions": {"a": NOUL}, "extra": 1}, RequestError, "unknown request key"),
        ({"state": "x", "questions": {"a": NOUL}, "assets": ["<a>"]}, RequestError, "maps placeholders"),
        ({"state": "x", "questions": {"a": {"type": "maybe"}}}, QuestionError, "must be one of noul, choice, score"),
        ({"state": "x", "questions": {"a": {"type": "choice"}}}, QuestionError, "criteria"),
        ({"state": "x", "questions": {"a": {"type": "score", "criteria": ["a"], "bogus": 1}}}, QuestionError, "bogus"),
        ({"state": "x", "questions": {"a": NOUL}, "assets": {"<a>": png_base64()}}, AssetError, "not referenced"),
        ({"state": "<a>", "questions": {"a": NOUL}, "assets": {"<a>": "bm90IGFuIGltYWdl"}}, AssetError,
         "not a decodable image"),
        ({"state": "<a>", "questions": {"a": NOUL}, "assets": {"<a>": {"type": "image", "data_base64": "%%%"}}},
         AssetError, "not a decodable image"),
        ({"state": "<a>", "questions": {"a": NOUL}, "assets": {"<a>": {"type": "image"}}}, AssetError, "data_base64"),
        ({"state": "<a>", "questions": {"a": NOUL}, "assets": {"<a>": "https://example.com/x.png"}}, AssetError,
         "never fetches"),
        ({"state": "<a>", "questions": {"a": NOUL}, "assets": {"<a>": 42}}, AssetError, "has type int"),
    ],
)  # fmt: skip
def test_bad_requests(demo, request_, cls, message):
    with pytest.raises(cls, match=message):
        demo.decide(request_)


def test_too_many_questions_and_assets(demo):
    qs = {f"q{i}": NOUL for i in range(65)}
    with pytest.raises(QuestionError, match="too many questions: 65, at most 64"):
        demo.decide({"state": "x", "questions": qs})
    with pytest.raises(QuestionError, match="at most 2"):
        demo.decide({"state": "x", "questions": dict(list(qs.items())[:3])}, limits=Limits(max_questions=2))
    assets = {f"<{i}>": png_base64(i) for i in range(3)}
    with pytest.raises(AssetError, match="too many assets"):
        demo.decide(
            {"state": " ".join(assets), "questions": {"a": NOUL}, "assets": assets},
            limits=Limits(max_assets=2),
        )
    with pytest.raises(InputError, match="positive integer"):
        Limits(max_questions=0)


def test_paths_can_be_refused(demo, tmp_path):
    path = tmp_path / "a.png"
    random_image(0, (32, 32)).save(path)
    req = {"state": "<a>", "questions": {"a": NOUL}, "assets": {"<a>": str(path)}}
    assert demo.decide(req)["a"]["type"] == "noul"
    with pytest.raises(AssetError, match="file paths are not accepted"):
        demo.decide(req, limits=Limits(allow_paths=False))
    with pytest.raises(AssetError, match="bytes, at most 10"):
        demo.decide(req, limits=Limits(max_asset_bytes=10))


def test_refused_paths_never_ask_the_file_system(demo, tmp_path, monkeypatch):
    """Where paths are refused (a server), an asset's text is base64 or an error: an existing file and a missing
    one get the same answer, and no file is looked up or opened."""
    import builtins
    import os

    path = tmp_path / "a.png"
    random_image(0, (32, 32)).save(path)
    refused = Limits(allow_paths=False)

    def no_files(*args, **kwargs):
        raise AssertionError(f"the file system was asked: {args}")

    for name in ("isfile", "exists", "getsize"):
        monkeypatch.setattr(os.path, name, no_files)
    monkeypatch.setattr(builtins, "open", no_files)
    messages = []
    dict_asset = {"type": "image", "format": "png", "data_base64": str(path)}
    for value in (str(path), str(tmp_path / "missing.png"), dict_asset):
        req = {"state": "<a>", "questions": {"a": NOUL}, "assets": {"<a>": value}}
        with pytest.raises(AssetError, match="file paths are not accepted") as e:
            demo.decide(req, limits=refused)
        messages.append(str(e.value).replace(str(value if isinstance(value, str) else path), "PATH"))
    assert len(set(messages)) == 1, messages
    b64 = png_base64(0)
    for value in (b64, f"data:image/png;base64,{b64}", f"{b64[:60]}\n{b64[60:]}"):  # line breaks allowed
        req = {"state": "<a>", "questions": {"a": NOUL}, "assets": {"<a>": value}}
        assert demo.decide(req, limits=refused)["a"]["type"] == "noul"


def test_batch_error_names_the_request(demo):
    good = {"state": "x", "questions": {"a": NOUL}}
    bad = {"state": "x", "questions": {"a": {"type": "maybe"}}}
    with pytest.raises(QuestionError, match="^request 1: ") as e:
        demo.decide([good, bad])
    assert e.value.index == 1
    with pytest.raises(RequestError, match="no requests"):
        demo.decide([])


def test_recipes(demo):
    req = {"state": "x", "questions": {"a": NOUL}}
    with pytest.raises(RecipeError, match="decodes nothing"):
        demo.decide(req, recipe="kv=snapkv:keep=0.25")
    with pytest.raises(RecipeError, match="unknown tokens method"):
        demo.decide(req, recipe="tokens=nosuch:keep=0.5")


def test_bad_decision_configs(demo):
    from trimvlm.decision.demo_template import DEMO_TEMPLATE

    req = {"state": "x", "questions": {"a": NOUL}}
    with pytest.raises(DecisionError, match="single tokens"):
        demo.decide(
            req, decision_config={"labels": {"noul": ["yes please", "no"]}, "chat_template": DEMO_TEMPLATE}
        )
    with pytest.raises(DecisionError, match="invalid decision config"):
        demo.decide(req, decision_config={"labels": 3})
    with pytest.raises(DecisionError, match="not found"):
        demo.decide(req, decision_config="/no/such/decision.json")
    with pytest.raises(DecisionError, match="one per question"):
        demo.decide(
            req, decision_config={"chat_template": "{{ question.instructions }} <ans><|mark|><|mark|>"}
        )
    with pytest.raises(DecisionError, match="prompts could not be built"):
        demo.decide(req, decision_config={"chat_template": "{{ raise_exception('no') }}"})


def test_decision_config_from_a_file(demo, tmp_path):
    from transformers.decision import DecisionConfig

    from trimvlm.decision.demo_template import demo_decision_config

    cfg = demo_decision_config()
    cfg.temperature = {"noul": 3.0}
    cfg.save_pretrained(tmp_path)
    req = {"state": "x", "questions": {"a": NOUL}}
    by_path = demo.decide(req, decision_config=tmp_path / "decision.json")
    assert by_path == demo.decide(req, decision_config=tmp_path) == demo.decide(req, decision_config=cfg)
    assert by_path != demo.decide(req)  # the temperature applies
    assert isinstance(DecisionConfig.from_pretrained(tmp_path), DecisionConfig)


def test_jev_text_model_errors(jev_text):
    with pytest.raises(AssetError, match="reads no images"):
        jev_text.decide({"state": "<a>", "questions": {"a": NOUL}, "assets": {"<a>": png_base64()}})
    many = {f"o{i}": None for i in range(17)}  # JEV's choice rows are 8..23: 16 options at most
    with pytest.raises(QuestionError, match="at most 16 options"):
        jev_text.decide({"state": "x", "questions": {"a": {"type": "choice", "criteria": many}}})


def test_json_string_request(demo):
    req = {"state": "x", "questions": {"a": NOUL}}
    assert demo.decide(json.dumps(req)) == demo.decide(req)
