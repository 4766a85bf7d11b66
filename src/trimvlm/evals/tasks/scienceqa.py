"""ScienceQA-IMG (Lu et al. 2022): the ScienceQA questions that come with an image; multiple choice, the
row's `hint` its context and its `subject` its kind. Rows without an image are skipped, so the full ScienceQA
configuration reads as ScienceQA-IMG too. Columns, prompt (lmms-eval's), probe and metric:
docs/benchmarks.md#tasks.
"""

from __future__ import annotations

from trimvlm.evals.tasks.base import OPTION_INSTRUCTION, option_lines
from trimvlm.evals.tasks.benchmark import (
    Benchmark,
    missing,
    option_letter,
    register_benchmark,
    string_list,
    text,
)


def make(row: dict, where: str) -> dict:
    question = text(row, "question", where)
    choices = string_list(row, "choices", where)
    letter = option_letter(row.get("answer"), len(choices), where)
    hint = row.get("hint")
    context = "" if missing(hint) else f"Context: {hint}\n"
    prompt = f"{context}{question}\n{option_lines(choices)}\n{OPTION_INSTRUCTION}"
    kind = "scienceqa" if missing(row.get("subject")) else str(row["subject"])
    return {"question": question, "answers": [letter], "options": choices, "prompt": prompt, "kind": kind}


SCIENCEQA_IMG = register_benchmark(Benchmark(name="scienceqa_img", title="ScienceQA-IMG",
    columns=("question", "choices", "answer", "image"), optional=("hint", "subject"),
    configs=("ScienceQA-IMG", "ScienceQA-FULL"), make=make, probe="prefill", metric="option",
    prompt="[Context: <hint>\\n]<question>\\nA. ...\\nB. ...\\n" + OPTION_INSTRUCTION, default_split="test",
    only_with_image=True))  # fmt: skip
