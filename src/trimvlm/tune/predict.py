"""Prefill FLOPs and KV bytes of a recipe from the input shapes alone, before anything runs.

For a task's batches (the harness' own `evals.run.batches`, so the padding is the one the run will have) the shapes
are read once, from the token ids and image grids (`Adapter.layout_seq`: no vision tower runs for them): each row's
real length, its visual tokens per image (the reducers' units) and the vision tower's FLOPs (`Runner.vision_flops`,
counted once per input shape and remembered). Downsampling (a plan with a `resolution`) reads each batch again with
its images prepared at that size: the rows, the visual tokens and the vision tower's FLOPs of the smaller images. A
recipe's model prefill FLOPs then follow the runner's own count: every decoder layer that runs costs
`Adapter.layer_flops(i, B, q, q)` on the batch's padded length q at that layer (a token reducer at layer L keeps
what its `kept_counts` says: K = ceil(N_image * keep) per image by default, pooling's window count; the batch
shrinks to its longest kept row), plus the LM head at the last position and the vision tower. KV bytes at the
prefill/decode boundary: per attention layer that ran, key and value of [B, Hk, K, hd], K the longest row after the
KV policy kept ceil(N_visual * keep) of the row's visual entries in that layer (text entries are never evicted).

What the shapes cannot tell is refused with None: a router (its layer plan follows the input), a reducer whose kept
counts follow the data (`TokenReducer.predictable = False`: SparseVLM), a KV policy whose per-layer split follows
the attention (`KVPolicy.predictable`: VL-Cache, AirCache), candidate items (their branches follow the candidates).
Such recipes are run to be measured. `tests/test_tune.py` checks prediction == measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from trimvlm.evals.tasks.base import Record
from trimvlm.kernels.select import keep_count
from trimvlm.plan import LayerPlan, build_methods, make_plan
from trimvlm.recipe import parse_recipe
from trimvlm.runtime.layers import ATTENTION
from trimvlm.tokens.base import _image_of, make_view


class Unit(NamedTuple):
    """One reducer unit of a row: its visual tokens, the image that owns it and its (rows, columns) grid."""

    tokens: int
    image: tuple[int, int]  # (sample, image)
    grid: tuple[int, int]


class Inputs(NamedTuple):
    """A batch's inputs: the images of each row and the prompts."""

    images: list
    prompts: list


@dataclass
class BatchShape:
    rows: list[int]  # real prefill tokens per row
    visual: list[int]  # visual tokens per row
    units: list[list[Unit]]  # per row: its units
    vision_flops: int
    inputs: Inputs  # to read the batch again at another resolution
    resized: dict = field(default_factory=dict, repr=False)  # plan.resolution -> this batch read at it

    @property
    def batch(self) -> int:
        return len(self.rows)


@dataclass
class Predicted:
    prefill_flops: int  # the model's (vision tower included), as the meter counts it
    kv_bytes: int


def read_shapes(vlm, task, batch_list: list[list[int]]) -> list[BatchShape] | None:
    """The shapes of every batch; None when the task holds items other than generation records."""
    records = task.records
    if not all(isinstance(r, Record) for r in records):
        return None
    out = []
    for idx in batch_list:
        items = [records[i] for i in idx]
        out.append(_shape(vlm, [list(r.images) for r in items], [r.prompt_text() for r in items]))
    return out


def _shape(vlm, images: list, prompts: list, plan=None) -> BatchShape:
    """One batch's shape, its images prepared as `plan` says (its resolution: tokens=downsample)."""
    runner = vlm.runner
    prepared = vlm.prepare(images, prompts, plan=plan)
    seq = vlm.adapter.layout_seq(prepared)  # the layout only: the tower runs once per new shape, to be counted
    view = make_view(seq, 1.0, 0)
    units: list[list[Unit]] = [[] for _ in range(seq.batch)]
    if view is not None:
        for u in range(view.mask.shape[0]):
            b = int(view.sample[u])
            grid = (int(view.grid[u, 0]), int(view.grid[u, 1]))
            units[b].append(Unit(int(view.n[u]), _image_of(seq, b, int(view.image[u])), grid))
    return BatchShape(rows=[int(x) for x in seq.valid.sum(1)], visual=[int(x) for x in (seq.visual & seq.valid).sum(1)],
                      units=units, vision_flops=runner.vision_flops(prepared), inputs=Inputs(images, prompts))  # fmt: skip


def predict(vlm, recipe, shapes: list[BatchShape]) -> Predicted | None:
    """The recipe's model prefill FLOPs and boundary KV bytes over the batches, or None where they follow the
    data (see the module docstring)."""
    recipe = parse_recipe(recipe)
    if recipe.router is not None:
        return None
    methods = build_methods(recipe)
    runner, ad = vlm.runner, vlm.adapter
    tokens, kv = methods.get("tokens"), methods.get("kv")
    if (tokens is not None and not tokens.predictable) or (kv is not None and not kv.predictable):
        return None
    plan = make_plan(recipe, runner)
    skip = plan.skip_prefill
    if isinstance(skip, LayerPlan | torch.Tensor):  # per-sample plans follow the input
        return None
    if plan.resolution is not None:  # smaller images (downsampling): every batch read again at their size
        for s in shapes:
            if plan.resolution not in s.resized:
                s.resized[plan.resolution] = _shape(vlm, s.inputs.images, s.inputs.prompts, plan=plan)
        shapes = [s.resized[plan.resolution] for s in shapes]
        tokens = None  # nothing is reduced inside the model
    lay = tokens.at(runner) if tokens is not None and tokens.ratio < 1 else None
    cfg = ad.text_config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_entry = 2 * heads * head_dim * ad.model.dtype.itemsize  # key + value of one position
    flops = kv_bytes = 0
    for s in shapes:
        dropped = [0] * s.batch
        if lay is not None:
            for b, units in enumerate(s.units):
                if units:
                    n = [u.tokens for u in units]
                    kept = tokens.kept_counts(n, [u.image for u in units], [u.grid for u in units])
                    dropped[b] = sum(n) - sum(kept)
        flops += s.vision_flops + ad.head_flops(s.batch, 1)
        for i in range(runner.num_layers):
            after = lay is not None and i >= lay
            lengths = [r - d for r, d in zip(s.rows, dropped, strict=True)] if after else s.rows
            q = max(lengths)
            if i in skip:
                continue
            flops += ad.layer_flops(i, s.batch, q, q)
            if ad.layer_types[i] != ATTENTION:
                continue
            if kv is None or kv.is_noop:
                kv_bytes += per_entry * s.batch * q
                continue
            vis = [v - d for v, d in zip(s.visual, dropped, strict=True)] if after else s.visual
            kept = [ln - v + keep_count(v, kv.keep) for ln, v in zip(lengths, vis, strict=True)]
            kv_bytes += per_entry * s.batch * max(kept)
    return Predicted(prefill_flops=int(flops), kv_bytes=int(kv_bytes))
