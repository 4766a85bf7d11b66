"""Self-supervised DPO training of the meta-router (`trimvlm train-router`), REFERENCES.md section 5.

For every unlabeled input x (the task's images and prompts; answers are never read):
1. the unpruned model answers greedily (`answer_tokens` tokens); its next-token distributions along that answer
   are the target p_full;
2. layouts are sampled at the budget (`token_keep`, `layers_skip`): token sets from noise-perturbed FastV
   rankings (the last query's attention in layer 1 of the unpruned model, heads averaged, plus N(0, sigma^2)
   noise scaled by the scores' spread, several seeds) and layer sets from random and block-influence-ranked
   subsets of the candidate layers;
3. every layout runs for real (tokens gathered before layer 0, its layers skipped), all layouts of one input
   as rows of one batch with per-row layer plans, teacher-forced on the unpruned answer; its cost is
   sum over answer positions of KL(p_full || p_layout);
4. pairs (better, worse) are formed from the ranking by cost, and the router takes Adam steps on the DPO loss
   against a frozen copy of itself (the reference).
Seeded; a checkpoint is written every epoch (`--resume` continues from it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from trimvlm.errors import InputError
from trimvlm.kernels.select import topk_mask
from trimvlm.router.dpo import dpo_loss, layout_logprob
from trimvlm.router.route import RouterTokens, _packed
from trimvlm.runtime.attention import AttentionContext, AttentionProbe


@dataclass
class Layouts:
    """The sampled layouts of one input: token keep masks over its packed visual tokens, layer skip sets."""

    tokens: torch.Tensor  # [M, Nv] bool
    layers: torch.Tensor  # [M, N] bool over the candidate layers (True: skipped)
    cost: torch.Tensor  # [M] sum of KL(p_full || p_layout) over the answer


def fastv_scores(runner, prepared) -> torch.Tensor:
    """[B, S] the last query's attention in layer 1 (heads averaged) of the unpruned model."""
    probe = AttentionProbe(last=1, layers={1})
    runner.prefill(prepared, ctx=AttentionContext(probe=probe))
    return probe.results[1][:, -1].float()


@torch.no_grad()
def answer(runner, prepared, n: int):
    """(greedy answer tokens [B, n], p_full log-probs [B, n, V]) of the unpruned model."""
    out = runner.prefill(prepared)
    logits, tokens, pos = out.logits, [], out.next_pos.clone()
    logps = []
    for _ in range(n):
        logps.append(torch.log_softmax(logits.double(), -1))
        tok = logits.argmax(-1)
        tokens.append(tok)
        logits = runner.step(tok[:, None], runner.adapter.text_positions(pos, 1), out.cache)
        pos += 1
    return torch.stack(tokens, 1), torch.stack(logps, 1)


@torch.no_grad()
def layout_costs(runner, prepared1, answer_tok, p_full, token_scores, plans, token_keep: float) -> torch.Tensor:
    """[M] cost of M layouts of ONE input (prepared1: batch of one): each row keeps the tokens with the top
    `token_scores[m]` (a [M, S] column score) and skips `plans[m]` ([M, L] bool), teacher-forced on the
    answer."""
    from trimvlm.plan import Handoff

    m = plans.shape[0]
    prep = _repeat(prepared1, m)
    handoff = Handoff(router=token_scores)
    red = RouterTokens(keep=token_keep, layer=0)

    def hook(i, seq, run):
        return red.reduce(seq, run, handoff) if i == 0 and token_keep < 1 else seq

    out = runner.prefill(prep, hook=hook, skip=plans)
    logits, pos = out.logits, out.next_pos.clone()
    cost = torch.zeros(m, dtype=torch.float64)
    for t in range(len(answer_tok)):
        q = torch.log_softmax(logits.double(), -1)
        p = p_full[t][None]
        cost += (p.exp() * (p - q)).sum(-1).cpu()
        tok = answer_tok[t].reshape(1).expand(m)
        logits = runner.step(tok[:, None], runner.adapter.text_positions(pos, 1), out.cache, skip=plans)
        pos += 1
    return cost


def _repeat(prepared, m: int):
    from dataclasses import replace

    def rep(v):
        return v.repeat(m, *([1] * (v.dim() - 1))) if isinstance(v, torch.Tensor) else v

    inputs = {k: rep(v) for k, v in prepared.model_inputs.items()}
    return replace(prepared, input_ids=rep(prepared.input_ids), attention_mask=rep(prepared.attention_mask),
                   model_inputs=inputs, n_images=prepared.n_images * m, tiles=prepared.tiles * m,
                   image_keys=prepared.image_keys * m)  # fmt: skip


def sample_layouts(gen, fastv, vis_cols, n_vis, cand, layers_skip, sigmas, seeds, order):
    """Token score rows [M, S] (noise-perturbed FastV) and layer plans [M, L] over the candidate layers."""
    rows, plans = [], []
    spread = float(fastv[vis_cols].std()) if n_vis > 1 else 1.0
    n = len(cand)
    ranked = [c for c in order if c in cand][:layers_skip]
    for sigma in sigmas:
        for _ in range(seeds):
            s = fastv.clone()
            s[vis_cols] += torch.randn(n_vis, generator=gen) * sigma * spread
            for kind in ("random", "ranked"):
                if kind == "ranked" and sigma != sigmas[0]:
                    continue
                skip = ranked if kind == "ranked" else [cand[i] for i in torch.randperm(n, generator=gen)[:layers_skip]]
                rows.append(s)
                plans.append(skip)
    return rows, plans


def train_router(vlm, records, *, token_keep: float = 0.25, layers_skip: int = 2, epochs: int = 3, seed: int = 0,
                 sigmas=(0.0, 0.5, 1.0), seeds: int = 3, answer_tokens: int = 4, beta: float = 0.1, lr: float = 1e-3,
                 width: int = 64, heads: int = 4, out=None, resume: bool = False, on_step=None) -> dict:  # fmt: skip
    """Train a router for `vlm` on `records`; returns the training log. Writes `out` every epoch."""
    import copy

    from trimvlm.depth.base import model_fingerprint
    from trimvlm.depth.block_influence import block_influence
    from trimvlm.router.model import MetaRouter, load_router, save_router

    runner = vlm.runner
    n_layers = runner.num_layers
    cand = list(range(n_layers // 2, n_layers))
    if not 0 <= layers_skip <= len(cand):
        raise InputError(f"layers_skip must be in 0..{len(cand)} (the candidate layers: the last half)")
    torch.manual_seed(seed)
    hidden = vlm.adapter.text_config.hidden_size
    if resume and out is not None and (Path(out) / "router.json").exists():
        router, meta = load_router(out)
        router.train()
        start = int(meta.get("epochs_done", 0))
    else:
        router, start = MetaRouter(hidden, cand, width=width, heads=heads), 0
    ref = copy.deepcopy(router).eval().requires_grad_(False)
    opt = torch.optim.Adam(router.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    # the training data: per input, its layouts and costs (computed once, with the model frozen)
    data = []
    order = None
    torch.set_grad_enabled(False)
    for r in records:
        prep = vlm.prepare([list(r.images)], [r.prompt_text()])
        if order is None:
            bi = block_influence(runner, [prep])
            order = sorted(range(n_layers), key=lambda i: (bi[i], i))
        tok, p_full = answer(runner, prep, answer_tokens)
        fv = fastv_scores(runner, prep)[0]
        seq = runner.adapter.embed(prep)
        vis = (seq.visual & seq.valid)[0]
        cols = torch.nonzero(vis).flatten()
        rows, skips = sample_layouts(gen, fv, cols, len(cols), cand, layers_skip, list(sigmas), seeds, order)
        plans = torch.zeros(len(rows), n_layers, dtype=torch.bool)
        for i, sk in enumerate(skips):
            plans[i, sk] = True
        scores = torch.stack(rows).masked_fill(~vis[None], float("-inf"))
        cost = layout_costs(runner, prep, tok[0], p_full[0], scores, plans, token_keep)
        chosen = torch.cat([_kept(seq, scores, token_keep), ~plans[:, cand]], dim=1)  # layers: keep = not skipped
        order_m = torch.argsort(cost)
        best, worst = order_m[: len(order_m) // 2], order_m.flip(0)[: len(order_m) // 2]
        rp = layout_logprob(_scores(ref, seq).expand(chosen.shape[0], -1), chosen)  # the frozen reference's
        data.append((seq, chosen, best, worst, rp))
        if on_step is not None:
            on_step()
    torch.set_grad_enabled(True)
    log = {"epochs": [], "inputs": len(records)}
    for epoch in range(start, epochs):
        total, pairs = 0.0, 0
        for seq, chosen, best, worst, rp in data:
            lp = layout_logprob(_scores(router, seq).expand(chosen.shape[0], -1), chosen)
            loss = dpo_loss(lp[best], lp[worst], rp[best], rp[worst], beta)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(best)
            pairs += len(best)
        log["epochs"].append({"epoch": epoch, "dpo_loss": total / max(1, pairs)})
        if out is not None:
            save_router(router, out, fingerprint=model_fingerprint(vlm.adapter), hidden=hidden,
                        extra={"epochs_done": epoch + 1, "token_keep": token_keep, "layers_skip": layers_skip,
                               "seed": seed, "log": log})  # fmt: skip
        if on_step is not None:
            on_step()
    return log


def _kept(seq, scores, token_keep):
    """[M, Nv] which packed visual tokens each layout keeps (the same per-image top-K the run used)."""
    from trimvlm.tokens.base import make_view

    m = scores.shape[0]
    vis = (seq.visual & seq.valid)[0]
    cols = torch.nonzero(vis).flatten()
    view = make_view(seq, token_keep, 0)
    keep_cols = torch.zeros(m, vis.shape[0], dtype=torch.bool)
    for u in range(view.mask.shape[0]):
        n, k = int(view.n[u]), int(view.k[u])
        c = view.cols[u, :n]
        top = topk_mask(scores[:, c], torch.full((m,), k), torch.ones(m, n, dtype=torch.bool))
        keep_cols[:, c] = top
    return keep_cols[:, cols]


def _scores(router, seq) -> torch.Tensor:
    """[1, Nv + N] the router's keep scores (visual tokens in column order, then the candidate layers)."""
    v, vm, _ = _packed(seq.hidden, seq.visual & seq.valid)
    t, tm, _ = _packed(seq.hidden, ~seq.visual & seq.valid)
    s_v, s_l = router(v, vm, t, tm)
    return torch.cat([s_v[:, : int(vm.sum())], s_l], dim=1)


def train_router_command(model="demo", task="demo", n: int = 32, token_keep: float = 0.25, layers_skip: int = 2,
                         epochs: int = 3, seed: int = 0, out="runs/router", resume: bool = True, console=None,
                         load_kw: dict | None = None) -> dict:  # fmt: skip
    """`trimvlm train-router`: train on `n` unlabeled val inputs of the demo task, write the checkpoint."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    import trimvlm
    from trimvlm.depth.calibration import calibration_records

    console = console or Console()
    vlm = trimvlm.load(model, **(load_kw or {}))
    records = calibration_records(task, n, seed)
    with Progress(TextColumn("[bold]train-router"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as bar:  # fmt: skip
        job = bar.add_task("router", total=len(records) + epochs)
        log = train_router(vlm, records, token_keep=token_keep, layers_skip=layers_skip, epochs=epochs, seed=seed,
                           out=out, resume=resume, on_step=lambda: bar.advance(job))  # fmt: skip
    for e in log["epochs"]:
        console.print(f"epoch {e['epoch']}: DPO loss {e['dpo_loss']:.4f}")
    console.print(f"wrote {out}")
    return {"out": str(out), **log}
