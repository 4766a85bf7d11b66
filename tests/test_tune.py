"""trimvlm tune: predicted costs equal measured ones, the search never runs a recipe over its predicted budget,
it is seeded and resumable, it never reads the test split, its recipes round-trip, and bad input is one line."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import AVAILABLE, ragged_batch

import trimvlm
from trimvlm.errors import TrimVLMError
from trimvlm.evals.run import batches, run_eval
from trimvlm.evals.tasks import demo_task
from trimvlm.recipe import parse_recipe
from trimvlm.tune import Settings, search
from trimvlm.tune.budgets import budget_points
from trimvlm.tune.predict import predict, read_shapes
from trimvlm.tune.report import write_report
from trimvlm.tune.space import load_space

SPACE = """
tokens:
  - {method: fastv, layer: [2, 9]}
  - {method: random, layer: [0]}
kv:
  - {method: snapkv, keep: [0.5]}
depth:
  - {method: block-influence, budget: [1]}
  - {method: tail, budget: [1]}
combine: [tokens, tokens+kv, tokens+depth, depth]
"""
SMALL = {"n_val": 16, "n_test": 12, "settings": Settings(start=8, batch_size=8), "progress": False}


@pytest.fixture(scope="module")
def demo():
    return trimvlm.load("demo")


@pytest.fixture
def space(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text(SPACE)
    return path


@pytest.mark.parametrize("model", ["demo", "demo-qwen35"])
def test_predicted_costs_equal_measured(model, one_thread):
    vlm = trimvlm.load(model)
    task = demo_task(limit=14, seed=0, split="val")
    recipes = ["tokens=fastv:keep=0.37:layer=2", "tokens=random:keep=0.2:layer=0,kv=snapkv:keep=0.3",
               "depth=tail:budget=1:scope=all,tokens=fastv:keep=0.5:layer=4", "kv=h2o:keep=0.1",
               "tokens=visionzip:keep=0.3,depth=skip:layers=1:scope=prefill", "tokens=downsample:keep=0.3",
               "tokens=downsample:keep=0.6,kv=snapkv:keep=0.4,depth=tail:budget=1:scope=all"]  # fmt: skip
    res = run_eval(vlm, task, recipes, batch_size=5, warmup=False, memory="off", progress=False)
    shapes = read_shapes(vlm, task, batches(task, 5))
    for r in ["baseline", *recipes]:
        p, got = predict(vlm, r, shapes), res.row(parse_recipe(r).label())["costs"]["sum"]
        assert (p.prefill_flops, p.kv_bytes) == (got["prefill_flops"], got["kv_bytes"]), r
    if model == "demo":  # a router's layout follows the input: not predicted, run
        assert predict(vlm, "router=demo:token_keep=0.5:layers_skip=1", shapes) is None


def _runs(monkeypatch):
    """Every recipe the search's harness calls run, with the items of each call."""
    calls = []
    real = run_eval

    def spy(vlm, task, recipes, **kw):
        calls.append(([r["name"] for r in recipes], [r.id for r in task.records]))
        return real(vlm, task, recipes, **kw)

    monkeypatch.setattr("trimvlm.evals.run.run_eval", spy)
    return calls


def test_never_runs_over_predicted_budget_and_never_reads_test(demo, space, tmp_path, monkeypatch, one_thread):
    calls = _runs(monkeypatch)
    point = {"prefill_flops": 0.8, "kv_bytes": 0.6}
    rep = search.tune(demo, "demo", [f"{a}={v}" for a, v in point.items()], space=space, out=tmp_path / "t", **SMALL)
    val = {r.id for r in demo_task(limit=16, seed=0, split="val").records}
    test = {r.id for r in demo_task(limit=12, seed=0, split="test").records}
    *searching, final = calls
    assert searching and all(set(ids) <= val for _, ids in searching)  # the search reads validation items only
    assert set(final[1]) == test and not test & val
    lines = [json.loads(line) for line in (tmp_path / "t" / "journal.jsonl").read_text().splitlines()]
    journal = [e["row"] for e in lines if not e["key"].endswith("|baseline")]
    assert len(journal) > 5
    for row in journal:  # prediction is exact: nothing run is over budget on a predicted axis
        assert row["ratio"]["prefill_flops"] <= point["prefill_flops"] + 1e-9
        assert row["ratio"]["kv_bytes"] <= point["kv_bytes"] + 1e-9
    assert any("predicted" in s["why"] for s in rep["skipped"])  # the depth-only family: over budget, not run
    assert any("refused by the model" in s["why"] for s in rep["skipped"])  # fastv at layer 9 of 6: never run


def _frontier(rep, out):
    """The frontier and the rankings, with the folder (ranking files live in it) taken out of the specs."""
    strip = json.dumps([{a: rep["frontier"][a] for a in ("total_flops", "kv_bytes")},
                        [b["ranking"] for b in rep["budgets"]]]).replace(str(out), "OUT")  # fmt: skip
    return json.loads(strip)


def test_seeded_resumable_and_round_trip(demo, space, tmp_path, monkeypatch, one_thread):
    budgets = ["total_flops=0.8", "total_flops=0.7"]
    whole = search.tune(demo, "demo", budgets, space=space, out=tmp_path / "a", **SMALL)
    again = search.tune(demo, "demo", budgets, space=space, out=tmp_path / "b", **SMALL)
    assert _frontier(whole, tmp_path / "a") == _frontier(again, tmp_path / "b")  # the same seed, the same frontier

    class Killed(Exception):
        pass

    def kill_after(n):
        count = {"calls": 0}

        def on_run(_):
            count["calls"] += 1
            if count["calls"] >= n:
                raise Killed

        return on_run

    with pytest.raises(Killed):
        search.tune(demo, "demo", budgets, space=space, out=tmp_path / "c", on_run=kill_after(3), **SMALL)
    calls = _runs(monkeypatch)
    resumed = search.tune(demo, "demo", budgets, space=space, out=tmp_path / "c", **SMALL)
    assert _frontier(resumed, tmp_path / "c") == _frontier(whole, tmp_path / "a")
    assert len(calls) < 1 + sum(1 for _ in (tmp_path / "a" / "journal.jsonl").open())  # finished work not rerun
    # a tuned recipe is a recipe: it gives the figures the report shows for it, on the same test items
    write_report(resumed, tmp_path / "c")
    best = next(b for b in resumed["budgets"] if b["budget"] == {"total_flops": 0.7})
    entry = next(e for e in resumed["entries"] if e["spec"] == best["best"])
    test = demo_task(limit=12, seed=0, split="test")
    for recipe in ("tuned=" + str(tmp_path / "c") + ":budget=0.7", str(tmp_path / "c" / "best-total_flops-0.7.yaml")):
        row = run_eval(demo, test, [recipe], batch_size=8, progress=False).row("tuned-total_flops=0.7")
        assert row["accuracy"] == entry["test"]["accuracy"]
        assert row["ratio"]["total_flops"] == pytest.approx(entry["test"]["ratio"]["total_flops"], rel=1e-12)
        assert row["ratio"]["total_flops"] <= 0.7 + 0.02


def test_bad_input_one_line_errors(demo, space, tmp_path, one_thread):
    cases = [lambda: budget_points(["total_flops=0"]), lambda: budget_points(["total_flops=1.5"]),
             lambda: budget_points(["flops=0.5"]), lambda: budget_points(["total_flops"]),
             lambda: search.check_splits("tasks.jsonl", "val", "test", None),
             lambda: search.check_splits("demo-candidates-nosuch", "val", "test", None)]  # fmt: skip
    for text, want in [("tokens:\n  - {method: nosuch}\n", "nosuch"),
                       ("tokens:\n  - {method: fastv, bogus: [1]}\n", "bogus"),
                       ("tokens:\n  - {method: fastv, keep: [0.5]}\n", "free knob"),
                       ("combine: [tokens+nothing]\n", "combine")]:  # fmt: skip
        bad = tmp_path / f"bad{len(cases)}.yaml"
        bad.write_text(text)
        cases.append(lambda bad=bad: load_space(bad))
        with pytest.raises(TrimVLMError, match=want):
            load_space(bad)
    for case in cases:
        with pytest.raises(TrimVLMError) as e:
            case()
        assert "\n" not in str(e.value)
    # a tuned folder from another model
    rep = search.tune(demo, "demo", ["total_flops=0.8"], space=space, out=tmp_path / "t", **SMALL)
    write_report(rep, tmp_path / "t")
    other = trimvlm.load("demo-qwen35")
    with pytest.raises(TrimVLMError, match="tuned for another model") as e:
        other.generate(None, "hi", recipe=f"tuned={tmp_path / 't'}:budget=0.8", max_new_tokens=1)
    assert "\n" not in str(e.value)
    with pytest.raises(TrimVLMError, match="it has: total_flops=0.8"):
        parse_recipe(f"tuned={tmp_path / 't'}:budget=0.5")


def test_cli_tune_writes_the_folder(space, tmp_path, one_thread):
    from typer.testing import CliRunner

    from trimvlm.cli import app

    out = tmp_path / "cli"
    args = ["tune", "--model", "demo", "--budget", "total_flops=0.75", "--space", str(space), "--n-val", "16",
            "--n-test", "8", "--batch-size", "8", "--out", str(out)]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    for name in ("tune.json", "best.yaml", "best-total_flops-0.75.yaml", "frontier.md", "frontier.png"):
        assert (out / name).exists(), name
    (out / "best-total_flops-0.5.yaml").write_text("{}")  # an earlier search's files in the same folder
    (out / "recipes" / "99.yaml").write_text("{}")
    again = CliRunner().invoke(app, args)  # the same search again (its journal: nothing runs twice)
    assert again.exit_code == 0, again.output
    assert not (out / "best-total_flops-0.5.yaml").exists() and not (out / "recipes" / "99.yaml").exists()
    assert (out / "best-total_flops-0.75.yaml").exists()
    bad = CliRunner().invoke(app, [*args[:3], "--budget", "latency=2", "--out", str(out)])
    assert bad.exit_code == 2 and "(0, 1]" in bad.output


def test_a_moved_tune_folder_finds_its_ranking_files(tmp_path):
    """A tuned recipe's ranking file lives in its tune folder: copied elsewhere (docs/results), the recipe
    file and tuned=DIR still find it there."""
    import yaml

    (tmp_path / "rankings").mkdir()
    (tmp_path / "rankings" / "block-influence.json").write_text("{}")
    recipe = {"name": "t", "tokens": "fastv:keep=0.5:layer=2", "tuned_for": "abc",
              "depth": "ranking:file=gone/rankings/block-influence.json:budget=1:scope=all"}  # fmt: skip
    (tmp_path / "best.yaml").write_text(yaml.safe_dump(recipe))
    got = parse_recipe(str(tmp_path / "best.yaml"))
    assert got.depth.options["file"] == str(tmp_path / "rankings" / "block-influence.json")
    assert got.tokens.options == {"keep": 0.5, "layer": 2}


def test_budgets_are_judged_on_all_the_validation_items(tmp_path, one_thread):
    """With images of several sizes (demo-scenes) a round's few items cost differently from all of them: the keep
    is bisected on all the validation items, and a measured ratio is projected to them (its own offset kept)."""
    from trimvlm.evals.tasks import get_task
    from trimvlm.tune.journal import Journal, local_evaluator
    from trimvlm.tune.space import Family

    vlm = trimvlm.load("demo-scenes")
    val = get_task("scenes", limit=12, seed=0, split="val", progress=False)
    journal = Journal(vlm, val, tmp_path, batch_size=6, fingerprint="fp", evaluate=local_evaluator(vlm))
    s = search.Search(vlm, val, load_space(None, rankings=tmp_path), journal, Settings(start=4, batch_size=6))
    rounds = search.round_items(12, 4, 3, 0)
    s.full = rounds[-1]
    fam = Family("density_l0", {"tokens": "density:keep={keep}:layer=0"}, free=True)
    few = s.predicted(fam.recipe(0.25), rounds[0])["prefill_flops"]
    full = s.predicted(fam.recipe(0.25), rounds[-1])["prefill_flops"]
    assert abs(few - full) > 0.005  # the item sets cost differently (else this test shows nothing)
    point = {"prefill_flops": full}
    cand = search.Candidate(fam)
    cand.keep = s.bisect(cand, point, rounds[0])
    on_all = s.predicted(fam.recipe(cand.keep), rounds[-1])["prefill_flops"]
    assert on_all <= full + 1e-12 and cand.keep == pytest.approx(0.25, abs=0.01)  # the keep that meets it on all
    cand.row = journal.run([cand.recipe], rounds[0])[cand.spec]
    measured = cand.row["ratio"]["prefill_flops"]
    assert measured == pytest.approx(s.predicted(cand.recipe, rounds[0])["prefill_flops"], rel=1e-9)
    assert s.projected(cand, rounds[0])["prefill_flops"] == pytest.approx(on_all, rel=1e-9)
    cand.row = journal.run([cand.recipe], rounds[-1])[cand.spec]
    assert s.projected(cand, rounds[-1]) == cand.row["ratio"]  # the last round's items are all of them


@pytest.mark.parametrize("family", AVAILABLE)
def test_layout_seq_lays_the_batch_out_as_embed_does(vlms, family):
    """The shapes are read without the vision tower: `Adapter.layout_seq` gives embed's layout exactly."""
    vlm = vlms(family)
    prep = vlm.prepare(*ragged_batch())
    full, shape = vlm.adapter.embed(prep), vlm.adapter.layout_seq(prep)
    assert shape.hidden.shape == (*full.hidden.shape[:2], 0)
    for name in ("valid", "visual", "image_id", "source", "size"):
        assert torch.equal(getattr(shape, name), getattr(full, name)), name
    assert (shape.grids, shape.image_start, shape.tile_image) == (full.grids, full.image_start, full.tile_image)
    assert int(full.visual.sum()) > 0


def test_shapes_run_the_vision_tower_once_per_input_shape(monkeypatch, one_thread):
    """Reading a task's shapes (and again at a downsampling resolution) runs the tower only to count the FLOPs
    of an input shape not seen before, never once per batch."""
    vlm = trimvlm.load("demo")
    task = demo_task(limit=20, seed=0, split="val")
    calls, real = [], vlm.adapter.embed
    monkeypatch.setattr(vlm.adapter, "embed", lambda *a, **k: calls.append(1) or real(*a, **k))
    shapes = read_shapes(vlm, task, batches(task, 5))
    predict(vlm, "tokens=downsample:keep=0.3", shapes)
    predict(vlm, "tokens=downsample:keep=0.3", shapes)  # the resized shapes are remembered
    seen = {vlm.adapter.vision_key(vlm.prepare(*s.inputs)) for s in shapes}  # batches of the same image count
    assert len(seen) < len(shapes)
    assert len(calls) == 2 * len(seen)  # each input shape once at each of the two resolutions
