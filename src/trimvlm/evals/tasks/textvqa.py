"""TextVQA (Singh et al. 2019): questions that need reading the text in a photo; 10 human answers each.

- columns (lmms-lab/textvqa): question, answers (the 10 human answers), image; question_id (the record id)
  when present. Split: validation (the test split withholds its answers).
- prompt (lmms-eval's, without OCR tokens): "<question>\\nAnswer the question using a single word or phrase."
- probe: full (the whole answer, up to 32 new tokens; lmms-eval's task sets no cap of its own).
- metric: `vqa`: VQA accuracy, min(1, #matching humans / 3) averaged over the 10 leave-one-out subsets,
  after the official answer normalisation (trimvlm.evals.vqa_accuracy).
"""

from __future__ import annotations

from trimvlm.evals.tasks.base import SHORT_PROMPT
from trimvlm.evals.tasks.benchmark import Benchmark, open_answer, register_benchmark

TEXTVQA = register_benchmark(Benchmark(name="textvqa", title="TextVQA", columns=("question", "answers", "image"),
    id_column="question_id", make=open_answer("answers"), probe="full", metric="vqa", prompt=SHORT_PROMPT,
    default_split="validation", max_new_tokens=32))  # fmt: skip
