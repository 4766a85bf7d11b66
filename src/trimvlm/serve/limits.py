"""What one request to the server may ask for (`trimvlm serve --max-...`), checked before any model work."""

from __future__ import annotations

from dataclasses import dataclass

from trimvlm.decision import Limits
from trimvlm.errors import InputError

MiB = 1024 * 1024


@dataclass(frozen=True)
class ServerLimits:
    """`max_body_bytes`: the request body (413 past it); `max_images`: images per request (System One assets,
    chat `image_url` parts, score `images`); `max_image_bytes`: one encoded image; `max_questions`: questions
    per System One request; `max_candidates`: candidates per score request; `max_tokens`: the most a chat
    completion may ask for (`max_tokens` / `max_completion_tokens`); `default_max_tokens`: what it gets when it
    asks for none; `max_prefill_tokens`: prompt tokens admitted into one prefill between two decode steps (a
    longer prompt runs alone), so a burst of long prompts cannot stall the running streams for long."""

    max_body_bytes: int = 16 * MiB
    max_images: int = 8
    max_image_bytes: int = 8 * MiB
    max_questions: int = 64
    max_candidates: int = 64
    max_tokens: int = 256
    default_max_tokens: int = 32
    max_prefill_tokens: int = 4096

    def __post_init__(self):
        for name, v in vars(self).items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InputError(f"server limit {name} must be a positive integer, got {v!r}")
        if self.default_max_tokens > self.max_tokens:
            raise InputError(
                f"default_max_tokens ({self.default_max_tokens}) is above max_tokens ({self.max_tokens})"
            )

    def decision(self) -> Limits:
        """The limits `decision.prepare_request` checks (no local file paths: requests are remote)."""
        return Limits(
            max_questions=self.max_questions, max_assets=self.max_images,
            max_asset_bytes=self.max_image_bytes, allow_paths=False,
        )  # fmt: skip


@dataclass(frozen=True)
class Batching:
    """`max_batch`: requests (chat: running rows) per batch at most; `max_wait_ms`: how long a batch waits for
    requests still being read, after its first arrived."""

    max_batch: int = 32
    max_wait_ms: float = 10.0

    def __post_init__(self):
        if not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise InputError(f"--max-batch must be a positive integer, got {self.max_batch!r}")
        if not self.max_wait_ms >= 0:
            raise InputError(f"--max-wait-ms must be >= 0, got {self.max_wait_ms!r}")


@dataclass(frozen=True)
class CacheSizes:
    """The caches' bounds in MiB (0: off): vision features, System One prefixes and chat prompts, prepared
    requests (docs/serving.md, "Caches")."""

    vision_mb: float = 256
    prefix_mb: float = 512
    request_mb: float = 256

    def __post_init__(self):
        for flag in ("vision", "prefix", "request"):
            self.bytes(flag)

    def bytes(self, cache: str) -> int | None:
        """A cache's bound in bytes (None: the cache is off)."""
        mb = getattr(self, f"{cache}_mb")
        if isinstance(mb, bool) or not isinstance(mb, int | float) or not mb >= 0:
            raise InputError(f"--{cache}-cache-mb must be a number of MiB >= 0 (0: off), got {mb!r}")
        return int(mb * MiB) or None
