"""ChartQA (Masry et al. 2022): questions on charts, many answered with a number.

- columns (lmms-lab/ChartQA): question, answer, image; type (human_test / augmented_test, reported as the
  kind) when present. Split: test.
- prompt (lmms-eval's): "<question>\\nAnswer the question using a single word or phrase."
- probe: full (the whole answer, up to 16 new tokens, lmms-eval's cap).
- metric: `relaxed`: relaxed accuracy, a number within 5% of the reference, otherwise an exact match
  ignoring case (trimvlm.evals.relaxed_accuracy).
"""

from __future__ import annotations

from trimvlm.evals.tasks.base import SHORT_INSTRUCTION, SHORT_PROMPT
from trimvlm.evals.tasks.benchmark import Benchmark, answer_texts, missing, register_benchmark, text


def make(row: dict, where: str) -> dict:
    question = text(row, "question", where)
    answers = answer_texts(row, "answer", where)
    kind = "chartqa" if missing(row.get("type")) else str(row["type"])
    return {
        "question": question,
        "answers": answers,
        "prompt": f"{question}\n{SHORT_INSTRUCTION}",
        "kind": kind,
    }


CHARTQA = register_benchmark(
    Benchmark(
        name="chartqa",
        title="ChartQA",
        columns=("question", "answer", "image"),
        optional=("type",),
        make=make,
        probe="full",
        metric="relaxed",
        prompt=SHORT_PROMPT,
        default_split="test",
        max_new_tokens=16,
    )
)
