"""Token-selection cost of every prefill reducer: time and peak memory of selection (+ merge) vs N.

Synthetic visual tokens (an h x w grid of smooth random features plus noise, d features) for
N in {576, 1024, 2304, 4096}, keep 20%, batch 1 and 8; each method runs its real `reduce` path (view, selection,
merge, gather) on a visual-only live sequence. FastV gets a random last-query attention row; the vision-scored
methods (prumerge, visionzip) a random vision-tower record (attention received and keys) per image. Reports the median time, the peak of tensor bytes allocated during the call (a
dispatch-level tracker: works on any device; the inputs are not counted), and per method the fitted exponent
of time and memory vs N (least squares on log-log). A memory exponent near 1 means no N x N matrix.

Density's farthest-point loop is compared with two references of the same rule, at batch 1 (each image of a
batch would run once more), at d = 1024 and 2048 (`--ref-dims`) for every N: `naive` builds the full N x N
distance matrix and, one Python step per pick, takes the min over the rows of every token picked so far (the
straightforward form, as DivPrune's reference code does), and `incremental` builds the full matrix and keeps a
running min (one row per pick). Identical picks are checked, and `ours` is set against its compute roofline:
K x N x d multiply-adds at the matmul rate measured for one [K, d] x [d, N] product, timed in the same
interleaved rounds. `numpy loop` is ours with the per-pick loop uncompiled (the fallback). Each round
gives paired ratios (ours against the product and the naive loop of the same round): the table shows their
median and spread (min-max) over >= 5 rounds. The targets: >= 5x the naive loop at N = 576, >= 10x at N >= 1024;
<= 2.5x the roofline at N = 1024, <= 2x at N >= 2304.

Default run (bounded, a few minutes on 2 idle cores): the references at both widths, the method table at d = 1024
and batch 1 and 4. `--full`: the method table at both widths and batch 1 and 8 too. `--width 3b`: d = 2048 only.
`select=topk` (density top-k, TwinPrune's ablation and decode rule) should scale linearly when it only selects
(`merge=false`); assigning every dropped token to its nearest kept token is O(N * K * d) in any method.

    python benchmarks/token_selection.py --json sel.json [--threads 2] [--width 3b] [--full] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import weakref

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trimvlm.kernels import farthest_point, jit, masked_minmax
from trimvlm.plan import Handoff, build_methods
from trimvlm.runtime.attention import AttentionProbe
from trimvlm.runtime.sequence import LiveSeq
from trimvlm.runtime.vision_probe import VisionProbe, VisionUnit
from trimvlm.testing import REAL_WIDTHS
from trimvlm.tokens.base import make_view
from trimvlm.tokens.density import view_density

METHODS = [
    "density",
    "density:merge=false",
    "density:select=topk",
    "density:select=topk:merge=false",
    "divprune",
    "fastv",
    "tome",
    "dart",
    "prumerge",
    "prumerge:plus=true",
    "visionzip",
    "random",
    "pool",
    "cdpruner",
    "holov",
]
TEXT = 32  # instruction tokens after the image, for the text-guided methods (cdpruner)
SIDES = {576: 24, 1024: 32, 2304: 48, 4096: 64}


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created inside the mode and still alive (views/inputs not counted)."""

    def __init__(self):
        super().__init__()
        self.cur = self.peak = 0
        self.live: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.cur -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if key and key not in self.live:
                    self.live[key] = st.nbytes()
                    self.cur += st.nbytes()
                    self.peak = max(self.peak, self.cur)
                    weakref.finalize(t, self._free, key)
        return out


class _Runner:
    """Stands in for the runner as a reducer sees it: 32 attention layers, and `layer_keys` as the adapters
    compute it (the layer's input RMS norm, then a k_proj to 8 KV heads x 64), with fixed random weights, so
    DART's key pivots pay the projection of every visual token as on a real model."""

    num_layers = 32
    KV_DIM = 512

    def __init__(self, d: int):
        g = torch.Generator().manual_seed(d)
        self.k_proj = torch.randn(d, self.KV_DIM, generator=g) / math.sqrt(d)

    def is_attention(self, i: int) -> bool:
        return True

    def layer_keys(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x @ self.k_proj


def features(batch: int, side: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    low = torch.randn(batch, d, max(2, side // 4), max(2, side // 4), generator=g)
    up = F.interpolate(low, size=(side, side), mode="bilinear", align_corners=False)
    x = up.permute(0, 2, 3, 1).reshape(batch, side * side, d)
    return (x + 0.3 * torch.randn(x.shape, generator=g)).contiguous()  # token-major, as hidden states are


def visual_seq(x: torch.Tensor, side: int, text: int = 0) -> LiveSeq:
    """The image's tokens, then `text` instruction tokens (random features)."""
    b, n, _ = x.shape
    if text:
        x = torch.cat([x, torch.randn(b, text, x.shape[-1], generator=torch.Generator().manual_seed(3))], 1)
    ar = torch.arange(n + text)
    visual = torch.zeros(b, n + text, dtype=torch.bool)
    visual[:, :n] = True
    return LiveSeq(
        hidden=x,
        positions=ar[None, None].expand(3, b, n + text).clone(),
        valid=torch.ones(b, n + text, dtype=torch.bool),
        visual=visual,
        source=ar[None].expand(b, n + text).clone(),
        image_id=torch.where(visual, 0, -1),
        grids=[[(side, side)] for _ in range(b)],
        image_start=[[0] for _ in range(b)],
        size=torch.ones(b, n + text, dtype=torch.long),
    )


def reducer_for(method: str, keep: float, seq: LiveSeq):
    """The reducer, and a call that runs its real `reduce` (re-arming the attention row the reducer consumes)."""
    attention = method.split(":")[0] == "fastv"
    vision = method.split(":")[0] in ("prumerge", "visionzip", "holov")
    layer = 1 if attention else 0
    red = build_methods(f"tokens={method}:keep={keep}:layer={layer}")["tokens"]
    att = None
    handoff = Handoff()
    if attention:
        handoff.probes["tokens"] = AttentionProbe(last=1, layers={0})
        logits = torch.randn(seq.batch, 1, seq.length, generator=torch.Generator().manual_seed(1))
        att = torch.softmax(logits * 3, dim=-1)

    units = {}
    if vision:  # what the vision probe would have recorded: attention received and keys, per image
        g = torch.Generator().manual_seed(2)
        for b in range(seq.batch):
            received = torch.softmax(torch.randn(seq.length, generator=g) * 3, dim=-1)
            units[(b, 0)] = VisionUnit(received=received, keys=torch.randn(seq.length, 64, generator=g))

    runner = _Runner(seq.hidden.shape[-1])

    def call():
        if att is not None:
            handoff.probes["tokens"].results[0] = att
        if vision:
            handoff.vision = VisionProbe(results=dict(units), heads=1)
        return red.reduce(seq, runner, handoff)

    return red, call


def interleaved_rounds(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of each call in each of `repeats` rounds that run every call once (after one warm-up each), so
    drift on a shared machine hits all of them alike."""
    for fn in fns.values():
        fn()
    ts: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            ts[name].append(time.perf_counter() - t0)
    return ts


def interleaved_medians(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each call over `interleaved_rounds`."""
    return {name: statistics.median(v) for name, v in interleaved_rounds(fns, repeats).items()}


def paired(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of the per-round ratios num / den."""
    r = [a / b for a, b in zip(num, den, strict=True)]
    return statistics.median(r), min(r), max(r)


def product(k: int, n: int, d: int):
    """The product farthest point needs in all, [K, d] x [d, N], as one call (the matmul rate at its best shape):
    timed in the same interleaved rounds as the loop it bounds, so both see the same machine."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(k, d, generator=g), torch.randn(n, d, generator=g)
    return lambda: a @ b.T


def ref_naive(x: torch.Tensor, k: int, tilt: torch.Tensor, first: int) -> list[int]:
    xn = F.normalize(x, dim=-1, eps=1e-12)
    dist = 1.0 - xn @ xn.T
    picks = [first]
    for _ in range(1, k):
        mind = dist[picks].min(0).values
        score = mind + tilt
        score[picks] = float("-inf")
        picks.append(int(score.argmax()))
    return picks


def ref_incremental(x: torch.Tensor, k: int, tilt: torch.Tensor, first: int) -> list[int]:
    xn = F.normalize(x, dim=-1, eps=1e-12)
    dist = 1.0 - xn @ xn.T
    picks = [first]
    mind = dist[first].clone()
    taken = torch.zeros(x.shape[0], dtype=torch.bool)
    taken[first] = True
    for _ in range(1, k):
        s = int((mind + tilt).masked_fill(taken, float("-inf")).argmax())
        picks.append(s)
        taken[s] = True
        mind = torch.minimum(mind, dist[s])
    return picks


def exponent(ns, ys) -> float:
    ok = [(n, y) for n, y in zip(ns, ys, strict=True) if y > 0]
    if len(ok) < 2:
        return float("nan")
    a, _ = np.polyfit(np.log([n for n, _ in ok]), np.log([y for _, y in ok]), 1)
    return float(a)


def fps_vs_reference(d: int, n: int, keep: float, rounds: int) -> dict:
    """Farthest point (compiled and its numpy loop) against the naive and incremental references and the
    roofline product, at batch 1, in interleaved rounds; per-round paired ratios."""
    side = SIDES.get(n) or int(math.isqrt(n))
    x = features(1, side, d, seed=n + d)
    view = make_view(visual_seq(x, side), keep, 0)
    rt = masked_minmax(view_density(view, 3), view.mask)
    tilt, first, k = rt[0], int(rt[0].argmax()), int(view.k[0])
    xn = F.normalize(x, dim=-1, eps=1e-12)

    def ours():
        return farthest_point(xn, view.mask, view.k, rt, rt.argmax(1))[0][0].tolist()

    def numpy_loop():
        with jit.disabled():
            return ours()

    ts = interleaved_rounds(
        dict(ours=ours, numpy_loop=numpy_loop, incremental=lambda: ref_incremental(x[0], k, tilt, first),
             naive=lambda: ref_naive(x[0], k, tilt, first), product=product(k, side * side, d)),
        rounds,
    )  # fmt: skip
    med = {name: statistics.median(v) for name, v in ts.items()}
    picks, p_loop = ours(), numpy_loop()
    p_inc, p_naive = (ref(x[0], k, tilt, first) for ref in (ref_incremental, ref_naive))
    same = sum(a == b for a, b in zip(picks, p_naive, strict=True))
    over, over_lo, over_hi = paired(ts["ours"], ts["product"])
    vs_naive, naive_lo, naive_hi = paired(ts["naive"], ts["ours"])
    return dict(
        d=d, n=side * side, k=k, ours_s=med["ours"], numpy_loop_s=med["numpy_loop"], naive_s=med["naive"],
        incremental_s=med["incremental"], roofline_s=med["product"],
        matmul_gflops=2 * k * side * side * d / med["product"] / 1e9,
        over_roofline=over, over_roofline_spread=[over_lo, over_hi],
        speedup_vs_naive=vs_naive, speedup_vs_naive_spread=[naive_lo, naive_hi],
        speedup_vs_incremental=paired(ts["incremental"], ts["ours"])[0],
        compiled_vs_numpy=paired(ts["numpy_loop"], ts["ours"])[0], rounds=rounds,
        identical_picks=picks == p_naive == p_inc == p_loop, first_divergence=same if picks != p_naive else None,
    )  # fmt: skip


def method_rows(args, console) -> list[dict]:
    """Every method's real reduce at each width, batch and N: median seconds of interleaved rounds, peak bytes."""
    rows = []
    for d in args.dims:
        for batch in args.batches:
            for n in args.ns:
                side = SIDES.get(n) or int(math.isqrt(n))
                x = features(batch, side, d, seed=n + d)
                seq, with_text = visual_seq(x, side), visual_seq(x, side, TEXT)
                calls = {}
                for method in args.methods:
                    guided = build_methods(f"tokens={method}:keep=0.5")["tokens"].wants_text
                    calls[method] = reducer_for(method, args.keep, with_text if guided else seq)[1]
                med = interleaved_medians(calls, args.repeats)  # every method once per round
                for method, call in calls.items():
                    t = med[method]
                    with LiveBytes() as mem:
                        call()
                    rows.append(
                        dict(method=method, d=d, batch=batch, n=side * side, seconds=t, peak_bytes=mem.peak,
                             feature_bytes=x.numel() * 4, nxn_bytes=batch * (side * side) ** 2 * 4)
                    )  # fmt: skip
                    console.log(
                        f"d={d} B={batch} N={side * side} {method}: {t * 1e3:.1f} ms, {mem.peak / 2**20:.1f} MiB"
                    )
    return rows


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="token_selection.json")
    ap.add_argument("--ns", type=int, nargs="+", default=list(SIDES))
    ap.add_argument("--dims", type=int, nargs="+", default=None, help="the method table's widths (default 1024; "
                    "--full: 1024 2048)")  # fmt: skip
    ap.add_argument("--ref-dims", type=int, nargs="+", default=[1024, 2048], help="farthest point vs references")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 4 (--full: 1 8)")
    ap.add_argument("--keep", type=float, default=0.2)
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the method table")
    ap.add_argument("--ref-rounds", type=int, default=5, help="rounds of the reference comparison (>= 5)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--full", action="store_true", help="the method table at both widths, batch 1 and 8")
    ap.add_argument("--width", choices=sorted(REAL_WIDTHS), default=None,
                    help="a real checkpoint's width: 3b = d 2048 (Qwen2.5-VL-3B's hidden size)")  # fmt: skip
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a smoke test in seconds: d=64, N 144 and 256, batch 1 and 2, 1 repeat",
    )
    args = ap.parse_args(argv)
    args.dims = args.dims or ([1024, 2048] if args.full else [1024])
    args.batches = args.batches or ([1, 8] if args.full else [1, 4])
    if args.width:
        args.dims = args.ref_dims = [REAL_WIDTHS[args.width]["hidden"]]
    if args.quick:
        args.dims, args.ref_dims, args.ns, args.batches, args.repeats = [64], [64], [144, 256], [1, 2], 1
        args.ref_rounds = 1
    return args


def main(argv=None):
    args = parse(argv)
    torch.set_num_threads(args.threads)
    console = Console(width=170)
    rows = method_rows(args, console)
    refs = []
    for d in [] if args.no_reference else args.ref_dims:
        for n in args.ns:
            refs.append(fps_vs_reference(d, n, args.keep, max(1 if args.quick else 5, args.ref_rounds)))
            r = refs[-1]
            console.log(
                f"FPS d={d} N={r['n']}: ours {r['ours_s']:.3f}s ({r['over_roofline']:.2f}x roofline), "
                f"{r['speedup_vs_naive']:.1f}x naive, numpy loop {r['numpy_loop_s']:.3f}s"
            )
    fits = []
    for d in args.dims:
        for batch in args.batches:
            for method in args.methods:
                sel = [r for r in rows if r["method"] == method and r["d"] == d and r["batch"] == batch]
                ns = [r["n"] for r in sel]
                fits.append(
                    dict(method=method, d=d, batch=batch, time_exponent=exponent(ns, [r["seconds"] for r in sel]),
                         memory_exponent=exponent(ns, [r["peak_bytes"] for r in sel]))
                )  # fmt: skip
    print_tables(args, console, rows, fits, refs)
    meta = dict(keep=args.keep, threads=args.threads, repeats=args.repeats, ref_rounds=args.ref_rounds,
                device="cpu", torch=torch.__version__, compiled=jit.compiled())  # fmt: skip
    with open(args.json, "w") as f:
        json.dump(dict(meta=meta, rows=rows, fits=fits, fps_vs_reference=refs), f, indent=1)
    console.print(f"wrote {args.json}")


def print_tables(args, console, rows, fits, refs) -> None:
    for d in args.dims:
        for batch in args.batches:
            table = Table(
                title=f"selection + merge, keep {args.keep:.0%}, d={d}, batch {batch}: ms (peak MiB)"
            )
            table.add_column("method", no_wrap=True)
            for n in args.ns:
                table.add_column(f"N={n}", justify="right")
            table.add_column("time exp", justify="right")
            table.add_column("mem exp", justify="right")
            for method in args.methods:
                cells = []
                for n in args.ns:
                    r = next(
                        r for r in rows if (r["method"], r["d"], r["batch"], r["n"]) == (method, d, batch, n)
                    )
                    cells.append(f"{r['seconds'] * 1e3:.1f} ({r['peak_bytes'] / 2**20:.1f})")
                f = next(f for f in fits if (f["method"], f["d"], f["batch"]) == (method, d, batch))
                table.add_row(method, *cells, f"{f['time_exponent']:.2f}", f"{f['memory_exponent']:.2f}")
            nxn = [f"{batch * n * n * 4 / 2**20:.0f}" for n in args.ns]
            table.add_row("(N x N fp32 matrix, MiB)", *nxn, "", "", style="dim")
            console.print(table)
    if not refs:
        return
    table = Table(
        title=f"density farthest-point loop vs references of the same rule (batch 1, keep {args.keep:.0%}, "
        f"{args.threads} thread(s)); ratios: median (min-max) of paired rounds"
    )
    for c in ("d", "N", "K", "ours s", "numpy loop s", "roofline s", "x roofline", "naive s", "x vs naive",
              "x vs incr.", "same picks"):  # fmt: skip
        table.add_column(c, justify="right")
    for r in refs:
        (olo, ohi), (nlo, nhi) = r["over_roofline_spread"], r["speedup_vs_naive_spread"]
        table.add_row(
            str(r["d"]), str(r["n"]), str(r["k"]), f"{r['ours_s']:.4f}", f"{r['numpy_loop_s']:.4f}",
            f"{r['roofline_s']:.4f}", f"{r['over_roofline']:.2f} [{olo:.2f}-{ohi:.2f}]", f"{r['naive_s']:.3f}",
            f"{r['speedup_vs_naive']:.1f} [{nlo:.1f}-{nhi:.1f}]", f"{r['speedup_vs_incremental']:.1f}",
            "yes" if r["identical_picks"] else f"first {r['first_divergence']}",
        )  # fmt: skip
    console.print(table)


if __name__ == "__main__":
    main()
