"""AI2D (Kembhavi et al. 2016): multiple-choice questions about science diagrams.

- columns (lmms-lab/ai2d): question, options (list), answer (0-based index of the right option, often a
  digit string), image. Split: test.
- prompt (lmms-eval's "mcq" format): "<question>\\nA. <option>\\nB. <option>...\\nAnswer with the option's
  letter from the given choices directly."
- probe: prefill (the letter is the first generated token).
- metric: `option`: accuracy of the option the answer names (letter extraction, trimvlm.evals.metrics).
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
