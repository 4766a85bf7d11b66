"""Decode-phase visual-KV eviction: one interface for every policy.

One shot at the prefill/decode boundary, in every attention layer that holds a cache, per sample:

    N_post = the sample's visual entries in that layer (after any prefill reduction)
    k      = ceil(N_post * keep)          (keep = 0, "Dall", drops every visual entry)
    keep the k visual entries with the highest `scores`; text entries are never evicted.

Evicted entries are physically freed (`KVCache.gather`: the tensors shrink to the longest kept row of the
batch). Surviving keys keep the RoPE rotation they were written with, and decoding goes on at the true position
counter (`PrefillOutput.next_pos`), so an eviction is exactly "these keys are masked out" for every later token.
Recurrent (Gated DeltaNet) states hold no per-token entries and are left untouched.

A policy is a small dataclass that implements one hook, `scores(view) -> [B, K]` (higher = keep; only the
visual, valid entries are compared), and, if it scores by attention, declares the prefill attention rows it
reads (`rows_wanted`, `per_head`) or the column sums over every prefill query (`colsum`). Two optional extras:
`layer_weights` (a policy that splits one total over the layers instead of ceil(N_post * keep) in each; the
total per sample stays the same, so every policy is compared at equal KV entries) and `compensate` (a policy
that folds the evicted entries into the kept ones before they are freed, e.g. LOOK-M's merge). Ties are broken by cache order
(earlier entry first), so a sample's selection does not depend on its batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from trimvlm.errors import TrimVLMError
from trimvlm.kernels.budget import split_budget
from trimvlm.kernels.select import keep_count, topk_mask
from trimvlm.options import check_options, option, require_int, require_number
from trimvlm.protocol import Method
from trimvlm.runtime.attention import AttentionProbe
from trimvlm.runtime.cache import KVCache, LayerKV


@dataclass
class LayerView:
    """What a policy sees of one attention layer at the prefill/decode boundary."""

    layer: int
    entry: LayerKV  # the layer's cache entries: key/value [B, Hk, K, hd], valid/visual/source [B, K]
    candidates: torch.Tensor  # [B, K] bool: visual & valid, the only entries that may be evicted
    budget: torch.Tensor  # [B] long: visual entries kept per sample, ceil(N_post * keep)
    prefill: object  # the PrefillOutput (seq: grids, image starts; next_pos; logits)
    attention: torch.Tensor | None = None  # [B, n, K] (or [B, H, n, K]) prefill attention rows, if asked
    row_valid: torch.Tensor | None = None  # [B, n]: which of those rows are real tokens
    handoff: object | None = None  # the plan's Handoff: what the prefill reducer left (rho, kept positions)


@dataclass
class KVPolicy(Method):
    """Base of every KV policy. Options: `keep` in [0, 1] (fraction of each layer's visual entries kept;
    0 = drop all visual KV, 1 = exact no-op) and `seed` (for policies with a random choice)."""

    keep: float = 0.25
    seed: int = option(0, require_int)

    # what a policy declares it needs (a class value, or a property where it follows an option)
    rows_option: ClassVar[str] = ""  # the option whose value is `rows_wanted` (unset or None: 0)
    per_head: ClassVar[bool] = False  # those rows per head ([B, H, n, K]) instead of heads averaged
    # score with the attention every key received from *all* prefill queries (summed over queries and heads,
    # `AttentionProbe(colsum=True)`) instead of the last `rows_wanted` rows
    colsum: ClassVar[bool] = False

    def __post_init__(self):
        require_number("keep", self.keep, 0, 1, hint=" (0 drops every visual entry)")
        self.keep = float(self.keep)
        check_options(self)

    @property
    def rows_wanted(self) -> int:
        """Prefill attention rows (the last query tokens) it scores with; 0 = none."""
        return getattr(self, self.rows_option, None) or 0

    @property
    def predictable(self) -> bool:
        """Whether the boundary KV bytes follow from the shapes (`trimvlm tune`): not with a `budgets` split
        over the layers other than `uniform` (it follows the attention and is measured)."""
        return getattr(self, "budgets", "uniform") == "uniform"

    # ---- what a policy implements ----
    def scores(self, view: LayerView) -> torch.Tensor:
        """[B, K] score per entry; higher = kept. Only `view.candidates` entries are compared."""
        raise NotImplementedError

    def layer_weights(self, views: dict[int, LayerView]) -> dict[int, torch.Tensor] | None:
        """[B] weight per attention layer for splitting each sample's total visual budget over the layers
        (`split_budget`); None (the default, and a `budgets=uniform` option) keeps ceil(N_post * keep) in each."""
        return None

    def compensate(self, cache: KVCache, masks: dict[int, torch.Tensor]) -> None:
        """Called between the selection and the eviction: may rewrite the kept entries (never their
        positions); the default does nothing."""
        return None

    # ---- the plan's side ----
    @property
    def is_noop(self) -> bool:
        return self.keep >= 1.0

    def probe(self, runner, handoff) -> AttentionProbe | None:
        """The attention probe the prefill must record for this policy (kept in `handoff.probes`), or None."""
        handoff.probes.pop("kv", None)
        if self.is_noop or self.keep == 0 or (self.rows_wanted <= 0 and not self.colsum):
            return None
        if self.colsum:
            handoff.probes["kv"] = AttentionProbe(colsum=True)
        else:
            handoff.probes["kv"] = AttentionProbe(last=self.rows_wanted, layers=None, per_head=self.per_head)
        return handoff.probes["kv"]

    def apply(self, plan, runner) -> None:
        """The method protocol: the KV step at the prefill/decode boundary, and the attention rows it reads."""
        plan.after_prefill = self.bind(runner, plan.handoff)
        wanted = self.probe(runner, plan.handoff)
        plan.probe = wanted.merge(plan.probe) if wanted is not None else plan.probe

    def bind(self, runner, handoff):
        """The after-prefill step: decide and evict, in place on `PrefillOutput.cache`."""
        if self.is_noop:
            return lambda out: None  # keep = 1: nothing to evict

        def after_prefill(out) -> None:
            masks = self.select(out, handoff)
            self.compensate(out.cache, masks)
            self.evict(out.cache, masks)

        return after_prefill

    # ---- the mechanics ----
    def select(self, out, handoff) -> dict[int, torch.Tensor]:
        """layer -> keep mask [B, K] over that layer's cache entries (True = keep; text always True)."""
        masks, views = {}, {}
        for i in sorted(out.cache.layers):
            entry = out.cache.layers[i]
            cand = entry.visual & entry.valid
            budget = keep_count(cand.sum(1), self.keep)
            if self.is_noop or self.keep == 0:  # every visual entry kept, or none
                masks[i] = entry.valid & (~entry.visual | (cand & self.is_noop))
            else:
                view = LayerView(i, entry, cand, budget, out, handoff=handoff)
                if self.rows_wanted > 0 or self.colsum:
                    view.attention, view.row_valid = self._attention_rows(i, entry, handoff)
                views[i] = view
        uniform = getattr(self, "budgets", None) == "uniform"  # a `budgets` option's ablation: no split
        weights = self.layer_weights(views) if views and not uniform else None
        if weights is not None:
            order = sorted(views)
            split = split_budget(
                torch.stack([weights[i].double().cpu() for i in order], 1),
                torch.stack([views[i].candidates.sum(1).cpu() for i in order], 1),
                sum(views[i].budget.cpu() for i in order),
            )
            for c, i in enumerate(order):
                views[i].budget = split[:, c].to(views[i].budget.device)
        for i, view in views.items():
            chosen = topk_mask(self.scores(view), view.budget, view.candidates)
            masks[i] = view.entry.valid & (~view.entry.visual | chosen)
        return dict(sorted(masks.items()))

    def _attention_rows(self, layer: int, entry: LayerKV, handoff):
        probe = handoff.probes.get("kv")
        if probe is None or layer not in probe.results:
            raise TrimVLMError(
                f"kv={self.name} scores by prefill attention, but none was recorded for layer {layer}: pass "
                "`probe=policy.probe(runner, handoff)` (or the plan's probe) to the prefill"
            )
        att = probe.results[layer]
        if att.shape[-1] != entry.key.shape[2]:
            what = "column sums" if self.colsum else "attention"
            raise TrimVLMError(
                f"recorded {what} of layer {layer} covers {att.shape[-1]} keys but the cache holds "
                f"{entry.key.shape[2]}: the probe is from another prefill"
            )
        if self.colsum:
            return att, None  # [B, K] column sums: no rows
        rv = probe.row_valid.get(layer)
        if rv is None:
            rv = torch.ones(att.shape[0], att.shape[-2], dtype=torch.bool, device=att.device)
        return att, rv

    @staticmethod
    def evict(cache: KVCache, masks: dict[int, torch.Tensor]) -> None:
        """Physically keep only the masked entries in each layer; layers left with equal metadata share it
        again (so the decode builds one attention mask for them)."""
        for i, keep in masks.items():
            cache.gather(i, keep)
        shared: list[LayerKV] = []
        for e in (cache.layers[i] for i in masks):
            same = (s for s in shared if s.valid.shape == e.valid.shape
                    and all(torch.equal(getattr(s, f), getattr(e, f)) for f in ("valid", "source", "visual")))  # fmt: skip
            s = next(same, None)
            if s is None:
                shared.append(e)
            else:
                e.valid, e.visual, e.source = s.valid, s.visual, s.source


def mask_out(cache: KVCache, masks: dict[int, torch.Tensor]) -> None:
    """The reference for an eviction: mark the evicted entries invalid instead of removing them (new tensors,
    since layers may share their metadata)."""
    for i, keep in masks.items():
        e = cache.layers[i]
        e.valid = e.valid & keep
        e.visual = e.visual & keep


def order_in_span(cand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index from the start, index from the end) of each candidate among its row's candidates (0-based)."""
    c = cand.long()
    from_start = c.cumsum(1) - 1
    from_end = c.flip(1).cumsum(1).flip(1) - 1
    return from_start, from_end


def heavy_and_recent(heavy: torch.Tensor, view: LayerView, recent: float) -> torch.Tensor:
    """[B, K] ranking score: the most recent floor(budget * recent) visual entries of each sample above every
    other entry, the rest by `heavy` (H2O's heavy hitters + recent window, on the visual span)."""
    _, from_end = order_in_span(view.candidates)
    n_recent = torch.floor(view.budget.double() * recent + 1e-9).long()
    is_recent = view.candidates & (from_end < n_recent.to(from_end.device)[:, None])
    return heavy + is_recent.float() * (float(heavy.amax()) + 1.0)


def post_vision_rows(view: LayerView) -> torch.Tensor:
    """[B, n] bool: which of the recorded attention rows (the last n queries of the prefill, i.e. cache columns
    K - n .. K - 1 of this layer) are real text queries after the sample's last visual entry (VL-Cache's
    "post-vision" queries: the instruction that reads the image)."""
    e = view.entry
    n, k = view.attention.shape[-2], e.valid.shape[1]
    cols = torch.arange(k - n, k, device=e.valid.device)
    col = torch.arange(k, device=e.valid.device).expand_as(e.valid)
    last_vis = torch.where(e.visual & e.valid, col, torch.full_like(col, -1)).amax(1)  # [B]; -1: none
    rows = e.valid[:, k - n :] & ~e.visual[:, k - n :] & (cols[None] > last_vis[:, None])
    if view.row_valid is not None:
        rows &= view.row_valid.to(rows.device)
    return rows


def observed_rows(view: LayerView) -> torch.Tensor:
    """[B, n] bool: the post-vision rows (`post_vision_rows`), every recorded row for a sample that has none."""
    post = post_vision_rows(view)
    rv = view.row_valid.to(post.device) if view.row_valid is not None else torch.ones_like(post)
    return torch.where(post.any(1, keepdim=True), post, rv)

