"""Evaluation harness: tasks (the demo task, JSONL benchmarks), metrics, the interleaved run loop, reports.

from trimvlm.evals import evaluate
result = evaluate(vlm, task="demo", recipes=["kv=density:keep=0.25"], limit=120)
print_report(result); write_json(result, "out.json"); plot_pareto(result, "out.png")
"""

from trimvlm.evals.metrics import (
    METRICS,
    anls,
    exact_match,
    get_metric,
    mismatch_pct,
    normalize_answer,
    yes_no_f1,
)
from trimvlm.evals.report import plot_pareto, print_report, write_json
from trimvlm.evals.run import EvalResult, normalize_recipes, run_eval
from trimvlm.evals.tasks import TASKS, Record, Task, get_task, load_jsonl, register_task

evaluate = run_eval

__all__ = [
    "METRICS",
    "TASKS",
    "EvalResult",
    "Record",
    "Task",
    "anls",
    "evaluate",
    "exact_match",
    "get_metric",
    "get_task",
    "load_jsonl",
    "mismatch_pct",
    "normalize_answer",
    "normalize_recipes",
    "plot_pareto",
    "print_report",
    "register_task",
    "run_eval",
    "write_json",
    "yes_no_f1",
]
