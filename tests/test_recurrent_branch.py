"""Recurrent branches at their own length: short Qwen3.5 segments (decode steps, candidate suffixes,
trie chains) run the gated delta rule's recurrent form (`kernels.gated_delta`) instead of transformers' chunked
kernel. The step form equals the chunked form (<= 1e-5), absent positions are absent, and candidate scores and
greedy tokens are those of the chunked path and of transformers."""

import pytest
import torch
from conftest import ragged_batch
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from trimvlm.kernels.gated_delta import gated_delta_steps
from trimvlm.runtime.cache import KVCache
from trimvlm.runtime.generate import generate
from trimvlm.runtime.layers import LINEAR
from trimvlm.runtime.runner import Runner
from trimvlm.scoring.request import ScoreRequest

TOL = 1e-5
pytestmark = pytest.mark.usefixtures("merged_tree")


def _inputs(b, t, h_k, h_v, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, h_k, d, generator=gen) for _ in range(2))
    v = torch.randn(b, t, h_v, d, generator=gen)
    g = -3 * torch.rand(b, t, h_v, generator=gen)
    beta = torch.rand(b, t, h_v, generator=gen)
    return q, k, v, g, beta


def _chunked(q, k, v, g, beta, state):
    return torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )


@pytest.mark.parametrize("t", [1, 3, 8, 24, 70])
def test_step_form_equals_chunked_form(t):
    """Rows start from rows `rows` of a table (a shared prefix's states), grouped value heads (4 per 2 q/k)."""
    q, k, v, g, beta = _inputs(5, t, 2, 4, 16)
    table = torch.randn(2, 4, 16, 16)
    rows = torch.tensor([0, 1, 1, 0, 1])
    with torch.no_grad():
        out, state = gated_delta_steps(q, k, v, g, beta, state=table, rows=rows)
        ref_out, ref_state = _chunked(q, k, v, g, beta, table[rows])
    assert (out - ref_out).abs().max().item() <= TOL
    assert (state - ref_state).abs().max().item() <= TOL
    # a broadcast view (one shared row for every branch) is read, never written
    before = table.clone()
    with torch.no_grad():
        out2, _ = gated_delta_steps(q, k, v, g, beta, state=table[:1].expand(5, -1, -1, -1))
    assert torch.equal(table, before)
    assert (out2 - _chunked(q, k, v, g, beta, table[:1].expand(5, -1, -1, -1))[0]).abs().max().item() <= TOL


def test_step_form_with_gradients_equals_without():
    q, k, v, g, beta = _inputs(2, 6, 2, 2, 8, seed=1)
    state = torch.randn(2, 2, 8, 8)
    with torch.no_grad():
        ref = gated_delta_steps(q, k, v, g, beta, state=state)
    q.requires_grad_(True)
    out, final = gated_delta_steps(q, k, v, g, beta, state=state)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    assert torch.allclose(out, ref[0], atol=1e-6) and torch.allclose(final, ref[1], atol=1e-6)


def test_absent_positions_are_absent():
    """A row with valid tokens first equals that row run on its valid tokens alone; a row with none keeps its
    start state exactly."""
    t = 7
    q, k, v, g, beta = _inputs(3, t, 2, 4, 8, seed=2)
    state = torch.randn(3, 4, 8, 8)
    n = [7, 3, 0]
    valid = torch.arange(t)[None] < torch.tensor(n)[:, None]
    with torch.no_grad():
        out, final = gated_delta_steps(q, k, v, g, beta, state=state, valid=valid)
        for r, m in enumerate(n):
            if m == 0:
                assert torch.equal(final[r], state[r])
                continue
            sl = (slice(r, r + 1), slice(0, m))
            ro, rs = _chunked(q[sl], k[sl], v[sl], g[sl], beta[sl], state[r : r + 1])
            assert (out[r, :m] - ro[0]).abs().max().item() <= TOL
            assert (final[r] - rs[0]).abs().max().item() <= TOL


@pytest.mark.parametrize("t", [1, 5, 24])
def test_layer_step_form_equals_the_module(tiny_adapter, t):
    """A whole Gated DeltaNet decoder layer continuing from a prefix's states: the adapter's step form against
    the model's own layer (transformers' chunked kernel for t > 1, its decode step for t = 1), outputs and final
    conv / recurrent states."""
    ad = tiny_adapter("qwen3_5")
    images, prompts = ragged_batch()
    pre = Runner(ad).prefill(ad.prepare(images[:2], prompts[:2]))
    owner = torch.tensor([0, 1, 1, 0])
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(4, t, ad.text_config.hidden_size, generator=gen)
    for i in [j for j, kind in enumerate(ad.layer_types) if kind == LINEAR]:
        sub = KVCache.branching(
            [], pre.cache.states, owner, keep_final_states=True, num_layers=pre.cache.num_layers
        )
        with torch.no_grad():
            ref = ad._call(i, x, None, sub)
            got, states = ad._linear_steps(i, x, None, pre.cache.states[i], owner)
        assert (got - ref).abs().max().item() <= TOL
        for name in ("conv", "recurrent"):
            assert (states[name] - sub.states[i][name]).abs().max().item() <= TOL, name
        fresh = KVCache(pre.cache.num_layers)  # no state yet: a short prompt's first chunk
        with torch.no_grad():
            ref = ad._call(i, x, None, fresh)
            got, states = ad._linear_steps(i, x, None, {}, None)
        assert (got - ref).abs().max().item() <= TOL
        for name in ("conv", "recurrent"):
            assert (states[name] - fresh.states[i][name]).abs().max().item() <= TOL, name


def _requests():
    images, prompts = ragged_batch()
    cands = [
        ["red circle yes", "red circle no", "red square yes", "red square two three", "blue"],
        ["two three four", "two three five", "one"],
        ["yes"],
    ]
    return [ScoreRequest(images[i], prompts[i], c) for i, c in enumerate(cands)]


def _logits(res):
    return [x for r in res.results for x in r.logits]


def _count_steps(ad, monkeypatch):
    calls = []
    real = ad._linear_steps

    def counted(i, x, *a):
        calls.append(x.shape[1])
        return real(i, x, *a)

    monkeypatch.setattr(ad, "_linear_steps", counted)
    return calls


@pytest.mark.parametrize("executor", ["independent", "batched", "segments", "tree", "tree-merged"])
def test_scores_equal_the_chunked_path(vlms, monkeypatch, executor):
    """Every executor's scores on a ragged batch of requests (shared prefixes of different rows, a nested trie):
    the step form everywhere, the chunked kernel everywhere (recurrent_max_len 0: every call padded to chunks),
    and a mix (chains longer than 2 tokens chunked); all equal `independent` on the chunked path."""
    vlm = vlms("qwen3_5")
    ad = vlm.adapter
    reqs = _requests()
    monkeypatch.setattr(ad, "recurrent_max_len", 0)
    ref = _logits(vlm.score(reqs, readout="loglik", executor="independent"))
    for limit in (0, 2, 24):
        monkeypatch.setattr(ad, "recurrent_max_len", limit)
        with monkeypatch.context() as m:
            calls = _count_steps(ad, m)
            got = _logits(vlm.score(reqs, readout="loglik", executor=executor))
        assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-4, limit
        assert all(c <= limit for c in calls)
        if limit != 2:  # (at 2, which segments are short depends on the executor's layout)
            assert bool(calls) == (limit > 0)


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_tokens_equal_model_generate(tiny_adapter, monkeypatch, batch):
    """Decode steps (and the short ragged prompts' linear layers) run the step form; the tokens are
    transformers' greedy tokens."""
    ad = tiny_adapter("qwen3_5")
    images, prompts = ragged_batch()
    prep = ad.prepare(images[:batch], prompts[:batch])
    tok = ad.tokenizer
    calls = _count_steps(ad, monkeypatch)
    ours = generate(Runner(ad), prep, max_new_tokens=12, stop_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
    with torch.no_grad():
        ref = ad.model.generate(
            input_ids=prep.input_ids, attention_mask=prep.attention_mask, **prep.model_inputs,
            max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        )[:, prep.input_ids.shape[1]:]  # fmt: skip
    assert torch.equal(ours.tokens, ref)
    assert calls.count(1) >= ours.tokens.shape[1] - 1  # every decode step of every linear layer


def test_ragged_rows_equal_each_row_alone(tiny_adapter):
    """One call over rows whose valid positions differ (left padding, holes, a row with none) from different
    prefix rows: each row's valid outputs and final states are those of the model's layer on that row's valid
    tokens alone; a row with none keeps its start states exactly."""
    ad = tiny_adapter("qwen3_5")
    images, prompts = ragged_batch()
    pre = Runner(ad).prefill(ad.prepare(images[:2], prompts[:2]))
    owner = torch.tensor([1, 0, 1, 0])
    valid = torch.tensor(
        [[0, 0, 1, 1, 1, 1], [1, 0, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.bool
    )
    x = torch.randn(4, 6, ad.text_config.hidden_size, generator=torch.Generator().manual_seed(3))
    i = ad.layer_types.index(LINEAR)
    num = pre.cache.num_layers
    cache = KVCache.branching([], pre.cache.states, owner, keep_final_states=True, num_layers=num)
    with torch.no_grad():
        got = ad._run_linear(i, x, None, cache, valid)
        for r in range(4):
            start = {k: v[owner[r] : owner[r] + 1] for k, v in pre.cache.states[i].items()}
            if not valid[r].any():
                for k, v in start.items():
                    assert torch.equal(cache.states[i][k][r : r + 1], v), k
                continue
            one = KVCache.branching([], {i: start}, torch.tensor([0]), keep_final_states=True, num_layers=num)
            ref = ad._call(i, x[r : r + 1, valid[r]], None, one)
            assert (got[r, valid[r]] - ref[0]).abs().max().item() <= TOL
            for k in ("conv", "recurrent"):
                assert (cache.states[i][k][r] - one.states[i][k][0]).abs().max().item() <= TOL, k
