"""Evaluation tasks: a list of `Record`s plus generation settings, by name.

A record is one question: its images, the question, the options (multiple choice) or reference answers, the
probe kind and the metric that scores it, and a question `kind` that results are grouped by.

Probe kinds (../shared/REFERENCES.md section 1):
- `prefill`: the answer is read from the first generated token only (a letter, yes/no, a one-word answer);
  the harness generates `prefill_tokens` (default 1) tokens, so decode-phase methods cannot change it.
- `full`: the whole generated answer is scored (open text, reading, lists); up to `max_new_tokens` tokens.

Tasks by name (`get_task`):
- `demo`: the synthetic demo task (`trimvlm.demo.task`), test split, one question of every kind per image;
- a path to a `.jsonl` file (or `jsonl:PATH`): one record per line, schema below;
- anything added with `register_task`.

JSONL schema, one JSON object per line (blank lines and lines starting with `#` are skipped):

    id        string, optional (default: "<file stem>-<line number>")
    image     path of one image, or `images`: a list of paths (may be empty); relative to the file's folder
    question  string, required
    answer    the reference answer, or `answers`: a list of references (required, non-empty)
              for `option` items: the correct letter ("B") or the correct option's text
    options   list of strings, optional (multiple choice; shown to the model as "A. ...", "B. ..." lines)
    metric    one of trimvlm.evals.metrics.METRICS (default: "option" with options, else "exact")
    probe     "prefill" or "full" (default: "prefill" for option/yesno metrics, else "full")
    kind      the group to report under (default: the metric name)
    prompt    the exact text given to the model (default: the question, plus options and an instruction)

The model's own prompt template (chat template, or the demo model's "{question} <ans>") is applied by
`VLM.generate`; the prompt here is the user's text only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from trimvlm.errors import InputError
from trimvlm.evals.metrics import OPTION_LETTERS, get_metric
from trimvlm.options import is_int

PROBES = ("prefill", "full")
OPTION_INSTRUCTION = "Answer with the option's letter from the given choices directly."
SHORT_INSTRUCTION = "Answer the question using a single word or phrase."
DEMO_DEFAULT_ITEMS = 300
DEMO_METRICS = {
    "exist": "yesno",
    "mc": "option",
    "color": "exact",
    "count": "exact",
    "list": "exact",
    "read": "exact_strict",  # "7 A 3": the usual normalisation would delete the glyph "A" as an article
}


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
            lines = [f"{OPTION_LETTERS[k]}. {o}" for k, o in enumerate(self.options)]
            return "\n".join([self.question, *lines, OPTION_INSTRUCTION])
        if self.probe == "prefill":
            return f"{self.question}\n{SHORT_INSTRUCTION}"
        return self.question


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


def get_task(name: str | Path, limit: int | None = None, seed: int = 0) -> Task:
    """Build a task by name (`demo`, a registered name) or from a JSONL file (`path.jsonl` / `jsonl:path`)."""
    limit = check_limit(limit)
    key = str(name)
    if key in TASKS:
        return TASKS[key](limit=limit, seed=seed)
    if key.startswith("jsonl:") or key.endswith(".jsonl"):
        return load_jsonl(key.removeprefix("jsonl:"), limit=limit)
    raise InputError(
        f"unknown task {key!r}; known tasks: {', '.join(sorted(TASKS))}, or a JSONL file given as "
        "PATH.jsonl or jsonl:PATH"
    )


# --------------------------------------------------------------------------------------------- demo


@register_task("demo")
def demo_task(limit: int | None = None, seed: int = 0, split: str = "test") -> Task:
    """The synthetic demo task: `limit` questions (default 300), one of every kind per image, image-major."""
    from trimvlm.demo import task as demo

    n = limit if limit is not None else DEMO_DEFAULT_ITEMS
    kinds = list(demo.KINDS)
    samples = demo.generate_split(split, math.ceil(n / len(kinds)), seed=seed)
    records = []
    for i, s in enumerate(samples):
        for qa in s.qas:
            if qa.kind not in demo.KINDS:
                continue
            records.append(
                Record(
                    id=f"{split}-{seed}-{i}-{qa.kind}",
                    images=[s.image],
                    question=qa.question,
                    answers=[qa.answer],
                    options=qa.options,
                    probe=qa.probe,
                    metric=DEMO_METRICS[qa.kind],
                    kind=qa.kind,
                    prompt=qa.question,  # options are already part of the demo's question text
                )
            )
    records = records[:n]
    # Caps for the full-pipeline kinds: the longest possible answer plus its end token (a list names at most
    # MAX_OBJECTS colours; a drawn string has 3-4 glyphs), never below the longest reference here + 1, so a
    # truncated answer can never equal a reference. A model that answers right always stops before the cap.
    longest = {
        k: max((len(r.answers[0].split()) for r in records if r.kind == k), default=0) for k in demo.KINDS
    }
    caps = {"list": max(demo.MAX_OBJECTS, longest["list"]) + 1, "read": max(4, longest["read"]) + 1}
    return Task(
        name="demo",
        records=records,
        max_new_tokens=max(caps.values()),
        prefill_tokens=1,
        info={"split": split, "seed": seed, "n_images": len(samples), "questions_per_kind": 1},
        kind_max_new_tokens=caps,
    )


# --------------------------------------------------------------------------------------------- JSONL


def _strings(value, what: str, where: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str | int | float) for v in value):
        return [str(v) for v in value]
    raise InputError(f"{where}: {what} must be a string or a list of strings, got {value!r}")


def record_from_json(obj: dict, folder: Path, default_id: str, where: str) -> Record:
    known = {
        "id",
        "image",
        "images",
        "question",
        "answer",
        "answers",
        "options",
        "metric",
        "probe",
        "kind",
        "prompt",
    }
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - known)
    if unknown:
        raise InputError(f"{where}: unknown field(s) {unknown}; allowed: {', '.join(sorted(known))}")
    question = obj.get("question")
    if not isinstance(question, str) or not question.strip():
        raise InputError(f"{where}: 'question' is required and must be a non-empty string")
    if "answer" in obj and "answers" in obj:
        raise InputError(f"{where}: give 'answer' or 'answers', not both")
    raw = obj.get("answers", obj.get("answer"))
    if raw is None:
        raise InputError(f"{where}: a reference is required: 'answer' (string) or 'answers' (list)")
    answers = _strings(raw, "answers", where)
    if not answers:
        raise InputError(f"{where}: 'answers' is empty")
    options = _strings(obj["options"], "options", where) if obj.get("options") is not None else None
    if "image" in obj and "images" in obj:
        raise InputError(f"{where}: give 'image' or 'images', not both")
    paths = obj.get("images", obj.get("image")) or []
    images = []
    for p in _strings(paths, "images", where):
        path = Path(p).expanduser()
        path = path if path.is_absolute() else folder / path
        if not path.exists():
            raise InputError(f"{where}: image file not found: {path}")
        try:  # decode now: a broken image stops the task before the run, never in the middle of it
            with Image.open(path) as im:
                im.load()
        except Exception as e:  # PIL raises several types for unreadable files
            raise InputError(
                f"{where}: record {obj.get('id', default_id)!s}: image {path} cannot be decoded "
                f"({type(e).__name__}); give a PNG/JPEG/... file PIL can open"
            ) from None
        images.append(path)
    metric = str(obj.get("metric", "option" if options else "exact"))
    try:
        get_metric(metric)
    except InputError as e:
        raise InputError(f"{where}: {e}") from None
    if metric == "option" and not options:
        raise InputError(f"{where}: metric 'option' needs 'options'")
    probe = str(obj.get("probe", "prefill" if metric in ("option", "yesno") else "full"))
    if probe not in PROBES:
        raise InputError(f"{where}: unknown probe kind {probe!r}; allowed: {', '.join(PROBES)}")
    if metric == "option":
        get_metric("option").gold(answers, options)  # the reference must name one of the options
    prompt = obj.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise InputError(f"{where}: 'prompt' must be a string")
    return Record(
        id=str(obj.get("id", default_id)),
        images=images,
        question=question,
        answers=answers,
        options=options,
        probe=probe,
        metric=metric,
        kind=str(obj.get("kind", metric)),
        prompt=prompt,
    )


def load_jsonl(
    path: str | Path, limit: int | None = None, max_new_tokens: int = 32, name: str | None = None
) -> Task:
    """A task from a local JSONL file (schema in this module's docstring); the first `limit` records."""
    limit = check_limit(limit)
    path = Path(path).expanduser()
    if not path.is_file():
        raise InputError(f"task file not found: {path}")
    records: list[Record] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(records) >= limit:
                break
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{where}: not valid JSON ({e.msg})") from None
            try:
                records.append(record_from_json(obj, path.parent, f"{path.stem}-{lineno}", where))
            except InputError as e:
                if str(e).startswith(where):
                    raise
                raise InputError(f"{where}: {e}") from None
    if not records:
        raise InputError(f"task file {path} holds no records")
    return Task(
        name=name or path.stem, records=records, max_new_tokens=max_new_tokens, info={"source": str(path)}
    )
