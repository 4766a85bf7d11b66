"""Tiny random Idefics3 (SigLIP-style vision tower, pixel shuffle connector, Llama text model).

Each image is one global tile (no splitting) of 32x32 pixels, 4x4-pixel patches, pixel shuffle by 2: 16 LLM
tokens per image on a 4x4 grid. `deepstack` is ignored (Idefics3 has none).
"""

from trimvlm.testing import text_config

TILE, PATCH, SCALE = 32, 4, 2


def build(tok, hidden, layers, heads, kv_heads, vision_hidden, deepstack):
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil

    cfg = Idefics3Config(
        text_config=text_config(tok, hidden, layers, heads, kv_heads, {}, model_type="llama", head_dim=hidden // heads,
                                pad_token_id=tok.pad_token_id, tie_word_embeddings=False),
        vision_config=dict(
            hidden_size=vision_hidden, intermediate_size=vision_hidden * 2, num_hidden_layers=2,
            num_attention_heads=2, image_size=TILE, patch_size=PATCH,
        ),
        scale_factor=SCALE,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )  # fmt: skip
    proc = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": 2 * TILE}, max_image_size={"longest_edge": TILE}
    )
    return Idefics3ForConditionalGeneration(cfg), proc
