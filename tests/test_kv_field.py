"""The field's VLM-specific decode KV baselines: kv=lookm, kv=vlcache, kv=aircache. Each against a
reference written here by loops from its definition (LOOK-M's merged KV, VL-Cache's post-vision score and
sparsity, AirCache's elite window, importance, strength and skewness); per-layer budgets add up to the total
every policy gets; eviction (with the merge) equals masking after the same merge; a ragged batch equals each
sample alone on every family; keep = 1 is a no-op; method FLOPs equal torch's counter minus the model's."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import AVAILABLE, ragged_batch

from trimvlm.errors import RecipeError
from trimvlm.kernels.budget import split_budget
from trimvlm.kv import mask_out
from trimvlm.kv.base import LayerView
from trimvlm.plan import Handoff, Plan, build_methods, make_plan
from trimvlm.registry import build_method
from trimvlm.runtime.cache import LayerKV
from trimvlm.runtime.generate import generate
from trimvlm.runtime.meter import Meter, flop_counter
from trimvlm.runtime.runner import Runner

pytestmark = pytest.mark.usefixtures("one_thread")

POLICIES = [
    ("lookm", {}),
    ("lookm", {"merge": "weighted"}),
    ("vlcache", {}),
    ("aircache", {}),
]
IDS = [n + "".join(f"-{k}={v}" for k, v in o.items()) for n, o in POLICIES]


# ---- the budget kernel --------------------------------------------------------------------------------------
def test_split_budget_is_exact_capped_and_proportional():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n_layers = int(torch.randint(1, 7, (1,), generator=g))
        caps = torch.randint(0, 12, (3, n_layers), generator=g)
        weights = torch.rand(3, n_layers, generator=g) * (torch.rand(3, n_layers, generator=g) > 0.2)
        total = torch.stack([torch.randint(0, int(c.sum()) + 1, (1,), generator=g)[0] for c in caps])
        k = split_budget(weights, caps, total)
        assert torch.equal(k.sum(1), total)
        assert bool((k >= 0).all()) and bool((k <= caps).all())
        for b in range(3):  # where no cap binds, each layer is within one unit of its proportional share
            free = [j for j in range(n_layers) if k[b, j] < caps[b, j] and weights[b, j] > 0]
            rest = int(total[b]) - sum(int(k[b, j]) for j in range(n_layers) if j not in free)
            wsum = sum(float(weights[b, j]) for j in free)
            for j in free:
                assert abs(int(k[b, j]) - rest * float(weights[b, j]) / wsum) < 1 + 1e-9
            if int(total[b]) <= sum(int(caps[b, j]) for j in range(n_layers) if weights[b, j] > 0):
                assert all(int(k[b, j]) == 0 for j in range(n_layers) if weights[b, j] == 0)


# ---- a hand-made layer ----------------------------------------------------------------------------------------
def _layer(seed: int, hk: int = 2, hd: int = 4):
    """Two samples: text, an image span, text after it (sample 1 padded at the end); some visual entries already
    removed by a prefill reduction."""
    g = torch.Generator().manual_seed(seed)
    k = 24
    visual = torch.zeros(2, k, dtype=torch.bool)
    visual[0, 2:14] = True
    visual[1, 3:12] = True
    valid = torch.ones(2, k, dtype=torch.bool)
    valid[0, 6] = valid[1, 8] = False
    valid[1, 20:] = False
    key, value = torch.randn(2, hk, k, hd, generator=g), torch.randn(2, hk, k, hd, generator=g)
    return LayerKV(key, value, valid, visual & valid, torch.arange(k)[None].repeat(2, 1))


def _causal_attention(entry, n: int, heads: int, seed: int):
    """Softmax rows of the last n queries over the keys each can see (valid, causal), [B, H, n, K]."""
    g = torch.Generator().manual_seed(seed)
    b, _, k, _ = entry.key.shape
    logits = 2 * torch.randn(b, heads, n, k, generator=g)
    seen = (torch.arange(k)[None] <= torch.arange(k - n, k)[:, None])[None, None] & entry.valid[:, None, None]
    return torch.softmax(logits.masked_fill(~seen, float("-inf")), -1)


def _view(entry, att, keep=0.5):
    cand = entry.visual & entry.valid
    budget = torch.tensor([math.ceil(int(c) * keep) for c in cand.sum(1)])
    row_valid = entry.valid[:, -att.shape[-2] :]
    return LayerView(0, entry, cand, budget, None, attention=att, row_valid=row_valid)


def _post_rows(entry, n):
    """Loop: the recorded rows (columns K - n ..) that are valid text after the sample's last visual entry."""
    k = entry.valid.shape[1]
    out = []
    for b in range(2):
        last = max(j for j in range(k) if entry.visual[b, j] and entry.valid[b, j])
        out.append([r for r in range(n) if entry.valid[b, k - n + r] and k - n + r > last])
    return out


# ---- LOOK-M ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("merge", ["pivotal", "averaged", "weighted"])
def test_lookm_merged_kv_equals_a_hand_computation(merge):
    """Each evicted visual entry joins its most key-cosine-similar kept visual entry (per sample and KV head);
    each kept entry becomes pivotal (k_c + sum (k_e + k_c) / 2) / (1 + n), averaged (k_c + sum k_e) / (1 + n)
    or weighted (k_c + sum s_e k_e) / (1 + sum s_e); text, padding and evicted entries are untouched."""
    entry = _layer(1)
    keep = entry.valid.clone()
    keep[0, [3, 4, 7, 9, 10, 13]] = False  # evicted visual entries
    keep[1, [4, 5, 9, 11]] = False
    keep &= entry.valid
    policy = build_method("kv", "lookm", {"keep": 0.5, "merge": merge})
    before = copy.deepcopy(entry)
    policy.compensate(SimpleNamespace(layers={0: entry}), {0: keep})
    cos = torch.nn.functional.cosine_similarity
    for b in range(2):
        kept = [j for j in range(24) if keep[b, j] and before.visual[b, j]]
        gone = [j for j in range(24) if not keep[b, j] and before.visual[b, j] and before.valid[b, j]]
        for h in range(2):
            k0, v0 = before.key[b, h], before.value[b, h]
            target = {e: max(kept, key=lambda c, e=e: (float(cos(k0[e], k0[c], dim=0)), -c)) for e in gone}
            for j in range(24):
                if j not in kept:
                    assert torch.equal(entry.key[b, h, j], k0[j]) and torch.equal(entry.value[b, h, j], v0[j])
                    continue
                group = [e for e in gone if target[e] == j]
                for t0, t1 in ((k0, entry.key[b, h]), (v0, entry.value[b, h])):
                    if merge == "pivotal":
                        want = (t0[j] + sum((t0[e] + t0[j]) / 2 for e in group)) / (1 + len(group))
                    elif merge == "averaged":
                        want = (t0[j] + sum(t0[e] for e in group)) / (1 + len(group))
                    else:
                        s = {e: max(float(cos(k0[e], k0[j], dim=0)), 0.0) for e in group}
                        want = (t0[j] + sum(s[e] * t0[e] for e in group)) / (1 + sum(s.values()))
                    assert torch.allclose(t1[j], torch.as_tensor(want, dtype=t1.dtype), atol=1e-5)
    assert not torch.equal(entry.key, before.key)  # the case does merge


def test_lookm_ranks_visual_entries_by_accumulated_attention():
    """kv=lookm keeps the visual entries with the largest column sums (attention received from every prefill
    query); text is kept whatever its score (the text prior)."""
    entry = _layer(2)
    colsum = torch.rand(2, 24, generator=torch.Generator().manual_seed(3))
    handoff = Handoff()
    handoff.probes["kv"] = SimpleNamespace(results={0: colsum}, row_valid={})
    masks = build_method("kv", "lookm", {"keep": 0.5}).select(
        SimpleNamespace(cache=SimpleNamespace(layers={0: entry})), handoff
    )
    for b in range(2):
        cols = [j for j in range(24) if entry.visual[b, j] and entry.valid[b, j]]
        k = math.ceil(len(cols) * 0.5)
        want = set(sorted(cols, key=lambda j: (-float(colsum[b, j]), j))[:k])
        got = {j for j in range(24) if masks[0][b, j] and entry.visual[b, j]}
        assert got == want
        assert all(bool(masks[0][b, j]) for j in range(24) if entry.valid[b, j] and not entry.visual[b, j])


# ---- VL-Cache -------------------------------------------------------------------------------------------------
def test_vlcache_score_and_sparsity_match_loops():
    """Score = post-vision attention summed over the post-vision queries and heads; sparsity = the fraction of
    post-vision entries (over the keys each query sees, every head) below 1 % of their row's max."""
    entry = _layer(4)
    n, heads = 10, 3
    att = _causal_attention(entry, n, heads, 5)
    view = _view(entry, att)
    policy = build_method("kv", "vlcache", {"keep": 0.5})
    score, gamma = policy.scores(view), policy.sparsity(view)
    post = _post_rows(entry, n)
    k = 24
    for b in range(2):
        assert post[b]  # the case has post-vision rows
        for j in range(k):
            want = sum(float(att[b, h, r, j]) for h in range(heads) for r in post[b])
            assert abs(float(score[b, j]) - want) < 1e-5
        low = seen = 0
        for h in range(heads):
            for r in post[b]:
                row = [float(att[b, h, r, j]) for j in range(k) if entry.valid[b, j] and j <= k - n + r]
                low += sum(x < 0.01 * max(row) for x in row)
                seen += len(row)
        assert abs(float(gamma[b]) - low / seen) < 1e-9


# ---- AirCache -------------------------------------------------------------------------------------------------
def test_aircache_elite_importance_and_layer_weight_match_loops():
    """Elite window = the top ceil(|T| * elite) post-vision text tokens by the last one's attention to them;
    importance = the elite rows' mean attention; layer weight = strength * (1 + max(skewness, 0))."""
    entry = _layer(6)
    n = 10
    att = _causal_attention(entry, n, 1, 7)[:, 0]  # heads averaged
    view = _view(entry, att)
    policy = build_method("kv", "aircache", {"keep": 0.5, "elite": 0.5})
    elite, imp = policy.elite_rows(view), policy.scores(view)
    weight = policy.layer_weights({0: view})[0]
    post = _post_rows(entry, n)
    k = 24
    for b in range(2):
        rel = {t: float(att[b, max(post[b]), k - n + t]) for t in post[b]}  # the last query reads t
        m = math.ceil(len(post[b]) * 0.5)
        want_elite = set(sorted(post[b], key=lambda t: (-rel[t], t))[:m])
        assert {r for r in range(n) if elite[b, r]} == want_elite
        imp_loop = [sum(float(att[b, t, j]) for t in want_elite) / m for j in range(k)]
        assert max(abs(float(imp[b, j]) - imp_loop[j]) for j in range(k)) < 1e-6
        vis = [imp_loop[j] for j in range(k) if entry.visual[b, j] and entry.valid[b, j]]
        mu = sum(vis) / len(vis)
        sigma = (sum((x - mu) ** 2 for x in vis) / len(vis)) ** 0.5
        skew = sum((x - mu) ** 3 for x in vis) / len(vis) / sigma**3
        assert abs(float(weight[b]) - sum(vis) * (1 + max(skew, 0.0))) < 1e-5


# ---- on the models ----------------------------------------------------------------------------------------------
FAMILIES = [f for f in AVAILABLE]


def _prefill(runner, prep, policy):
    handoff = Handoff()
    out = runner.prefill(prep, Plan(probe=policy.probe(runner, handoff)))
    return out, policy.select(out, handoff)


def _decode(runner, out, caches, steps=3, tokens=None):
    logits = [[out.logits] for _ in caches]
    pos = out.next_pos.clone()
    fed = []
    for t in range(steps):
        tok = logits[0][-1].argmax(-1) if tokens is None else tokens[:, t]
        fed.append(tok)
        positions = runner.adapter.text_positions(pos, 1)
        for c, cache in enumerate(caches):
            logits[c].append(runner.step(tok[:, None], positions, cache))
        pos += 1
    return [torch.stack(ls, 1) for ls in logits], torch.stack(fed, 1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("name", "opts"), POLICIES, ids=IDS)
def test_eviction_matches_masking_and_ragged_batch_equals_each_alone(tiny_adapter, family, name, opts):
    """Batch: the kept visual entries add up, per sample, to sum_l ceil(N_post^l * keep) (equal KV entries);
    the eviction (after the merge) equals masking the merged cache; then each sample alone keeps the same
    entries, merges them the same way and decodes the same logits."""
    adapter = tiny_adapter(family)
    runner = Runner(adapter)
    images, prompts = ragged_batch()
    prep = adapter.prepare(images, prompts)
    keep = 0.25
    policy = build_method("kv", name, {"keep": keep, **opts})
    out, masks = _prefill(runner, prep, policy)
    total = sum(torch.tensor([math.ceil(int(x) * keep) for x in (e.visual & e.valid).sum(1)])
                for e in out.cache.layers.values())  # fmt: skip
    kept = sum((m & out.cache.layers[i].visual).sum(1) for i, m in masks.items())
    assert torch.equal(kept, total)
    states = {i: dict(st) for i, st in out.cache.states.items()}
    policy.compensate(out.cache, masks)
    ref = copy.deepcopy(out.cache)
    mask_out(ref, masks)
    policy.evict(out.cache, masks)
    for i, st in states.items():  # recurrent (Gated DeltaNet) states untouched
        assert all(out.cache.states[i][k] is v for k, v in st.items())
    kept = {i: copy.deepcopy(e) for i, e in out.cache.layers.items()}  # before the decode appends to it
    (la, lb), fed = _decode(runner, out, [out.cache, ref])
    assert (la - lb).abs().max().item() <= 1e-5
    s = prep.input_ids.shape[1]
    for b in range(len(prompts)):
        one = adapter.prepare([images[b]], [prompts[b]])
        o1, m1 = _prefill(runner, one, policy)
        s1 = one.input_ids.shape[1]
        for i, m in m1.items():  # the same entries kept (sources counted from the end of the prompt)
            e = kept[i]
            assert torch.equal(e.source[b][e.valid[b]] - s, o1.cache.layers[i].source[0][m[0]] - s1)
        policy.compensate(o1.cache, m1)
        policy.evict(o1.cache, m1)
        for i, e1 in o1.cache.layers.items():  # the same merged keys and values
            e = kept[i]
            for t, t1 in ((e.key, e1.key), (e.value, e1.value)):
                assert (t[b][:, e.valid[b]] - t1[0][:, e1.valid[0]]).abs().max().item() <= 1e-5
        (l1,), _ = _decode(runner, o1, [o1.cache], tokens=fed[b : b + 1])
        assert (l1[0] - la[b]).abs().max().item() <= 1e-4


def test_budgets_differ_per_layer_and_uniform_is_the_ablation():
    """On the trained demo model (a random tiny model attends almost uniformly: no layer is sparser than
    another), vlcache and aircache split the total unevenly over the layers, while `budgets=uniform` keeps
    ceil(N_post * keep) in every layer; both keep the same total per sample."""
    import trimvlm
    from trimvlm.testing import random_image

    vlm = trimvlm.load("demo")
    runner = vlm.runner
    prep = vlm.adapter.prepare([[random_image(1, (64, 64))], [random_image(2, (64, 64))]],
                               ["how many blue ?", "what colour is at row 2 column 3 ?"])  # fmt: skip

    def per_layer(name, **opts):
        out, masks = _prefill(runner, prep, build_method("kv", name, {"keep": 0.25, **opts}))
        return torch.stack([(m & out.cache.layers[i].visual).sum(1) for i, m in masks.items()], 1)

    for name in ("vlcache", "aircache"):
        split, flat = per_layer(name), per_layer(name, budgets="uniform")
        assert torch.equal(split.sum(1), flat.sum(1))
        assert not torch.equal(split, flat)


@pytest.mark.parametrize("keep", [0.5, 0.25])
def test_equal_kv_bytes_per_sample(tiny_adapter, keep):
    """One sample at a time, the per-layer budgets of vlcache and aircache leave exactly the KV bytes of a
    uniform policy at the same keep (a padded batch adds each layer's padding to its longest row)."""
    adapter = tiny_adapter("qwen3_vl")
    runner = Runner(adapter)
    images, prompts = ragged_batch()
    kw = dict(max_new_tokens=1, stop_ids=[], pad_id=0)
    for b in range(len(prompts)):
        prep = adapter.prepare([images[b]], [prompts[b]])
        want = generate(runner, prep, make_plan(f"kv=density:keep={keep}", runner), **kw).costs.kv_bytes
        for name in ("vlcache", "aircache", "lookm"):
            got = generate(runner, prep, make_plan(f"kv={name}:keep={keep}", runner), **kw).costs.kv_bytes
            assert got == want


def test_keep_one_is_an_exact_noop(tiny_adapter):
    adapter = tiny_adapter("qwen3_vl")
    runner = Runner(adapter)
    prep = adapter.prepare(*ragged_batch())
    kw = dict(max_new_tokens=3, stop_ids=[], pad_id=0)
    base = generate(runner, prep, **kw)
    for name, _ in POLICIES[::-1][:3]:
        plan = make_plan(f"kv={name}:keep=1.0", runner)
        assert plan.probe is None
        g = generate(runner, prep, plan, **kw)
        assert torch.equal(g.tokens, base.tokens)
        assert g.costs.kv_bytes == base.costs.kv_bytes
        assert g.costs.method_total_flops == 0


@pytest.mark.parametrize("recipe", ["kv=lookm:keep=0.25", "kv=vlcache:keep=0.25", "kv=aircache:keep=0.25"])
def test_method_flops_equal_torch_counter_minus_model(tiny_adapter, recipe):
    adapter = tiny_adapter("qwen3_vl")
    runner = Runner(adapter)
    prep = adapter.prepare(*ragged_batch())
    runner.vision_flops(prep)
    with flop_counter() as fc:
        out = generate(runner, prep, make_plan(recipe, runner), max_new_tokens=3, meter=Meter(), stop_ids=[],
                       pad_id=0)  # fmt: skip
    c = out.costs
    assert c.method_total_flops > 0
    assert fc.get_total_flops() - c.model_flops == c.method_total_flops


@pytest.mark.parametrize(
    "spec",
    ["kv=lookm:merge=max", "kv=lookm:recent=2", "kv=vlcache:threshold=0", "kv=vlcache:rows=0",
     "kv=vlcache:budgets=pyramid", "kv=aircache:elite=0", "kv=aircache:budgets=x", "kv=aircache:keep=2"],
)  # fmt: skip
def test_bad_options_are_recipe_errors(spec):
    with pytest.raises(RecipeError):
        build_methods(spec)
