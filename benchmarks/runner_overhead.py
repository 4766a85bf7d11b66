"""Runner overhead: trimvlm's layer loop vs the model's own forward and generate, as time ratios.

Tiny Qwen3-VL (hidden 256, 8 layers, 256 visual tokens per image; `--hidden`, `--layers`) or any supported
checkpoint (`--model PATH`), batch 1 and 8 (`--batches`), median of interleaved runs in one process. Prints a table and
writes JSON. `--width 3b`: Qwen2.5-VL-3B's text width (hidden 2048, 16 heads, 2 KV heads), 4 layers, random weights.

    python benchmarks/runner_overhead.py --json out.json [--width 3b] [--quick]
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

from trimvlm.loading import load_adapter
from trimvlm.runtime.generate import generate
from trimvlm.runtime.runner import Runner
from trimvlm.testing import REAL_WIDTHS, random_image, tiny_checkpoint


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="runner_overhead.json")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="a supported checkpoint folder instead of the random model")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=None, help="default 8 (4 with --width)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--width", choices=sorted(REAL_WIDTHS), default=None,
                    help="a real checkpoint's width with random weights (3b: hidden 2048, 16 heads, 2 KV heads; "
                    "4 layers unless --layers says otherwise)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a smoke test in seconds: hidden 64, 2 layers, batch 1 "
                    "and 2, 4 new tokens, 1 repeat")  # fmt: skip
    args = ap.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.batches, args.new_tokens, args.repeats, args.width = 64, 2, [1, 2], 4, 1, None
    return args


def calls(adapter, runner, prep, new_tokens: int) -> dict:
    """The four timed calls on one batch: the runner's and the model's own forward and generate."""
    model, pad = adapter.model, adapter.tokenizer.pad_token_id
    inputs = dict(input_ids=prep.input_ids, attention_mask=prep.attention_mask, **prep.model_inputs)

    def ours_fwd():
        runner.prefill(prep, all_logits=True)

    def ref_fwd():
        with torch.no_grad():
            model(**inputs)

    def ours_gen():
        generate(runner, prep, max_new_tokens=new_tokens, stop_ids=[], pad_id=pad)

    def ref_gen():
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=pad)  # fmt: skip

    return {"ours_fwd": ours_fwd, "ref_fwd": ref_fwd, "ours_gen": ours_gen, "ref_gen": ref_gen}


def measure(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each call: one warm-up each, then `repeats` rounds, every other round in reverse order
    within each pair (forward, generate)."""
    for fn in fns.values():
        fn()
    t = {name: [] for name in fns}
    for r in range(repeats):
        order = list(fns.items())
        if r % 2:
            order = order[1::-1] + order[:1:-1]
        for name, fn in order:
            t[name].append(timed(fn))
    return {k: statistics.median(v) for k, v in t.items()}


def show(rows: list[dict]) -> None:
    table = Table(title="trimvlm runner vs the model's own forward / generate (median, interleaved)")
    for col in ("batch", "seq", "ours fwd ms", "model fwd ms", "fwd ratio", "ours gen ms", "model gen ms",
                "gen ratio"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["batch"]), str(r["seq_len"]), f"{r['ours_fwd_s'] * 1e3:.1f}", f"{r['ref_fwd_s'] * 1e3:.1f}",
                      f"{r['forward_ratio']:.3f}", f"{r['ours_gen_s'] * 1e3:.1f}", f"{r['ref_gen_s'] * 1e3:.1f}",
                      f"{r['generate_ratio']:.3f}")  # fmt: skip
    Console(width=160).print(table)


def main(argv=None):
    args = parse(argv)
    torch.set_num_threads(args.threads)
    shape = dict(heads=max(1, args.hidden // 32), kv_heads=max(1, args.hidden // 64), hidden=args.hidden)
    shape.update(REAL_WIDTHS.get(args.width, {}))
    layers = args.layers or (4 if args.width else 8)
    folder = args.model or tiny_checkpoint("qwen3_vl", tempfile.mkdtemp(), layers=layers, vision_hidden=64, **shape)
    adapter = load_adapter(folder)
    runner = Runner(adapter)
    rows = []
    for batch in args.batches:
        images = [[random_image(i, (256, 256))] for i in range(batch)]  # 256 px / 8 / 2 -> 16x16 = 256 tokens
        prep = adapter.prepare(images, ["what is the colour of the square"] * batch)
        med = measure(calls(adapter, runner, prep, args.new_tokens), args.repeats)
        rows.append({
            "batch": batch, "seq_len": prep.input_ids.shape[1], **{f"{k}_s": v for k, v in med.items()},
            "forward_ratio": med["ours_fwd"] / med["ref_fwd"], "generate_ratio": med["ours_gen"] / med["ref_gen"],
        })  # fmt: skip
    show(rows)
    out = {"benchmark": "runner_overhead", "threads": args.threads, "repeats": args.repeats,
           "torch": torch.__version__, "rows": rows}  # fmt: skip
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
