"""Block influence (ShortGPT, Men et al. 2024): how much each decoder block changes the hidden states.

    BI_l = 1 - mean_t cos(h_in_l(t), h_out_l(t))

over every real (non-padding) token t of the calibration inputs, where h_in_l enters block l and h_out_l is
what leaves it (what enters block l + 1, the family's per-layer adds included; the last block's output is the
final hidden state before the final norm). A block with a low BI barely turns its input: the first to skip.
The calibration runs the unpruned prefill once per batch and reads the states through the runner's layer hook
(nothing is patched). `rank_block_influence` returns the ranking file's content, least influential first, for
`depth=ranking:file=...:budget=K`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trimvlm.depth.base import model_fingerprint
from trimvlm.errors import InputError


def layer_states(runner, prepared) -> list[torch.Tensor]:
    """The hidden states [B, S, D] entering every block, plus the last block's output (num_layers + 1)."""
    states: list[torch.Tensor] = []

    def hook(i, seq, run):
        states.append(seq.hidden)
        return seq

    runner.prefill(prepared, hook=hook)
    return states


def block_influence(runner, batches, on_step: Callable[[], None] | None = None) -> list[float]:
    """BI_l of every block over the prepared `batches` (token-weighted over all real tokens)."""
    n = runner.num_layers
    sums = torch.zeros(n, dtype=torch.float64)
    count = 0
    for prepared in batches:
        states = layer_states(runner, prepared)
        valid = prepared.attention_mask.bool().to(states[0].device)
        for i in range(n):
            cos = torch.nn.functional.cosine_similarity(states[i].double(), states[i + 1].double(), dim=-1)
            sums[i] += cos[valid].sum().cpu()
        count += int(valid.sum())
        if on_step is not None:
            on_step()
    if count == 0:
        raise InputError("block influence needs calibration inputs with at least one token")
    return [float(1.0 - s / count) for s in sums]


def rank_block_influence(vlm, records, batch_size: int = 16, on_step=None, calibration: dict | None = None) -> dict:
    """Score and rank every block of `vlm` on task `records` (their images and prompts; answers unused)."""
    if not records:
        raise InputError("block influence needs at least one calibration input")
    batches = [
        vlm.prepare([list(r.images) for r in records[a : a + batch_size]],
                    [r.prompt_text() for r in records[a : a + batch_size]])
        for a in range(0, len(records), batch_size)
    ]  # fmt: skip
    scores = block_influence(vlm.runner, batches, on_step)
    order = sorted(range(len(scores)), key=lambda i: (scores[i], i))
    return {
        "method": "block-influence",
        "fingerprint": model_fingerprint(vlm.adapter),
        "num_layers": vlm.runner.num_layers,
        "scores": scores,
        "order": order,
        "calibration": {"n": len(records), **(calibration or {})},
    }


def calibration_records(task: str, n: int, seed: int):
    """`n` inputs of a generation task: the demo task's val split for "demo", else the task's own records."""
    from trimvlm.evals.tasks import demo_task, get_task

    if str(task) == "demo":
        return demo_task(limit=n, seed=seed, split="val").records[:n]
    return get_task(task, limit=n, seed=seed).records


def calibrate_command(model="demo", task="demo", n: int = 32, seed: int = 0, json_out="rank.json", console=None,
                      batch_size: int = 16, load_kw: dict | None = None) -> dict:  # fmt: skip
    """`trimvlm calibrate --method block-influence`: score every block on `n` unlabeled inputs, write the
    ranking JSON, print a table. Returns the JSON's content."""
    import json
    from pathlib import Path

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    import trimvlm
    from trimvlm.options import is_int

    if not is_int(n) or n < 1:
        raise InputError(f"n must be a positive number of calibration inputs, got {n!r}")
    console = console or Console()
    vlm = trimvlm.load(model, **(load_kw or {}))
    records = calibration_records(task, n, seed)
    with Progress(TextColumn("[bold]block influence"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as bar:  # fmt: skip
        job = bar.add_task("bi", total=-(-len(records) // batch_size))
        data = rank_block_influence(vlm, records, batch_size, on_step=lambda: bar.advance(job),
                                    calibration={"task": str(task), "seed": seed, "split": "val"})  # fmt: skip
    data = {"model": str(model), "family": vlm.family, **data}
    t = Table(title=f"block influence BI_l ({model}, {len(records)} inputs)", title_justify="left")
    for col in ("layer", "type", "BI_l", "rank"):
        t.add_column(col, justify="left" if col == "type" else "right")
    rank = {layer: k for k, layer in enumerate(data["order"])}
    for layer, bi in enumerate(data["scores"]):
        t.add_row(str(layer), vlm.adapter.layer_types[layer], f"{bi:.4g}", str(rank[layer] + 1))
    console.print(t)
    console.print(f"order (least influential first): {data['order']}")
    if json_out is not None:
        path = Path(json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
        console.print(f"wrote {json_out}")
    return data
