"""AI2D (Kembhavi et al. 2016): multiple-choice questions about science diagrams, the answer a 0-based option
index. Columns, prompt (lmms-eval's "mcq" format), probe and metric: docs/benchmarks.md#tasks.
"""

from __future__ import annotations

from trimvlm.evals.tasks.base import OPTION_INSTRUCTION, option_lines
from trimvlm.evals.tasks.benchmark import Benchmark, option_letter, register_benchmark, string_list, text


def make(row: dict, where: str) -> dict:
    question = text(row, "question", where)
    options = string_list(row, "options", where)
    letter = option_letter(row.get("answer"), len(options), where)
    prompt = f"{question}\n{option_lines(options)}\n{OPTION_INSTRUCTION}"
    return {"question": question, "answers": [letter], "options": options, "prompt": prompt}


AI2D = register_benchmark(Benchmark(name="ai2d", title="AI2D", columns=("question", "options", "answer", "image"),
    make=make, probe="prefill", metric="option", prompt="<question>\\nA. ...\\nB. ...\\n" + OPTION_INSTRUCTION,
    default_split="test"))  # fmt: skip
