"""Records (the generation item), tasks and the one task registry.

A record is one question: its images, the question, the options (multiple choice) or reference answers, the
probe kind and the metric that scores it, and a question `kind` that results are grouped by. A task's records
may be any items of trimvlm.evals.items' protocol (generation records, candidate items).

Probe kinds (docs/references.md#prefill-probes-and-full-pipeline-probes):
- `prefill`: the answer is read from the first generated token only (a letter, yes/no, a one-word answer);
  the harness generates `prefill_tokens` (default 1) tokens, so decode-phase methods cannot change it.
- `full`: the whole generated answer is scored (open text, reading, lists); up to `max_new_tokens` tokens.
- `candidates`: a candidate item's fixed candidates are scored (trimvlm.evals.items.CandidateItem).
- `decision`: a System One request's typed questions are answered (trimvlm.evals.items.DecisionItem).

`TASKS` is the one registry (trimvlm.evals.tasks.lookup's `get_task` builds by name): the demo tasks (`demo`,
`demo-candidates`), every benchmark read from a local copy (`register_benchmark`; `data=PATH` required) and
anything added with `register_task`. A path to a `.jsonl` file (or `jsonl:PATH`) is a task too
(trimvlm.evals.tasks.jsonl).

The model's own prompt template (chat template, or the demo model's "{question} <ans>") is applied by
`VLM.generate`; the prompt of a record is the user's text only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trimvlm.errors import InputError
from trimvlm.evals.items import ItemsRun
from trimvlm.evals.metrics import OPTION_LETTERS, get_metric, option_gold
from trimvlm.options import is_int

PROBES = ("prefill", "full")  # of generation records
GROUP_PROBES = (*PROBES, "candidates", "decision")  # every item kind's probes, in report order
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

    def batch_key(self, task) -> tuple:
        return (self.probe, self.kind, task.new_tokens(self.probe, self.kind))

    @classmethod
    def run(cls, vlm, items, recipe, task, opts, track_memory: bool = False):
        kw = {"track_memory": True} if track_memory else {}
        n_new = task.new_tokens(items[0].probe, items[0].kind)
        res = vlm.generate([list(r.images) for r in items], [r.prompt_text() for r in items], recipe=recipe,
                           max_new_tokens=n_new, seed=opts.seed, **kw)  # fmt: skip
        return ItemsRun(list(res.texts), res.costs)

    @classmethod
    def prepare(cls, vlm, items, task, opts):
        if getattr(vlm, "tokenizer", None) is not None:
            check_prefill_answers(task, vlm.tokenizer)
        return opts

    @classmethod
    def untimed(cls, vlm, items, task, opts) -> None:
        """The vision-FLOP count of a new input shape runs here, outside every timing (a stand-in without a
        runner has none)."""
        runner = getattr(vlm, "runner", None)
        if runner is not None and hasattr(runner, "vision_flops"):
            runner.vision_flops(vlm.prepare([list(r.images) for r in items], [r.prompt_text() for r in items]))

    def score(self, output) -> float:
        return get_metric(self.metric).score(output, self.answers, self.options)

    def canonical(self, output):
        return get_metric(self.metric).canonical(output, self.options)

    @classmethod
    def summary(cls, items, outputs) -> dict:
        """The metric's summary (the harness asks it of groups of one metric only)."""
        return get_metric(items[0].metric).summary(outputs, [r.answers for r in items], [r.options for r in items])

    def as_json(self) -> dict:
        return {"id": self.id, "kind": self.kind, "probe": self.probe, "metric": self.metric,
                "question": self.question, "answers": self.answers, "options": self.options}  # fmt: skip

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
            for name in ("probe", "metric"):
                if k[name] != getattr(r, name):
                    k[name] = "mixed"
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
            refs = [OPTION_LETTERS[option_gold(r.answers, r.options)]]
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


@dataclass(frozen=True)
class TaskEntry:
    """A registered task: `build(limit, seed, split, data, progress) -> Task`."""

    name: str
    build: Callable[..., Task]
    about: str  # one line (`trimvlm eval --help`)
    reads_data: bool = False  # a benchmark read from a local copy (--data PATH)
    splits: tuple[str, ...] = ()  # the splits a generated task takes (a benchmark: whatever its copy holds)
    candidates: str | None = None  # the task holding the same questions as candidate items (calibration)


TASKS: dict[str, TaskEntry] = {}


def register_task(name: str, about: str, **kw):
    """Register a builder `(limit, seed, split) -> Task` (`split` one of `splits`; a builder that also reads
    a local copy is registered with `reads_data=True` and takes `data` and `progress` too)."""

    def deco(fn):
        TASKS[name] = TaskEntry(name, fn, about, **kw)
        return fn

    return deco


def check_positive(name: str, value, what: str = "a positive integer", optional: bool = False):
    """`value`, unless it is not a positive integer (None is let through where `optional`): then InputError
    "<name> must be <what>, got <value>"."""
    if (value is not None or not optional) and (not is_int(value) or value <= 0):
        raise InputError(f"{name} must be {what}, got {value!r}")
    return value


def check_limit(limit) -> int | None:
    return check_positive("limit", limit, "a positive number of items (or omitted for all)", optional=True)
