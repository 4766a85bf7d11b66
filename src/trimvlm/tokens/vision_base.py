"""The shared part of reducers that read the vision tower's attention (PruMerge, VisionZip): they act at LLM
layer 0, ask for a `VisionProbe` of one vision layer, and read its records (attention received, keys) per unit."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trimvlm.options import is_int
from trimvlm.runtime import vision_probe
from trimvlm.tokens.base import TokenReducer, VisualView


@dataclass
class VisionAttentionReducer(TokenReducer):
    """Options shared by the vision-attention reducers: `vision_layer` (the vision layer read, default -2, the
    penultimate; negative counts from the end); `layer` can only be 0 (the projector's tokens)."""

    vision_layer: int = -2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer is not None and (not is_int(self.layer) or self.layer != 0):
            raise ValueError(
                f"layer must be 0 for {self.name}: it reduces the projector's tokens before the first decoder "
                f"layer, from the vision tower's attention; got {self.layer!r}"
            )
        if not is_int(self.vision_layer):
            raise ValueError(
                f"vision_layer must be an integer (negative counts from the end), got {self.vision_layer!r}"
            )

    def check(self, runner) -> None:
        vision_probe.check_layer(runner, self.vision_layer, self.name)

    def vision_probe(self, runner, handoff):
        return vision_probe.request(handoff, self.vision_layer) if self.ratio < 1 else None

    def wants_attention(self, runner) -> bool:
        return True  # the vision tower's, read from the handoff (`_attention`), not an LLM layer's

    def read_attention(self, view: VisualView, seq, lay: int, handoff) -> torch.Tensor:
        view.attention, keys, heads = vision_probe.view_records(view, handoff, self.name)
        view.keys = self.vision_keys(keys, heads)
        return view.attention

    def vision_keys(self, keys: torch.Tensor, heads: int) -> torch.Tensor:
        """The keys the merge compares, from the recorded [U, N, heads * d] keys (default: heads concatenated)."""
        return keys
