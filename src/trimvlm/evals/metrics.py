"""Answer metrics and prediction mismatch (docs/benchmarks.md#metrics describes each one's rule).

Every metric scores one prediction against one record (a number in [0, 1]), gives a canonical form of a
prediction (what "the same answer" means for that metric, used for mismatch against the baseline), and may add
task-level numbers (`summary`, e.g. F1 for yes/no). `exact` normalises as SQuAD/VQA scoring does (lowercase,
punctuation and the articles a/an/the removed, whitespace collapsed); `exact_strict` only collapses whitespace,
for answers the usual normalisation destroys (a read-out "7 A 3": the glyph "A" is an article). `option`,
`yesno`, `anls`, `vqa` (`trimvlm.evals.vqa_accuracy`), `relaxed` (`trimvlm.evals.relaxed_accuracy`) and
`open_match` (`trimvlm.evals.open_match`: a local containment check, NOT MM-Vet's GPT-4 grader) follow the rules
there. `mismatch_pct` compares predictions with the uncompressed model's in the metric's canonical form.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from trimvlm.errors import InputError
from trimvlm.evals.open_match import open_match
from trimvlm.evals.relaxed_accuracy import relaxed_accuracy
from trimvlm.evals.vqa_accuracy import normalize_vqa_answer, vqa_accuracy

OPTION_LETTERS = string.ascii_uppercase
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def collapse(text: str) -> str:
    return " ".join(str(text).split())


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation, drop the articles a/an/the, collapse whitespace (SQuAD/VQA style)."""
    text = str(text).lower()
    text = "".join(" " if ch in _PUNCT else ch for ch in text)
    text = _ARTICLES.sub(" ", text)
    return collapse(text)


def _refs(references: str | Sequence[str]) -> list[str]:
    return [references] if isinstance(references, str) else list(references)


def exact_match(prediction: str, references: str | Sequence[str]) -> float:
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(r) for r in _refs(references)))


def exact_strict(prediction: str, references: str | Sequence[str]) -> float:
    p = collapse(prediction)
    return float(any(p == collapse(r) for r in _refs(references)))


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insert, delete, substitute; each costs 1)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def anls(prediction: str, references: str | Sequence[str], threshold: float = 0.5) -> float:
    """ANLS of one prediction: max over references of (1 - NL if NL < threshold else 0)."""
    p = collapse(prediction).lower()
    best = 0.0
    for r in _refs(references):
        r = collapse(r).lower()
        longest = max(len(p), len(r))
        nl = levenshtein(p, r) / longest if longest else 0.0
        best = max(best, 1.0 - nl if nl < threshold else 0.0)
    return best


def option_index(prediction: str, options: Sequence[str]) -> int | None:
    """Which option a prediction names, or None (docs/benchmarks.md#metrics gives the order of the rules)."""
    raw = str(prediction).strip()
    n = len(options)
    m = re.match(r"^\(?([A-Za-z])(?:[).:,]|\s|$)", raw)
    if m:
        letter = m.group(1)
        k = OPTION_LETTERS.find(letter.upper())
        # a lowercase leading "a" followed by more words is the article, not option A
        bare = collapse(raw.strip(string.punctuation + " ")) == letter
        if 0 <= k < n and (letter.isupper() or bare):
            return k
    norm, norms = normalize_answer(raw), [normalize_answer(o) for o in options]
    if norm and norm in norms:
        return norms.index(norm)
    return _letter_in_text(raw, norms) if n else None


_NAMED = (
    re.compile(  # "answer is (B)", "Answer: B", "option b." ; a lowercase letter only in parentheses or last
        r"\b(?i:answer|option|choice)\s*(?i:is|would be)?\s*:?\s*"
        r"(?:\(([A-Za-z])\)|([A-Z])\b|([a-z])(?=[).:,]?\s*$))"
    )
)


def _letter_in_text(raw: str, norms: Sequence[str]) -> int | None:
    """A letter named in free text, or the one option whose text (`norms`: each normalised) the answer
    contains; else None."""
    n = len(norms)
    letters = set(OPTION_LETTERS[:n])
    m = _NAMED.search(raw)
    if m:
        k = OPTION_LETTERS.find(next(g for g in m.groups() if g).upper())
        if 0 <= k < n:
            return k
    paren = {x.upper() for x in re.findall(r"\(([A-Za-z])\)", raw)} & letters
    if len(paren) == 1:
        return OPTION_LETTERS.find(paren.pop())
    words = raw.split()
    lone = {w.strip(string.punctuation) for w in words} & letters
    if len(lone) == 1:
        letter = lone.pop()
        if not (letter == "A" and len(words) > 3):  # "A" inside a sentence: the article
            return OPTION_LETTERS.find(letter)
    text = f" {normalize_answer(raw)} "
    found = [k for k, o in enumerate(norms) if o and f" {o} " in text]
    longest = max(found, key=lambda k: len(norms[k]), default=None)
    # one option named, or one whose text holds every other one found ("red" inside "dark red")
    if longest is not None and all(norms[k] in norms[longest] for k in found):
        return longest
    return None


def yes_no(prediction: str) -> str | None:
    """'yes' / 'no' from a prediction: its first word, else any yes / no / not in it (POPE's rule), else None."""
    words = normalize_answer(prediction).split()
    if words and words[0] in ("yes", "no"):
        return words[0]
    if "yes" in words:
        return "yes"
    if "no" in words or "not" in words:
        return "no"
    return None


def yes_no_f1(predictions: Sequence[str | None], golds: Sequence[str]) -> dict[str, float]:
    """Accuracy, precision, recall and F1 with 'yes' as the positive class; predicted_yes_ratio = the share of
    the model's answers that are 'yes' (the POPE paper's yes-ratio; lmms-eval's `pope_yes_ratio` is the share of
    *gold* answers that are 'yes', a property of the data).

    A prediction that is neither yes nor no counts as wrong and as not-yes."""
    if len(predictions) != len(golds):
        raise InputError(f"{len(predictions)} predictions for {len(golds)} references")
    counts = Counter((p == "yes", g == "yes") for p, g in zip(predictions, golds, strict=True))
    tp, fp, fn = counts[True, True], counts[True, False], counts[False, True]
    correct = sum(p == g for p, g in zip(predictions, golds, strict=True))
    n = len(golds)
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {
        "accuracy": correct / n if n else 0.0,
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "predicted_yes_ratio": (tp + fp) / n if n else 0.0,
    }


@dataclass(frozen=True)
class Metric:
    """One metric: `score(prediction, answers, options)` of an item, the `canonical(prediction, options)` form of a
    prediction (what "the same answer" means for mismatch), task-level `summary(predictions, answers, options)`
    numbers."""

    name: str
    score: Callable[..., float]
    canonical: Callable[..., Hashable] = lambda prediction, options=None: normalize_answer(prediction)
    summary: Callable[..., dict[str, float]] = lambda predictions, answers, options: {}


def option_gold(answers: Sequence[str], options: Sequence[str]) -> int:
    """The option the references name (the first that names one)."""
    for a in answers:
        k = option_index(a, options)
        if k is not None:
            return k
    raise InputError(f"reference answer {list(answers)!r} names none of the options {list(options)!r}")


def _option_score(prediction, answers, options=None) -> float:
    if not options:
        raise InputError("metric 'option' needs the item's options; this item has none")
    return float(option_index(prediction, options) == option_gold(answers, options))


def _option_canonical(prediction, options=None):
    k = option_index(prediction, options or [])
    return k if k is not None else normalize_answer(prediction)


def _yes_no_score(prediction, answers, options=None) -> float:
    p = yes_no(prediction)
    return float(p is not None and p in {yes_no(a) for a in answers})


def _yes_no_canonical(prediction, options=None):
    p = yes_no(prediction)
    return p if p is not None else normalize_answer(prediction)


def _yes_no_summary(predictions, answers, options) -> dict[str, float]:
    s = yes_no_f1([yes_no(p) for p in predictions], [yes_no(a[0]) or "" for a in answers])
    return {k: v for k, v in s.items() if k != "accuracy"}


METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        Metric("exact", lambda p, answers, options=None: exact_match(p, answers)),
        Metric("exact_strict", lambda p, answers, options=None: exact_strict(p, answers),
               lambda p, options=None: collapse(p)),
        Metric("option", _option_score, _option_canonical),
        Metric("yesno", _yes_no_score, _yes_no_canonical, _yes_no_summary),
        Metric("anls", lambda p, answers, options=None: anls(p, answers), lambda p, options=None: collapse(p).lower()),
        # TextVQA / VQA v2: min(1, #humans / 3) over the 10 leave-one-out subsets, official normalisation
        Metric("vqa", lambda p, answers, options=None: vqa_accuracy(p, answers),
               lambda p, options=None: normalize_vqa_answer(p)),
        # ChartQA: numbers within 5% of the reference, exact (case-insensitive) match otherwise
        Metric("relaxed", lambda p, answers, options=None: relaxed_accuracy(p, answers),
               lambda p, options=None: str(p).strip().lower()),
        # MM-Vet-style open answers, locally: the reference's words contained in the answer (not the GPT-4 grader)
        Metric("open_match", lambda p, answers, options=None: open_match(p, answers, normalize_answer)),
    )
}  # fmt: skip


def get_metric(name: str) -> Metric:
    metric = METRICS.get(str(name))
    if metric is None:
        raise InputError(f"unknown metric {name!r}; known metrics: {', '.join(sorted(METRICS))}")
    return metric


def mismatch_pct(
    predictions: Sequence[str],
    baseline: Sequence[str],
    metric: str | Metric = "exact",
    options: Sequence[Sequence[str] | None] | None = None,
) -> float:
    """% of items whose prediction differs (in the metric's canonical form) from the baseline's prediction."""
    if len(predictions) != len(baseline):
        raise InputError(f"{len(predictions)} predictions for {len(baseline)} baseline predictions")
    if not predictions:
        return 0.0
    m = get_metric(metric) if isinstance(metric, str) else metric
    opts: Sequence[Any] = options if options is not None else [None] * len(predictions)
    diff = sum(
        m.canonical(p, o) != m.canonical(b, o) for p, b, o in zip(predictions, baseline, opts, strict=True)
    )
    return 100.0 * diff / len(predictions)
