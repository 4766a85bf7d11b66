"""Tiny random LLaVA: a CLIP (default) or SigLIP vision tower, a two-layer projector, a Llama text model."""

from trimvlm.testing import text_config


def build(tok, hidden, layers, heads, kv_heads, vision_hidden, deepstack, vision="clip"):
    """`deepstack` is ignored (LLaVA has none). `vision` is "clip" (CLS dropped by the "default" feature
    strategy) or "siglip" (no CLS, "full" strategy)."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    image_size, patch = 48, 8  # 6 x 6 patches = 36 image tokens per image
    tower = dict(
        hidden_size=vision_hidden, intermediate_size=vision_hidden * 2, num_hidden_layers=2,
        num_attention_heads=2, image_size=image_size, patch_size=patch,
    )  # fmt: skip
    if vision == "clip":
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        tower.update(model_type="clip_vision_model", projection_dim=vision_hidden)
        strategy = "default"
        proc = CLIPImageProcessorPil(
            size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
        )
    elif vision == "siglip":
        from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

        tower.update(model_type="siglip_vision_model")
        strategy = "full"
        proc = SiglipImageProcessorPil(size={"height": image_size, "width": image_size})
    else:
        raise ValueError(f"vision must be 'clip' or 'siglip', got {vision!r}")
    cfg = LlavaConfig(
        vision_config=tower,
        text_config=text_config(tok, hidden, layers, heads, kv_heads, model_type="llama", pad_token_id=tok.pad_token_id,
                                bos_token_id=None, eos_token_id=tok.eos_token_id, tie_word_embeddings=False),
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        image_seq_length=(image_size // patch) ** 2,
        vision_feature_select_strategy=strategy,
        vision_feature_layer=-2,
        tie_word_embeddings=False,
    )  # fmt: skip
    return LlavaForConditionalGeneration(cfg), proc
