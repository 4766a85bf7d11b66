"""The oracle router (training/oracle.py): its greedy choice under a budget is the best any choice can do, a
layout answers right exactly when greedy decoding under it gives the reference, and a layout trie whose tokens
are a token method's (a router's `select=`) gives each layout the logits of that recipe run alone."""

import itertools

import pytest
import torch

from trimvlm.protocol import build
from trimvlm.runtime.generate import generate
from trimvlm.runtime.meter import Meter
from trimvlm.runtime.plan import Plan
from trimvlm.runtime.runner import Runner
from trimvlm.training.layout_trie import Layout, run_trie
from trimvlm.training.oracle import answer_target, answers_right, cheapest_right, oracle_at


def _brute(right: torch.Tensor, cost: torch.Tensor, budget: float) -> int:
    """The most right inputs of any assignment with mean cost <= budget (-1: none fits)."""
    n, m = right.shape
    best = -1
    for pick in itertools.product(range(m), repeat=n):
        spent = sum(float(cost[i, j]) for i, j in enumerate(pick))
        if spent <= budget * n + 1e-9:
            best = max(best, sum(bool(right[i, j]) for i, j in enumerate(pick)))
    return best


@pytest.mark.parametrize("shared", [True, False])
def test_greedy_oracle_equals_brute_force(shared):
    """Random small instances (costs shared by every input, as a cost table gives them, or per input), every
    budget from below the cheapest to above the dearest: the greedy's count is the brute force's, its mean cost
    fits, and its choices are right where it counts them right."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):
        n, m = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen))
        right = torch.rand(n, m, generator=gen) < 0.4
        cost = torch.rand(m if shared else (n, m), generator=gen).double()
        full = cost.expand(n, m)
        for budget in torch.linspace(0, 1.05, 12).tolist():
            got = oracle_at(right, cost, budget)
            want = _brute(right, full, budget)
            assert (got.right if got.reached else -1) == want
            if want >= 0:
                assert got.mean_cost <= budget + 1e-9
                assert sum(float(full[i, j]) for i, j in enumerate(got.layout)) / n == pytest.approx(
                    got.mean_cost
                )
                assert got.right == sum(bool(right[i, j]) for i, j in enumerate(got.layout))


def test_cheapest_right_and_target():
    right = torch.tensor([[False, True, True], [False, False, False]])
    assert cheapest_right(right, torch.tensor([0.2, 0.9, 0.5])).tolist() == [0.5, float("inf")]
    assert answer_target(torch.tensor([4, 5]), 2, 5).tolist() == [4, 5, 2]
    assert answer_target(torch.tensor([4, 5]), 2, 1).tolist() == [4]


def test_unpruned_layout_is_right_iff_its_greedy_answer_is_the_reference(tiny_adapter, one_thread):
    """Teacher-forced in the trie, the unpruned layout answers a reference right iff the reference is the
    unpruned model's own greedy answer (a changed token anywhere: wrong)."""
    from conftest import ragged_batch

    adapter = tiny_adapter("qwen3_vl")
    runner = Runner(adapter)
    images, prompts = ragged_batch()
    prep = adapter.prepare(images[:1], prompts[:1])
    greedy = generate(runner, prep, Plan(), max_new_tokens=4, stop_ids=[], pad_id=0).tokens[0]
    s = runner.encode(prep, Meter()).valid.shape[1]
    layouts = [Layout(1.0, 0, frozenset()), Layout(1.0, 0, frozenset({1, 2}))]
    for pos in (None, 0, 3):
        ref = greedy.clone()
        if pos is not None:
            ref[pos] = (ref[pos] + 1) % 50
        out = run_trie(runner, prep, [ref], torch.zeros(1, 1, s), layouts, 0, keep_logits=True)
        right = answers_right(out.logits[out.leaf[0]], ref)
        assert bool(right[0]) == (pos is None)


def _alone(runner, prep1, plan, answer):
    """[n, V] the logits of one input's recipe run alone (prefill, decode steps), teacher-forced on `answer`."""
    got = []
    generate(runner, prep1, plan, max_new_tokens=len(answer), forced=answer, stop_ids=[], pad_id=0,
             on_logits=lambda t, logits: got.append(logits[0]))  # fmt: skip
    return torch.stack(got)


def test_trie_with_a_token_method_gives_the_recipe_logits(tiny_adapter, one_thread):
    """Tokens by a token method (density at layer 0, its merge included) in the trie: each layout's logits
    along the answer are those of the method's recipe run alone with the layout's skipped layers."""
    from conftest import ragged_batch

    adapter = tiny_adapter("qwen3_vl")
    runner = Runner(adapter)
    images, prompts = ragged_batch()
    prep = adapter.prepare(images[:2], prompts[:2])
    answers = [torch.tensor([5, 7, 9]), torch.tensor([4, 6])]
    layouts = [Layout(k, 0, frozenset(s)) for k in (0.3, 0.6, 1.0) for s in ([], [2], [1, 3])]

    def method(keep):
        return build("tokens", "density", {"keep": keep, "layer": 0})

    out = run_trie(runner, prep, answers, None, layouts, 0, keep_logits=True, reducer=method)
    for b in range(2):
        prep1 = adapter.prepare(images[b : b + 1], prompts[b : b + 1])
        for m, lay in enumerate(layouts):
            plan = Plan(skip_prefill=lay.skip, skip_decode=lay.skip)
            if lay.keep < 1:
                method(lay.keep).apply(plan, runner)
            mine = out.logits[out.leaf[b, m], -len(answers[b]) :]
            torch.testing.assert_close(mine, _alone(runner, prep1, plan, answers[b]), atol=2e-5, rtol=0)
