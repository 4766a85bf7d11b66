"""What `trimvlm calibrate-router` and `trimvlm refit-router` measure (training/calibration.py): every layout of a
budget table (each keep x each skip subset), its tokens chosen by a token method (`select=`) or by the router's
own scores, run as one layout trie, costs what running each layout apart costs (its prefill, then its decode
steps, teacher-forced on the answer): the KL to the unpruned model along the answer."""

import pytest
import torch

from trimvlm.errors import TrimVLMError
from trimvlm.protocol import build
from trimvlm.router.route import RouterTokens
from trimvlm.runtime.generate import generate
from trimvlm.runtime.meter import Meter
from trimvlm.runtime.plan import Handoff, Plan
from trimvlm.runtime.runner import Runner
from trimvlm.training.layout_trie import Layout, run_trie

KEEPS = (0.3, 0.6, 1.0)
SUBSETS = ([], [2], [3], [2, 3])  # the candidate layers: the last half of the tiny model's 4
LAYOUTS = [Layout(k, 0, frozenset(s)) for k in KEEPS for s in SUBSETS]


def _apart(runner, prep1, plan, answer, p_full) -> float:
    """The reference: one layout of one input run alone (prefill, decode steps), teacher-forced on `answer`;
    the sum over the answer of KL(p_full || p_layout)."""
    cost = []

    def kl(t, logits):
        q = torch.log_softmax(logits[0].double(), -1)
        cost.append(float((p_full[t].exp() * (p_full[t] - q)).sum()))

    generate(runner, prep1, plan, max_new_tokens=len(answer), forced=answer, stop_ids=[], pad_id=0, on_logits=kl)
    return sum(cost)


def _setup(tiny_adapter, family):
    from conftest import ragged_batch

    adapter = tiny_adapter(family)
    images, prompts = ragged_batch()
    gen = torch.Generator().manual_seed(0)
    answers = [torch.tensor([5, 7, 9]), torch.tensor([4]), torch.tensor([3, 3, 8, 1])]
    vocab = adapter.lm_head(torch.zeros(1, adapter.text_config.hidden_size)).shape[-1]
    p_full = [torch.log_softmax(torch.randn(len(a), vocab, generator=gen, dtype=torch.float64), -1) for a in answers]
    return adapter, Runner(adapter), images, prompts, answers, p_full


@pytest.mark.parametrize(
    "family,name,layer",
    [("qwen3_vl", "fastv", 1), ("qwen3_vl", "density", 0), ("qwen3_vl", "cdpruner", 1), ("qwen3_vl", "visionzip", 0), ("qwen3_5", "density", 1)],
)
def test_selector_layouts_cost_what_they_cost_apart(tiny_adapter, one_thread, family, name, layer):
    """A ragged batch (three images and prompts of different sizes, answers of 3, 1 and 4 tokens): a method that
    reads the prompt's attention in the layer before its own (fastv), one that reads the visual tokens alone
    (density), one that reads the prompt's text (cdpruner) and one that reads the vision tower's attention
    (visionzip) each give every layout the KL of the recipe
    `tokens=NAME:keep=K:layer=L` with its layers skipped, run alone."""
    adapter, runner, images, prompts, answers, p_full = _setup(tiny_adapter, family)

    def method(keep):
        return build("tokens", name, {"keep": keep, "layer": layer})

    out = run_trie(runner, adapter.prepare(images, prompts), answers, None, LAYOUTS, layer, p_full, reducer=method)
    for b in range(3):
        prep1 = adapter.prepare(images[b : b + 1], prompts[b : b + 1])
        for m, lay in enumerate(LAYOUTS):
            plan = Plan(skip_prefill=lay.skip, skip_decode=lay.skip)
            if lay.keep < 1:
                method(lay.keep).apply(plan, runner)
            want = _apart(runner, prep1, plan, answers[b], p_full[b])
            assert abs(float(out.cost[b, m]) - want) < 1e-5 * max(1.0, want)
    assert float(out.cost[:, 0].min()) > 0  # keep 0.3 moves the answer's distributions


def test_router_score_layouts_cost_what_they_cost_apart(tiny_adapter, one_thread):
    """The router's own token scores (one score row per input, `select=router`): each layout's KL is that of
    the router's token half (RouterTokens on those scores before its layer) with the layout's layers skipped,
    run alone."""
    adapter, runner, images, prompts, answers, p_full = _setup(tiny_adapter, "qwen3_vl")
    prep = adapter.prepare(images, prompts)
    seq = runner.encode(prep, Meter())
    own = torch.randn(seq.valid.shape, generator=torch.Generator().manual_seed(1))
    own = own.masked_fill(~(seq.visual & seq.valid), float("-inf"))
    out = run_trie(runner, prep, answers, own[:, None], LAYOUTS, 1, p_full)
    for b in range(3):
        prep1 = adapter.prepare(images[b : b + 1], prompts[b : b + 1])
        alone = own[b][seq.valid[b]][None]  # the row's own columns: a batch of one has no padding
        for m, lay in enumerate(LAYOUTS):
            red = RouterTokens(keep=lay.keep, layer=1)

            def hook(i, s, run, red=red, alone=alone):
                return red.reduce(s, run, Handoff(router=alone)) if i == 1 and red.keep < 1 else s

            want = _apart(runner, prep1, Plan(hook=hook, skip_prefill=lay.skip, skip_decode=lay.skip), answers[b],
                          p_full[b])  # fmt: skip
            assert abs(float(out.cost[b, m]) - want) < 1e-5 * max(1.0, want)


def test_trie_refuses_what_it_cannot_run_as_the_recipe_does(tiny_adapter):
    """A method reading layer L-1's attention with a layout skipping a layer before L is refused."""
    adapter, runner, images, prompts, answers, _ = _setup(tiny_adapter, "qwen3_vl")

    def method(keep):
        return build("tokens", "fastv", {"keep": keep, "layer": 2})

    with pytest.raises(TrimVLMError, match="before 2"):
        run_trie(runner, adapter.prepare(images, prompts), answers, None, [Layout(0.5, 0, frozenset({0}))], 2,
                 reducer=method)  # fmt: skip
