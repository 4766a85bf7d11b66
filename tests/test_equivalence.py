"""Invariant 1: with nothing compressed, the runner reproduces the model's own forward and generate."""

import dataclasses

import pytest
import torch
from conftest import AVAILABLE, ragged_batch

from trimvlm.runtime.generate import generate
from trimvlm.runtime.plan import Plan
from trimvlm.runtime.runner import Runner, branch


def _reference_logits(adapter, prep):
    with torch.no_grad():
        return adapter.model(
            input_ids=prep.input_ids, attention_mask=prep.attention_mask, **prep.model_inputs
        ).logits


@pytest.mark.parametrize("family", AVAILABLE)
@pytest.mark.parametrize("batch", [1, 3])
def test_prefill_logits_equal_model_forward(tiny_adapter, family, batch):
    adapter = tiny_adapter(family)
    images, prompts = ragged_batch()
    prep = adapter.prepare(
        images[:batch] if batch > 1 else images[1:2], prompts[:batch] if batch > 1 else prompts[1:2]
    )
    out = Runner(adapter).prefill(prep, all_logits=True)
    ref = _reference_logits(adapter, prep)
    valid = prep.attention_mask.bool()
    assert out.logits.shape == ref.shape
    assert (out.logits - ref)[valid].abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", AVAILABLE)
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_tokens_equal_model_generate(tiny_adapter, family, batch):
    adapter = tiny_adapter(family)
    images, prompts = ragged_batch()
    prep = adapter.prepare(images[:batch], prompts[:batch])
    tok = adapter.tokenizer
    ours = generate(
        Runner(adapter), prep, max_new_tokens=16, stop_ids=[tok.eos_token_id], pad_id=tok.pad_token_id
    )
    with torch.no_grad():
        ref = adapter.model.generate(
            input_ids=prep.input_ids, attention_mask=prep.attention_mask, **prep.model_inputs,
            max_new_tokens=16, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        )[:, prep.input_ids.shape[1]:]  # fmt: skip
    n = ref.shape[1]
    assert ours.tokens.shape[1] == n
    assert torch.equal(ours.tokens, ref)


@pytest.mark.parametrize("family", AVAILABLE)
def test_branches_from_shared_prefix_equal_full_forwards(tiny_adapter, family):
    adapter = tiny_adapter(family)
    runner = Runner(adapter)
    images, prompts = ragged_batch()
    prep = adapter.prepare(images[:2], prompts[:2])
    pre = runner.prefill(prep)
    tok = adapter.tokenizer
    conts = [
        ["red", "circle", "yes"],
        ["blue", "square", "no"],
        ["two", "three", "four"],
        ["yes", "no", "one"],
    ]
    ids = torch.tensor([tok.convert_tokens_to_ids(c) for c in conts])
    owner = torch.tensor([0, 0, 1, 1])
    before = {i: e.key.clone() for i, e in pre.cache.layers.items()}
    logits = branch(runner, pre, owner, ids)
    for i, e in pre.cache.layers.items():  # the prefix is read, never written
        assert torch.equal(e.key, before[i])
    for n in range(len(conts)):
        b = int(owner[n])
        one = adapter.prepare([images[b]], [prompts[b] + " " + " ".join(conts[n])])
        ref = _reference_logits(adapter, one)[0, -ids.shape[1] :]
        assert (logits[n] - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", AVAILABLE)
def test_gather_mid_model_equals_masking_from_that_layer(tiny_adapter, family):
    adapter = tiny_adapter(family)
    runner = Runner(adapter)
    images, prompts = ragged_batch()
    prep = adapter.prepare(images, prompts)
    layer = 2
    gen = torch.Generator().manual_seed(0)

    def keep_mask(seq):
        keep = torch.rand(seq.valid.shape, generator=gen) > 0.5
        keep[:, -1] = True  # the last token predicts the next one
        return (keep | ~seq.visual) & seq.valid

    decided = {}

    def gather_hook(i, seq, _):
        if i == layer:
            decided["keep"] = keep_mask(seq)
            return seq.gather(decided["keep"])
        return seq

    def mask_hook(i, seq, _):
        if i == layer:
            return dataclasses.replace(
                seq, valid=decided["keep"].clone(), visual=seq.visual & decided["keep"]
            )
        return seq

    tok = adapter.tokenizer
    kw = dict(max_new_tokens=8, stop_ids=[], pad_id=tok.pad_token_id)
    g = generate(runner, prep, Plan(hook=gather_hook), **kw)
    m = generate(runner, prep, Plan(hook=mask_hook), **kw)
    assert (g.first_logits - m.first_logits).abs().max().item() <= 1e-4
    assert torch.equal(g.tokens, m.tokens)
    # and the gathered run really ran fewer tokens from that layer on
    assert g.costs.layer_flops["prefill"][layer] < m.costs.layer_flops["prefill"][layer]
    assert g.costs.kv_bytes < m.costs.kv_bytes
