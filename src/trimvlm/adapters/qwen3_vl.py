"""Qwen3-VL: M-RoPE (3 axes), vision tower with deepstack features added after the first decoder layers."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from trimvlm.adapters.base import Adapter, Images, Prepared, current_resolution
from trimvlm.adapters.patch_embed import as_matmul
from trimvlm.adapters.vision_rotary import compiled_rotary
from trimvlm.errors import InputError
from trimvlm.runtime.vision_probe import VisionUnit

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"


class QwenVLAdapterMixin:
    """Shared by the Qwen-VL families: image block, M-RoPE positions from the model's own rule."""

    rope_axes = 3
    caches_vision = True
    chat_image_marker = VISION_START + IMAGE_PAD + VISION_END

    @property
    def merge(self) -> int:
        return self.vision_config.spatial_merge_size

    resizes = True  # dynamic resolution: the token grid follows the image's size

    def process_images(self, per_sample) -> Images:
        flat, kw = self._at_resolution([im for ims in per_sample for im in ims])
        proc = self._process(flat, **kw)
        grids = proc["image_grid_thw"]
        counts = iter(int(g.prod().item()) // self.merge**2 for g in grids)
        blocks = [[VISION_START + IMAGE_PAD * next(counts) + VISION_END for _ in ims] for ims in per_sample]
        pixels = proc["pixel_values"].to(self.model.dtype)
        return Images({"pixel_values": pixels, "image_grid_thw": grids}, blocks)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def token_inputs(self, ids: torch.Tensor) -> dict:
        return {"mm_token_type_ids": (ids == self.model.config.image_token_id).to(torch.int32)}

    def _process(self, flat: list, **kw):
        """The checkpoint's image processor on `flat`; an image it refuses (an aspect ratio of 200 or more, a
        side too short to resize) is a one-line `InputError` naming the image and its size."""
        try:
            return self.image_processor(images=flat, return_tensors="pt", **kw)
        except ValueError as e:
            sizes = ", ".join(f"{getattr(im, 'width', '?')}x{getattr(im, 'height', '?')}" for im in flat)
            raise InputError(
                f"the image processor refuses an image of this batch ({sizes} pixels): {e}; allowed: images "
                "whose longer side is under 200 times the shorter"
            ) from None

    def _at_resolution(self, flat: list) -> tuple[list, dict]:
        """(images, image-processor kwargs) under the active `adapters.base.resolution`: each image resized
        (bicubic) to exactly the target token grid's pixels (a multiple of patch * merge on each side) and the
        processor's pixel bounds opened to those sizes, so its own resize leaves them as they are."""
        from PIL import Image

        target = current_resolution()
        if target is None:
            return flat, {}
        natural = self._process(flat)["image_grid_thw"]
        f = self.image_processor.patch_size * self.merge
        out, areas = [], []
        for im, (_, h, w) in zip(flat, natural.tolist(), strict=True):
            th, tw = target(h // self.merge, w // self.merge)
            out.append(im.convert("RGB").resize((tw * f, th * f), Image.BICUBIC))
            areas.append(th * tw * f * f)
        return out, {"size": {"shortest_edge": min(areas), "longest_edge": max(areas)}}

    # ---- decision requests ----
    def processor_options(self) -> dict:
        return {}

    processed_image_inputs = ("image_grid_thw",)

    def processed_images(self, inputs: dict) -> list[torch.Tensor]:
        grid = inputs.get("image_grid_thw")
        return [] if grid is None else list(inputs["pixel_values"].split(grid.prod(-1).tolist()))

    def layout(self, prepared: Prepared):
        """Per sample: grids (h, w) in merged tokens and the start index of each image's tokens."""
        visual = prepared.input_ids == self.model.config.image_token_id
        grid_thw = prepared.model_inputs.get("image_grid_thw")
        thw = iter([] if grid_thw is None else grid_thw.tolist())
        grids = [[next(thw) for _ in range(n)] for n in prepared.n_images]  # (t, h, w) in patches
        image_id, starts = self.unit_layout(visual, [[t * h * w // self.merge**2 for t, h, w in s] for s in grids])
        return visual, image_id, [[(h // self.merge, w // self.merge) for _, h, w in s] for s in grids], starts

    def positions(self, prepared: Prepared) -> torch.Tensor:
        ids, att = prepared.input_ids, prepared.attention_mask
        if "image_grid_thw" not in prepared.model_inputs:  # text only: the 1-D positions on every axis
            return super().positions(prepared).expand(3, -1, -1).clone()
        pos, _ = self.inner.get_rope_index(
            ids,
            mm_token_type_ids=prepared.model_inputs["mm_token_type_ids"],
            image_grid_thw=prepared.model_inputs["image_grid_thw"],
            attention_mask=att,
        )
        return pos

    def processed_positions(self, inputs: dict) -> int:
        ids = inputs["input_ids"]
        extra = self.token_inputs(ids)
        if inputs.get("image_grid_thw") is not None:
            extra["image_grid_thw"] = inputs["image_grid_thw"]
        return int(self.next_positions(Prepared(ids, torch.ones_like(ids), extra))[0])

    def image_features(self, prepared: Prepared, vision, grids):
        """The vision tower's output for the batch's images (`pooler_output`: per image, `deepstack_features`: per
        deepstack layer, per image): one call, or through the vision cache when one is set and no probe records
        the tower (only the images it does not hold are encoded)."""
        pixel_values, grid_thw = (prepared.model_inputs[k] for k in ("pixel_values", "image_grid_thw"))

        def call(pixels, grid):
            visual = self.inner.visual
            with as_matmul(getattr(getattr(visual, "patch_embed", None), "proj", None)), compiled_rotary(visual):
                return self.inner.get_image_features(pixels, grid, return_dict=True)

        if self.vision_cache is None or vision is not None:
            units = lambda rec: self._vision_units(rec, grid_thw)  # noqa: E731
            return self.encode_vision(vision, lambda: call(pixel_values, grid_thw), units, grids)
        chunks = pixel_values.split(grid_thw.prod(-1).tolist())

        def encode(idx: list[int]) -> list[tuple]:
            out = call(torch.cat([chunks[i] for i in idx]), grid_thw[idx])
            deep = getattr(out, "deepstack_features", None) or []
            return [(out.pooler_output[k], *(layer[k] for layer in deep)) for k in range(len(idx))]

        parts = self.vision_cache.features(list(zip(chunks, grid_thw, strict=True)), encode)
        deep = [[p[d] for p in parts] for d in range(1, len(parts[0]))]
        return SimpleNamespace(pooler_output=[p[0] for p in parts], deepstack_features=deep)

    # ---- vision-tower probe ----
    def vision_attention_modules(self) -> list:
        return [blk.attn for blk in self.inner.visual.blocks]

    def vision_order(self, grid_thw: torch.Tensor) -> torch.Tensor | None:
        """The merged-token order the vision blocks run in (None: the images' own order)."""
        return None

    def _vision_units(self, rec, grid_thw: torch.Tensor) -> list:
        """Qwen-VL towers run all images packed in one sequence, one attention call per image (or window): the
        concatenated records are the packed sequence, whose groups of merge**2 consecutive patches are the
        LLM tokens (in `vision_order`). Received attention is the column sum over the image's patches, divided
        by their count (every patch of a Qwen-VL image is a query)."""
        patches = grid_thw.prod(-1).tolist()
        stat, keys = rec.packed(sum(patches))
        m2 = self.merge**2
        stat, keys = stat.view(-1, m2), keys.view(-1, m2, keys.shape[-1])
        order = self.vision_order(grid_thw)
        if order is not None:
            back = torch.argsort(order.to(stat.device))
            stat, keys = stat[back], keys[back]
        received, keys = stat.sum(-1), keys.mean(1)  # per LLM token: sum over its patches, mean key
        tokens = [n // m2 for n in patches]  # per image its LLM tokens
        parts = zip(received.split(tokens), keys.split(tokens), patches, strict=True)
        return [VisionUnit(received=r / n, keys=k) for r, k, n in parts]


class Qwen3VLAdapter(QwenVLAdapterMixin, Adapter):
    family = "qwen3_vl"

    def vision_adds(self, out, embeds, visual) -> dict:
        deep = []
        for layer_feats in out.deepstack_features:
            t = torch.zeros_like(embeds)
            t[visual] = torch.cat(layer_feats, dim=0).to(embeds.dtype)
            deep.append(t)
        return {"deepstack": deep}

    def after_layer(self, index, seq, hidden):
        """Deepstack feature k is added after the k-th layer each row runs, as in transformers' model with the
        skipped layers removed (`deepstack_visual_embeds[layer_idx]` after `layers[layer_idx]`): skipping a layer
        below the deepstack layers moves the later injections one layer down, per row."""
        deep = seq.adds.get("deepstack") or []
        for k, feats in enumerate(deep):
            rows = index == k
            if not bool(rows.any()):
                continue
            at = seq.visual if bool(rows.all()) else seq.visual & rows.to(seq.visual.device)[:, None]
            hidden = hidden + feats * at[..., None].to(hidden.dtype)
        return hidden
