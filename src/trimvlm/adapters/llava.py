"""LLaVA: a CLIP or SigLIP vision tower, a projector, a Llama-style text model with 1-D RoPE.

Each image becomes a run of `<image>` tokens, one per vision patch (the CLS token of CLIP is dropped by the
"default" feature strategy and kept by "full"). Position ids are the running count of valid tokens, as
transformers' `generate` computes them for a left-padded batch (`attention_mask.cumsum(-1) - 1`).
"""

from __future__ import annotations

import torch

from trimvlm.adapters.base import (
    Adapter,
    Prepared,
    image_keys,
    images_only_processor,
    load_images,
    on_host,
    pixel_key,
)
from trimvlm.errors import InputError
from trimvlm.runtime.sequence import LiveSeq

IMAGE = "<image>"


class LlavaAdapter(Adapter):
    family = "llava"
    rope_axes = 1
    chat_image_marker = IMAGE

    @property
    def patch_size(self) -> int:
        return self.model.config.vision_config.patch_size

    @property
    def has_cls(self) -> bool:
        """Whether the vision tower puts a CLS token before the patches (CLIP does, SigLIP does not)."""
        embeddings = getattr(self.inner.vision_tower, "embeddings", None)
        return getattr(embeddings, "class_embedding", None) is not None

    @property
    def grid_offset(self) -> int:
        """Index of patch (0, 0) relative to an image's first token: 1 when a CLS token is kept ("full"
        strategy on CLIP), -1 when the "default" strategy drops a patch (a tower without CLS), else 0."""
        full = self.model.config.vision_feature_select_strategy == "full"
        if self.has_cls:
            return int(full)
        return 0 if full else -1

    def _grid(self, pixel_values: torch.Tensor) -> tuple[int, int]:
        """(h, w) patches of the images in this batch (the processor gives every image the same size)."""
        h, w = pixel_values.shape[-2:]
        return h // self.patch_size, w // self.patch_size

    def _image_tokens(self, grid: tuple[int, int]) -> int:
        h, w = grid
        return h * w + self.grid_offset

    def _tokenize(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        bos = self.tokenizer.bos_token_id
        if bos is not None and getattr(self.tokenizer, "add_bos_token", False) and ids[:1] != [bos]:
            ids = [bos] + ids
        return ids

    @on_host
    def prepare(self, images, prompts) -> Prepared:
        per_sample = load_images(images, len(prompts))
        flat = [im for ims in per_sample for im in ims]
        model_inputs = {}
        count = 0
        if flat:
            pixel_values = self.image_processor(images=flat, return_tensors="pt")["pixel_values"]
            model_inputs["pixel_values"] = pixel_values.to(self.model.dtype)
            count = self._image_tokens(self._grid(pixel_values))
        rows = []
        for ims, prompt in zip(per_sample, prompts, strict=True):
            text = self.render_prompt(prompt, len(ims), lambda k: IMAGE * count)
            rows.append(self._tokenize(text))
        ids, att = self.pad_batch(rows)
        return Prepared(
            ids, att, model_inputs, n_images=[len(x) for x in per_sample], image_keys=image_keys(per_sample)
        )

    # ---- decision requests ----
    def decision_processor(self):
        import copy

        tokenizer = copy.deepcopy(self.tokenizer)
        return images_only_processor("LlavaProcessor")(
            image_processor=self.image_processor, tokenizer=tokenizer, patch_size=self.patch_size,
            vision_feature_select_strategy=self.model.config.vision_feature_select_strategy,
            num_additional_image_tokens=int(self.has_cls), image_token=IMAGE,
            chat_template=getattr(tokenizer, "chat_template", None),
        )  # fmt: skip

    @on_host
    def prepare_processed(self, inputs: list[dict]) -> Prepared:
        ids, att = self.pad_batch([x["input_ids"][0].tolist() for x in inputs])
        pixels = [x.get("pixel_values") for x in inputs]
        model_inputs = {}
        given = [p for p in pixels if p is not None]
        if given:
            model_inputs["pixel_values"] = torch.cat(given).to(self.model.dtype)
        n_images = [0 if p is None else len(p) for p in pixels]
        keys = [[] if p is None else [pixel_key(im) for im in p] for p in pixels]
        return Prepared(ids, att, model_inputs, n_images=n_images, image_keys=keys)

    def layout(self, prepared: Prepared):
        """Per sample: grids (h, w) in patches and where each image's patch (0, 0) lies (`image_start`): its
        patch (r, c) is at image_start + r * w + c."""
        visual = prepared.input_ids == self.image_token_id
        image_id = torch.full(visual.shape, -1, dtype=torch.long, device=visual.device)
        grids, starts = [], []
        pixel_values = prepared.model_inputs.get("pixel_values")
        grid = self._grid(pixel_values) if pixel_values is not None else (0, 0)
        n = self._image_tokens(grid) if pixel_values is not None else 0
        for b in range(prepared.batch):
            idx = torch.nonzero(visual[b]).flatten().tolist()
            if len(idx) != n * prepared.n_images[b]:
                raise InputError(
                    f"sample {b} has {len(idx)} {IMAGE} tokens for {prepared.n_images[b]} image(s) of {n} "
                    f"tokens each; do not write {IMAGE} in a prompt, pass the images instead"
                )
            g, st = [], []
            for j in range(prepared.n_images[b]):
                first = idx[j * n]
                image_id[b, first : first + n] = j
                g.append(grid)
                st.append(first + self.grid_offset)
            grids.append(g)
            starts.append(st)
        return visual, image_id, grids, starts

    def embed(self, prepared: Prepared, vision=None) -> LiveSeq:
        embeds = self.embed_tokens(prepared.input_ids)
        visual, image_id, grids, starts = self.layout(prepared)
        if "pixel_values" in prepared.model_inputs:
            out = self.encode_feature_layer(prepared, vision, grids)
            embeds = self.merge_features(embeds, visual, torch.cat(list(out.pooler_output), dim=0))
        positions = self.running_positions(prepared)
        return self.sequence_from(prepared, embeds, positions, visual, image_id, grids, starts)

    # ---- vision-tower probe ----
    @property
    def vision_has_cls(self) -> bool:
        return self.has_cls

    def vision_attention_modules(self) -> list:
        tower = self.inner.vision_tower
        return [layer.self_attn for layer in getattr(tower, "vision_model", tower).encoder.layers]

    def _vision_units(self, rec, pixel_values) -> list:
        """One attention call for all images; the LLM tokens of an image are its vision tokens after the ones the
        feature strategy drops (the [CLS] token, or patch 0 on a tower without one), one to one."""
        h, w = self._grid(pixel_values)
        s = h * w + int(self.has_cls)
        stat, keys, queries = rec.batched(pixel_values.shape[0], s)
        n = self._image_tokens((h, w))
        groups = torch.arange(s - n, s, device=stat.device)[:, None]
        return self.vision_tokens(stat / queries[:, None], keys, groups)
