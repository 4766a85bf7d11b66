"""The branch layout: prefix P = images + question through the model's prompt template (or chat template);
candidate suffix R_i = open marker + candidate tokens + close marker, every suffix starting at the same
position (the prefix's next one), so scores do not depend on candidate order.

Markers come from the checkpoint's `trimvlm.json` (`candidate_open`, `candidate_close`, strings) and default to
no open marker and the end-of-sequence token as the close marker (the answer ends where the model would stop),
which is what the demo models were trained to produce after `<ans>`.
"""

from __future__ import annotations

from dataclasses import dataclass

from trimvlm.errors import InputError


@dataclass
class Layout:
    open_ids: list[int]
    close_ids: list[int]
    unk_id: int | None
    max_positions: int | None

    @classmethod
    def for_adapter(cls, adapter) -> Layout:
        tok = adapter.tokenizer
        open_text = adapter.meta.get("candidate_open", "")
        close_text = adapter.meta.get("candidate_close")
        close = _ids(tok, close_text) if close_text is not None else [tok.eos_token_id]
        return cls(
            open_ids=_ids(tok, open_text),
            close_ids=[i for i in close if i is not None],
            unk_id=tok.unk_token_id if getattr(tok, "unk_token", None) else None,
            max_positions=adapter.max_positions,
        )

    def encode(self, tokenizer, candidate, index: int) -> list[int]:
        """The suffix ids of one candidate; refuses what cannot be scored faithfully."""
        if not isinstance(candidate, str):
            raise InputError(f"candidate {index} is {type(candidate).__name__}, not a string")
        if not candidate.strip():
            raise InputError(f"candidate {index} is empty; every candidate needs at least one token")
        ids = _ids(tokenizer, candidate)
        if not ids:
            raise InputError(f"candidate {index} ({candidate!r}) encodes to no tokens")
        if self.unk_id is not None and self.unk_id in ids:
            raise InputError(
                f"candidate {index} ({candidate!r}) holds words this tokenizer does not know (they would all "
                "score as the unknown token); use words from the model's vocabulary"
            )
        return self.open_ids + ids + self.close_ids

    @property
    def first_counted(self) -> int:
        """Index of a suffix's first scored token: the open marker is the same for every candidate."""
        return len(self.open_ids)


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def check_length(layout: Layout, prefix_len: int, suffix: list[int], request: int, index: int) -> None:
    if layout.max_positions is not None and prefix_len + len(suffix) > layout.max_positions:
        raise InputError(
            f"request {request}, candidate {index}: prefix ({prefix_len} tokens) + candidate ({len(suffix)} "
            f"tokens) exceeds the model's context of {layout.max_positions} positions; shorten it"
        )
