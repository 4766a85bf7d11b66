"""MM-Vet (Yu et al. 2023)-style open answers: questions that combine recognition, OCR, knowledge, language
generation, spatial awareness and maths; references may join parts with <AND> / <OR>.

- columns (lmms-lab/MMVet): question, answer, image; question_id (the record id) when present. Split: test.
- prompt (lmms-eval's): "First please perform reasoning, and think step by step to provide best answer to
  the following question: \\n\\n<question>"
- probe: full (the whole answer, up to 1024 new tokens, lmms-eval's cap; --max-new-tokens lowers it).
- metric: `open_match`, a LOCAL CONTAINMENT CHECK, NOT MM-Vet's GPT-4 grader: the share of the reference's
  <AND> parts (or any <OR> part) whose words occur in the answer (trimvlm.evals.open_match). Its numbers
  are not comparable with published MM-Vet scores; they compare recipes with the baseline on the same items.
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
