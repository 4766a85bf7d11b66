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


def _decoy(folder):
    """A scene.png in `folder` that differs from the fixture's: an empty background (no blue circle)."""
    from PIL import Image

    from trimvlm.demo.task import BACKGROUND_RGB, IMAGE_SIZE

    Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND_RGB).save(folder / "scene.png")
    return folder / "scene.png"


def test_relative_asset_is_read_beside_the_request_file_not_the_working_directory(
    requests_file, tmp_path, monkeypatch
):
    import trimvlm

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    decoy = _decoy(cwd)
    circle = json.loads((requests_file / "two.json").read_text())[1]
    on_decoy = trimvlm.load("demo").decide({**circle, "assets": {"<img>": str(decoy)}})
    assert on_decoy["c"]["noul"] < 0.5  # the decoy answers otherwise: reading it would fail the test below
    monkeypatch.chdir(cwd)
    out = tmp_path / "out.json"
    res = _cli("decide", "--model", "demo", "--request", requests_file / "two.json", "--json", out)
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["answers"][1]["c"]["noul"] > 0.5
    # a relative name with no file beside the request file is an error, even where the working directory has one
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "req.json").write_text(json.dumps(circle))
    res = _cli("decide", "--model", "demo", "--request", alone / "req.json")
    _one_line_error(res, f"no file scene.png in {alone}")


def test_request_file_paths_may_leave_its_folder_on_the_command_line(requests_file, tmp_path):
    import os

    circle = json.loads((requests_file / "two.json").read_text())[1]
    inner = tmp_path / "inner"
    inner.mkdir()
    up = os.path.relpath(requests_file / "scene.png", inner)
    assert up.startswith("..")
    out = tmp_path / "out.json"
    for name, value in (("up.json", up), ("abs.json", str(requests_file / "scene.png"))):
        (inner / name).write_text(json.dumps({**circle, "assets": {"<img>": value}}))
        res = _cli("decide", "--model", "demo", "--request", inner / name, "--json", out)
        assert res.exit_code == 0, res.output
        assert json.loads(out.read_text())["answers"]["c"]["noul"] > 0.5, name


def test_request_file_base64_text_is_an_image_not_a_file_name(requests_file, tmp_path, monkeypatch):
    one = json.loads((requests_file / "one.json").read_text())
    text = one["assets"]["<img>"]["data_base64"]
    circle = json.loads((requests_file / "two.json").read_text())[1]
    (tmp_path / "req.json").write_text(json.dumps({**circle, "assets": {"<img>": text}}))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out.json"
    res = _cli("decide", "--model", "demo", "--request", tmp_path / "req.json", "--json", out)
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["answers"]["c"]["noul"] > 0.5
