"""The scenes tasks (`trimvlm.demo.scenes`, the demo-scenes model's task): `scenes` generates answers (one
question of every kind per image, image-major; 600 test questions = 100 images by default) and
`scenes-candidates` scores each question's fixed candidates (exist and relation: yes/no, count: 0-8, colour:
the five colours, largest: its option letters, read: the string and three near misses in a seeded order)."""

from __future__ import annotations

from trimvlm.demo import scenes
from trimvlm.evals.tasks.demo import register_generated

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


scenes_task, scenes_candidate_task = register_generated(
    "scenes", "the scenes task (160-400 visual tokens, objects spanning many): generated answers (600 test "
    "questions)", scenes, SCENES_METRICS, SCENES_DEFAULT_ITEMS, lambda records: {"read": READ_CAP})  # fmt: skip
