"""Word-level tokenizer for a demo task (every word the task can produce, plus Qwen-style specials)."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

from trimvlm.demo.task import vocabulary_words

PAD = "<pad>"
UNK = "<unk>"
EOS = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
SPECIALS = [PAD, UNK, EOS, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]


def build_vocab(words: list[str] | None = None) -> dict[str, int]:
    """The specials, then `words` (default: the grid task's vocabulary)."""
    words = SPECIALS + (words if words is not None else vocabulary_words())
    return {w: i for i, w in enumerate(words)}


def build_tokenizer(words: list[str] | None = None) -> PreTrainedTokenizerFast:
    """A `PreTrainedTokenizerFast` over a WordLevel model split on whitespace; no BOS/EOS added."""
    tok = Tokenizer(WordLevel(vocab=build_vocab(words), unk_token=UNK))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        unk_token=UNK,
        eos_token=EOS,
        additional_special_tokens=[VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD],
    )
    fast.padding_side = "left"
    return fast


def vision_ids(tok) -> dict[str, int]:
    """The special-token ids a Qwen-VL config names, from `tok`."""
    ids = tok.convert_tokens_to_ids
    return {"image_token_id": ids(IMAGE_PAD), "video_token_id": ids(VIDEO_PAD),
            "vision_start_token_id": ids(VISION_START), "vision_end_token_id": ids(VISION_END)}  # fmt: skip
