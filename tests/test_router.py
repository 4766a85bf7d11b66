"""The meta-router's model and DPO objective."""

import copy
import math

import torch

from trimvlm.kernels.flops import counting
from trimvlm.router.model import MetaRouter
from trimvlm.runtime.meter import Meter, flop_counter
from trimvlm.training.dpo import dpo_loss, layout_logprob_logits


def layout_logprob(scores: torch.Tensor, chosen: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: [B] log pi(layout) from scores [B, E] in (0, 1), clamped to (1e-6, 1 - 1e-6)."""
    s = scores.clamp(1e-6, 1 - 1e-6)
    lp = torch.where(chosen, s.log(), (1 - s).log())
    if mask is not None:
        lp = lp.masked_fill(~mask, 0.0)
    return lp.sum(-1)


def test_dpo_loss_on_hand_made_log_probs_equals_the_closed_form():
    pw, pl = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.5])
    rw, rl = torch.tensor([-1.5, -2.0]), torch.tensor([-2.0, -2.0])
    beta = 0.5
    margins = [beta * ((-1.0 + 1.5) - (-3.0 + 2.0)), beta * ((-2.0 + 2.0) - (-1.5 + 2.0))]
    expected = sum(math.log1p(math.exp(-m)) for m in margins) / 2  # -log sigmoid(m) = log(1 + e^-m)
    assert abs(float(dpo_loss(pw, pl, rw, rl, beta)) - expected) < 1e-6


def test_layout_logprob_is_the_bernoulli_log_likelihood_of_the_real_elements():
    s = torch.tensor([[0.9, 0.2, 0.6, 0.5]])
    chosen = torch.tensor([[True, False, True, True]])
    mask = torch.tensor([[True, True, True, False]])
    expected = math.log(0.9) + math.log(0.8) + math.log(0.6)
    assert abs(float(layout_logprob(s, chosen, mask)[0]) - expected) < 1e-6


def test_layout_logprob_from_logits_equals_the_probability_form_and_keeps_gradient_when_saturated():
    z = torch.tensor([[2.0, -1.0, 0.3, float("-inf")]])
    chosen = torch.tensor([[True, False, True, False]])
    assert torch.allclose(layout_logprob_logits(z, chosen), layout_logprob(torch.sigmoid(z), chosen,
                                                                           torch.isfinite(z)), atol=1e-6)  # fmt: skip
    sat = torch.tensor([[30.0, -30.0]], requires_grad=True)  # sigmoid rounds to 1 / 0: a clamp cuts the gradient
    layout_logprob_logits(sat, torch.tensor([[False, True]])).sum().backward()
    assert torch.all(sat.grad.abs() > 0.5)
    clamped = sat.detach().clone().requires_grad_(True)
    layout_logprob(torch.sigmoid(clamped), torch.tensor([[False, True]])).sum().backward()
    assert torch.all(clamped.grad == 0)


def test_preference_pairs_compare_only_layouts_that_differ_in_one_part_and_skip_near_ties():
    from trimvlm.training.router import layer_sets, preference_pairs

    # grid of 2 token sets x 2 layer sets, index = t * 2 + l
    cost = torch.tensor([1.0, 3.0, 0.5, 0.52], dtype=torch.float64)
    pairs = preference_pairs(cost, 2, 2, margin=0.1)
    tok = sorted(zip(*(x.tolist() for x in pairs["tokens"]), strict=True))
    lay = sorted(zip(*(x.tolist() for x in pairs["layers"]), strict=True))
    assert tok == [(2, 0), (3, 1)]  # same layer set: t=1 beats t=0 under both
    assert lay == [(0, 1)]  # same token set: l=0 beats l=1 for t=0; t=1's 0.5 vs 0.52 is a near-tie
    tiny = preference_pairs(torch.tensor([0.0, 0.004, 0.3, 0.001], dtype=torch.float64), 2, 2, 0.1, floor=0.05)
    assert [tuple(x.tolist()) for x in tiny["tokens"]] == [(0,), (2,)]  # t=0 beats t=1 under l=0 only
    assert [tuple(x.tolist()) for x in tiny["layers"]] == [(3,), (2,)]  # 0.0 vs 0.004 is no preference
    gen = torch.Generator().manual_seed(0)
    assert layer_sets(gen, [3, 4, 5], 1, order=[4, 3, 5]) == [[3], [4], [5]]
    many = layer_sets(gen, list(range(8, 16)), 3, order=list(range(16)), max_sets=5)
    assert len(many) == 5 and many[0] == [8, 9, 10] and len({tuple(m) for m in many}) == 5


def test_preference_pairs_equal_a_pairwise_loop_on_a_v2_grid_with_unmeasured_layouts():
    """Every ordered pair of the [keep x token set x layer set] grid tested one by one (the definition) gives the
    same winners and losers, in the same order, as the tensor masks; NaN (unmeasured) layouts pair with none."""
    from trimvlm.training.router import preference_pairs

    g = torch.Generator().manual_seed(3)
    n_keep, n_tok, n_lay, margin, floor, iso = 3, 4, 6, 0.1, 0.05, 0.05
    cost = torch.rand(n_keep * n_tok * n_lay, generator=g) * 2
    cost[torch.rand(cost.shape, generator=g) < 0.3] = float("nan")
    sizes = [0, 1, 1, 2, 2, 2]
    flops = [[0.9 - 0.1 * k - 0.07 * sizes[j] for j in range(n_lay)] for k in range(n_keep)]
    got = preference_pairs(cost, n_tok, n_lay, margin, floor, n_keep=n_keep, sizes=sizes, flops=flops, iso=iso)
    cells = [(k, t, j) for k in range(n_keep) for t in range(n_tok) for j in range(n_lay)]
    kinds = {
        "tokens": lambda a, b: a[0] == b[0] and a[2] == b[2] and a[1] != b[1],
        "layers": lambda a, b: a[0] == b[0] and a[1] == b[1] and a[2] != b[2] and sizes[a[2]] == sizes[b[2]],
        "iso": lambda a, b: a[1] == b[1] and sizes[a[2]] != sizes[b[2]]
        and abs(flops[a[0]][a[2]] - flops[b[0]][b[2]]) <= iso,
    }
    for kind, same in kinds.items():
        want = [(i, j) for i, a in enumerate(cells) for j, b in enumerate(cells) if i != j and same(a, b)
                and float(cost[i]) < (1 - margin) * float(cost[j]) and float(cost[j]) - float(cost[i]) > floor]
        assert want, kind
        assert list(zip(got[kind][0].tolist(), got[kind][1].tolist(), strict=True)) == want, kind


def test_answer_length_stops_at_the_first_stop_token():
    from trimvlm.training.router import answer_length

    assert answer_length(torch.tensor([5, 7, 2, 2]), [2]) == 3
    assert answer_length(torch.tensor([5, 7, 8]), [2]) == 3
    assert answer_length(torch.tensor([2, 7]), [9, 2]) == 1


def _inputs(seed=0, b=3, nv=10, nt=5, d=32):
    g = torch.Generator().manual_seed(seed)
    vis, txt = torch.randn(b, nv, d, generator=g), torch.randn(b, nt, d, generator=g)
    vm = torch.ones(b, nv, dtype=torch.bool)
    tm = torch.ones(b, nt, dtype=torch.bool)
    vm[1, 7:] = False
    tm[2, 3:] = False
    return vis, vm, txt, tm


def test_router_batch_equals_each_input_alone_and_counts_its_flops():
    torch.manual_seed(0)
    router = MetaRouter(32, candidate_layers=[2, 3], width=16, heads=4)
    vis, vm, txt, tm = _inputs()
    meter = Meter()
    with torch.no_grad(), flop_counter() as fc, counting(meter, "prefill"):
        s_v, s_l = router(vis, vm, txt, tm)
    assert meter.costs.method_flops["prefill"] == fc.get_total_flops() > 0
    assert s_v.shape == (3, 10) and s_l.shape == (3, 2)
    assert bool((s_v[~vm] == 0).all()) and bool(((s_l > 0) & (s_l < 1)).all())
    for b in range(3):
        nv, nt = int(vm[b].sum()), int(tm[b].sum())
        with torch.no_grad():
            a_v, a_l = router(vis[b : b + 1, :nv], vm[b : b + 1, :nv], txt[b : b + 1, :nt], tm[b : b + 1, :nt])
        assert torch.allclose(a_v[0], s_v[b, :nv], atol=1e-6) and torch.allclose(a_l[0], s_l[b], atol=1e-6)


def test_one_dpo_step_lowers_the_loss_on_a_fixed_batch():
    torch.manual_seed(0)
    router = MetaRouter(32, candidate_layers=[2, 3], width=16, heads=4)
    ref = copy.deepcopy(router).requires_grad_(False)
    vis, vm, txt, tm = _inputs(1)
    g = torch.Generator().manual_seed(2)
    win = torch.rand(3, 12, generator=g) < 0.5  # 10 tokens + 2 layers
    lose = ~win
    mask = torch.cat([vm, torch.ones(3, 2, dtype=torch.bool)], dim=1)

    def loss():
        s = torch.cat(router(vis, vm, txt, tm), dim=1)
        with torch.no_grad():
            r = torch.cat(ref(vis, vm, txt, tm), dim=1)
        return dpo_loss(layout_logprob(s, win, mask), layout_logprob(s, lose, mask),
                        layout_logprob(r, win, mask), layout_logprob(r, lose, mask), beta=0.5)  # fmt: skip

    opt = torch.optim.Adam(router.parameters(), lr=1e-2)
    before = loss()
    assert abs(before.detach().item() - math.log(2)) < 1e-6  # router == reference: every margin is 0
    before.backward()
    opt.step()
    assert loss().item() < before.detach().item()


def _saved_router(adapter, folder, seed=0):
    from trimvlm.depth.base import model_fingerprint
    from trimvlm.router.model import save_router

    torch.manual_seed(seed)
    n = adapter.num_layers
    hidden = adapter.text_config.hidden_size
    router = MetaRouter(hidden, candidate_layers=list(range(n // 2, n)), width=16, heads=4)
    save_router(router, folder, fingerprint=model_fingerprint(adapter), hidden=hidden)
    return folder


def test_router_layout_is_executed_physically_and_per_sample(tiny_adapter, tmp_path):
    """The router's per-input layout: tokens physically dropped before layer 0, its lowest-scored candidate
    layers not run for that sample (no KV of theirs), FLOPs that torch's counter sees, and a batch equal to
    each sample alone."""
    from conftest import ragged_batch

    from trimvlm.plan import make_plan
    from trimvlm.runtime.generate import generate
    from trimvlm.runtime.runner import Runner

    adapter = tiny_adapter("qwen3_vl")
    runner = Runner(adapter)
    path = _saved_router(adapter, tmp_path / "router")
    recipe = f"router={path}:token_keep=0.5:layers_skip=1"
    images, prompts = ragged_batch()
    prep = adapter.prepare(images, prompts)

    def run(prep):
        plan = make_plan(recipe, runner)
        runner.vision_flops(prep)
        meter = Meter()
        with flop_counter() as fc:
            out = generate(runner, prep, plan, max_new_tokens=4, stop_ids=[], pad_id=0, meter=meter)
        return out, plan, fc.get_total_flops()

    both, plan, counted = run(prep)
    assert counted == both.costs.total_flops and both.costs.method_flops["prefill"] > 0
    skip = plan.skip_prefill.plan
    assert skip.shape == (3, runner.num_layers) and bool((skip.sum(1) == 1).all())
    assert bool((skip[:, : runner.num_layers // 2] == 0).all())  # only candidate layers are skipped
    base = generate(runner, prep, max_new_tokens=4, stop_ids=[], pad_id=0)
    assert both.costs.prefill_flops < base.costs.prefill_flops
    for b in range(3):
        alone, _, _ = run(adapter.prepare(images[b : b + 1], prompts[b : b + 1]))
        assert both.tokens[b].tolist() == alone.tokens[0].tolist()


def test_router_prefill_drops_tokens_and_skipped_layers_hold_no_kv(tiny_adapter, tmp_path):
    import math

    from conftest import ragged_batch

    from trimvlm.plan import make_plan
    from trimvlm.runtime.runner import Runner

    adapter = tiny_adapter("qwen3_vl")
    runner = Runner(adapter)
    plan = make_plan(f"router={_saved_router(adapter, tmp_path / 'r')}:token_keep=0.5:layers_skip=1", runner)
    images, prompts = ragged_batch()
    prep = adapter.prepare(images, prompts)
    full = runner.prefill(prep)
    out = runner.prefill(prep, plan)
    skip = plan.skip_prefill.plan
    for b in range(3):
        n_vis = int((full.cache.layers[0].visual[b] & full.cache.layers[0].valid[b]).sum())
        e0 = out.cache.layers[0]
        assert int((e0.visual[b] & e0.valid[b]).sum()) == math.ceil(n_vis * 0.5)
        for layer in torch.nonzero(skip[b]).flatten().tolist():
            e = out.cache.layers.get(layer)  # absent when every sample skipped it
            assert e is None or not bool(e.valid[b].any())  # that sample wrote no KV there


def test_router_recipe_errors(tiny_adapter, tmp_path):
    import pytest

    from trimvlm.errors import RecipeError
    from trimvlm.plan import make_plan
    from trimvlm.runtime.runner import Runner

    runner = Runner(tiny_adapter("qwen3_vl"))
    path = _saved_router(runner.adapter, tmp_path / "r")
    other = Runner(tiny_adapter("qwen3_vl", seed=1))
    with pytest.raises(RecipeError, match="another model"):
        make_plan(f"router={path}", other)
    with pytest.raises(RecipeError, match="exceeds its 2 candidate layers"):
        make_plan(f"router={path}:layers_skip=3", runner)
    with pytest.raises(RecipeError, match="do not combine router= with tokens="):
        make_plan(f"router={path},tokens=random:keep=0.5", runner)
    with pytest.raises(RecipeError, match="unknown option"):
        make_plan(f"router={path}:threshold=2", runner)
    with pytest.raises(RecipeError, match="router checkpoint not found"):
        make_plan(f"router={tmp_path / 'missing'}", runner)


def test_train_router_runs_end_to_end_and_its_checkpoint_executes(tmp_path):
    """A few DPO epochs on the demo model: the layouts' costs come from real pruned runs, the loss starts at
    log 2 (router == reference) and falls, the checkpoint resumes and runs as a recipe."""
    import trimvlm
    from trimvlm.evals.tasks import calibration_items as calibration_records
    from trimvlm.training.router import train_router

    vlm = trimvlm.load("demo")
    records = calibration_records("demo", 4, 0)
    out = tmp_path / "router"
    log = train_router(vlm, records, token_keep=0.5, layers_skip=1, epochs=2, seed=0, out=out, lr=3e-3)
    losses = [e["dpo_loss"] for e in log["epochs"]]
    assert abs(losses[0] - math.log(2)) < 0.05 and losses[-1] < losses[0]
    more = train_router(vlm, records, token_keep=0.5, layers_skip=1, epochs=3, seed=0, out=out, resume=True)
    assert [e["epoch"] for e in more["epochs"]] == [2]  # resumed after the two epochs on disk
    res = vlm.generate(records[0].images, records[0].prompt_text(), recipe=f"router={out}:token_keep=0.5:layers_skip=1",
                       max_new_tokens=3)  # fmt: skip
    base = vlm.generate(records[0].images, records[0].prompt_text(), max_new_tokens=3)
    assert res.costs.method_flops["prefill"] > 0
    # the trained router ran as a recipe: half the visual tokens and one of six layers gone from the prefill
    assert res.costs.layers_run["prefill"] == 5 and res.costs.prefill_flops < 0.8 * base.costs.prefill_flops


def test_shipped_routers_load_by_demo_name_and_refuse_the_other_model():
    """`router=demo` / `router=demo-qwen35` name the routers trained for (and shipped with) each demo model."""
    import pytest

    import trimvlm
    from trimvlm.depth.base import model_fingerprint
    from trimvlm.errors import RecipeError
    from trimvlm.router.model import load_router

    vlm = trimvlm.load("demo")
    for name in ("demo", "demo-qwen35", "demo-scenes"):
        _, meta = load_router(name)
        assert meta["epochs_done"] >= 1 and meta["log"]["epochs"][-1]["dpo_loss"] < math.log(2) - 0.05
    assert load_router("demo-scenes")[1]["fingerprint"] == model_fingerprint(trimvlm.load("demo-scenes").adapter)
    assert load_router("demo")[1]["fingerprint"] == model_fingerprint(vlm.adapter)
    from trimvlm.testing import random_image

    res = vlm.generate([random_image(seed=1)], "how many red ?", recipe="router=demo:token_keep=0.5:layers_skip=1",
                       max_new_tokens=2)  # fmt: skip
    assert res.costs.method_flops["prefill"] > 0
    with pytest.raises(RecipeError, match="trained for another model"):
        vlm.generate([random_image(seed=1)], "how many red ?", recipe="router=demo-qwen35", max_new_tokens=1)
