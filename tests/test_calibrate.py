"""Decision-guided pruning (FastJEV's P): J_l against a slow independent reference, the skip confined to the
candidate branches, tie order, the depth methods' checks, the calibrate command and the candidate eval."""

import json
import math

import numpy as np
import pytest
import torch
from conftest import ragged_batch

from trimvlm.cli_calibrate import calibrate_command
from trimvlm.errors import InputError, RecipeError
from trimvlm.plan import make_plan
from trimvlm.runtime.cache import KVCache
from trimvlm.runtime.meter import Meter
from trimvlm.scoring.calibrate import calibrate, rank_layers
from trimvlm.scoring.engine import prefill_requests, run_branches, run_scoring
from trimvlm.scoring.head import DecisionHead
from trimvlm.scoring.request import ScoreRequest
from trimvlm.vlm import VLM

CANDIDATES = [
    ["red circle", "red square", "blue", "yes"],
    ["one", "two", "three", "two red"],
    ["circle", "square triangle", "square"],
]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def requests() -> list[ScoreRequest]:
    images, prompts = ragged_batch()
    return [ScoreRequest(images[i], prompts[i], CANDIDATES[i]) for i in range(3)]


def skip_one(tmp_path, layer: int, n: int) -> str:
    """A recipe skipping exactly `layer` in the candidate branches, through a ranking file."""
    path = tmp_path / f"only-{layer}.json"
    path.write_text(json.dumps({"num_layers": n, "order": [layer] + [i for i in range(n) if i != layer]}))
    return f"depth=ranking:file={path}:budget=1:scope=candidates"


def reference_J(vlm, reqs, tmp_path, readout: str) -> list[float]:
    """The slow reference: the independent executor, the skip given as a recipe, the formula in numpy.
    loglik: each candidate scored alone (its own request); head: one request per input (the head's features
    read all candidates), still every candidate from its own prefix copy."""
    n = vlm.runner.num_layers

    def z(req, recipe):
        if readout == "loglik":
            return np.array(
                [
                    vlm.score(
                        [ScoreRequest(req.images, req.question, [c])], executor="independent", recipe=recipe
                    )
                    .results[0]
                    .candidates[0]
                    .loglik_sum
                    for c in req.candidates
                ]  # fmt: skip
            )
        res = vlm.score([req], readout="head", executor="independent", recipe=recipe).results[0]
        return np.array([c.logit for c in res.candidates] + [res.abstain_logit])

    def rms(v):
        return np.sqrt(np.mean(v**2))

    base = [z(r, None) for r in reqs]
    out = []
    for layer in range(n):
        recipe = skip_one(tmp_path, layer, n)
        d = []
        for r, z0 in zip(reqs, base, strict=True):
            delta = z(r, recipe) - z0
            d.append(rms(delta - delta.mean()) / max(1e-8, rms(z0 - z0.mean())))
        out.append(float(np.mean(d)))
    return out


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_J_matches_independent_reference_loglik(tiny_adapter, tmp_path, family):
    vlm = VLM(tiny_adapter(family))
    vlm.head = None
    reqs = requests()
    ref = reference_J(vlm, reqs, tmp_path, "loglik")
    for executor in ("auto", "batched", "segments"):
        # two batches: one padded pair and one single request, each prefilled once
        got = calibrate(vlm, reqs, "auto", batch_size=2, executor=executor)
        assert got["readout"] == "loglik"
        np.testing.assert_allclose(got["J"], ref, rtol=2e-4, atol=1e-7)
        assert got["order"] == sorted(range(len(ref)), key=lambda i: (ref[i], i))
    assert min(got["J"]) > 0  # every block of a random model moves the scores


def test_J_matches_independent_reference_head(tiny_adapter, tmp_path):
    vlm = VLM(tiny_adapter("qwen3_vl"))
    torch.manual_seed(0)
    vlm.head = DecisionHead(vlm.adapter.text_config.hidden_size, width=16).eval()
    reqs = requests()
    got = calibrate(vlm, reqs, "auto", batch_size=3)
    assert got["readout"] == "head"
    ref = reference_J(vlm, reqs, tmp_path, "head")
    np.testing.assert_allclose(got["J"], ref, rtol=2e-4, atol=1e-7)


def _cache_tensors(cache: KVCache) -> list[torch.Tensor]:
    out = []
    for i in sorted(cache.layers):
        e = cache.layers[i]
        out += [e.key, e.value, e.valid]
    for i in sorted(cache.states):
        out += [v for _, v in sorted(cache.states[i].items()) if v is not None]
    return [t.clone() for t in out]


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_skip_applies_to_candidate_branches_only(tiny_adapter, monkeypatch, family):
    vlm = VLM(tiny_adapter(family))
    reqs = requests()
    layer = 1
    # prefill once, then branches with and without the skip off the same prefix: the prefix is never written
    pre = prefill_requests(vlm, reqs, meter=Meter())
    before = _cache_tensors(pre.prefix.cache)
    logits_before = pre.prefix.logits.clone()
    written = []
    update = KVCache.update

    def spy(self, key, value, layer_idx, *a, **kw):
        written.append(layer_idx)
        return update(self, key, value, layer_idx, *a, **kw)

    monkeypatch.setattr(KVCache, "update", spy)
    for executor in ("independent", "batched", "segments", "tree"):
        run_branches(vlm, pre, executor=executor, skip_branch={layer}, meter=Meter())
        run_branches(vlm, pre, executor=executor, meter=Meter())
    attention = [i for i, t in enumerate(vlm.adapter.layer_types) if t == "full_attention"]
    written.clear()
    run_branches(vlm, pre, executor="independent", skip_branch={layer}, meter=Meter())
    written_skip = sorted(set(written))
    monkeypatch.setattr(KVCache, "update", update)
    assert layer not in written_skip  # the skipped block writes no branch KV
    assert written_skip == [i for i in attention if i != layer]
    after = _cache_tensors(pre.prefix.cache)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert torch.equal(pre.prefix.logits, logits_before)

    # a fresh prefill with the skip requested: the prefix is identical, the branches cheaper
    m_full, m_skip = Meter(), Meter()
    w_full, _, f_full, _ = run_scoring(vlm, reqs, executor="batched", meter=m_full)
    w_skip, _, f_skip, _ = run_scoring(vlm, reqs, executor="batched", meter=m_skip, skip_branch={layer})
    assert torch.equal(w_full.prefix.logits, w_skip.prefix.logits)
    assert torch.equal(w_full.prefix.seq.hidden, w_skip.prefix.seq.hidden)
    for a, b in zip(_cache_tensors(w_full.prefix.cache), _cache_tensors(w_skip.prefix.cache), strict=True):
        assert torch.equal(a, b)
    assert m_full.costs.flops["prefill"] == m_skip.costs.flops["prefill"]
    assert m_skip.costs.flops["branch"] < m_full.costs.flops["branch"]
    assert layer not in m_skip.costs.layer_flops["branch"]
    assert layer in m_full.costs.layer_flops["branch"]
    assert any(not torch.allclose(a, b) for a, b in zip(f_full.sums, f_skip.sums, strict=True))
    # the same through recipes: depth methods with scope=candidates leave the prefill alone
    base = vlm.score(reqs)
    for recipe in ("depth=tail:budget=1", "depth=random:budget=2:seed=3:scope=candidates"):
        res = vlm.score(reqs, recipe=recipe)
        assert res.costs.flops["branch"] < base.costs.flops["branch"]
        assert res.costs.flops["prefill"] == base.costs.flops["prefill"]
    everywhere = vlm.score(reqs, recipe="depth=tail:budget=1:scope=all")  # the contrast: prefill skips too
    assert everywhere.costs.flops["prefill"] < base.costs.flops["prefill"]


def test_ties_are_ordered_by_layer_index(tiny_dir):
    assert rank_layers([0.3, 0.1, 0.1, 0.0, 0.3]) == [3, 1, 2, 0, 4]
    assert rank_layers([0.0, 0.0, 0.0]) == [0, 1, 2]
    # end to end: two blocks made exact identities (zero output projections) both get J = 0
    from trimvlm.loading import load_adapter

    vlm = VLM(load_adapter(tiny_dir("qwen3_vl")))  # a fresh copy: its weights are changed below
    vlm.head = None
    for i in (2, 1):
        layer = vlm.adapter.layers[i]
        torch.nn.init.zeros_(layer.self_attn.o_proj.weight)
        torch.nn.init.zeros_(layer.mlp.down_proj.weight)
    got = calibrate(vlm, requests(), "loglik")
    assert got["J"][1] == 0.0 and got["J"][2] == 0.0
    assert got["order"][:2] == [1, 2]
    assert all(j > 0 for k, j in enumerate(got["J"]) if k not in (1, 2))


def test_depth_methods_choose_layers(tiny_adapter, tmp_path):
    runner = VLM(tiny_adapter("qwen3_vl")).runner  # 4 layers
    assert make_plan("depth=tail:budget=2", runner).skip_branch == {1, 2}  # the final block (3) is kept
    assert make_plan("depth=tail:budget=0", runner).skip_branch == frozenset()
    r2 = make_plan("depth=random:budget=2:seed=5", runner).skip_branch
    r3 = make_plan("depth=random:budget=3:seed=5", runner).skip_branch
    assert len(r2) == 2 and r2 < r3  # seeded, nested across budgets
    assert make_plan("depth=random:budget=2:seed=5", runner).skip_branch == r2
    rank = tmp_path / "rank.json"
    rank.write_text(json.dumps({"num_layers": 4, "order": [2, 0, 3, 1]}))
    plan = make_plan(f"depth=ranking:file={rank}:budget=2:scope=candidates", runner)
    assert plan.skip_branch == {0, 2} and plan.skip_prefill == frozenset()


def test_bad_inputs_have_clear_errors(tiny_adapter, tmp_path):
    vlm = VLM(tiny_adapter("qwen3_vl"))  # 4 layers
    other = tmp_path / "rank-other.json"
    other.write_text(json.dumps({"num_layers": 6, "order": [2, 3, 4, 1, 5, 0]}))
    with pytest.raises(RecipeError, match=r"computed for a model with 6 layers; this model has 4"):
        make_plan(f"depth=ranking:file={other}:budget=1", vlm.runner)
    with pytest.raises(RecipeError, match=r"ranking file not found: .*missing\.json"):
        make_plan(f"depth=ranking:file={tmp_path / 'missing.json'}:budget=1", vlm.runner)
    good = tmp_path / "rank.json"
    good.write_text(json.dumps({"num_layers": 4, "order": [0, 1, 2, 3]}))
    for recipe in (f"depth=ranking:file={good}:budget=4", "depth=tail:budget=4", "depth=random:budget=5"):
        with pytest.raises(RecipeError, match=r"budget \d must be below the layer count 4 \(0\.\.3\)"):
            vlm.score(requests()[:1], recipe=recipe)
    with pytest.raises(RecipeError, match=r"budget must be an integer >= 0"):
        make_plan("depth=tail:budget=-1", vlm.runner)
    with pytest.raises(RecipeError, match=r"depth scope 'prefix' unknown"):
        make_plan("depth=random:budget=1:scope=prefix", vlm.runner)
    with pytest.raises(RecipeError, match=r"'order' must list at least 2 distinct layers"):
        bad = tmp_path / "dupes.json"
        bad.write_text(json.dumps({"num_layers": 4, "order": [1, 1, 2, 3]}))
        make_plan(f"depth=ranking:file={bad}:budget=2", vlm.runner)
    vlm.head = None
    with pytest.raises(InputError, match=r"readout 'head' needs a trained decision head"):
        calibrate(vlm, requests(), "head")
    with pytest.raises(InputError, match=r"unknown readout 'best'; allowed: auto, loglik, head"):
        calibrate(vlm, requests(), "best")
    with pytest.raises(InputError, match=r"calibration needs at least one input"):
        calibrate(vlm, [], "loglik")
    # the command checks its inputs before any model loads
    with pytest.raises(InputError, match=r"unknown calibration task 'okvqa'; allowed: demo"):
        calibrate_command(model="demo", task="okvqa", n=4, json_out=None)
    for n in (0, -3, 2.5):
        with pytest.raises(InputError, match=r"n must be a positive number of calibration inputs"):
            calibrate_command(model="demo", task="demo", n=n, json_out=None)


def test_calibrate_command_and_candidate_eval_on_demo(tmp_path):
    from rich.console import Console

    from trimvlm.cli_eval import eval_command

    console = Console(file=open(tmp_path / "out.txt", "w"), width=200)
    rank = tmp_path / "rank.json"
    data = calibrate_command(model="demo", task="demo", n=6, seed=1, json_out=rank, console=console)
    saved = json.loads(rank.read_text())
    assert saved == data
    # the one ranking-file format (every method writes it)
    assert set(saved) == {"method", "model", "fingerprint", "family", "num_layers", "scores", "order", "calibration"}
    assert saved["calibration"] == {"task": "demo", "split": "val", "seed": 1, "n": 6, "readout": "head"}
    assert saved["num_layers"] == 6 and saved["method"] == "candidates"
    assert sorted(saved["order"]) == list(range(6)) and all(j > 0 for j in saved["scores"])

    recipes = tmp_path / "r.yaml"
    recipes.write_text(
        "recipes:\n"
        f"  - {{name: rank_k0, depth: 'ranking:file={rank}:budget=0'}}\n"
        f"  - {{name: rank_k2, depth: 'ranking:file={rank}:budget=2'}}\n"
        "  - {name: tail_k2, depth: 'tail:budget=2'}\n"
    )
    out = eval_command(
        "demo", "demo-candidates", str(recipes), limit=12, json_out=str(tmp_path / "s.json"),
        plot_out=str(tmp_path / "s.png"), batch_size=4, progress=False, console=console,
        markdown_out=str(tmp_path / "s.md"),
    )  # fmt: skip
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "s.json").read_text())["task"]["items"] == 12
    rows = {r["recipe"]: r for r in out["results"] if r["group"] == "all"}
    depth = {r["label"]: r["depth"] for r in out["recipes"]}
    assert list(rows) == ["baseline", "rank_k0", "rank_k2", "tail_k2"]
    base, k0, k2 = rows["baseline"], rows["rank_k0"], rows["rank_k2"]
    kinds = {r["group"] for r in out["results"] if r["group_type"] == "kind"}
    assert kinds == {"exist", "mc", "color", "count", "list", "read"}
    assert base["retention"] == 1.0 and base["agreement"] == 1.0 and base["ratio"]["branch_flops"] == 1.0
    assert k0["agreement"] == 1.0 and k0["ratio"]["branch_flops"] == 1.0
    assert depth["rank_k2"]["skipped_branch"] == sorted(saved["order"][:2])
    assert depth["tail_k2"]["skipped_branch"] == [3, 4]
    assert math.isclose(k2["ratio"]["branch_flops"], rows["tail_k2"]["ratio"]["branch_flops"], rel_tol=0.05)
    assert k2["ratio"]["branch_flops"] < 0.8
    kinds_ret = [r["retention"] for r in out["results"]
                 if r["recipe"] == "rank_k2" and r["group_type"] == "kind" and r["retention"] is not None]  # fmt: skip
    assert math.isclose(k2["retention"], sum(kinds_ret) / len(kinds_ret))
    assert set(out["largest_budget_90"]) == {"ranking[file=rank.json]", "tail"}
    assert out["largest_budget_90"]["tail"]["tested"] == [2]
    md = (tmp_path / "s.md").read_text()
    assert md.startswith("| recipe | skipped | candidates acc |") and "KV peak" in md
    assert "largest budget with >= 90% retention" in md
    with pytest.raises(InputError, match=r"max_new_tokens does not apply"):
        eval_command(
            "demo", "demo-candidates", None, limit=2, max_new_tokens=4, progress=False, console=console
        )


def test_largest_budget_is_the_largest_tested_budget_meeting_90_percent():
    from trimvlm.evals.run import largest_budgets

    def row(ranker, budget, retention):
        return {
            "recipe": f"{ranker}{budget}",
            "retention": retention,
            "depth": {"ranker": ranker, "budget": budget},
        }

    rows = [{"recipe": "baseline", "retention": 1.0, "depth": None}]
    rows += [row("a", 0, 1.0), row("a", 1, 0.95), row("a", 2, 0.85), row("a", 3, 0.91)]  # not monotonic
    rows += [row("b", 1, 0.5), row("b", 2, 0.2)]
    got = largest_budgets(rows, [r["depth"] for r in rows])
    assert got["a"]["budget"] == 3 and got["a"]["retention"] == 0.91 and got["a"]["tested"] == [0, 1, 2, 3]
    assert got["b"]["budget"] is None and got["b"]["tested"] == [1, 2]
    assert "baseline" not in got


def test_one_ranking_file_format_round_trip(tiny_adapter, tmp_path):
    """A layer ranker's file and the candidates method's file have the same keys; each reads back through
    depth=ranking (trimvlm.depth.ranking.read_ranking) and skips the first K of its order."""
    import trimvlm.depth  # noqa: F401  (registers the rankers)
    from trimvlm.depth.calibration import rank, ranking_data, write_ranking
    from trimvlm.depth.ranking import read_ranking
    from trimvlm.evals.tasks import calibration_items

    vlm = VLM(tiny_adapter("qwen3_vl"))
    vlm.head = None
    records = [r for r in calibration_items("demo", 6, 0) if r.kind == "exist"][:1]
    layer = rank(vlm, "block-influence", records, calibration={"task": "demo", "split": "val", "seed": 0}, model="tiny")
    res = calibrate(vlm, requests()[:1], "loglik")
    cand = ranking_data(vlm, "candidates", res["J"], res["order"], {"n": 1, "readout": "loglik"}, "tiny")
    assert set(layer) == set(cand) == {"method", "model", "family", "fingerprint", "num_layers", "scores", "order",
                                       "calibration"}  # fmt: skip
    for data in (layer, cand):
        path = write_ranking(data, tmp_path / f"{data['method']}.json")
        assert json.loads(path.read_text()) == data
        back = read_ranking(path)
        assert back == {"order": data["order"], "num_layers": 4, "fingerprint": data["fingerprint"]}
        plan = make_plan(f"depth=ranking:file={path}:budget=2:scope=candidates", vlm.runner)
        assert plan.skip_branch == frozenset(data["order"][:2])
