"""Held-out calibration of a v2 router (`trimvlm calibrate-router`): what `router=PATH:budget=B` calibrates on.

A v2 checkpoint carries its training inputs' layer logits and layouts' KL, and `router/budget.py` chooses each
budget's keep and layer policy on them; but the router was fit to those inputs (its per-input layer choices look
better on them than on new inputs), and their KL was measured with FastV-ranked tokens, not the tokens a recipe
executes (`select=density@0` prunes far more gently, which moves the balance between tokens and layers).
This measures, on `n` inputs the router never trained on (the task's val split after its training inputs) and
for each selector (`router`: its own token scores; or a token method NAME@LAYER, as `select=` takes it), the
router's layer logits z and the KL to the unpruned model of every layout of the table (each keep x each skip
subset), teacher-forced on the unpruned greedy answer, all layouts of one input as one layout trie
(training/layout_trie.py). `BudgetTable(select=...)` then calibrates on those (the anchors' deviations are still
measured from the training inputs' mean logit, a constant of the checkpoint).
"""

from __future__ import annotations

import torch

from trimvlm.training.layout_trie import Layout, run_trie
from trimvlm.training.router import _features, _logits, answer_length, unpruned_pass


def trained_inputs(meta: dict) -> int:
    """How many of the task's first val inputs (at the router's seed) its training and refits have seen."""
    return max(int(meta.get("log", {}).get("inputs", 0)), int(meta.get("refit", {}).get("inputs", 0)))


def seen_inputs(meta: dict) -> int:
    """How many of the task's first val inputs the router trained, refit or was calibrated on (validation
    that should not favour its own choices starts after them)."""
    held = meta.get("budget", {}).get("held_out", {})
    return max(trained_inputs(meta), int(held.get("skip", 0)) + int(held.get("inputs", 0)))


@torch.no_grad()
def measure(vlm, router, records, selectors, answer_tokens: int = 8, on_step=None, features=None) -> dict:
    """The `held_out` section: {"inputs": n, "z": [X][N] layer logits, "kl": {selector: [X][keep][subset]}}.
    `router`: a `trimvlm.router.route.Router` built with `budget=` (its model, meta and `selector`);
    `features`: a list that receives each input's router inputs (training/layer_pairs.py trains on them)."""
    runner = vlm.runner
    table, cand, layer = router.meta["budget"], router.meta["candidate_layers"], router.layer
    layouts = [Layout(k, 0, frozenset(sub)) for k in table["keeps"] for sub in table["subsets"]]
    methods = [type(router)(path=router.path, budget=router.budget, select=s) for s in selectors]
    zs, kl = [], {r.select_key: [] for r in methods}
    for rec in records:
        prep = vlm.prepare([list(rec.images)], [rec.prompt_text()])
        tok, p_full, _, seq = unpruned_pass(runner, prep, answer_tokens, max(layer, 2) - 1, layer)
        n = answer_length(tok[0], vlm.stop_ids())
        ans, p = [tok[0, :n]], [p_full[0, :n]]
        feats = _features(seq)
        if features is not None:
            features.append(feats)
        logits = _logits(router.model, feats)
        zs.append(logits[0, -len(cand):].double().tolist())
        own = torch.full(seq.valid.shape, float("-inf"))
        own[0, torch.nonzero((seq.visual & seq.valid)[0]).flatten()] = logits[0, : int(feats[1].sum())].float()
        for r in methods:
            if r.select == "router":
                out = run_trie(runner, prep, ans, own[:, None], layouts, layer, p)
            else:
                out = run_trie(runner, prep, ans, None, layouts, r.selector(0.5).layer, p, reducer=r.selector)
            kl[r.select_key].append(out.cost[0].view(len(table["keeps"]), -1).tolist())
        if on_step is not None:
            on_step()
    return {"inputs": len(records), "z": zs, "kl": kl}
