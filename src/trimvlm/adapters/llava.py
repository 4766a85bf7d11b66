"""LLaVA: a CLIP or SigLIP vision tower, a projector, a Llama-style text model with 1-D RoPE.

Each image becomes a run of `<image>` tokens, one per vision patch (the CLS token of CLIP is dropped by the
"default" feature strategy and kept by "full"). Position ids are the running count of valid tokens, as
transformers' `generate` computes them for a left-padded batch (`attention_mask.cumsum(-1) - 1`).
"""

from __future__ import annotations

import torch

from trimvlm.adapters.base import Adapter, Images, Prepared
from trimvlm.errors import InputError

IMAGE = "<image>"


class LlavaAdapter(Adapter):
    family = "llava"
    chat_image_marker = IMAGE

    @property
    def patch_size(self) -> int:
        return self.vision_config.patch_size

    @property
    def vision_has_cls(self) -> bool:
        """Whether the vision tower puts a CLS token before the patches (CLIP does, SigLIP does not)."""
        embeddings = getattr(self.inner.vision_tower, "embeddings", None)
        return getattr(embeddings, "class_embedding", None) is not None

    @property
    def grid_offset(self) -> int:
        """Index of patch (0, 0) relative to an image's first token: 1 when a CLS token is kept ("full"
        strategy on CLIP), -1 when the "default" strategy drops a patch (a tower without CLS), else 0."""
        full = self.model.config.vision_feature_select_strategy == "full"
        if self.vision_has_cls:
            return int(full)
        return 0 if full else -1

    def _grid(self, pixel_values: torch.Tensor) -> tuple[int, int]:
        """(h, w) patches of the images in this batch (the processor gives every image the same size)."""
        h, w = pixel_values.shape[-2:]
        return h // self.patch_size, w // self.patch_size

    def _image_tokens(self, grid: tuple[int, int]) -> int:
        h, w = grid
        return h * w + self.grid_offset

    def tokenize(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        bos = self.tokenizer.bos_token_id
        if bos is not None and getattr(self.tokenizer, "add_bos_token", False) and ids[:1] != [bos]:
            ids = [bos] + ids
        return ids

    def process_images(self, per_sample) -> Images:
        flat = [im for ims in per_sample for im in ims]
        pixel_values = self.image_processor(images=flat, return_tensors="pt")["pixel_values"]
        block = IMAGE * self._image_tokens(self._grid(pixel_values))
        blocks = [[block] * len(ims) for ims in per_sample]
        return Images({"pixel_values": pixel_values.to(self.model.dtype)}, blocks)

    def processor_options(self) -> dict:
        return {
            "patch_size": self.patch_size, "image_token": IMAGE,
            "num_additional_image_tokens": int(self.vision_has_cls),
            "vision_feature_select_strategy": self.model.config.vision_feature_select_strategy,
        }  # fmt: skip

    def layout(self, prepared: Prepared):
        """Per sample: grids (h, w) in patches and where each image's patch (0, 0) lies (`image_start`): its
        patch (r, c) is at image_start + r * w + c."""
        visual = prepared.input_ids == self.image_token_id
        pixel_values = prepared.model_inputs.get("pixel_values")
        grid = self._grid(pixel_values) if pixel_values is not None else (0, 0)
        n = self._image_tokens(grid) if pixel_values is not None else 0
        for b, found in enumerate(visual.sum(1).tolist()):
            if found != n * prepared.n_images[b]:
                raise InputError(
                    f"sample {b} has {found} {IMAGE} tokens for {prepared.n_images[b]} image(s) of {n} "
                    f"tokens each; do not write {IMAGE} in a prompt, pass the images instead"
                )
        image_id, starts = self.unit_layout(visual, [[n] * k for k in prepared.n_images], self.grid_offset)
        return visual, image_id, [[grid] * k for k in prepared.n_images], starts

    # ---- vision-tower probe ----
    def vision_attention_modules(self) -> list:
        tower = self.inner.vision_tower
        return [layer.self_attn for layer in getattr(tower, "vision_model", tower).encoder.layers]

    def _vision_units(self, rec, prepared, grids) -> list:
        """One attention call for all images; the LLM tokens of an image are its vision tokens after the ones the
        feature strategy drops (the [CLS] token, or patch 0 on a tower without one), one to one."""
        pixel_values = prepared.model_inputs["pixel_values"]
        h, w = self._grid(pixel_values)
        s = h * w + int(self.vision_has_cls)
        n = self._image_tokens((h, w))
        return rec.batched(pixel_values.shape[0], s, torch.arange(s - n, s, device="cpu")[:, None])
