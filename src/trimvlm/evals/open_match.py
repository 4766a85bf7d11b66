"""A local stand-in for MM-Vet's grader: does the open answer contain the reference?

THIS IS NOT MM-VET'S METRIC (a GPT-4 judge grades MM-Vet; none can be reached here): its numbers compare recipes
with the baseline on the same items, never with published MM-Vet scores (docs/benchmarks.md#metrics). A
reference part is found when its normalised words occur as a contiguous run of whole words in the normalised
answer; `<OR>` joins alternatives, `<AND>` parts each worth their share. A long free-text reference is almost
never contained: such items score 0 unless the answer repeats it."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def _found(part: str, answer: str, norm: Callable[[str], str]) -> bool:
    p = norm(part)
    return bool(p) and f" {p} " in f" {answer} "


def open_match(prediction: str, references: Sequence[str], norm: Callable[[str], str]) -> float:
    """Max over references of the share of `<AND>` parts (or any `<OR>` part) found in the prediction."""
    answer = norm(prediction)
    best = 0.0
    for ref in references:
        if "<AND>" in ref:
            parts = [p for p in ref.split("<AND>") if p.strip()]
            score = sum(_found(p, answer, norm) for p in parts) / len(parts) if parts else 0.0
        else:
            score = float(any(_found(p, answer, norm) for p in ref.split("<OR>")))
        best = max(best, score)
    return best
