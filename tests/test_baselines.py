"""Baselines as their papers define them: H2O over all prefill queries, DivPrune's first pick, DART's
per-pivot budget, random per image, per-image budgets of tiled families, and every method's own FLOPs counted
on the method line, equal to torch's counter."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import ragged_batch

import trimvlm
from trimvlm.plan import Handoff, Plan, build_methods, make_plan
from trimvlm.runtime.attention import AttentionProbe
from trimvlm.runtime.generate import generate
from trimvlm.runtime.meter import Meter, flop_counter
from trimvlm.runtime.runner import Runner
from trimvlm.testing import random_image
from trimvlm.tokens.base import make_view


@pytest.fixture(scope="module")
def qwen(tiny_adapter):
    adapter = tiny_adapter("qwen3_vl")
    return adapter, Runner(adapter)


@torch.no_grad()
def _view(runner, adapter, images, prompts, keep, layer=0):
    seq = adapter.embed(adapter.prepare(images, prompts))
    return make_view(seq, keep, layer)


# ---- H2O: every prefill query ----------------------------------------------------------------------------
def test_h2o_column_sums_equal_every_row_of_the_softmax(qwen):
    """The blockwise column sums equal the sum over all real query rows (and heads) of the full softmax."""
    adapter, runner = qwen
    prep = adapter.prepare(*ragged_batch())
    q = prep.input_ids.shape[1]
    cols = AttentionProbe(colsum=True, block=7)  # several blocks, one of them ragged
    rows = AttentionProbe(last=q, per_head=True)
    out = runner.prefill(prep, Plan(probe=cols.merge(rows)))
    valid = out.seq.valid if out.seq.length == q else prep.attention_mask.bool()
    for i in out.cache.layers:
        full = rows.results[i] * valid[:, None, :, None]
        ref = full.sum(dim=(1, 2))
        assert torch.allclose(cols.results[i], ref, atol=1e-4)
        assert cols.results[i].shape == (prep.batch, out.cache.layers[i].key.shape[2])


def test_h2o_default_reads_all_queries_and_rows_is_the_cheap_variant(qwen):
    adapter, runner = qwen
    h2o = build_methods("kv=h2o:keep=0.25")["kv"]
    probe = h2o.probe(runner, Handoff())
    assert probe.colsum
    cheap = build_methods("kv=h2o:keep=0.25:rows=8")["kv"]
    probe = cheap.probe(runner, Handoff())
    assert not probe.colsum and probe.last == 8
    prep = adapter.prepare(*ragged_batch())
    a = generate(runner, prep, max_new_tokens=3, **_plan_kw(runner, "kv=h2o:keep=0.25"))
    b = generate(runner, prep, max_new_tokens=3, **_plan_kw(runner, "kv=h2o:keep=0.25:rows=8"))
    assert a.costs.kv_bytes == b.costs.kv_bytes  # the same budget ...
    assert a.costs.method_flops["prefill"] > b.costs.method_flops["prefill"] > 0  # ... all rows cost more


def _plan_kw(runner, recipe):
    return dict(plan=make_plan(recipe, runner), stop_ids=[], pad_id=0)


# ---- DivPrune ---------------------------------------------------------------------------------------------
def _divprune_reference(x: torch.Tensor, k: int) -> list[int]:
    """DivPrune with the full distance matrix: first the most isolated token, then greedy max-min."""
    xn = F.normalize(x.double(), dim=-1)
    d = 1 - xn @ xn.T
    n = d.shape[0]
    off = d + torch.eye(n, dtype=d.dtype) * 1e9
    picks = [int(off.amin(0).argmax())]
    mind = d[picks[0]].clone()
    while len(picks) < k:
        score = mind.clone()
        score[picks] = -1
        s = int(score.argmax())
        picks.append(s)
        mind = torch.minimum(mind, d[s])
    return sorted(picks)


@torch.no_grad()
def test_divprune_matches_the_full_matrix_reference(qwen):
    adapter, runner = qwen
    view = _view(runner, adapter, *ragged_batch(), keep=0.3)
    sel = build_methods("tokens=divprune:keep=0.3:layer=0")["tokens"].choose(view)
    for u in range(view.mask.shape[0]):
        n = int(view.n[u])
        ref = _divprune_reference(view.features[u, :n], int(view.k[u]))
        assert torch.nonzero(sel.keep[u]).flatten().tolist() == ref


# ---- DART -------------------------------------------------------------------------------------------------
def _dart_reference(x: torch.Tensor, basis: torch.Tensor, k: int, pivots: int) -> list[int]:
    norms = basis.double().norm(dim=-1)
    p = min(k, pivots)
    piv = sorted(range(len(norms)), key=lambda i: (-float(norms[i]), i))[:p]
    xn = F.normalize(x.double(), dim=-1)
    kept = set(piv)
    rest = k - p
    for j, pv in enumerate(piv):
        share = rest // p + (1 if j < rest % p else 0)
        sim = xn @ xn[pv]
        cand = sorted((i for i in range(len(x)) if i not in kept), key=lambda i: (float(sim[i]), i))
        kept.update(cand[:share])
    return sorted(kept)


@pytest.mark.parametrize("pivot", ["key", "hidden"])
@torch.no_grad()
def test_dart_splits_the_budget_over_key_norm_pivots(qwen, pivot):
    adapter, runner = qwen
    view = _view(runner, adapter, *ragged_batch(), keep=0.4, layer=2)
    dart = build_methods(f"tokens=dart:keep=0.4:pivots=3:pivot={pivot}")["tokens"]
    assert dart.at(runner) == 2  # the paper's layer
    view.keys = runner.layer_keys(view.layer, view.features) if dart.wants_keys else None  # its declared need
    sel = dart.choose(view)
    for u in range(view.mask.shape[0]):
        n = int(view.n[u])
        x = view.features[u, :n]
        basis = runner.layer_keys(2, x) if pivot == "key" else x
        assert torch.nonzero(sel.keep[u]).flatten().tolist() == _dart_reference(x, basis, int(view.k[u]), 3)


# ---- random: a different subset per image, the same alone or in a batch ---------------------------------
def test_random_draws_per_image_for_tokens_and_kv(qwen):
    adapter, runner = qwen
    img = random_image(5, (64, 64))
    other = random_image(6, (64, 64))
    two = adapter.prepare([[img, other]], ["two images"])
    base = generate(runner, two, max_new_tokens=1, **_plan_kw(runner, ""))
    e = runner.prefill(two).cache.layers[0]
    n_vis, n_text = int((e.visual & e.valid).sum()), int((~e.visual & e.valid).sum())
    for recipe in ("tokens=random:keep=0.3:layer=0", "kv=random:keep=0.3"):
        both = generate(runner, two, max_new_tokens=1, **_plan_kw(runner, recipe))
        # each image keeps ceil(0.3 n) of its n visual entries in every layer; text stays
        kept = 2 * math.ceil(0.3 * n_vis / 2)
        assert both.costs.kv_bytes == base.costs.kv_bytes * (n_text + kept) // (n_text + n_vis)

    def kept_cells(images, prompts, recipe):
        out = runner.prefill(adapter.prepare(images, prompts), make_plan(recipe, runner))
        e = out.cache.layers[max(out.cache.layers)]
        res = []
        for b in range(len(prompts)):
            cells = []
            for (h, w), st in zip(out.seq.grids[b], out.seq.image_start[b], strict=True):
                src = e.source[b][e.valid[b] & e.visual[b]]
                cells.append(sorted(int(s) - st for s in src if 0 <= int(s) - st < h * w))
            res.append(cells)
        return res

    for recipe in ("tokens=random:keep=0.3:layer=0", "kv=random:keep=0.3"):
        two = kept_cells([[img, other]], ["two images"], recipe)[0]
        same = kept_cells([[img, img]], ["two images"], recipe)[0]
        assert two[0] != two[1]  # different images, different subsets (same size, same index rule before)
        assert same[0] == same[1]  # the draw follows the image, not its index
        alone = kept_cells([[other]], ["describe"], recipe)[0][0]
        batch = kept_cells([[img], [other]], ["a longer prompt for the first", "describe"], recipe)[1][0]
        assert alone == batch
        if recipe.startswith("tokens"):  # budgets are per image (kv: per sample, over both images)
            assert alone == two[1]
        seeded = kept_cells([[other]], ["describe"], recipe.replace("keep=0.3", "keep=0.3:seed=7"))[0][0]
        assert seeded != alone


# ---- tiled families: the budget is per image ------------------------------------------------------------
@pytest.mark.parametrize("family", ["idefics3", "internvl"])
@torch.no_grad()
def test_tiled_images_share_one_budget(tiny_adapter, family):
    adapter = tiny_adapter(family)
    prep = adapter.prepare([[random_image(1, (160, 96)), random_image(2, (64, 64))]], ["two images"])
    seq = adapter.embed(prep)
    tiles = seq.tile_image[0]
    if len(set(tiles)) == len(tiles):
        pytest.skip(f"the tiny {family} processor made one tile per image")
    view = make_view(seq, 0.3, 0)
    for img in set(tiles):
        units = [u for u, t in enumerate(tiles) if t == img]
        n = int(view.n[units].sum())
        assert int(view.k[units].sum()) == max(len(units), math.ceil(n * 0.3 - 1e-9))


# ---- every method's own FLOPs: counted on the method line, equal to torch's counter ---------------------
RECIPES = [
    "tokens=density:keep=0.3:layer=1",
    "tokens=density:keep=0.3:layer=1:select=topk",
    "tokens=divprune:keep=0.3:layer=0:merge=true",
    "tokens=dart:keep=0.3",
    "tokens=tome:keep=0.3:layer=1",
    "tokens=fastv:keep=0.3:layer=1",
    "tokens=fastv:keep=0.3:layer=1:noise=1:trials=3",
    "kv=h2o:keep=0.25",
    "kv=h2o:keep=0.25:rows=4",
    "kv=snapkv:keep=0.25",
    "kv=density:keep=0.25",
    "tokens=density:keep=0.5:layer=1,kv=density:keep=0.25",
    "tokens=fastv:keep=0.5:layer=2,kv=h2o:keep=0.25",
]


@pytest.mark.parametrize("recipe", RECIPES)
def test_method_flops_equal_torch_counter(qwen, recipe):
    """torch's FlopCounterMode over a whole generate = the model's line + the method line; the method line is
    > 0 for every method that computes (a selection, a probe, a merge)."""
    adapter, runner = qwen
    prep = adapter.prepare(*ragged_batch())
    runner.vision_flops(prep)  # counted once per input shape, outside the measured run
    kw = _plan_kw(runner, recipe)
    meter = Meter()
    with flop_counter() as fc:
        out = generate(runner, prep, max_new_tokens=3, meter=meter, **kw)
    c = out.costs
    assert c.method_total_flops > 0
    assert c.model_flops + c.method_total_flops == c.total_flops == fc.get_total_flops()
    base = generate(runner, prep, max_new_tokens=1, stop_ids=[], pad_id=0).costs
    assert base.method_total_flops == 0


def test_demo_reports_the_method_line():
    vlm = trimvlm.load("demo")
    img = random_image(0, (64, 64))
    res = vlm.generate(img, "what colour is the circle", recipe="tokens=density:keep=0.25:layer=1", max_new_tokens=2)
    d = res.costs.as_dict()
    assert d["method_prefill_flops"] > 0
    assert d["total_flops"] == d["model_flops"] + d["method_total_flops"]


def test_image_budgets_split_one_image_budget_over_its_tiles():
    from trimvlm.tokens.base import image_budgets

    # image (0, 0) spans three tiles of 16 tokens, image (0, 1) one tile of 16, sample 1 one tile of 10
    n = [16, 16, 16, 16, 10]
    owner = [(0, 0), (0, 0), (0, 0), (0, 1), (1, 0)]
    k = image_budgets(n, owner, 0.3)
    assert sum(k[:3]) == math.ceil(48 * 0.3) == 15  # not 3 * ceil(16 * 0.3) = 15 ... at 0.3 they agree
    assert k[3] == 5 and k[4] == 3
    k = image_budgets(n, owner, 0.1)
    assert sum(k[:3]) == math.ceil(48 * 0.1 - 1e-9) == 5  # per tile it would have been 3 * 2 = 6
    assert max(k[:3]) - min(k[:3]) <= 1
    assert image_budgets([16, 16, 16], [(0, 0)] * 3, 0.01) == [1, 1, 1]  # at least one per tile


@pytest.mark.parametrize("family", ["qwen3_vl", "llava"])
def test_probe_rows_equal_eager_attention_weights(tiny_adapter, family):
    """The attention probe's rows (and H2O's column sums) equal transformers' eager attention weights."""
    adapter = tiny_adapter(family)
    prep = adapter.prepare([[random_image(4, (64, 96))]], ["what is the colour of the square"])
    rows = AttentionProbe(last=3, per_head=True)
    cols = AttentionProbe(colsum=True, block=5)
    Runner(adapter).prefill(prep, Plan(probe=rows.merge(cols)))
    cfg = adapter.model.config
    saved = cfg._attn_implementation
    try:
        cfg._attn_implementation = "eager"
        with torch.no_grad():
            ref = adapter.model(input_ids=prep.input_ids, attention_mask=prep.attention_mask,
                                **prep.model_inputs, output_attentions=True).attentions  # fmt: skip
    finally:
        cfg._attn_implementation = saved
    assert len(ref) == len(rows.results)
    for i, att in enumerate(ref):
        assert torch.allclose(rows.results[i], att[:, :, -3:].float(), atol=1e-5)
        assert torch.allclose(cols.results[i], att.float().sum(dim=(1, 2)), atol=1e-4)
