"""POPE (Li et al. 2023, "Evaluating Object Hallucination in Large Vision-Language Models"): "Is there a
<object> in the image?" over COCO images, answered yes or no; the row's `category` (adversarial / popular /
random) is its kind. Columns, prompt (lmms-eval's), probe and metric (accuracy, F1 and the share of "yes"
answers): docs/benchmarks.md#tasks.
"""

from __future__ import annotations

from trimvlm.errors import InputError
from trimvlm.evals.tasks.base import SHORT_INSTRUCTION, SHORT_PROMPT
from trimvlm.evals.tasks.benchmark import Benchmark, answer_texts, missing, register_benchmark, text


def make(row: dict, where: str) -> dict:
    question = text(row, "question", where)
    answer = answer_texts(row, "answer", where)[0].strip().lower()
    if answer not in ("yes", "no"):
        raise InputError(f"{where}: POPE's answer must be yes or no, got {answer!r}")
    kind = "pope" if missing(row.get("category")) else str(row["category"])
    return {
        "question": question,
        "answers": [answer],
        "prompt": f"{question}\n{SHORT_INSTRUCTION}",
        "kind": kind,
    }


POPE = register_benchmark(Benchmark(name="pope", title="POPE", columns=("question", "answer", "image"),
    optional=("category",), id_column="question_id", make=make, probe="prefill", metric="yesno", prompt=SHORT_PROMPT,
    default_split="test"))  # fmt: skip
