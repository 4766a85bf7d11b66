"""The shared-prefix forward of a decision batch: a request's prompts that begin alike (one prompt per question,
each starting with the state and its images, as most decision templates write them) encode that common part
once, and every prompt's own tail runs as a branch off it, reading its request's prefix cache uncopied (the
scoring engine's `batched` executor).

Per request the prefix is the longest common token prefix of its prompts, cut before the first position a
question is read at (the token before its mark), and it must hold every image token of its prompts; each tail
runs from there up to its last read position (nothing after it can change what is read). Attention in the tail
sees [prefix KV | own KV] in one softmax and recurrent layers start from the prefix's states, so the states read
equal the plain forward's (tested against DecisionPipeline). The vision tower runs once per request instead of
once per question.

A recipe's token reducer runs on the prefix (the state's images are reduced once per request, so a
question-aware reducer such as FastV reads the prefix's last token, not each question); its layer plan applies
to prefix and tails alike. A per-sample layer plan (the router) is chosen once per request, on its prefix, and
each tail runs its request's layers (the prefix cache is not used then: a cached prefix holds no layer plan). A
batch where some request's prompts share no such prefix takes the plain forward (`forward.run_prompts`).
"""

from __future__ import annotations

import torch

from trimvlm.decision.forward import Forward
from trimvlm.runtime.plan import LayerPlan
from trimvlm.runtime.prefix_cache import PrefixCache
from trimvlm.runtime.tensor_memo import remembered
from trimvlm.scoring.executors.common import Work, request_rows, run_batched
from trimvlm.scoring.trie import build_forest

PER_TOKEN = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")  # cut with the tokens


def prefix_cuts(vlm, groups: list[list]) -> list[int] | None:
    """Per request (its `prompts.Prompt`s), the length of the prefix its prompts share; None when one has none
    (nothing before its first read position, or an image token after the common part)."""
    image = image_token(vlm)
    cuts = []
    for prompts in groups:
        cut = remembered(("cut", image), prompt_tensors(prompts), lambda p=prompts: request_cut(p, image))
        if cut is None:
            return None
        cuts.append(cut)
    return cuts


def image_token(vlm) -> int | None:
    """The model's image token id; None for a text-only backbone."""
    try:
        return int(vlm.adapter.image_token_id)
    except (AttributeError, TypeError):
        return None


def prompt_tensors(prompts: list) -> list:
    """The tensors a request's cut and tails are computed from: per prompt its token ids and marks."""
    return [t for p in prompts for t in (p.inputs["input_ids"], p.marks)]


def request_cut(prompts: list, image: int | None) -> int | None:
    """One request's `prefix_cuts`."""
    ids = [p.inputs["input_ids"].reshape(-1) for p in prompts]
    cut = min(len(x) for x in ids)
    for x in ids[1:]:
        differ = torch.nonzero(x[:cut] != ids[0][:cut]).flatten()
        if len(differ):
            cut = int(differ[0])
    cut = min([cut] + [int(p.marks.min()) - 1 for p in prompts])
    if cut < 1:
        return None
    if image is not None and any(bool((x[cut:] == image).any()) for x in ids):
        return None
    return cut


def request_tails(prompts: list, cut: int) -> list[tuple[int, ...]]:
    """A request's tails: per prompt its tokens after the prefix, up to its last read position."""

    def compute():
        return [tuple(p.inputs["input_ids"].reshape(-1)[cut : int(p.marks.max())].tolist()) for p in prompts]

    return remembered(("tails", cut), prompt_tensors(prompts), compute)


def prefix_inputs(prompts: list, cut: int) -> dict:
    """The processor tensors of a request's shared prefix: its first prompt's, cut to `cut` tokens."""
    return {k: (v[..., :cut] if k in PER_TOKEN else v) for k, v in prompts[0].inputs.items()}


def prefix_key(label: str, prompts: list, cut: int) -> bytes:
    """The prefix cache's key of a request's prefix (`PrefixCache.key` of its `prefix_inputs`), remembered for
    its first prompt's tensors."""
    items = prompts[0].inputs.items()
    tensors = [v for _, v in items if isinstance(v, torch.Tensor)]
    other = repr([(k, None if isinstance(v, torch.Tensor) else v) for k, v in items])  # the names, the rest
    return remembered(("prefix", label, cut, other), tensors,
                      lambda: PrefixCache.key(label, prefix_inputs(prompts, cut)))  # fmt: skip


@torch.no_grad()
def run_shared(vlm, groups: list[list], cuts: list[int], plan, meter) -> Forward:
    """Prefix per request (batched across requests), then every prompt's tail as a branch off its request."""
    runner, ad = vlm.runner, vlm.adapter
    inputs = [prefix_inputs(g, c) for g, c in zip(groups, cuts, strict=True)]
    reuse = None
    if runner.prefix_cache is None or plan.per_sample:  # a cached prefix holds no per-sample layer plan
        prepared = ad.prepare_processed(inputs)
        prefix = runner.prefill(prepared, plan, meter=meter, lm_head=False)
    else:  # found prefixes are read from the cache, the others prefilled (runtime/prefix_cache.py)
        prepared = None
        keys = [prefix_key(plan.label(), g, c) for g, c in zip(groups, cuts, strict=True)]
        prefix, reuse = runner.prefix_cache.prefill(runner, inputs, plan, meter, keys)
    owner = list(range(len(groups))) if reuse is None else reuse.rows  # each request's prefix row
    tails, where = tails_by_row(groups, cuts, owner, int(prefix.next_pos.shape[0]))
    forest = build_forest(tails, prefix.next_pos.tolist(), merge=False)
    skip = tail_skip(plan.skip_prefill, forest)
    with meter.timer("branch"):  # the tails' FLOPs are on the branch line: their time is too
        states = run_batched(Work(runner, prefix, forest, skip, meter, plan))
    rows = [forest.paths[a][u][int(m) - 1 - c]
            for g, c, at in zip(groups, cuts, where, strict=True)
            for p, (a, u) in zip(g, at, strict=True) for m in p.marks]  # fmt: skip
    layers = meter.costs.flops.get("prefill", 0) + meter.costs.flops.get("branch", 0)
    return Forward(hidden=states[torch.tensor(rows, device=states.device)], prepared=prepared, cache=prefix.cache,
                   layer_flops=layers, kv_rows=[1] * len(groups), reuse=reuse)  # fmt: skip


def tails_by_row(groups: list[list], cuts: list[int], owner: list[int], n_rows: int):
    """Each prompt's tail (its tokens after its request's prefix, up to its last read position), gathered by
    the prefix row it reads (`owner[r]`: request r's): the requests that read one row (the same prefix, from
    the prefix cache) branch off it together, and a tail they share runs once (the same tokens at the same
    positions off the same KV: the same states). (tails per row, per request per prompt its (row, index))."""
    tails: list[list[list[int]]] = [[] for _ in range(n_rows)]
    index: list[dict[tuple, int]] = [{} for _ in range(n_rows)]
    where = []
    for g, c, row in zip(groups, cuts, owner, strict=True):
        at = []
        for t in request_tails(g, c):
            if t not in index[row]:
                index[row][t] = len(tails[row])
                tails[row].append(list(t))
            at.append((row, index[row][t]))
        where.append(at)
    return tails, where


def tail_skip(skip, forest):
    """The layers the tails skip: the prefix's, each tail its request's row of a per-sample plan (the router
    chose one layout per request, on its prefix), in the executor's row order (paths by request)."""
    if isinstance(skip, LayerPlan):
        skip = skip.plan  # None: the plan's method skipped nothing (a router at price inf)
    if not isinstance(skip, torch.Tensor):
        return frozenset(skip or ())
    owner = request_rows(forest.paths, device=skip.device)
    return skip.index_select(0, owner)
