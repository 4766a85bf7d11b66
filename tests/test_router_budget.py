"""Router v2 (`router=PATH:budget=B`, router/budget.py): trained on layouts at several keeps and skip sets, it
chooses each input's layout under a total-FLOP budget. budget 1 is the unpruned model, a batch's mean total
FLOPs meets the budget, a ragged batch of per-input layouts equals each input alone, and bad input is refused."""

from __future__ import annotations

import pytest
import torch

import trimvlm
from trimvlm.errors import RecipeError
from trimvlm.evals.run import run_eval
from trimvlm.evals.tasks import calibration_items
from trimvlm.evals.tasks.base import Task
from trimvlm.router.budget import BudgetTable
from trimvlm.training.router import all_subsets, preference_pairs, train_router


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    torch.set_num_threads(1)
    vlm = trimvlm.load("demo")
    records = calibration_items("demo", 12, 0)
    out = tmp_path_factory.mktemp("router-v2")
    log = train_router(vlm, records, epochs=2, seed=0, layer=2, keeps=[0.3, 0.6, 1.0], max_skip=1, out=out,
                       width=32, lr=3e-3, budgets=[0.8, 0.9])  # fmt: skip
    return vlm, records, out, log


def test_budget_one_is_the_unpruned_model(trained):
    vlm, records, out, _ = trained
    images, prompts = [list(r.images) for r in records[:4]], [r.prompt_text() for r in records[:4]]
    plain = vlm.generate(images, prompts, max_new_tokens=4)
    full = vlm.generate(images, prompts, recipe=f"router={out}:budget=1.0", max_new_tokens=4)
    assert full.texts == plain.texts and full.tokens == plain.tokens
    assert full.costs.total_flops == plain.costs.total_flops  # at budget 1 the router does not even run


def test_mean_total_flops_meets_the_budget_and_batch_equals_alone(trained):
    vlm, records, out, _ = trained
    task = Task(name="router-inputs", records=records, max_new_tokens=4)
    res = run_eval(vlm, task, [f"router={out}:budget=0.8"], batch_size=12, warmup=False, memory="off", progress=False)
    ratio = res.row(f"router={out}:budget=0.8")["ratio"]["total_flops"]
    assert ratio <= 0.8 + 0.02  # calibrated on these inputs: their mean meets the budget
    images, prompts = [list(r.images) for r in records[:5]], [r.prompt_text() for r in records[:5]]
    recipe = f"router={out}:budget=0.8"
    batch = vlm.generate(images, prompts, recipe=recipe, max_new_tokens=4)
    for i in range(5):
        alone = vlm.generate([images[i]], [prompts[i]], recipe=recipe, max_new_tokens=4)
        assert alone.tokens[0] == batch.tokens[i]


def test_skip_rule_spends_per_input_and_skipping_none_is_a_choice():
    """The threshold rule on hand-made logits: a layer is skipped while its skip preference -z beats the
    price times the FLOPs it saves; an input whose layers all score high skips none."""
    table = BudgetTable({"keeps": [0.5, 1.0], "subsets": [[], [3], [4], [3, 4]], "max_skip": 2,
                         "cost": [[0.8, 0.7, 0.7, 0.6], [1.0, 0.9, 0.9, 0.8]], "choices": [[0.8, 0.5, 1.0]]})  # fmt: skip
    z = torch.tensor([[5.0, 6.0], [-3.0, 4.0], [-3.0, -2.0]])
    assert table.skip(z, [3, 4], 0.5, lam=10.0) == [(), (3,), (3, 4)]  # saves 0.1 each: skip while -z > 1
    assert table.skip(z, [3, 4], 0.5, lam=50.0) == [(), (), ()]  # dear enough: nobody skips
    assert table.choice(0.8) == (0.5, 1.0)


def test_iso_cost_pairs_compare_layer_counts_at_one_cost():
    cost = torch.tensor([0.5, 0.2, 0.1, 0.4], dtype=torch.float64)  # keeps x (one token set) x subsets [(), (3,)]
    flops = [[0.70, 0.62], [0.85, 0.66]]  # (keep 0.5, skip 3) ~ (keep 1.0, skip 3)... and (0.5, ()) vs (1.0, (3,))
    pairs = preference_pairs(cost, 1, 2, 0.1, n_keep=2, sizes=[0, 1], flops=flops)
    w, lo = pairs["iso"]
    assert list(zip(w.tolist(), lo.tolist(), strict=True)) == [(3, 0)]  # 0.66 vs 0.70: within 0.05, 0.4 < 0.5
    assert all_subsets([3, 4], 1) == [[], [3], [4]]


def test_errors(trained, tmp_path):
    vlm, records, out, log = trained
    assert log["pairs"]["tokens"] > 0 and "iso" in log["pairs"]
    for recipe, want in [(f"router={out}:budget=0.8:token_keep=0.5", "do not give token_keep"),
                         (f"router={out}:budget=0", r"\(0, 1\]"), (f"router={out}:budget=0.3", "cannot meet budget"),
                         ]:  # fmt: skip
        with pytest.raises(RecipeError, match=want):
            vlm.generate(None, "hi", recipe=recipe, max_new_tokens=1)
    v1 = tmp_path / "v1"
    train_router(vlm, records[:2], token_keep=0.5, layers_skip=1, epochs=1, seed=0, out=v1, width=32)
    with pytest.raises(RecipeError, match="v1 router"):
        vlm.generate(None, "hi", recipe=f"router={v1}:budget=0.8", max_new_tokens=1)
    res = vlm.generate(records[0].images, records[0].prompt_text(), recipe=f"router={out}:token_keep=0.5:layers_skip=1",
                       max_new_tokens=2)  # fmt: skip
    assert res.costs.method_flops["prefill"] > 0  # v1 options on a v2 checkpoint


def test_select_a_token_method_and_a_price(trained):
    """`select=fastv@2`: the router decides the layers, FastV the tokens (its attention probe in layer 1, below the
    per-input layer plans); price=inf never skips, so it is FastV alone at the budget's keep; price=-inf skips
    every layer it may. A ragged batch equals each input alone."""
    vlm, records, out, _ = trained
    images, prompts = [list(r.images) for r in records[:4]], [r.prompt_text() for r in records[:4]]
    never = f"router={out}:budget=0.9:select=fastv@2:price=inf"
    from trimvlm.registry import build_method

    keep = build_method("router", str(out), {"budget": 0.9, "select": "fastv@2", "price": "inf"}).table.choice(0.9, float("inf"))[0]
    a = vlm.generate(images, prompts, recipe=never, max_new_tokens=3)
    b = vlm.generate(images, prompts, recipe=f"tokens=fastv:keep={keep}:layer=2", max_new_tokens=3)
    assert a.tokens == b.tokens and a.costs.total_flops == b.costs.total_flops  # the router did not even run
    always = f"router={out}:budget=0.8:select=fastv:price=-inf"
    batch = vlm.generate(images, prompts, recipe=always, max_new_tokens=3)
    for i in range(4):
        assert vlm.generate([images[i]], [prompts[i]], recipe=always, max_new_tokens=3).tokens[0] == batch.tokens[i]
    with pytest.raises(RecipeError, match="select=nosuch"):
        vlm.generate(None, "hi", recipe=f"router={out}:budget=0.8:select=nosuch", max_new_tokens=1)
    with pytest.raises(RecipeError, match="the layer after @"):
        vlm.generate(None, "hi", recipe=f"router={out}:budget=0.8:select=fastv@5", max_new_tokens=1)
    with pytest.raises(RecipeError, match="price"):
        vlm.generate(None, "hi", recipe=f"router={out}:budget=0.8:price=cheap", max_new_tokens=1)


def test_anchored_layouts_include_every_static_layout():
    """An anchor (S, tau): tau = inf is the static layout S for every input; a finite tau lets an input run a
    layer of S, or skip one outside it, where its logit departs from the training mean by more than tau; the
    calibration takes an anchor where it has the smallest KL at the budget."""
    from trimvlm.router.budget import calibrate

    data = {"keeps": [0.5, 1.0], "subsets": [[], [3], [4], [3, 4]], "max_skip": 2,
            "cost": [[0.8, 0.7, 0.7, 0.6], [1.0, 0.9, 0.9, 0.8]],
            "z": [[0.0, 0.0], [0.0, 0.0]], "candidate_layers": [3, 4],
            # per input [keep][subset]: dropping tokens costs KL, skipping layer 4 little, layer 3 much
            "kl": [[[3.0, 8.0, 3.1, 9.0], [0.0, 5.0, 0.1, 6.0]]] * 2}  # fmt: skip
    table = BudgetTable(data)
    z = torch.tensor([[0.0, 0.0], [3.0, 0.0], [0.0, -3.0]])
    assert table.skip(z, [3, 4], 0.5, ((4,), float("inf"))) == [(4,), (4,), (4,)]
    assert table.skip(z, [3, 4], 0.5, ((3,), 2.0)) == [(3,), (), (3, 4)]  # runs 3 at z=+3, skips 4 at z=-3
    (budget, keep, policy), = calibrate(table, table.z, [3, 4], table.kl_at, [0.9])
    assert policy == ((4,), float("inf")) and table.mean_cost(table.z, [3, 4], keep, policy) <= 0.9 + 1e-9


def test_a_policy_that_cannot_spend_the_budget_is_taken_only_when_none_can():
    """Skipping both layers is nearly free in KL here, but even at full keep it costs 0.8 against a budget of
    0.9: "meets the budget" is within 2%, so the calibration takes a layout that spends it."""
    from trimvlm.router.budget import REACH, calibrate

    data = {"keeps": [0.5, 1.0], "subsets": [[], [3], [4], [3, 4]], "max_skip": 2,
            "cost": [[0.8, 0.7, 0.7, 0.6], [1.0, 0.9, 0.9, 0.8]], "z": [[0.0, 0.0], [0.0, 0.0]],
            "candidate_layers": [3, 4], "kl": [[[3.0, 8.0, 3.1, 0.05], [0.0, 5.0, 0.1, 0.05]]] * 2}  # fmt: skip
    table = BudgetTable(data)
    (_, keep, policy), = calibrate(table, table.z, [3, 4], table.kl_at, [0.9])
    assert table.mean_cost(table.z, [3, 4], keep, policy) >= (1 - REACH) * 0.9
    (_, keep, policy), = calibrate(table, table.z, [3, 4], table.kl_at, [0.8])  # now it can: the cheapest KL
    assert table.skip(table.z, [3, 4], keep, policy) == [(3, 4), (3, 4)]


def test_held_out_calibration_measures_each_selector(trained, tmp_path):
    """`trimvlm calibrate-router`: on val inputs after the training ones, the router's layer logits and every
    layout's KL with each selector's own tokens; `select=` then calibrates on them. The unpruned layout's KL is
    0 (it is the model), a pruned one's is not, and the selectors' tokens differ."""
    import io
    import json
    import shutil

    from rich.console import Console

    from trimvlm.cli_train import calibrate_router_command
    from trimvlm.errors import InputError
    from trimvlm.registry import build_method

    vlm, records, out, _ = trained
    folder = tmp_path / "router"
    shutil.copytree(out, folder)
    quiet = Console(file=io.StringIO())
    calibrate_router_command(str(folder), model="demo", n=3, select=("router", "fastv"), console=quiet)
    meta = json.loads((folder / "router.json").read_text())
    held = meta["budget"]["held_out"]
    assert held["inputs"] == 3 and held["skip"] == len(records) and len(held["z"]) == 3
    assert sorted(held["kl"]) == ["fastv@2", "router"]  # fastv at its layer by the router's: the key names it
    keeps, subsets = meta["budget"]["keeps"], meta["budget"]["subsets"]
    for kl in held["kl"].values():
        assert [len(x) for x in kl] == [len(keeps)] * 3 and all(len(r) == len(subsets) for x in kl for r in x)
        assert all(abs(x[keeps.index(1.0)][0]) < 1e-6 for x in kl)  # keep 1, skip nothing: the model itself
        assert max(x[0][0] for x in kl) > 1e-4  # keep 0.3 moves the answer's distributions
    assert held["kl"]["fastv@2"][0][0] != held["kl"]["router"][0][0]
    table = build_method("router", str(folder), {"budget": 0.9, "select": "fastv@2"}).table
    assert table.held_out and table.kl == held["kl"]["fastv@2"] and table.z.shape == (3, len(meta["candidate_layers"]))
    assert not build_method("router", str(out), {"budget": 0.9}).table.held_out  # none measured: the training KL
    v1 = tmp_path / "v1"
    train_router(vlm, records[:2], token_keep=0.5, layers_skip=1, epochs=1, seed=0, out=v1, width=32)
    for router, want in [(str(v1), "v1 router"), ("demo", "shipped demo checkpoint")]:
        with pytest.raises((InputError, RecipeError), match=want):
            calibrate_router_command(router, model="demo", n=1, console=quiet)


def test_refit_trains_the_layer_scores_on_the_selectors_layouts(trained, tmp_path):
    """`trimvlm refit-router`: the layouts of the budget table run with the selector's tokens give layer and
    iso-cost pairs; DPO moves the layer scores and leaves the token scores exactly as they were; the calibration inputs become the refit's (their logits under
    the refit router) and the stale held-out calibration is dropped."""
    import io
    import json
    import shutil

    from rich.console import Console

    from trimvlm.cli_train import calibrate_router_command, refit_router_command
    from trimvlm.router.model import load_router
    from trimvlm.training.calibration import trained_inputs

    _, records, out, _ = trained
    folder = tmp_path / "router"
    shutil.copytree(out, folder)
    quiet = Console(file=io.StringIO())
    calibrate_router_command(str(folder), model="demo", n=2, console=quiet)
    before, _ = load_router(folder)
    got = refit_router_command(str(folder), model="demo", n=4, select="fastv@2", epochs=3, out=tmp_path / "refit",
                               console=quiet, lr=1e-2)  # fmt: skip
    assert got["pairs"]["layers"] > 0 and got["pairs"]["iso"] > 0 and got["select"] == "fastv@2"
    after, meta = load_router(tmp_path / "refit")
    assert "held_out" not in meta["budget"] and len(meta["budget"]["z"]) == 4 and trained_inputs(meta) == len(records)
    d = meta["hidden"]
    feats = (torch.randn(1, 5, d), torch.ones(1, 5, dtype=torch.bool), torch.randn(1, 3, d),
             torch.ones(1, 3, dtype=torch.bool))  # fmt: skip
    assert not torch.allclose(before.logits(*feats)[1], after.logits(*feats)[1])
    assert torch.equal(before.logits(*feats)[0], after.logits(*feats)[0])  # the layer head alone: tokens as they were
    json.loads((folder / "router.json").read_text())["budget"]["held_out"]  # the source is left as it was


def test_plain_recipe_runs_the_recorded_variant_and_the_nearest_elsewhere(trained, tmp_path):
    import shutil

    from trimvlm.router.route import Router
    from trimvlm.training.variants import record_variants

    vlm, records, out, _ = trained
    folder = tmp_path / "router"
    shutil.copytree(out, folder)
    assert Router(path=str(folder), budget=0.9).select == "router"  # nothing recorded: the router's own scores
    assert Router(path=str(folder), budget=0.9).price == "auto"
    record_variants(folder, [{"budget": 0.9, "select": "fastv@2", "price": "inf"},
                             {"budget": 0.8, "select": "router", "price": "0"}])  # fmt: skip
    images, prompts = [list(r.images) for r in records[:4]], [r.prompt_text() for r in records[:4]]
    for budget, explicit in [(0.9, "select=fastv@2:price=inf"), (0.8, "select=router:price=0"),
                             (0.93, "select=fastv@2:price=inf"), (0.85, "select=router:price=0")]:  # fmt: skip
        r = Router(path=str(folder), budget=budget)
        assert f"select={r.select}:price={r.price}" == explicit.replace("price=0", "price=0.0")
        plain = vlm.generate(images, prompts, recipe=f"router={folder}:budget={budget}", max_new_tokens=3)
        full = vlm.generate(images, prompts, recipe=f"router={folder}:budget={budget}:{explicit}", max_new_tokens=3)
        assert plain.tokens == full.tokens and plain.costs.total_flops == full.costs.total_flops
    # a given select= or price= overrides the recorded variant
    assert Router(path=str(folder), budget=0.9, price="auto").select == "router"


def test_recorded_aim_scales_with_the_budget_and_equals_it_given(trained, tmp_path):
    """A variant's aim (the budget its keep is calibrated for) scales with the budget asked; the plain recipe
    equals the same recipe with that aim given, and a larger aim keeps more tokens."""
    import shutil

    from trimvlm.router.route import Router
    from trimvlm.training.variants import record_variants

    vlm, records, out, _ = trained
    folder = tmp_path / "router"
    shutil.copytree(out, folder)
    record_variants(folder, [{"budget": 0.8, "select": "router", "price": "inf", "aim": 0.84}])
    r = Router(path=str(folder), budget=0.85)
    assert r.aim == pytest.approx(0.85 * 0.84 / 0.8) and r.layout()[0] > Router(path=str(folder), budget=0.85,
                                                                               price="inf").layout()[0]  # fmt: skip
    assert Router(path=str(folder), budget=0.85, aim=0.9).aim == 0.9  # given: taken as it is
    images, prompts = [list(r.images) for r in records[:4]], [r.prompt_text() for r in records[:4]]
    plain = vlm.generate(images, prompts, recipe=f"router={folder}:budget=0.8", max_new_tokens=3)
    given = vlm.generate(images, prompts, recipe=f"router={folder}:budget=0.8:select=router:price=inf:aim=0.84",
                         max_new_tokens=3)  # fmt: skip
    assert plain.tokens == given.tokens and plain.costs.total_flops == given.costs.total_flops
    with pytest.raises(RecipeError, match="aim must be a total-FLOP ratio"):
        Router(path=str(folder), budget=0.8, aim=1.5)
    with pytest.raises(RecipeError, match="aim= applies with budget="):
        Router(path=str(folder), aim=0.8)


def test_aimed_moves_the_measured_spend_toward_the_budget(trained):
    """pick-router's aim step: a candidate that spends under the budget (here: started at aim 0.78 for budget
    0.85) runs again at aim x budget / its spend, which lands nearer the budget."""
    from trimvlm.training.variants import aimed

    vlm, records, out, _ = trained
    task = Task(name="router-inputs", records=records[:6], max_new_tokens=3)
    cand = f"router={out}:budget=0.85:select=router:price=inf"

    def spend(rounds):
        recipes, res = aimed(vlm, task, {cand: 0.78}, 0.85, batch_size=6, rounds=rounds)
        return res.row(recipes[cand])["ratio"]["total_flops"], recipes[cand]

    (first, at_start), (second, at_aim) = spend(1), spend(2)
    assert at_start.endswith(":aim=0.78") and first < 0.8
    assert at_aim != at_start and abs(second - 0.85) < 0.01 < abs(first - 0.85)


def test_aimed_keeps_an_aim_the_router_refuses(trained):
    """An aim scaled below what the router's cheapest layouts cost is refused by the router: the candidate runs
    again at the aim it ran at, and the pick goes on."""
    from trimvlm.training.variants import aimed

    vlm, records, out, _ = trained
    task = Task(name="router-inputs", records=records[:3], max_new_tokens=2)
    cand = f"router={out}:budget=0.85:select=router:price=inf"
    recipes, res = aimed(vlm, task, {cand: 0.78}, 0.05, batch_size=3, rounds=2)
    assert recipes[cand].endswith(":aim=0.78") and res.row(recipes[cand])["ratio"]["total_flops"] > 0.5


def test_a_selector_that_never_skips_is_priced_without_the_router():
    """With a `select=` method the router runs only to plan layers: the policy that skips none (lambda inf) costs
    the method's own layout, and every other policy adds the router's share."""
    data = {"keeps": [0.5, 1.0], "subsets": [[], [3]], "max_skip": 1, "router_share": 0.02,
            "cost": [[0.8, 0.7], [1.0, 0.9]], "cost_by_layer": {"0": [[0.6, 0.5], [1.0, 0.9]]}}  # fmt: skip
    z = torch.tensor([[-5.0], [5.0]])
    own, method = BudgetTable(data), BudgetTable(data, layer=0)
    assert own.mean_cost(z, [3], 0.5, float("inf")) == pytest.approx(0.8)  # the router's own scores: it runs
    assert method.mean_cost(z, [3], 0.5, float("inf")) == pytest.approx(0.6)
    assert method.mean_cost(z, [3], 0.5, float("-inf")) == pytest.approx(0.5 + 0.02)
    assert method.mean_cost(z, [3], 0.5, 0.0) == pytest.approx((0.52 + 0.62) / 2)


def test_shipped_routers_record_their_variants():
    from trimvlm.router.model import load_router

    for name, budgets in [("demo", [0.65, 0.75, 0.85]), ("demo-qwen35", [0.65, 0.75, 0.85]),
                          ("demo-scenes", [0.45, 0.6, 0.75])]:  # fmt: skip
        variants = load_router(name)[1]["budget"].get("variants", [])
        assert sorted(v["budget"] for v in variants) == budgets, name
        assert all(v["val_items"] >= 96 and v["recipe"].startswith("router=") for v in variants)
