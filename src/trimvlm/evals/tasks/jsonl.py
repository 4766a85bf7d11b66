"""A task from a local JSONL file: one record per line.

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

(A benchmark's own columns in JSONL + image files, read with `--task NAME --data PATH`, are another form:
see `trimvlm.data.layout`.)
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from trimvlm.data.layout import ImageOpener, jsonl_objects
from trimvlm.errors import InputError
from trimvlm.evals.metrics import option_gold
from trimvlm.evals.tasks.base import Record, Task, check_limit


def _strings(value, what: str, where: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str | int | float) for v in value):
        return [str(v) for v in value]
    raise InputError(f"{where}: {what} must be a string or a list of strings, got {value!r}")


def _images(paths, folder: Path, rid, where: str) -> list[Path]:
    """The record's image files (relative to `folder`), each decoded now: a broken image stops the task before
    the run, never in the middle of it. An empty path names the folder itself: refused as no image file."""
    opener, record = ImageOpener(), f"{where}: record {rid!s}"
    return [opener.open(p or ".", folder, record) for p in _strings(paths, "images", where)]


def record_from_json(obj: dict, folder: Path, default_id: str, where: str) -> Record:
    known = {f.name for f in fields(Record)} | {"image", "answer"}
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
    answers = _strings(raw, "answers", where)  # Record refuses an empty list
    options = _strings(obj["options"], "options", where) if obj.get("options") is not None else None
    if "image" in obj and "images" in obj:
        raise InputError(f"{where}: give 'image' or 'images', not both")
    images = _images(obj.get("images", obj.get("image")) or [], folder, obj.get("id", default_id), where)
    metric = str(obj.get("metric", "option" if options else "exact"))  # Record refuses an unknown one
    if metric == "option" and not options:
        raise InputError(f"{where}: metric 'option' needs 'options'")
    probe = str(obj.get("probe", "prefill" if metric in ("option", "yesno") else "full"))  # Record checks it
    if metric == "option":
        option_gold(answers, options)  # the reference must name one of the options
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


def load_jsonl(path: str | Path, limit: int | None = None, max_new_tokens: int = 32) -> Task:
    """A task from a local JSONL file (schema in this module's docstring); the first `limit` records."""
    limit = check_limit(limit)
    path = Path(path).expanduser()
    if not path.is_file():
        raise InputError(f"task file not found: {path}")
    records: list[Record] = []
    for lineno, obj in jsonl_objects(path):
        where = f"{path}:{lineno}"
        try:
            records.append(record_from_json(obj, path.parent, f"{path.stem}-{lineno}", where))
        except InputError as e:
            if str(e).startswith(where):
                raise
            raise InputError(f"{where}: {e}") from None
        if len(records) == limit:  # the lines after the last record used are never read
            break
    if not records:
        raise InputError(f"task file {path} holds no records")
    return Task(name=path.stem, records=records, max_new_tokens=max_new_tokens, info={"source": str(path)})
