"""Records, tasks and the task registry.

A record is one question: its images, the question, the options (multiple choice) or reference answers, the
probe kind and the metric that scores it, and a question `kind` that results are grouped by.

Probe kinds (../shared/REFERENCES.md section 1):
- `prefill`: the answer is read from the first generated token only (a letter, yes/no, a one-word answer);
  the harness generates `prefill_tokens` (default 1) tokens, so decode-phase methods cannot change it.
- `full`: the whole generated answer is scored (open text, reading, lists); up to `max_new_tokens` tokens.

Tasks by name (`get_task`):
- `demo`: the synthetic demo task (`trimvlm.evals.tasks.demo`);
- a benchmark read from a local copy (`BENCHMARKS`: pope, scienceqa_img, mmbench, ai2d, textvqa, docvqa,
  infovqa, chartqa, mmvet; `data=PATH` required, see `trimvlm.evals.tasks.benchmark`);
- a path to a `.jsonl` file (or `jsonl:PATH`): one record per line (`trimvlm.evals.tasks.jsonl`);
- anything added with `register_task` (builders take `limit` and `seed`) or `register_benchmark`.

The model's own prompt template (chat template, or the demo model's "{question} <ans>") is applied by
`VLM.generate`; the prompt of a record is the user's text only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trimvlm.errors import InputError
from trimvlm.evals.metrics import OPTION_LETTERS, get_metric
from trimvlm.options import is_int

PROBES = ("prefill", "full")
OPTION_INSTRUCTION = "Answer with the option's letter from the given choices directly."
SHORT_INSTRUCTION = "Answer the question using a single word or phrase."
SHORT_PROMPT = "<question>\\n" + SHORT_INSTRUCTION  # the format in words (Benchmark.prompt)


@dataclass
class Record:
    id: str
    images: list[Any]  # PIL images or paths
    question: str
    answers: list[str]
    options: list[str] | None = None
    probe: str = "full"
    metric: str = "exact"
    kind: str = "default"
    prompt: str | None = None

    def __post_init__(self):
        if self.probe not in PROBES:
            raise InputError(
                f"record {self.id}: unknown probe kind {self.probe!r}; allowed: {', '.join(PROBES)}"
            )
        get_metric(self.metric)
        if not self.answers:
            raise InputError(f"record {self.id}: no reference answer")
        if self.options is not None and len(self.options) > len(OPTION_LETTERS):
            raise InputError(f"record {self.id}: {len(self.options)} options; at most {len(OPTION_LETTERS)}")

    def prompt_text(self) -> str:
        """The text given to the model: `prompt` if set, else the question with options / an instruction."""
        if self.prompt is not None:
            return self.prompt
        if self.options:
            return "\n".join([self.question, option_lines(self.options), OPTION_INSTRUCTION])
        if self.probe == "prefill":
            return f"{self.question}\n{SHORT_INSTRUCTION}"
        return self.question


def option_lines(options) -> str:
    """'A. first\\nB. second...': the options as multiple-choice benchmarks show them."""
    return "\n".join(f"{OPTION_LETTERS[k]}. {o}" for k, o in enumerate(options))


@dataclass
class Task:
    name: str
    records: list[Record]
    max_new_tokens: int = 32  # for full-pipeline probes
    prefill_tokens: int = 1  # for prefill probes
    info: dict = field(default_factory=dict)  # how the records were made (split, seed, source file...)
    kind_max_new_tokens: dict[str, int] = field(default_factory=dict)  # tighter caps of some full kinds

    def new_tokens(self, probe: str, kind: str) -> int:
        """Tokens to generate for items of this probe and kind."""
        if probe == "prefill":
            return self.prefill_tokens
        return self.kind_max_new_tokens.get(kind, self.max_new_tokens)

    def kinds(self) -> dict[str, dict]:
        """kind -> {probe, metric, n}, in order of first appearance."""
        out: dict[str, dict] = {}
        for r in self.records:
            k = out.setdefault(r.kind, {"probe": r.probe, "metric": r.metric, "n": 0})
            k["n"] += 1
            if k["probe"] != r.probe:
                k["probe"] = "mixed"
            if k["metric"] != r.metric:
                k["metric"] = "mixed"
        return out


def check_prefill_answers(task: Task, tokenizer) -> None:
    """Refuse a prefill-probe record none of whose references fits in the `task.prefill_tokens` (default 1)
    tokens that probe generates: it could never be scored right. The reference of an `option` record is its
    letter; a reference's length is the fewer tokens of it alone or after a space."""
    for r in task.records:
        if r.probe != "prefill":
            continue
        refs = r.answers
        if r.metric == "option":
            refs = [OPTION_LETTERS[get_metric("option").gold(r.answers, r.options)]]
        lengths = [
            min(
                len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in (a.strip(), " " + a.strip())
            )
            for a in refs
        ]
        if min(lengths) > task.prefill_tokens:
            raise InputError(
                f"task {task.name!r}, record {r.id}: answer {refs[0]!r} is {lengths[0]} tokens, but a prefill "
                f"probe scores only the first {task.prefill_tokens} generated token(s); give the record "
                '"probe": "full" or a one-token answer'
            )


TaskBuilder = Callable[..., Task]  # (limit: int | None, seed: int) -> Task
TASKS: dict[str, TaskBuilder] = {}


def register_task(name: str):
    def deco(fn: TaskBuilder) -> TaskBuilder:
        TASKS[name] = fn
        return fn

    return deco


def check_limit(limit) -> int | None:
    if limit is None:
        return None
    if not is_int(limit) or limit <= 0:
        raise InputError(f"limit must be a positive number of items (or omitted for all), got {limit!r}")
    return limit


def get_task(
    name: str | Path,
    limit: int | None = None,
    seed: int = 0,
    *,
    data: str | Path | None = None,
    split: str | None = None,
    progress: bool = True,
) -> Task:
    """Build a task by name: `demo` or another registered task; a benchmark read from the local copy at `data`
    (its `split`, default the benchmark's usual one; `limit` items drawn with `seed`); or a JSONL file
    (`path.jsonl` / `jsonl:path`)."""
    from trimvlm.evals.tasks.benchmark import BENCHMARKS, load_benchmark
    from trimvlm.evals.tasks.jsonl import load_jsonl

    limit = check_limit(limit)
    key = str(name)
    if key in BENCHMARKS:
        if data is None:
            raise InputError(
                f"task {key!r} reads a local copy of the benchmark: give its folder with --data PATH (parquet "
                "shards as Hugging Face datasets publish them, or <split>.jsonl with image files)"
            )
        return load_benchmark(key, data, split=split, limit=limit, seed=seed, progress=progress)
    is_jsonl = key.startswith("jsonl:") or key.endswith(".jsonl")
    if (key in TASKS or is_jsonl) and (data is not None or split is not None):
        what = "--data" if data is not None else "--split"
        raise InputError(
            f"{what} applies to the benchmarks read from local files ({', '.join(sorted(BENCHMARKS))}), "
            f"not to task {key!r}"
        )
    if key in TASKS:
        return TASKS[key](limit=limit, seed=seed)
    if is_jsonl:
        return load_jsonl(key.removeprefix("jsonl:"), limit=limit)
    raise InputError(
        f"unknown task {key!r}; known tasks: {', '.join(sorted(TASKS))}, or a JSONL file given as "
        f"PATH.jsonl or jsonl:PATH, or a benchmark read with --data PATH: {', '.join(sorted(BENCHMARKS))}"
    )
