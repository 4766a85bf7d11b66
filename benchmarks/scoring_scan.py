"""FastJEV's workload scan (its section 4.5) on tiny models: every candidate executor on artificial candidate
sets, candidates {4, 8, 16, 64} x suffix tokens {8, 32, 128} x shared content {0, 25, 50, 75%} x branching
{flat, two-level} = 96 conditions per model (a tiny Qwen3-VL and the tiny Qwen3.5 hybrid).

Shared content is the fraction of each candidate's tokens held in common, boundary markers excluded. Flat: all
candidates start with the same shared run, then their own tokens. Two-level: half of the shared run is common
to all, the other half common within groups of four candidates, then their own tokens.

Per condition and executor: full-request latency (prefix encoding + candidates + readout; the median of
`--rounds` interleaved rounds after a warm-up, order shuffled by a fixed seed each round; in a round a short
condition's calls repeat until each executor has run `--min-time` s, the executors in turn call by call, and
the round's figure is the mean; every round is kept too; `tree_over_batched_paired` is the median over rounds of
tree / batched in the same round, which the summary counts), candidate-phase latency (median), candidate-phase peak tensor memory (a separate, untimed run with the tensor tracker), logical vs
executed candidate tokens, and the largest score difference to `independent`. Times are ratios within one
process; absolute CPU times mean little.

    .venv/bin/python benchmarks/scoring_scan.py --json scan.json [--quick] [--models qwen3_vl,qwen3_5]
        [--threads 1] [--rounds 5] [--width 3b] [--full | --grid full|small]

By default it scans the small grid (below) in 3 rounds on one thread; `--full` scans all 96 conditions per model
in 5 rounds (about 20 minutes), as `docs/results/scan.json` was measured.

`--width 3b` builds the random-weight models at the width of a real checkpoint (Qwen2.5-VL-3B: hidden 2048,
16 heads, 2 KV heads; 4 layers so it runs in minutes). The small grid is candidates {4, 64} x
suffix tokens {8, 128} x shared {0, 75%} x both branchings = 16 conditions, the 64 x 128 x 75% ones included.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import tempfile
import time

import torch

from trimvlm.loading import load_adapter
from trimvlm.testing import REAL_WIDTHS, WORDS, random_image, tiny_checkpoint
from trimvlm.vlm import VLM

EXECUTORS = ["independent", "batched", "segments", "tree", "auto"]
CANDIDATES = [4, 8, 16, 64]
LENGTHS = [8, 32, 128]
SHARING = [0.0, 0.25, 0.5, 0.75]
BRANCHING = ["flat", "two-level"]
SMALL_GRID = ([4, 64], [8, 128], [0.0, 0.75])  # candidates, suffix tokens, shared content of `--grid small`
WIDTHS = {  # --width: (hidden, heads, KV heads); `tiny` takes --hidden; the others are real checkpoints' widths
    "tiny": (None, 4, 2),
    **{name: (w["hidden"], w["heads"], w["kv_heads"]) for name, w in REAL_WIDTHS.items()},
}
GROUP = 4
CONTENT = WORDS[20:]  # colour / shape / number words: no special tokens


def candidates(n: int, length: int, share: float, branching: str, seed: int) -> list[str]:
    """n candidates of `length` content tokens (the close marker is added by the layout)."""
    rng = random.Random(seed)

    def words(k):
        return [rng.choice(CONTENT) for _ in range(k)]

    shared = round(share * length)
    top = words(shared if branching == "flat" else shared // 2)
    groups = {}
    out = []
    for i in range(n):
        toks = list(top)
        if branching == "two-level":
            g = i // GROUP
            groups.setdefault(g, words(shared - shared // 2))
            toks += groups[g]
        toks += words(length - len(toks))
        out.append(" ".join(toks))
    return out


def one_run(vlm, image, cands, executor, track=False):
    t0 = time.perf_counter()
    res = vlm.score(image, "what is the colour", cands, executor=executor, track_memory=track)
    return time.perf_counter() - t0, res


def conditions(args) -> list[tuple]:
    """The (candidates, suffix length, shared fraction, branching) conditions scanned."""
    grid = list(itertools.product(CANDIDATES, LENGTHS, SHARING, BRANCHING))
    if args.grid == "small":
        grid = [g for g in grid if all(x in ok for x, ok in zip(g[:3], SMALL_GRID, strict=True))]
    if args.quick:  # two conditions: no sharing and 75% shared, 4 candidates of 8 tokens, flat
        grid = [g for g in grid if g[0] == 4 and g[1] == 8 and g[2] in (0.0, 0.75) and g[3] == "flat"]
    return grid


def timed_rounds(vlm, image, cands, rounds: int, reps: int, order_rng):
    """Per executor: seconds and branch seconds per call in each round (the executors in a shuffled order, call
    by call in turn, so a drift of the host over the round hits all alike), and its last result."""
    times = {e: [] for e in EXECUTORS}
    branch = {e: [] for e in EXECUTORS}
    results = {}
    for _ in range(rounds):
        order = list(EXECUTORS)
        order_rng.shuffle(order)
        spent = {e: [0.0, 0.0] for e in EXECUTORS}  # seconds, branch seconds over the round's calls
        for _ in range(reps):
            for e in order:
                dt, res = one_run(vlm, image, cands, e)
                spent[e][0] += dt
                spent[e][1] += res.costs.seconds.get("branch", 0.0)
                results[e] = res
        for e in EXECUTORS:
            times[e].append(spent[e][0] / reps)
            branch[e].append(spent[e][1] / reps)
    return times, branch, results


def executor_cells(vlm, image, cands, times, branch, results) -> dict:
    """Each executor's latency, memory, FLOPs and largest score difference from `independent`."""
    ref, cells = results["independent"], {}
    for e in EXECUTORS:
        err = max(
            abs(a - b)
            for ra, rb in zip(ref.results, results[e].results, strict=True)
            for a, b in zip(ra.logits, rb.logits, strict=True)
        )
        _, mem = one_run(vlm, image, cands, e, track=True)
        cells[e] = {
            "latency_s": statistics.median(times[e]),  # the median of the rounds
            "latency_rounds_s": times[e],
            "branch_s": statistics.median(branch[e]),
            "peak_branch_bytes": mem.costs.peak_memory_phase.get("branch", 0),
            "branch_flops": results[e].costs.flops.get("branch", 0),
            "max_score_error": err,
        }
    return cells


def scan_model(family: str, args) -> list[dict]:
    torch.manual_seed(0)
    _, heads, kv_heads = WIDTHS[args.width]
    folder = tiny_checkpoint(
        family, tempfile.mkdtemp(), hidden=args.hidden, layers=args.layers, heads=heads, kv_heads=kv_heads
    )
    vlm = VLM(load_adapter(folder))
    image = random_image(0, (128, 128))
    t0 = time.perf_counter()  # load time: `tree` measures its call cost once (executors/call_cost.py)
    one_run(vlm, image, candidates(4, 8, 0.75, "flat", seed=0), "tree")
    calibration = {
        "seconds": time.perf_counter() - t0,
        "call_cost_slots": _measured(vlm.adapter.model),
    }
    rows = []
    order_rng = random.Random(1)
    for k, (n, length, share, branching) in enumerate(conditions(args)):
        cands = candidates(n, length, share, branching, seed=k)
        warm, _ = one_run(vlm, image, cands, "batched")  # warm-up; it also sizes the calls per timing
        reps = max(1, math.ceil(args.min_time / warm))  # the same for every executor of this condition
        times, branch, results = timed_rounds(vlm, image, cands, args.rounds, reps, order_rng)
        ref, tree = results["independent"], results["tree"]
        row = {
            "model": family, "candidates": n, "suffix_tokens": length, "shared": share, "branching": branching,
            "logical_tokens": ref.tokens["logical"],
            "unique_tokens": tree.tokens["unique"],
            "tree_executed_tokens": tree.tokens["executed"],
            # no merge taken: `tree` ran batched's own code (executors/tree_schedule.py run_pieces)
            "tree_plain_layout": tree.tokens["executed"] == ref.tokens["logical"],
            "calls_per_timing": reps,
            # the median over rounds of tree / batched within each round (round-to-round drift cancels)
            "tree_over_batched_paired": statistics.median(
                t / b for t, b in zip(times["tree"], times["batched"], strict=True)
            ),
            "auto_chose": results["auto"].executor,
            "tree_call_cost_slots": list(calibration["call_cost_slots"].values()),
            "calibration_s": calibration["seconds"],
        }  # fmt: skip
        row.update(executor_cells(vlm, image, cands, times, branch, results))
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _measured(model) -> dict:
    """The tree executor's measured call costs (none before issue 20: this scan also runs older checkouts, for
    before/after tables with PYTHONPATH=<checkout>/src)."""
    try:
        from trimvlm.scoring.executors.call_cost import measured
    except ImportError:
        return {}
    return measured(model)


def _line(r) -> str:
    b, t, i = r["batched"], r["tree"], r["independent"]
    return (
        f"{r['model']:9s} N={r['candidates']:3d} T={r['suffix_tokens']:3d} share={r['shared']:.2f} "
        f"{r['branching']:9s} tokens {r['logical_tokens']:5d}->{r['unique_tokens']:5d}  "
        f"tree/batched {r['tree_over_batched_paired']:.2f}x  independent/tree "
        f"{i['latency_s'] / t['latency_s']:.2f}x  segments/batched {r['segments']['latency_s'] / b['latency_s']:.2f}x"
        f"  mem batched/indep {b['peak_branch_bytes'] / max(1, i['peak_branch_bytes']):.2f}  "
        f"err {max(r[e]['max_score_error'] for e in EXECUTORS):.1e}  auto={r['auto_chose']}"
    )


def summary(rows: list[dict]) -> dict:
    out = {}
    for model in sorted({r["model"] for r in rows}):
        rs = [r for r in rows if r["model"] == model]
        ratio = [r["tree"]["latency_s"] / r["batched"]["latency_s"] for r in rs]
        paired = [r["tree_over_batched_paired"] for r in rs]
        misses = [r for r, x in zip(rs, paired, strict=True) if x > 1.05]
        overlap = [r["logical_tokens"] / r["unique_tokens"] for r in rs]
        speedup = [1 / x for x in ratio]
        heavy = [r for r in rs if r["candidates"] == 64 and r["suffix_tokens"] == 128 and r["shared"] == 0.75]
        out[model] = {
            "conditions": len(rs),
            "tree_call_cost_slots": rs[0]["tree_call_cost_slots"],  # [] when not measured (older code)
            "first_tree_call_s (call-cost measurement included)": rs[0]["calibration_s"],
            "tree_over_batched_median": statistics.median(ratio),
            "tree_within_1.05x_batched (ratio of medians)": sum(x <= 1.05 for x in ratio),
            "tree_within_1.05x_batched (median of paired ratios)": len(rs) - len(misses),
            "misses_where_tree_ran_batched_code": sum(r["tree_plain_layout"] for r in misses),
            "tree_faster_than_batched": sum(x < 1.0 for x in ratio),
            "segments_faster_than_batched": sum(
                r["segments"]["latency_s"] < r["batched"]["latency_s"] for r in rs
            ),
            "batched_peak_below_independent": sum(
                r["batched"]["peak_branch_bytes"] < r["independent"]["peak_branch_bytes"] for r in rs
            ),
            "auto_within_1.05x_best": sum(
                r["auto"]["latency_s"] <= 1.05 * min(r["batched"]["latency_s"], r["tree"]["latency_s"])
                for r in rs
            ),
            "max_score_error": max(r[e]["max_score_error"] for r in rs for e in EXECUTORS),
            "corr_speedup_vs_token_ratio": _corr(speedup, overlap),
            "mean_speedup_over_token_ratio": statistics.mean(
                s / o for s, o in zip(speedup, overlap, strict=True)
            ),
            "heavy_64x128x75": [
                {
                    "branching": r["branching"],
                    "tokens": f"{r['logical_tokens']} -> {r['unique_tokens']}",
                    "independent_over_tree": r["independent"]["latency_s"] / r["tree"]["latency_s"],
                    "batched_over_tree": r["batched"]["latency_s"] / r["tree"]["latency_s"],
                    "tree_peak_over_batched": r["tree"]["peak_branch_bytes"]
                    / r["batched"]["peak_branch_bytes"],
                }
                for r in heavy
            ],
        }
    return out


def _corr(x, y) -> float:
    mx, my = statistics.mean(x), statistics.mean(y)
    sx = sum((a - mx) ** 2 for a in x) ** 0.5
    sy = sum((b - my) ** 2 for b in y) ** 0.5
    return sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / (sx * sy) if sx and sy else 0.0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="scan.json")
    p.add_argument("--models", default="qwen3_vl,qwen3_5")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; --full: 5)")
    p.add_argument("--min-time", type=float, default=0.1,
                   help="seconds per executor and round at least: a short condition's calls repeat (the executors "
                   "in turn, call by call), their mean is the round's")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--width",
        choices=list(WIDTHS),
        default="tiny",
        help="tiny: --hidden, 4 heads, 2 KV heads; 3b: hidden 2048, 16 heads, 2 KV heads",
    )
    p.add_argument(
        "--grid",
        choices=["full", "small"],
        default=None,
        help="full: the 96 conditions (--full); small: 16 of them (the default)",
    )
    p.add_argument("--full", action="store_true", help="the 96 conditions per model (about 20 minutes on one "
                   "thread; the default small grid takes about 4)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke test in seconds: 2 conditions per model "
        "(4 candidates x 8 tokens, 0 and 75%% shared, flat), hidden 64, 2 layers, 1 round",
    )
    args = p.parse_args(argv)
    if args.width != "tiny":
        args.hidden = WIDTHS[args.width][0]
    args.grid = args.grid or ("full" if args.full else "small")
    args.rounds = args.rounds or (5 if args.full else 3)
    if args.quick:
        args.layers, args.rounds, args.min_time = 2, 1, 0.0
        args.hidden = 64 if args.width == "tiny" else args.hidden
    torch.set_num_threads(args.threads)
    print(
        f"latencies: the median of {args.rounds} interleaved rounds per executor; hidden {args.hidden}, "
        f"{args.layers} layers, {args.threads} thread(s), {args.grid} grid",
        flush=True,
    )
    rows = []
    for family in args.models.split(","):
        rows += scan_model(family, args)
    timing = (
        f"latency_s, branch_s: the median of {args.rounds} interleaved rounds, each the mean of calls_per_timing "
        f"calls (>= {args.min_time:g} s); tree_over_batched_paired: the median of the rounds' tree / batched"
    )
    result = {"settings": vars(args), "timing": timing, "summary": summary(rows), "rows": rows}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
