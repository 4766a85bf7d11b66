"""Tiny random Qwen3-VL (deepstack in the first `deepstack` layers)."""

from trimvlm.demo.model import qwen_image_processor, vision_ids


def build(tok, hidden, layers, heads, kv_heads, vision_hidden, deepstack):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    head_dim = hidden // heads
    cfg = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [head_dim // 4 - 2 * (head_dim // 16), head_dim // 16, head_dim // 16],
                             "mrope_interleaved": True},
        ),
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
