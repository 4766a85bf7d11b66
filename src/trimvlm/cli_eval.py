"""The main jobs behind `trimvlm demo` and `trimvlm eval` (the typer CLI in cli.py calls these).

Inputs are checked before any model loads: a bad limit, an unknown task, a recipe file that does not parse
or names an unknown method each raise a TrimVLMError that says what was wrong.
"""

from __future__ import annotations

from pathlib import Path

import torch
from rich.console import Console

import trimvlm
from trimvlm.errors import CheckpointError, InputError, RecipeError, TrimVLMError
from trimvlm.evals.report import (
    check_writable,
    plot_pareto,
    print_report,
    result_dict,
    write_json,
    write_markdown,
    write_outputs,
)
from trimvlm.evals.run import normalize_recipes, prepare_task, run_eval
from trimvlm.evals.tasks import TASKS, check_limit, check_positive
from trimvlm.integrations.ray_eval import check_workers, run_eval_ray
from trimvlm.loading import resolve
from trimvlm.recipe import load_recipes, parse_recipe
from trimvlm.scoring.calibrate import check_readout_name

# Shown side by side with the baseline by `trimvlm demo` (codes as in the paper:
# L3_50 = prune 50% of visual tokens at layer 3, D75 = drop 75% of visual KV at the prefill/decode boundary).
DEMO_RECIPES: list[dict] = [
    {"name": "L3_50", "tokens": "density:keep=0.5:layer=3"},
    {"name": "D75", "kv": "density:keep=0.25"},
    {"name": "L3_50_D75", "tokens": "density:keep=0.5:layer=3", "kv": "density:keep=0.25"},
]
DEMO_LIMIT = 300
DEMO_BATCH_SIZE = 64  # 50 items of a kind in one call: per-call and per-step overheads dominate tiny models


def demo_command(
    limit: int = DEMO_LIMIT,
    json_out: str | Path | None = "trimvlm-demo.json",
    png_out: str | Path | None = "trimvlm-demo.png",
    recipes: list | None = None,
    batch_size: int = DEMO_BATCH_SIZE,
    seed: int = 0,
    progress: bool = True,
    console=None,
    load_kw: dict | None = None,
) -> dict:
    """Load the shipped demo model, run the baseline and DEMO_RECIPES on `limit` test items
    of the demo task, print the tables, write the JSON and the Pareto PNG. Returns the JSON's content."""
    limit = check_limit(limit)
    try:
        resolve("demo")
    except CheckpointError as e:
        raise CheckpointError(
            f"{e}; `trimvlm demo` needs the trained demo model: train it with `trimvlm train-demo`, or "
            "reinstall a trimvlm release that ships it"
        ) from None
    return eval_command("demo", "demo", None, limit, json_out, png_out, batch_size, seed, progress=progress,
                        console=console, recipes=DEMO_RECIPES if recipes is None else recipes, load_kw=load_kw)


def _recipes_from(recipes_file, inline=()) -> list:
    """The recipes of the file (if any), then the inline recipe strings (normalize_recipes validates them)."""
    out = []
    if recipes_file is not None:
        try:
            out = load_recipes(recipes_file)
        except TrimVLMError:
            raise
        except Exception as e:  # e.g. pydantic validation of a malformed entry
            raise RecipeError(f"recipe file {recipes_file} is not a valid list of recipes: {e}") from e
    return out + [parse_recipe(text) for text in inline]


def task_list() -> str:
    """Every registered task, one line each (`trimvlm eval --help`)."""
    return "\n".join(f"{name}: {TASKS[name].about}" for name in sorted(TASKS))


def eval_command(
    model: str | Path,
    task: str | Path = "demo",
    recipes_file: str | Path | None = None,
    limit: int | None = None,
    json_out: str | Path | None = None,
    plot_out: str | Path | None = None,
    batch_size: int = 16,
    seed: int = 0,
    max_new_tokens: int | None = None,
    progress: bool = True,
    console=None,
    markdown_out: str | Path | None = None,
    readout: str = "auto",
    recipes: list[str | dict] | None = None,
    load_kw: dict | None = None,
    data: str | Path | None = None,
    split: str | None = None,
    ray: str | None = None,
    workers: int | None = None,
    threads: int | None = None,
) -> dict:
    """Run the recipes of `recipes_file` (YAML/JSON) and the inline `recipes` (strings such as
    "tokens=density:keep=0.5:layer=3"; the baseline is always added, first) over `task` (a registered task:
    "demo", "demo-candidates", a benchmark such as "pope" read from its local copy at `data`, split `split`;
    or PATH.jsonl; `limit` items of it drawn with `seed`) with `model` (a checkpoint folder or "demo").
    `limit` None runs the whole task; `max_new_tokens` caps every full-answer item (prefill probes still
    generate the task's `prefill_tokens`); `readout` (auto | loglik | head) scores candidate items. Prints the
    tables, writes the JSON / Pareto PNG / Markdown summary when paths are given. Returns the JSON's content.
    `ray` ("auto", "local" or a cluster's HOST:PORT): shard the items over `workers` Ray workers, each with
    the model loaded once (trimvlm.integrations.ray_eval, docs/scale-out.md); the results are the single process's.
    `threads`: torch threads of this process (None: torch's default)."""
    console = console or Console()
    limit = check_limit(limit)
    workers = check_workers(workers)
    check_readout_name(readout)
    if threads is not None:
        torch.set_num_threads(check_positive("threads", threads, "a positive number of torch threads"))
    if workers is not None and ray is None:
        raise InputError("--workers applies to a run sharded over Ray: give --ray auto, local or HOST:PORT too")
    check_writable(json_out, plot_out, markdown_out)
    the_task = prepare_task(str(task), limit=limit, seed=seed, max_new_tokens=max_new_tokens, data=data, split=split,
                            progress=progress)  # a cap that cannot apply fails now, before the model loads
    chosen = normalize_recipes(_recipes_from(recipes_file, recipes or ()))
    kw = {"batch_size": batch_size, "seed": seed, "readout": readout, "progress": progress, "console": console}
    if ray is not None:
        result = run_eval_ray(model, the_task, chosen, workers=workers, ray_address=ray, load_kw=load_kw, **kw)
    else:
        result = run_eval(trimvlm.load(model, **(load_kw or {})), the_task, chosen, **kw)
    print_report(result, console=console)
    write_outputs(result, console, [(json_out, write_json), (plot_out, plot_pareto), (markdown_out, write_markdown)])
    return result_dict(result)
