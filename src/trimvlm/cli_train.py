"""The training commands' CLI glue (`trimvlm calibrate-router`, `refit-router`, `train-head`): load, pick the
inputs, show progress, write; the training itself is the method packages' (`trimvlm.training`,
`trimvlm.scoring.train_head`)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

import trimvlm
from trimvlm.depth.base import model_fingerprint
from trimvlm.errors import InputError
from trimvlm.evals.tasks import calibration_items as calibration_records
from trimvlm.evals.tasks import check_positive
from trimvlm.loading import checkpoint_task, refuse_shipped, resolve
from trimvlm.progress import progress as progress_bar
from trimvlm.progress import steps as step_bar
from trimvlm.router.model import CONFIG, router_folder, save_router
from trimvlm.router.route import Router
from trimvlm.scoring.train_head import (
    BINARY_KINDS,
    EXTRACT_BATCH,
    TEST_IMAGES,
    Cached,
    Settings,
    accuracy,
    binary_report,
    extract,
    make_binary_items,
    make_items,
    predictions,
    test_report,
    train,
    without_answer,
)
from trimvlm.terminal import Col, Sheet
from trimvlm.training.calibration import measure, trained_inputs
from trimvlm.training.layer_pairs import refit_layers


def calibrate_router_command(router, model="demo", task="demo", n: int = 64, skip: int | None = None,
                             select: tuple[str, ...] = ("router",), console=None, load_kw: dict | None = None,
                             overwrite: bool = False) -> dict:  # fmt: skip
    """`trimvlm calibrate-router`: measure a v2 router's held-out calibration (training/calibration.py) on `n`
    val inputs after the `skip` it trained on (default: its training count, same seed) and write it into the
    checkpoint (a shipped demo router only with `overwrite`)."""
    console = console or Console()
    folder, vlm, r = v2_router(router, model, load_kw, "calibrated", overwrite)
    skip = trained_inputs(r.meta) if skip is None else skip
    if not isinstance(n, int) or n < 1 or skip < 0:
        raise InputError(f"--n must be a positive number of inputs and --skip >= 0, got n={n!r}, skip={skip!r}")
    seed = int(r.meta.get("seed", 0))
    records = calibration_records(task, skip + n, seed)[skip:]
    with step_bar("calibrate-router", len(records), console, unit="input",
                  phase=f"held-out layouts, selectors {', '.join(select)}") as bar:  # fmt: skip
        held = measure(vlm, r, records, list(select), on_step=bar.advance)
    meta = json.loads((folder / CONFIG).read_text())
    meta["budget"]["held_out"] = held | {"task": task, "skip": skip, "seed": seed}
    (folder / CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    console.print(f"wrote the held-out calibration ({len(records)} inputs; {', '.join(held['kl'])}) into {folder}; "
                  f"use it as the recipe router={router}:budget=0.75 (select= one of: {', '.join(held['kl'])})")  # fmt: skip
    return {"out": str(folder), "inputs": len(records), "selectors": list(held["kl"])}


def v2_router(router, model, load_kw, verb: str, overwrite: bool, out=None):
    """(the router's folder, the loaded model, the v2 router checked against it as a `Router` at budget 1). Writing
    into `out` (default: the router's folder) is refused first for a shipped demo router without `overwrite`."""
    folder = router_folder(router)
    refuse_shipped(folder if out is None else out, overwrite)
    vlm = trimvlm.load(model, **(load_kw or {}))
    r = Router(path=str(folder), budget=1.0)
    if "budget" not in r.meta:
        raise InputError(f"router {folder} is a v1 router: only a v2 one (train-router --keeps) is {verb}")
    r.check(vlm.runner)
    return folder, vlm, r


def refit_router_command(router, model="demo", task="demo", n: int = 512, select: str = "router", epochs: int = 40,
                         out=None, console=None, load_kw: dict | None = None, overwrite: bool = False,
                         **fit_kw) -> dict:  # fmt: skip
    """`trimvlm refit-router`: train a v2 router's layer scores on layouts run with `select`'s tokens
    (training/layer_pairs.py) on the task's first `n` val inputs; write it to `out` (default: in place; a
    shipped demo router only with `overwrite`)."""
    if not isinstance(n, int) or n < 1 or not isinstance(epochs, int) or epochs < 1:
        raise InputError(f"--n and --epochs must be positive integers, got n={n!r}, epochs={epochs!r}")
    console = console or Console()
    folder, vlm, r = v2_router(router, model, load_kw, "refit", overwrite, out)
    out = folder if out is None else Path(out)
    records = calibration_records(task, n, int(r.meta.get("seed", 0)))
    with step_bar("refit-router", len(records), console, unit="input",
                  phase=f"layouts with {select}'s tokens, then {epochs} DPO epochs") as bar:  # fmt: skip
        fit, budget, log = refit_layers(vlm, r, records, select, epochs=epochs, on_step=bar.advance, **fit_kw)
    own = ("hidden", "candidate_layers", "width", "heads", "ff", "fingerprint")
    extra = {k: v for k, v in r.meta.items() if k not in own} | {"budget": budget, "refit": log}
    save_router(fit, out, fingerprint=model_fingerprint(vlm.adapter), hidden=r.meta["hidden"], extra=extra)
    console.print(f"refit on {len(records)} inputs ({log['pairs']['layers']} layer pairs, {log['pairs']['iso']} "
                  f"iso-cost pairs; DPO loss {log['epochs'][0]['dpo_loss']:.4f} -> {log['epochs'][-1]['dpo_loss']:.4f}); "
                  f"wrote {out}: calibrate it on later inputs (`trimvlm calibrate-router {out} --model {model}`), "
                  f"then use it as the recipe router={out}:budget=0.75")  # fmt: skip
    return {"out": str(out), **log}


# ------------------------------------------------------------------------------------------- train-head


def _check(steps: int, items: int, out) -> None:
    check_positive("--steps", steps)
    if not isinstance(items, int) or items < 12:
        raise InputError(f"--items must be an integer >= 12 (two images' questions), got {items!r}")
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise InputError(f"--out {out} is a file; give a folder to write the decision head to")


DEMO_TASKS = ("demo", "scenes")


def demo_task_module(name: str):
    """The generator module of a demo task: `demo` (the grid task) or `scenes`."""
    if name not in DEMO_TASKS:
        allowed = ", ".join(DEMO_TASKS)
        raise InputError(f"--task must be one of {allowed} (the demo tasks a head trains on), got {name!r}")
    from trimvlm.demo import scenes, task

    return scenes if name == "scenes" else task


def train_head_command(
    model, out, steps: int, items: int, seed: int, console=None, threads: int = 1, load_kw: dict | None = None,
    overwrite: bool = False, task: str | None = None,
) -> dict:
    """Train and save the decision head of `model` (a checkpoint folder or a demo id) on a demo task's candidate
    questions (`task`: `demo` or `scenes`; default the checkpoint's own task, else `demo`). Returns the saved
    meta. The same seed and thread count give bitwise-equal weights (the shipped heads: one thread). A shipped
    demo checkpoint is written to only with `overwrite`."""
    _check(steps, items, out)
    refuse_shipped(out if out is not None else resolve(model), overwrite)
    torch.set_num_threads(check_positive("threads", threads))
    vlm = trimvlm.load(model, **(load_kw or {}))
    task = task if task is not None else checkpoint_task(vlm.adapter.folder)
    mod = demo_task_module(task)
    folder = Path(out) if out is not None else vlm.adapter.folder
    if folder is None:
        raise InputError(f"model {model!r} has no checkpoint folder to write the head to; pass --out")
    settings = Settings(steps=steps, items=items, seed=seed)
    kinds = list(mod.KINDS)
    t0 = time.perf_counter()
    with progress_bar(console, enabled=console is not None) as progress:
        sets = {name: extract(vlm, its, progress=progress, label=f"features: {LABELS[name]}")
                for name, its in _item_sets(seed, items, settings, mod).items()}  # fmt: skip
        t1 = time.perf_counter()
        head, fit = train(vlm.adapter.text_config.hidden_size, sets["train"], sets["val"], settings,
                          binary_train=sets["bin_train"], binary_val=sets["bin_val"], progress=progress)  # fmt: skip
    seconds = {"seconds_features": round(t1 - t0, 1), "seconds_train": round(time.perf_counter() - t1, 1)}
    meta = _head_meta(model, head, sets, settings, fit, seconds, task, kinds)
    folder.mkdir(parents=True, exist_ok=True)
    head.save(folder, meta=meta)
    if vlm.adapter.folder is not None and folder.resolve() == Path(vlm.adapter.folder).resolve():
        vlm.head = head
    if console is not None:
        _print_summary(console, folder, meta, kinds)
    return meta


LABELS = {"train": "train", "val": "val", "test": "test", "removed": "test, answer removed",
          "bin_train": "binary train", "bin_val": "binary val", "bin_test": "binary test"}  # fmt: skip


def _item_sets(seed: int, items: int, settings: Settings, mod) -> dict[str, list]:
    """The head's training, validation and test items of the demo task module `mod` (choice items, then the
    binary ones from their own random stream), in the order their features are extracted."""
    KINDS, generate_split = mod.KINDS, mod.generate_split  # noqa: N806

    rng = np.random.default_rng([seed, 20250101])
    train_samples = generate_split("train", math.ceil(items / len(KINDS)), seed=seed)
    out = {"train": make_items(train_samples, settings.abstain_fraction, rng, items),
           "val": make_items(generate_split("val", settings.val_images), settings.abstain_fraction, rng),
           "test": make_items(generate_split("test", TEST_IMAGES), 0.0, rng)}  # fmt: skip
    out["removed"] = [without_answer(it) for it in out["test"] if len(it.candidates) >= 3]
    rng_b = np.random.default_rng([seed, 20250102])  # its own stream: the choice items stay as they were
    out["bin_train"] = make_binary_items(train_samples, rng_b)
    out["bin_val"] = make_binary_items(generate_split("val", settings.val_images), rng_b)
    out["bin_test"] = make_binary_items(generate_split("test", TEST_IMAGES), rng_b)
    return out


def _head_meta(model, head, sets: dict, settings: Settings, fit: dict, seconds: dict, task: str,
               kinds: list[str]) -> dict:  # fmt: skip
    """What a trained head's checkpoint says of itself: its test report, validation figures, settings."""
    val_pred = predictions(head, sets["val"])
    return {
        "task": task,
        "model": str(model),
        "test_items": {"split": "test", "seed": 0, "n_images": TEST_IMAGES, "questions_per_kind": 1},
        **test_report(head, sets["test"], sets["removed"], kinds, sets["bin_test"]),
        "val_accuracy": accuracy(val_pred, sets["val"], kinds),
        "val_abstain_accuracy": _abstain_accuracy(val_pred, sets["val"]),
        "val_binary_accuracy": binary_report(head, sets["bin_val"])["accuracy"],
        "train": {
            **settings.as_dict(),
            "split": "train",
            "train_items": len(sets["train"]),
            "train_abstain_items": int(sets["train"].abstains.sum()),
            "val_items": len(sets["val"]),
            "binary_kinds": list(BINARY_KINDS),
            "binary_train_items": len(sets["bin_train"]),
            "binary_val_items": len(sets["bin_val"]),
            "executor": "batched",
            "extract_batch": EXTRACT_BATCH,
            "best_step": fit["best_step"],
            "best_val_accuracy": fit["best_val_accuracy"],
            **seconds,
            "torch_threads": torch.get_num_threads(),
        },
    }


def _abstain_accuracy(pred: torch.Tensor, c: Cached) -> float | None:
    sel = c.abstains
    return float((pred[sel] == c.target[sel]).float().mean()) if bool(sel.any()) else None


def _print_summary(console, folder: Path, meta: dict, kinds: list[str]) -> None:
    ab = meta["test_abstention"]
    table = Sheet(console, f"decision head -> {folder}",
                  ["kind", *(Col(c, right=True) for c in ("head", "loglik", "abstains (answer present)",
                                                            "abstains (answer removed)"))])  # fmt: skip
    for k in [*kinds, "all"]:
        present = ab["answer_present"]["by_kind"].get(k) if k != "all" else ab["answer_present"]["rate"]
        removed = ab["answer_removed"]["by_kind"].get(k) if k != "all" else ab["answer_removed"]["rate"]
        table.row(
            k,
            f"{meta['test_accuracy'][k]:.1%}",
            f"{meta['test_accuracy_loglik'][k]:.1%}",
            "-" if present is None else f"{present:.1%}",
            "-" if removed is None else f"{removed:.1%}",
        )
    console.print(table)
    if "test_binary_accuracy" in meta:
        b = meta["test_binary_accuracy"]
        console.print("binary accuracy (P(true) >= 0.5): " + ", ".join(f"{k} {v:.1%}" for k, v in b.items()))
    t = meta["train"]
    console.print(
        f"best step {t['best_step']} (val accuracy {t['best_val_accuracy']:.3f}); features {t['seconds_features']} s, "
        f"training {t['seconds_train']} s; use it: trimvlm score --model {folder} --readout head ..."
    )
