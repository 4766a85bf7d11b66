"""PruMerge and VisionZip as their papers define them: they read the vision tower's attention.

The vision probe records what eager attention computes (the [CLS] row on CLIP, the mean attention received on
Qwen-VL, window attention included), mapped to LLM tokens; the selections and merges equal slow references;
keep = 1 changes nothing; ragged batches equal per-sample runs on every family; the probe's FLOPs are exactly
what torch's counter sees on top of the plain encode; the vision config is restored."""

import importlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import AVAILABLE, plan_prefill, ragged_batch

from trimvlm.errors import RecipeError
from trimvlm.plan import Handoff, build_methods, make_plan
from trimvlm.runtime import vision_probe as vp
from trimvlm.runtime.meter import flop_counter
from trimvlm.runtime.runner import Runner
from trimvlm.testing import concurrent_runs, random_image

RECIPES = ["prumerge:keep=0.25", "prumerge:keep=0.25:plus=true", "visionzip:keep=0.25"]


pytestmark = pytest.mark.usefixtures("one_thread")


_prefill = plan_prefill


def _units(seq):
    """(sample, unit) -> the live columns of that unit's tokens, in grid order."""
    out = {}
    for b in range(seq.batch):
        for j in range(len(seq.grids[b])):
            cols = torch.nonzero(seq.visual[b] & (seq.image_id[b] == j)).flatten()
            out[(b, j)] = cols[torch.argsort(seq.source[b, cols])]
    return out


# ---- the probe equals eager attention ----------------------------------------------------------------
def test_llava_probe_is_the_cls_row_of_eager_attention(tiny_adapter):
    ad = tiny_adapter("llava")
    prep = ad.prepare(
        [[random_image(1)], [random_image(2), random_image(3)]], ["describe", "what is the colour"]
    )
    probe = vp.VisionProbe()
    ad.embed(prep, vision=probe)
    assert probe.mode == "cls"
    modules = ad.vision_attention_modules()
    layer = len(modules) - 2  # the penultimate layer, LLaVA's feature layer
    keys = {}
    hook = modules[layer].k_proj.register_forward_hook(lambda m, i, o: keys.setdefault("k", o))
    cfg = ad.vision_config
    saved = cfg._attn_implementation
    cfg._attn_implementation = "eager"
    try:
        out = ad.inner.vision_tower(prep.model_inputs["pixel_values"], output_attentions=True)
    finally:
        cfg._attn_implementation = saved
        hook.remove()
    cls_row = out.attentions[layer][:, :, 0, 1:].mean(1)  # [CLS] -> each patch, heads averaged; CLS dropped
    for i, key in enumerate([(0, 0), (1, 0), (1, 1)]):
        rec = probe.results[key]
        torch.testing.assert_close(rec.received, cls_row[i], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(rec.keys, keys["k"][i, 1:], rtol=1e-5, atol=1e-6)
    assert cfg._attn_implementation == saved


def test_llava_siglip_probe_is_the_mean_attention_received(tmp_path):
    """A LLaVA with a SigLIP tower (no [CLS], "full" features): the mean attention each patch receives."""
    from trimvlm.loading import load_adapter
    from trimvlm.testing import word_tokenizer
    from trimvlm.testing.tiny_llava import build

    torch.manual_seed(0)
    tok = word_tokenizer()
    model, proc = build(tok, 64, 2, 4, 2, 32, 1, vision="siglip")
    for part in (model, tok, proc):
        part.save_pretrained(tmp_path)
    ad = load_adapter(tmp_path)
    assert not ad.vision_has_cls
    prep = ad.prepare([[random_image(1)], [random_image(2, (96, 64))]], ["describe", "what"])
    probe = vp.VisionProbe()
    ad.embed(prep, vision=probe)
    cfg = ad.vision_config
    cfg._attn_implementation = "eager"
    try:
        out = ad.inner.vision_tower(prep.model_inputs["pixel_values"], output_attentions=True)
    finally:
        cfg._attn_implementation = "sdpa"
    received = out.attentions[-2].mean(1).mean(1)  # heads averaged, mean over the query patches
    for i in range(2):
        torch.testing.assert_close(probe.results[(i, 0)].received, received[i], rtol=1e-5, atol=1e-7)
    res = _prefill(Runner(ad), prep, "tokens=prumerge:keep=0.25")[0]
    assert (res.seq.visual & res.seq.valid).sum(1).tolist() == [9, 9]


def _qwen_reference(ad, prep, layer, window_order):
    """Eager recomputation from the probed layer's inputs: per attention chunk (an image, or a window) the full
    softmax matrix, heads averaged, column sums; back to the images' merged-token order; per LLM token the sum
    over its merge**2 patches divided by the image's patch count, keys averaged over them."""
    attn = ad.vision_attention_modules()[layer]
    cap = {}

    def grab(module, args, kwargs):
        cap["x"] = args[0] if args else kwargs["hidden_states"]
        cap["cu"] = kwargs["cu_seqlens"]
        cap["pe"] = kwargs["position_embeddings"]

    hook = attn.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        ad.embed(prep)
    finally:
        hook.remove()
    rotary = importlib.import_module(type(attn).__module__).apply_rotary_pos_emb_vision
    x = cap["x"]
    s = x.shape[0]
    q, k, _ = attn.qkv(x).reshape(s, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    q, k = rotary(q, k, *cap["pe"])
    col = torch.zeros(s, dtype=torch.float64)
    cu = cap["cu"].tolist()
    for a, e in zip(cu[:-1], cu[1:], strict=True):
        qa, ka = q[a:e].transpose(0, 1).double(), k[a:e].transpose(0, 1).double()
        p = torch.softmax(qa @ ka.transpose(-1, -2) * attn.scaling, dim=-1)  # [H, n, n]
        col[a:e] = p.mean(0).sum(0)
    m2 = ad.merge**2
    col, keys = col.view(-1, m2), k.reshape(s, -1).view(-1, m2, k.shape[1] * k.shape[2])
    grid = prep.model_inputs["image_grid_thw"]
    if window_order:
        back = torch.argsort(ad.vision_order(grid))  # what the model does to the merger's output
        col, keys = col[back], keys[back]
    out, t0 = [], 0
    for n in grid.prod(-1).tolist():
        t1 = t0 + n // m2
        out.append((col[t0:t1].sum(-1) / n, keys[t0:t1].mean(1)))
        t0 = t1
    return out


@pytest.mark.parametrize("family, layer", [("qwen3_vl", -2), ("qwen2_5_vl", -2), ("qwen2_5_vl", -1)])
def test_qwen_probe_is_the_mean_attention_received(tiny_adapter, family, layer):
    """Qwen-VL towers have no [CLS]: the mean attention each patch receives, within its own image; Qwen2.5-VL's
    layer 0 is a window layer (blocks run in window order), its layer 1 full attention."""
    ad = tiny_adapter(family)
    images = [[random_image(1, (64, 64))], [random_image(2, (96, 64)), random_image(3, (64, 128))]]
    prep = ad.prepare(images, ["describe", "what is the colour"])
    probe = vp.VisionProbe(layer=layer)
    ad.embed(prep, vision=probe)
    assert probe.mode == "mean"
    depth = len(ad.vision_attention_modules())
    ref = _qwen_reference(ad, prep, layer % depth, window_order=family == "qwen2_5_vl")
    for i, key in enumerate([(0, 0), (1, 0), (1, 1)]):
        rec = probe.results[key]
        torch.testing.assert_close(rec.received.double(), ref[i][0], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(rec.keys, ref[i][1], rtol=1e-5, atol=1e-6)
        assert abs(float(rec.received.sum()) - 1.0) < 1e-5  # every query row sums to 1, divided by N


@pytest.mark.parametrize("cls", [False, True])
@pytest.mark.parametrize("float_mask", [False, True])
@pytest.mark.parametrize("block", [3, 64])
def test_recorded_statistic_matches_dense_softmax_with_padding_and_blocks(monkeypatch, cls, float_mask, block):
    """The statistic itself, with a padding mask (as Idefics3 passes for padded patches), with query blocks
    smaller than the sequence (one sample and head at a time) and with one block (all heads at once)."""
    monkeypatch.setattr(vp, "QUERY_BLOCK", block)
    gen = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 3, 10, 4
    q, k = (torch.randn(b, h, s, d, generator=gen, dtype=torch.float64) for _ in range(2))
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[1, 7:] = False
    mask = valid[:, None, None, :].expand(b, 1, s, s)
    given = mask
    if float_mask:
        given = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(
            ~mask, torch.finfo(torch.float64).min
        )
    rec = vp.Recording(probe=vp.VisionProbe(), target=None, cls=cls)
    rec.record(q, k, given, 0.5)
    stat, keys, queries = rec.calls[0]
    p = torch.softmax((q @ k.transpose(-1, -2) * 0.5).masked_fill(~mask, float("-inf")), -1).mean(1)
    if cls:
        ref, nq = p[:, 0], torch.ones(b)
    else:
        ref, nq = (p * valid[:, :, None]).sum(1), valid.sum(1).double()
    torch.testing.assert_close(stat.double(), ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(queries.double(), nq.double())
    torch.testing.assert_close(keys.double(), k.transpose(1, 2).reshape(b, s, h * d), rtol=1e-6, atol=1e-6)
    assert rec.flops == 2 * b * h * (1 if cls else s) * s * d


# ---- selections and merges equal slow references -----------------------------------------------------
def _iqr_reference(scores):
    q1, q3 = np.percentile(scores, [25, 75])
    return [i for i, v in enumerate(scores) if v > q3 + 1.5 * (q3 - q1)]


def _spread_reference(cands, f):
    m = len(cands)
    return [c for r, c in enumerate(cands) if (r + 1) * f // m > r * f // m]


def _reduce_with(adapter, recipe, images, prompts, scores=None):
    """Run the reducer by hand: encode with its probe, optionally replace the recorded scores, reduce."""
    runner = Runner(adapter)
    red = build_methods(f"tokens={recipe}")["tokens"]
    handoff = Handoff()
    probe = red.vision_probe(runner, handoff)
    seq = adapter.embed(adapter.prepare(images, prompts), vision=probe)
    if scores is not None:
        for key, rec in probe.results.items():
            rec.received = scores(key, rec.received)
    recs = {k: (v.received.clone().double(), v.keys.clone().double()) for k, v in probe.results.items()}
    out = red.reduce(seq, runner, handoff)
    return red, probe, seq, out, handoff, recs


def _check_merge(seq, out, b, cols, kept_idx, sim_keys, weights):
    """Every dropped token joins its most cosine-similar kept token (by `sim_keys`); a kept token becomes the
    `weights`-weighted mean of itself and its tokens."""
    kn = F.normalize(sim_keys, dim=-1)
    targets = kept_idx if isinstance(kept_idx, list) else kept_idx[0]
    kept = kept_idx if isinstance(kept_idx, list) else kept_idx[1]
    groups = {t: [t] for t in kept}
    for i in range(len(cols)):
        if i in kept:
            continue
        sims = [float(kn[i] @ kn[t]) for t in targets]
        groups[targets[int(np.argmax(sims))]].append(i)
    where = {int(out.source[b, c]): c for c in range(out.length) if out.valid[b, c]}
    x = seq.hidden[b, cols].double()
    for t, members in groups.items():
        w = torch.tensor([float(weights[m]) for m in members], dtype=torch.float64)
        ref = (x[members] * w[:, None]).sum(0) / w.sum()
        got = out.hidden[b, where[int(seq.source[b, cols[t]])]].double()
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
        assert int(out.size[b, where[int(seq.source[b, cols[t]])]]) == len(members)


def _spikes(m):
    """Scores: uniform noise with m spikes far above it (so the spikes are exactly the IQR outliers)."""

    def make(key, received):
        g = torch.Generator().manual_seed(17 * key[0] + key[1])
        s = torch.rand(received.shape, generator=g)
        idx = torch.randperm(received.shape[0], generator=g)[: m(received.shape[0])]
        s[idx] += 10.0
        return s

    return make


@pytest.mark.parametrize("family", ["llava", "qwen3_vl"])
@pytest.mark.parametrize("plus", [False, True])
@pytest.mark.parametrize(
    "keep, scores",
    [(0.25, None), (0.1, _spikes(lambda n: n // 5)), (0.5, _spikes(lambda n: 2))],
    ids=["recorded", "more-outliers-than-K", "fewer-outliers-than-K"],
)
def test_prumerge_keeps_k_outliers_first_and_merges_by_key_similarity(
    tiny_adapter, family, plus, keep, scores
):
    images, prompts = ragged_batch()
    recipe = f"prumerge:keep={keep}:plus={str(plus).lower()}"
    _, _, seq, out, handoff, recs = _reduce_with(tiny_adapter(family), recipe, images, prompts, scores)
    for (b, j), cols in _units(seq).items():
        sc, keys = recs[(b, j)]
        n = cols.numel()
        k = math.ceil(n * keep)
        kept = torch.nonzero(handoff.kept[b, seq.source[b, cols]]).flatten().tolist()
        assert len(kept) == k
        outl = _iqr_reference(sc.tolist())
        ranked = sorted(range(n), key=lambda i: (-float(sc[i]), i))
        if scores is not None:
            assert len(outl) > k if keep == 0.1 else 0 < len(outl) < k
        if len(outl) >= k:
            expected = [i for i in ranked if i in outl][:k]
        elif not plus:
            expected = ranked[:k]
        else:
            expected = outl + _spread_reference([i for i in range(n) if i not in outl], k - len(outl))
        assert sorted(kept) == sorted(expected)
        _check_merge(seq, out, b, cols, sorted(kept), keys, sc.clamp(min=1e-12))


@pytest.mark.parametrize("family", ["llava", "qwen3_vl", "internvl"])
@pytest.mark.parametrize("split", [(54, 10), (1, 1), (3, 0)])
def test_visionzip_keeps_dominant_plus_contextual_and_merges_into_contextual(tiny_adapter, family, split):
    images, prompts = ragged_batch()
    dom_w, ctx_w = split
    recipe = f"visionzip:keep=0.4:dominant={dom_w}:contextual={ctx_w}"
    red, probe, seq, out, handoff, recs = _reduce_with(tiny_adapter(family), recipe, images, prompts)
    heads = probe.heads
    for (b, j), cols in _units(seq).items():
        sc, keys = recs[(b, j)]
        n = cols.numel()
        k = math.ceil(n * 0.4)
        n_dom = round(k * dom_w / (dom_w + ctx_w))
        if dom_w and ctx_w:
            n_dom = min(max(n_dom, 1), k - 1) if k >= 2 else k
        n_ctx = k - n_dom
        ranked = sorted(range(n), key=lambda i: (-float(sc[i]), i))
        dom = ranked[:n_dom]
        rest = [i for i in range(n) if i not in dom]
        step = max(1, len(rest) // n_ctx) if n_ctx else 1
        targets = list(range(0, len(rest), step))[:n_ctx]
        targets = [rest[t] for t in targets]
        kept = torch.nonzero(handoff.kept[b, seq.source[b, cols]]).flatten().tolist()
        assert len(kept) == k and sorted(kept) == sorted(dom + targets)
        metric = keys.view(n, heads, -1).mean(1)  # VisionZip's metric: keys averaged over heads
        into = targets if targets else dom
        _check_merge(seq, out, b, cols, (into, sorted(kept)), metric, torch.ones(n))


# ---- no-op, batches, every family --------------------------------------------------------------------
@pytest.mark.parametrize("family", AVAILABLE)
@pytest.mark.parametrize("method", ["prumerge", "prumerge:plus=true", "visionzip"])
def test_keep_one_is_exact_noop(tiny_adapter, family, method):
    ad = tiny_adapter(family)
    runner = Runner(ad)
    images, prompts = ragged_batch()
    prep = ad.prepare(images, prompts)
    base, bm, _ = _prefill(runner, prep, "", all_logits=True)
    for opt in ("keep=1.0", "prune=0"):
        out, m, plan = _prefill(runner, prep, f"tokens={method}:{opt}", all_logits=True)
        assert plan.vision_probe is None
        assert torch.equal(out.logits, base.logits)
        assert m.costs.flops == bm.costs.flops and not m.costs.method_flops


@pytest.mark.parametrize("family", AVAILABLE)
@pytest.mark.parametrize("recipe", RECIPES)
def test_ragged_batch_equals_per_sample_runs(tiny_adapter, family, recipe):
    ad = tiny_adapter(family)
    runner = Runner(ad)
    images, prompts = ragged_batch()
    images, prompts = images + [[]], prompts + ["what is the colour of a red circle"]  # a text-only sample
    prep = ad.prepare(images, prompts)
    full, _, _ = _prefill(runner, prep, "")
    out, meter, _ = _prefill(runner, prep, f"tokens={recipe}")
    n_vis = (full.seq.visual & full.seq.valid).sum(1).tolist()
    kept = (out.seq.visual & out.seq.valid).sum(1).tolist()
    assert kept == [math.ceil(n * 0.25) for n in n_vis[:3]] + [0]
    assert meter.costs.method_flops["vision"] > 0
    for b in range(len(prompts)):
        alone, _, _ = _prefill(runner, ad.prepare(images[b : b + 1], prompts[b : b + 1]), f"tokens={recipe}")
        assert (alone.logits[0] - out.logits[b]).abs().max().item() <= 1e-5
    assert ad.vision_config._attn_implementation == "sdpa"  # restored


# ---- costs ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llava", "qwen3_vl", "qwen2_5_vl", "idefics3"])
@pytest.mark.parametrize("recipe", ["prumerge:keep=0.25", "visionzip:keep=0.25"])
def test_method_flops_equal_torch_counter(tiny_adapter, family, recipe):
    """`method_flops["vision"]` after a generate is what torch's counter sees on top of the plain encode, and the
    whole generate (model + methods) equals torch's count of everything that ran."""
    from trimvlm.vlm import VLM

    ad = tiny_adapter(family)
    vlm = VLM(ad)
    images, prompts = ragged_batch()
    prep = vlm.prepare(images, prompts)
    with flop_counter() as plain:
        ad.embed(prep)
    with flop_counter() as probed:
        ad.embed(prep, vision=vp.VisionProbe())
    vlm.runner.vision_flops(prep)  # the vision line is measured once per input shape, untimed
    with flop_counter() as fc:
        res = vlm.generate(images, prompts, recipe=f"tokens={recipe}", max_new_tokens=3)
    extra = probed.get_total_flops() - plain.get_total_flops()
    assert extra > 0
    assert res.costs.method_flops["vision"] == extra
    assert res.costs.total_flops == fc.get_total_flops()


# ---- errors, options, the config ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "recipe, words",
    [
        ("tokens=prumerge:keep=0.5:layer=2", ["layer must be 0", "prumerge"]),
        ("tokens=visionzip:keep=0.5:layer=1", ["layer must be 0", "visionzip"]),
        ("tokens=prumerge:keep=0.5:plus=2", ["plus", "true or false"]),
        ("tokens=visionzip:keep=0.5:dominant=0:contextual=0", ["dominant + contextual"]),
        ("tokens=visionzip:keep=0.5:dominant=-1", ["dominant", ">= 0"]),
        ("tokens=visionzip:keep=0.5:split=3", ["dominant", "contextual", "vision_layer"]),
    ],
)
def test_recipe_errors_name_what_is_allowed(recipe, words):
    with pytest.raises(RecipeError) as e:
        build_methods(recipe)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("method", ["prumerge", "visionzip"])
def test_vision_layer_out_of_range_names_the_range(tiny_adapter, method):
    runner = Runner(tiny_adapter("qwen3_vl"))
    with pytest.raises(RecipeError) as e:
        make_plan(f"tokens={method}:keep=0.5:vision_layer=2", runner)
    assert "-2..1" in str(e.value)
    plan = make_plan(f"tokens={method}:keep=0.5:vision_layer=0", runner)
    assert plan.vision_probe.layer == 0 and plan.handoff.vision is plan.vision_probe


def test_vision_layer_option_records_that_layer(tiny_adapter):
    ad = tiny_adapter("llava")
    prep = ad.prepare([[random_image(4)]], ["describe"])
    a, b = vp.VisionProbe(layer=0), vp.VisionProbe(layer=-1)
    ad.embed(prep, vision=a)
    ad.embed(prep, vision=b)
    assert not torch.equal(a.results[(0, 0)].received, b.results[(0, 0)].received)


def test_the_shared_configs_switched_mid_encode_do_not_stop_the_recording(tiny_adapter):
    """A run in another thread selecting or restoring attention on the model's config reaches the vision config
    (transformers' setter carries it to sub-configs): the probed module reads its own private copy meanwhile, so
    the recording is complete; the shared configs are never written by the probe."""
    ad = tiny_adapter("qwen3_vl")
    images, prompts = ragged_batch()
    prep = ad.prepare(images, prompts)
    clean = vp.VisionProbe()
    ad.embed(prep, vision=clean)
    target = ad.vision_attention_modules()[-2]
    own = target.config

    def clobber(module, args, kwargs):
        assert module.config is not own and module.config._attn_implementation == vp.NAME
        ad.model.config._attn_implementation = "eager"  # reaches the shared vision config

    hook = target.register_forward_pre_hook(clobber, with_kwargs=True)
    probe = vp.VisionProbe()
    try:
        ad.embed(prep, vision=probe)
    finally:
        hook.remove()
        ad.model.config._attn_implementation = "sdpa"
    for key, rec in clean.results.items():
        torch.testing.assert_close(probe.results[key].received, rec.received, rtol=1e-5, atol=1e-7)
    assert target.config is own and own._attn_implementation == "sdpa"


def test_overlapping_runs_in_threads_equal_sequential_ones(tiny_adapter):
    from trimvlm.vlm import VLM

    vlm = VLM(tiny_adapter("qwen3_vl"))
    recipes = ["tokens=prumerge:keep=0.5", None, "tokens=visionzip:keep=0.25"]

    def run(recipe):
        res = vlm.generate([random_image(5)], "what is the colour", recipe=recipe, max_new_tokens=4)
        return res.tokens, dict(res.costs.flops), dict(res.costs.method_flops)

    expected = {r: run(r) for r in recipes}
    got = concurrent_runs(run, recipes, 6)
    for r in recipes:
        assert got[r] == [expected[r]] * 6, r
    assert all(m.config is vlm.adapter.vision_config for m in vlm.adapter.vision_attention_modules())


def test_selection_is_nested_and_puts_the_modules_config_back(tiny_adapter):
    module = tiny_adapter("llava").vision_attention_modules()[0]
    own = module.config
    with vp.use_vision_attention(module):
        private = module.config
        assert private is not own and private._attn_implementation == vp.NAME
        with vp.use_vision_attention(module):
            assert module.config is private
        assert module.config is private  # the outer one is still inside
    assert module.config is own and own._attn_implementation == "sdpa"
