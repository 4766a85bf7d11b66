"""The shared options of reducers that read the vision tower's attention (PruMerge, VisionZip, HoloV, FasterVLM,
VisPruner): they act at LLM layer 0 and declare `attention = "vision"`, so the base asks for a `VisionProbe` of
their `vision_layer` and hands them its records (attention received, keys) per unit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trimvlm.options import option, require_int
from trimvlm.tokens.base import TokenReducer


@dataclass
class VisionAttentionReducer(TokenReducer):
    """Options shared by the vision-attention reducers: `vision_layer` (the vision layer read, default -2, the
    penultimate; negative counts from the end); `layer` can only be 0 (the projector's tokens)."""

    vision_layer: int = option(-2, require_int, hint=" (negative counts from the end)")

    attention: ClassVar[str] = "vision"
