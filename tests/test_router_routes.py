"""Router v2's routed variants: each input runs one of several routes, each route's rows a batch of their own
(runtime/routes.py); the switch that sends them (training/routes.py); budgets below the cost table's keeps."""

import json
import math
import shutil

import pytest
import torch
from conftest import live, need_extra

import trimvlm
from trimvlm.errors import InputError, RecipeError
from trimvlm.evals.tasks import get_task
from trimvlm.plan import decision_plan, make_plan
from trimvlm.router.budget import BudgetTable, calibrate
from trimvlm.router.model import router_folder
from trimvlm.runtime.meter import Meter
from trimvlm.training.routes import fit_switch

ROUTES = [{"select": "density@0", "price": "inf", "aim": 0.465}, {"select": "density@2", "price": "inf", "aim": 0.46}]


@pytest.fixture(scope="module")
def scenes():
    return trimvlm.load("demo-scenes")


def _routed(tmp_path, weight, bias):
    """A copy of demo-scenes' router whose 0.45 variant is routed by the switch (weight, bias)."""
    folder = tmp_path / "routed"
    shutil.copytree(router_folder("demo-scenes"), folder)
    meta = json.loads((folder / "router.json").read_text())
    variant = next(v for v in meta["budget"]["variants"] if v["budget"] == 0.45)
    variant.update(routes=ROUTES, switch={"weight": weight, "bias": bias})
    (folder / "router.json").write_text(json.dumps(meta))
    return folder


def _batch(n=8):
    records = get_task("scenes", limit=n, seed=3, split="test").records
    return [list(r.images) for r in records], [r.prompt_text() for r in records]


def test_a_routed_batch_equals_each_route_run_as_a_batch_of_its_own(scenes, tmp_path):
    torch.manual_seed(0)
    folder = _routed(tmp_path, (torch.randn(2, scenes.adapter.text_config.hidden_size) * 10).tolist(), [0.0, 0.0])
    images, prompts = _batch()
    recipe = f"router={folder}:budget=0.45"
    out = scenes.generate(images, prompts, recipe=recipe, max_new_tokens=6)
    plan = make_plan(recipe, scenes.runner)
    seq = scenes.runner.encode(scenes.prepare(images, prompts), Meter(), None)
    groups = [group.rows.tolist() for group in plan.routes(seq, scenes.runner)]
    assert all(groups) and sorted(sum(groups, [])) == list(range(len(prompts)))  # both routes take rows
    prefill = method = 0
    for rows, r in zip(groups, ROUTES, strict=True):
        alone = scenes.generate([images[i] for i in rows], [prompts[i] for i in rows], max_new_tokens=6,
                                recipe=f"{recipe}:select={r['select']}:price=inf:aim={r['aim']}")  # fmt: skip
        assert [out.tokens[i] for i in rows] == alone.tokens
        prefill += alone.costs.prefill_flops
        method += alone.costs.method_prefill_flops
    assert out.costs.prefill_flops == prefill  # each group padded to its own longest row, counted once
    assert out.costs.method_prefill_flops == method


def test_a_switch_that_sends_every_row_one_way_runs_that_route_alone(scenes, tmp_path):
    hidden = scenes.adapter.text_config.hidden_size
    folder = _routed(tmp_path, [[0.0] * hidden, [0.0] * hidden], [0.0, 1.0])  # route 1 for every input
    images, prompts = _batch(4)
    out = scenes.generate(images, prompts, recipe=f"router={folder}:budget=0.45", max_new_tokens=6)
    alone = scenes.generate(images, prompts, recipe=f"router={folder}:budget=0.45:select=density@2:price=inf:"
                            f"aim={ROUTES[1]['aim']}", max_new_tokens=6)  # fmt: skip
    assert out.tokens == alone.tokens and out.costs.prefill_flops == alone.costs.prefill_flops


def test_routes_refuse_what_reads_one_prefill_of_the_batch(scenes, tmp_path):
    hidden = scenes.adapter.text_config.hidden_size
    folder = _routed(tmp_path, [[0.0] * hidden] * 2, [0.0, 0.0])
    with pytest.raises(RecipeError, match="kv= cannot be combined"):
        make_plan(f"router={folder}:budget=0.45,kv=density:keep=0.5", scenes.runner)
    with pytest.raises(RecipeError, match="a decision reads one prefill"):
        decision_plan(f"router={folder}:budget=0.45", scenes.runner)


def test_the_switch_learns_which_route_agrees_and_ignores_items_where_none_differ():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 6, generator=g) * 0.01
    x[:100, 0] += 0.05  # two kinds of prompt, told apart by one feature
    agree = torch.zeros(200, 2, dtype=torch.bool)
    agree[:100, 0] = agree[100:, 1] = True
    agree[::10] = True  # both agree: no lesson
    w, b = fit_switch(x, agree)
    assert w.shape == (2, 6) and b.shape == (2,)
    assert ((x @ w.T + b).argmax(1) == torch.cat([torch.zeros(100), torch.ones(100)]).long()).float().mean() > 0.95
    assert torch.equal(fit_switch(x, agree)[0], w)  # deterministic
    with pytest.raises(InputError, match="nothing tells them apart"):
        fit_switch(x, torch.ones(200, 2, dtype=torch.bool))


def test_a_budget_below_the_tables_keeps_is_calibrated_on_its_extrapolated_costs():
    table = BudgetTable({"keeps": [0.2, 0.6, 1.0], "subsets": [[]], "cost": [[0.4], [0.6], [0.8]], "max_skip": 0})
    assert table.cost_of(0.1, ()) == pytest.approx(0.35)  # along the two lowest keeps
    assert table.cost_of(0.4, ()) == pytest.approx(0.5)
    z, kl = torch.zeros(3, 0), lambda x, keep, subset: 0.0
    got = {b: k for b, k, _ in calibrate(table, z, [], kl, [0.36, 0.5, 0.3], (math.inf,))}
    assert got[0.36] == pytest.approx(0.12, abs=1e-3)
    assert got[0.5] == pytest.approx(0.4, abs=1e-3)  # within the table: as before
    assert 0.3 not in got  # below even the floor keep's cost: left out


def test_the_shipped_routed_variant_runs_through_the_server_as_in_process(scenes):
    """demo-scenes' plain router at 0.45 is routed (its recorded variant has routes and a switch); as the server's
    recipe, concurrent chat requests (admitted together where they arrive together) equal `vlm.generate` in
    process, answer and prefill FLOPs."""
    need_extra("fastapi", "uvicorn", "httpx")
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from trimvlm.router.model import load_router
    from trimvlm.serve.limits import CacheSizes
    from trimvlm.serve.recipes import RecipeOptions
    from trimvlm.serve.state import ServerState

    variant = next(v for v in load_router("demo-scenes")[1]["budget"]["variants"] if v["budget"] == 0.45)
    assert [r["select"] for r in variant["routes"]] == ["density@0", "density@2"]
    images, prompts = _batch(4)
    recipe = "router=demo-scenes:budget=0.45"
    refs = [scenes.generate(i, p, recipe=recipe, max_new_tokens=6) for i, p in zip(images, prompts, strict=True)]
    state = ServerState(scenes, model_id="demo-scenes", recipes=RecipeOptions(recipe=recipe),
                        caches=CacheSizes(vision_mb=0, prefix_mb=0, request_mb=0))  # fmt: skip

    def ask(url, image, prompt):
        content = [{"type": "image_url", "image_url": {"url": _data_url(image[0])}}, {"type": "text", "text": prompt}]
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 6}
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=300)

    with live(state) as (url, _), ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda ip: ask(url, *ip), zip(images, prompts, strict=True)))
    for r, ref in zip(got, refs, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == ref.texts[0]
        assert r.json()["usage"]["recipe"] == ref.recipe


def _data_url(image) -> str:
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_pick_routes_records_the_routed_variant_only_where_it_wins(scenes, tmp_path):
    """pick-routes on a copy of demo-scenes' router: the switch fitted on one set of validation items, checked on
    the next; the router records the routed variant exactly when it answered more of the check items, else the
    single variant it had; whichever it records, the plain recipe runs (no aim the router refuses)."""
    from trimvlm.router.budget import recorded_variant
    from trimvlm.router.model import load_router
    from trimvlm.training.routes import pick_routes

    folder = tmp_path / "router"
    shutil.copytree(router_folder("demo-scenes"), folder)
    single = recorded_variant(load_router("demo-scenes")[1], 0.45)
    n = 24
    got = pick_routes(scenes, str(folder), 0.45, ["density@0", "density@2"], "scenes", n, batch_size=n)
    assert got["items"] == n and got["recorded"] == (got["routed_accuracy"] > got["single_accuracy"])
    assert [r["select"] for r in got["variant"]["routes"]] == ["density@0", "density@2"]
    variant = recorded_variant(load_router(str(folder))[1], 0.45)
    assert ("routes" in variant) == got["recorded"]
    if not got["recorded"]:
        assert variant["recipe"] == single["recipe"] and variant["aim"] == single["aim"]
    plan = make_plan(f"router={folder}:budget=0.45", scenes.runner)
    assert (plan.routes is not None) == got["recorded"]


def test_an_aim_is_scaled_where_the_router_takes_it_and_kept_where_it_refuses(scenes):
    from trimvlm.training.variants import reaimed

    route = "router=demo-scenes:budget=0.45:select=density@0:price=inf"
    assert reaimed(scenes.runner, route, 0.47, 0.9) == pytest.approx(0.423)
    assert reaimed(scenes.runner, route, 0.8, 2.0) == 1.0  # capped
    with pytest.raises(RecipeError, match="cannot meet"):
        make_plan(f"{route}:aim=0.1", scenes.runner)
    assert reaimed(scenes.runner, route, 0.47, 0.1 / 0.47) == 0.47  # 0.1 refused: the aim stays
