"""Qwen2.5-VL: M-RoPE (3 axes) from the model's own rule, vision tower with window attention, no deepstack."""

from __future__ import annotations

import torch

from trimvlm.adapters.base import Adapter, Prepared
from trimvlm.adapters.qwen3_vl import QwenVLAdapterMixin
from trimvlm.runtime.sequence import LiveSeq


class Qwen25VLAdapter(QwenVLAdapterMixin, Adapter):
    family = "qwen2_5_vl"

    def embed(self, prepared: Prepared) -> LiveSeq:
        embeds = self.embed_tokens(prepared.input_ids)
        visual, image_id, grids, starts = self._layout(prepared)
        if "pixel_values" in prepared.model_inputs:
            out = self.inner.get_image_features(
                prepared.model_inputs["pixel_values"],
                prepared.model_inputs["image_grid_thw"],
                return_dict=True,
            )
            feats = torch.cat(out.pooler_output, dim=0).to(embeds.dtype)
            embeds = embeds.masked_scatter(visual[..., None], feats)
        return self.sequence_from(prepared, embeds, self.positions(prepared), visual, image_id, grids, starts)
