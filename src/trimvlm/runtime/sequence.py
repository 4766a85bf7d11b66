"""The live sequence the runner carries between decoder layers.

Every per-position tensor is aligned on the sequence axis S, left-padded (pads first, so the last column is
every sample's newest token). Gathering a subset of positions keeps each token's original position ids, so a
token dropped after layer L leaves the others exactly where RoPE put them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch


def compact_order(keep: torch.Tensor) -> torch.Tensor:
    """[B, S'] column indices that take the True entries of `keep` [B, S], in order, right-aligned (left
    padding), S' = the largest count of a row. Pad columns come first and point at dropped entries."""
    new_len = int(keep.sum(1).max().item()) if keep.numel() else 0
    # stable sort puts dropped positions first and kept ones after, in their original order
    return torch.sort(keep.to(torch.int8), dim=1, stable=True).indices[:, keep.shape[1] - new_len :]


def next_positions(positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B] the position id each row's next token takes (its largest valid position + 1), from positions
    [A, B, S] and valid [B, S]."""
    return positions.masked_fill(~valid[None], -1).amax(dim=(0, 2)) + 1


@dataclass
class LiveSeq:
    hidden: torch.Tensor  # [B, S, D]
    positions: torch.Tensor  # [A, B, S] rope position ids (A = 3 for M-RoPE, 1 otherwise)
    valid: torch.Tensor  # [B, S] bool, False on padding
    visual: torch.Tensor  # [B, S] bool, True on image tokens
    source: torch.Tensor  # [B, S] long, index of the token in the original prefill sequence (-1 on padding)
    image_id: torch.Tensor  # [B, S] long, which image of the sample a visual token came from (-1 for text)
    # Per-position tensors a family adds to the hidden states after given layers (Qwen3-VL deepstack):
    # name -> list of [B, S, D], gathered together with the sequence.
    adds: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    # Visual-token patch grids per sample: list of (grid_h, grid_w) per image (positions of tokens in the grid
    # are recovered from `source` minus the image's first index, kept in `image_start`).
    grids: list[list[tuple[int, int]]] = field(default_factory=list)
    image_start: list[list[int]] = field(default_factory=list)
    # Tokens merged into each live token (1 if none); used by size-weighted merges.
    size: torch.Tensor | None = None
    # Tiled families: the image each grid (tile) of `grids` belongs to, per sample (one grid per image else).
    tile_image: list[list[int]] = field(default_factory=list)
    # A content fingerprint of every image, per sample (seeded random choices draw per image from it).
    image_keys: list[list[int]] = field(default_factory=list)

    @classmethod
    def text(cls, hidden: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> LiveSeq:
        """A chunk of text tokens (no image, no prefill index)."""
        b, q = valid.shape
        dev = valid.device
        return cls(
            hidden=hidden, positions=positions, valid=valid, visual=torch.zeros(b, q, dtype=torch.bool, device=dev),
            source=torch.full((b, q), -1, dtype=torch.long, device=dev),
            image_id=torch.full((b, q), -1, dtype=torch.long, device=dev),
        )  # fmt: skip

    @property
    def batch(self) -> int:
        return self.hidden.shape[0]

    @property
    def length(self) -> int:
        return self.hidden.shape[1]

    def gather(self, keep: torch.Tensor) -> LiveSeq:
        """Keep positions where `keep` [B, S] is True, compacted to the right (left padding), order kept."""
        if keep.shape != self.valid.shape:
            raise ValueError(f"keep mask shape {tuple(keep.shape)} != sequence {tuple(self.valid.shape)}")
        keep = keep & self.valid
        order = compact_order(keep)
        return self.index_select(order, keep.gather(1, order))

    def index_select(self, order: torch.Tensor, new_valid: torch.Tensor) -> LiveSeq:
        """Take columns `order` [B, S'] of every per-position tensor; `new_valid` marks real entries."""
        b_idx = torch.arange(self.batch, device=order.device)[:, None]

        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[b_idx, order]

        return replace(
            self, hidden=take(self.hidden), positions=self.positions[:, b_idx, order], valid=new_valid,
            visual=take(self.visual) & new_valid, source=take(self.source).masked_fill(~new_valid, -1),
            image_id=take(self.image_id).masked_fill(~new_valid, -1), size=take(self.size),
            adds={k: [take(t) for t in ts] for k, ts in self.adds.items()},
        )  # fmt: skip

    def take_rows(self, idx) -> LiveSeq:
        """Rows (samples) `idx` of every per-row field, in that order (a row may repeat)."""
        t = torch.as_tensor(idx, dtype=torch.long)
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out[f.name] = v.index_select(1 if f.name == "positions" else 0, t.to(v.device))
            elif f.name == "adds":
                out[f.name] = {k: [x.index_select(0, t.to(x.device)) for x in xs] for k, xs in v.items()}
            elif isinstance(v, list):
                out[f.name] = [v[j] for j in t.tolist()] if v else v
            else:
                out[f.name] = v
        return LiveSeq(**out)

    def with_hidden(self, hidden: torch.Tensor) -> LiveSeq:
        return replace(self, hidden=hidden)
