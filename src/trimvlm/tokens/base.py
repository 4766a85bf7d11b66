"""Prefill visual-token reduction: the interface every `tokens=` method shares.

A reducer is a small dataclass registered with `@register("tokens", name)`; its fields are the recipe options.
Before decoder layer `layer` (L = 0: before the first layer) the runner's hook hands the live sequence to
`TokenReducer.reduce`, which

1. cuts the batch into one *unit* per image (several images per sample, each with its own patch grid; a sample
   without images is untouched) and pads the units to a common length N into a `VisualView`, with what the
   method declared it needs (attention, keys, the instruction: `TokenReducer`);
2. asks the method's `choose(view)` which tokens each unit keeps: exactly K = ceil(N_image * keep) per image
   (or the method's `counts`);
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
from torch.nn.utils.rnn import pad_sequence

from trimvlm.errors import RecipeError, TrimVLMError
from trimvlm.kernels import jit
from trimvlm.kernels.merge import nearest_kept
from trimvlm.kernels.select import keep_count
from trimvlm.options import check_options, is_int, option, require_bool, require_int, require_number
from trimvlm.protocol import Method
from trimvlm.runtime import vision_probe
from trimvlm.runtime.attention import AttentionProbe
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
    stage: int = 0  # which of the method's stages this is (0-based), of `stages`
    stages: int = 1
    # what the method declared it needs (`TokenReducer`'s declarations), None otherwise
    attention: torch.Tensor | None = None  # [U, N] attention each token receives: the last query's at layer L-1
    rows: torch.Tensor | None = None  # [U, (H,) r, S] layer L-1's recorded rows of the unit's sample (live keys)
    row_source: torch.Tensor | None = None  # [U, r] original position of each recorded row's query
    row_text: torch.Tensor | None = None  # [U, r] bool: the row's query is an instruction token (`instruction`)
    keys: torch.Tensor | None = None  # [U, N, H * d] key states: layer L's (`wants_keys`) or the vision tower's
    key_heads: int = 1  # heads concatenated in `keys` (the vision tower's)
    text: torch.Tensor | None = None  # [U, M, D] the instruction's hidden states entering layer L (`wants_text`)
    text_mask: torch.Tensor | None = None  # [U, M] bool, real instruction tokens of `text`
    # (keep [U, N] bool or None) -> [B, V] next-token logits of the sequence reduced to `keep` (None: as it is),
    # run through layers L.. on a scratch cache, for a method that looks ahead (its FLOPs are the method's)
    finish: object = None


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

    A method implements one hook, `choose(view) -> Selection`, and declares what its view must carry; the base
    reads the declarations (a class value, or a property where it follows an option) and does the rest:

    attention: "" (none), "llm" (the attention rows of layer L-1 the prefill records: `view.rows`, and the last
        query's row as `view.attention`; `query_rows` rows, heads averaged unless `per_head`), "vision" (the
        vision tower's attention each token receives, `view.attention`, and its keys, `view.keys`; the method
        has a `vision_layer` option) or "router" (the meta-router's score of each token, `Handoff.router`).
    wants_text: the instruction's hidden states (`view.text`); wants_keys: layer L's key states (`view.keys`).
    resizes: the method acts before the vision tower by resizing each image (`Plan.resolution`), no `choose`.
    default_layer / min_layer: the layer L when none is given, and the lowest allowed; keep_grid: the keeps the
        method accepts (None: any in (0, 1]).

    Three optional extras, for methods with more than one phase: `stages(runner)` (the layers a progressive
    method reduces before; one, L, by default), `counts(view)` (the tokens each unit keeps at a stage when not
    the shared K; also what `trimvlm tune` predicts) and `start(seq)` (called with the sequence entering the
    first layer, for state a later stage reads, kept on the method)."""

    keep: float | None = None
    prune: float | None = None
    layer: int | None = None
    merge: bool = False
    size_weighted: bool = False

    attention: ClassVar[str] = ""
    query_rows: ClassVar[int] = 1
    per_head: ClassVar[bool] = False
    wants_text: ClassVar[bool] = False
    wants_keys: ClassVar[bool] = False
    resizes: ClassVar[bool] = False
    default_layer: ClassVar[int] = 0
    min_layer: ClassVar[int] = 0
    keep_grid: ClassVar[tuple[float, ...] | None] = None

    # ---- options -------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        if (self.keep is None) == (self.prune is None):
            raise ValueError("give exactly one of keep (in (0, 1]) or prune (in [0, 1), prune = 1 - keep)")
        if self.keep is not None:
            require_number("keep", self.keep, 0, 1, above=True)
        else:
            require_number("prune", self.prune, 0, 1, below=True)
        if self.layer is not None:
            if not is_int(self.layer):
                raise ValueError(f"layer must be an integer >= {self.min_layer}, got {self.layer!r}")
            if self.layer < self.min_layer:
                raise ValueError(f"layer must be >= {self.min_layer}{self.layer_why()}, got {self.layer}")
        if self.layer not in (None, 0) and (self.resizes or self.attention == "vision"):
            why = ("the image is resized before the vision tower" if self.resizes else "it reduces the projector's "
                   "tokens before the first decoder layer, from the vision tower's attention")  # fmt: skip
            raise ValueError(f"layer must be 0 for {self.name}: {why}; got {self.layer!r}")
        for f in ("merge", "size_weighted"):  # subclasses change their defaults: checked here
            require_bool(f, getattr(self, f))
        check_options(self)

    @property
    def ratio(self) -> float:
        """The kept fraction."""
        return float(self.keep) if self.keep is not None else 1.0 - float(self.prune)

    def layer_why(self) -> str:
        return f" ({self.name} ranks by the attention of layer L-1, so L >= 1)" if self.attention == "llm" else ""

    # ---- the optional extras -------------------------------------------------------------------------
    def stages(self, runner) -> list[int]:
        """The layers this reducer acts before, on this model: L alone, unless the method is progressive."""
        if self.layer is not None:
            return [self.layer]
        return [max(self.min_layer, min(self.default_layer, runner.num_layers - 1))]

    def counts(self, view: VisualView) -> torch.Tensor:
        """[U] the tokens each unit keeps at this stage (`view.stage`): the shared K = view.k by default."""
        return view.k

    def start(self, seq: LiveSeq) -> None:
        """Called with the sequence entering the first layer, before any stage (nothing by default)."""

    def choose(self, view: VisualView) -> Selection:  # pragma: no cover - every method overrides it
        raise NotImplementedError

    # ---- what the runner and `trimvlm tune` call -----------------------------------------------------
    def at(self, runner) -> int:
        """The (first) layer L this reducer acts before, on this model."""
        return min(self.stages(runner), default=self.layer if self.layer is not None else self.min_layer)

    def kept_counts(self, n: list[int], owner: list[tuple], grids: list[tuple[int, int]]) -> list[int]:
        """Tokens each unit keeps, from its token count, owning image and grid alone (`counts` on full grids)."""
        return [int(x) for x in self.counts(grid_view(n, image_budgets(n, owner, self.ratio), grids))]

    def check(self, runner) -> None:
        """Raise RecipeError when the options or the declared needs do not fit this model."""
        n, lay = runner.num_layers, self.at(runner)
        if self.resizes and not getattr(runner.adapter, "resizes", False):
            raise RecipeError(
                f"tokens={self.name}: the {runner.adapter.family} processor gives every image the same tokens at "
                f"any size (a fixed-resolution tower), so a smaller image gives no fewer tokens; {self.name} runs on "
                "the dynamic-resolution families (qwen3_vl, qwen2_5_vl, qwen3_5); use tokens=pool here"
            )
        if self.resizes:
            return
        if not self.min_layer <= lay < n:
            raise RecipeError(f"tokens={self.name}: layer {lay} out of range; allowed {self.min_layer}..{n - 1} "
                              f"(this model has {n} decoder layers){self.layer_why()}")  # fmt: skip
        ok = [i + 1 for i in range(n - 1) if runner.is_attention(i)]  # the L whose layer L - 1 has attention
        for s in self.stages(runner) if self.attention == "llm" else ():
            if s not in ok:
                raise RecipeError(f"tokens={self.name}: layer {s} reads the attention of layer {s - 1}, which must be "
                                  f"an attention layer of this model; allowed on this model: {ok}")  # fmt: skip
        if self.wants_keys and not runner.is_attention(lay):
            raise RecipeError(
                f"tokens={self.name}: layer {lay} is a {runner.adapter.layer_types[lay]} layer without attention "
                f"keys; choose an attention layer ({[i for i in range(n) if runner.is_attention(i)]})"
            )
        if self.attention == "vision":
            vision_probe.check_layer(runner, self.vision_layer, self.name)

    def apply(self, plan, runner) -> None:
        """The method protocol: fill this axis' part of `plan` (a `runtime.plan.Plan`): the hook before each
        stage and what the prefill must record for it (or the images' resolution, for a method that resizes)."""
        self.check(runner)
        if self.resizes:
            plan.resolution = Resolution(self.ratio) if self.ratio < 1 else None
            return
        plan.hook = self.hook(runner, plan.handoff)
        wanted = self.probe(runner, plan.handoff)
        plan.probe = wanted.merge(plan.probe) if wanted is not None else plan.probe
        plan.vision_probe = self.vision_probe(runner, plan.handoff)

    def probe(self, runner, handoff):
        """The AttentionProbe the prefill must record (kept in `handoff.probes`), or None."""
        handoff.probes.pop("tokens", None)
        stages = self.stages(runner) if self.attention == "llm" and self.ratio < 1 else []
        if not stages:
            return None
        layers = {s - 1 for s in stages}
        handoff.probes["tokens"] = AttentionProbe(last=self.query_rows, layers=layers, per_head=self.per_head)
        return handoff.probes["tokens"]

    def vision_probe(self, runner, handoff):
        """What the vision tower must record while the images are encoded (kept in `handoff.vision`), or None."""
        if self.attention != "vision" or self.ratio >= 1:
            return None
        return vision_probe.request(handoff, self.vision_layer)

    def hook(self, runner, handoff):
        """The runner hook `(layer_idx, seq, runner) -> seq` that reduces before each stage (None: keep 1); what
        it finds and decides (attention rows read, rho, kept positions) goes through `handoff` (a `plan.Handoff`)."""
        stages = self.stages(runner) if self.ratio < 1 else []
        if not stages:
            return None
        index = {lay: j for j, lay in enumerate(stages)}

        def _hook(i: int, seq: LiveSeq, run) -> LiveSeq:
            if i == 0:
                self.start(seq)
            if i not in index:
                return seq
            return self.reduce(seq, run, handoff, layer=i, stage=index[i], stages=len(stages))

        return _hook

    # ---- the shared mechanics ------------------------------------------------------------------------
    @torch.no_grad()
    def reduce(self, seq: LiveSeq, runner, handoff, layer=None, stage: int = 0, stages: int = 1) -> LiveSeq:
        """Reduce `seq` before layer `layer` (None: L), stage `stage` of the method's `stages`."""
        lay = self.at(runner) if layer is None else layer
        handoff.rho = handoff.kept = None  # never leave a previous batch's results behind
        view = make_view(seq, self.ratio, lay)
        if view is None or bool((view.k == view.n).all()):
            return seq  # nothing visual, or keep everything: exactly the same sequence
        view.stage, view.stages = stage, stages
        self.read_attention(view, seq, lay, handoff)
        if self.wants_text:
            view.text, view.text_mask = instruction_features(seq, view)
        if self.wants_keys:
            view.keys = runner.layer_keys(lay, view.features)
        view.k = self.counts(view).to(view.k)
        view.finish = lambda keep=None: runner.finish(  # the logits of `seq` reduced to `keep`, from `lay` on
            seq if keep is None else seq.gather(kept_positions(seq, view, keep)), lay
        )
        sel = self.choose(view)
        if sel.rho is not None:
            handoff.rho = by_source(view, sel.rho.float(), float("nan"))
        keep = sel.keep & view.mask
        if not torch.equal(keep.sum(1), view.k):
            raise TrimVLMError(f"tokens={self.name} kept {keep.sum(1).tolist()} tokens, expected {view.k.tolist()}")
        keep_seq = kept_positions(seq, view, keep)
        out = seq.gather(keep_seq)
        handoff.kept = by_source(view, keep, False)
        if self.merge and bool((view.mask & ~keep).any()):
            assign = sel.assign if sel.assign is not None else nearest_kept(view.features, view.mask, keep)
            weight = sel.weight
            if weight is None:
                weight = view.size.float() if self.size_weighted else torch.ones_like(view.size).float()
            merge_dropped(seq, out, keep_seq, view, keep, assign, weight.to(view.mask.device))
        return out

    def read_attention(self, view: VisualView, seq: LiveSeq, lay: int, handoff) -> None:
        """Put on the view the attention the method declared (`attention`), read from what the prefill (layer
        L-1's rows, taken out of the probe so a later prefill never reads them) or the vision tower recorded."""
        if self.attention == "vision":
            view.attention, view.keys, view.key_heads = vision_probe.view_records(view, handoff, self.name)
            return
        if self.attention == "router":
            view.attention = handoff.router[view.sample[:, None], view.cols].float().masked_fill(~view.mask, 0.0)
            return
        if self.attention != "llm":
            return
        probe = handoff.probes.get("tokens")
        res = None if probe is None else probe.results.pop(lay - 1, None)
        if res is None:
            raise TrimVLMError(
                f"tokens={self.name} needs the attention of layer {lay - 1} recorded during prefill: pass "
                f"reducer.probe(runner, handoff) to the prefill (AttentionContext(probe=...)), and do not skip that layer"
            )
        if res.shape[-1] != seq.length:
            raise TrimVLMError(
                f"tokens={self.name}: attention of layer {lay - 1} covers {res.shape[-1]} keys but the live "
                f"sequence has {seq.length}; the sequence changed between layer {lay - 1} and {lay}"
            )
        r = res.shape[-2]
        view.rows = res[view.sample]
        view.row_source = seq.source[:, seq.length - r :][view.sample]
        view.row_text = instruction(seq)[:, seq.length - r :][view.sample]
        if not self.per_head:
            view.attention = res[:, -1, :][view.sample[:, None], view.cols].float().masked_fill(~view.mask, 0.0)


@dataclass
class VisionAttentionReducer(TokenReducer):
    """The shared options of the reducers that read the vision tower's attention (PruMerge, VisionZip, HoloV,
    FasterVLM, VisPruner): `vision_layer` (the vision layer read, default -2, the penultimate; negative counts
    from the end); `layer` can only be 0 (the projector's tokens). They declare `attention = "vision"`, so the base
    asks for a `VisionProbe` of their `vision_layer` and hands them its records (attention received, keys) per
    unit."""

    vision_layer: int = option(-2, require_int, hint=" (negative counts from the end)")

    attention: ClassVar[str] = "vision"


def picked(picks: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[U, N] bool: the first k[u] of each row's `picks` [U, kmax] kept (a row's later columns are not its picks)."""
    valid = torch.arange(picks.shape[1], device=picks.device)[None] < k[:, None]
    rows = torch.arange(picks.shape[0], device=picks.device)[:, None].expand_as(picks)
    keep = torch.zeros_like(mask)
    keep[rows[valid], picks[valid]] = True
    return keep & mask


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


def instruction(seq: LiveSeq) -> torch.Tensor:
    """[B, S] bool, each sample's instruction: its live text tokens after its last visual token (every family's
    template puts the question after the images; the template's closing tokens come with it), or all its text
    tokens when none follow the images."""
    text = seq.valid & ~seq.visual
    col = torch.arange(seq.length, device=text.device)
    last = torch.where(seq.visual & seq.valid, col, -1).amax(1, keepdim=True)
    after = text & (col > last)
    return torch.where(after.any(1, keepdim=True), after, text)


def instruction_features(seq: LiveSeq, view: VisualView) -> tuple[torch.Tensor, torch.Tensor]:
    """([U, M, D] hidden states, [U, M] mask) of each unit's `instruction`, zero-padded to the longest one."""
    rows = [torch.nonzero(r).flatten() for r in instruction(seq)]
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
    dev = seq.hidden.device
    cols = pad_sequence([r.cols for r in rows], batch_first=True)
    cells = pad_sequence([r.cells for r in rows], batch_first=True, padding_value=-1)
    nmax = cols.shape[1]
    mask = torch.arange(nmax, device=dev) < torch.tensor([r.cols.numel() for r in rows], device=dev)[:, None]
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


def grid_view(n: list[int], k: list[int], grids: list[tuple[int, int]]) -> VisualView:
    """A view of whole units without a sequence (what `kept_counts` hands `counts`): unit u has its n[u] tokens
    in grid order on grid grids[u] and keeps k[u]; no features."""
    u, nmax = len(n), max(n, default=1)
    cells = torch.arange(nmax).repeat(u, 1)
    mask = cells < torch.tensor(n, dtype=torch.long)[:, None]
    zero = torch.zeros(u, dtype=torch.long)
    return VisualView(
        features=torch.zeros(u, nmax, 0), mask=mask, n=mask.sum(1), k=torch.tensor(k, dtype=torch.long),
        grid=torch.tensor(grids, dtype=torch.long).view(u, 2), cells=cells.masked_fill(~mask, -1), sample=zero,
        image=zero, image_key=zero, tile=zero, cols=cells, source=cells, batch=1, size=mask.long(), layer=0,
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
        for i in [i for i in order if base[i] < n[units[i]]][: max(0, kk - sum(base))]:  # room left, in order
            base[i] += 1
        for u, k in zip(units, base, strict=True):
            out[u] = k
    return out


def _unit_features(hidden: torch.Tensor, rows: list[UnitRow], nmax: int) -> torch.Tensor:
    """[U, nmax, D] features of each unit, zero on pads: a view of `hidden` where every unit is one contiguous
    run of columns, one unit per sample at the same columns (or a lone unit); else copied."""
    spans = [(r.sample, int(r.cols[0]), r.cols.numel()) for r in rows]
    if all(int(r.cols[-1]) - int(r.cols[0]) + 1 == r.cols.numel() for r in rows):
        if len(rows) == 1 and spans[0][2] == nmax:
            b, c0, n = spans[0]
            return hidden[b : b + 1, c0 : c0 + n]
        if [b for b, _, _ in spans] == list(range(hidden.shape[0])) and len({(c, n) for _, c, n in spans}) == 1:
            c0 = spans[0][1]  # one full-length image per sample, all at the same columns: a view, no copy
            return hidden[:, c0 : c0 + nmax]
    out = hidden.new_zeros(len(rows), nmax, hidden.shape[-1])
    for i, r in enumerate(rows):
        out[i, : r.cols.numel()] = hidden[r.sample, r.cols]
    return out


class MergeRows(NamedTuple):
    """Where `merge_dropped` moves rows: flat [B * S] rows of the dropped tokens (`src_at`) and of their receivers
    in the gathered sequence (`dst_at`), each dropped token's receiver (`inv`, into `dst_at`), and the weights."""

    src_at: torch.Tensor
    dst_at: torch.Tensor
    inv: torch.Tensor
    w_drop: torch.Tensor
    w_self: torch.Tensor
    w_sum: torch.Tensor
    unit: bool  # every weight 1: plain means, no weight products


def merge_rows(seq: LiveSeq, out: LiveSeq, keep_seq: torch.Tensor, view: VisualView, keep: torch.Tensor,
               assign: torch.Tensor, weight: torch.Tensor) -> MergeRows:  # fmt: skip
    """The rows and weights of a merge (see `merge_dropped`)."""
    drop = view.mask & ~keep
    rows = view.sample[:, None].expand_as(drop)
    d_rows, d_cols = rows[drop], view.cols[drop]
    t_cols = view.cols.gather(1, assign)[drop]  # target column in the original sequence
    new_len = out.length
    cnt = keep_seq.long().cumsum(1)
    newcol = cnt - 1 + (new_len - cnt[:, -1:])  # column of every kept position after gather
    recv, inv = torch.unique(d_rows * new_len + newcol[d_rows, t_cols], return_inverse=True)
    k_rows, k_cols = rows[keep], view.cols[keep]
    w_self = torch.zeros(out.batch * new_len, dtype=weight.dtype, device=weight.device)
    w_self[k_rows * new_len + newcol[k_rows, k_cols]] = weight[keep]  # the weight of each receiving token itself
    w_self, w_drop = w_self[recv], weight[drop]
    w_sum = w_self + torch.zeros_like(w_self).index_add_(0, inv, w_drop)
    unit = bool((weight == 1).all())
    return MergeRows(d_rows * seq.length + d_cols, recv, inv, w_drop, w_self, w_sum, unit)


def merge_dropped(seq: LiveSeq, out: LiveSeq, keep_seq: torch.Tensor, view: VisualView, keep: torch.Tensor,
                  assign: torch.Tensor, weight: torch.Tensor) -> None:  # fmt: skip
    """Merge, in place in the gathered sequence `out`, every dropped token of `view` into its kept target
    `assign` (an index into the view's row): kept = (w_i x_i + sum_j w_j x_j) / (w_i + sum_j w_j) over the
    dropped tokens j assigned to it, for the hidden states and every `adds` tensor (same groups and weights);
    `out.size` grows by the sizes merged in. Tokens that receive nothing are left bit for bit as they were.
    Works on the compacted rows only (memory O(dropped * D)), no [N, D] scratch per tensor."""
    m = merge_rows(seq, out, keep_seq, view, keep, assign, weight)
    memo: dict = {}  # what the folds of one merge share: the receiver of every source row, the compiled plan
    fold(seq.hidden, out.hidden, m, memo)
    for name, ts in seq.adds.items():
        for src, dst in zip(ts, out.adds[name], strict=True):
            fold(src, dst, m, memo)
    if out.size is None:
        out.size = torch.ones(out.valid.shape, dtype=torch.long, device=out.valid.device)
    src_size = (seq.size if seq.size is not None else torch.ones_like(seq.source)).reshape(-1)
    add = torch.zeros(m.dst_at.numel(), dtype=out.size.dtype, device=out.size.device)
    add.index_add_(0, m.inv, src_size[m.src_at].to(out.size.dtype))
    out.size[m.dst_at // out.length, m.dst_at % out.length] += add


def fold(src: torch.Tensor, dst: torch.Tensor, m: MergeRows, memo: dict) -> None:
    """One tensor's merge: compiled (`kernels.fold`, same floats) on CPU float rows; else one index_add over the
    batch: the dropped rows summed into their receivers, then each receiver's own row added and the sum divided,
    in place. Unweighted float32 rows are added straight from the source through a per-row receiver map (no
    copy of the dropped rows; the same rows in the same order, so the same sums)."""
    dt = torch.promote_types(src.dtype, torch.float32)
    flat_src = src.reshape(-1, src.shape[-1])
    flat_dst = dst.view(-1, dst.shape[-1])  # the gathered tensors are fresh, contiguous ones
    if src.dtype == dt == dst.dtype and jit.compiled(src, dst, cpu=True):  # the same floats, one pass
        from trimvlm.kernels.fold import Receivers  # numba: imported on first use

        if "plan" not in memo:
            memo["plan"] = Receivers(m.dst_at, m.inv, m.src_at, m.w_drop, m.w_self, m.w_sum, weighted=not m.unit)
        return memo["plan"].fold(flat_src, flat_dst)
    n = m.dst_at.numel()
    acc = torch.zeros(n + 1, src.shape[-1], dtype=dt, device=src.device)
    if m.unit and src.dtype == dt:
        if "every" not in memo:  # per source row its receiver in `acc` (a spare row: not dropped)
            memo["every"] = torch.full((flat_src.shape[0],), n, dtype=m.inv.dtype, device=m.inv.device)
            memo["every"][m.src_at] = m.inv
        acc.index_add_(0, memo["every"], flat_src)
    else:
        moved = flat_src.index_select(0, m.src_at).to(dt)
        if not m.unit:
            moved.mul_(m.w_drop[:, None].to(dt))
        acc.index_add_(0, m.inv, moved)
    mine = flat_dst.index_select(0, m.dst_at).to(dt)
    if not m.unit:
        mine.mul_(m.w_self[:, None].to(dt))
    flat_dst.index_copy_(0, m.dst_at, mine.add_(acc[:-1]).div_(m.w_sum[:, None].to(dt)).to(dst.dtype))


@dataclass(frozen=True)
class Resolution:
    """(h, w) LLM token grid -> the grid the image is prepared at (a method that `resizes`): each side scaled by
    sqrt(keep), rounded, at least 1 (the aspect ratio kept)."""

    keep: float

    def __call__(self, h: int, w: int) -> tuple[int, int]:
        s = math.sqrt(self.keep)
        return max(1, round(h * s)), max(1, round(w * s))


def scaled_stages(first: int, depth: int, paper_layers, paper_depth: int) -> list[int]:
    """A paper's stage layers (`paper_layers` of a `paper_depth`-layer model) on a `depth`-layer model, the first
    at `first` and the gaps scaled by depth; stages past the last layer are dropped."""
    out = [first + round((p - paper_layers[0]) * depth / paper_depth) for p in paper_layers]
    return sorted({x for x in out if x < depth})

