"""Generation loop: seeded sampling is reproducible, top-p at its limit is greedy, stop tokens end a sample."""

import torch
from conftest import ragged_batch

from trimvlm.runtime.generate import Sampling, generate
from trimvlm.runtime.runner import Runner


def _run(adapter, sampling, stop_ids=(), n=8):
    images, prompts = ragged_batch()
    prep = adapter.prepare(images, prompts)
    return generate(
        Runner(adapter), prep, max_new_tokens=n, stop_ids=list(stop_ids), pad_id=0, sampling=sampling
    )


def test_sampling_is_seeded(tiny_adapter):
    adapter = tiny_adapter("qwen3_vl")
    a = _run(adapter, Sampling(temperature=1.5, seed=3)).tokens
    b = _run(adapter, Sampling(temperature=1.5, seed=3)).tokens
    c = _run(adapter, Sampling(temperature=1.5, seed=4)).tokens
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_tiny_top_p_is_greedy(tiny_adapter):
    adapter = tiny_adapter("qwen3_vl")
    greedy = _run(adapter, Sampling()).tokens
    nucleus = _run(adapter, Sampling(temperature=1.0, top_p=1e-6, seed=1)).tokens
    assert torch.equal(greedy, nucleus)


def test_stop_token_ends_each_sample_and_pads(tiny_adapter):
    adapter = tiny_adapter("qwen3_vl")
    greedy = _run(adapter, Sampling()).tokens
    stop = int(greedy[0, 2])  # make sample 0's third token a stop token
    out = _run(adapter, Sampling(), stop_ids=[stop])
    first = int((greedy[0] == stop).nonzero()[0])
    assert int(out.lengths[0]) == first + 1
    assert torch.all(out.tokens[0, first + 1 :] == 0)
