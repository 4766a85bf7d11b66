"""Self-supervised DPO training of the meta-router (`trimvlm train-router`;
docs/references.md#the-meta-router).

For every unlabeled input x (the task's images and prompts; answers are never read):
1. the unpruned model answers greedily (at most `answer_tokens` tokens, up to and including its first stop
   token: positions after the answer ended are not part of it); its next-token distributions along that
   answer are the target p_full;
2. layouts are sampled at the budget (`token_keep`, `layers_skip`) as a grid: T token sets from noise-perturbed
   FastV rankings (the last query's attention in layer max(K, 2) - 1 of the unpruned model, heads averaged,
   plus N(0, sigma^2) noise scaled by the scores' spread: sigma 0 once, then `seeds` draws per sigma), times
   the layer sets (every `layers_skip`-subset of the candidate layers when there are at most `max_layer_sets`,
   else the block-influence-ranked one and random ones);
3. every layout runs for real (tokens gathered before layer K, the router's `layer`; its layers skipped),
   teacher-forced on the unpruned answer, all layouts of one input as one layout trie (training/layout_trie.py:
   the layers two layouts agree on run once); its cost is the sum over answer positions of KL(p_full ||
   p_layout);
4. preference pairs come from the grid: two layouts with the same layer set and different token sets (a
   token pair), or the same token set and different layer sets (a layer pair), the cheaper one preferred when
   its cost is below (1 - `margin`) times the other's and `floor` nats below it (near-ties, and differences
   between two nearly free layouts, carry no preference). The elements the two
   share cancel in the DPO margin, so a token pair trains the token scores and a layer pair the layer scores;
   the loss is the mean DPO loss of the token pairs plus that of the layer pairs, so that a handful of layer
   decisions is not drowned by hundreds of token decisions;
5. the router takes Adam steps (one per input, inputs shuffled each epoch) on that loss against a frozen copy
   of its initial self (the reference). log pi(layout) is computed from the logits (logsigmoid), never from
   clamped probabilities, so that saturated scores still carry gradient.
Seeded (each input's draws by (seed, its index)); a checkpoint is written every epoch (`--resume` continues
from it); with `work`, each input's measured layouts are written as measured and a new run resumes from them
(training/collect.py, which also samples v2 layouts near the budgets).

Router v2 (`keeps`, `max_skip`): the grid is every keep x every subset of at most `max_skip` candidate layers
(the empty one included) x the token sets; besides token and layer pairs (layer pairs: same size) it adds
iso-cost pairs, two layouts of one token set with different numbers of skipped layers at total-FLOP ratios
within 0.05 of each other (predicted from the shapes, `flop_table`). The last checkpoint carries the budget
section (router/budget.py): the cost table, and the training inputs' layer logits and plain-ranking KL on
which `router=PATH:budget=B` calibrates its keep and price.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from trimvlm.depth.base import model_fingerprint
from trimvlm.depth.block_influence import block_influence
from trimvlm.errors import InputError
from trimvlm.evals.run import batches
from trimvlm.evals.tasks.base import Task
from trimvlm.kernels.select import topk_mask
from trimvlm.router.budget import BudgetTable, calibrate
from trimvlm.router.model import MetaRouter, load_router, save_router
from trimvlm.router.route import _packed
from trimvlm.runtime.attention import AttentionProbe
from trimvlm.runtime.generate import generate
from trimvlm.runtime.meter import flop_counter
from trimvlm.runtime.plan import Plan
from trimvlm.tokens.base import make_view
from trimvlm.training.collect import Collect, Measured, check_sampling, prepare_work, stored
from trimvlm.training.dpo import dpo_loss, layout_logprob_logits
from trimvlm.training.layout_trie import Layout, run_trie
from trimvlm.tune.predict import predict, read_shapes


@dataclass
class Example:
    """One input's training data: the router's inputs, the layouts' chosen elements and the preference pairs."""

    feats: tuple  # (vis, vis_mask, txt, txt_mask), batch of one
    chosen: torch.Tensor  # [M, Nv + N] bool: visual tokens kept, then candidate layers kept
    pairs: dict  # "tokens" / "layers" -> (winners [P], losers [P]) layout indices
    ref: torch.Tensor  # [M] the frozen reference's log pi of each layout


def answer_length(tokens: torch.Tensor, stop_ids) -> int:
    """Positions of a one-row greedy answer [n] up to and including its first stop token."""
    stop = set(stop_ids)
    return next((i + 1 for i, t in enumerate(tokens.tolist()) if t in stop), len(tokens))


@torch.no_grad()
def unpruned_pass(runner, prepared, n: int, probe_layer: int, router_layer: int):
    """One prefill of the unpruned model serves every read training needs: the greedy answer (`n` tokens) and
    p_full, its log-probs along it ([B, n], [B, n, V]); FastV's scores, the last query's attention in
    `probe_layer`, heads averaged ([B, S]); and the live sequence entering `router_layer` (the router's input).
    The probe only records one attention row and the hook returns the sequence unchanged, so the cache the
    answer decodes from is the plain prefill's."""
    probe = AttentionProbe(last=1, layers={probe_layer})
    got = {}

    def hook(i, seq, run):
        if i == router_layer:
            got["seq"] = seq
        return seq

    logps = []
    gen = generate(runner, prepared, Plan(hook=hook, probe=probe), max_new_tokens=n,
                   on_logits=lambda t, logits: logps.append(torch.log_softmax(logits.double(), -1)))  # fmt: skip
    fastv = probe.results[probe_layer][:, -1].float()
    return gen.tokens, torch.stack(logps, 1), fastv, got["seq"]


def token_sets(gen, fastv, vis_cols, sigmas, seeds) -> list[torch.Tensor]:
    """Noise-perturbed FastV score rows [S]: sigma 0 once, then `seeds` draws for every other sigma."""
    spread = float(fastv[vis_cols].std()) if len(vis_cols) > 1 else 1.0
    noisy = [fastv.index_add(0, vis_cols, torch.randn(len(vis_cols), generator=gen) * sigma * spread)
             for sigma in sigmas if sigma != 0 for _ in range(seeds)]  # fmt: skip
    return [fastv.clone(), *noisy]


def layer_sets(gen, cand, layers_skip, order, max_sets: int = 8) -> list[list[int]]:
    """The skip sets: every `layers_skip`-subset of `cand` when there are at most `max_sets`, else the
    block-influence-ranked one plus random distinct ones."""
    every = [list(c) for c in itertools.combinations(cand, layers_skip)]
    if len(every) <= max_sets:
        return every
    ranked = [c for c in order if c in cand][:layers_skip]  # the lowest block influence first
    out = [sorted(ranked)]
    while len(out) < max_sets:
        pick = sorted(cand[i] for i in torch.randperm(len(cand), generator=gen)[:layers_skip].tolist())
        if pick not in out:
            out.append(pick)
    return out


def preference_pairs(cost: torch.Tensor, n_tok: int, n_lay: int, margin: float, floor: float = 0.0, *,
                     n_keep: int = 1, sizes=None, flops=None, iso: float = 0.05) -> dict:  # fmt: skip
    """Preference pairs over the [n_keep x n_tok x n_lay] layout grid (index (k * n_tok + t) * n_lay + l), the
    cheaper preferred when clearly cheaper: by more than `margin` times the dearer one's cost and by more than
    `floor` nats (0.001 against 0.004 is a tie, not a preference).
    - tokens: the same keep and layer set, different token sets;
    - layers: the same keep and token set, different layer sets of the same size (`sizes[l]`; all one size
      when None);
    - iso (router v2, with `flops` [n_keep, n_lay] total-FLOP ratios): the same token set, layer sets of
      different sizes, at FLOP ratios within `iso` of each other (more tokens and a skipped layer against fewer
      tokens and none, at one cost)."""
    n = n_keep * n_tok * n_lay
    flat = torch.arange(n)  # flat = (k * n_tok + t) * n_lay + j
    k, t, j = flat // (n_tok * n_lay), flat // n_lay % n_tok, flat % n_lay
    size = torch.tensor(sizes or [0] * n_lay)[j]

    def same(x):
        return x[:, None] == x[None, :]

    groups = {"tokens": same(k) & same(j) & ~same(t), "layers": same(k) & same(t) & ~same(j) & same(size)}
    if flops is not None:
        ratio = torch.tensor(flops, dtype=torch.float64)[k, j]
        groups["iso"] = same(t) & ~same(size) & ((ratio[:, None] - ratio[None, :]).abs() <= iso)
    c = cost.reshape(-1)
    better = (c[:, None] < (1 - margin) * c[None, :]) & (c[None, :] - c[:, None] > floor)  # row over column
    return {kind: tuple(torch.nonzero(mask & better, as_tuple=True)) for kind, mask in groups.items()}


def all_subsets(cand: list[int], max_skip: int) -> list[list[int]]:
    """Every subset of the candidate layers with at most `max_skip` layers, the empty one first."""
    return [list(c) for s in range(max_skip + 1) for c in itertools.combinations(cand, s)]


def train_router(vlm, records, *, token_keep: float = 0.25, layers_skip: int = 2, epochs: int = 3, seed: int = 0,
                 sigmas=(0.0, 0.5, 1.0), seeds: int = 3, answer_tokens: int = 8, beta: float = 0.1, lr: float = 1e-3,
                 width: int = 64, heads: int = 4, layer: int = 0, margin: float = 0.1, floor: float = 0.05, out=None,
                 resume: bool = False, on_step=None, keeps=None, max_skip: int | None = None,
                 budgets=None, work=None, near: float | None = None, cells: int | None = None) -> dict:  # fmt: skip
    """Train a router for `vlm` on `records`; returns the training log. Writes `out` every epoch.

    v1 (default): layouts at one budget, `token_keep` and `layers_skip`. v2 (`keeps`, a list of token keeps,
    and `max_skip`): layouts at every keep x every subset of at most `max_skip` candidate layers (skipping none
    included), with iso-cost pairs besides the token and layer pairs; the checkpoint then carries the budget
    table and its calibration at `budgets` (router/budget.py), for `router=PATH:budget=B`."""
    runner = vlm.runner
    cand = list(range(runner.num_layers // 2, runner.num_layers))
    v2 = keeps is not None
    keeps, max_skip = _check_layouts(cand, layers_skip, keeps, max_skip, layer)
    check_sampling(v2, near, budgets, cells)
    keeps = keeps or [token_keep]
    flops = flop_table(vlm, records, keeps, all_subsets(cand, max_skip), layer) if v2 else None
    hidden = vlm.adapter.text_config.hidden_size
    start = 0
    if resume and out is not None and (Path(out) / "router.json").exists():
        router, meta = load_router(out)
        start, layer = int(meta.get("epochs_done", 0)), int(meta.get("layer", 0))
        width, heads = router.width, router.heads
    ref = initial_router(hidden, cand, width, heads, seed)  # rebuilt from the seed when resuming
    if not start:
        router = copy.deepcopy(ref).requires_grad_(True)
    router.train()
    collect = Collect(cand, keeps, layer, seed, list(sigmas), seeds, answer_tokens, layers_skip,
                      all_subsets(cand, max_skip) if v2 else None, near, budgets if near is not None else None,
                      cells, flops["cost"] if v2 else None)  # fmt: skip
    folder = prepare_work(work, model_fingerprint(vlm.adapter), collect)
    with torch.no_grad():
        data, kls = _examples(vlm, records, ref, flops, collect, margin=margin, floor=floor, work=folder,
                              on_step=on_step)  # fmt: skip
    log = {"epochs": [], "inputs": len(records),
           "pairs": {k: sum(len(e.pairs[k][0]) for e in data) for k in data[0].pairs} if data else {}}  # fmt: skip

    def save(epoch: int) -> None:
        if out is not None:
            extra = {"epochs_done": epoch + 1, "token_keep": token_keep, "layers_skip": layers_skip, "layer": layer,
                     "seed": seed, "log": log}  # fmt: skip
            if v2 and epoch + 1 == epochs:  # calibrated once, on the trained router
                extra["budget"] = _budget_section(router, data, kls, flops, cand, max_skip, budgets)
            save_router(router, out, fingerprint=model_fingerprint(vlm.adapter), hidden=hidden, extra=extra)
        if on_step is not None:
            on_step()

    dpo_epochs(router, data, log, range(start, epochs), lr=lr, beta=beta, seed=seed + 1, on_epoch=save)
    return log


def initial_router(hidden: int, cand: list[int], width: int, heads: int, seed: int):
    """The router before training, from its seed: DPO's frozen reference (in training and in refits)."""
    torch.manual_seed(seed)
    return MetaRouter(hidden, cand, width=width, heads=heads).eval().requires_grad_(False)


def _check_layouts(cand: list[int], layers_skip: int, keeps, max_skip, layer: int) -> tuple[list[float], int | None]:
    """The token keeps and the most layers a v2 layout skips, checked (v1: `keeps` None, one keep set later)."""
    if not 0 <= layers_skip <= len(cand):
        raise InputError(f"layers_skip must be in 0..{len(cand)} (the candidate layers: the last half)")
    if not 0 <= layer <= cand[0]:
        raise InputError(f"the router's layer must be in 0..{cand[0]} (before the first candidate layer)")
    if keeps is None:
        return [], max_skip
    keeps = sorted({float(k) for k in keeps})
    if not keeps or not all(0 < k <= 1 for k in keeps):
        raise InputError(f"keeps must be token keep fractions in (0, 1], got {keeps!r}")
    max_skip = len(cand) if max_skip is None else int(max_skip)
    if not 0 <= max_skip <= len(cand):
        raise InputError(f"max_skip must be in 0..{len(cand)} (the candidate layers: the last half)")
    return keeps, max_skip


def _examples(vlm, records, ref, flops, collect: Collect, *, margin, floor, work=None,
              on_step=None) -> tuple[list[Example], list[torch.Tensor]]:  # fmt: skip
    """Per training input its layouts (token sets x layer sets at every keep; v1: sampled layer sets), their
    measured cost (KL, one layout trie per input), the preference pairs and the reference router's log-probs;
    and per input [keeps, layer sets] the KL of the plain-ranking token set (v2's calibration). Each input's
    random draws are seeded by (seed, its index), so a run resumed from `work` (training/collect.py) is the run
    that was not interrupted."""
    order = None
    if collect.lays is None:  # v1 ranks layer sets by block influence, on the first input
        bi = block_influence(vlm.runner, [vlm.prepare([list(records[0].images)], [records[0].prompt_text()])])
        order = sorted(range(vlm.runner.num_layers), key=lambda i: (bi[i], i))
    data, kls = [], []
    for j, r in enumerate(records):
        m = stored(work, j, lambda r=r, j=j: measure_input(vlm, r, collect, order, j))
        sets = len(m.sizes)
        pairs = preference_pairs(m.cost, m.n_tok, sets, margin, floor, n_keep=m.n_keep, sizes=m.sizes,
                                 flops=None if flops is None else flops["cost"])  # fmt: skip
        rp = layout_logprob_logits(_logits(ref, m.feats).expand(m.chosen.shape[0], -1), m.chosen)
        data.append(Example(m.feats, m.chosen, pairs, rp))
        kls.append(m.cost.view(m.n_keep, m.n_tok, sets)[:, 0])  # the plain FastV token set's KL
        if on_step is not None:
            on_step()
    return data, kls


@torch.no_grad()
def measure_input(vlm, r, collect: Collect, order, index: int):
    """(the `Measured` layouts of input `r`, the trie's `TrieOutput`): every layout of the grid (v2 with
    `collect.cells`: the plain token set's at every cell, the others' at the cells near the budgets) run as
    one layout trie, teacher-forced on the unpruned answer."""
    runner, c = vlm.runner, collect
    gen = torch.Generator().manual_seed(c.seed * 1_000_003 + index)
    prep = vlm.prepare([list(r.images)], [r.prompt_text()])
    tok, p_full, fv, seq = unpruned_pass(runner, prep, c.answer_tokens, max(c.layer, 2) - 1, c.layer)
    n_ans = answer_length(tok[0], vlm.stop_ids())
    vis = (seq.visual & seq.valid)[0]
    toks = token_sets(gen, fv[0], torch.nonzero(vis).flatten(), list(c.sigmas), c.seeds)
    sets = c.lays if c.lays is not None else layer_sets(gen, c.cand, c.layers_skip, order)
    cells = c.sampled(gen)
    grid = [(k, t, j) for k in range(len(c.keeps)) for t in range(len(toks)) for j in range(len(sets))]
    run = [i for i, (k, t, j) in enumerate(grid) if cells is None or t == 0 or (k, j) in cells]
    layouts = [Layout(c.keeps[grid[i][0]], grid[i][1], frozenset(sets[grid[i][2]])) for i in run]
    scores = torch.stack(toks).masked_fill(~vis[None], float("-inf"))
    out = run_trie(runner, prep, [tok[0, :n_ans]], scores[None], layouts, c.layer, [p_full[0, :n_ans]])
    cost = torch.full((len(grid),), float("nan"), dtype=torch.float64)
    cost[run] = out.cost[0]
    layers = torch.tensor([[i not in s for i in c.cand] for s in sets] * len(toks), dtype=torch.bool)  # layers run
    rows = torch.stack([t for t in scores for _ in sets])
    chosen = torch.cat([torch.cat([_kept(seq, rows, k, c.layer), layers], dim=1) for k in c.keeps])
    return Measured(_features(seq), chosen, cost, len(c.keeps), len(toks), [len(x) for x in sets]), out


def dpo_epochs(router, data: list[Example], log: dict, epochs: range, *, lr: float, beta: float, seed: int,
               on_epoch=None) -> None:  # fmt: skip
    """Adam on the router's trainable parameters: per epoch one step per input (the inputs shuffled by `seed`,
    epoch after epoch from 0, so a run resumed at `epochs.start` sees the same order) on the mean DPO loss of
    each pair kind; each epoch's mean loss appended to `log["epochs"]`, then `on_epoch(epoch)`."""
    opt = torch.optim.Adam([p for p in router.parameters() if p.requires_grad], lr=lr)
    shuffle = torch.Generator().manual_seed(seed)
    for epoch in range(epochs.stop):
        order = torch.randperm(len(data), generator=shuffle).tolist()
        if epoch < epochs.start:
            continue
        total, steps = 0.0, 0
        for j in order:
            ex = data[j]
            lp = layout_logprob_logits(_logits(router, ex.feats).expand(ex.chosen.shape[0], -1), ex.chosen)
            terms = [dpo_loss(lp[w], lp[lo], ex.ref[w], ex.ref[lo], beta) for w, lo in ex.pairs.values() if len(w)]
            if not terms:
                continue
            loss = sum(terms)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) / len(terms)
            steps += 1
        log["epochs"].append({"epoch": epoch, "dpo_loss": total / max(1, steps)})
        if on_epoch is not None:
            on_epoch(epoch)


def flop_table(vlm, records, keeps, subsets, layer, batch: int = 16) -> dict:
    """Predicted total-FLOP ratios [keep][subset] of the layouts on the training inputs (prefill prediction,
    tune.predict: any reducer's kept counts at a layer equal the router's), with the tokens reduced at the
    router's layer (`cost`) and at every layer up to it (`cost_by_layer`, for a `select=` method acting at its
    own layer); the router's own FLOPs are added as a ratio later (`_budget_section`). A skipped layer saves its
    own FLOPs, which depend only on the keep and whether the tokens were reduced before it: so each keep is
    predicted skipping nothing and skipping each layer alone, and a subset costs the first less its layers'
    savings (exactly the subset's own prediction)."""
    task = Task(name="router", records=list(records))
    shapes = read_shapes(vlm, task, batches(task, batch))
    base = predict(vlm, {}, shapes).prefill_flops
    layers = sorted({i for sub in subsets for i in sub})

    def flops(k: float, at: int, skip: list[int]) -> int:
        recipe = {} if k >= 1 else {"tokens": f"random:keep={k}:layer={at}"}
        if skip:
            recipe["depth"] = f"skip:layers={'+'.join(map(str, skip))}:scope=all"
        return predict(vlm, recipe, shapes).prefill_flops

    saved: dict[tuple, int] = {}  # (keep, layer, reduced before it) -> the FLOPs skipping it saves

    def table(at: int) -> list[list[float]]:
        cost = []
        for k in keeps:
            none = flops(k, at, [])
            for i in layers:
                if (k, i, i >= at) not in saved:
                    saved[k, i, i >= at] = none - flops(k, at, [i])
            cost.append([(none - sum(saved[k, i, i >= at] for i in sub)) / base for sub in subsets])
        return cost

    by_layer = {str(at): table(at) for at in range(layer + 1)}
    return {"keeps": list(keeps), "subsets": [list(x) for x in subsets], "cost": by_layer[str(layer)],
            "cost_by_layer": by_layer, "base_prefill": base, "inputs": len(records)}  # fmt: skip


def _budget_section(router, data, kls, flops, cand, max_skip, budgets) -> dict:
    """The checkpoint's `budget` section: the cost table (router FLOPs included) and the calibrated
    (budget, keep, lambda) grid (router/budget.py)."""
    with torch.no_grad(), flop_counter() as fc:
        z = torch.cat([_logits(router, ex.feats)[:, -len(cand):] for ex in data])
    share = fc.get_total_flops() / (flops["base_prefill"] * len(data) / flops["inputs"]) if data else 0.0
    table = {"keeps": flops["keeps"], "subsets": flops["subsets"], "max_skip": max_skip, "router_share": share,
             "cost": [[c + share for c in row] for row in flops["cost"]], "cost_by_layer": flops["cost_by_layer"]}  # fmt: skip
    # the calibration inputs' layer logits and layouts' KL: any budget is calibrated on them when asked
    table |= {"z": z.double().tolist(), "kl": [k.tolist() for k in kls], "candidate_layers": list(cand)}
    if budgets:
        bt = BudgetTable(table)
        table["choices"] = calibrate(bt, bt.z, cand, bt.kl_at, budgets)
    return table


def _kept(seq, scores, token_keep, layer):
    """[M, Nv] which packed visual tokens each layout keeps (the same per-image top-K the run used)."""
    m = scores.shape[0]
    vis = (seq.visual & seq.valid)[0]
    cols = torch.nonzero(vis).flatten()
    view = make_view(seq, token_keep, layer)
    keep_cols = torch.zeros(m, vis.shape[0], dtype=torch.bool)
    for u in range(view.mask.shape[0]):
        n, k = int(view.n[u]), int(view.k[u])
        c = view.cols[u, :n]
        top = topk_mask(scores[:, c], torch.full((m,), k), torch.ones(m, n, dtype=torch.bool))
        keep_cols[:, c] = top
    return keep_cols[:, cols]


def _features(seq):
    """The router's inputs for a live sequence: packed visual and text tokens with their masks."""
    v, vm, _ = _packed(seq.hidden, seq.visual & seq.valid)
    t, tm, _ = _packed(seq.hidden, ~seq.visual & seq.valid)
    return v, vm, t, tm


def _logits(router, feats) -> torch.Tensor:
    """[1, Nv + N] the router's score logits (visual tokens in column order, then the candidate layers)."""
    z_v, z_l = router.logits(*feats)
    return torch.cat([z_v[:, : int(feats[1].sum())], z_l], dim=1)
