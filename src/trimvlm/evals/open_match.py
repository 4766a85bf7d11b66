"""A local stand-in for MM-Vet's grader: does the open answer contain the reference?

THIS IS NOT MM-VET'S METRIC. MM-Vet scores each answer with a GPT-4 judge (0.0 .. 1.0, partial credit for
long descriptions); no judge can be reached here. This metric only says whether the reference's words occur
in the answer, so its numbers are not comparable with published MM-Vet scores; use them to compare recipes
against the baseline on the same items (mismatch, relative drops), not as MM-Vet results.

Rule: both texts are normalised (lowercase, punctuation removed, articles a/an/the dropped, spaces
collapsed: `normalize_answer`). A reference part is found when its normalised words occur as a contiguous
run of whole words in the normalised answer. MM-Vet's references may join parts with `<OR>` (any part found
scores 1) or `<AND>` (the score is the share of parts found, as the judge's examples give 0.5 for one of
two). A long free-text reference (MM-Vet's "gen" questions) is almost never contained: those items score 0
unless the answer repeats it."""

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
