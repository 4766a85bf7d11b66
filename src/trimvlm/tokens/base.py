"""Prefill visual-token reduction: the interface every `tokens=` method shares.

A reducer is a small dataclass registered with `@register("tokens", name)`; its fields are the recipe options.
Before decoder layer `layer` (L = 0: before the first layer) the runner's hook hands the live sequence to
`TokenReducer.reduce`, which

1. cuts the batch into one *unit* per image (several images per sample, each with its own patch grid; a sample
   without images is untouched) and pads the units to a common length N into a `VisualView`;
2. asks the method's `choose(view)` which tokens each unit keeps: exactly K = ceil(N_image * keep) per image;
3. merges, when the method asks for it, every dropped token into a kept token of the same image (by default
   the most cosine-similar kept one): kept = mean (or size-weighted mean, using `LiveSeq.size`) of itself and
   the tokens assigned to it, and `size` becomes the number of original tokens it represents;
4. physically gathers the live sequence (`LiveSeq.gather`): hidden states, all M-RoPE position axes (original
   positions kept), masks, and so the KV that layers >= L write, all shrink.

Qwen3-VL deepstack: the per-position features the adapter adds after the first layers (`seq.adds`) are sliced
by the same gather, and when tokens are merged they are merged with the same groups and weights. Because the
merge is linear, merging before a deepstack add equals adding first and merging after, so a reduction at any
layer, inside the deepstack layers or not, stays consistent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from trimvlm.errors import RecipeError, TrimVLMError
from trimvlm.kernels import jit
from trimvlm.kernels.merge import nearest_kept
from trimvlm.kernels.select import keep_count
from trimvlm.options import is_int, is_number, require_bool
from trimvlm.protocol import Method
from trimvlm.runtime.sequence import LiveSeq


@dataclass
class VisualView:
    """Every image of the batch as one row ("unit"), padded to a common length N (pads: `mask` False)."""

    features: torch.Tensor  # [U, N, D] hidden states entering layer L, grid (row-major) order, 0 on pads
    mask: torch.Tensor  # [U, N] bool, real tokens
    n: torch.Tensor  # [U] real tokens per unit
    k: torch.Tensor  # [U] tokens to keep per unit (1 <= k <= n)
    grid: torch.Tensor  # [U, 2] (h, w) of each image's patch grid in LLM tokens
    cells: torch.Tensor  # [U, N] flat grid cell r * w + c of each token (-1 on pads)
    sample: torch.Tensor  # [U] sample of the batch the unit belongs to
    image: torch.Tensor  # [U] index of the unit (image, or tile of a tiled family) within its sample
    image_key: torch.Tensor  # [U] long: content fingerprint of the unit's image (0 when unknown)
    tile: torch.Tensor  # [U] long: which tile of its image the unit is (0 for untiled families)
    cols: torch.Tensor  # [U, N] column of each token in the live sequence (0 on pads)
    source: torch.Tensor  # [U, N] index of each token in the original prefill sequence (0 on pads)
    batch: int  # samples in the batch
    size: torch.Tensor  # [U, N] original tokens each live token already represents (1 if none merged)
    layer: int
    attention: torch.Tensor | None = None  # [U, N] attention from the last query at layer L-1, when asked
    keys: torch.Tensor | None = None  # [U, N, Hk * hd] layer L's key states, for methods that ask (`prepare`)
    text: torch.Tensor | None = None  # [U, M, D] the instruction's hidden states entering layer L (`wants_text`)
    text_mask: torch.Tensor | None = None  # [U, M] bool, real instruction tokens of `text`


class UnitRow(NamedTuple):
    """One image (or tile) of the batch as `make_view` collects it: its sample, its index in the sample, its
    grid, and its tokens' live columns and grid cells in grid (row-major) order."""

    sample: int
    image: int
    h: int
    w: int
    cols: torch.Tensor  # [n] long
    cells: torch.Tensor  # [n] long


@dataclass
class Selection:
    """What a method decides for each unit of a `VisualView`."""

    keep: torch.Tensor  # [U, N] bool, exactly view.k True per unit, only on real tokens
    assign: torch.Tensor | None = None  # [U, N] long: the kept token each token merges into (None: nearest)
    weight: torch.Tensor | None = None  # [U, N] merge weights (None: 1, or `size` when size-weighted)
    rho: torch.Tensor | None = None  # [U, N] spatial density the method computed, handed to the KV phase


@dataclass
class TokenReducer(Method):
    """Base of every prefill visual-token reducer. Options shared by all methods:

    keep: fraction of each image's visual tokens kept, in (0, 1]; or `prune` = 1 - keep, in [0, 1). Exactly
        one of the two. K = ceil(N * keep) per image.
    layer: decoder layer L before which tokens are reduced, 0..num_layers-1 (None: the method's default,
        clamped to the model's depth).
    merge: merge dropped tokens into the most similar kept token instead of discarding them.
    size_weighted: merged value = size-weighted mean (sizes from earlier merges) instead of the plain mean.
    """

    keep: float | None = None
    prune: float | None = None
    layer: int | None = None
    merge: bool = False
    size_weighted: bool = False

    # what `trimvlm tune` may know before running: whether the kept counts follow from the shapes
    # (`predictable`, `Method`'s: `kept_counts`), and the keeps the method accepts (None: any in (0, 1])
    keep_grid: ClassVar[tuple[float, ...] | None] = None
    wants_text: ClassVar[bool] = False  # fill view.text with the instruction's hidden states (text-guided methods)
    default_layer: ClassVar[int] = 0
    min_layer: ClassVar[int] = 0

    # ---- options -------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        if (self.keep is None) == (self.prune is None):
            raise ValueError("give exactly one of keep (in (0, 1]) or prune (in [0, 1), prune = 1 - keep)")
        if self.keep is not None:
            _number("keep", self.keep)
            if not 0 < self.keep <= 1:
                raise ValueError(f"keep must be in (0, 1], got {self.keep}")
        else:
            _number("prune", self.prune)
            if not 0 <= self.prune < 1:
                raise ValueError(f"prune must be in [0, 1), got {self.prune}")
        if self.layer is not None:
            if not is_int(self.layer):
                raise ValueError(f"layer must be an integer >= {self.min_layer}, got {self.layer!r}")
            if self.layer < self.min_layer:
                raise ValueError(f"layer must be >= {self.min_layer}{self.layer_why()}, got {self.layer}")
        for f in ("merge", "size_weighted"):
            require_bool(f, getattr(self, f))

    @property
    def ratio(self) -> float:
        """The kept fraction."""
        return float(self.keep) if self.keep is not None else 1.0 - float(self.prune)

    def kept_counts(self, n: list[int], owner: list[tuple], grids: list[tuple[int, int]]) -> list[int]:
        """Tokens each unit keeps, from its token count, owning image and grid alone (the shared rule)."""
        return image_budgets(n, owner, self.ratio)

    def layer_why(self) -> str:
        return ""

    def at(self, runner) -> int:
        """The layer L this reducer acts before, on this model."""
        if self.layer is not None:
            return self.layer
        return max(self.min_layer, min(self.default_layer, runner.num_layers - 1))

    def check(self, runner) -> None:
        """Raise RecipeError when the options do not fit this model."""
        n = runner.num_layers
        lay = self.at(runner)
        if not self.min_layer <= lay < n:
            raise RecipeError(
                f"tokens={self.name}: layer {lay} out of range; allowed {self.min_layer}..{n - 1} "
                f"(this model has {n} decoder layers){self.layer_why()}"
            )
        if self.wants_attention(runner) and not runner.is_attention(lay - 1):
            ok = after_attention_layers(runner)
            raise RecipeError(
                f"tokens={self.name}: layer {lay} reads the attention of layer {lay - 1}, which is a "
                f"{runner.adapter.layer_types[lay - 1]} layer without attention weights; allowed layers on this "
                f"model: {ok}"
            )

    # ---- what the runner calls -----------------------------------------------------------------------
    def apply(self, plan, runner) -> None:
        """The method protocol: fill this axis' part of `plan` (a `runtime.plan.Plan`): the hook before layer
        L and what the prefill must record for it."""
        self.check(runner)
        plan.hook = self.hook(runner, plan.handoff)
        wanted = self.probe(runner, plan.handoff)
        plan.probe = wanted.merge(plan.probe) if wanted is not None else plan.probe
        plan.vision_probe = self.vision_probe(runner, plan.handoff)

    def probe(self, runner, handoff):
        """The AttentionProbe the prefill must record for this method (kept in `handoff.probes`), or None."""
        return None

    def vision_probe(self, runner, handoff):
        """What the vision tower must record while the images are encoded (kept in `handoff.vision`), or
        None: for methods that read the vision tower's attention (PruMerge, VisionZip)."""
        return None

    def hook(self, runner, handoff):
        """The runner hook `(layer_idx, seq, runner) -> seq` that reduces before layer L; what it finds and
        decides (attention rows read, rho, kept positions) goes through `handoff` (a `plan.Handoff`)."""
        lay = self.at(runner)

        def _hook(i: int, seq: LiveSeq, run) -> LiveSeq:
            return self.reduce(seq, run, handoff) if i == lay else seq

        return _hook

    def prepare(self, view: VisualView, runner, handoff) -> None:
        """Add what `choose` needs from the model or an earlier phase to the view (e.g. `view.keys`); nothing by
        default."""

    def refine(self, view: VisualView, seq: LiveSeq, runner, sel: Selection) -> Selection:
        """A last look at the selection with the model at hand (noise-perturbed FastV searches here); as is by
        default."""
        return sel

    def choose(self, view: VisualView) -> Selection:  # pragma: no cover - every method overrides it
        raise NotImplementedError

    def wants_attention(self, runner) -> bool:
        return False

    # ---- the shared mechanics ------------------------------------------------------------------------
    @torch.no_grad()
    def reduce(self, seq: LiveSeq, runner, handoff, layer: int | None = None) -> LiveSeq:
        """Reduce `seq` before layer `layer` (None: the method's layer L; a progressive method reduces at
        several layers, each one call)."""
        lay = self.at(runner) if layer is None else layer
        handoff.rho = handoff.kept = None  # never leave a previous batch's results behind
        view = make_view(seq, self.ratio, lay)
        if view is None or bool((view.k == view.n).all()):
            return seq  # nothing visual, or keep everything: exactly the same sequence
        if self.wants_attention(runner):
            view.attention = self.read_attention(view, seq, lay, handoff)
        if self.wants_text:
            view.text, view.text_mask = instruction_features(seq, view)
        self.prepare(view, runner, handoff)
        sel = self.refine(view, seq, runner, self.choose(view))
        if sel.rho is not None:
            handoff.rho = by_source(view, sel.rho.float(), float("nan"))
        keep = sel.keep & view.mask
        if not torch.equal(keep.sum(1), view.k):
            raise TrimVLMError(
                f"tokens={self.name} kept {keep.sum(1).tolist()} tokens, expected {view.k.tolist()}"
            )
        drop = view.mask & ~keep
        keep_seq = kept_positions(seq, view, keep)
        out = seq.gather(keep_seq)
        handoff.kept = by_source(view, keep, False)
        if self.merge and bool(drop.any()):
            assign = sel.assign
            if assign is None:
                assign = nearest_kept(view.features, view.mask, keep)
            weight = sel.weight
            if weight is None:
                weight = view.size.float() if self.size_weighted else torch.ones_like(view.size).float()
            merge_dropped(seq, out, keep_seq, view, keep, assign, weight.to(view.mask.device))
        return out

    def read_attention(self, view: VisualView, seq: LiveSeq, lay: int, handoff) -> torch.Tensor:
        """[U, N] the scores `choose` reads as `view.attention` (methods whose `wants_attention` is true): by
        default the last query's row of layer L-1 that `last_query_probe` recorded, heads averaged; a method
        that reads other rows (SparseVLM's raters) or the vision tower (`vision_base`) overrides it."""
        probe = handoff.probes.get("tokens")
        # taken out of the probe, so a later prefill can never read this one's row
        res = None if probe is None else probe.results.pop(lay - 1, None)
        if res is None:
            raise TrimVLMError(
                f"tokens={self.name} needs the attention of layer {lay - 1} recorded during prefill: pass "
                f"reducer.probe(runner, handoff) to the prefill (AttentionContext(probe=...)), and do not skip that layer"
            )
        att = res[:, -1, :]  # [B, K] the last query row, heads averaged
        if att.shape[1] != seq.length:
            raise TrimVLMError(
                f"tokens={self.name}: attention of layer {lay - 1} covers {att.shape[1]} keys but the live "
                f"sequence has {seq.length}; the sequence changed between layer {lay - 1} and {lay}"
            )
        out = att[view.sample[:, None], view.cols].float()
        return out.masked_fill(~view.mask, 0.0)

    def last_query_probe(self, runner, handoff):
        """AttentionProbe(last=1, layers={L-1}), kept in the handoff so the hook reads what it recorded (None at
        keep = 1: nothing is reduced, so nothing is recorded)."""
        from trimvlm.runtime.attention import AttentionProbe

        if self.ratio >= 1:
            return None
        handoff.probes["tokens"] = AttentionProbe(last=1, layers={self.at(runner) - 1})
        return handoff.probes["tokens"]


def _number(name: str, v) -> None:
    if not is_number(v) or not math.isfinite(v):
        raise ValueError(f"{name} must be a number, got {v!r}")


def kept_positions(seq: LiveSeq, view: VisualView, keep: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: the live positions left when each unit keeps `keep` [U, N] of its visual tokens."""
    drop = view.mask & ~keep
    out = seq.valid.clone()
    out[view.sample[:, None].expand_as(drop)[drop], view.cols[drop]] = False
    return out


def by_source(view: VisualView, values: torch.Tensor, fill) -> torch.Tensor:
    """[B, S] per original prefill position (S = last visual source + 1) from per-unit [U, N] values."""
    s0 = int(view.source.max()) + 1
    out = torch.full((view.batch, s0), fill, dtype=values.dtype, device=values.device)
    rows = view.sample[:, None].expand_as(view.mask)[view.mask]
    out[rows, view.source[view.mask]] = values[view.mask]
    return out


def instruction_features(seq: LiveSeq, view: VisualView) -> tuple[torch.Tensor, torch.Tensor]:
    """([U, M, D] hidden states, [U, M] mask) of each unit's instruction: the live text tokens of its sample
    after the sample's last visual token (every family's template puts the question after the images; the
    template's closing tokens come with it), or all its text tokens when none follow the images. Zero-padded
    to the longest instruction of the batch."""
    text = seq.valid & ~seq.visual
    rows = []
    for b in range(seq.batch):
        vis = torch.nonzero(seq.visual[b] & seq.valid[b]).flatten()
        cols = torch.nonzero(text[b]).flatten()
        after = cols[cols > vis[-1]] if vis.numel() else cols
        rows.append(after if after.numel() else cols)
    m = max(1, max(r.numel() for r in rows))
    out = seq.hidden.new_zeros(seq.batch, m, seq.hidden.shape[-1])
    mask = torch.zeros(seq.batch, m, dtype=torch.bool, device=seq.hidden.device)
    for b, c in enumerate(rows):
        out[b, : c.numel()] = seq.hidden[b, c]
        mask[b, : c.numel()] = True
    return out[view.sample], mask[view.sample]


# ---- view ------------------------------------------------------------------------------------------------
def make_view(seq: LiveSeq, keep: float, layer: int) -> VisualView | None:
    """Pad every image of the batch into one row; None when the batch has no visual tokens."""
    rows: list[UnitRow] = []
    for b in range(seq.batch):
        grids = seq.grids[b] if b < len(seq.grids) else []
        for j, (h, w) in enumerate(grids):
            cols = torch.nonzero(seq.visual[b] & (seq.image_id[b] == j)).flatten()
            if cols.numel() == 0:
                continue
            cells = seq.source[b, cols] - int(seq.image_start[b][j])
            order = torch.argsort(cells, stable=True)
            rows.append(UnitRow(b, j, h, w, cols[order], cells[order]))
    if not rows:
        return None
    u, nmax = len(rows), max(r.cols.numel() for r in rows)
    dev = seq.hidden.device
    cols = torch.zeros(u, nmax, dtype=torch.long, device=dev)
    cells = torch.full((u, nmax), -1, dtype=torch.long, device=dev)
    mask = torch.zeros(u, nmax, dtype=torch.bool, device=dev)
    for i, r in enumerate(rows):
        cols[i, : r.cols.numel()] = r.cols
        cells[i, : r.cols.numel()] = r.cells
        mask[i, : r.cols.numel()] = True
    sample = torch.tensor([r.sample for r in rows], dtype=torch.long, device=dev)
    n = mask.sum(1)
    owner = [_image_of(seq, r.sample, r.image) for r in rows]
    k = torch.tensor(image_budgets([int(x) for x in n.tolist()], owner, keep), dtype=torch.long, device=dev)
    keys = [seq.image_keys[b][i] if b < len(seq.image_keys) and i < len(seq.image_keys[b]) else 0
            for b, i in owner]  # fmt: skip
    feats = _unit_features(seq.hidden, rows, nmax)
    size = seq.size if seq.size is not None else torch.ones(seq.valid.shape, dtype=torch.long, device=dev)
    return VisualView(
        features=feats,
        mask=mask,
        n=n,
        k=k,
        grid=torch.tensor([[r.h, r.w] for r in rows], dtype=torch.long, device=dev),
        cells=cells,
        sample=sample,
        image=torch.tensor([r.image for r in rows], dtype=torch.long, device=dev),
        image_key=torch.tensor(keys, dtype=torch.long, device=dev),
        tile=torch.tensor([owner[:u].count(o) for u, o in enumerate(owner)], dtype=torch.long, device=dev),
        cols=cols,
        source=seq.source[sample[:, None], cols].masked_fill(~mask, 0),
        batch=seq.batch,
        size=size[sample[:, None], cols].masked_fill(~mask, 0),
        layer=layer,
    )


def _image_of(seq: LiveSeq, b: int, j: int) -> tuple[int, int]:
    """(sample, image) that unit j of sample b belongs to (a tile's image in tiled families)."""
    tiles = seq.tile_image[b] if b < len(seq.tile_image) else []
    return b, (tiles[j] if j < len(tiles) else j)


def image_budgets(n: list[int], owner: list[tuple[int, int]], keep: float) -> list[int]:
    """Tokens each unit keeps: every image keeps K = ceil(N_image * keep) of its N_image tokens, however many
    tiles it spans. K is split over the image's tiles in proportion to their token counts (largest remainder,
    ties to the earlier tile), at least one per tile. One unit per image: simply ceil(N * keep)."""
    out = [0] * len(n)
    groups: dict[tuple[int, int], list[int]] = {}
    for u, o in enumerate(owner):
        groups.setdefault(o, []).append(u)
    for units in groups.values():
        total = sum(n[u] for u in units)
        kk = keep_count(total, keep, minimum=1)
        exact = [kk * n[u] / total for u in units]
        base = [max(1, min(n[u], math.floor(e))) for u, e in zip(units, exact, strict=True)]
        order = sorted(range(len(units)), key=lambda i: (-(exact[i] - math.floor(exact[i])), i))
        left = kk - sum(base)
        for i in order:
            if left <= 0:
                break
            if base[i] < n[units[i]]:
                base[i] += 1
                left -= 1
        for u, k in zip(units, base, strict=True):
            out[u] = k
    return out


def _unit_features(hidden: torch.Tensor, rows: list[UnitRow], nmax: int) -> torch.Tensor:
    """[U, nmax, D] features of each unit, zero on pads. An image's tokens are one contiguous run of columns
    in practice: then slices are copied (one unit per sample, all at the same columns, is returned as a view);
    otherwise advanced indexing."""
    spans = [(r.sample, int(r.cols[0]), r.cols.numel()) for r in rows]
    if all(int(r.cols[-1]) - int(r.cols[0]) + 1 == r.cols.numel() for r in rows):
        if len(rows) == 1 and spans[0][2] == nmax:
            b, c0, n = spans[0]
            return hidden[b : b + 1, c0 : c0 + n]
        if [b for b, _, _ in spans] == list(range(hidden.shape[0])) and len({(c, n) for _, c, n in spans}) == 1:
            c0 = spans[0][1]  # one full-length image per sample, all at the same columns: a view, no copy
            return hidden[:, c0 : c0 + nmax]
        out = hidden.new_zeros(len(rows), nmax, hidden.shape[-1])
        for i, (b, c0, n) in enumerate(spans):
            out[i, :n] = hidden[b, c0 : c0 + n]
        return out
    out = hidden.new_zeros(len(rows), nmax, hidden.shape[-1])
    for i, r in enumerate(rows):
        out[i, : r.cols.numel()] = hidden[r.sample, r.cols]
    return out


def merge_dropped(
    seq: LiveSeq,
    out: LiveSeq,
    keep_seq: torch.Tensor,
    view: VisualView,
    keep: torch.Tensor,
    assign: torch.Tensor,
    weight: torch.Tensor,
) -> None:
    """Merge, in place in the gathered sequence `out`, every dropped token of `view` into its kept target
    `assign` (an index into the view's row): kept = (w_i x_i + sum_j w_j x_j) / (w_i + sum_j w_j) over the
    dropped tokens j assigned to it, for the hidden states and every `adds` tensor (same groups and weights);
    `out.size` grows by the sizes merged in. Tokens that receive nothing are left bit for bit as they were.
    Works on the compacted rows only (memory O(dropped * D)), no [N, D] scratch per tensor."""
    drop = view.mask & ~keep
    rows = view.sample[:, None].expand_as(drop)
    d_rows, d_cols = rows[drop], view.cols[drop]
    t_cols = view.cols.gather(1, assign)[drop]  # target column in the original sequence
    new_len = out.length
    cnt = keep_seq.long().cumsum(1)
    newcol = cnt - 1 + (new_len - cnt[:, -1:])  # column of every kept position after gather
    flat_t = d_rows * new_len + newcol[d_rows, t_cols]
    recv, inv = torch.unique(flat_t, return_inverse=True)
    r_rows, r_cols = recv // new_len, recv % new_len
    # the weight of each receiving kept token itself
    k_rows, k_cols = rows[keep], view.cols[keep]
    w_self = torch.zeros(out.batch * new_len, dtype=weight.dtype, device=weight.device)
    w_self[k_rows * new_len + newcol[k_rows, k_cols]] = weight[keep]
    w_self = w_self[recv]
    w_drop = weight[drop]
    w_sum = w_self + torch.zeros_like(w_self).index_add_(0, inv, w_drop)

    unit = bool((weight == 1).all())  # plain means: no weight products
    src_at = d_rows * seq.length + d_cols  # flat [B * S] row of every dropped token
    dst_at = r_rows * new_len + r_cols  # flat [B * S'] row of every receiving kept token
    w_drop_c, w_self_c, w_sum_c = w_drop[:, None], w_self[:, None], w_sum[:, None]

    every = plan = None  # per source row [B * S] its receiver in `acc` (a spare row: not dropped); `Receivers`

    def fold(src: torch.Tensor, dst: torch.Tensor) -> None:
        """Compiled (`kernels.fold`, same floats) on CPU float rows; else one index_add over the batch: the dropped
        rows summed into their receivers, then each receiver's own row added and the sum divided, in place.
        Unweighted float32 rows are added straight from the source through `every` (no copy of the dropped rows;
        the same rows in the same order, so the same sums); fresh scratch pages cost more than the adds."""
        nonlocal every, plan
        dt = torch.promote_types(src.dtype, torch.float32)
        flat_src = src.reshape(-1, src.shape[-1])
        flat_dst = dst.view(-1, dst.shape[-1])  # the gathered tensors are fresh, contiguous ones
        if src.dtype == dt == dst.dtype and jit.compiled(src, dst, cpu=True):  # the same floats, one pass
            from trimvlm.kernels.fold import Receivers  # numba: imported on first use

            plan = plan or Receivers(dst_at, inv, src_at, w_drop, w_self, w_sum, weighted=not unit)  # once a merge
            return plan.fold(flat_src, flat_dst)
        acc = torch.zeros(recv.numel() + 1, src.shape[-1], dtype=dt, device=src.device)
        if unit and src.dtype == dt:
            if every is None:
                every = torch.full((flat_src.shape[0],), recv.numel(), dtype=inv.dtype, device=inv.device)
                every[src_at] = inv
            acc.index_add_(0, every, flat_src)
        else:
            moved = flat_src.index_select(0, src_at).to(dt)
            if not unit:
                moved.mul_(w_drop_c.to(dt))
            acc.index_add_(0, inv, moved)
        acc = acc[:-1]
        mine = flat_dst.index_select(0, dst_at).to(dt)
        if not unit:
            mine.mul_(w_self_c.to(dt))
        flat_dst.index_copy_(0, dst_at, mine.add_(acc).div_(w_sum_c.to(dt)).to(dst.dtype))

    fold(seq.hidden, out.hidden)
    for name, ts in seq.adds.items():
        for src, dst in zip(ts, out.adds[name], strict=True):
            fold(src, dst)
    if out.size is None:
        out.size = torch.ones(out.valid.shape, dtype=torch.long, device=out.valid.device)
    src_size = seq.size if seq.size is not None else torch.ones_like(seq.source)
    add = torch.zeros(recv.numel(), dtype=out.size.dtype, device=out.size.device)
    add.index_add_(0, inv, src_size[d_rows, d_cols].to(out.size.dtype))
    out.size[r_rows, r_cols] += add


def scaled_stages(first: int, depth: int, paper_layers, paper_depth: int) -> list[int]:
    """A paper's stage layers (`paper_layers` of a `paper_depth`-layer model) on a `depth`-layer model, the first
    at `first` and the gaps scaled by depth; stages past the last layer are dropped."""
    out = [first + round((p - paper_layers[0]) * depth / paper_depth) for p in paper_layers]
    return sorted({x for x in out if x < depth})


def after_attention_layers(runner) -> list[int]:
    """The layers L (1 <= L < depth) whose layer L - 1 has attention weights: where a stage ranked by the
    attention of the layer before it can run."""
    return [i + 1 for i in range(runner.num_layers - 1) if runner.is_attention(i)]
