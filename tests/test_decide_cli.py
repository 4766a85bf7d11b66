"""`trimvlm decide --model M --request req.json [--recipe R] [--json OUT]`: answers printed, JSON written with
`usage`, bad input as one line on stderr."""

import base64
import io
import json

import numpy as np
import pytest

from trimvlm.testing.cli import assert_one_line_error as _one_line_error
from trimvlm.testing.cli import run_cli as _cli


@pytest.fixture(scope="module")
def requests_file(tmp_path_factory):
    from trimvlm.demo.task import make_scene, render

    folder = tmp_path_factory.mktemp("req")
    image = render(make_scene(np.random.default_rng(0)))
    image.save(folder / "scene.png")
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    asset = {"type": "image", "format": "png", "data_base64": base64.b64encode(buf.getvalue()).decode()}
    questions = {
        "circle": {"type": "noul", "instructions": "is there a blue circle ?"},
        "yellow": {"type": "score", "instructions": "how many yellow ?", "criteria": ["0", "1", "2", "3"]},
    }
    one = {"state": {"photo": "<img>"}, "questions": questions, "assets": {"<img>": asset}}
    (folder / "one.json").write_text(json.dumps(one))
    two = [one, {"state": "<img>", "questions": {"c": questions["circle"]}, "assets": {"<img>": "scene.png"}}]
    (folder / "two.json").write_text(json.dumps(two))
    return folder


def test_decide_one_request(requests_file, tmp_path):
    import trimvlm

    out = tmp_path / "out.json"
    res = _cli("decide", "--model", "demo", "--request", requests_file / "one.json", "--json", out)
    assert res.exit_code == 0, res.output
    assert "circle" in res.output and "P(true)" in res.output and "input tokens" in res.output
    data = json.loads(out.read_text())
    req = json.loads((requests_file / "one.json").read_text())
    assert data["answers"] == trimvlm.load("demo").decide(req)
    assert data["usage"]["input_tokens"] > 0 and data["usage"]["output_tokens"] == 0
    assert data["usage"]["total_flops"] > 0 and data["recipe"] == "baseline"


def test_decide_batch_with_recipe_and_relative_image(requests_file, tmp_path):
    out = tmp_path / "out.json"
    res = _cli("decide", "--model", "demo", "--request", requests_file / "two.json", "--json", out)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert len(data["answers"]) == 2 and len(data["usage"]) == 2 and "request 1" in res.output
    assert (
        data["answers"][1]["c"]["noul"] > 0.5
    )  # the scene (read from a path next to the file) has a blue circle
    res = _cli("decide", "--model", "demo", "--request", requests_file / "two.json", "--recipe",
               "tokens=random:keep=0.5", "--json", out)  # fmt: skip
    assert res.exit_code == 0, res.output
    cut = json.loads(out.read_text())
    assert cut["recipe"] == "tokens=random:keep=0.5"
    assert cut["usage"][0]["layer_flops"] < data["usage"][0]["layer_flops"]


def test_decide_bad_input(requests_file, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"state": "x", "questions": {"a": {"type": "maybe"}}}))
    _one_line_error(_cli("decide", "--model", "demo", "--request", bad), "must be one of noul, choice, score")
    bad.write_text("{oops")
    _one_line_error(_cli("decide", "--model", "demo", "--request", bad), "not valid JSON")
    _one_line_error(_cli("decide", "--model", "demo", "--request", tmp_path / "none.json"), "cannot read")
    res = _cli(
        "decide", "--model", "demo", "--request", requests_file / "one.json", "--recipe", "kv=snapkv:keep=0.5"
    )
    _one_line_error(res, "decodes nothing")
