"""ChartQA (Masry et al. 2022): questions on charts, many answered with a number.

- columns (lmms-lab/ChartQA): question, answer, image; type (human_test / augmented_test, reported as the
  kind) when present. Split: test.
- prompt (lmms-eval's): "<question>\\nAnswer the question using a single word or phrase."
- probe: full (the whole answer, up to 16 new tokens, lmms-eval's cap).
- metric: `relaxed`: relaxed accuracy, a number within 5% of the reference, otherwise an exact match
  ignoring case (trimvlm.evals.relaxed_accuracy).
"""

from __future__ import annotations

from trimvlm.evals.tasks.base import SHORT_PROMPT
from trimvlm.evals.tasks.benchmark import Benchmark, open_answer, register_benchmark

CHARTQA = register_benchmark(Benchmark(name="chartqa", title="ChartQA", columns=("question", "answer", "image"),
    optional=("type",), make=open_answer("answer", kind="type", default_kind="chartqa"), probe="full",
    metric="relaxed", prompt=SHORT_PROMPT, default_split="test", max_new_tokens=16))  # fmt: skip
