"""Prefill wall time and FLOPs with visual-token reduction vs the uncompressed baseline.

A tiny random Qwen3-VL (hidden 256, 8 layers, head_dim 64; `--hidden`, `--num-layers` to change) and one 512x512 image (patch 8, merge 2 -> 32x32
= 1024 visual tokens) plus a short prompt. Recipes: `density` at prune 50/75/80/90% inserted at L = 0 and
L = 3 (and any other `--methods`). Timing: median over interleaved repeats (every recipe once per round, so
drift on a shared machine hits all alike) of the LLM prefill (the decoder layers, the reduction itself
included, and the LM head; the vision tower runs identically for every recipe and is reported apart).
The FLOP-ratio bound is baseline prefill FLOPs / recipe prefill FLOPs; `efficiency` = measured speedup /
bound (the issue's target: >= 0.8 at L = 0, prune 80%).

    python benchmarks/prefill_speed.py --json pre.json [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch
from rich.console import Console
from rich.table import Table

from trimvlm.loading import load_adapter
from trimvlm.plan import make_plan
from trimvlm.runtime.attention import AttentionContext
from trimvlm.runtime.meter import Meter
from trimvlm.runtime.runner import Runner
from trimvlm.testing import random_image, tiny_checkpoint


def run_once(runner, prep, plan) -> Meter:
    meter = Meter()
    ctx = AttentionContext(probe=plan.probe) if plan.probe is not None else None
    runner.prefill(prep, hook=plan.hook, ctx=ctx, meter=meter)
    return meter


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="prefill_speed.json")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--methods", nargs="+", default=["density"])
    ap.add_argument("--prunes", type=float, nargs="+", default=[0.5, 0.75, 0.8, 0.9])
    ap.add_argument("--layers", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--image", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--num-layers", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    console = Console(width=160)
    folder = tiny_checkpoint("qwen3_vl", tempfile.mkdtemp(), hidden=args.hidden, layers=args.num_layers,
                             heads=args.hidden // 64, kv_heads=max(1, args.hidden // 128), vision_hidden=32)  # fmt: skip
    adapter = load_adapter(folder)
    runner = Runner(adapter)
    images = [[random_image(i, (args.image, args.image))] for i in range(args.batch)]
    prep = adapter.prepare(images, ["what is the colour of the square in the image"] * args.batch)
    n_vis = int((prep.input_ids == adapter.image_token_id).sum()) // args.batch
    recipes = ["baseline"] + [
        f"tokens={m}:prune={p}:layer={lay}" for m in args.methods for lay in args.layers for p in args.prunes
    ]
    plans = {r: make_plan("" if r == "baseline" else r, runner) for r in recipes}
    times: dict[str, list[float]] = {r: [] for r in recipes}
    vision: dict[str, list[float]] = {r: [] for r in recipes}
    flops: dict[str, int] = {}
    for r in recipes:  # warm-up
        run_once(runner, prep, plans[r])
    for rep in range(args.repeats):
        for r in recipes:
            m = run_once(runner, prep, plans[r])
            times[r].append(m.costs.seconds["prefill"])
            vision[r].append(m.costs.seconds["vision"])
            flops[r] = m.costs.flops["prefill"]
        console.log(
            f"round {rep + 1}/{args.repeats}: baseline {statistics.median(times['baseline']) * 1e3:.1f} ms"
        )
    base_t, base_f = statistics.median(times["baseline"]), flops["baseline"]
    rows = []
    for r in recipes:
        t = statistics.median(times[r])
        bound = base_f / flops[r]
        rows.append(
            dict(recipe=r, prefill_ms=t * 1e3, vision_ms=statistics.median(vision[r]) * 1e3, prefill_flops=flops[r],
                 flop_ratio=flops[r] / base_f, speedup=base_t / t, bound=bound, efficiency=(base_t / t) / bound,
                 times_ms=[x * 1e3 for x in times[r]])
        )  # fmt: skip
    table = Table(
        title=f"prefill, tiny Qwen3-VL (hidden {args.hidden}, {args.num_layers} layers), {n_vis} visual tokens, "
        f"batch {args.batch}"
    )
    for c in ("recipe", "prefill ms", "GFLOPs", "FLOP ratio", "speedup", "bound", "efficiency"):
        table.add_column(c, justify="left" if c == "recipe" else "right", no_wrap=True)
    for x in rows:
        table.add_row(
            x["recipe"], f"{x['prefill_ms']:.1f}", f"{x['prefill_flops'] / 1e9:.2f}", f"{x['flop_ratio']:.3f}",
            f"{x['speedup']:.2f}x", f"{x['bound']:.2f}x", f"{x['efficiency']:.0%}",
        )  # fmt: skip
    console.print(table)
    console.print(f"vision tower (same for all recipes): {rows[0]['vision_ms']:.1f} ms")
    meta = dict(visual_tokens=n_vis, batch=args.batch, repeats=args.repeats, threads=args.threads,
                hidden=args.hidden, layers=args.num_layers, torch=torch.__version__)  # fmt: skip
    with open(args.json, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
