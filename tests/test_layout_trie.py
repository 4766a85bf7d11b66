"""The layout trie of router training (training/layout_trie.py): each layout's answer, logits and cost equal those
of running it alone; the layers its layouts share are run, and counted, once; the work folder resumes."""

import math

import pytest
import torch

from trimvlm.router.route import RouterTokens
from trimvlm.runtime.generate import generate
from trimvlm.runtime.meter import Meter, flop_counter
from trimvlm.runtime.plan import Handoff, Plan
from trimvlm.runtime.runner import Runner
from trimvlm.training.layout_trie import Layout, run_trie

LAYER = 1  # the router's layer K: tokens dropped before it (layer 0 is shared by every layout)
LAYOUTS = [
    Layout(k, t, frozenset(s)) for k in (0.5, 1.0) for t in (0, 1) for s in ([], [2], [3], [2, 3], [0, 3])
]
# fewer, for the comparison with each layout run alone: still forks at every layer, a skip before the router's
FEW = [
    Layout(k, t, frozenset(s))
    for k, t, s in [
        (0.5, 0, []),
        (0.5, 0, [2]),
        (0.5, 0, [3]),
        (0.5, 1, [2, 3]),
        (0.5, 1, [0, 3]),
        (1.0, 0, []),
        (1.0, 1, [3]),
        (1.0, 0, [0]),
    ]
]


def _scores(runner, prep, table):
    """[B, T, S] token score rows by column: table[b, t] indexed by each row's own token index (-inf off the
    visual tokens), so a row scores its tokens alike batched and alone."""
    seq = runner.encode(prep, Meter())
    own = (seq.valid.long().cumsum(1) - 1).clamp(min=0)
    rows = torch.stack([table[:, t].gather(1, own) for t in range(table.shape[1])], 1)
    return rows.masked_fill(~(seq.visual & seq.valid)[:, None], float("-inf"))


def _alone(runner, prep1, scores1, layout, answer):
    """[n, V] the logits of one layout of one input run alone: its prefill (tokens dropped before LAYER by
    the router's reducer, its layers skipped) and its decode steps, teacher-forced on `answer`."""
    red = RouterTokens(keep=layout.keep, layer=LAYER)
    handoff = Handoff(router=scores1[0, layout.tokens][None])

    def hook(i, seq, run):
        return red.reduce(seq, run, handoff) if i == LAYER and layout.keep < 1 else seq

    got = []
    plan = Plan(hook=hook, skip_prefill=layout.skip, skip_decode=layout.skip)
    generate(runner, prep1, plan, max_new_tokens=len(answer), forced=answer, stop_ids=[], pad_id=0,
             on_logits=lambda t, logits: got.append(logits[0]))  # fmt: skip
    return torch.stack(got)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_trie_gives_each_layout_the_answer_logits_and_cost_of_running_it_alone(
    tiny_adapter, family, one_thread
):
    """A ragged batch (three images and prompts of different sizes, answers of 3, 1 and 4 tokens), layouts
    that differ in keep, token ranking and skipped layers (one before the router's layer): every layout's
    logits along the answer equal its own run (prefill, then decode steps), so do its greedy answer and KL."""
    from conftest import ragged_batch

    adapter = tiny_adapter(family)
    runner = Runner(adapter)
    images, prompts = ragged_batch()
    prep = adapter.prepare(images, prompts)
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(3, 2, 4096, generator=gen)
    answers = [torch.tensor([5, 7, 9]), torch.tensor([4]), torch.tensor([3, 3, 8, 1])]
    vocab = adapter.lm_head(torch.zeros(1, adapter.text_config.hidden_size)).shape[-1]
    p_full = [
        torch.log_softmax(torch.randn(len(a), vocab, generator=gen, dtype=torch.float64), -1) for a in answers
    ]
    out = run_trie(runner, prep, answers, _scores(runner, prep, table), FEW, LAYER, p_full, keep_logits=True)
    assert out.node_layers < out.layout_layers
    for b in range(3):
        prep1 = adapter.prepare(images[b : b + 1], prompts[b : b + 1])
        scores1 = _scores(runner, prep1, table[b : b + 1])
        for m, layout in enumerate(FEW):
            alone = _alone(runner, prep1, scores1, layout, answers[b])
            mine = out.logits[out.leaf[b, m], -len(answers[b]) :]
            torch.testing.assert_close(mine, alone, atol=2e-5, rtol=0)
            assert mine.argmax(-1).tolist() == alone.argmax(-1).tolist()
            q = torch.log_softmax(alone.double(), -1)
            kl = float((p_full[b].exp() * (p_full[b] - q)).sum())
            assert abs(float(out.cost[b, m]) - kl) < 1e-5 * max(1.0, kl)


def _nodes(layouts, layer: int, n_layers: int) -> dict:
    """Per (keep group, layer): how many distinct trie nodes run it (the same tokens and the same skipped
    layers before it), from the layouts alone; the root's layers before the router's under keep None."""
    out = {}
    for i in range(n_layers):
        for m in layouts:
            if i in m.skip:
                continue
            group = None if i < layer else m.keep
            tokens = None if i < layer or m.keep >= 1 else m.tokens
            out.setdefault((group, i), set()).add((tokens, frozenset(s for s in m.skip if s < i)))
    return {k: len(v) for k, v in out.items()}


def test_trie_counts_each_shared_layer_once(tiny_adapter):
    """One input: the meter's FLOPs equal torch's own count of what ran, and the vision tower once plus each
    trie node's layers (a node: a distinct prefix of token choice and skipped layers) plus the LM head on the
    leaves; strictly less than the layouts run one by one."""
    from trimvlm.testing import random_image

    adapter = tiny_adapter("qwen3_vl")
    runner = Runner(adapter)
    prep = adapter.prepare([[random_image(1, (64, 96))]], ["how many red circle are there"])
    scores = _scores(runner, prep, torch.randn(1, 2, 4096, generator=torch.Generator().manual_seed(1)))
    answer = [torch.tensor([5, 7, 9])]
    runner.vision_flops(prep)  # the vision tower's count is remembered first (as every benchmark warms up)
    meter = Meter()
    with flop_counter() as fc:
        out = run_trie(runner, prep, answer, scores, LAYOUTS, LAYER, meter=meter)
    assert fc.get_total_flops() == meter.costs.total_flops
    seq = runner.encode(prep, Meter())
    n_vis, q = int(seq.visual.sum()), seq.length + len(answer[0]) - 1
    length = {None: q} | {k: q - n_vis + math.ceil(n_vis * k) for k in (0.5, 1.0)}
    nodes = _nodes(LAYOUTS, LAYER, runner.num_layers)
    layers = sum(c * adapter.layer_flops(i, 1, length[g], length[g]) for (g, i), c in nodes.items())
    leaves = len({(m.keep, m.tokens if m.keep < 1 else None, m.skip) for m in LAYOUTS})
    head = adapter.head_flops(leaves, len(answer[0]))
    assert meter.costs.total_flops == runner.vision_flops(prep) + layers + head
    assert out.node_layers == sum(nodes.values())
    apart = 0
    for m in LAYOUTS:
        one = Meter()
        run_trie(runner, prep, answer, scores, [m], LAYER, meter=one)
        apart += one.costs.total_flops
    assert meter.costs.total_flops < apart and out.node_layers < out.layout_layers


def _train(vlm, records, work, **kw):
    from trimvlm.training.router import train_router

    settings = {"keeps": [0.5, 1.0], "max_skip": 1, "layer": 2, "sigmas": (0.0, 1.0), "seeds": 2, "epochs": 0,
                "near": 0.12, "budgets": [0.8], "cells": 3} | kw  # fmt: skip
    train_router(vlm, records, work=work, **settings)
    return [torch.load(p) for p in sorted((work / "inputs").glob("*.pt"))]


def test_work_folder_resumes_where_it_stopped_and_samples_near_the_budgets(demo, tmp_path):
    """Inputs are written as they are measured; a second run measures only the inputs after those on disk, and
    the result equals one uninterrupted run; other settings are refused. With near=, the plain token set runs
    every cell and the noise-perturbed ones at most `cells` cells near the budgets (the rest carry NaN)."""
    import json

    from trimvlm.errors import InputError
    from trimvlm.evals.tasks import calibration_items

    records = calibration_items("demo", 2, 0)
    first = _train(demo, records[:1], tmp_path / "a")
    resumed = _train(demo, records, tmp_path / "a")
    log = [json.loads(x) for x in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    assert [x["input"] for x in log] == [0, 1] and len(first) == 1  # the second run measured input 1 alone
    assert all(x["trie_layers"] < x["apart_layers"] for x in log)
    whole = _train(demo, records, tmp_path / "b")
    for a, b in zip(resumed, whole, strict=True):
        torch.testing.assert_close(a["cost"], b["cost"], equal_nan=True)
        assert torch.equal(a["chosen"], b["chosen"])
    for m in whole:
        cost = m["cost"].view(m["n_keep"], m["n_tok"], len(m["sizes"]))
        assert not bool(cost[:, 0].isnan().any())  # the plain token set: every cell
        ran = ~cost[:, 1:].isnan()
        assert bool((ran == ran[:, :1]).all())  # the noise sets share their cells (token pairs compare them)
        assert 0 < int(ran[:, 0].sum()) <= 3
    with pytest.raises(InputError, match="other settings"):
        _train(demo, records, tmp_path / "a", cells=2)
