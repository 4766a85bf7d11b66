"""Tiny random Qwen2.5-VL: window attention in the vision tower (windows of 2x2 merged tokens), the last
vision block with full attention. `deepstack` is ignored (Qwen2.5-VL has none)."""

from trimvlm.demo.model import qwen_image_processor, vision_ids
from trimvlm.testing import text_config


def build(tok, hidden, layers, heads, kv_heads, vision_hidden, deepstack):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    patch, merge = 8, 2
    half = hidden // heads // 2  # rotary frequencies per head, split over (t, h, w)
    cfg = Qwen2_5_VLConfig(
        text_config=text_config(tok, hidden, layers, heads, kv_heads,
                                {"mrope_section": [half - 2 * (half // 4), half // 4, half // 4]},
                                bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
        vision_config=dict(
            depth=2, hidden_size=vision_hidden, intermediate_size=vision_hidden * 2, num_heads=2,
            patch_size=patch, spatial_merge_size=merge, temporal_patch_size=2, out_hidden_size=hidden,
            window_size=2 * merge * patch, fullatt_block_indexes=[1], tokens_per_second=2,
        ),
        **vision_ids(tok),
        tie_word_embeddings=False,
    )  # fmt: skip
    proc = qwen_image_processor(32 * 32, 512 * 512)
    return Qwen2_5_VLForConditionalGeneration(cfg), proc
