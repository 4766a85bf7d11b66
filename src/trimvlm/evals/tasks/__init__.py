"""Evaluation tasks: a list of `Record`s plus generation settings, by name (`get_task`).

- `base`: Record (the generation item), Task, the one registry `TASKS`; `lookup`: `get_task`, `benchmarks`,
  `calibration_items`; `jsonl`: a task from a JSONL file in trimvlm's own schema;
- `demo` and `scenes`: the synthetic tasks of the demo models; `benchmark`: the `Benchmark` description each
  benchmark file (pope, scienceqa, mmbench, ai2d, textvqa, docvqa, chartqa, mmvet) registers, and its loader.

Every module of this package is imported when it is (`protocol.discover`: no list kept by hand), so a new
file that registers a task or a benchmark is one.
"""

from trimvlm.evals.tasks.base import (
    GROUP_PROBES,
    PROBES,
    TASKS,
    Record,
    Task,
    TaskEntry,
    check_limit,
    check_positive,
    check_prefill_answers,
    register_task,
)
from trimvlm.evals.tasks.benchmark import Benchmark, load_benchmark, register_benchmark
from trimvlm.evals.tasks.demo import demo_candidate_task, demo_task
from trimvlm.evals.tasks.jsonl import load_jsonl
from trimvlm.evals.tasks.lookup import benchmarks, calibration_items, get_task
from trimvlm.protocol import discover

__all__ = [
    "PROBES",
    "TASKS",
    "Benchmark",
    "Record",
    "Task",
    "GROUP_PROBES",
    "TaskEntry",
    "benchmarks",
    "calibration_items",
    "check_limit",
    "check_positive",
    "check_prefill_answers",
    "demo_candidate_task",
    "demo_task",
    "get_task",
    "load_benchmark",
    "load_jsonl",
    "register_benchmark",
    "register_task",
]

discover(__name__)
