"""VQA accuracy (VQA v2 / TextVQA / VizWiz) with the official answer normalisation, written from the
evaluation's public description (visualqa.org, "Evaluation"; docs/benchmarks.md#metrics states the rule).

The official contraction table's keys for "I'd", "I'm", "I've" are capitalised and never match lowercased text,
and forms that are also plain words ("well", "were", "shed", "its", ...) are not in it: those are left alone
here too. The official scorer normalises punctuation only when the human answers differ from each other; this
one normalises every time (as the EvalAI TextVQA server's answer processor does), so "yes." scores like "yes".
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence

_PUNCT = ";/[]\"{}()=+\\_-><@`,?!"  # each deleted or made a space (step 2)
_DIGIT_COMMA = re.compile(r"\d,\d")
_PERIOD = re.compile(r"\.(?!\d)")
NUMBER_WORDS = {
    "none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
    "seven": "7", "eight": "8", "nine": "9", "ten": "10",
}  # fmt: skip
ARTICLES = {"a", "an", "the"}
# contractions in their written form; each is also reached from its spellings with apostrophes left out
_WRITTEN = """ain't aren't can't could've couldn't couldn't've didn't doesn't don't hadn't hadn't've hasn't haven't
he'd he'd've he's how'd how'll how's isn't it'd it'd've it'll let's ma'am mightn't mightn't've might've
mustn't must've needn't not've o'clock oughtn't shan't she'd she'd've she'll she's should've shouldn't
shouldn't've somebody'd somebody'd've somebody'll somebody's someone'd someone'd've someone'll someone's
something'd something'd've something'll that's there'd there'd've there're there's they'd they'd've they'll
they're they've 'twas wasn't we'd've we're we've weren't what'll what're what's what've when's where'd where's
where've who'd who'd've who'll who's who've why'll why're why's won't would've wouldn't wouldn't've y'all
y'all'll y'all'd've you'd you'd've you'll you're you've""".split()
_KEEP_AS_IS = {"well", "were", "wed", "shed", "hell", "shell", "ill", "id", "its"}  # plain words too


def _spellings(written: str) -> set[str]:
    """Every spelling of a contraction with one or more of its apostrophes left out."""
    parts = written.split("'")
    out = set()
    for keep in itertools.product((True, False), repeat=len(parts) - 1):
        text = parts[0] + "".join(("'" if k else "") + p for k, p in zip(keep, parts[1:], strict=True))
        if text != written:
            out.add(text)
    return out


CONTRACTIONS = {s: w for w in _WRITTEN for s in _spellings(w) if s not in _KEEP_AS_IS}


def normalize_vqa_answer(text: str) -> str:
    """The official VQA normalisation of one answer: punctuation, lowercase, number words, articles, contractions."""
    text = str(text).replace("\n", " ").replace("\t", " ").strip()
    delete_all = _DIGIT_COMMA.search(text) is not None
    for p in _PUNCT:  # deleted beside a space (or in a number with a comma), else made a space
        text = text.replace(p, "" if delete_all or (p + " ") in text or (" " + p) in text else " ")
    text = _PERIOD.sub("", text)
    words = []
    for w in text.lower().split():
        w = NUMBER_WORDS.get(w, w)
        if w not in ARTICLES:
            words.append(CONTRACTIONS.get(w, w))
    return " ".join(words)


def vqa_accuracy(prediction: str, answers: Sequence[str]) -> float:
    """min(1, matches among the other humans / 3), averaged over leaving out each human answer in turn.

    With 10 answers this is the official rule; with one reference it is plain (normalised) exact match."""
    gts = [normalize_vqa_answer(a) for a in answers]
    if not gts:
        return 0.0
    p = normalize_vqa_answer(prediction)
    if len(gts) == 1:
        return float(p == gts[0])
    hits = [g == p for g in gts]
    total = sum(hits)
    return sum(min(1.0, (total - h) / 3) for h in hits) / len(gts)
