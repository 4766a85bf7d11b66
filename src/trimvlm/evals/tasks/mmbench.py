"""MMBench (Liu et al. 2023), English: single-choice questions over 20 abilities, 2 to 4 options A-D; the
row's `L2-category` is its kind and its dev split the one with answers. Columns, prompt (lmms-eval's), probe and
metric: docs/benchmarks.md#tasks. Each row is scored on its own: MMBench's CircularEval (an item counts only if
every rotation of its options is answered right) and the GPT matching of answers that name no letter are not
applied.
"""

from __future__ import annotations

from trimvlm.errors import InputError
from trimvlm.evals.tasks.base import OPTION_INSTRUCTION, option_lines
from trimvlm.evals.tasks.benchmark import Benchmark, answer_texts, missing, register_benchmark, text

LETTERS = ("A", "B", "C", "D", "E")


def make(row: dict, where: str) -> dict:
    question = text(row, "question", where)
    held = [c for c in LETTERS if not missing(row.get(c))]
    if held != list(LETTERS[: len(held)]) or len(held) < 2:
        raise InputError(f"{where}: MMBench's options must be filled from A on, at least A and B; got {held}")
    options = [str(row[c]) for c in held]
    answer = answer_texts(row, "answer", where)[0].strip().upper()
    if answer not in held:
        raise InputError(f"{where}: answer {answer!r} is not one of the options {', '.join(held)}")
    hint = row.get("hint")
    query = f"{question} " if missing(hint) else f"{hint} {question} "
    prompt = f"{query}There are several options:\n{option_lines(options)}\n\n{OPTION_INSTRUCTION}"
    kind = "mmbench" if missing(row.get("L2-category")) else str(row["L2-category"])
    return {"question": question, "answers": [answer], "options": options, "prompt": prompt, "kind": kind}


MMBENCH = register_benchmark(Benchmark(name="mmbench", title="MMBench",
    columns=("question", "A", "B", "answer", "image"), optional=("C", "D", "E", "hint", "L2-category"),
    id_column="index", configs=("en",), make=make, probe="prefill", metric="option",
    prompt="[<hint> ]<question> There are several options:\\nA. ...\\nB. ...\\n\\n" + OPTION_INSTRUCTION,
    default_split="dev"))  # fmt: skip
