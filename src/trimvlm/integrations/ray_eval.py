"""Evaluation sharded over Ray workers (`trimvlm eval --ray auto|local|ADDRESS --workers N`; optional extra
`trimvlm[ray]`); docs/scale-out.md says how it runs and what is identical to one process.

`run_eval_ray` takes run_eval's own arguments (the model by name instead of loaded, plus the Ray settings). The
driver cuts the task's batches (run_eval's own `batches`) into shards of consecutive batches; each worker loads
the model once and runs `run_eval` on shard after shard with the recipe order every batch has in one process
(`order_offset`). The merge puts the predictions back in the task's order, adds up the per-(probe, kind) cost
sums (`CostAcc.merge`) and makes scores and rows with run_eval's own `finish`.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import suppress
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from trimvlm.cluster import RayError, connect
from trimvlm.errors import TrimVLMError
from trimvlm.evals.run import (
    CostAcc,
    EvalResult,
    batches,
    finish,
    normalize_recipes,
    prepare_task,
    run_eval,
)
from trimvlm.evals.tasks import Task, check_positive
from trimvlm.progress import steps

SHARDS_PER_WORKER = 4  # shards are pulled as workers free up: a few per worker balance uneven batches
IN_FLIGHT = 2  # shards queued per worker, so none waits on the driver between two


def check_workers(workers) -> int | None:
    return check_positive("workers", workers, "a positive number of Ray workers", optional=True)


def _worker_class(ray):
    @ray.remote
    class EvalWorker:
        """One model, loaded once; runs run_eval on shard after shard."""

        def __init__(self, model, load_kw: dict):
            self.error = None
            self.measured: set[str] = set()
            self.warm = False
            try:
                import torch

                import trimvlm

                if not ray.get_gpu_ids():
                    torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources()
                                                     .get("CPU", 1))))  # fmt: skip
                self.vlm = trimvlm.load(model, **load_kw)
            except Exception as e:  # raised by info(), so the driver sees the reason
                self.error = e

        def info(self) -> dict:
            if self.error is not None:
                raise self.error
            return {
                "node": ray.util.get_node_ip_address(),
                "pid": os.getpid(),
                "device": str(self.vlm.runner.device),
                "gpus": [str(g) for g in ray.get_gpu_ids()],
            }

        def run(self, task: Task, recipes, offset: int, kw: dict) -> dict:
            """run_eval on one shard, its recipe order that of its batches in the whole task."""
            kw = dict(kw)
            probes = {r.probe for r in task.records}
            if kw.get("memory") == "first":  # the first batch of each probe kind on this worker
                kw["memory"] = "off" if probes <= self.measured else "first"
                self.measured |= probes
            kw["warmup"] = kw.get("warmup", True) and not self.warm
            t0 = time.perf_counter()
            res = run_eval(self.vlm, task, recipes, progress=False, order_offset=offset, **kw)
            self.warm = True
            latency = {r["recipe"]: r["ratio"]["latency_s"] for r in res.rows if r["group"] == "all"}
            fields = {k: getattr(res, k) for k in ("predictions", "costs", "depths", "settings")}
            return {**fields, "latency_ratio": latency, "seconds": time.perf_counter() - t0, "worker": self.info()}

    return EvalWorker


def _get(ray, refs):
    """`ray.get(refs)`; a worker's failure raised as the TrimVLMError it raised, else as a RayError."""
    try:
        return ray.get(refs)
    except Exception as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, TrimVLMError):
            raise cause from None
        if isinstance(e, ray.exceptions.RayTaskError) and cause is not None:
            raise RayError(f"a Ray worker failed: {type(cause).__name__}: {cause}") from None
        raise RayError(f"a Ray worker failed: {' '.join(str(e).split())[:500]}") from None


class Shard(NamedTuple):
    """A run of consecutive batches of the task: its item indices, the index of its first batch, how many."""

    items: list[int]
    first_batch: int
    batches: int


def shards_of(task: Task, batch_size: int, n_shards: int) -> list[Shard]:
    """At most `n_shards` runs of consecutive batches of `batches`. A shard's items regroup into exactly
    its batches (checked): within a (probe, kind) group only the group's last batch is short, and it is the
    last of that group in a shard."""
    whole = batches(task, batch_size)
    per = max(1, math.ceil(len(whole) / max(1, n_shards)))
    out = []
    for s in range(0, len(whole), per):
        part = whole[s : s + per]
        idx = [i for b in part for i in b]
        again = batches(replace(task, records=[task.records[i] for i in idx]), batch_size)
        if [[idx[j] for j in b] for b in again] != part:  # pragma: no cover - invariant
            raise TrimVLMError(f"shard {len(out)} does not regroup into its batches; please report this")
        out.append(Shard(idx, s, len(part)))
    return out


class RayEvaluator:
    """Ray workers that stay up across evaluations: `with RayEvaluator(model, ...) as ev: ev(task, recipes, **kw)`
    runs each `run_eval(vlm, task, recipes, **kw)` sharded over the same actors (each loads the model once, for
    all the calls), so a search that evaluates many times (`trimvlm tune --ray`) pays for the loads once.
    `workers` None: one per GPU (GPU workers), else per CPU; `ray_address`: see `connect`."""

    def __init__(self, model: str | Path, *, workers: int | None = None, ray_address: str | None = None,
                 load_kw: dict | None = None, shards_per_worker: int = SHARDS_PER_WORKER, progress: bool = True,
                 console=None):  # fmt: skip
        self.workers = check_workers(workers)
        check_positive("shards_per_worker", shards_per_worker)
        self.model, self.ray_address, self.load_kw = model, ray_address, dict(load_kw or {})
        self.shards_per_worker, self.progress, self.console = shards_per_worker, progress, console
        self.ray, self.started, self.where, self.actors, self.infos = None, False, None, [], []

    def __enter__(self) -> RayEvaluator:
        self.ray, self.started, self.where = connect(self.ray_address)
        try:
            self.actors = _start_workers(self.ray, self.where, self.workers, self.model, self.load_kw)
            self.infos = _get(self.ray, [a.info.remote() for a in self.actors])
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for a in self.actors:
            with suppress(Exception):
                self.ray.kill(a)
        self.actors = []
        if self.started:
            self.ray.shutdown()
            self.started = False

    def __call__(self, task: Task | str, recipes=None, *, progress: bool | None = None, **kw) -> EvalResult:
        """run_eval's result for `task` and `recipes` (run_eval's keyword arguments), sharded over the workers."""
        progress = self.progress if progress is None else progress
        task, kw = _checked(task, kw, progress)
        recipes = normalize_recipes(recipes)
        shards = shards_of(task, kw["batch_size"], len(self.actors) * self.shards_per_worker)
        total = sum(s.batches for s in shards) * len(recipes)
        with steps(f"eval {task.name} on {len(self.actors)} Ray workers", total, self.console, progress,
                   unit="batch") as bar:  # fmt: skip
            t_start = time.perf_counter()
            results = _pull(self.ray, self.actors, shards, task, recipes, kw, bar)
        return _merge(task, recipes, shards, results, self.where, len(self.actors), self.infos,
                      time.perf_counter() - t_start)  # fmt: skip


def run_eval_ray(
    model: str | Path,
    task: Task | str,
    recipes=None,
    *,
    workers: int | None = None,
    ray_address: str | None = None,
    load_kw: dict | None = None,
    shards_per_worker: int = SHARDS_PER_WORKER,
    progress: bool = True,
    console=None,
    **kw,
) -> EvalResult:
    """`run_eval(vlm, task, recipes, **kw)` with the items sharded over `workers` Ray actors, each loading
    `model` (a checkpoint folder or "demo", on every node) once with `load_kw`: on its own GPU when the cluster
    has GPUs and `load_kw` names no device or a CUDA one, else on the CPU. `workers` None: one per GPU (GPU
    workers), else per CPU. `ray_address`: see `connect`. The result is run_eval's (see docs/scale-out.md
    for what is identical to one process and what is per shard); `settings["ray"]` says how it ran."""
    task, kw = _checked(task, kw, progress)  # bad input fails before Ray
    with RayEvaluator(model, workers=workers, ray_address=ray_address, load_kw=load_kw,
                      shards_per_worker=shards_per_worker, progress=progress, console=console) as ev:  # fmt: skip
        return ev(task, recipes, **kw)


def _checked(task: Task | str, kw: dict, progress: bool) -> tuple[Task, dict]:
    """run_eval's checks and its task (built by name, cut to `limit`, capped), before any Ray work; the rest of
    run_eval's keyword arguments."""
    kw = {"batch_size": 16, "memory": "first", **kw}
    built = {k: kw.pop(k, None) for k in ("limit", "max_new_tokens", "data", "split")}
    return prepare_task(task, seed=kw.get("seed", 0), progress=progress, memory=kw["memory"],
                        batch_size=kw["batch_size"], **built), kw  # fmt: skip


def _start_workers(ray, where: str, workers: int | None, model, load_kw: dict):
    """The actors (one model each, on a GPU of its own when the cluster has GPUs)."""
    res = ray.cluster_resources()
    gpus, cpus = int(res.get("GPU", 0)), int(res.get("CPU", 0))
    device = str(load_kw.get("device", "cuda" if gpus else "cpu"))
    use_gpu = device.startswith("cuda")
    if use_gpu and not gpus:
        raise RayError(f"device {device!r} asks for GPU workers, but the Ray cluster at {where} has no GPUs")
    if use_gpu:
        load_kw["device"] = "cuda"  # Ray sets CUDA_VISIBLE_DEVICES: "cuda" is the worker's own GPU
    kind, have = ("GPU", gpus) if use_gpu else ("CPU", cpus)
    workers = workers or have
    if workers > have:
        raise RayError(f"{workers} workers need {workers} {kind}s (one each) but the Ray cluster at {where} has "
                       f"{have}; give --workers {have} or fewer, or add nodes")  # fmt: skip
    opts = {"num_gpus": 1, "num_cpus": 1} if use_gpu else {"num_cpus": 1}
    Worker = _worker_class(ray)
    return [Worker.options(**opts).remote(str(model), load_kw) for _ in range(workers)]


def _pull(ray, actors, shards, task, recipes, kw: dict, bar) -> dict[int, dict]:
    """Every shard run, `IN_FLIGHT` queued per worker, the next pulled by whichever worker finishes; `bar` (a
    `Steps`) advanced by each shard's batches x recipes as it ends."""
    results: dict[int, dict] = {}
    pending, queue = {}, list(range(len(shards)))

    def submit(a: int) -> None:
        s = queue.pop(0)
        part = replace(task, records=[task.records[i] for i in shards[s].items])
        pending[actors[a].run.remote(part, recipes, shards[s].first_batch, kw)] = (s, a)

    for a in range(len(actors)):
        for _ in range(IN_FLIGHT):
            if queue:
                submit(a)
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        s, a = pending.pop(done[0])
        results[s] = _get(ray, done[0])
        bar.phase(f"shard {s + 1}/{len(shards)}")
        bar.advance(shards[s].batches * len(recipes))
        if queue:
            submit(a)
    return results


def _merge(task, recipes, shards, results, where, workers, infos, seconds) -> EvalResult:
    preds: list[list] = [[None] * len(task.records) for _ in recipes]
    accs: list[dict] = [{} for _ in recipes]
    for s, shard in enumerate(shards):
        part = results[s]
        for r in range(len(recipes)):
            for local, i in enumerate(shard.items):
                preds[r][i] = part["predictions"][r][local]
            for key, acc in part["costs"][r].items():
                accs[r].setdefault(key, CostAcc()).merge(acc)
    settings = dict(results[0]["settings"])
    memories = {results[s]["settings"]["memory"] for s in results}
    settings["memory"] = memories.pop() if len(memories) == 1 else "first (each Ray worker)"
    settings["warmup"] = any(results[s]["settings"]["warmup"] for s in results)
    settings["ray"] = {
        "address": where,
        "workers": workers,
        "worker_info": infos,
        "shards": [{**shard._asdict(), "items": len(shard.items),
                    **{k: results[s][k] for k in ("worker", "seconds", "latency_ratio")}}
                   for s, shard in enumerate(shards)],  # fmt: skip
        "seconds": seconds,
        "timing": "sums over shards; each shard's recipes interleaved on its own worker",
    }
    return finish(task, recipes, preds, accs, settings, results[0]["depths"])
