"""The field's standard baselines (tokens=pyramiddrop, vispruner, fastervlm, gprune, fitprune; kv=pyramidkv):
each method's picks against a plain-loop reference of its paper's formula on random inputs, and the options
or layers it cannot use refused in one line."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import plan_prefill, ragged_batch
from test_kv import _loop_snapkv, _loop_topk, _ragged_layer

from trimvlm.errors import RecipeError
from trimvlm.kernels.select import topk_mask
from trimvlm.plan import Handoff, build_methods, make_plan
from trimvlm.registry import build_method
from trimvlm.runtime.runner import Runner
from trimvlm.testing import random_image
from trimvlm.tokens.base import VisualView
from trimvlm.tokens.fitprune import Stats, deletion_order, fit, received, statistics
from trimvlm.tokens.gprune import propagate
from trimvlm.tokens.pyramiddrop import stage_counts
from trimvlm.tokens.vispruner import remove_duplicates


def _view(seed: int, ns=(12, 7, 16), d: int = 6, keep: float = 0.4) -> VisualView:
    """A padded view of three units with random features and attention (ties impossible)."""
    g = torch.Generator().manual_seed(seed)
    u, n = len(ns), max(ns)
    mask = torch.arange(n)[None] < torch.tensor(ns)[:, None]
    feats = torch.randn(u, n, d, generator=g) * mask[..., None]
    nn = mask.sum(1)
    return VisualView(
        features=feats, mask=mask, n=nn, k=torch.ceil(nn * keep).long(), grid=torch.stack([nn, torch.ones_like(nn)], 1),
        cells=torch.where(mask, torch.arange(n)[None], -1), sample=torch.arange(u), image=torch.zeros(u, dtype=torch.long),
        image_key=torch.zeros(u, dtype=torch.long), tile=torch.zeros(u, dtype=torch.long), cols=torch.arange(n)[None].repeat(u, 1),
        source=torch.arange(n)[None].repeat(u, 1), batch=u, size=mask.long(), layer=0,
        attention=torch.rand(u, n, generator=g) * mask,
    )  # fmt: skip


def _kept(sel, view) -> list[set[int]]:
    return [
        set(torch.nonzero(sel.keep[u] & view.mask[u]).flatten().tolist()) for u in range(view.mask.shape[0])
    ]


def _cos(a, b) -> float:
    return float((a @ b) / (a.norm().clamp(min=1e-12) * b.norm().clamp(min=1e-12)))


# ---- FasterVLM ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_fastervlm_keeps_the_top_cls_attention(seed):
    view = _view(seed)
    sel = build_method("tokens", "fastervlm", {"keep": 0.4}).choose(view)
    for u, got in enumerate(_kept(sel, view)):
        scores = {j: float(view.attention[u, j]) for j in range(int(view.n[u]))}
        assert got == _loop_topk(scores, int(view.k[u]))


# ---- VisPruner ----------------------------------------------------------------------------------------
def _loop_vispruner(view, u: int, important: float) -> set[int]:
    n, k = int(view.n[u]), int(view.k[u])
    k_imp = min(k, round(k * important))
    att = {j: float(view.attention[u, j]) for j in range(n)}
    imp = _loop_topk(att, k_imp)
    rest = [j for j in range(n) if j not in imp]
    x = view.features[u]
    while len(rest) > k - k_imp:
        a, b = rest[0::2], rest[1::2]
        if not b:
            rest = rest[: k - k_imp]
            break
        s = {i: max(_cos(x[i], x[j]) for j in b) for i in a}
        r = min(len(a), len(rest) - (k - k_imp))
        gone = set(sorted(a, key=lambda i: (-s[i], i))[:r])
        rest = [j for j in rest if j not in gone]
    return imp | set(rest)


@pytest.mark.parametrize("important", [0.5, 0.0, 1.0, 0.3])
@pytest.mark.parametrize("seed", [0, 3])
def test_vispruner_keeps_important_then_diverse_tokens(seed, important):
    view = _view(seed, keep=0.3)
    sel = build_method("tokens", "vispruner", {"keep": 0.3, "important": important}).choose(view)
    for u, got in enumerate(_kept(sel, view)):
        assert got == _loop_vispruner(view, u, important)
        assert len(got) == int(view.k[u])


def test_remove_duplicates_drops_the_exact_copy_first():
    x = F.normalize(torch.randn(1, 6, 4, generator=torch.Generator().manual_seed(2)), dim=-1)
    x[0, 2] = x[0, 5]  # 2 (in A) duplicates 5 (in B)
    left = remove_duplicates(x, torch.ones(1, 6, dtype=torch.bool), torch.tensor([5]))
    assert torch.nonzero(~left[0]).flatten().tolist() == [2]


# ---- G-Prune ------------------------------------------------------------------------------------------
def _loop_gprune(x, threshold, temperature, steps) -> list[float]:
    n = x.shape[0]
    sim = [[_cos(x[i], x[j]) for j in range(n)] for i in range(n)]
    edge = [[i == j or sim[i][j] >= threshold for j in range(n)] for i in range(n)]
    p = []
    for i in range(n):
        z = sum(math.exp(sim[i][j] / temperature) for j in range(n) if edge[i][j])
        p.append([math.exp(sim[i][j] / temperature) / z if edge[i][j] else 0.0 for j in range(n)])
    s = [float(x[i].norm()) for i in range(n)]
    for _ in range(steps):
        s = [sum(s[i] * p[i][j] for i in range(n)) for j in range(n)]
    return [s[j] / sum(edge[i][j] for i in range(n)) for j in range(n)]


@pytest.mark.parametrize(
    "opts", [{}, {"threshold": 0.1, "temperature": 0.5, "steps": 2}, {"threshold": -1.0, "steps": 1}]
)
def test_gprune_scores_and_picks_match_loop(opts):
    view = _view(5, d=3)  # few dimensions: many similar pairs, a real graph
    m = build_method("tokens", "gprune", {"keep": 0.4, **opts})
    score = propagate(view.features.double(), view.mask, m.threshold, m.temperature, m.steps)
    sel = m.choose(view)
    for u, got in enumerate(_kept(sel, view)):
        n = int(view.n[u])
        want = _loop_gprune(view.features[u, :n].double(), m.threshold, m.temperature, m.steps)
        assert torch.allclose(score[u, :n], torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-12)
        assert got == _loop_topk(dict(enumerate(want)), int(view.k[u]))


# ---- PyramidDrop --------------------------------------------------------------------------------------
def test_pyramiddrop_stage_counts_are_a_geometric_pyramid():
    n0 = torch.tensor([576, 100, 7])
    for keep, stages in ((0.125, 3), (0.5, 3), (0.25, 2), (0.3, 1)):
        lam = keep ** (1 / stages)
        got = stage_counts(n0, keep, stages)
        for j in range(1, stages + 1):
            frac = keep if j == stages else lam**j
            assert got[j - 1].tolist() == [max(1, math.ceil(n * frac - 1e-9)) for n in n0.tolist()]
    assert stage_counts(torch.tensor([576]), 0.125, 3)[0].tolist() == [288]  # the paper's lambda = 0.5


def test_pyramiddrop_stages_scale_the_papers_layers():
    m = build_method("tokens", "pyramiddrop", {"keep": 0.125})
    assert m.stages(SimpleNamespace(num_layers=32)) == [8, 16, 24]
    assert m.stages(SimpleNamespace(num_layers=4)) == [1, 2, 3]
    m2 = build_method("tokens", "pyramiddrop", {"keep": 0.125, "layer": 2})
    assert m2.stages(SimpleNamespace(num_layers=32)) == [2, 10, 18]


def test_pyramiddrop_drops_at_every_stage_by_the_last_query_row(tiny_adapter):
    """Each stage keeps the top K_j by the last query's attention in the layer before it (the probe's row),
    and the sequence shrinks stage by stage to ceil(N * keep) per image."""
    adapter = tiny_adapter("qwen3_vl")
    runner = Runner(adapter)
    images, prompts = ragged_batch()
    prep = adapter.prepare(images, prompts)
    seen = []
    plan = make_plan("tokens=pyramiddrop:keep=0.25:layers=1-2-3", runner)
    method = build_methods("tokens=pyramiddrop:keep=0.25:layers=1-2-3")["tokens"]
    inner = type(method).choose

    def spy(self, view):
        sel = inner(self, view)
        for u in range(view.mask.shape[0]):
            n = int(view.n[u])
            scores = {j: float(view.attention[u, j]) for j in range(n)}
            assert set(torch.nonzero(sel.keep[u]).flatten().tolist()) == _loop_topk(scores, int(view.k[u]))
        seen.append((view.layer, view.k.tolist()))
        return sel

    type(method).choose = spy
    try:
        out = runner.prefill(prep, plan)
    finally:
        type(method).choose = inner
    n0 = [16, 24, 32]
    want = [c.tolist() for c in stage_counts(torch.tensor(n0), 0.25, 3)]
    assert seen == [(1, want[0]), (2, want[1]), (3, want[2])]
    assert (out.seq.visual & out.seq.valid).sum(1).tolist() == [math.ceil(n * 0.25) for n in n0]


# ---- PyramidKV ----------------------------------------------------------------------------------------
def _loop_pyramid_budgets(totals: int, m: int, beta: float) -> list[int]:
    top = totals / (beta * m)
    bottom = 2 * totals / m - top
    share = [bottom - (bottom - top) * i / (m - 1) for i in range(m)]
    k = [math.floor(s + 1e-9) for s in share]
    for i in sorted(range(m), key=lambda i: (-(share[i] - k[i]), i))[: totals - sum(k)]:
        k[i] += 1
    return k


@pytest.mark.parametrize("opts", [{}, {"beta": 4, "kernel": 3, "pool": "max"}])
def test_pyramidkv_budgets_and_picks_match_loop(opts):
    """Per sample: the uniform total sum_l ceil(n_l * keep), split over the layers in PyramidKV's arithmetic
    pyramid (bottom 2 k/m - k/(beta m), top k/(beta m)), then SnapKV's pooled window vote in each layer."""
    layers = 4
    policy = build_method("kv", "pyramidkv", {"keep": 0.25, "window": 4, **opts})
    entries = {i: _ragged_layer(10 + i)[0] for i in range(layers)}
    g = torch.Generator().manual_seed(7)
    att = {i: torch.softmax(3 * torch.randn(2, 4, 30, generator=g), -1) for i in range(layers)}
    row_valid = torch.tensor([[True] * 4, [False, True, True, True]])
    handoff = Handoff()
    handoff.probes["kv"] = SimpleNamespace(results=att, row_valid={i: row_valid for i in range(layers)})
    masks = policy.select(SimpleNamespace(cache=SimpleNamespace(layers=entries)), handoff)
    snap = build_method("kv", "snapkv", {"keep": 0.25, "window": 4})
    uniform = snap.select(SimpleNamespace(cache=SimpleNamespace(layers=entries)), handoff)
    for b in range(2):
        cands = [
            [j for j in range(30) if entries[i].visual[b, j] and entries[i].valid[b, j]]
            for i in range(layers)
        ]
        total = sum(math.ceil(len(c) * 0.25) for c in cands)
        budgets = _loop_pyramid_budgets(total, layers, float(policy.beta))
        assert budgets == sorted(budgets, reverse=True)  # a pyramid: fewer entries deeper
        kept = sum(int((masks[i][b] & entries[i].visual[b]).sum()) for i in range(layers))
        assert kept == total == sum(int((uniform[i][b] & entries[i].visual[b]).sum()) for i in range(layers))
        for i in range(layers):
            vote = _loop_snapkv(
                att[i][b],
                row_valid[b],
                entries[i].visual[b] & entries[i].valid[b],
                policy.kernel,
                policy.pool,
            )
            want = _loop_topk({j: vote[j] for j in cands[i]}, budgets[i])
            assert {j for j in range(30) if masks[i][b, j] and entries[i].visual[b, j]} == want


# ---- refusals -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "recipe, words",
    [
        ("tokens=vispruner:keep=0.5:important=2", ["important", "[0, 1]"]),
        ("tokens=vispruner:keep=0.5:layer=2", ["layer must be 0"]),
        ("tokens=fastervlm:keep=0.5:layer=3", ["layer must be 0"]),
        ("tokens=fastervlm:keep=0.5:vision_layer=x", ["vision_layer", "integer"]),
        ("tokens=gprune:keep=0.5:threshold=3", ["threshold", "[-1, 1]"]),
        ("tokens=gprune:keep=0.5:temperature=0", ["temperature", "> 0"]),
        ("tokens=gprune:keep=0.5:steps=0", ["steps", ">= 1"]),
        ("tokens=pyramiddrop:keep=0.5:layer=0", ["layer must be >= 1", "attention of layer L-1"]),
        ("tokens=pyramiddrop:keep=0.5:layers=3-2", ["increasing"]),
        ("tokens=pyramiddrop:keep=0.5:ratio=0.5", ["unknown option", "allowed"]),
        ("kv=pyramidkv:keep=0.5:beta=0.5", ["beta", ">= 1"]),
        ("kv=pyramidkv:keep=0.5:kernel=4", ["kernel", "odd"]),
        ("kv=pyramidkv:keep=0.5:pool=mean", ["pool", "avg"]),
    ],
)
def test_bad_options_are_refused_in_one_line(recipe, words):
    with pytest.raises(RecipeError) as e:
        build_methods(recipe)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_attention_ranked_stages_on_linear_layers_are_refused(tiny_adapter):
    """Qwen3.5 mixes Gated DeltaNet (linear) layers, which have no attention weights: a stage after one is
    refused with the layers that are allowed."""
    adapter = tiny_adapter("qwen3_5")
    runner = Runner(adapter)
    linear = [i for i in range(runner.num_layers - 1) if not runner.is_attention(i)]
    assert linear
    with pytest.raises(RecipeError) as e:
        make_plan(f"tokens=pyramiddrop:keep=0.5:layers={linear[0] + 1}", runner)
    assert "allowed on this model" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(RecipeError) as e:
        make_plan(f"tokens=pyramiddrop:keep=0.5:layer={runner.num_layers + 5}", runner)
    assert "allowed" in str(e.value) and "\n" not in str(e.value)


# ---- FitPrune -----------------------------------------------------------------------------------------
def test_fitprune_distributions_match_loop():
    g = torch.Generator().manual_seed(3)
    att = torch.softmax(torch.randn(3, 10, 10, generator=g), -1)
    cols = torch.tensor([2, 3, 5, 6])
    text = torch.zeros(10, dtype=torch.bool)
    text[[7, 8, 9]] = True
    cross, self_ = received(att, cols, text)
    hmax = [[max(float(att[h, q, k]) for h in range(3)) for k in range(10)] for q in range(10)]
    for i, v in enumerate(cols.tolist()):
        assert cross[i].item() == pytest.approx(sum(hmax[t][v] for t in (7, 8, 9)) / 3, rel=1e-6)
        assert self_[i].item() == pytest.approx(sum(hmax[u][v] for u in cols.tolist()) / 4, rel=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fitprune_deletes_the_tokens_low_in_both_distributions(seed):
    """Deleting d tokens by `deletion_order` deletes exactly B_m(cross) & B_m(self) (the lowest m by each)
    whenever that intersection has d tokens."""
    g = torch.Generator().manual_seed(seed)
    n = 15
    cross, self_ = torch.rand(n, generator=g), torch.rand(n, generator=g)
    order = deletion_order(cross, self_)
    low = lambda s, m: set(sorted(range(n), key=lambda j: (float(s[j]), j))[:m])  # noqa: E731
    for m in range(n + 1):
        both = low(cross, m) & low(self_, m)
        kept = topk_mask(order[None], torch.tensor([n - len(both)]), torch.ones(1, n, dtype=torch.bool))[0]
        assert set(torch.nonzero(~kept).flatten().tolist()) == both


def _loop_fit(stats, keep):
    """FitPrune's fit by plain loops: for alpha, layer by layer, stop once the layer-mean alive fraction is met
    assuming no more pruning; else each input deletes the largest prefix (ascending) of its alive tokens by
    each distribution that leaves (1 - alpha) of the layer's total, and the tokens in both prefixes go; the
    binary search keeps the smallest alpha that meets the budget."""

    def run(alpha):
        depth = len(stats[0].cross)
        alive = [set(range(len(s.cross[0]))) for s in stats]
        n0 = [len(s.cross[0]) for s in stats]
        used, fr = 0.0, []
        for i in range(depth):
            now = sum(len(a) / n for a, n in zip(alive, n0, strict=False)) / len(alive)
            if (used + now * (depth - i)) / depth <= keep + 1e-12:
                return True, fr + [now] * (depth - i)
            for a, s in zip(alive, stats, strict=False):
                gone = []
                for dist in (s.cross[i], s.self_[i]):
                    total, mass = sum(dist), sum(dist[j] for j in a)
                    order, cut = sorted(a, key=lambda j: (dist[j], j)), 0
                    while (
                        cut < len(order) - 1
                        and mass - sum(dist[j] for j in order[: cut + 1]) >= (1 - alpha) * total - 1e-12
                    ):
                        cut += 1
                    gone.append(set(order[:cut]))
                a -= gone[0] & gone[1]
            used += now
            fr.append(sum(len(a) / n for a, n in zip(alive, n0, strict=False)) / len(alive))
        return False, fr

    lo, hi = 0.0, 1.0
    best = run(hi)[1]
    while hi - lo > 0.01 + 1e-9:
        mid = (lo + hi) / 2
        ok, fr = run(mid)
        if ok:
            hi, best = mid, fr
        else:
            lo = mid
    return best


@pytest.mark.parametrize("keep", [0.8, 0.5, 0.25, 0.1])
def test_fitprune_fit_matches_loop(keep):
    g = torch.Generator().manual_seed(9)
    stats = []
    for n in (12, 9, 16):
        layers = [torch.softmax(4 * torch.randn(2, n, generator=g), -1).tolist() for _ in range(5)]
        stats.append(Stats([x[0] for x in layers], [x[1] for x in layers]))
    got = fit(stats, keep)
    assert got == pytest.approx(_loop_fit(stats, keep), abs=1e-12)
    assert sum([1.0, *got[:-1]]) / len(got) <= keep + 1e-9 or got[-1] < 0.2  # the budget, unless unreachable


def test_fitprune_runs_its_fitted_recipe_on_the_layers_own_attention(tiny_adapter, tmp_path):
    """Calibrated on the tiny model, each stage keeps ceil(N0 * fraction) per image, deleting by the layer's
    own attention statistics (a loop over the recorded rows)."""
    adapter = tiny_adapter("qwen3_vl")
    runner = Runner(adapter)
    images, prompts = ragged_batch()
    prep = adapter.prepare(images, prompts)
    path = write_statistics(runner, prep, tmp_path)
    recipe = f"tokens=fitprune:file={path}:keep=0.5"
    method = build_methods(recipe)["tokens"]
    stages = method.stages(runner)
    assert stages and all(1 <= s < runner.num_layers for s in stages)
    out, m, _ = plan_prefill(runner, prep, recipe)
    last = stages[max(stages)]
    assert (out.seq.visual & out.seq.valid).sum(1).tolist() == [
        max(1, math.ceil(n * last - 1e-9)) for n in (16, 24, 32)
    ]
    assert m.costs.method_total_flops > 0


def write_statistics(runner, prep, folder) -> str:
    import json

    stats = statistics(runner, prep)
    path = folder / "fitprune.json"
    path.write_text(
        json.dumps(
            {"num_layers": runner.num_layers, "inputs": [{"cross": s.cross, "self": s.self_} for s in stats]}
        )
    )
    return str(path)


@pytest.mark.parametrize(
    "recipe, words",
    [
        ("tokens=fitprune:keep=0.5", ["file=PATH", "trimvlm calibrate --method fitprune"]),
        ("tokens=fitprune:keep=0.5:file=x.json:layer=2", ["drop layer="]),
    ],
)
def test_fitprune_options_are_refused_in_one_line(recipe, words):
    with pytest.raises(RecipeError) as e:
        build_methods(recipe)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words)


def test_fitprune_refuses_a_missing_file_or_another_models(tiny_adapter, tmp_path):
    runner = Runner(tiny_adapter("qwen3_vl"))
    with pytest.raises(RecipeError, match="not found"):
        make_plan(f"tokens=fitprune:keep=0.5:file={tmp_path / 'none.json'}", runner)
    bad = tmp_path / "other.json"
    bad.write_text('{"num_layers": 99, "inputs": [{"cross": [[1.0]], "self": [[1.0]]}]}')
    with pytest.raises(RecipeError, match="99 layers"):
        make_plan(f"tokens=fitprune:keep=0.5:file={bad}", runner)


def test_fitprune_calibrates_through_the_calibrate_command(tmp_path):
    """`trimvlm calibrate --method fitprune` writes the statistics file that tokens=fitprune reads: one entry
    per input, a distribution per layer over its visual tokens (head maxima of probabilities: each in [0, 1]);
    an unknown method's refusal names it."""
    import json

    from rich.console import Console

    import trimvlm
    from trimvlm.cli_calibrate import calibrate_command
    from trimvlm.errors import InputError

    path = tmp_path / "fp.json"
    data = calibrate_command(
        "fitprune", model="demo", task="demo", n=3, json_out=path, console=Console(quiet=True)
    )
    assert json.loads(path.read_text()) == json.loads(json.dumps(data))
    assert len(data["inputs"]) == 3 and data["method"] == "fitprune"
    for entry in data["inputs"]:
        for dist in entry["cross"] + entry["self"]:
            assert dist is not None and sum(dist) > 0 and all(0 <= x <= 1 + 1e-6 for x in dist)
    vlm = trimvlm.load("demo")
    out = vlm.generate(
        random_image(2, (96, 96)),
        "describe ?",
        recipe=f"tokens=fitprune:file={path}:keep=0.5",
        max_new_tokens=2,
    )
    assert out.costs.method_total_flops > 0
    with pytest.raises(InputError, match="fitprune"):
        calibrate_command("nope", model="demo", task="demo", n=2, json_out=None)
