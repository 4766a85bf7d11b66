"""Vision-tower attention probe: what PruMerge and VisionZip read while the images are encoded.

A `VisionProbe` asks for one layer of the vision tower (default the penultimate, as both papers use) and gets,
for every visual unit of the batch (an image, or a tile of a tiled family), in the LLM token order of that unit:

- `received` [n]: the attention each LLM token receives in that layer, heads averaged, summed over the vision
  patches the projector merged into the token:
  * towers with a [CLS] token (CLIP, InternViT): the [CLS] row of the softmax (the [CLS] query's attention to
    each patch), as LLaVA-PruMerge and VisionZip read it;
  * towers without one (Qwen-VL, SigLIP in LLaVA and Idefics3): the mean attention each patch receives, i.e. the
    column mean of the softmax over all (valid) query patches of its own image, computed in blocks of query rows
    (never an N x N matrix). In window-attention layers (Qwen2.5-VL) a query outside a patch's window gives it 0.
- `keys` [n, H * d]: that layer's keys as the attention function received them (after rotary embeddings where the
  tower has them), heads concatenated (the k_proj output, as PruMerge's code reads it), averaged over the patches
  merged into the token; `heads` says how to split them (VisionZip averages over heads).

Recording: `recording(probe, modules, cls=...)` selects trimvlm's vision attention function (registered in
transformers' `AttentionInterface` under its own name) for the probed layer's attention module only, while the
encode runs (`use_vision_attention`), and holds the active recording in a context variable, so a run in another
thread never records into it. The function is transformers' SDPA for every call (the layer's output is SDPA's);
for the probed layer of the active recording it also computes the statistic above, counted as method FLOPs
(`kernels.flops`, the "vision" line). Qwen-VL towers call it once per image (or per window), with no mask;
CLIP/SigLIP/InternViT/Idefics3 towers once per layer for all images, with a padding mask where images have padded
patches. The records become LLM tokens (`Recording.batched`, or the adapter over `Recording.packed`), stored in
`probe.results[(sample, unit)]`.

Why the module's own config and not the shared vision config: the shared configs are never written while the
model runs (other threads and a user's code read them). The probed module reads, while the probe is active, a
private shallow copy of its config that names this function (reference-counted per module with `held.Held`, the
module's own config put back by the last recording out); the other layers run as configured.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from trimvlm.errors import RecipeError, TrimVLMError
from trimvlm.kernels.flops import matmul_flops
from trimvlm.runtime.held import Held

NAME = "trimvlm_vision_sdpa"
QUERY_BLOCK = 128  # query rows per block of the received-attention column mean


@dataclass
class VisionUnit:
    """What the probe recorded for one visual unit, in the LLM token order of that unit."""

    received: torch.Tensor  # [n] float32: attention each LLM token receives (module docstring)
    keys: torch.Tensor  # [n, H * d] float32: keys, heads concatenated, mean over the token's patches


@dataclass
class VisionProbe:
    """Record one vision-tower layer's attention statistics (`layer`: index into the tower's layers, negative
    from the end; -2 = the penultimate layer). Filled by the adapter's `embed(prepared, vision=probe)`:
    `results[(sample, unit)]`, `heads` (attention heads of the keys), `mode` ("cls" or "mean": which statistic
    the tower allows)."""

    layer: int = -2
    results: dict[tuple[int, int], VisionUnit] = field(default_factory=dict)
    heads: int = 0
    mode: str = ""


class Call(NamedTuple):
    """The raw record of one attention call: stat [B, S] the [CLS] row (queries 1) or the column sums over the
    valid query rows (queries = their count), keys [B, S, Hk * d], queries [B]."""

    stat: torch.Tensor
    keys: torch.Tensor
    queries: torch.Tensor


@dataclass
class Recording:
    """One active recording: the probed attention module, the statistic, and the records of its calls in
    call order."""

    probe: VisionProbe
    target: torch.nn.Module
    cls: bool
    calls: list[Call] = field(default_factory=list)
    heads: int = 0
    flops: int = 0  # the extra score products, counted by `Adapter.encode_vision` once the records are in

    def _column_sums(self, q, kt, add, rows, scaling):
        """[..., S]: the softmax of the scaled scores in float32 (the queries scaled before the product, a pass
        over [q, d], not [q, S]; plus the additive mask `add`) summed over the query rows, the rows not in `rows`
        (bool [..., q]) left out."""
        self.flops += matmul_flops(q.shape, kt.shape)
        sc = torch.matmul(q * scaling, kt).float()
        if add is not None:
            sc = sc + add
        p = torch.softmax(sc, dim=-1)
        if rows is not None:
            p = torch.where(rows[..., None], p, 0.0)
        return p.sum(-2)

    def batched(self, b: int, s: int, groups: torch.Tensor) -> list[VisionUnit]:
        """One `VisionUnit` per unit of a tower that runs all b units in one call per layer over s tokens: LLM
        token t of a unit is made of vision tokens groups[t] ([n, g], e.g. the 2x2 patches of a spatial merge
        or a pixel shuffle; index tensors made on the CPU, with an explicit device): its attention (per query
        row) is their sum, its key their mean."""
        if len(self.calls) != 1 or tuple(self.calls[0].stat.shape) != (b, s):
            raise Incomplete(
                f"expected one call over [{b}, {s}] tokens, got {[tuple(c.stat.shape) for c in self.calls]}"
            )
        call = self.calls[0]
        groups = groups.to(call.stat.device)
        received = (call.stat / call.queries.clamp(min=1)[:, None])[:, groups].sum(-1)
        k = call.keys[:, groups].mean(-2)
        return [VisionUnit(received=received[u], keys=k[u]) for u in range(b)]

    def packed(self, total: int):
        """(stat [total], keys [total, D]) of a tower that runs one image (or window) per call, concatenated in
        call order: the layer's token order."""
        got = sum(c.stat.numel() for c in self.calls)
        if got != total or any(c.stat.shape[0] != 1 for c in self.calls):
            raise Incomplete(f"expected {total} tokens in calls of one sequence each, got {got}")
        return torch.cat([c.stat[0] for c in self.calls]), torch.cat([c.keys[0] for c in self.calls])

    @torch.no_grad()
    def record(self, query, key, mask, scaling) -> None:
        b, h, s, d = query.shape
        hk = key.shape[1]
        self.heads = hk
        kr = key if hk == h else key.repeat_interleave(h // hk, 1)
        kt = kr.transpose(-1, -2)
        add = None if mask is None else mask.float()  # additive
        if mask is not None and mask.dtype == torch.bool:
            add = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(~mask, float("-inf"))
        if self.cls:  # the [CLS] query's row, heads averaged: [B, S]
            first = None if add is None else add[:, :, :1]
            stat = self._column_sums(query[:, :, :1], kt, first, None, scaling).mean(1)
            queries = torch.ones(b, dtype=torch.float32, device=query.device)
        else:
            if mask is None:
                valid = torch.ones(b, s, dtype=torch.bool, device=query.device)
            else:  # a padded patch is masked as a key for every query, itself included
                diag = mask[:, 0].diagonal(dim1=-2, dim2=-1)
                valid = diag if diag.dtype == torch.bool else diag > torch.finfo(diag.dtype).min / 2
                valid = valid.expand(b, s)
            if s <= QUERY_BLOCK:  # one block (small calls: window layers): every head in one product
                rows = None if mask is None else valid[:, None, :]
                stat = self._column_sums(query, kt, add, rows, scaling).mean(1)
            else:  # one sample and head at a time: its [q, S] block stays in cache through softmax and sums
                stat = torch.zeros(b, kr.shape[2], dtype=torch.float32, device=query.device)
                for i, j in itertools.product(range(b), range(h)):
                    for q0 in range(0, s, QUERY_BLOCK):
                        q1 = min(s, q0 + QUERY_BLOCK)
                        part = None if add is None else add[i, min(j, add.shape[1] - 1), q0:q1]
                        rows = None if mask is None else valid[i, q0:q1]
                        stat[i] += self._column_sums(query[i, j, q0:q1], kt[i, j], part, rows, scaling)
                stat /= h  # heads averaged
            queries = valid.sum(1).float()
        keys = key.detach().transpose(1, 2).reshape(b, key.shape[2], hk * d).to(torch.float32, copy=True)
        self.calls.append(Call(stat, keys, queries))


class Incomplete(TrimVLMError):
    """The probed layer's calls did not all come through trimvlm's function, or not over the tokens expected."""


_ACTIVE: ContextVar[Recording | None] = ContextVar("trimvlm_vision_probe", default=None)


def trimvlm_vision_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA; for the probed layer of an active recording (this context only) it also records."""
    rec = _ACTIVE.get()
    if rec is not None and module is rec.target:
        scaling = kwargs.get("scaling")
        rec.record(query, key, attention_mask, scaling if scaling is not None else query.shape[-1] ** -0.5)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(NAME, trimvlm_vision_attention)


_HELD = Held()  # per attention module: its own config while recordings use a private copy


def use_vision_attention(module):
    """Select trimvlm's vision attention for one attention module while a recording runs: the module reads a
    private copy of its config naming this function; the last recording out puts the module's config back."""

    def change():
        own = module.config
        # a shallow copy: every other setting is the shared config's; the name is set on this copy only
        # (the property setter would also reach any sub-config)
        private = copy.copy(own)
        private._attn_implementation_internal = NAME
        module.config = private
        return lambda: setattr(module, "config", own)

    return _HELD.holding(id(module), change)


@contextlib.contextmanager
def recording(probe: VisionProbe, modules: list, *, cls: bool):
    """Record `probe`'s layer of the vision tower whose attention modules are `modules` (in layer order) while
    the block runs; yields the `Recording`."""
    depth = len(modules)
    if not -depth <= probe.layer < depth:
        raise TrimVLMError(
            f"vision layer {probe.layer} out of range: this vision tower has {depth} layers "
            f"(allowed {-depth}..{depth - 1})"
        )
    rec = Recording(probe=probe, target=modules[probe.layer], cls=cls)
    probe.results.clear()
    probe.mode = "cls" if cls else "mean"
    token = _ACTIVE.set(rec)
    try:
        with use_vision_attention(rec.target):
            yield rec
    finally:
        _ACTIVE.reset(token)
    probe.heads = rec.heads


# ---- what a vision-scored token reducer (PruMerge, VisionZip) shares ------------------------------------------
def request(handoff, layer: int) -> VisionProbe:
    """A VisionProbe for `layer`, kept in `handoff.vision` so the reducer reads what the encode recorded."""
    handoff.vision = VisionProbe(layer=layer)
    return handoff.vision


def check_layer(runner, layer: int, name: str) -> None:
    """RecipeError unless this model has a vision tower with a layer `layer` the probe can record."""
    try:
        depth = len(runner.adapter.vision_attention_modules())
    except (NotImplementedError, AttributeError) as e:
        raise RecipeError(
            f"tokens={name} reads the vision tower's attention; this model has none to probe"
        ) from e
    if not -depth <= layer < depth:
        raise RecipeError(
            f"tokens={name}: vision_layer {layer} out of range; allowed {-depth}..{depth - 1} (this vision tower "
            f"has {depth} layers; -2 = the penultimate)"
        )


def view_records(view, handoff, name: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(received [U, N], keys [U, N, H * d], heads) aligned with the units of `view`, a `VisualView` (0 on pads),
    from the probe in the handoff, taken out of the probe so a later prefill can never read them."""
    probe = handoff.vision
    if not isinstance(probe, VisionProbe):
        raise TrimVLMError(
            f"tokens={name} needs the vision tower's attention: pass the plan's vision_probe to the prefill "
            "(AttentionContext(vision=plan.vision_probe))"
        )
    u, n = view.mask.shape
    dev = view.mask.device
    received, keys = torch.zeros(u, n, dtype=torch.float32, device=dev), None
    for i in range(u):
        key = (int(view.sample[i]), int(view.image[i]))
        rec = probe.results.pop(key, None)
        if rec is None:
            raise TrimVLMError(
                f"tokens={name} needs the vision tower's attention of sample {key[0]}, unit {key[1]}: pass the "
                "plan's vision_probe to the prefill (AttentionContext(vision=...)) so the images are encoded with it"
            )
        m = rec.received.shape[0]
        if m != int(view.n[i]):
            raise TrimVLMError(
                f"tokens={name}: the vision probe recorded {m} tokens for sample {key[0]}, unit {key[1]}, but the "
                f"unit has {int(view.n[i])}; it reads the projector's tokens, at layer 0"
            )
        if keys is None:
            keys = torch.zeros(u, n, rec.keys.shape[-1], dtype=torch.float32, device=dev)
        received[i, :m], keys[i, :m] = rec.received.to(dev), rec.keys.to(dev)
    return received, keys, probe.heads
