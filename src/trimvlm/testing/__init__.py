"""Tiny random-weight checkpoints of each supported family, built offline from configs.

Used by the tests and the benchmarks: `tiny_checkpoint(family, folder)` writes a folder that `trimvlm.load`
and transformers' `from_pretrained` both read (config, fp32 safetensors, a word-level tokenizer, the image
processor). Sizes are arguments so the benchmarks can ask for bigger ones.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image  # noqa: F401

WORDS = (
    "what is the colour shape of a an in on at row column left right top bottom how many are there "
    "red green blue yellow white black grey circle square triangle yes no one two three four five six seven "
    "eight nine zero describe image picture text read list and or which answer question"
).split()
SPECIALS = [
    "<pad>", "<unk>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
    "<image>", "<fake_token_around_image>", "<global-img>",
]  # fmt: skip


def word_tokenizer(extra: list[str] | None = None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS + list(extra or []))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>",
        additional_special_tokens=SPECIALS[3:],
    )  # fmt: skip


def random_image(seed: int, size=(64, 64)) -> Image.Image:
    rng = np.random.default_rng(seed)
    w, h = size
    arr = (rng.random((h, w, 3)) * 255).astype(np.uint8)
    return Image.fromarray(arr)


# Text widths of real checkpoints for the benchmarks' `--width`: a random-weight model at that width (with few
# layers, so it runs in minutes) shows what the tiny shapes cannot: the same figures at a real matrix size.
REAL_WIDTHS = {"3b": dict(hidden=2048, heads=16, kv_heads=2)}  # Qwen2.5-VL-3B's text model


def text_config(tok, hidden, layers, heads, kv_heads, rope: dict | None = None, **extra) -> dict:
    """A tiny text model's config over `tok`'s vocabulary: MLP width 2 x hidden, 4096 positions; with `rope`:
    default RoPE (theta 10000) with those parameters added."""
    rope_kw = {} if rope is None else {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, **rope}}
    return dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096, **rope_kw,
                **extra)  # fmt: skip


FAMILIES = ("qwen3_vl", "qwen2_5_vl", "llava", "idefics3", "qwen3_5", "internvl")


def builder(family: str):
    """The `build(tok, hidden, layers, heads, kv_heads, vision_hidden, deepstack) -> (model, image_processor)`
    of one family, from `trimvlm/testing/tiny_<family>.py`."""
    import importlib

    if family not in FAMILIES:
        raise ValueError(f"no tiny builder for {family!r}; known: {FAMILIES}")
    return importlib.import_module(f"trimvlm.testing.tiny_{family}").build


def tiny_checkpoint(
    family: str,
    folder: str | Path,
    *,
    hidden: int = 64,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    vision_hidden: int = 32,
    deepstack: int = 1,
    seed: int = 0,
) -> Path:
    folder = Path(folder)
    torch.manual_seed(seed)
    tok = word_tokenizer()
    model, proc = builder(family)(tok, hidden, layers, heads, kv_heads, vision_hidden, deepstack)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    proc.save_pretrained(folder)
    return folder


def concurrent_runs(run, keys, repeats: int) -> dict:
    """Call `run(key)` `repeats` times for every key, one thread per key, with the interpreter switching threads
    often (so runs interleave inside a forward). Returns key -> list of results; an exception in a thread is
    raised here."""
    import sys
    from concurrent.futures import ThreadPoolExecutor

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        with ThreadPoolExecutor(max_workers=max(1, len(keys))) as pool:
            futures = {k: pool.submit(lambda k=k: [run(k) for _ in range(repeats)]) for k in keys}
    finally:
        sys.setswitchinterval(old)
    return {k: f.result() for k, f in futures.items()}
