"""ChartQA (Masry et al. 2022): questions on charts, many answered with a number; the row's `type`
(human_test / augmented_test) is its kind. Columns, prompt (lmms-eval's), probe and metric:
docs/benchmarks.md#tasks.
"""

from __future__ import annotations

from trimvlm.evals.tasks.base import SHORT_PROMPT
from trimvlm.evals.tasks.benchmark import Benchmark, open_answer, register_benchmark

CHARTQA = register_benchmark(Benchmark(name="chartqa", title="ChartQA", columns=("question", "answer", "image"),
    optional=("type",), make=open_answer("answer", kind="type", default_kind="chartqa"), probe="full",
    metric="relaxed", prompt=SHORT_PROMPT, default_split="test", max_new_tokens=16))  # fmt: skip
