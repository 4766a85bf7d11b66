"""Names both the runtime and the adapters use: the decoder layer types (transformers' `layer_types` values)."""

ATTENTION = "full_attention"  # softmax attention with a KV cache
LINEAR = "linear_attention"  # Gated DeltaNet (Qwen3.5): a recurrent state, no KV cache
