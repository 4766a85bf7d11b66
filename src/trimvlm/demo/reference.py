"""The shipped demo checkpoint's reference accuracy, measured by transformers' own `generate`.

`record_reference(folder)` scores the first `items` questions of the checkpoint's task (`trimvlm.json`'s
"task": the grid demo task, or scenes for demo-scenes; seed 0, test split) with the
model's own greedy `generate` — not trimvlm's runner — and writes the result into the checkpoint's
`trimvlm.json` under `reference`. The test suite then checks that trimvlm's runner and harness, on the same
items, land within 2 points of it: the shipped model and the shipped code agree.

    python -m trimvlm.demo.reference [--model demo|demo-qwen35|demo-scenes | --folder PATH] [--items 200]
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import typer

from trimvlm.evals.metrics import get_metric
from trimvlm.evals.run import batches
from trimvlm.evals.tasks import get_task
from trimvlm.loading import load_adapter, resolve


def reference_accuracy(folder: str | Path, items: int = 200, batch_size: int = 50) -> dict:
    adapter = load_adapter(folder)
    model, tok = adapter.model, adapter.tokenizer
    name = json.loads((Path(folder) / "trimvlm.json").read_text()).get("task", "demo")
    task = get_task(name, limit=items, seed=0, split="test")
    scores: dict[str, list[float]] = {}
    for idx in batches(task, batch_size):  # one (probe, kind) a batch
        chunk = [task.records[i] for i in idx]
        prep = adapter.prepare([r.images for r in chunk], [r.prompt_text() for r in chunk])
        with torch.no_grad():
            out = model.generate(
                input_ids=prep.input_ids, attention_mask=prep.attention_mask, **prep.model_inputs,
                max_new_tokens=task.new_tokens(chunk[0].probe, chunk[0].kind), do_sample=False,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
            )[:, prep.input_ids.shape[1] :]  # fmt: skip
        for r, row in zip(chunk, out.tolist(), strict=True):
            text = tok.decode([t for t in row if t not in (tok.eos_token_id, tok.pad_token_id)],
                              skip_special_tokens=True).strip()  # fmt: skip
            scores.setdefault(r.kind, []).append(get_metric(r.metric).score(text, r.answers, r.options))
    by_kind = {k: sum(v) / len(v) for k, v in scores.items()}
    overall = sum(sum(v) for v in scores.values()) / sum(len(v) for v in scores.values())
    return {"task": name, "items": items, "seed": 0, "split": "test", "measured_with": "transformers generate (greedy)",
            "overall": overall, "by_kind": by_kind}  # fmt: skip


def record_reference(folder: str | Path, items: int = 200) -> dict:
    folder = Path(folder)
    ref = reference_accuracy(folder, items)
    meta_path = folder / "trimvlm.json"
    meta = json.loads(meta_path.read_text())
    meta["reference"] = ref
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return ref


def main(
    folder: str | None = typer.Option(None, help="checkpoint folder (default: the shipped --model)"),
    model: str = typer.Option("demo", help="shipped demo model: demo, demo-qwen35 or demo-scenes"),
    items: int = typer.Option(200),
) -> None:
    """Record the checkpoint's reference accuracy (transformers' own greedy generate) in its trimvlm.json."""
    print(json.dumps(record_reference(folder or resolve(model), items), indent=2))


if __name__ == "__main__":
    typer.run(main)
