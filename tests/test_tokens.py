"""Prefill visual-token reducers: no-op at keep = 1, exact references for rho / FPS / merge, ragged
batches equal per-sample runs, FLOPs fall as predicted, recipe errors name what is allowed."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import hand_flops, plan_prefill, ragged_batch

from trimvlm.errors import RecipeError
from trimvlm.kernels import farthest_point, masked_minmax, merge_groups, spatial_density
from trimvlm.plan import Handoff, Plan, build_methods, make_plan
from trimvlm.registry import REGISTRIES, build_method, load_methods
from trimvlm.runtime.runner import Runner
from trimvlm.testing import random_image
from trimvlm.tokens.base import TokenReducer, make_view
from trimvlm.tokens.density import view_density
from trimvlm.vlm import VLM

FAMILY = "qwen3_vl"


def registered(keep: float, layers: tuple[int, ...], counted: bool) -> list[str]:
    """Every registered token method that reduces with `keep` at each of `layers`, read from the registry;
    `counted`: only those that keep the shared count K = ceil(N * keep) per image in the live sequence
    (predictable, with neither their own `counts` nor `resizes`: pool counts windows, downsample resizes the
    images when they are prepared). A method that refuses the layer (one acting before the LLM: prumerge,
    visionzip, holov, downsample; tests/test_vision_baselines.py, tests/test_tokens_field.py) or the keep
    (pool's grid of keeps) is left out; any other refusal fails here."""
    load_methods()
    out = []
    for name, cls in sorted(REGISTRIES["tokens"].items()):
        own = cls.counts is not TokenReducer.counts or cls.resizes
        if counted and (not cls.predictable or own):
            continue
        try:
            for layer in layers:
                build_method("tokens", name, {"keep": keep, "layer": layer})
        except RecipeError as e:
            assert "layer" in str(e) or "keep" in str(e), e
            continue
        out.append(name)
    return out


# an option that changes the selection rule, beside every method's defaults
VARIANTS = ["density:select=topk"]
NOOP = registered(1.0, (1, 3), counted=False) + VARIANTS
METHODS = registered(0.3, (1, 2, 3), counted=True) + VARIANTS
AT_ZERO = registered(0.5, (0,), counted=True)


_prefill = plan_prefill


@pytest.fixture(scope="module")
def setup(tiny_adapter):
    adapter = tiny_adapter(FAMILY)
    runner = Runner(adapter)
    images, prompts = ragged_batch()
    return adapter, runner, images, prompts


# ---- exact no-op and equivalences ---------------------------------------------------------------------
@pytest.mark.parametrize("method", NOOP)
def test_keep_one_is_exact_noop(setup, method):
    adapter, runner, images, prompts = setup
    prep = adapter.prepare(images, prompts)
    base, bm, _ = _prefill(runner, prep, "", all_logits=True)
    for layer in (1, 3):
        out, m, _ = _prefill(runner, prep, f"tokens={method}:keep=1.0:layer={layer}", all_logits=True)
        assert torch.equal(out.logits, base.logits)
        assert m.costs.flops["prefill"] == bm.costs.flops["prefill"]
    out, _, _ = _prefill(runner, prep, f"tokens={method}:prune=0:layer=1", all_logits=True)
    assert torch.equal(out.logits, base.logits)


@pytest.mark.parametrize("method", METHODS)
def test_ragged_batch_equals_per_sample_runs(setup, method):
    adapter, runner, images, prompts = setup
    # a 4th sample without an image is untouched by the reducer
    images = images + [[]]
    prompts = prompts + ["what is the colour of a red circle"]
    prep = adapter.prepare(images, prompts)
    recipe = f"tokens={method}:keep=0.3:layer=2"
    out, _, _ = _prefill(runner, prep, recipe)
    kept = (out.seq.visual & out.seq.valid).sum(1).tolist()
    assert kept == [math.ceil(n * 0.3) for n in (16, 24, 32)] + [0]  # different counts per sample
    for b in range(len(prompts)):
        one = adapter.prepare(images[b : b + 1], prompts[b : b + 1])
        alone, _, _ = _prefill(runner, one, recipe)
        assert (alone.logits[0] - out.logits[b]).abs().max().item() <= 1e-4
    base_last, _, _ = _prefill(runner, adapter.prepare(images[3:], prompts[3:]), "")
    assert (base_last.logits[0] - out.logits[3]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("method", METHODS)
def test_several_images_per_sample_each_on_its_own_grid(setup, method):
    adapter, runner, _, _ = setup
    images = [[random_image(1, (64, 64)), random_image(2, (64, 128))], [random_image(3, (96, 64))]]
    prompts = ["what is left and right", "describe"]
    prep = adapter.prepare(images, prompts)
    seq = adapter.embed(prep)
    assert [len(g) for g in seq.grids] == [2, 1]
    recipe = f"tokens={method}:keep=0.3:layer=2"
    out, _, _ = _prefill(runner, prep, recipe)
    vis = out.seq.visual & out.seq.valid
    per_image = [
        [int((vis[b] & (out.seq.image_id[b] == j)).sum()) for j in range(len(images[b]))] for b in range(2)
    ]
    assert per_image == [[math.ceil(16 * 0.3), math.ceil(32 * 0.3)], [math.ceil(24 * 0.3)]]
    for b in range(2):
        alone, _, _ = _prefill(runner, adapter.prepare(images[b : b + 1], prompts[b : b + 1]), recipe)
        assert (alone.logits[0] - out.logits[b]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("method", AT_ZERO)
def test_tiny_image_next_to_a_large_one(setup, method):
    """A 2x2-token image beside an 8x8 one: the small row runs out of tokens long before the large one has
    its k picks; each still keeps exactly its own ceil(N * keep) and matches its run alone."""
    adapter, runner, _, _ = setup
    images = [[random_image(4, (32, 32))], [random_image(5, (128, 128))]]
    prompts = ["what is the colour", "describe"]
    recipe = f"tokens={method}:keep=0.5:layer=0"  # prumerge: the vision tower's attention

    def prefill(images, prompts):  # prepared as the plan asks (downsample resizes the images then)
        plan = make_plan(recipe, runner)
        return runner.prefill(VLM(adapter).prepare(images, prompts, plan=plan), plan)

    out = prefill(images, prompts)
    assert (out.seq.visual & out.seq.valid).sum(1).tolist() == [2, 32]
    for b in range(2):
        alone = prefill(images[b : b + 1], prompts[b : b + 1])
        assert (alone.logits[0] - out.logits[b]).abs().max().item() <= 1e-4


def test_kept_tokens_keep_original_positions(setup):
    adapter, runner, images, prompts = setup
    prep = adapter.prepare(images, prompts)
    seen = {}

    def spy(i, seq, run):
        if i == 2:
            seen["before"] = seq
        if i == 3:
            seen["after"] = seq
        return hook(i, seq, run)

    plan = make_plan("tokens=density:keep=0.25:layer=3", runner)
    hook = plan.hook
    runner.prefill(prep, Plan(hook=spy))
    before, after = seen["before"], seen["after"]
    for b in range(prep.batch):
        for col in torch.nonzero(after.valid[b]).flatten().tolist():
            src = int(after.source[b, col])
            orig = int(torch.nonzero(before.source[b] == src))
            assert torch.equal(after.positions[:, b, col], before.positions[:, b, orig])


# ---- references --------------------------------------------------------------------------------------
def _rho_reference(x, window):
    h, w, _ = x.shape
    r = window // 2
    rho = torch.zeros(h, w, dtype=torch.float64)
    for i in range(h):
        for j in range(w):
            sims = [
                F.cosine_similarity(x[i, j], x[a, b], dim=0, eps=1e-12)
                for a in range(max(0, i - r), min(h, i + r + 1))
                for b in range(max(0, j - r), min(w, j + r + 1))
                if (a, b) != (i, j)
            ]
            rho[i, j] = 1.0 - sum(sims) / len(sims) if sims else 1.0
    return rho


@pytest.mark.parametrize("shape", [(1, 1), (1, 5), (3, 4), (6, 5)])
@pytest.mark.parametrize("window", [1, 3, 5])
def test_spatial_density_matches_double_loop(shape, window):
    x = torch.randn(*shape, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(sum(shape)))
    ref = _rho_reference(x, window)
    assert torch.allclose(spatial_density(x, window), ref, atol=1e-12)
    flat = spatial_density(x.reshape(-1, 7), window, grid=shape)
    assert torch.allclose(flat, ref.flatten(), atol=1e-12)
    batched = spatial_density(torch.stack([x, 2 * x]), window)  # cosine: scale-free
    assert torch.allclose(batched[1], ref, atol=1e-12)


def test_view_density_pads_grids_of_different_sizes(setup):
    adapter, _, images, prompts = setup
    seq = adapter.embed(adapter.prepare(images, prompts))
    view = make_view(seq, 0.5, 0)
    rho = view_density(view, 3)
    for u in range(view.mask.shape[0]):
        h, w = view.grid[u].tolist()
        n = int(view.n[u])
        x = view.features[u, :n].double().reshape(h, w, -1)
        assert torch.allclose(rho[u, :n].double(), _rho_reference(x, 3).flatten(), atol=1e-5)


def _fps_reference(x, k, beta, rho_t):
    """Straight from the formula: full pairwise cosine-distance matrix, one Python step per pick."""
    xn = F.normalize(x, dim=-1, eps=1e-12)
    dist = 1.0 - xn @ xn.T
    picks = [int(torch.argmax(rho_t))]
    mind = dist[picks[0]].clone()
    while len(picks) < k:
        score = mind + beta * rho_t
        score[picks] = float("-inf")
        s = int(torch.argmax(score))
        picks.append(s)
        mind = torch.minimum(mind, dist[s])
    nearest = torch.stack([dist[p] for p in picks]).argmin(0)
    return picks, [picks[i] for i in nearest.tolist()]


@pytest.mark.parametrize("beta", [0.0, 1.0, 3.0])
@pytest.mark.parametrize("block", [1, 4, 32])
def test_farthest_point_order_matches_slow_reference(beta, block):
    gen = torch.Generator().manual_seed(7)
    sizes, ks = [40, 25, 33], [9, 25, 1]
    nmax = max(sizes)
    x = torch.zeros(len(sizes), nmax, 16, dtype=torch.float64)
    mask = torch.zeros(len(sizes), nmax, dtype=torch.bool)
    rho = torch.zeros(len(sizes), nmax, dtype=torch.float64)
    for u, n in enumerate(sizes):
        x[u, :n] = torch.randn(n, 16, dtype=torch.float64, generator=gen)
        rho[u, :n] = torch.rand(n, dtype=torch.float64, generator=gen)
        mask[u, :n] = True
    rt = masked_minmax(rho, mask)
    xn = F.normalize(x, dim=-1, eps=1e-12)
    tilt = beta * rt.masked_fill(~mask, 0.0)
    k = torch.tensor(ks)
    picks, nearest = farthest_point(xn, mask, k, tilt, rt.argmax(1), track_nearest=True, block=block)
    for u, n in enumerate(sizes):
        ref, ref_near = _fps_reference(x[u, :n], ks[u], beta, rt[u, :n])
        assert picks[u, : ks[u]].tolist() == ref
        assert nearest[u, :n].tolist() == ref_near


def test_farthest_point_default_block_with_many_picks_matches_reference():
    """Picks over several default blocks (each refill the picks the look-ahead is certain of): the picks and
    nearest picks stay the formula's."""
    from trimvlm.kernels import density

    gen = torch.Generator().manual_seed(11)
    n, k = 4 * density.BLOCK + 8, 3 * density.BLOCK + 10
    x = torch.randn(1, n, 8, dtype=torch.float64, generator=gen)
    rt = masked_minmax(torch.rand(1, n, dtype=torch.float64, generator=gen), torch.ones(1, n, dtype=torch.bool))
    xn = F.normalize(x, dim=-1, eps=1e-12)
    mask = torch.ones(1, n, dtype=torch.bool)
    picks, nearest = farthest_point(xn, mask, torch.tensor([k]), rt, rt.argmax(1), track_nearest=True)
    ref, ref_near = _fps_reference(x[0], k, 1.0, rt[0])
    assert picks[0].tolist() == ref and nearest[0].tolist() == ref_near


def test_merge_conserves_size_weighted_sum():
    gen = torch.Generator().manual_seed(3)
    u, n, d = 3, 20, 8
    x = torch.randn(u, n, d, dtype=torch.float64, generator=gen)
    mask = torch.ones(u, n, dtype=torch.bool)
    mask[2, 15:] = False
    size = torch.randint(1, 5, (u, n), generator=gen) * mask
    keep = torch.zeros(u, n, dtype=torch.bool)
    keep[:, :5] = True
    assign = torch.randint(0, 5, (u, n), generator=gen)
    merged, members = merge_groups(x, keep, assign, size.double(), mask)
    new_size = torch.zeros_like(size).scatter_add_(
        1, torch.where(keep | ~mask, torch.arange(n), assign), size
    )
    lhs = (merged * (new_size * keep)[..., None]).sum(1)
    rhs = (x * (size * mask)[..., None]).sum(1)
    assert torch.allclose(lhs, rhs, atol=1e-10)
    assert members[keep].sum() == mask.sum()


@pytest.mark.parametrize(
    "recipe", ["density:keep=0.25", "density:keep=0.25:size_weighted=true", "tome:keep=0.2"]
)
def test_merge_in_the_live_sequence_conserves_mass(setup, recipe):
    """A reduction with merge keeps sum(size * hidden) and sum(size) over each image's tokens, and the deepstack
    adds are merged with the same groups (their size-weighted sum is conserved too)."""
    adapter, runner, images, prompts = setup
    seq = adapter.embed(adapter.prepare(images, prompts))
    assert seq.adds.get("deepstack")  # this tiny family adds deepstack features
    reducer = build_methods(f"tokens={recipe}:layer=0")["tokens"]
    out = reducer.reduce(seq, runner, Handoff())

    def mass(s, t):
        w = (s.size * s.visual)[..., None].to(t.dtype)
        return (t * w).sum(1), (s.size * s.visual).sum(1)

    for t0, t1 in [(seq.hidden, out.hidden)] + list(
        zip(seq.adds["deepstack"], out.adds["deepstack"], strict=True)
    ):
        (m0, n0), (m1, n1) = mass(seq, t0), mass(out, t1)
        assert torch.equal(n0, n1)
        assert torch.allclose(m0, m1, atol=1e-4)
    assert out.length < seq.length


# ---- costs --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layer", [0, 2])
def test_pruned_flops_match_analytic_count(setup, layer):
    adapter, runner, images, prompts = setup
    prep = adapter.prepare(images, prompts)
    out, meter, _ = _prefill(runner, prep, f"tokens=density:prune=0.75:layer={layer}")
    b, s0 = prep.input_ids.shape
    n_img = [16, 24, 32]
    text = prep.attention_mask.sum(1) - torch.tensor(n_img)
    s1 = int(max(int(t) + math.ceil(n / 4) for t, n in zip(text, n_img, strict=True)))
    assert out.seq.length == s1
    cfg = adapter.text_config  # by hand from the sizes, not from the count the meter itself calls
    for i in range(adapter.num_layers):
        q = s0 if i < layer else s1
        assert meter.costs.layer_flops["prefill"][i] == hand_flops(cfg, b, q, q)
    assert meter.costs.flops["prefill"] == (
        hand_flops(cfg, b, s0, s0, layer) + hand_flops(cfg, b, s1, s1, adapter.num_layers - layer)
        + 2 * b * cfg.hidden_size * cfg.vocab_size
    )  # fmt: skip
    full = out.cache.layers[adapter.num_layers - 1].key.shape[2]
    assert full == s1  # the KV written from layer L on is the shrunk sequence


# ---- recipe errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "recipe, words",
    [
        ("tokens=density:keep=0", ["keep", "(0, 1]"]),
        ("tokens=density:keep=1.5", ["keep", "(0, 1]"]),
        ("tokens=tome:prune=1", ["prune", "[0, 1)"]),
        ("tokens=random:keep=0.5:prune=0.5", ["exactly one"]),
        ("tokens=dart", ["exactly one"]),
        ("tokens=density:keep=0.5:window=4", ["window", "odd"]),
        ("tokens=density:keep=0.5:select=kmeans", ["fps", "topk"]),
        ("tokens=density:keep=0.5:beta=-1", ["beta"]),
        ("tokens=density:keep=0.5:alpha=2", ["alpha", "beta", "window", "select"]),
        ("tokens=fastv:keep=0.5:layer=0", ["layer", ">= 1"]),
        ("tokens=sparsevit:keep=0.5", ["sparsevit", "density", "fastv", "tome", "visionzip"]),
    ],
)
def test_recipe_errors_name_what_is_allowed(recipe, words):
    with pytest.raises(RecipeError) as e:
        build_methods(recipe)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("method", METHODS)
def test_layer_out_of_range_names_the_range(setup, method):
    _, runner, _, _ = setup
    n = runner.num_layers
    with pytest.raises(RecipeError) as e:
        make_plan(f"tokens={method}:keep=0.5:layer={n}", runner)
    lo = REGISTRIES["tokens"][method.split(":")[0]].min_layer
    assert f"{lo}..{n - 1}" in str(e.value)
    make_plan(f"tokens={method}:keep=0.5:layer={n - 1}", runner)  # the last layer is allowed


def test_default_layer_is_clamped_to_the_model(setup):
    _, runner, _, _ = setup
    reducer = build_methods("tokens=density:keep=0.5")["tokens"]
    assert reducer.at(runner) == min(3, runner.num_layers - 1)
    reducer.check(runner)
