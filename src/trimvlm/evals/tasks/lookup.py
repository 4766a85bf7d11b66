"""Tasks by name: `get_task` builds a registered task (trimvlm.evals.tasks.base's `TASKS`) or a JSONL file's
(trimvlm.evals.tasks.jsonl), `benchmarks` lists the tasks read from a local copy, and `calibration_items` draws
a generated task's unlabeled inputs."""

from __future__ import annotations

from pathlib import Path

from trimvlm.errors import InputError, did_you_mean
from trimvlm.evals.tasks.base import TASKS, Task, check_limit, check_positive
from trimvlm.evals.tasks.jsonl import load_jsonl


def get_task(
    name: str | Path,
    limit: int | None = None,
    seed: int = 0,
    *,
    data: str | Path | None = None,
    split: str | None = None,
    progress: bool = True,
) -> Task:
    """Build a task by name: a registered task (a benchmark reads the local copy at `data`, its `split`, default
    the benchmark's usual one; `limit` items drawn with `seed`), or a JSONL file (`path.jsonl` / `jsonl:path`)."""
    limit = check_limit(limit)
    key = str(name)
    entry = TASKS.get(key)
    if entry is not None and entry.reads_data:
        if data is None:
            raise InputError(
                f"task {key!r} reads a local copy of the benchmark: give its folder with --data PATH (parquet "
                "shards as Hugging Face datasets publish them, or <split>.jsonl with image files)"
            )
        return entry.build(limit=limit, seed=seed, split=split, data=data, progress=progress)
    is_jsonl = entry is None and (key.startswith("jsonl:") or key.endswith(".jsonl"))
    if (entry is not None or is_jsonl) and data is not None:
        raise InputError(f"--data applies to the benchmarks read from local files ({', '.join(benchmarks())}), "
                         f"not to task {key!r}")  # fmt: skip
    if entry is not None and split is not None and split not in entry.splits:
        allowed = f"one of {', '.join(entry.splits)}" if entry.splits else "none (it is generated)"
        raise InputError(f"--split {split!r} does not apply to task {key!r}; allowed: {allowed}")
    if entry is not None:
        return entry.build(limit=limit, seed=seed, **({"split": split} if split else {}))
    if is_jsonl:
        if split is not None:
            raise InputError(f"--split does not apply to the JSONL task {key!r}")
        return load_jsonl(key.removeprefix("jsonl:"), limit=limit)
    raise InputError(
        f"unknown task {key!r}; known tasks: {', '.join(t for t in sorted(TASKS) if t not in benchmarks())}, or a "
        f"JSONL file given as PATH.jsonl or jsonl:PATH, or a benchmark read with --data PATH: {', '.join(benchmarks())}"
        f"{did_you_mean(key, list(TASKS))}"
    )


def benchmarks() -> list[str]:
    """The registered tasks read from a local copy."""
    return sorted(n for n, e in TASKS.items() if e.reads_data)


def calibration_items(task: str, n: int, seed: int, candidates: bool = False) -> list:
    """`n` unlabeled inputs of a registered task (answers are never read): its `val` split when it has one.
    `candidates`: candidate items, from the task's candidate counterpart when it has generation records."""
    entry = TASKS.get(str(task))
    if candidates and entry is not None and entry.candidates is not None:
        entry = TASKS[entry.candidates]
    generated = [t for t in sorted(TASKS) if t not in benchmarks()]
    if entry is None or entry.reads_data:
        raise InputError(f"unknown calibration task {task!r}; allowed: {', '.join(generated)} (a generated "
                         "task: its unlabeled val inputs)")  # fmt: skip
    check_positive("n", n, "a positive number of calibration inputs")
    split = "val" if "val" in entry.splits else None
    items = get_task(entry.name, limit=n, seed=seed, split=split).records[:n]
    if candidates and not all(hasattr(it, "candidates") for it in items):
        raise InputError(f"task {task!r} has no candidate questions; the candidates method needs them")
    return items
