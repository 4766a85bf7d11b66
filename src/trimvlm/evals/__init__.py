"""The one evaluation harness: one task registry (the demo tasks, JSONL files, every benchmark loader), items of
one protocol (generation records, candidate items), the interleaved items x recipes loop, one report module.

from trimvlm.evals import evaluate
result = evaluate(vlm, task="demo", recipes=["kv=density:keep=0.25"], limit=120)  # or task="demo-candidates"
print_report(result); write_json(result, "out.json"); plot_pareto(result, "out.png")
"""

from trimvlm.evals.items import CandidateItem, RunOptions
from trimvlm.evals.metrics import (
    METRICS,
    anls,
    exact_match,
    get_metric,
    mismatch_pct,
    normalize_answer,
    yes_no_f1,
)
from trimvlm.evals.report import plot_pareto, print_report, write_json, write_markdown
from trimvlm.evals.run import CostAcc, EvalResult, normalize_recipes, run_eval
from trimvlm.evals.tasks import TASKS, Record, Task, get_task, load_jsonl, register_task

evaluate = run_eval

__all__ = [
    "METRICS",
    "CandidateItem",
    "CostAcc",
    "RunOptions",
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
    "write_markdown",
    "yes_no_f1",
]
