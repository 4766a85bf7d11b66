"""Bad input gets a clear TrimVLMError naming the problem."""

import json
from pathlib import Path

import pytest

import trimvlm
from trimvlm.errors import CheckpointError, InputError, RecipeError, UnsupportedModelError
from trimvlm.plan import build_methods
from trimvlm.recipe import parse_recipe


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        trimvlm.load(tmp_path / "nope")


def test_folder_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        trimvlm.load(tmp_path)


def test_unknown_family(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="unsupported model family 'gpt2'.*qwen3_vl"):
        trimvlm.load(tmp_path)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from trimvlm.testing import tiny_checkpoint

    return trimvlm.load(tiny_checkpoint("qwen3_vl", tmp_path_factory.mktemp("q")))


def test_image_that_is_not_an_image(vlm, tmp_path):
    bad = tmp_path / "x.png"
    bad.write_text("not an image")
    with pytest.raises(InputError, match="image unreadable"):
        vlm.generate(str(bad), "what is the colour")


def test_image_missing(vlm, tmp_path):
    with pytest.raises(InputError, match="image file not found"):
        vlm.generate(str(tmp_path / "none.png"), "what is the colour")


def test_empty_prompt(vlm):
    with pytest.raises(InputError, match="empty prompt"):
        vlm.generate(None, "   ")


@pytest.mark.parametrize("n", [0, -3])
def test_max_tokens_not_positive(vlm, n):
    with pytest.raises(InputError, match="max_new_tokens must be a positive integer"):
        vlm.generate(None, "what is", max_new_tokens=n)


def test_recipe_errors():
    with pytest.raises(RecipeError, match="unknown recipe axis 'colour'"):
        parse_recipe("colour=red")
    with pytest.raises(RecipeError, match="unknown tokens method 'nosuch'"):
        build_methods("tokens=nosuch:keep=0.5")
    with pytest.raises(RecipeError, match="not of the form option=value"):
        parse_recipe("tokens=density:keep")


def test_cli_reports_errors_without_traceback(tmp_path):
    from typer.testing import CliRunner

    from trimvlm.cli import app

    res = CliRunner().invoke(app, ["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"])
    assert res.exit_code == 2
    assert "checkpoint not found" in res.output
    assert "Traceback" not in res.output


def test_a_missing_extra_skips_and_fails_under_ci(monkeypatch):
    """An optional extra that does not import skips its tests, except under .ci/run (which installs every
    extra and sets TRIMVLM_REQUIRE_EXTRAS=1): there it fails them."""
    import conftest

    monkeypatch.setattr(conftest, "REQUIRE_EXTRAS", False)
    with pytest.raises(pytest.skip.Exception, match="no_such_extra_module cannot be imported"):
        conftest.need_extra("json", "no_such_extra_module")
    conftest.fail_if_required(None)
    monkeypatch.setattr(conftest, "REQUIRE_EXTRAS", True)
    with pytest.raises(pytest.fail.Exception, match="TRIMVLM_REQUIRE_EXTRAS is set"):
        conftest.need_extra("no_such_extra_module")
    with pytest.raises(pytest.fail.Exception, match="Ray cannot be imported"):
        conftest.fail_if_required("Ray cannot be imported (ImportError)")
    assert conftest.need_extra("json").dumps([1]) == "[1]"
    assert "export TRIMVLM_REQUIRE_EXTRAS=1" in (Path(__file__).parent.parent / ".ci" / "run").read_text()


def test_a_mistyped_model_or_task_gets_the_close_names():
    from trimvlm.evals.tasks import get_task

    with pytest.raises(CheckpointError, match=r"checkpoint not found: 'demoo' .*; did you mean demo\?$"):
        trimvlm.load("demoo")
    with pytest.raises(CheckpointError, match="checkpoint not found") as e:
        trimvlm.load("qqqq")
    assert "did you mean" not in str(e.value)
    with pytest.raises(InputError, match=r"unknown task 'scens'; .*; did you mean scenes\?$"):
        get_task("scens")
    with pytest.raises(InputError, match="unknown task") as e:
        get_task("nosuch")
    assert "did you mean" not in str(e.value)


def test_a_mistyped_checkpoint_folder_gets_its_neighbours(tmp_path):
    for name in ("model-small", "model-large", "notes"):
        (tmp_path / name).mkdir()
    for name in ("model-small", "model-large"):
        (tmp_path / name / "config.json").write_text("{}")
    with pytest.raises(CheckpointError) as e:
        trimvlm.load(tmp_path / "model-smal")
    assert str(e.value).endswith(f"did you mean {tmp_path / 'model-small'}?"), e.value
    with pytest.raises(CheckpointError) as e:
        trimvlm.load(tmp_path / "note")  # a folder that holds no checkpoint is not suggested
    assert "did you mean" not in str(e.value)


def test_cli_suggests_the_model_and_task_names():
    from trimvlm.testing.cli import assert_one_line_error, run_cli

    assert_one_line_error(run_cli("generate", "--model", "demoo", "--prompt", "hi"), "did you mean demo?")
    assert_one_line_error(run_cli("eval", "--model", "demo", "--task", "scens"), "did you mean scenes?")
