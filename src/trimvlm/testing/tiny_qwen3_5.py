"""Tiny random Qwen3.5: hybrid text stack, three Gated DeltaNet (linear attention) layers then one gated
full-attention layer, repeated (`full_attention_interval` = 4, as the real checkpoints). Qwen3.5's vision
tower has no deepstack features, so `deepstack` is accepted for a uniform signature and ignored."""

from trimvlm.demo.model import qwen_image_processor, vision_ids
from trimvlm.testing import text_config


def build(tok, hidden, layers, heads, kv_heads, vision_hidden, deepstack):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    head_dim = hidden // heads
    rotary = 0.5  # partial rotary factor: M-RoPE rotates the first head_dim * rotary dims
    n_freq = int(head_dim * rotary) // 2
    linear_heads = max(1, heads // 2)
    cfg = Qwen3_5Config(
        text_config=text_config(
            tok, hidden, layers, heads, kv_heads, {"partial_rotary_factor": rotary, "mrope_interleaved": True,
                                                   "mrope_section": [n_freq - 2 * (n_freq // 4), n_freq // 4, n_freq // 4]},
            head_dim=head_dim, full_attention_interval=4, linear_conv_kernel_dim=4, linear_num_key_heads=linear_heads,
            linear_num_value_heads=2 * linear_heads, linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
        ),
        vision_config=dict(
            depth=2, hidden_size=vision_hidden, intermediate_size=vision_hidden * 2, num_heads=2, patch_size=8,
            spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=hidden, num_position_embeddings=256,
        ),
        **vision_ids(tok),
        tie_word_embeddings=False,
    )  # fmt: skip
    proc = qwen_image_processor(32 * 32, 512 * 512)
    return Qwen3_5ForConditionalGeneration(cfg), proc
