"""The field's strongest prefill baselines: pool, cdpruner, holov, downsample. Each against a reference
written here from its definition; a ragged batch equals each sample alone on every family; keep = 1 changes
nothing; the method FLOPs are exactly what torch's counter sees on top of the model's."""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import AVAILABLE, plan_prefill, ragged_batch

from trimvlm.errors import RecipeError
from trimvlm.plan import Handoff, build_methods, make_plan
from trimvlm.runtime.generate import generate
from trimvlm.runtime.meter import Meter, flop_counter
from trimvlm.runtime.runner import Runner
from trimvlm.testing import random_image
from trimvlm.tokens.base import instruction_features, make_view
from trimvlm.tokens.cdpruner import dpp_greedy

pytestmark = pytest.mark.usefixtures("one_thread")

# every new method at a budget and layer it allows (holov reads the vision tower: layer 0 only)
RECIPES = ["pool:keep=0.25", "cdpruner:keep=0.3", "holov:keep=0.3"]


@pytest.fixture(scope="module")
def qwen(tiny_adapter):
    adapter = tiny_adapter("qwen3_vl")
    return adapter, Runner(adapter)


def _units(seq):
    """(sample, image) -> live columns of that image's tokens, in grid order."""
    out = {}
    for b in range(seq.batch):
        for j in range(len(seq.grids[b])):
            cols = torch.nonzero(seq.visual[b] & seq.valid[b] & (seq.image_id[b] == j)).flatten()
            out[(b, j)] = cols[torch.argsort(seq.source[b, cols])]
    return out


# ---- pool: avg_pool2d on each grid -----------------------------------------------------------------------
@pytest.mark.parametrize("keep, window", [(0.5, (1, 2)), (0.25, (2, 2)), (0.125, (2, 4))])
@torch.no_grad()
def test_pool_equals_avg_pool2d_on_each_grid(qwen, keep, window):
    adapter, runner = qwen
    images = [[random_image(1, (64, 64))], [random_image(2, (96, 64)), random_image(3, (64, 160))]]
    seq = adapter.embed(adapter.prepare(images, ["what is the colour", "two images here"]))
    out = build_methods(f"tokens=pool:keep={keep}:layer=0")["tokens"].reduce(seq, runner, Handoff())
    before, after = _units(seq), _units(out)
    for (b, j), cols in before.items():
        h, w = seq.grids[b][j]
        kh, kw = window if w >= h else window[::-1]  # the longer side of the window along the longer grid side
        grid = seq.hidden[b, cols].double().T.reshape(1, -1, h, w)
        ref = F.avg_pool2d(grid, (kh, kw), ceil_mode=True)[0].flatten(1).T  # [windows, D]
        got = out.hidden[b, after[(b, j)]].double()
        assert got.shape == ref.shape == (math.ceil(h / kh) * math.ceil(w / kw), seq.hidden.shape[-1])
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        for name, ts in seq.adds.items():  # Qwen3-VL's deepstack features: pooled with the same windows
            for t0, t1 in zip(ts, out.adds[name], strict=True):
                g = t0[b, cols].double().T.reshape(1, -1, h, w)
                torch.testing.assert_close(
                    t1[b, after[(b, j)]].double(), F.avg_pool2d(g, (kh, kw), ceil_mode=True)[0].flatten(1).T,
                    rtol=1e-5, atol=1e-6,
                )
        # each pooled token sits at its window's top-left token
        first = [r * w + c for r in range(0, h, kh) for c in range(0, w, kw)]
        start = seq.image_start[b][j]
        assert (out.source[b, after[(b, j)]] - start).tolist() == first


def test_pool_keep_must_be_one_over_an_integer():
    with pytest.raises(RecipeError, match="1 / an integer"):
        build_methods("tokens=pool:keep=0.3")
    with pytest.raises(RecipeError, match="merge=true"):
        build_methods("tokens=pool:keep=0.25:merge=false")


# ---- cdpruner: greedy DPP MAP == brute-force greedy log-det --------------------------------------------
def _greedy_logdet(x: torch.Tensor, q: torch.Tensor, k: int) -> list[int]:
    """Greedy MAP of the DPP with kernel diag(q) X X^T diag(q), straight from the definition: at every step
    the token whose addition gives the largest log det of the kernel's principal submatrix."""
    kern = q[:, None] * (x @ x.T) * q[None, :]
    picks: list[int] = []
    for _ in range(k):
        best, arg = -math.inf, -1
        for i in range(len(x)):
            if i in picks:
                continue
            s = picks + [i]
            v = torch.logdet(kern[s][:, s]).item()
            if v > best:
                best, arg = v, i
        picks.append(arg)
    return picks


def test_dpp_greedy_equals_brute_force_log_det():
    gen = torch.Generator().manual_seed(11)
    sizes, ks, d = [12, 9, 15], [6, 9, 4], 24  # d > n: the kernel is full rank
    x = torch.zeros(3, max(sizes), d, dtype=torch.float64)
    q = torch.zeros(3, max(sizes), dtype=torch.float64)
    mask = torch.zeros(3, max(sizes), dtype=torch.bool)
    for u, n in enumerate(sizes):
        x[u, :n] = F.normalize(torch.randn(n, d, dtype=torch.float64, generator=gen), dim=-1)
        q[u, :n] = torch.rand(n, dtype=torch.float64, generator=gen) + 0.1
        mask[u, :n] = True
    picks = dpp_greedy(x, q, mask, torch.tensor(ks))
    for u, n in enumerate(sizes):
        assert picks[u, : ks[u]].tolist() == _greedy_logdet(x[u, :n], q[u, :n], ks[u])


@torch.no_grad()
def test_cdpruner_selection_equals_reference_on_the_model(qwen):
    """On the model's own features: relevance = mean cosine to the instruction's tokens, min-max per image;
    the kept set = the brute-force greedy log-det picks of diag(r) S diag(r)."""
    adapter, runner = qwen
    images, prompts = ragged_batch()
    seq = adapter.embed(adapter.prepare(images, prompts))
    view = make_view(seq, 0.3, 0)
    red = build_methods("tokens=cdpruner:keep=0.3")["tokens"]
    view.text, view.text_mask = instruction_features(seq, view)
    sel = red.choose(view)
    for u in range(view.mask.shape[0]):
        b, n = int(view.sample[u]), int(view.n[u])
        vis = torch.nonzero(seq.visual[b] & seq.valid[b]).flatten()
        text_cols = [c for c in torch.nonzero(seq.valid[b] & ~seq.visual[b]).flatten().tolist() if c > vis[-1]]
        x = F.normalize(view.features[u, :n].double(), dim=-1)
        t = F.normalize(seq.hidden[b, text_cols].double(), dim=-1)
        r = (x @ t.T).mean(1)
        r = (r - r.min() + 1e-6) / (r.max() - r.min())
        ref = sorted(_greedy_logdet(x, r, int(view.k[u])))
        assert torch.nonzero(sel.keep[u]).flatten().tolist() == ref


def test_cdpruner_follows_the_instruction(qwen):
    """The same image with two different questions can keep different tokens (the relevance term acts)."""
    adapter, runner = qwen
    img = random_image(7, (96, 96))
    kept = []
    for prompt in ("what is the colour of the circle", "how many squares are in the top row"):
        out, _, _ = plan_prefill(runner, adapter.prepare([[img]], [prompt]), "tokens=cdpruner:keep=0.25")
        kept.append(sorted(out.seq.source[0][out.seq.visual[0] & out.seq.valid[0]].tolist()))
    assert kept[0] != kept[1]


# ---- every family: ragged batch == each sample alone; keep = 1 is a no-op --------------------------------
@pytest.mark.parametrize("family", AVAILABLE)
@pytest.mark.parametrize("recipe", RECIPES)
def test_ragged_batch_equals_each_sample_alone(tiny_adapter, family, recipe):
    adapter = tiny_adapter(family)
    runner = Runner(adapter)
    images, prompts = ragged_batch()
    images, prompts = images + [[]], prompts + ["what is the colour of a red circle"]
    prep = adapter.prepare(images, prompts)
    full = f"tokens={recipe}:layer=0"
    out, _, _ = plan_prefill(runner, prep, full)
    base, _, _ = plan_prefill(runner, prep, "")
    n_vis = (base.seq.visual & base.seq.valid).sum(1)
    kept = (out.seq.visual & out.seq.valid).sum(1)
    assert (kept[:3] < n_vis[:3]).all() and int(kept[3]) == 0
    for b in range(len(prompts)):
        alone, _, _ = plan_prefill(runner, adapter.prepare(images[b : b + 1], prompts[b : b + 1]), full)
        assert (alone.logits[0] - out.logits[b]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("recipe", RECIPES)
def test_ragged_batch_at_layer_two(qwen, recipe):
    if recipe.startswith("holov"):
        pytest.skip("holov reads the vision tower's attention: layer 0 only")
    adapter, runner = qwen
    images, prompts = ragged_batch()
    prep = adapter.prepare(images, prompts)
    out, _, _ = plan_prefill(runner, prep, f"tokens={recipe}:layer=2")
    for b in range(3):
        alone, _, _ = plan_prefill(runner, adapter.prepare(images[b : b + 1], prompts[b : b + 1]),
                                   f"tokens={recipe}:layer=2")  # fmt: skip
        assert (alone.logits[0] - out.logits[b]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("method", ["pool", "cdpruner", "holov"])
def test_keep_one_is_an_exact_noop(qwen, method):
    adapter, runner = qwen
    prep = adapter.prepare(*ragged_batch())
    base, bm, _ = plan_prefill(runner, prep, "", all_logits=True)
    for layer in (0,) if method == "holov" else (0, 2):
        out, m, _ = plan_prefill(runner, prep, f"tokens={method}:keep=1.0:layer={layer}", all_logits=True)
        assert torch.equal(out.logits, base.logits)
        assert m.costs.flops == bm.costs.flops and m.costs.method_total_flops == 0


# ---- the method line: exactly torch's counter minus the model's ----------------------------------------
@pytest.mark.parametrize("recipe", RECIPES)
def test_method_flops_equal_torch_counter(qwen, recipe):
    adapter, runner = qwen
    prep = adapter.prepare(*ragged_batch())
    runner.vision_flops(prep)  # counted once per input shape, outside the measured run
    plan = make_plan(f"tokens={recipe}", runner)
    with flop_counter() as fc:
        out = generate(runner, prep, plan, max_new_tokens=2, stop_ids=[], pad_id=0, meter=Meter())
    c = out.costs
    assert c.model_flops + c.method_total_flops == c.total_flops == fc.get_total_flops()
    if recipe.startswith("pool"):
        assert c.method_total_flops == 0  # averaging is element-wise
    else:
        assert c.method_total_flops > 0


# ---- holov: budget split over crops, the most attended inside each -------------------------------------
def _holov_reference(x: torch.Tensor, a: torch.Tensor, k: int, crops: int, alpha=1.0, beta=0.09) -> list[int]:
    """HoloV, one Python step at a time: crops = contiguous runs of the raster order (the first n % crops one
    longer); token score a_i + beta v_i (mean|a| / mean|v|) within its crop, v_i = variance of cos(x_i, x_j) over
    the crop's other tokens; crop weight = mean score / sum; floor(w K) plus the remainder one each by weight,
    overflow passed on by weight; the most attended tokens of each crop."""
    n = len(x)
    c = min(n, crops)
    size, extra = n // c, n % c
    bounds, s = [], 0
    for i in range(c):
        e = s + size + (1 if i < extra else 0)
        bounds.append(list(range(s, e)))
        s = e
    xn = F.normalize(x.double(), dim=-1)
    weights = []
    for idx in bounds:
        var = []
        for i in idx:
            sims = [float(xn[i] @ xn[j]) for j in idx if j != i]
            if not sims:
                var.append(0.0)
                continue
            m = sum(sims) / len(sims)
            var.append(sum((v - m) ** 2 for v in sims) / len(sims))
        att = [float(a[i]) for i in idx]
        scale = (sum(abs(v) for v in att) / len(att)) / (sum(abs(v) for v in var) / len(var) + 1e-6)
        scores = [alpha * ai + beta * vi * scale for ai, vi in zip(att, var, strict=True)]
        weights.append(sum(scores) / len(scores))
    tot = sum(weights)
    w = [v / tot for v in weights]
    alloc = [min(len(b), math.floor(v * k)) for v, b in zip(w, bounds, strict=True)]
    by_weight = sorted(range(c), key=lambda i: (-w[i], i))
    while sum(alloc) < k:
        left = k - sum(alloc)
        for i in by_weight:
            if left and alloc[i] < len(bounds[i]):
                alloc[i] += 1
                left -= 1
    kept = []
    for idx, q in zip(bounds, alloc, strict=True):
        kept += sorted(idx, key=lambda i: (-float(a[i]), i))[:q]
    return sorted(kept)


@pytest.mark.parametrize("family", ["qwen3_vl", "llava"])
@pytest.mark.parametrize("keep, crops", [(0.3, 4), (0.125, 16), (0.6, 3)])
@torch.no_grad()
def test_holov_selection_equals_loop_reference(tiny_adapter, family, keep, crops):
    adapter = tiny_adapter(family)
    runner = Runner(adapter)
    images, prompts = ragged_batch()
    prep = adapter.prepare(images, prompts)
    red = build_methods(f"tokens=holov:keep={keep}:crops={crops}")["tokens"]
    plan = make_plan(f"tokens=holov:keep={keep}:crops={crops}", runner)
    seen = {}

    def spy(i, seq, run):
        if i == 0:
            view = make_view(seq, keep, 0)
            red.read_attention(view, seq, 0, plan.handoff)
            seen["view"], seen["sel"] = view, red.choose(view)
        return seq

    plan.hook = spy
    runner.prefill(prep, plan)
    view, sel = seen["view"], seen["sel"]
    for u in range(view.mask.shape[0]):
        n = int(view.n[u])
        ref = _holov_reference(view.features[u, :n], view.attention[u, :n].double(), int(view.k[u]), crops)
        assert torch.nonzero(sel.keep[u]).flatten().tolist() == ref


@pytest.mark.parametrize("crops", [1, 3, 16])
def test_holov_crop_variance_equals_loop_reference(crops):
    """The batched crop variance (every crop of every unit in one product) equals a per-token loop, on ragged
    units, units with fewer tokens than crops and a unit of one token."""
    from trimvlm.tokens.base import VisualView
    from trimvlm.tokens.holov import crop_variance, crops_of

    gen = torch.Generator().manual_seed(3)
    lengths = [13, 40, 2, 1]
    n, d = max(lengths), 6
    x = torch.randn(len(lengths), n, d, generator=gen, dtype=torch.float64)
    mask = torch.arange(n)[None] < torch.tensor(lengths)[:, None]
    view = VisualView.__new__(VisualView)
    view.mask, view.n = mask, torch.tensor(lengths)
    crop = crops_of(view, crops)
    size = torch.stack([(crop == c).sum(1) for c in range(int(crop.max()) + 1)], 1)
    xn = F.normalize(x, dim=-1)
    got = crop_variance(xn, size)
    for u, length in enumerate(lengths):
        for i in range(n):
            others = [j for j in range(length) if j != i and crop[u, j] == crop[u, i]] if i < length else []
            sims = torch.tensor([float(xn[u, i] @ xn[u, j]) for j in others], dtype=torch.float64)
            ref = float(((sims - sims.mean()) ** 2).mean()) if len(others) else 0.0
            assert abs(float(got[u, i]) - ref) <= 1e-12


# ---- downsample: the image is prepared smaller, the vision tower makes fewer tokens -----------------------
RESIZING = [f for f in ("qwen3_vl", "qwen2_5_vl", "qwen3_5") if f in AVAILABLE]


def _grids(prep, merge):
    return [(h // merge, w // merge) for _, h, w in prep.model_inputs["image_grid_thw"].tolist()]


@pytest.mark.parametrize("family", RESIZING)
@pytest.mark.parametrize("keep", [0.5, 0.25])
@torch.no_grad()
def test_downsample_prepares_each_image_at_the_scaled_grid(vlms, family, keep):
    """Each image's token grid is round(side * sqrt(keep)); its pixels are those of the image resized by hand to
    that grid and prepared as is; a ragged batch equals each sample alone."""
    vlm = vlms(family)
    ad, runner = vlm.adapter, vlm.runner
    images, prompts = ragged_batch()
    plan = make_plan(f"tokens=downsample:keep={keep}", runner)
    prep = vlm.prepare(images, prompts, plan=plan)
    natural = _grids(ad.prepare(images, prompts), ad.merge)
    want = [(max(1, round(h * math.sqrt(keep))), max(1, round(w * math.sqrt(keep)))) for h, w in natural]
    assert _grids(prep, ad.merge) == want
    f = ad.image_processor.patch_size * ad.merge
    by_hand = [[im.resize((tw * f, th * f), resample=3)] for (im,), (th, tw) in zip(images, want, strict=True)]
    ref = ad.prepare(by_hand, prompts)
    assert torch.equal(ref.input_ids, prep.input_ids)
    torch.testing.assert_close(ref.model_inputs["pixel_values"], prep.model_inputs["pixel_values"])
    out = runner.prefill(prep, plan)
    for b in range(3):
        p1 = make_plan(f"tokens=downsample:keep={keep}", runner)
        alone = runner.prefill(vlm.prepare(images[b : b + 1], prompts[b : b + 1], plan=p1), p1)
        assert (alone.logits[0] - out.logits[b]).abs().max().item() <= 1e-4


# qwen3_5 left out: torch's counter also sees the matmuls of the Gated DeltaNet reference kernels, which the
# model line counts by its own rule (tests/test_meter.py)
@pytest.mark.parametrize("family", [f for f in RESIZING if f != "qwen3_5"])
def test_downsample_lowers_vision_flops_and_counts_them_exactly(vlms, family):
    vlm = vlms(family)
    images, prompts = ragged_batch()
    base = vlm.generate(images, prompts, max_new_tokens=2).costs
    plan = make_plan("tokens=downsample:keep=0.25", vlm.runner)
    prep = vlm.prepare(images, prompts, plan=plan)
    vlm.runner.vision_flops(prep)
    with flop_counter() as fc:
        out = generate(vlm.runner, prep, plan, max_new_tokens=2, stop_ids=[], pad_id=0, meter=Meter())
    c = out.costs
    assert c.flops["vision"] < base.flops["vision"] and c.flops["prefill"] < base.flops["prefill"]
    assert c.method_total_flops == 0
    assert c.model_flops == c.total_flops == fc.get_total_flops()


def test_downsample_keep_one_is_a_noop_and_needs_its_preparation(vlms):
    vlm = vlms("qwen3_vl")
    images, prompts = ragged_batch()
    plan = make_plan("tokens=downsample:keep=1.0", vlm.runner)
    assert plan.resolution is None
    a = vlm.runner.prefill(vlm.prepare(images, prompts, plan=plan), plan, all_logits=True)
    b = vlm.runner.prefill(vlm.prepare(images, prompts), None, all_logits=True)
    assert torch.equal(a.logits, b.logits)
    plan = make_plan("tokens=downsample:keep=0.5", vlm.runner)
    with pytest.raises(Exception, match="plan=plan"):
        vlm.runner.prefill(vlm.prepare(images, prompts), plan)  # prepared without the plan: refused


@pytest.mark.parametrize("family", [f for f in ("llava", "idefics3", "internvl") if f in AVAILABLE])
def test_downsample_is_refused_where_the_tower_has_one_resolution(tiny_adapter, family):
    with pytest.raises(RecipeError, match="fixed-resolution"):
        make_plan("tokens=downsample:keep=0.5", Runner(tiny_adapter(family)))
    with pytest.raises(RecipeError, match="layer must be 0"):
        build_methods("tokens=downsample:keep=0.5:layer=2")


def test_dpp_greedy_keeps_exactly_k_past_the_kernels_rank():
    """More picks than the features' rank (d = 4 < k): the gains run out, the rest follow the quality, every
    pick is a different real token."""
    gen = torch.Generator().manual_seed(5)
    x = F.normalize(torch.randn(2, 30, 4, generator=gen), dim=-1)
    q = torch.rand(2, 30, generator=gen) + 0.1
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1, 20:] = False
    picks = dpp_greedy(x, q, mask, torch.tensor([25, 20]))
    assert sorted(set(picks[0].tolist())) == sorted(picks[0].tolist()) and len(set(picks[0].tolist())) == 25
    assert sorted(picks[1, :20].tolist()) == list(range(20))
    first = _greedy_logdet(x[0].double(), q[0].double(), 4)  # within the rank: the log-det picks
    assert picks[0, :4].tolist() == first
    rest = [i for i in sorted(range(30), key=lambda i: (-float(q[0, i]), i)) if i not in first]
    assert picks[0, 4:].tolist() == rest[:21]


# ---- sparsevlm: raters, progressive stages, recycling ---------------------------------------------------
def _raters_reference(seq, b):
    vis = [c for c in range(seq.length) if seq.visual[b, c] and seq.valid[b, c]]
    text = [c for c in range(seq.length) if seq.valid[b, c] and not seq.visual[b, c] and c > vis[-1]]
    rel = []
    for m in text:
        acc = 0.0
        for i in vis:
            logits = torch.stack([seq.hidden[b, i].double() @ seq.hidden[b, t].double() for t in text])
            acc += float(torch.softmax(logits, 0)[text.index(m)])
        rel.append(acc / len(vis))
    mean = sum(rel) / len(rel)
    return sorted(int(seq.source[b, t]) for t, r in zip(text, rel, strict=True) if r > mean)


def _dpc_reference(x: torch.Tensor, k: int) -> tuple[list[int], list[int]]:
    m, d = x.shape
    dist = [[float((x[i] - x[j]).norm()) / math.sqrt(d) for j in range(m)] for i in range(m)]
    kk = min(k, m)
    rho = [math.exp(-sum(v**2 for v in sorted(row)[:kk]) / kk) for row in dist]
    top = max(max(row) for row in dist)
    delta = []
    for i in range(m):
        denser = [dist[i][j] for j in range(m) if rho[j] > rho[i] or (rho[j] == rho[i] and j < i)]
        delta.append(min(denser) if denser else top)
    centers = sorted(range(m), key=lambda i: (-rho[i] * delta[i], i))[:kk]
    assign = [centers.index(i) if i in centers else min(range(kk), key=lambda c: (dist[i][centers[c]], c))
              for i in range(m)]  # fmt: skip
    return centers, assign


@torch.no_grad()
def test_sparsevlm_raters_and_clustering_equal_loop_references(qwen):
    from trimvlm.tokens.sparsevlm import dpc_knn, raters

    adapter, _ = qwen
    seq = adapter.embed(adapter.prepare(*ragged_batch()))
    got = raters(seq)
    for b in range(seq.batch):
        assert sorted(got[b].tolist()) == _raters_reference(seq, b)
        assert 0 < len(got[b]) < int((seq.valid[b] & ~seq.visual[b]).sum())
    gen = torch.Generator().manual_seed(3)
    for m, k in [(12, 2), (25, 3), (5, 5)]:
        x = torch.randn(m, 16, dtype=torch.float64, generator=gen)
        centers, assign = dpc_knn(x, k)
        assert (centers.tolist(), assign.tolist()) == _dpc_reference(x, k)


@torch.no_grad()
def test_sparsevlm_stages_keep_the_rated_tokens_and_recycle_cluster_means(qwen):
    """Each stage keeps the K_j tokens the raters attend most (mean over the raters' rows of the layer's
    attention), plus one token per density-peak cluster of the int(0.3 D) + 1 best deleted ones, equal to its
    cluster's mean; the last stage keeps K = ceil(N keep) plus its clusters."""
    from trimvlm.tokens.sparsevlm import raters

    adapter, runner = qwen
    images, prompts = ragged_batch()
    keep = 0.3
    plan = make_plan(f"tokens=sparsevlm:keep={keep}:layers=1-2", runner)
    hook, checked, rated = plan.hook, [], []

    def spy(i, seq, run):
        if i == 0:  # the raters, from the embeddings entering the first layer
            rated.append(raters(seq))
        att = plan.handoff.probes["tokens"].results.get(i - 1) if i in (1, 2) else None
        out = hook(i, seq, run)
        if att is None:
            return out
        r = att.shape[1]
        for (b, im), cols in _units(seq).items():
            h, w = seq.grids[b][im]
            n0, n = h * w, cols.numel()
            j = 1 if i == 1 else 2
            kj = math.ceil(n0 * keep - 1e-9) if j == 2 else min(n, round(n0 * keep ** (j / 2)))
            rows = [q for q in range(r) if int(seq.source[b, seq.length - r + q]) in rated[0][b].tolist()]
            score = [sum(float(att[b, q, c]) for q in rows) / len(rows) for c in cols.tolist()]
            order = sorted(range(n), key=lambda t: (-score[t], t))
            selected, deleted = order[:kj], order[kj:]
            expect = {int(seq.source[b, cols[t]]): seq.hidden[b, cols[t]].double() for t in selected}
            if deleted:
                cand = sorted(deleted[: int(0.3 * len(deleted)) + 1])
                centers, assign = _dpc_reference(seq.hidden[b, cols[cand]].double(), len(cand) // 10 + 1)
                for c, center in enumerate(centers):
                    members = [cand[t] for t, a in enumerate(assign) if a == c]
                    mean = torch.stack([seq.hidden[b, cols[t]].double() for t in members]).mean(0)
                    expect[int(seq.source[b, cols[cand[center]]])] = mean
            got = {int(out.source[b, c]): out.hidden[b, c].double() for c in _units(out)[(b, im)].tolist()}
            assert sorted(got) == sorted(expect)
            for src, v in expect.items():
                torch.testing.assert_close(got[src], v, rtol=1e-5, atol=1e-5)
            checked.append((i, b))
        return out

    plan.hook = spy
    runner.prefill(adapter.prepare(images, prompts), plan)
    assert sorted(checked) == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]


@pytest.mark.parametrize("family", AVAILABLE)
def test_sparsevlm_ragged_batch_equals_each_sample_alone(tiny_adapter, family):
    adapter = tiny_adapter(family)
    runner = Runner(adapter)
    ok = [i + 1 for i in range(runner.num_layers - 1) if runner.is_attention(i)]
    if len(ok) < runner.num_layers - 1:  # a hybrid model: a stage after a linear layer is refused
        bad = next(i + 1 for i in range(runner.num_layers - 1) if not runner.is_attention(i))
        with pytest.raises(RecipeError, match=re.escape(f"allowed on this model: {ok}")):
            make_plan(f"tokens=sparsevlm:keep=0.3:layers={bad}", runner)
    if not ok:
        return  # no attention layer before the last: nothing to rate with (refused above)
    recipe = f"tokens=sparsevlm:keep=0.3:layers={'-'.join(str(x) for x in ok[:2])}"
    images, prompts = ragged_batch()
    images, prompts = images + [[]], prompts + ["what is the colour of a red circle"]
    prep = adapter.prepare(images, prompts)
    out, _, _ = plan_prefill(runner, prep, recipe)
    assert ((out.seq.visual & out.seq.valid).sum(1)[:3] < (prep.attention_mask.sum(1)[:3])).all()
    for b in range(len(prompts)):
        alone, _, _ = plan_prefill(runner, adapter.prepare(images[b : b + 1], prompts[b : b + 1]), recipe)
        assert (alone.logits[0] - out.logits[b]).abs().max().item() <= 1e-4


def test_sparsevlm_keep_one_noop_and_flops_equal_torch_counter(qwen):
    adapter, runner = qwen
    prep = adapter.prepare(*ragged_batch())
    base, bm, _ = plan_prefill(runner, prep, "", all_logits=True)
    out, m, _ = plan_prefill(runner, prep, "tokens=sparsevlm:keep=1.0:layer=1", all_logits=True)
    assert torch.equal(out.logits, base.logits) and m.costs.method_total_flops == 0
    runner.vision_flops(prep)
    plan = make_plan("tokens=sparsevlm:keep=0.3:layer=1", runner)
    with flop_counter() as fc:
        res = generate(runner, prep, plan, max_new_tokens=2, stop_ids=[], pad_id=0, meter=Meter())
    c = res.costs
    assert c.method_total_flops > 0
    assert c.model_flops + c.method_total_flops == c.total_flops == fc.get_total_flops()
