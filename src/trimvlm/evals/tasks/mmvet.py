"""MM-Vet (Yu et al. 2023)-style open answers: questions that combine recognition, OCR, knowledge, language
generation, spatial awareness and maths; references may join parts with <AND> / <OR>. Columns, prompt
(lmms-eval's), probe and metric: docs/benchmarks.md#tasks. Its metric, `open_match`, is a LOCAL CONTAINMENT
CHECK, NOT MM-Vet's GPT-4 grader (trimvlm.evals.open_match): its numbers are not comparable with published
MM-Vet scores; they compare recipes with the baseline on the same items.
"""

from __future__ import annotations

from trimvlm.evals.tasks.benchmark import Benchmark, open_answer, register_benchmark

PRE_PROMPT = (
    "First please perform reasoning, and think step by step to provide best answer to the following "
    "question: \n\n"
)


MMVET = register_benchmark(Benchmark(name="mmvet", title="MM-Vet", columns=("question", "answer", "image"),
    id_column="question_id", make=open_answer("answer", prefix=PRE_PROMPT, suffix=""), probe="full",
    metric="open_match", prompt=PRE_PROMPT.replace("\n", "\\n") + "<question>", default_split="test",
    max_new_tokens=1024))  # fmt: skip
