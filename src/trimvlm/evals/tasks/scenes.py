"""The scenes tasks (`trimvlm.demo.scenes`, the demo-scenes model's task): `scenes` generates answers (one
question of every kind per image, image-major; 600 test questions = 100 images by default) and
`scenes-candidates` scores each question's fixed candidates (exist and relation: yes/no, count: 0-8, colour:
the five colours, largest: its option letters, read: the string and three near misses in a seeded order)."""

from __future__ import annotations

from trimvlm.evals.tasks.base import Task, register_task
from trimvlm.evals.tasks.demo import SPLITS, candidate_items, demo_questions, question_records, split_info

SCENES_DEFAULT_ITEMS = 600
SCENES_METRICS = {
    "exist": "yesno",
    "count": "exact",
    "color": "exact",
    "relation": "yesno",
    "largest": "option",
    "read": "exact_strict",  # "7 A 3": the usual normalisation would delete the glyph "A" as an article
}
READ_CAP = 5  # the longest string (4 glyphs) and its end token


def _questions(limit, seed, split):
    from trimvlm.demo import scenes

    return demo_questions(limit, seed, split, generator=scenes, default=SCENES_DEFAULT_ITEMS)


@register_task("scenes", "the scenes task (160-400 visual tokens, objects spanning many): generated answers "
               "(600 test questions)", splits=SPLITS, candidates="scenes-candidates")  # fmt: skip
def scenes_task(limit: int | None = None, seed: int = 0, split: str = "test") -> Task:
    """`limit` questions (default 600) of the scenes task's `split`, one of every kind per image."""
    samples, questions = _questions(limit, seed, split)
    return Task(name="scenes", records=question_records(questions, SCENES_METRICS), max_new_tokens=READ_CAP,
                prefill_tokens=1, info=split_info(split, seed, samples), kind_max_new_tokens={"read": READ_CAP})  # fmt: skip


@register_task("scenes-candidates", "the scenes task's questions, each scored over its fixed candidates",
               splits=SPLITS)  # fmt: skip
def scenes_candidate_task(limit: int | None = None, seed: int = 0, split: str = "test") -> Task:
    """`limit` candidate questions (default 600) of the scenes task's `split`, one of every kind per image."""
    samples, questions = _questions(limit, seed, split)
    return Task(name="scenes-candidates", records=candidate_items(questions), max_new_tokens=1,
                info=split_info(split, seed, samples))  # fmt: skip
