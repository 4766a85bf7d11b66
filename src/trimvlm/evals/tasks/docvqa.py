"""DocVQA (Mathew et al. 2021) and InfographicVQA (Mathew et al. 2022): questions on scanned documents and
on infographics, answered with text read from the image; their test splits withhold the answers. A copy that
holds both configurations is read at the one the task names; --data may also point at the configuration's
folder. Columns, prompt (lmms-eval's), probe and metric: docs/benchmarks.md#tasks.
"""

from __future__ import annotations

from trimvlm.evals.tasks.base import SHORT_PROMPT
from trimvlm.evals.tasks.benchmark import Benchmark, open_answer, register_benchmark


def _bench(name: str, title: str, config: str) -> Benchmark:
    return Benchmark(name=name, title=title, columns=("question", "answers", "image"), id_column="questionId",
        configs=(config,), make=open_answer("answers"), probe="full", metric="anls", prompt=SHORT_PROMPT,
        default_split="validation", max_new_tokens=128)  # fmt: skip


DOCVQA = register_benchmark(_bench("docvqa", "DocVQA", "DocVQA"))
INFOVQA = register_benchmark(_bench("infovqa", "InfographicVQA", "InfographicVQA"))
