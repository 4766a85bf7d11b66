"""Per-request limits of `decide` (a server passes its own)."""

from __future__ import annotations

from dataclasses import dataclass

from trimvlm.errors import InputError
from trimvlm.options import is_int


@dataclass(frozen=True)
class Limits:
    """`max_questions`: questions per request (`transformers serve` allows 64); `max_assets`: images per request;
    `max_asset_bytes`: the size of one encoded image (base64 text or file); `max_prompt_tokens`: tokens of one
    prompt after the images are expanded (None: none but the model's positions, which are always checked);
    `allow_paths`: whether an asset may be a local file path (a server that answers remote requests turns it
    off: an asset's text is then base64 or a data URL, and no file is looked up)."""

    max_questions: int = 64
    max_assets: int = 16
    max_asset_bytes: int = 32 * 1024 * 1024
    max_prompt_tokens: int | None = None
    allow_paths: bool = True

    def __post_init__(self):
        for name in ("max_questions", "max_assets", "max_asset_bytes", "max_prompt_tokens"):
            v = getattr(self, name)
            if not (v is None and name == "max_prompt_tokens") and not (is_int(v) and v >= 1):
                raise InputError(f"limit {name} must be a positive integer, got {v!r}")
