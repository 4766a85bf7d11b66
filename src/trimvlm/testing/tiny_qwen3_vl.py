"""Tiny random Qwen3-VL (deepstack in the first `deepstack` layers)."""

from trimvlm.demo.model import qwen_image_processor, vision_ids
from trimvlm.testing import text_config


def build(tok, hidden, layers, heads, kv_heads, vision_hidden, deepstack):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    head_dim = hidden // heads
    cfg = Qwen3VLConfig(
        text_config=text_config(tok, hidden, layers, heads, kv_heads, {
            "mrope_section": [head_dim // 4 - 2 * (head_dim // 16), head_dim // 16, head_dim // 16],
            "mrope_interleaved": True}, head_dim=head_dim),
        vision_config=dict(
            depth=2, hidden_size=vision_hidden, intermediate_size=vision_hidden * 2, num_heads=2, patch_size=8,
            spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=hidden, num_position_embeddings=256,
            deepstack_visual_indexes=list(range(deepstack)),
        ),
        **vision_ids(tok),
        tie_word_embeddings=False,
    )  # fmt: skip
    proc = qwen_image_processor(32 * 32, 512 * 512)
    return Qwen3VLForConditionalGeneration(cfg), proc
