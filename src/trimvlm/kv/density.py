"""TwinPrune decode phase: keep the top-k visual KV entries by spatial density rho (TwinPrune, section 4.3).

    rho_ij = 1 - (1/|N_w(i,j)|) * sum_{(i',j') in N_w(i,j)} cos(x_ij, x_i'j')      (trimvlm.tokens.density)

Where rho comes from:
1. Reused from prefill (`reuse=true`, the default) when the same recipe prunes tokens with density: the token
   reducer leaves `Handoff.rho` on the plan, a [B, S] tensor over the original prefill positions (column j = rho of
   the token whose `source` is j; NaN where it has none; S may stop after the last visual token), computed on
   the hidden states entering its layer L before it selects, and every layer ranks its visual entries by it:
   no extra similarity computation, and one ranking for both phases as in the paper. (A rho that does not
   cover every surviving visual entry, e.g. left by another batch, is not used.)
2. Otherwise computed here, per attention layer, from that layer's cached **values** (all KV heads
   concatenated). A value is a linear image of the layer's normed input hidden state (v = W_v RMSNorm(h)), the
   features the layer's attention actually aggregates, and unlike the keys it carries no RoPE rotation: cosines
   between keys of grid neighbours mix in a position-dependent rotation (M-RoPE rotates each neighbour by a
   different angle), which is not a property of the content. `features=keys` is offered for comparison.
   The grid of each image comes from the prefill sequence (`grids`, `image_start`); when a prefill reducer
   without rho removed some tokens, a token's neighbourhood is the surviving tokens of its window (a
   neighbourless token gets rho = 1). Cost per layer O(N w^2 d), one vectorised call for the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from trimvlm.kernels.density import grid_density
from trimvlm.kv.base import KVPolicy, LayerView
from trimvlm.options import option, require_bool, require_choice, require_int
from trimvlm.protocol import register


@register("kv", "density")
@dataclass
class DensityKV(KVPolicy):
    """Options: `keep`, `window` (odd density window, default 3), `features` (`values` or `keys`, used when
    rho is not reused), `reuse` (take the prefill reducer's rho when it left one, default true)."""

    window: int = option(3, require_int, minimum=1, odd=True)
    features: str = option("values", require_choice, allowed=("values", "keys"))
    reuse: bool = option(True, require_bool)

    def scores(self, view: LayerView) -> torch.Tensor:
        reused = self.reused_rho(view)
        return reused if reused is not None else self.layer_rho(view)

    def reused_rho(self, view: LayerView) -> torch.Tensor | None:
        """rho per entry from the prefill reducer (None when there is none for this batch)."""
        if not self.reuse or view.handoff is None:
            return None
        rho = view.handoff.rho
        src = view.entry.source
        if not isinstance(rho, torch.Tensor) or rho.dim() != 2 or rho.shape[0] != src.shape[0]:
            return None
        rho = rho.to(src.device).float()
        width = int(src.max().item()) + 1
        if rho.shape[1] < width:  # columns past the last visual token hold no rho
            rho = torch.nn.functional.pad(rho, (0, width - rho.shape[1]), value=float("nan"))
        out = rho.gather(1, src.clamp(min=0))
        if bool(torch.isnan(out[view.candidates]).any()):
            return None  # no rho for some surviving visual entry: not this batch's reduction
        return out

    def layer_rho(self, view: LayerView) -> torch.Tensor:
        """rho per entry computed from this layer's cached values (or keys), each image on its own grid (all
        of them in one `grid_density` call)."""
        e = view.entry
        t = e.value if self.features == "values" else e.key
        b, hk, k, hd = t.shape
        feats = t.permute(0, 2, 1, 3).reshape(b, k, hk * hd).float()
        rho = torch.ones(b, k, device=feats.device)
        seq = view.prefill.seq
        units = []  # (sample, entry columns, grid cells, grid) of every image with surviving visual entries
        for bi in range(b):
            cand, src = view.candidates[bi], e.source[bi]
            for (h, w), st in zip(seq.grids[bi], seq.image_start[bi], strict=True):
                pos = src - int(st)
                cols = (cand & (pos >= 0) & (pos < h * w)).nonzero().squeeze(1)
                if cols.numel():
                    units.append((bi, cols, pos[cols], (h, w)))
        if not units:
            return rho
        cells = pad_sequence([c for _, _, c, _ in units], batch_first=True, padding_value=-1)
        x = pad_sequence([feats[bi, cols] for bi, cols, _, _ in units], batch_first=True)
        grid = torch.tensor([g for _, _, _, g in units], device=cells.device)
        out = grid_density(x, cells, grid, cells >= 0, self.window)
        for ui, (bi, cols, _, _) in enumerate(units):
            rho[bi, cols] = out[ui, : cols.numel()]
        return rho
