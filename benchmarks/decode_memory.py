"""Decode memory and speed vs context: KV bytes held after prefill and per-step decode time, for a context of
256 .. 8192 visual tokens, baseline (no eviction) vs a KV policy keeping 25% of the visual entries.

Tiny random Qwen3-VL (trimvlm.testing.tiny_checkpoint; hidden 256, 4 layers, 8 heads / 4 KV heads by default),
batch 1, a 512 x 512 image is 1024 visual tokens (patch 8, 2 x 2 merge), so 8192 tokens are 8 such images.
Each context is prefilled once; the cache is copied, one copy evicted; then the same greedy tokens are decoded
on both copies, interleaved, and the median step time is reported. KV bytes are measured (the cache tensors)
and checked against the analytic count  layers * 2 * Hk * hd * 4 bytes * (text + ceil(N_visual * keep)).

    python benchmarks/decode_memory.py --json mem.json [--quick]
    python benchmarks/decode_memory.py --contexts 256,1024,4096 --steps 8 --policy h2o --json mem.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import tempfile
import time

import torch
from rich.console import Console
from rich.table import Table

from trimvlm.loading import load_adapter
from trimvlm.plan import Handoff, Plan
from trimvlm.registry import build_method
from trimvlm.runtime.runner import Runner
from trimvlm.testing import random_image, tiny_checkpoint


def images_for(n_visual: int) -> list:
    """Images giving exactly n_visual tokens: 512 x 512 (32 x 32 = 1024 tokens) images plus one smaller one."""
    full, rest = divmod(n_visual, 1024)
    ims = [random_image(k, (512, 512)) for k in range(full)]
    if rest:
        shapes = [(rest // w, w) for w in range(32, 1, -1) if rest % w == 0 and 2 <= rest // w <= 32]
        if not shapes:
            raise SystemExit(
                f"context {n_visual}: {rest} tokens do not make an h x w grid with 2 <= h, w <= 32"
            )
        h, w = min(shapes, key=lambda hw: abs(hw[0] - hw[1]))
        ims.append(random_image(99, (16 * w, 16 * h)))
    return ims


def _sync(runner) -> None:
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def step_times(runner, out, caches, steps: int) -> list[list[float]]:
    times = [[] for _ in caches]
    pos = out.next_pos.clone()
    tok = out.logits.argmax(-1)
    for _ in range(steps):
        positions = runner.adapter.text_positions(pos, 1)
        logits = None
        for c, cache in enumerate(caches):
            _sync(runner)
            t0 = time.perf_counter()
            lg = runner.step(tok[:, None], positions, cache)
            _sync(runner)
            times[c].append(time.perf_counter() - t0)
            logits = lg if logits is None else logits
        tok = logits.argmax(-1)
        pos += 1
    return times


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="decode_memory.json")
    ap.add_argument(
        "--contexts", default="256,512,1024,2048,4096,8192", help="visual tokens, comma-separated"
    )
    ap.add_argument("--policy", default="density", help="kv policy name (density, h2o, snapkv, ...)")
    ap.add_argument("--keep", type=float, default=0.25)
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per context")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--model", default=None, help="a supported checkpoint folder instead of the random model "
                    "(the context sizes then are what its processor makes of the same images)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a smoke test in seconds: contexts 256 and 1024, "
                    "hidden 64, 2 layers, 3 steps")  # fmt: skip
    args = ap.parse_args(argv)
    if args.quick:
        args.contexts, args.hidden, args.layers, args.steps = "256,1024", 64, 2, 3
    return args


def measure_context(args, adapter, runner, policy, n_vis: int) -> dict:
    """One context: prefill, evict, the KV bytes against the analytic count, and the decode step times of the
    baseline and the evicted cache in turn."""
    prep = adapter.prepare([images_for(n_vis)], ["describe the image"])
    handoff = Handoff()
    probe = policy.probe(runner, handoff)
    t0 = time.perf_counter()
    out = runner.prefill(prep, Plan(probe=probe))
    t_prefill = time.perf_counter() - t0
    e0 = out.cache.layers[0]
    got_vis = int((e0.visual & e0.valid).sum())
    if got_vis != n_vis and not args.model:
        raise SystemExit(f"asked for {n_vis} visual tokens, the model made {got_vis}")
    n_vis = got_vis
    n_text = int((~e0.visual & e0.valid).sum())
    base = copy.deepcopy(out.cache)
    bytes_base = base.attention_bytes()
    t0 = time.perf_counter()
    policy.bind(runner, handoff)(out)
    t_evict = time.perf_counter() - t0
    bytes_kv = out.cache.attention_bytes()
    _, hk, _, hd = e0.key.shape
    per_entry = len(out.cache.layers) * 2 * hk * hd * e0.key.element_size()
    analytic = per_entry * (n_text + math.ceil(n_vis * args.keep - 1e-9))
    assert bytes_base == per_entry * (n_text + n_vis)
    assert bytes_kv == analytic, (bytes_kv, analytic)
    step_times(runner, out, [base, copy.deepcopy(out.cache)], 2)  # warm-up on throwaway copies
    tb, te = step_times(runner, out, [base, out.cache], args.steps)
    mb, me = statistics.median(tb), statistics.median(te)
    return {
        "visual_tokens": n_vis, "text_tokens": n_text, "kv_bytes_baseline": bytes_base, "kv_bytes_evicted": bytes_kv,
        "kv_bytes_analytic": analytic, "kv_ratio": bytes_kv / bytes_base, "step_ms_baseline": 1e3 * mb,
        "step_ms_evicted": 1e3 * me, "step_speedup": mb / me, "prefill_s": t_prefill, "evict_ms": 1e3 * t_evict,
    }  # fmt: skip


def show(args, rows: list[dict]) -> None:
    table = Table(title=f"decode memory and step time: baseline vs kv={args.policy}:keep={args.keep}")
    for col in ("visual", "text", "KV base MiB", "KV evicted MiB", "ratio", "step ms base", "step ms evicted",
                "speedup", "evict ms"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["visual_tokens"]), str(r["text_tokens"]), f"{r['kv_bytes_baseline'] / 2**20:.2f}",
            f"{r['kv_bytes_evicted'] / 2**20:.2f}", f"{r['kv_ratio']:.3f}", f"{r['step_ms_baseline']:.2f}",
            f"{r['step_ms_evicted']:.2f}", f"{r['step_speedup']:.2f}x", f"{r['evict_ms']:.1f}",
        )  # fmt: skip
    Console(width=160).print(table)


def main(argv=None):
    args = parse(argv)
    torch.set_num_threads(args.threads)
    folder = args.model or tiny_checkpoint("qwen3_vl", tempfile.mkdtemp(), hidden=args.hidden, layers=args.layers,
                                           heads=8, kv_heads=4, vision_hidden=32)  # fmt: skip
    adapter = load_adapter(folder)
    runner = Runner(adapter)
    policy = build_method("kv", args.policy, {"keep": args.keep})
    rows = [measure_context(args, adapter, runner, policy, int(n)) for n in args.contexts.split(",")]
    show(args, rows)
    meta = {"model": "tiny qwen3_vl", "hidden": args.hidden, "layers": args.layers, "heads": 8, "kv_heads": 4,
            "policy": args.policy, "keep": args.keep, "steps": args.steps, "threads": args.threads,
            "torch": torch.__version__}  # fmt: skip
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
