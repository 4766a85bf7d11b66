"""Random visual-KV eviction (seeded): a uniform random subset of each sample's visual entries.

The random value of an entry depends only on `seed` and the entry's distance from the end of its prompt (the
prompts are left-padded, so that distance is the same whether the sample runs alone or in a batch), so a sample
gets the same subset in any batch, and the same tokens are kept in every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trimvlm.kv.base import KVPolicy, LayerView
from trimvlm.registry import register

_BLOCK = 4096


def uniform_by_key(key: torch.Tensor, seed: int) -> torch.Tensor:
    """Deterministic U(0, 1) per integer key >= 0, independent of the other keys asked for."""
    n_blocks = int(key.max().item()) // _BLOCK + 1 if key.numel() else 0
    blocks = [
        torch.rand(_BLOCK, generator=torch.Generator().manual_seed(seed * 1_000_003 + j))
        for j in range(n_blocks)
    ]
    table = torch.cat(blocks) if blocks else torch.zeros(0)
    return table[key]


@register("kv", "random")
@dataclass
class RandomKV(KVPolicy):
    """Options: `keep`, `seed`."""

    def scores(self, view: LayerView):
        src = view.entry.source
        last = int(src.max().item())  # every sample's last prompt token sits in the last column
        key = (last - src).clamp(min=0, max=last)
        return uniform_by_key(key, self.seed).reshape(src.shape).to(src.device)
