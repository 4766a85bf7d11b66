"""Refit a v2 router's layer scores on layouts run with the tokens a recipe executes (`trimvlm refit-router`).

The router's layer half learns, in `train_router`, from layer pairs of FastV-ranked token sets, which need not
carry over to the tokens a recipe executes (the best blocks to skip can depend on the question under them).
This measures (training/calibration.py's `measure`), on `n` val inputs, every layout of the
checkpoint's budget table (each keep x each skip subset) with the selector's own tokens, KL to the unpruned model
along its greedy answer, and trains the layer scores further with PAR's DPO objective (beta, the frozen reference
its training used: the initial router, rebuilt from its seed) on the pairs that grid gives (`preference_pairs`:
layer pairs, one keep and two subsets of one size; iso-cost pairs, subsets of different sizes at total-FLOP ratios
within 0.05). Every layout of one input keeps the same token half, so the token scores cancel in every pair's
margin. Only the layer head is trained by default: the block under both heads is shared, and training it would move
the router's own token scores too, untrained (`head_only=False` does). The checkpoint's
calibration inputs become these inputs (their logits under the refit router, their measured KL); its held-out
calibration is dropped, being the old router's: run `trimvlm calibrate-router` again on inputs after these.
"""

from __future__ import annotations

import copy

import torch

from trimvlm.training.calibration import measure
from trimvlm.training.dpo import layout_logprob_logits
from trimvlm.training.router import Example, _logits, dpo_epochs, initial_router, preference_pairs


def refit_layers(vlm, router, records, select: str, *, epochs: int = 40, beta: float = 0.1, lr: float = 1e-3,
                 margin: float = 0.1, floor: float = 0.05, seed: int = 0, head_only: bool = True,
                 on_step=None):  # fmt: skip
    """(the refit MetaRouter, its budget section, the log). `router`: a `Router` built with `budget=`;
    `head_only`: train the layer head alone (the token scores then stay exactly the router's; on demo-qwen35 it
    did as well as training the whole router, which overfit by 40 epochs); False: the whole router."""
    table = router.meta["budget"]
    cand, keeps, subsets = router.meta["candidate_layers"], table["keeps"], table["subsets"]
    sel = type(router)(path=router.path, budget=router.budget, select=select)
    cost = sel.table.cost  # [keep][subset] at the selector's layer
    feats: list = []
    measured = measure(vlm, router, records, [select], features=feats, on_step=on_step)
    kl = measured["kl"][sel.select_key]
    meta = router.meta
    ref = initial_router(int(meta["hidden"]), cand, int(meta["width"]), int(meta["heads"]), int(meta.get("seed", 0)))
    model = copy.deepcopy(router.model).train().requires_grad_(True)
    kept = torch.tensor([[c not in s for c in cand] for s in subsets] * len(keeps))  # [K * S, N] layers run
    data = []
    for f, x in zip(feats, kl, strict=True):
        pairs = preference_pairs(torch.tensor(x, dtype=torch.float64), 1, len(subsets), margin, floor,
                                 n_keep=len(keeps), sizes=[len(s) for s in subsets], flops=cost)  # fmt: skip
        pairs.pop("tokens")  # one token set: there are none
        nv = int(f[1].sum())
        chosen = torch.cat([torch.ones(len(kept), nv, dtype=torch.bool), kept], dim=1)  # the same tokens everywhere
        rp = layout_logprob_logits(_logits(ref, f).expand(len(kept), -1), chosen)
        data.append(Example(f, chosen, pairs, rp))
    if head_only:
        model.requires_grad_(False).head_l.requires_grad_(True)
    log = {"inputs": len(records), "select": sel.select_key,
           "pairs": {k: sum(len(e.pairs[k][0]) for e in data) for k in ("layers", "iso")}, "epochs": []}  # fmt: skip
    dpo_epochs(model, data, log, range(epochs), lr=lr, beta=beta, seed=seed)
    model.eval().requires_grad_(False)
    with torch.no_grad():
        z = torch.cat([_logits(model, f)[:, -len(cand):] for f in feats]).double().tolist()
    budget = {k: v for k, v in table.items() if k not in ("held_out", "choices")} | {"z": z, "kl": kl}
    return model, budget, log
