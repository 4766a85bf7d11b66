"""Idefics3 and SmolVLM: SigLIP-style vision tower, pixel-shuffle connector, Llama text model (1-D RoPE).

An image is one global tile, or (with image splitting) rows x cols tiles followed by the global tile. Every tile
is a square of `image_seq_len` LLM tokens, laid out row-major on a (side, side) grid after the pixel shuffle, so
each tile is its own grid: `grids`, `image_start` and `image_id` count tiles, in prompt order.

Prompt format of one image, as the transformers processors write it:
    no split: <fake_token_around_image><global-img><image>*N<fake_token_around_image>
    split:    per row: (<fake_token_around_image><row_i_col_j><image>*N) per column, then "\\n";
              then "\\n<fake_token_around_image><global-img><image>*N<fake_token_around_image>"
"""

from __future__ import annotations

import torch

from trimvlm.adapters.base import Adapter, Images, Prepared

IMAGE, FAKE, GLOBAL = "<image>", "<fake_token_around_image>", "<global-img>"


def _as_list(x) -> list:
    return x.tolist() if hasattr(x, "tolist") else list(x)


class Idefics3Adapter(Adapter):
    family = "idefics3"
    chat_image_marker = IMAGE

    @property
    def text_model(self):
        return self.inner.text_model

    # ---- image layout ----
    @property
    def tile_side(self) -> int:
        """LLM tokens along each side of one tile: patches per side divided by the pixel-shuffle factor."""
        vc = self.vision_config
        return vc.image_size // vc.patch_size // self.model.config.scale_factor

    def image_block(self, rows: int, cols: int) -> str:
        tile = IMAGE * self.tile_side**2  # `image_seq_len` tokens
        glob = FAKE + GLOBAL + tile + FAKE
        if rows == 0 and cols == 0:
            return glob
        grid = ["".join(f"{FAKE}<row_{i + 1}_col_{j + 1}>{tile}" for j in range(cols)) for i in range(rows)]
        return "".join(line + "\n" for line in grid) + "\n" + glob

    # ---- inputs ----
    def process_images(self, per_sample) -> Images:
        proc = self.image_processor(images=per_sample, return_row_col_info=True, return_tensors="pt")
        inputs = {"pixel_values": proc["pixel_values"].to(self.model.dtype)}
        if proc.get("pixel_attention_mask") is not None:
            inputs["pixel_attention_mask"] = proc["pixel_attention_mask"]
        rows, cols = _as_list(proc["rows"]), _as_list(proc["cols"])
        shape = [list(zip(_as_list(r), _as_list(c), strict=True)) for r, c in zip(rows, cols, strict=True)]
        blocks = [[self.image_block(r, c) for r, c in sample] for sample in shape]
        return Images(inputs, blocks, [[r * c + 1 if r * c else 1 for r, c in sample] for sample in shape])

    def layout(self, prepared: Prepared):
        """Per sample: one (side, side) grid per tile, the start index of each tile's tokens, tile ids."""
        visual = prepared.input_ids == self.image_token_id
        return self.tile_layout(visual, (self.tile_side, self.tile_side), IMAGE)

    def vision_inputs(self, prepared: Prepared) -> dict:
        return {k: prepared.model_inputs.get(k) for k in ("pixel_values", "pixel_attention_mask")}

    # ---- vision-tower probe ----
    def vision_attention_modules(self) -> list:
        return [layer.self_attn for layer in self.inner.vision_model.encoder.layers]

    def _vision_units(self, rec, prepared, grids) -> list:
        """One attention call for all (real) tiles, padded patches masked; a tile's LLM tokens are the groups of
        patches the connector's pixel shuffle concatenates (found by shuffling the patch indices)."""
        vc = self.vision_config
        p = (vc.image_size // vc.patch_size) ** 2
        idx = torch.arange(p, device="cpu")[None, :, None]
        groups = self.inner.connector.pixel_shuffle(idx, self.model.config.scale_factor)[0]
        return rec.batched(sum(len(g) for g in grids), p, groups)


class SmolVLMAdapter(Idefics3Adapter):
    """SmolVLM: the Idefics3 architecture and image prompt format (its video input is not supported)."""

    family = "smolvlm"
