"""Random visual-KV eviction (seeded): a uniform random subset of each sample's visual entries.

Entry of grid cell t of an image draws `hashed_uniform(seed, image fingerprint, t)` (kernels/select.py), the
same draw as tokens=random: it depends only on the seed and the image (a fingerprint of its pixels), so a sample
gets the same subset in any batch, different images get different subsets, and every layer keeps the same
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trimvlm.kernels.select import TILE_STRIDE, hashed_uniform
from trimvlm.kv.base import KVPolicy, LayerView
from trimvlm.protocol import register


@register("kv", "random")
@dataclass
class RandomKV(KVPolicy):
    """Options: `keep`, `seed`."""

    def scores(self, view: LayerView):
        src = view.entry.source
        seq = view.prefill.seq
        key = torch.zeros_like(src)
        index = torch.zeros_like(src)
        for b in range(src.shape[0]):
            grids = seq.grids[b] if b < len(seq.grids) else []
            tiles = seq.tile_image[b] if b < len(seq.tile_image) else list(range(len(grids)))
            keys = seq.image_keys[b] if b < len(seq.image_keys) else []
            for j, ((h, w), st) in enumerate(zip(grids, seq.image_start[b], strict=True)):
                img = tiles[j] if j < len(tiles) else j
                cell = src[b] - int(st)
                inside = (cell >= 0) & (cell < h * w)
                key[b][inside] = keys[img] if img < len(keys) else 0
                index[b][inside] = cell[inside] + tiles[:j].count(img) * TILE_STRIDE
        return hashed_uniform(self.seed, key, index)
