"""Tiny random InternVL (InternViT-style vision tower with a CLS token, pixel-shuffle MLP projector, Qwen2
text model with 1-D RoPE).

Each image is one tile of 32x32 pixels (tiling is switched off with `max_patches=1`), 4x4-pixel patches (8x8,
the CLS token dropped), pixel shuffle by 0.5: 16 LLM tokens per image on a 4x4 grid. The tokenizer gains
InternVL's `<img>`, `</img>` and `<IMG_CONTEXT>` tokens. `deepstack` is ignored (InternVL has none).
"""

from trimvlm.testing import text_config

TILE, PATCH = 32, 4
START, END, CONTEXT = "<img>", "</img>", "<IMG_CONTEXT>"


def build(tok, hidden, layers, heads, kv_heads, vision_hidden, deepstack):
    from transformers import InternVLConfig, InternVLForConditionalGeneration
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    missing = [t for t in (START, END, CONTEXT) if tok.convert_tokens_to_ids(t) in (None, tok.unk_token_id)]
    if missing:
        tok.add_tokens(missing, special_tokens=True)
    cfg = InternVLConfig(
        text_config=text_config(tok, hidden, layers, heads, kv_heads, {}, model_type="qwen2", head_dim=hidden // heads,
                                pad_token_id=tok.pad_token_id, bos_token_id=None, eos_token_id=tok.eos_token_id,
                                tie_word_embeddings=False),
        vision_config=dict(
            hidden_size=vision_hidden, intermediate_size=vision_hidden * 2, num_hidden_layers=2,
            num_attention_heads=2, image_size=TILE, patch_size=PATCH,
        ),
        downsample_ratio=0.5,
        image_token_id=tok.convert_tokens_to_ids(CONTEXT),
        image_seq_length=(TILE // PATCH // 2) ** 2,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )  # fmt: skip
    proc = GotOcr2ImageProcessorPil(
        size={"height": TILE, "width": TILE}, crop_to_patches=False, min_patches=1, max_patches=1
    )
    return InternVLForConditionalGeneration(cfg), proc
