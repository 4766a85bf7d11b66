"""Qwen3.5 candidate scoring with short suffixes: Gated DeltaNet branches in the recurrent form at their own
length against transformers' chunked kernel (every call padded to 64-token chunks), in one process (issue 20).

A random-weight Qwen3.5 (`--hidden`, `--layers`, `--heads`: three Gated DeltaNet layers per full-attention
layer; `--width 3b`: hidden 2048, 16 heads, 2 KV heads) scores `--candidates` candidates of `--suffix` tokens each (content words plus the close marker) after
one image prompt, with the `batched` and `tree` executors. Two paths of the same model and requests:
- `chunked`: the adapter's `recurrent_max_len` = 0, every segment through transformers' chunked kernel: the
  path of commit 69b53e3 (before issue 20);
- `recurrent`: the adapter's default, segments of <= `recurrent_max_len` tokens in the step form.
Per path and executor: branch (candidate-phase) seconds, the median of `--rounds` interleaved rounds (the
order alternates every round), the branch phase's peak tensor memory (a separate run with the tensor tracker),
and the largest score difference to the chunked path. Plus, per path, greedy decoding of `--decode` tokens at
batch 4 (the decode phase's median seconds; the tokens must be equal). Ratios are within one process.

Run against an older checkout (PYTHONPATH=/tmp/before-gdn/src) it measures what that checkout has (an adapter
without `recurrent_max_len` only has the chunked path).

    python benchmarks/recurrent_branch.py [--candidates 64] [--suffix 8] [--rounds 5] [--threads 1] [--width 3b] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch

from trimvlm.loading import load_adapter
from trimvlm.runtime.generate import generate
from trimvlm.testing import REAL_WIDTHS, WORDS, random_image, tiny_checkpoint
from trimvlm.vlm import VLM

EXECUTORS = ["batched", "tree"]
CONTENT = WORDS[20:]  # colour / shape / number words: no special tokens
PROMPT = "what is the colour"


def candidates(n: int, suffix: int) -> list[str]:
    """n distinct candidates of suffix - 1 content words (the layout adds the close marker)."""
    k = len(CONTENT)
    return [" ".join(CONTENT[(i * 7 + j * (i % 5 + 1)) % k] for j in range(suffix - 1)) for i in range(n)]


def paths(adapter) -> list[str]:
    return ["chunked", "recurrent"] if hasattr(adapter, "recurrent_max_len") else ["chunked"]


def use(adapter, path: str, default: int | None) -> None:
    if default is not None:
        adapter.recurrent_max_len = 0 if path == "chunked" else default


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--candidates", type=int, default=64)
    p.add_argument("--suffix", type=int, default=8, help="tokens per candidate, the close marker included")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", choices=sorted(REAL_WIDTHS), default=None,
                   help="a real checkpoint's width with random weights (3b: hidden 2048, 16 heads, 2 KV heads)")
    p.add_argument("--decode", type=int, default=16, help="greedy tokens per row of the decode measurement")
    p.add_argument("--max-len", type=int, default=None, help="the recurrent path's recurrent_max_len (default: "
                   "the adapter's; a larger one measures where the step form stops paying)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default="recurrent_branch.json")
    p.add_argument("--quick", action="store_true", help="a smoke test in seconds: 8 candidates, hidden 64, "
                   "1 round, 4 decode tokens")  # fmt: skip
    args = p.parse_args(argv)
    if args.quick:
        args.candidates, args.hidden, args.rounds, args.decode, args.width = 8, 64, 1, 4, None
    return args


def setup(args):
    """The random Qwen3.5 model, its recurrent_max_len (from --max-len) and the two timed calls: scoring the
    candidates on one image, and greedy decoding of 4 ragged rows, each on a chosen path."""
    torch.manual_seed(0)
    shape = dict(hidden=args.hidden, heads=args.heads)
    shape.update(REAL_WIDTHS.get(args.width, {}))
    folder = tiny_checkpoint("qwen3_5", tempfile.mkdtemp(), layers=args.layers, **shape)
    vlm = VLM(load_adapter(folder))
    ad = vlm.adapter
    default = getattr(ad, "recurrent_max_len", None)
    if default is not None and args.max_len is not None:
        default = args.max_len
    image = random_image(0, (128, 128))
    cands = candidates(args.candidates, args.suffix)
    prep = ad.prepare([[random_image(s, (64 + 32 * s, 64))] for s in range(4)], [PROMPT] * 4)

    def score(path, executor, track=False):
        use(ad, path, default)
        return vlm.score(image, PROMPT, cands, executor=executor, track_memory=track)

    def decode(path):
        use(ad, path, default)
        return generate(vlm.runner, prep, max_new_tokens=args.decode, stop_ids=[], pad_id=ad.tokenizer.pad_token_id)

    return ad, default, score, decode


def rounds(n: int, names: list[str], score, decode):
    """One warm-up, then `n` rounds over the paths (every other round in reverse): each path's branch and decode
    seconds per round, its last scoring result and its decoded tokens."""
    for path in names:  # warm-up
        for ex in EXECUTORS:
            score(path, ex)
        decode(path)
    branch = {(pa, ex): [] for pa in names for ex in EXECUTORS}
    steps = {pa: [] for pa in names}
    last, tokens = {}, {}
    for r in range(n):
        for path in names if r % 2 == 0 else names[::-1]:
            for ex in EXECUTORS:
                res = score(path, ex)
                branch[(path, ex)].append(res.costs.seconds["branch"])
                last[(path, ex)] = res
            out = decode(path)
            steps[path].append(out.costs.seconds["decode"])
            tokens[path] = out.tokens
    return branch, steps, last, tokens


def score_rows(args, names, score, branch, last) -> list[dict]:
    ref = last[("chunked", "batched")]
    rows = []
    for path in names:
        for ex in EXECUTORS:
            res = last[(path, ex)]
            err = max(abs(a - b) for ra, rb in zip(ref.results, res.results, strict=True)
                      for a, b in zip(ra.logits, rb.logits, strict=True))  # fmt: skip
            rows.append({
                "path": path, "executor": ex, "candidates": args.candidates,
                "suffix_tokens": res.results[0].candidates[0].n_tokens,
                "branch_s": statistics.median(branch[(path, ex)]), "branch_rounds_s": branch[(path, ex)],
                "peak_branch_bytes": score(path, ex, track=True).costs.peak_memory_phase["branch"],
                "max_score_diff_vs_chunked": err,
            })  # fmt: skip
    return rows


def chunked_over_recurrent(names, rows, decode_rows) -> dict:
    ratios = {}
    if "recurrent" in names:
        by = {(r["path"], r["executor"]): r for r in rows}
        for ex in EXECUTORS:
            c, s = by[("chunked", ex)], by[("recurrent", ex)]
            ratios[ex] = {"branch_time": c["branch_s"] / s["branch_s"],
                          "peak_memory": c["peak_branch_bytes"] / s["peak_branch_bytes"]}  # fmt: skip
        ratios["decode_time"] = decode_rows[0]["decode_s"] / decode_rows[1]["decode_s"]
    return ratios


def main(argv=None) -> None:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    ad, default, score, decode = setup(args)
    names = paths(ad)
    branch, steps, last, tokens = rounds(args.rounds, names, score, decode)
    rows = score_rows(args, names, score, branch, last)
    decode_rows = [
        {"path": pa, "decode_s": statistics.median(steps[pa]), "decode_rounds_s": steps[pa],
         "same_tokens_as_chunked": bool(torch.equal(tokens[pa], tokens["chunked"]))}
        for pa in names
    ]  # fmt: skip
    if default is not None:
        ad.recurrent_max_len = type(ad).recurrent_max_len
    ratios = chunked_over_recurrent(names, rows, decode_rows)
    for r in rows:
        print(f"{r['path']:9s} {r['executor']:7s} N={r['candidates']} T={r['suffix_tokens']}  branch "
              f"{r['branch_s'] * 1e3:8.2f} ms  peak {r['peak_branch_bytes'] / 2**20:8.2f} MiB  "
              f"diff {r['max_score_diff_vs_chunked']:.1e}")  # fmt: skip
    for r in decode_rows:
        print(f"{r['path']:9s} decode {args.decode} tokens x 4 rows  {r['decode_s'] * 1e3:8.2f} ms  "
              f"same tokens {r['same_tokens_as_chunked']}")  # fmt: skip
    print("chunked / recurrent:", json.dumps(ratios))
    result = {"settings": vars(args), "recurrent_max_len": default, "rows": rows, "decode": decode_rows,
              "chunked_over_recurrent": ratios,
              "timing": f"branch_s, decode_s: the median of {args.rounds} interleaved rounds"}  # fmt: skip
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
