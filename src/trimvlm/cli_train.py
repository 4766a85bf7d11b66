"""The training commands' CLI glue (`trimvlm train-router`): load, pick the inputs, show progress, write; the
training itself is the method package's (`trimvlm.router.train`)."""

from __future__ import annotations

from trimvlm.router.train import train_router


def train_router_command(model="demo", task="demo", n: int = 32, token_keep: float = 0.25, layers_skip: int = 2,
                         epochs: int = 3, seed: int = 0, out="runs/router", resume: bool = True, console=None,
                         load_kw: dict | None = None, overwrite: bool = False, **train_kw) -> dict:  # fmt: skip
    """`trimvlm train-router`: train on `n` unlabeled val inputs of the demo task, write the checkpoint (into
    a shipped demo checkpoint only with `overwrite`)."""
    from rich.console import Console

    import trimvlm
    from trimvlm.evals.tasks import calibration_items as calibration_records
    from trimvlm.loading import refuse_shipped
    from trimvlm.progress import progress as progress_bar

    refuse_shipped(out, overwrite)
    console = console or Console()
    vlm = trimvlm.load(model, **(load_kw or {}))
    records = calibration_records(task, n, seed)
    with progress_bar(console) as bar:
        job = bar.add_task("train-router", total=len(records) + epochs)
        log = train_router(vlm, records, token_keep=token_keep, layers_skip=layers_skip, epochs=epochs, seed=seed,
                           out=out, resume=resume, on_step=lambda: bar.advance(job), **train_kw)  # fmt: skip
    for e in log["epochs"]:
        console.print(f"epoch {e['epoch']}: DPO loss {e['dpo_loss']:.4f}")
    console.print(f"wrote {out}")
    return {"out": str(out), **log}
