"""TextVQA (Singh et al. 2019): questions that need reading the text in a photo, scored against their 10 human
answers; its test split withholds them. Columns, prompt (lmms-eval's, without OCR tokens), probe and metric:
docs/benchmarks.md#tasks.
"""

from __future__ import annotations

from trimvlm.evals.tasks.base import SHORT_PROMPT
from trimvlm.evals.tasks.benchmark import Benchmark, open_answer, register_benchmark

TEXTVQA = register_benchmark(Benchmark(name="textvqa", title="TextVQA", columns=("question", "answers", "image"),
    id_column="question_id", make=open_answer("answers"), probe="full", metric="vqa", prompt=SHORT_PROMPT,
    default_split="validation", max_new_tokens=32))  # fmt: skip
