"""Layer plans: `depth=skip`, and a skipped block equals removing it from the model."""

import copy

import pytest
import torch
from conftest import ragged_batch

from trimvlm.errors import RecipeError
from trimvlm.plan import make_plan
from trimvlm.runtime.generate import generate
from trimvlm.runtime.plan import Plan
from trimvlm.runtime.runner import Runner


def _without_layer(adapter, drop: int):
    """A copy of the transformers model with decoder layer `drop` removed from its layer list, the later layers
    renumbered and the config shortened (the short-transformers way of removing a block)."""
    name = next(n for n, m in adapter.model.named_modules() if m is adapter.text_model.layers)
    model = copy.deepcopy(adapter.model)
    layers = model.get_submodule(name)
    del layers[drop]
    for j, layer in enumerate(layers):
        for attr in ("self_attn", "linear_attn"):
            mod = getattr(layer, attr, None)
            if mod is not None and hasattr(mod, "layer_idx"):
                mod.layer_idx = j
    cfg = model.config.get_text_config()
    cfg.num_hidden_layers -= 1
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [t for i, t in enumerate(cfg.layer_types) if i != drop]
    return model


def _reference_inputs(prep) -> dict:
    return dict(input_ids=prep.input_ids, attention_mask=prep.attention_mask, **prep.model_inputs)


# (family, tiny-model options, skipped layer): Qwen3-VL with two deepstack layers, skipping below them (0, 1:
# the later injections move one layer down, as in the model without that layer) and past them (3); Qwen3.5 a
# Gated DeltaNet block (0) and, with eight blocks (one of two attention blocks left), an attention block (3)
SKIPS = [("llava", {}, 0), ("llava", {}, 2), ("qwen3_vl", {"deepstack": 2}, 0), ("qwen3_vl", {"deepstack": 2}, 1),
         ("qwen3_vl", {"deepstack": 2}, 3), ("qwen3_5", {}, 0), ("qwen3_5", {"layers": 8}, 3)]  # fmt: skip


@pytest.mark.parametrize(("family", "kw", "drop"), SKIPS)
def test_a_skipped_block_equals_the_model_without_it(tiny_adapter, one_thread, family, kw, drop):
    """`depth=skip:layers=l` equals transformers' model with block l deleted from its layer list, the later
    blocks renumbered and the config shortened: prefill logits and greedy tokens."""
    adapter = tiny_adapter(family, **kw)
    runner = Runner(adapter)
    images, prompts = ragged_batch()
    prep = adapter.prepare(images[1:2], prompts[1:2])
    plan = make_plan(f"depth=skip:layers={drop}", runner)
    assert plan.skip_prefill == plan.skip_decode == frozenset({drop})
    ref_model = _without_layer(adapter, drop)
    with torch.no_grad():
        ref = ref_model(**_reference_inputs(prep)).logits
    out = runner.prefill(prep, plan, all_logits=True)
    assert (out.logits - ref).abs().max().item() <= 1e-4
    assert drop not in out.cache.layers  # a skipped block writes no KV
    ours = generate(runner, prep, plan, max_new_tokens=6, stop_ids=[], pad_id=0)
    with torch.no_grad():
        theirs = ref_model.generate(**_reference_inputs(prep), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                    pad_token_id=adapter.tokenizer.pad_token_id)[:, prep.input_ids.shape[1]:]  # fmt: skip
    assert ours.tokens.tolist() == theirs.tolist()


def test_per_sample_plans_move_deepstack_per_row(tiny_adapter):
    """Rows of one batch skipping different blocks below Qwen3-VL's deepstack layers get their injections after
    their own k-th executed block: each row equals the model without its skipped blocks."""
    adapter = tiny_adapter("qwen3_vl", deepstack=2)
    runner = Runner(adapter)
    images, prompts = ragged_batch()
    plans = [{0}, {1}, set()]
    skip = torch.zeros(len(prompts), runner.num_layers, dtype=torch.bool)
    for b, p in enumerate(plans):
        skip[b, sorted(p)] = True
    out = runner.prefill(adapter.prepare(images, prompts), Plan(skip_prefill=skip))
    for b, p in enumerate(plans):
        one = adapter.prepare(images[b : b + 1], prompts[b : b + 1])
        with torch.no_grad():
            ref = _without_layers(adapter, p)(**_reference_inputs(one)).logits[0, -1]
        assert (out.logits[b] - ref).abs().max().item() <= 1e-4, (b, p)


def test_skip_options_and_errors(tiny_adapter):
    runner = Runner(tiny_adapter("qwen3_vl"))
    n = runner.num_layers
    assert make_plan("depth=skip:layers=1+2:scope=prefill", runner).skip_prefill == {1, 2}
    assert make_plan("depth=skip:layers=1+2:scope=prefill", runner).skip_decode == frozenset()
    assert make_plan("depth=skip:layers=3:scope=candidates", runner).skip_branch == {3}
    with pytest.raises(RecipeError, match="out of range"):
        make_plan(f"depth=skip:layers={n}", runner)
    with pytest.raises(RecipeError, match="at least one block must run"):
        make_plan("depth=skip:layers=" + "+".join(str(i) for i in range(n)), runner)
    with pytest.raises(RecipeError, match="joined by"):
        make_plan("depth=skip:layers=1+x", runner)
    with pytest.raises(RecipeError, match="scope"):
        make_plan("depth=skip:layers=1:scope=prefix", runner)


def _bi_reference(adapter, images, prompts, first: int = 0) -> list[float]:
    """BI_l from forward hooks on transformers' own decoder layers, one unpadded sample at a time."""
    layers = adapter.text_model.layers
    sums, count = [0.0] * len(layers), 0
    for im, p in zip(images, prompts, strict=True):
        prep = adapter.prepare([im], [p])
        seen = {}

        def record(m, args, kw, out, i, seen=seen):
            seen[i] = (kw.get("hidden_states", args[0] if args else None), out[0] if isinstance(out, tuple) else out)

        hooks = [
            layer.register_forward_hook(lambda m, a, kw, out, i=i: record(m, a, kw, out, i), with_kwargs=True)
            for i, layer in enumerate(layers)
        ]
        try:
            with torch.no_grad():
                adapter.model(input_ids=prep.input_ids, attention_mask=prep.attention_mask, **prep.model_inputs)
        finally:
            for h in hooks:
                h.remove()
        for i, (h_in, h_out) in seen.items():
            sums[i] += float(torch.nn.functional.cosine_similarity(h_in.double(), h_out.double(), dim=-1).sum())
        count += prep.input_ids.shape[1]
    return [1 - s / count for s in sums][first:]


@pytest.mark.parametrize("family", ["llava", "qwen3_vl"])
def test_block_influence_matches_a_reference_on_the_models_own_layers(tiny_adapter, family):
    from trimvlm.depth.block_influence import block_influence

    adapter = tiny_adapter(family)
    runner = Runner(adapter)
    images, prompts = ragged_batch()
    got = block_influence(runner, [adapter.prepare(images, prompts)])  # one padded batch: padding excluded
    first = 1 if family == "qwen3_vl" else 0  # Qwen3-VL adds deepstack features after layer 0's output
    ref = _bi_reference(adapter, images, prompts, first)
    assert got[first:] == pytest.approx(ref, abs=1e-6)


def test_block_influence_ranking_drives_depth_ranking(tiny_adapter, tmp_path):
    import json

    from trimvlm.depth.calibration import rank
    from trimvlm.evals.tasks import demo_task
    from trimvlm.vlm import VLM

    vlm = VLM(tiny_adapter("qwen3_vl"))
    data = rank(vlm, "block-influence", demo_task(limit=6, split="val").records, batch_size=4)
    assert sorted(data["order"]) == list(range(vlm.runner.num_layers))
    assert [data["scores"][i] for i in data["order"]] == sorted(data["scores"])
    path = tmp_path / "bi.json"
    path.write_text(json.dumps(data))
    plan = make_plan(f"depth=ranking:file={path}:budget=2:scope=all", vlm.runner)
    assert plan.skip_prefill == frozenset(data["order"][:2]) == plan.skip_decode
    other = VLM(tiny_adapter("qwen3_vl", seed=1))  # same shape, other weights
    with pytest.raises(RecipeError, match="another model"):
        make_plan(f"depth=ranking:file={path}:budget=2", other.runner)


def _without_layers(adapter, drop):
    model = adapter.model
    for layer in sorted(drop, reverse=True):  # remove from the end so the indices stay valid
        model = _without_layer(_Shim(adapter, model), layer)
    return model


class _Shim:
    """An adapter-like view of a model copy, for `_without_layer` applied repeatedly."""

    def __init__(self, adapter, model):
        self.model = model
        name = next(n for n, m in adapter.model.named_modules() if m is adapter.text_model.layers)
        self.text_model = type("T", (), {"layers": model.get_submodule(name)})()


def _answer_logits_reference(adapter, model, images, prompts):
    out = []
    for im, p in zip(images, prompts, strict=True):
        prep = adapter.prepare([im], [p])
        with torch.no_grad():
            out.append(model(input_ids=prep.input_ids, attention_mask=prep.attention_mask,
                             **prep.model_inputs).logits[0, -1].double())  # fmt: skip
    return torch.stack(out)


def test_sensitivity_and_greedy_kl_match_references_on_models_without_those_blocks(tiny_adapter):
    from trimvlm.depth.greedy_kl import greedy_kl
    from trimvlm.depth.sensitivity import sensitivity

    adapter = tiny_adapter("llava")
    runner = Runner(adapter)
    images, prompts = ragged_batch()
    batches = [adapter.prepare(images, prompts)]  # one padded batch; the references run each sample alone
    n = runner.num_layers
    z = _answer_logits_reference(adapter, adapter.model, images, prompts)

    def rms_ctr(v):
        return (v - v.mean(-1, keepdim=True)).pow(2).mean(-1).sqrt()

    ref_j = []
    for layer in range(n):
        zs = _answer_logits_reference(adapter, _without_layers(adapter, {layer}), images, prompts)
        ref_j.append(float((rms_ctr(zs - z) / rms_ctr(z)).mean()))
    scores, order = sensitivity(runner, batches)
    assert scores == pytest.approx(ref_j, rel=1e-4, abs=1e-7)
    assert order == sorted(range(n), key=lambda i: (ref_j[i], i))

    p = torch.log_softmax(z, -1)
    scores, order = greedy_kl(runner, batches)
    removed = []
    for step in range(n - 1):
        kls = {}
        for layer in (i for i in range(n) if i not in removed):
            q = torch.log_softmax(_answer_logits_reference(adapter, _without_layers(adapter, {*removed, layer}),
                                                           images, prompts), -1)  # fmt: skip
            kls[layer] = float((p.exp() * (p - q)).sum(-1).mean())
        best = min(kls, key=lambda i: (kls[i], i))
        assert order[step] == best and scores[best] == pytest.approx(kls[best], rel=1e-4, abs=1e-9)
        removed.append(best)
    assert sorted(order) == list(range(n))


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5", "llava"])
def test_per_sample_layer_plans_equal_each_sample_alone(tiny_adapter, family):
    """A ragged batch whose samples skip different layers (attention and Gated DeltaNet layers alike) runs each
    layer on the rows that keep it, and equals each sample run alone with its own plan: prefill logits and
    greedy tokens."""
    adapter = tiny_adapter(family)
    runner = Runner(adapter)
    images, prompts = ragged_batch()
    n = runner.num_layers
    plans = [{1}, {2, 3}, set()]
    skip = torch.zeros(len(prompts), n, dtype=torch.bool)
    for b, p in enumerate(plans):
        skip[b, sorted(p)] = True
    prep = adapter.prepare(images, prompts)
    out = runner.prefill(prep, Plan(skip_prefill=skip))
    both = generate(runner, prep, Plan(skip_prefill=skip, skip_decode=skip), max_new_tokens=5, stop_ids=[], pad_id=0)
    for b, p in enumerate(plans):
        one = adapter.prepare(images[b : b + 1], prompts[b : b + 1])
        alone = runner.prefill(one, Plan(skip_prefill=frozenset(p)))
        assert (out.logits[b] - alone.logits[0]).abs().max().item() <= 1e-4, (b, p)
        same = Plan(skip_prefill=frozenset(p), skip_decode=frozenset(p))
        tokens = generate(runner, one, same, max_new_tokens=5, stop_ids=[], pad_id=0).tokens[0]
        assert both.tokens[b].tolist() == tokens.tolist(), (b, p)
    uniform = runner.prefill(prep, Plan(skip_prefill=torch.zeros_like(skip)))
    assert torch.equal(uniform.logits, runner.prefill(prep).logits)  # an empty per-sample plan is a no-op


def test_per_sample_plan_errors(tiny_adapter):
    runner = Runner(tiny_adapter("qwen3_vl"))
    prep = runner.adapter.prepare(*[x[:2] for x in ragged_batch()])
    with pytest.raises(RecipeError, match=r"bool tensor \[batch=2, layers="):
        runner.prefill(prep, Plan(skip_prefill=torch.zeros(3, runner.num_layers, dtype=torch.bool)))
    with pytest.raises(RecipeError, match="skips every layer"):
        runner.prefill(prep, Plan(skip_prefill=torch.ones(2, runner.num_layers, dtype=torch.bool)))


def test_noise_perturbed_fastv_keeps_each_samples_best_trial(tiny_adapter):
    """tokens=fastv:noise=S:trials=T: plain FastV when T = 1 or S = 0; otherwise each sample's next-token
    distribution is at least as close (KL) to the unpruned one as plain FastV's, and a batch equals each sample
    alone."""
    from conftest import plan_prefill

    adapter = tiny_adapter("qwen3_vl")
    runner = Runner(adapter)
    images, prompts = ragged_batch()
    prep = adapter.prepare(images, prompts)
    plain, _, _ = plan_prefill(runner, prep, "tokens=fastv:keep=0.25:layer=2")
    for same in ("tokens=fastv:keep=0.25:layer=2:trials=1:noise=1", "tokens=fastv:keep=0.25:layer=2:trials=4"):
        assert torch.equal(plan_prefill(runner, prep, same)[0].logits, plain.logits)
    recipe = "tokens=fastv:keep=0.25:layer=2:noise=1:trials=4:seed=3"
    noisy, meter, _ = plan_prefill(runner, prep, recipe)
    base = torch.log_softmax(runner.prefill(prep).logits.double(), -1)

    def kl(out):
        q = torch.log_softmax(out.logits.double(), -1)
        return (base.exp() * (base - q)).sum(-1)

    assert bool((kl(noisy) <= kl(plain) + 1e-9).all())
    assert meter.costs.method_flops["prefill"] > 3 * meter.costs.flops["prefill"] * 0.5  # the look-aheads
    for b in range(3):
        alone, _, _ = plan_prefill(runner, adapter.prepare(images[b : b + 1], prompts[b : b + 1]), recipe)
        assert (noisy.logits[b] - alone.logits[0]).abs().max().item() <= 1e-4
    with pytest.raises(RecipeError, match="noise must be a finite number >= 0"):
        make_plan("tokens=fastv:keep=0.5:noise=-1", runner)
