"""Qwen2.5-VL: M-RoPE (3 axes) from the model's own rule, vision tower with window attention, no deepstack.
Everything it needs is the shared Qwen-VL front end."""

from __future__ import annotations

from trimvlm.adapters.base import Adapter
from trimvlm.adapters.qwen3_vl import QwenVLAdapterMixin


class Qwen25VLAdapter(QwenVLAdapterMixin, Adapter):
    family = "qwen2_5_vl"

    def vision_order(self, grid_thw):
        """The vision blocks run the merged tokens in window order (the merger's output is put back after)."""
        from transformers.vision_utils import get_vision_window_index

        vc = self.vision_config
        return get_vision_window_index(grid_thw, vc.spatial_merge_size, vc.window_size, vc.patch_size)[0]
