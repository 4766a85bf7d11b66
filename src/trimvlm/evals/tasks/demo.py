"""The synthetic demo tasks (`trimvlm.demo.task`): one question of every kind per image, image-major; `demo`
generates answers, `demo-candidates` scores each question's fixed candidates (exist: yes/no, mc: A-D, colour:
five colours and grey, count: 0-7, list / read: the answer and three near misses in a seeded order), and
`demo-decisions` asks each image's exist, mc and count questions as one System One request (a noul, a choice
and a score question: the kinds the demo's decision labels, yes/no, A-F and 0-9, can answer)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from trimvlm.demo import task as grid
from trimvlm.evals.items import CandidateItem, DecisionItem
from trimvlm.evals.tasks.base import Record, Task, register_task

DEMO_DEFAULT_ITEMS = 300
DEMO_METRICS = {
    "exist": "yesno",
    "mc": "option",
    "color": "exact",
    "count": "exact",
    "list": "exact",
    "read": "exact_strict",  # "7 A 3": the usual normalisation would delete the glyph "A" as an article
}


class DemoQuestion(NamedTuple):
    """One question of a drawn image: its item id, the sample (image and scene) and the question."""

    id: str
    sample: Any
    qa: Any


def demo_questions(limit: int | None, seed: int, split: str, generator=grid, default: int = DEMO_DEFAULT_ITEMS):
    """(the samples drawn, the first `limit` (default `default`) of their questions (`DemoQuestion`)): one
    of every kind per image, image-major, from `generator` (a task module: the grid task's unless given)."""
    n = limit if limit is not None else default
    samples = generator.generate_split(split, math.ceil(n / len(generator.KINDS)), seed=seed)
    questions = [DemoQuestion(f"{split}-{seed}-{i}-{qa.kind}", s, qa)
                 for i, s in enumerate(samples) for qa in s.qas if qa.kind in generator.KINDS]  # fmt: skip
    return samples, questions[:n]


def split_info(split: str, seed: int, samples) -> dict:
    return {"split": split, "seed": seed, "n_images": len(samples), "questions_per_kind": 1}


SPLITS = ("train", "val", "test")


def register_generated(name: str, about: str, generator, metrics: dict[str, str], default: int, caps):
    """Register the synthetic task `name` (generated answers; `caps(records)`: its full-pipeline kinds'
    generation caps) and `name-candidates` (the same questions, each scored over its fixed candidates): `limit`
    questions (default `default`) of `generator`'s `split`, one of every kind per image, image-major. Returns
    the two builders `(limit, seed, split) -> Task`."""
    candidates = f"{name}-candidates"

    @register_task(name, about, splits=SPLITS, candidates=candidates)
    def build(limit: int | None = None, seed: int = 0, split: str = "test") -> Task:
        samples, questions = demo_questions(limit, seed, split, generator, default)
        # scored by `metrics[kind]`; the options are already part of each question's text
        records = [Record(id=qid, images=[s.image], question=qa.question, answers=[qa.answer],
                          options=qa.options, probe=qa.probe, metric=metrics[qa.kind], kind=qa.kind,
                          prompt=qa.question) for qid, s, qa in questions]  # fmt: skip
        kind_caps = caps(records)
        return Task(name=name, records=records, max_new_tokens=max(kind_caps.values()), prefill_tokens=1,
                    info=split_info(split, seed, samples), kind_max_new_tokens=kind_caps)  # fmt: skip

    @register_task(candidates, f"the {name} task's questions, each scored over its fixed candidates", splits=SPLITS)
    def build_candidates(limit: int | None = None, seed: int = 0, split: str = "test") -> Task:
        samples, questions = demo_questions(limit, seed, split, generator, default)
        items = [CandidateItem(id=qid, image=s.image, question=qa.question, candidates=list(qa.candidates),
                               answer=qa.candidates.index(qa.answer), kind=qa.kind)
                 for qid, s, qa in questions]  # fmt: skip
        return Task(name=candidates, records=items, max_new_tokens=1, info=split_info(split, seed, samples))

    return build, build_candidates


def _demo_caps(records: list[Record]) -> dict[str, int]:
    """The longest possible answer plus its end token (a list names at most MAX_OBJECTS colours; a drawn string
    has 3-4 glyphs), never below the longest reference here + 1, so a truncated answer can never equal a
    reference. A model that answers right always stops before the cap."""
    longest = {k: max((len(r.answers[0].split()) for r in records if r.kind == k), default=0) for k in grid.KINDS}
    return {"list": max(grid.MAX_OBJECTS, longest["list"]) + 1, "read": max(4, longest["read"]) + 1}


demo_task, demo_candidate_task = register_generated(
    "demo", "the synthetic demo task: generated answers (300 test questions)", grid, DEMO_METRICS,
    DEMO_DEFAULT_ITEMS, _demo_caps)  # fmt: skip


DECISION_KINDS = ("exist", "mc", "count")


def _decision_question(qa) -> tuple[dict, str]:
    """(the System One question, its expected answer) of one demo question."""
    if qa.kind == "exist":
        return {"type": "noul", "instructions": qa.question}, qa.answer
    if qa.kind == "count":
        return {"type": "score", "instructions": qa.question, "criteria": list(qa.candidates)}, qa.answer
    letters = list(qa.candidates)  # mc: A-D, the options written after the question by the decision template
    stem = qa.question[: qa.question.index(f" {letters[0]} {qa.options[0]}")]
    return {"type": "choice", "instructions": stem, "criteria": dict(zip(letters, qa.options, strict=True))}, qa.answer


@register_task("demo-decisions", "the demo images as System One requests: exist, mc and count questions each",
               splits=SPLITS)  # fmt: skip
def demo_decision_task(limit: int | None = None, seed: int = 0, split: str = "test") -> Task:
    """`limit` requests (default 100), one per image of the demo task's `split`, with three questions each."""
    n = limit if limit is not None else DEMO_DEFAULT_ITEMS // 3
    items = []
    for i, s in enumerate(grid.generate_split(split, n, seed=seed)):
        asked = {qa.kind: _decision_question(qa) for qa in s.qas if qa.kind in DECISION_KINDS}
        request = {"state": "<img>", "questions": {k: q for k, (q, _) in asked.items()}, "assets": {"<img>": s.image}}
        items.append(DecisionItem(id=f"{split}-{seed}-{i}", request=request, answers={k: a for k, (_, a) in asked.items()}))
    info = {"split": split, "seed": seed, "n_images": n, "questions_per_request": len(DECISION_KINDS)}
    return Task(name="demo-decisions", records=items, max_new_tokens=1, info=info)
