"""The `trimvlm` command: `--json PATH` everywhere results are produced, inline `--recipe` on eval, `--limit`
and `--max-new-tokens`, `trimvlm methods`, and bad input as one line on stderr with a non-zero exit."""

import json

import pytest

import trimvlm
from trimvlm.testing import random_image
from trimvlm.testing.cli import assert_one_line_error as _one_line_error
from trimvlm.testing.cli import run_cli as _cli

TOKENS = "tokens=density:keep=0.5:layer=1"
KV = "kv=snapkv:keep=0.25"
BOTH = f"{TOKENS},{KV}"


@pytest.fixture(scope="module")
def demo_vlm():
    import trimvlm

    return trimvlm.load("demo")


@pytest.fixture(scope="module")
def demo_image(tmp_path_factory):
    from trimvlm.demo.task import generate_split

    s = generate_split("test", 1, seed=0)[0]
    path = tmp_path_factory.mktemp("img") / "grid.png"
    s.image.save(path)
    return path, s.qas[0].question, s.qas[0].answer


def _tiny_task(folder, n=4):
    (folder / "img").mkdir(exist_ok=True)
    lines = []
    for i in range(n):
        random_image(i).save(folder / "img" / f"{i}.png")
        probe = "prefill" if i % 2 else "full"
        lines.append({"id": f"r{i}", "image": f"img/{i}.png", "question": "what is the colour", "answer": "red",
                      "probe": probe})  # fmt: skip
    path = folder / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_methods_lists_every_method_with_options(tmp_path):
    from trimvlm.registry import describe_methods

    out = tmp_path / "m.json"
    res = _cli("methods", "--json", out)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(describe_methods(), default=str))
    for axis in ("tokens=", "kv=", "depth="):
        assert axis in res.output
    for name in ("density", "fastv", "tome", "snapkv", "h2o", "streamingllm", "ranking", "tail"):
        assert name in res.output
    snapkv = next(m for m in data["kv"] if m["name"] == "snapkv")
    opts = {o["name"]: o for o in snapkv["options"]}
    assert opts["window"] == {"name": "window", "type": "int", "default": 32}
    assert opts["pool"]["default"] == "avg" and "keep" in opts
    assert snapkv["summary"].startswith("SnapKV")
    assert all(not o["name"].startswith("_") for ms in data.values() for m in ms for o in m["options"])
    assert "window: int = 32" in res.output


@pytest.mark.parametrize("recipe", ["", TOKENS, KV, BOTH])
def test_generate_writes_json_and_prints_text(demo_image, demo_vlm, tmp_path, recipe):
    image, question, answer = demo_image
    out = tmp_path / "g.json"
    res = _cli("generate", "--model", "demo", "--image", image, "--prompt", question, "--recipe", recipe,
               "--max-new-tokens", 4, "--json", out)  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert res.output.splitlines()[0] == data["text"] == answer
    assert data["recipe"] == (recipe or "baseline")
    ref = demo_vlm.generate([str(image)], question, recipe=recipe or None, max_new_tokens=4)
    want = json.loads(json.dumps(ref.costs.as_dict()))  # the command's costs are the API's, exactly
    for key in (
        "flops",
        "method_flops",
        "layer_flops",
        "total_flops",
        "kv_bytes",
        "kv_bytes_peak",
        "layers_run",
    ):
        assert data["costs"][key] == want[key], key
    assert (
        data["tokens"] == ref.tokens[0] and f"prefill {want['prefill_flops'] / 1e9:.3f} GFLOP" in res.output
    )


def test_generate_costs_fall_with_real_recipes(demo_image, tmp_path):
    image, question, _ = demo_image
    costs = {}
    for recipe in ("", TOKENS, KV):
        out = tmp_path / f"{len(costs)}.json"
        assert _cli("generate", "--model", "demo", "--image", image, "--prompt", question, "--recipe", recipe,
                    "--json", out).exit_code == 0  # fmt: skip
        costs[recipe] = json.loads(out.read_text())["costs"]
    assert costs[TOKENS]["prefill_flops"] < costs[""]["prefill_flops"]
    assert costs[KV]["kv_bytes"] < costs[""]["kv_bytes"]


def test_eval_inline_recipes_limit_and_new_tokens(tiny_dir, tmp_path, monkeypatch):
    task = _tiny_task(tmp_path)
    out = tmp_path / "e.json"
    res = _cli("eval", "--model", tiny_dir("qwen3_vl"), "--task", task, "--recipe", TOKENS, "--recipe", KV,
               "--recipe", BOTH, "--max-new-tokens", 3, "--batch-size", 2, "--json", out,
               "--plot", tmp_path / "e.png")  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert [r["label"] for r in data["recipes"]] == ["baseline", TOKENS, KV, BOTH]
    assert data["task"]["items"] == 4  # --limit unset: the whole task
    assert data["settings"]["max_new_tokens"] == 3
    by = {(r["recipe"], r["group"]): r for r in data["results"]}
    assert by[(TOKENS, "all")]["ratio"]["prefill_flops"] < 1.0
    assert by[(KV, "all")]["ratio"]["kv_bytes"] < 1.0
    assert by[(BOTH, "all")]["ratio"]["kv_bytes"] < by[(TOKENS, "all")]["ratio"]["kv_bytes"]
    assert all(len(t.split()) <= 3 for t in data["predictions"]["baseline"]["outputs"])

    recipes = tmp_path / "r.yaml"
    recipes.write_text("- {name: d, kv: 'density:keep=1e-1'}\n")
    res = _cli("eval", "--model", tiny_dir("qwen3_vl"), "--task", task, "--recipes", recipes, "--recipe", TOKENS,
               "--limit", 2, "--json", out, "--plot", tmp_path / "e.png")  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert [r["label"] for r in data["recipes"]] == ["baseline", "d", TOKENS]
    assert data["task"]["items"] == 2
    assert data["recipes"][1]["recipe"]["kv"]["options"] == {"keep": 0.1}

    # nothing is written unless asked; an unwritable output path is one line, not an OSError traceback
    monkeypatch.chdir(tmp_path)
    files = set(tmp_path.iterdir())
    res = _cli("eval", "--model", tiny_dir("qwen3_vl"), "--task", task, "--limit", 1)
    assert res.exit_code == 0, res.output
    assert "wrote" not in res.output and set(tmp_path.iterdir()) == files
    (tmp_path / "a-file").write_text("")
    _one_line_error(_cli("eval", "--model", tiny_dir("qwen3_vl"), "--task", task, "--limit", 1,
                         "--json", tmp_path / "a-file" / "x.json"), "cannot write")  # fmt: skip


def test_eval_defaults_to_the_whole_task(monkeypatch):
    import trimvlm.cli_eval

    seen = {}
    monkeypatch.setattr(trimvlm.cli_eval, "eval_command", lambda *a, **kw: seen.update(args=a, kw=kw))
    assert _cli("eval", "--task", "demo").exit_code == 0
    model, task, recipes_file, limit = seen["args"][:4]
    assert (limit, recipes_file, seen["kw"]["max_new_tokens"], seen["kw"]["recipes"]) == (
        None,
        None,
        None,
        [],
    )


def test_eval_on_the_demo_model_with_real_recipes(tmp_path):
    out = tmp_path / "d.json"
    res = _cli("eval", "--model", "demo", "--task", "demo", "--recipe", BOTH, "--limit", 12, "--batch-size", 12,
               "--json", out, "--plot", tmp_path / "d.png")  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    by = {(r["recipe"], r["group"]): r for r in data["results"]}
    assert by[("baseline", "all")]["accuracy"] >= 0.8
    assert by[(BOTH, "all")]["ratio"]["prefill_flops"] < 1.0 and by[(BOTH, "all")]["ratio"]["kv_bytes"] < 1.0


def test_info_and_score_write_json(tiny_dir, tmp_path):
    res = _cli("info", "--model", tiny_dir("qwen3_vl"), "--json", tmp_path / "i.json")
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "i.json").read_text())["family"] == "qwen3_vl"
    random_image(0).save(tmp_path / "x.png")
    res = _cli("score", "--model", tiny_dir("qwen3_vl"), "--image", tmp_path / "x.png", "--question", "what is",
               "--candidate", "red", "--candidate", "blue", "--json", tmp_path / "s.json")  # fmt: skip
    assert res.exit_code == 0, res.output
    assert len(json.loads((tmp_path / "s.json").read_text())["results"][0]["candidates"]) == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["--temperature", "nan"], "temperature must be a finite number >= 0"),
        (["--temperature", "-1"], "temperature must be a finite number >= 0"),
        (["--top-p", "0"], "top_p must be a number in (0, 1]"),
        (["--recipe", "tokens=fastv:keep=0.5,tokens=random:keep=0.5"], "gives tokens= twice"),
        (["--recipe", "tokens=density:keep=0.5:merge=off"], "merge must be true or false, got 'off'"),
        (["--recipe", "tokens=nosuch"], "unknown tokens method 'nosuch'; known: cdpruner, dart, density"),
        (["--image", "/no/such.png"], "image file not found"),
    ],
)
def test_generate_bad_input_is_one_line(tiny_dir, args, message):
    res = _cli("generate", "--model", tiny_dir("qwen3_vl"), "--prompt", "what is", *args)
    _one_line_error(res, message)


def test_eval_bad_input_is_one_line(tiny_dir, tmp_path):
    model = tiny_dir("qwen3_vl")
    task = _tiny_task(tmp_path)
    _one_line_error(_cli("eval", "--model", model, "--task", task, "--limit", 0), "limit must be a positive")
    _one_line_error(_cli("eval", "--model", model, "--task", task, "--recipe", "kv=h2o,kv=snapkv"),
                    "gives kv= twice")  # fmt: skip
    _one_line_error(_cli("eval", "--model", model, "--task", task, "--max-new-tokens", 0),
                    "max_new_tokens must be a positive integer")  # fmt: skip
    (tmp_path / "img" / "1.png").write_bytes(b"broken")
    _one_line_error(_cli("eval", "--model", model, "--task", task), "record r1: image")
    bad = tmp_path / "two.jsonl"
    bad.write_text(
        json.dumps({"id": "q2", "question": "what", "answer": "red circle", "probe": "prefill"}) + "\n"
    )
    _one_line_error(_cli("eval", "--model", model, "--task", bad, "--json", tmp_path / "x.json"),
                    "record q2: answer 'red circle' is 2 tokens")  # fmt: skip
    assert not (tmp_path / "x.json").exists()
    _one_line_error(_cli("eval", "--task", "demo-candidates", "--max-new-tokens", 3),
                    "max_new_tokens does not apply to the candidate task")  # fmt: skip


def test_device_and_dtype_options_on_every_model_command():
    for cmd in ("generate", "info", "demo", "eval", "score", "train-head", "calibrate"):
        res = _cli(cmd, "--help")
        assert "--device" in res.output and "--dtype" in res.output, cmd
    res = _cli("info", "--model", "demo", "--device", "nosuch")
    assert res.exit_code == 2 and "unknown device 'nosuch'" in res.output and "Traceback" not in res.output
    res = _cli("info", "--model", "demo", "--dtype", "int8")
    assert res.exit_code == 2 and "allowed: float32, bfloat16, float16" in res.output
    res = _cli("info", "--model", "demo", "--dtype", "bf16")
    assert res.exit_code == 0


def test_calibrate_block_influence_writes_a_ranking(tmp_path):
    out = tmp_path / "bi.json"
    res = _cli("calibrate", "--method", "block-influence", "--n", "6", "--json", out)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["method"] == "block-influence" and sorted(data["order"]) == list(range(data["num_layers"]))
    assert len(data["scores"]) == data["num_layers"] and data["fingerprint"]
    # it says which recipe reads what it wrote, and that recipe runs
    assert f"use it as the recipe depth=ranking:file={out}:budget=K" in " ".join(res.output.split())
    assert _cli("generate", "--prompt", "how many blue ?", "--recipe", f"depth=ranking:file={out}:budget=1").exit_code == 0
    _one_line_error(
        _cli("calibrate", "--method", "nosuch"), "allowed: candidates, block-influence, greedy-kl"
    )


def _params(cmd: str) -> dict:
    import typer

    from trimvlm.cli import app

    group = typer.main.get_command(app)
    return {p.name: p for p in group.commands[cmd].params}


def test_model_option_is_the_same_on_every_command():
    """Every command that loads a model takes `--model` with the same default ("demo"), the same help, and
    loads it with --device and --dtype."""
    import typer

    from trimvlm.cli import app

    commands = typer.main.get_command(app).commands
    with_model = sorted(c for c in commands if "model" in _params(c))
    assert set(with_model) >= {"generate", "info", "eval", "score", "train-head", "train-router", "calibrate",
                               "decide", "serve"}  # fmt: skip
    first = _params(with_model[0])["model"]
    for cmd in with_model:
        p = _params(cmd)
        assert p["model"].default == "demo" and p["model"].help == first.help, cmd
        assert p["model"].opts == ["--model"] and {"device", "dtype"} <= set(p), cmd


def test_max_new_tokens_is_the_one_flag_name():
    """`--max-new-tokens` on generate, eval and serve; no command spells it another way."""
    import typer

    from trimvlm.cli import app

    for cmd, c in typer.main.get_command(app).commands.items():
        flags = {o for p in c.params for o in p.opts}
        assert not {"--max-tokens", "--max-new", "--new-tokens"} & flags, cmd
    for cmd in ("generate", "eval", "serve"):
        assert _params(cmd)["max_new_tokens"].opts == ["--max-new-tokens"], cmd


@pytest.mark.parametrize(
    "args",
    [
        ["train-head"],  # default --out: the checkpoint's own folder
        ["train-head", "--model", "demo-qwen35", "--out", "{shipped}/qwen35"],
        ["train-router", "--out", "{shipped}/qwen3vl/router"],
        ["train-router", "--model", "demo-qwen35", "--out", "{shipped}"],
    ],
)
def test_train_commands_never_overwrite_a_shipped_checkpoint(args):
    """Without --overwrite, a training command aimed at a shipped demo checkpoint is refused before it
    loads or trains anything: one line naming the path and the flag; the shipped files are untouched."""
    from trimvlm.loading import DEMO_DIR

    before = {p: p.stat().st_mtime_ns for p in DEMO_DIR.rglob("*") if p.is_file()}
    res = _cli(*[a.format(shipped=DEMO_DIR) for a in args])
    _one_line_error(res, "is a shipped demo checkpoint")
    line = " ".join(res.output.split())
    assert "pass --overwrite" in line and str(DEMO_DIR) in line
    assert {p: p.stat().st_mtime_ns for p in DEMO_DIR.rglob("*") if p.is_file()} == before


def test_overwrite_guard_allows_other_folders_and_an_explicit_overwrite(tmp_path):
    from trimvlm.errors import InputError
    from trimvlm.loading import DEMO_DIR, refuse_shipped

    refuse_shipped(tmp_path / "head", overwrite=False)
    refuse_shipped(DEMO_DIR / "qwen3vl", overwrite=True)
    with pytest.raises(InputError, match="--overwrite"):
        refuse_shipped(DEMO_DIR / "qwen3vl" / ".." / "qwen35" / "router", overwrite=False)
    assert "--overwrite" in {o for p in _params("train-head").values() for o in p.opts}
    assert "--overwrite" in {o for p in _params("train-router").values() for o in p.opts}


def test_piped_tables_fold_at_100_columns_and_a_wider_width_keeps_rows_whole():
    """Piped (not a terminal, no COLUMNS), tables are laid out at 100 columns: the demo's layer-type row (143
    characters) is folded, never cut; with COLUMNS=200 it is one line."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}

    def info(**extra):
        res = subprocess.run([sys.executable, "-m", "trimvlm.cli", "info", "--model", "demo"], capture_output=True,
                             text=True, env=env | extra, timeout=300, stdin=subprocess.DEVNULL)  # fmt: skip
        assert res.returncode == 0, res.stderr
        return res.stdout

    piped = info()
    assert max(map(len, piped.splitlines())) <= 100 and "…" not in piped, piped
    assert "full_attention" in piped
    wide = info(COLUMNS="200")
    rows = [line for line in wide.splitlines() if "layer_types" in line]
    assert len(rows) == 1 and ", ".join(["full_attention"] * 6) in rows[0], wide
    widths = {len(line) for line in wide.splitlines() if line.startswith(("┃", "│", "┏", "└"))}
    assert len(widths) == 1 and widths.pop() > 100


def test_version_prints_the_package_version():
    from importlib.metadata import version

    res = _cli("--version")
    assert res.exit_code == 0 and res.output.strip() == f"trimvlm {version('trimvlm')}"


def test_version_without_an_installed_distribution_is_the_sources(monkeypatch):
    """Run from a checkout that is not installed, `--version` prints `trimvlm.__version__`."""
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    res = _cli("--version")
    assert res.exit_code == 0 and res.output.strip() == f"trimvlm {trimvlm.__version__}"


def test_the_version_is_the_latest_release():
    """pyproject.toml's version, `trimvlm.__version__` and CHANGELOG.md's latest release are one version."""
    import re
    import tomllib

    from conftest import REPO

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d\d-\d\d$", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert releases and project == trimvlm.__version__ == releases[0], (project, trimvlm.__version__, releases[:1])


def test_help_groups_the_commands_for_users_and_for_training():
    out = _cli("--help").output
    use, train = out.index("Use a model"), out.index("Train and calibrate")
    assert use < out.index("│ generate ") < train < out.index("│ train-router ")


def test_demo_image_writes_a_scene_and_its_questions_which_the_demo_model_answers(tmp_path):
    """The questions `demo-image` prints are ones the demo model answers: on its scene it gets them right."""
    import trimvlm
    from trimvlm.demo.task import make_sample, split_rng

    out = tmp_path / "scene.png"
    res = _cli("demo-image", out, "--seed", 3)
    assert res.exit_code == 0, res.output
    sample = make_sample(split_rng("test", 3))
    for qa in sample.qas:
        assert qa.question in res.output
    vlm = trimvlm.load("demo")
    texts = vlm.generate([str(out)] * 2, [sample.qas[0].question, sample.qas[3].question]).texts
    assert texts == [sample.qas[0].answer, sample.qas[3].answer]


def test_a_prompt_of_mostly_unknown_words_is_warned_about(demo_vlm, demo_image):
    import warnings

    from trimvlm.vlm import UnknownWordsWarning, unknown_words

    assert unknown_words(demo_vlm.tokenizer, "What is written here?") == ["What", "written", "here?"]
    assert unknown_words(demo_vlm.tokenizer, "how many blue ?") == []
    warned = _cli("generate", "--prompt", "What is written here?")
    assert warned.exit_code == 0 and "3 of the prompt's 4 words are unknown" in " ".join(warned.output.split())
    assert "unknown" not in _cli("generate", "--prompt", "how many blue ?").output
    path = str(demo_image[0])
    with pytest.warns(UnknownWordsWarning, match="3 of the prompt's 4 words"):
        demo_vlm.generate(path, "What is written here?", max_new_tokens=2)
    with pytest.warns(UnknownWordsWarning):
        demo_vlm.score(path, "Which colour is the big thing?", ["red", "blue"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownWordsWarning)
        demo_vlm.generate(path, "how many blue ?", max_new_tokens=2)


def test_unknown_words_warning_points_at_the_callers_line(demo_vlm, demo_image):
    import inspect
    import warnings

    from trimvlm.vlm import UnknownWordsWarning

    path = str(demo_image[0])
    for call in (
        lambda: demo_vlm.generate(path, "What is written here?", max_new_tokens=2),  # under torch's decorator
        lambda: demo_vlm.score(path, "Which colour is the big thing?", ["red", "blue"]),
    ):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", UnknownWordsWarning)
            call()
        found = [w for w in seen if issubclass(w.category, UnknownWordsWarning)]
        assert len(found) == 1, [str(w.message) for w in seen]
        assert found[0].filename == __file__, found[0].filename
        lines, first = inspect.getsourcelines(call)
        assert found[0].lineno == first, (found[0].lineno, first)


def test_methods_names_tuned_recipes_and_where_to_start():
    out = " ".join(_cli("methods").output.split())
    assert "tuned=FOLDER:budget=RATIO" in out and "Where to start" in out
    assert "papers/" not in out


def test_decide_counts_the_request_images_not_the_image_inputs(tmp_path, demo_image):
    path, _, _ = demo_image
    req = tmp_path / "req.json"
    req.write_text(json.dumps({"state": "<img>", "assets": {"<img>": str(path)}, "questions": {
        "a": {"type": "noul", "instructions": "is there a blue circle ?"},
        "b": {"type": "noul", "instructions": "is there a red square ?"}}}))  # fmt: skip
    out = " ".join(_cli("decide", "--request", req).output.split())
    assert "2 prompts" in out and "1 image (2 image inputs over the prompts)" in out and "image(s)" not in out
