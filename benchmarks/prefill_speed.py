"""Prefill wall time and FLOPs with visual-token reduction vs the uncompressed baseline.

Model: a random Qwen3-VL of a realistic width by default (hidden 1024, 4 layers, head_dim 64; `--hidden`,
`--num-layers`, `--heads`, `--kv-heads`), `--tiny` for the small shape (hidden 256, 8 layers, batch 1), or any
supported checkpoint with `--model PATH`. Input: `--batch` (default 4) images of `--image` pixels (512: patch 8,
merge 2 -> 32x32 = 1024 visual tokens on the random model) plus a short prompt. Recipes: `--methods` (default
density) at prune 50/75/80/90% inserted at L = 0 and L = 3.

`--width 3b`: the width of Qwen2.5-VL-3B (hidden 2048, 16 heads, 2 KV heads) with 4 layers and random weights.

Timing: median over interleaved repeats (every recipe once per round, so drift on a shared machine hits all
alike) of the LLM prefill: the decoder layers, the method's own work (selection, merge, probes) and the LM
head; the vision tower runs identically for every recipe and is reported apart. FLOPs: the model's prefill
FLOPs plus the method's own (`Costs.method_flops`), so the FLOP-ratio bound = baseline FLOPs / (recipe model +
method FLOPs) is the speedup the work alone allows; `efficiency` = measured speedup / bound (issue 20's target:
>= 0.92 at L = 0, prune 80%, >= 0.88 at prune 90%, at the default shape, on 1 and 2 threads). `reduce ms` is the
reduction step itself (the hook call that shrinks the sequence), `reduce %` its median share of the prefill
(issues 20 and 33: <= 5%). Each thread count (`--threads 1 2`, the default) runs its own interleaved rounds
(>= 5); efficiency and reduce % are also given per round (each recipe against the baseline of the same round)
as the median and the spread (min-max) of those paired values. The per-pick loops run compiled (numba) unless
TRIMVLM_JIT=0. `--full`: density, divprune, cdpruner and dart, 9 rounds.

    python benchmarks/prefill_speed.py --json pre.json [--repeats 5] [--threads 1 2] [--width 3b] [--tiny]
        [--model PATH] [--full] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from rich.console import Console
from rich.table import Table

from trimvlm.kernels import jit
from trimvlm.loading import load_adapter
from trimvlm.plan import make_plan
from trimvlm.runtime.meter import Meter
from trimvlm.runtime.runner import Runner
from trimvlm.testing import REAL_WIDTHS, random_image, tiny_checkpoint

WIDTHS = {name: dict(w, num_layers=4) for name, w in REAL_WIDTHS.items()}  # a real width, 4 layers


def timed_hook(plan, spent: list[float]):
    """The plan with its reduction hook timed: `spent` collects the seconds of every hook call that changed the
    sequence (the reduction step: view, density, selection, merge, gather)."""
    if plan.hook is None:
        return plan
    inner = plan.hook

    def hook(i, seq, run):
        t0 = time.perf_counter()
        out = inner(i, seq, run)
        if out is not seq:
            spent.append(time.perf_counter() - t0)
        return out

    plan.hook = hook
    return plan


def run_once(runner, prep, plan, spent: list[float]) -> tuple[Meter, float]:
    meter = Meter(device=runner.device)  # synchronizes its phase timers on a GPU
    spent.clear()
    runner.prefill(prep, plan, meter=meter)
    return meter, sum(spent)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="prefill_speed.json")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved rounds per thread count (default 5)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--methods", nargs="+", default=None, help="default density (--full: four selections)")
    ap.add_argument("--prunes", type=float, nargs="+", default=[0.5, 0.75, 0.8, 0.9])
    ap.add_argument("--layers", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--image", type=int, default=512)
    ap.add_argument("--batch", type=int, default=None, help="default 4 (1 with --tiny)")
    ap.add_argument("--hidden", type=int, default=None, help="default 1024 (256 with --tiny)")
    ap.add_argument("--num-layers", type=int, default=None, help="default 4 (8 with --tiny)")
    ap.add_argument("--heads", type=int, default=None, help="default hidden / 64")
    ap.add_argument("--kv-heads", type=int, default=None, help="default hidden / 128")
    ap.add_argument("--tiny", action="store_true", help="the small shape: hidden 256, 8 layers, batch 1")
    ap.add_argument("--width", choices=sorted(WIDTHS), default=None,
                    help="a real checkpoint's width with random weights: 3b = hidden 2048, 16 heads, 2 KV heads, "
                    "4 layers (Qwen2.5-VL-3B)")  # fmt: skip
    ap.add_argument("--model", default=None, help="a supported checkpoint folder instead of the random model")
    ap.add_argument("--full", action="store_true", help="density, divprune, cdpruner and dart; 9 rounds")
    ap.add_argument("--quick", action="store_true", help="a smoke test in seconds: hidden 64, 2 layers, batch 1, "
                    "a 128 px image, prune 75% at L = 0 and 1, 1 repeat, 1 thread")  # fmt: skip
    args = ap.parse_args(argv)
    args.methods = args.methods or (["density", "divprune", "cdpruner", "dart"] if args.full else ["density"])
    args.repeats = args.repeats or (9 if args.full else 5)
    if args.quick:
        args.hidden, args.num_layers, args.batch, args.image = 64, 2, 1, 128
        args.prunes, args.layers, args.repeats, args.threads = [0.75], [0, 1], 1, [1]
    if args.width:
        for key, v in WIDTHS[args.width].items():
            setattr(args, key, getattr(args, key) or v)
    small = args.tiny
    args.batch = args.batch or (1 if small else 4)
    args.hidden = args.hidden or (256 if small else 1024)
    args.num_layers = args.num_layers or (8 if small else 4)
    return args


def rounds(runner, prep, plans, repeats: int, console, spent: list[float]) -> dict:
    """Interleaved rounds (every recipe once per round, after a warm-up): per recipe the prefill, reduction and
    vision seconds of every round, and the model's and the method's FLOPs. `spent`: the list the plans' timed
    hooks fill."""
    out = {r: dict(times=[], reduce=[], vision=[], flops=0, method=0) for r in plans}
    for r in plans:  # warm-up
        run_once(runner, prep, plans[r], spent)
    for rep in range(repeats):
        for r, plan in plans.items():
            m, red = run_once(runner, prep, plan, spent)
            o = out[r]
            o["times"].append(m.costs.seconds["prefill"])
            o["reduce"].append(red)
            o["vision"].append(m.costs.seconds["vision"])
            o["flops"], o["method"] = m.costs.flops["prefill"], m.costs.method_prefill_flops
        console.log(f"{torch.get_num_threads()} thread(s), round {rep + 1}/{repeats}: baseline "
                    f"{statistics.median(out['baseline']['times']) * 1e3:.1f} ms")  # fmt: skip
    return out


def summarise(res: dict, threads: int) -> list[dict]:
    base = res["baseline"]
    base_t, base_f = statistics.median(base["times"]), base["flops"] + base["method"]
    rows = []
    for r, o in res.items():
        t, total = statistics.median(o["times"]), o["flops"] + o["method"]
        bound = base_f / total
        eff = [b / x / bound for b, x in zip(base["times"], o["times"], strict=True)]  # paired, per round
        share = [a / b for a, b in zip(o["reduce"], o["times"], strict=True)]
        rows.append(
            dict(recipe=r, threads=threads, prefill_ms=t * 1e3, vision_ms=statistics.median(o["vision"]) * 1e3,
                 prefill_flops=o["flops"], method_flops=o["method"], total_flops=total, flop_ratio=total / base_f,
                 speedup=base_t / t, bound=bound, efficiency=(base_t / t) / bound,
                 efficiency_paired=statistics.median(eff), efficiency_spread=[min(eff), max(eff)],
                 times_ms=[x * 1e3 for x in o["times"]], reduce_ms=statistics.median(o["reduce"]) * 1e3,
                 reduce_share=statistics.median(share), reduce_share_spread=[min(share), max(share)])
        )  # fmt: skip
    return rows


def table(rows: list[dict], title: str) -> Table:
    t = Table(title=title)
    for c in ("recipe", "prefill ms", "reduce ms", "reduce % (min-max)", "model GFLOPs", "method GFLOPs",
              "FLOP ratio", "speedup", "bound", "efficiency", "paired eff. (min-max)"):  # fmt: skip
        t.add_column(c, justify="left" if c == "recipe" else "right", no_wrap=True)
    for x in rows:
        (slo, shi), (elo, ehi) = x["reduce_share_spread"], x["efficiency_spread"]
        t.add_row(
            x["recipe"], f"{x['prefill_ms']:.1f}", f"{x['reduce_ms']:.1f}",
            f"{x['reduce_share']:.1%} ({slo:.1%}-{shi:.1%})", f"{x['prefill_flops'] / 1e9:.2f}",
            f"{x['method_flops'] / 1e9:.3f}", f"{x['flop_ratio']:.3f}", f"{x['speedup']:.2f}x",
            f"{x['bound']:.2f}x", f"{x['efficiency']:.0%}", f"{x['efficiency_paired']:.0%} ({elo:.0%}-{ehi:.0%})",
        )  # fmt: skip
    return t


def main(argv=None):
    args = parse(argv)
    console = Console(width=180)
    if args.model:
        folder = args.model
    else:
        folder = tiny_checkpoint("qwen3_vl", tempfile.mkdtemp(), hidden=args.hidden, layers=args.num_layers,
                                 heads=args.heads or args.hidden // 64,
                                 kv_heads=args.kv_heads or max(1, args.hidden // 128), vision_hidden=32)  # fmt: skip
    adapter = load_adapter(folder)
    if args.model:
        cfg = adapter.text_config
        args.hidden, args.num_layers = cfg.hidden_size, cfg.num_hidden_layers
    runner = Runner(adapter)
    images = [[random_image(i, (args.image, args.image))] for i in range(args.batch)]
    prep = adapter.prepare(images, ["what is the colour of the square in the image"] * args.batch)
    n_vis = int((prep.input_ids == adapter.image_token_id).sum()) // args.batch
    recipes = ["baseline"] + [
        f"tokens={m}:prune={p}:layer={lay}" for m in args.methods for lay in args.layers for p in args.prunes
    ]
    spent: list[float] = []
    plans = {r: timed_hook(make_plan("" if r == "baseline" else r, runner), spent) for r in recipes}
    rows = []
    name = args.model or "random Qwen3-VL"
    for threads in args.threads:
        torch.set_num_threads(threads)
        got = summarise(rounds(runner, prep, plans, args.repeats, console, spent), threads)
        rows += got
        console.print(table(got, f"prefill, {name} (hidden {args.hidden}, {args.num_layers} layers), {n_vis} visual "
                      f"tokens, batch {args.batch}, {threads} thread(s), {args.repeats} rounds; FLOP ratio and "
                      "bound include the method's own FLOPs"))  # fmt: skip
        console.print(f"vision tower (same for all recipes): {got[0]['vision_ms']:.1f} ms")
    meta = dict(visual_tokens=n_vis, batch=args.batch, repeats=args.repeats, threads=args.threads, model=name,
                hidden=args.hidden, layers=args.num_layers, width=args.width, torch=torch.__version__,
                compiled=jit.compiled())  # fmt: skip
    with open(args.json, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
