"""OpenAI's `stop`: up to 4 strings; generation ends where one first appears in the answer's text, and the
text from there on is not returned. `find` says where (the model thread ends the row there); `safe` says how
much of a growing text a stream may send: up to a match, and short of a tail that could still become one.
`token_start` places a token's text in the answer (the log-probabilities returned are those of the tokens whose
text begins before the cut)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopText:
    stops: tuple[str, ...]

    def find(self, text: str) -> int | None:
        """Where the first stop string begins in `text` (the earliest one), or None."""
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def safe(self, text: str) -> int:
        """How many characters of `text` may be sent: up to a match; else all but the longest tail that is the
        start of a stop string (it may complete with the next tokens)."""
        at = self.find(text)
        if at is not None:
            return at
        tails = (k for s in self.stops for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k]))
        return len(text) - max(tails, default=0)


def token_start(before: str, now: str) -> int:
    """Where the text of the newest token begins in `now` (the text with it), `before` the text without it: after
    `before` and the whitespace the decoding put between them."""
    rest = now[len(before) :]
    return len(before) + len(rest) - len(rest.lstrip())  # (lstrip: what `str.isspace` calls whitespace)
