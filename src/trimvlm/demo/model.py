"""The demo VLMs: a real `Qwen3VLForConditionalGeneration` (family "qwen3_vl", deepstack) and a real
`Qwen3_5ForConditionalGeneration` (family "qwen3_5": Gated DeltaNet linear-attention layers alternating with
gated full-attention layers) for the grid task, and a real `Qwen2_5_VLForConditionalGeneration` (family
"qwen2_5_vl": window attention in the vision tower, 12 decoder layers) for the scenes task, at dynamic
resolution; all built from small configs.

`build_config` sizes one, `build_model` instantiates it with the demo tokenizer's special-token ids, and
`save_checkpoint` writes a folder that transformers' own `from_pretrained` (model, tokenizer, image
processor) and `trimvlm.load` both read: fp32 safetensors, config, generation config, tokenizer, image
processor and `trimvlm.json` (prompt template and recorded accuracy).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoModelForImageTextToText,
    GenerationConfig,
    PretrainedConfig,
    Qwen2_5_VLConfig,
    Qwen3_5Config,
    Qwen3VLConfig,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from trimvlm.demo import scenes, task
from trimvlm.demo.vocab import EOS, PAD, build_tokenizer, vision_ids
from trimvlm.errors import InputError

PATCH = 8
MERGE = 2
TEMPORAL = 2
VISUAL_TOKENS = (task.IMAGE_SIZE // (PATCH * MERGE)) ** 2  # 64


def build_image_processor(task_name: str = "demo") -> Qwen2VLImageProcessorPil:
    """The grid task's fixed 128 x 128 images, or the scenes task's dynamic resolution: any image of 160 to 400
    visual tokens (16 x 16 pixels each) passes unchanged; others are resized into that range."""
    if task_name == "scenes":
        lo, hi = scenes.MIN_TOKENS * scenes.TOKEN_PX**2, scenes.MAX_TOKENS * scenes.TOKEN_PX**2
    else:
        lo = hi = task.IMAGE_SIZE * task.IMAGE_SIZE
    return qwen_image_processor(lo, hi)


def qwen_image_processor(min_pixels: int, max_pixels: int) -> Qwen2VLImageProcessorPil:
    """Qwen-VL's PIL image processor (no torchvision needed): patch 8, spatial merge 2, temporal patch 2."""
    return Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL,
                                    min_pixels=min_pixels, max_pixels=max_pixels)  # fmt: skip


FAMILIES = {"qwen3_vl": Qwen3VLConfig, "qwen3_5": Qwen3_5Config, "qwen2_5_vl": Qwen2_5_VLConfig}  # their configs
# The hybrid alternates one Gated DeltaNet layer and one full-attention layer (the released Qwen3.5 models use
# three to one); with 8 layers it keeps four full-attention layers for the visual search.
HYBRID_FULL_ATTENTION_INTERVAL = 2


def build_config(
    tokenizer=None,
    family: str = "qwen3_vl",
    hidden: int = 128,
    layers: int | None = None,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    vision_hidden: int = 64,
    vision_depth: int = 2,
) -> PretrainedConfig:
    if family not in FAMILIES:
        raise InputError(f"unknown demo model family {family!r}; allowed: {sorted(FAMILIES)}")
    hybrid = family == "qwen3_5"
    if family == "qwen2_5_vl":
        return build_scenes_config(tokenizer, hidden=hidden, layers=layers or 12, heads=heads,
                                   kv_heads=kv_heads, head_dim=head_dim, vision_hidden=vision_hidden)  # fmt: skip
    tok = tokenizer if tokenizer is not None else build_tokenizer()
    rotary = 0.5 if hybrid else 1.0  # Qwen3.5 rotates part of each head (partial_rotary_factor)
    half = int(head_dim * rotary) // 2
    hw = (half * 5) // 16  # same proportions as Qwen3-VL's [24, 20, 20] for head_dim 128
    rope = {"mrope_section": [half - 2 * hw, hw, hw], "mrope_interleaved": True}
    text = _text_config(tok, hidden, layers if layers is not None else (8 if hybrid else 6), heads, kv_heads,
                        head_dim, rope, max_position_embeddings=1024)  # fmt: skip
    if hybrid:
        text["rope_parameters"]["partial_rotary_factor"] = rotary
        text.update(full_attention_interval=HYBRID_FULL_ATTENTION_INTERVAL, linear_conv_kernel_dim=4,
                    linear_num_key_heads=kv_heads, linear_num_value_heads=heads, linear_key_head_dim=head_dim,
                    linear_value_head_dim=head_dim)  # fmt: skip
    grid = task.IMAGE_SIZE // PATCH
    vision = _vision_config(vision_hidden, vision_depth, hidden, num_position_embeddings=grid * grid)
    if not hybrid:  # Qwen3.5's vision tower has no deepstack mergers
        vision["deepstack_visual_indexes"] = list(range(min(2, vision_depth)))
    return _vlm_config(FAMILIES[family], tok, text, vision)


def build_scenes_config(
    tokenizer=None,
    hidden: int = 128,
    layers: int = 12,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    vision_hidden: int = 64,
    vision_depth: int = 4,
) -> PretrainedConfig:
    """demo-scenes: Qwen2.5-VL with `layers` decoder layers; the vision tower attends within windows of
    4 x 4 merged tokens (64 pixels) and across the whole image in its last two blocks."""
    tok = tokenizer if tokenizer is not None else build_tokenizer(scenes.vocabulary_words())
    half = head_dim // 2
    hw = (half * 3) // 8  # Qwen2.5-VL's [16, 24, 24] for head_dim 128
    rope = {"mrope_section": [half - 2 * hw, hw, hw]}
    text = _text_config(tok, hidden, layers, heads, kv_heads, head_dim, rope, max_position_embeddings=2048,
                        bos_token_id=None)  # fmt: skip
    full = list(range(vision_depth // 2, vision_depth))
    vision = _vision_config(vision_hidden, vision_depth, hidden, window_size=4 * MERGE * PATCH,
                            fullatt_block_indexes=full, tokens_per_second=2)  # fmt: skip
    return _vlm_config(Qwen2_5_VLConfig, tok, text, vision)


def _text_config(tok, hidden, layers, heads, kv_heads, head_dim, rope: dict, **extra) -> dict:
    """A demo decoder's text config: MLP width 4 x hidden, default M-RoPE with `rope`'s sections."""
    ids = tok.convert_tokens_to_ids
    return {"vocab_size": len(tok), "hidden_size": hidden, "intermediate_size": hidden * 4,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": head_dim, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, **rope},
            "pad_token_id": ids(PAD), "eos_token_id": ids(EOS), **extra}  # fmt: skip


def _vision_config(vision_hidden: int, depth: int, hidden: int, **extra) -> dict:
    """A demo vision tower: patch 8, spatial merge 2, temporal patch 2, heads of 32 channels."""
    return {"depth": depth, "hidden_size": vision_hidden, "intermediate_size": vision_hidden * 4,
            "num_heads": max(1, vision_hidden // 32), "in_channels": 3, "patch_size": PATCH,
            "spatial_merge_size": MERGE, "temporal_patch_size": TEMPORAL, "out_hidden_size": hidden,
            **extra}  # fmt: skip


def _vlm_config(config_cls: type, tok, text: dict, vision: dict) -> PretrainedConfig:
    return config_cls(text_config=text, vision_config=vision, **vision_ids(tok), tie_word_embeddings=False)


def build_model(config: PretrainedConfig | None = None, seed: int = 0):
    torch.manual_seed(seed)
    config = config if config is not None else build_config()
    model = AutoModelForImageTextToText.from_config(config)
    tc = model.config.text_config
    model.generation_config = GenerationConfig(eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id,
                                               do_sample=False, max_new_tokens=16)  # fmt: skip
    return model


DEMO_META = {"prompt_template": task.PROMPT_TEMPLATE, "image_first": True, "image_size": task.IMAGE_SIZE,
             "visual_tokens": VISUAL_TOKENS, "kinds": task.KINDS, "task": "demo"}  # fmt: skip


def save_checkpoint(
    model, folder: str | Path, meta: dict | None = None, tokenizer=None, image_processor=None
) -> Path:
    """Write the checkpoint folder atomically: into a temporary sibling, then swapped into place."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok = tokenizer if tokenizer is not None else build_tokenizer()
        tok.save_pretrained(tmp)
        (image_processor if image_processor is not None else build_image_processor()).save_pretrained(tmp)
        (tmp / "trimvlm.json").write_text(json.dumps({**DEMO_META, **(meta or {})}, indent=2) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a shipped folder is readable by all
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        old = None
        if folder.exists():
            old = folder.parent / f".{folder.name}.old-{os.getpid()}"
            os.replace(folder, old)
        os.replace(tmp, folder)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
