"""InternVL (transformers' native `internvl`): InternViT vision tower, pixel-shuffle MLP projector, a Qwen2,
Qwen3 or Llama text model with 1-D RoPE.

The image processor (GotOcr2) resizes an image to one tile or, with `crop_to_patches`, cuts it into
cols x rows tiles (row-major) followed by a thumbnail tile of the whole image. Every tile passes through the
vision tower alone; its patches (CLS token dropped by the "default" strategy) are pixel-shuffled by
`downsample_ratio`, giving a (side, side) grid of LLM tokens in row-major order. So each tile is its own grid:
`grids`, `image_start` and `image_id` count tiles, in prompt order.

Prompt format of one image, as `InternVLProcessor` writes it:
    <img><IMG_CONTEXT> * (image_seq_length * tiles)</img>
The chat template marks each image with one context token, which the processor replaces by that block.
"""

from __future__ import annotations

import torch

from trimvlm.adapters.base import Adapter, Images, Prepared

START, END, CONTEXT = "<img>", "</img>", "<IMG_CONTEXT>"


def _pair(x) -> tuple[int, int]:
    return (int(x[0]), int(x[1])) if isinstance(x, list | tuple) else (int(x), int(x))


class InternVLAdapter(Adapter):
    family = "internvl"
    # InternVLProcessor asks the image processor for tiles by default; a processor with max_patches=1 never tiles
    crop_to_patches = True

    # ---- image layout ----
    @property
    def context_token(self) -> str:
        return getattr(self.tokenizer, "context_image_token", None) or self.tokenizer.convert_ids_to_tokens(
            self.image_token_id
        )

    chat_image_marker = context_token  # the chat template marks each image with one context token

    def tile_grid(self, height: int, width: int) -> tuple[int, int]:
        """(h, w) LLM tokens of one tile of height x width pixels: patches per side times `downsample_ratio`."""
        ph, pw = _pair(self.vision_config.patch_size)
        ratio = self.model.config.downsample_ratio
        return int(height // ph * ratio), int(width // pw * ratio)

    def image_block(self, tokens: int) -> str:
        start = getattr(self.tokenizer, "start_image_token", None) or START
        return start + self.context_token * tokens + (getattr(self.tokenizer, "end_image_token", None) or END)

    # ---- inputs ----
    def process_images(self, per_sample) -> Images:
        flat = [im for ims in per_sample for im in ims]
        proc = self.image_processor(images=flat, crop_to_patches=self.crop_to_patches, return_tensors="pt")
        pixel_values = proc["pixel_values"]
        h, w = self.tile_grid(*pixel_values.shape[-2:])
        counts = iter(int(n) for n in proc["num_patches"])
        tiles = [[next(counts) for _ in ims] for ims in per_sample]
        blocks = [[self.image_block(h * w * n) for n in t] for t in tiles]
        return Images({"pixel_values": pixel_values.to(self.model.dtype)}, blocks, tiles)

    def layout(self, prepared: Prepared):
        """Per sample: one (h, w) grid per tile, the index of each tile's first token, tile ids."""
        pixel_values = prepared.model_inputs.get("pixel_values")
        grid = self.tile_grid(*pixel_values.shape[-2:]) if pixel_values is not None else (0, 0)
        return self.tile_layout(prepared.input_ids == self.image_token_id, grid, self.context_token)

    # ---- vision-tower probe ----
    vision_has_cls = True  # InternViT puts a [CLS] token first; the "default" feature strategy drops it

    def vision_attention_modules(self) -> list:
        return [layer.attention for layer in self.inner.vision_tower.encoder.layer]

    def _vision_units(self, rec, prepared, grids) -> list:
        """One attention call for all tiles ([CLS] + patches each); a tile's LLM tokens are the groups of patches
        the pixel shuffle (`downsample_ratio`) concatenates, found by shuffling the patch indices."""
        ph, pw = _pair(self.vision_config.patch_size)
        pixel_values = prepared.model_inputs["pixel_values"]
        h, w = pixel_values.shape[-2] // ph, pixel_values.shape[-1] // pw
        idx = torch.arange(1, 1 + h * w, device="cpu").reshape(1, h, w, 1)
        groups = self.inner.pixel_shuffle(idx, scale_factor=self.model.config.downsample_ratio)
        return rec.batched(pixel_values.shape[0], 1 + h * w, groups.reshape(-1, groups.shape[-1]))
