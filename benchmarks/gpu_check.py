"""GPU check (issue 10): trimvlm's invariants on a CUDA device, and the main benchmarks at a GPU-sized shape.

One run, under 8 minutes on one GPU, one JSON (`--json`, default gpu_check.json, rewritten after every part so
a cut-short run keeps what it measured):

1. equivalence, for every tiny family built from configs (trimvlm.testing), in fp32 and bf16, on a padded
   batch of 3 with images of different sizes:
   - empty recipe: the runner's prefill logits vs transformers' own forward on the real tokens. Tolerance
     fp32 max |d| <= 1e-3 (GPU kernels: the CPU suite holds 1e-4); bf16 max |d| <= 3e-2 * max(1, max |ref|)
     (bf16 keeps 8 bits of mantissa, and the two paths may pick different SDPA kernels);
   - greedy tokens vs `model.generate` (16 new tokens): fp32 every token equal; bf16 the first 4 steps equal
     (one ulp of bf16 can flip a near-tie argmax later on a random-weight model; the full match is reported);
   - candidate executors `batched`, `segments`, `tree`, `auto` vs `independent` (`vlm.score`, loglik readout,
     candidates that share long prefixes so `tree` runs the merged trie): fp32 <= 1e-3, bf16 <= 5e-2;
   - keep = 1.0 no-op for a token reducer and a KV policy (Qwen3-VL and Qwen3.5): logits, tokens and KV bytes
     exactly those of the empty recipe.
2. benchmarks on a tiny-architecture Qwen3-VL (hidden 1024, 4 layers, 16 heads / 8 KV heads, bf16 by default),
   512 x 512 images = 1024 visual tokens per sample, batch 4:
   - prefill: baseline vs `tokens=density:prune=0.8:layer=0` and `tokens=fastv:prune=0.8:layer=2`; interleaved
     rounds (the order rotates every round), medians; time of the whole call by CUDA events, LLM prefill
     (decoder layers, the reduction, LM head) and vision by the meter's synchronized phase timers; FLOP ratio,
     time ratios, efficiency = speedup / FLOP bound, `Costs.method_flops`, allocator peak per call;
   - decode: baseline vs `kv=density:keep=0.25` at 1024 and 4096 visual tokens per sample: KV bytes at the
     boundary (checked against the analytic count) and the most held in the call, the allocator's peak over
     the start of the call, decode time per step.
3. Without CUDA (`torch.cuda.is_available()` False) it says it needs a GPU and exits 0 (a no-op in CI), unless
   asked for another device: `--device cpu --quick` shrinks every shape so the whole script is smoke-tested on
   a CPU in a minute or two (the test suite's smoke test: `--device cpu --quick --families qwen3_vl --dtypes
   float32`, seconds).

    python benchmarks/gpu_check.py --json gpu_check.json
    python benchmarks/gpu_check.py --device cpu --quick --json /tmp/gpu_check.json

Exit status: 0 when every equivalence check passes (or without a GPU), 1 otherwise; benchmarks never fail.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from trimvlm.adapters.base import ATTENTION
from trimvlm.loading import load_adapter
from trimvlm.plan import make_plan
from trimvlm.runtime.generate import generate
from trimvlm.runtime.meter import Meter
from trimvlm.runtime.runner import Runner
from trimvlm.scoring.request import ScoreRequest
from trimvlm.testing import FAMILIES, WORDS, random_image, tiny_checkpoint
from trimvlm.vlm import VLM

sys.path.insert(0, str(Path(__file__).parent))
from decode_memory import images_for  # noqa: E402  (the benchmarks' helper: images of exactly N tokens)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FP32_TOL = 1e-3
BF16_REL_TOL = 3e-2
BF16_STEPS = 4
EXEC_TOL = {"float32": 1e-3, "bfloat16": 5e-2}
EXECUTORS = ["batched", "segments", "tree", "auto"]
NOOP_FAMILIES = ("qwen3_vl", "qwen3_5")
NOOP_RECIPES = ["tokens=density:keep=1.0:layer=1", "kv=density:keep=1.0"]
PREFILL_RECIPES = ["", "tokens=density:prune=0.8:layer=0", "tokens=fastv:prune=0.8:layer=2"]
DECODE_POLICY = "kv=density:keep=0.25"
PROMPTS = ["what is the colour", "how many red circle are there in the image", "describe"]


class Clock:
    """Wall time of a call: CUDA events on a GPU (the call's kernels included), perf_counter elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn):
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return out, start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0


class Report:
    """The JSON, rewritten after every part; a check that raises is recorded as failed with its error."""

    def __init__(self, path: str, meta: dict, budget_s: float):
        self.path, self.t0, self.budget_s = path, time.perf_counter(), budget_s
        self.data = {
            "meta": meta,
            "equivalence": [],
            "executors": [],
            "noop": [],
            "prefill": {},
            "decode": {},
        }
        self.failures: list[str] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over_budget(self) -> bool:
        return self.elapsed() > self.budget_s

    def check(self, section: str, name: str, fn) -> None:
        if self.over_budget():
            self.data[section].append({"name": name, "skipped": f"time budget ({self.budget_s:.0f} s) spent"})
            return
        t0 = time.perf_counter()
        try:
            row = fn()
        except Exception as e:  # a crash is a failed check, reported with its trace; the others still run
            row = {
                "passed": False,
                "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc()[-2000:],
            }
        row = {"name": name, **row, "seconds": round(time.perf_counter() - t0, 3)}
        if not row.get("passed", True):
            self.failures.append(name)
        self.data[section].append(row)
        status = "ok" if row.get("passed", True) else "FAILED"
        print(f"[{self.elapsed():6.1f}s] {section:11s} {name:48s} {status} {_brief(row)}", flush=True)
        self.write()

    def write(self) -> None:
        self.data["summary"] = {
            "passed": not self.failures,
            "failures": self.failures,
            "elapsed_s": round(self.elapsed(), 1),
        }
        Path(self.path).write_text(json.dumps(self.data, indent=1, default=str))


def _brief(row: dict) -> str:
    keys = ("max_abs_diff", "tol", "tokens_equal", "steps_equal", "speedup", "kv_ratio", "error")
    return " ".join(f"{k}={row[k]}" for k in keys if k in row)


def ragged(n: int = 3):
    """Three samples with different image sizes and prompt lengths (left padding in the batch)."""
    images = [[random_image(1, (64, 64))], [random_image(2, (96, 64))], [random_image(3, (64, 128))]]
    return images[:n], PROMPTS[:n]


# ------------------------------------------------------------------------------------------ equivalence
def prefill_equivalence(adapter, dtype_name: str) -> dict:
    images, prompts = ragged()
    prep = adapter.prepare(images, prompts)
    out = Runner(adapter).prefill(prep, all_logits=True)
    with torch.no_grad():
        inputs = dict(input_ids=prep.input_ids, attention_mask=prep.attention_mask, **prep.model_inputs)
        ref = adapter.model(**inputs).logits.float()
    valid = prep.attention_mask.bool()
    diff = float((out.logits - ref)[valid].abs().max())
    scale = float(ref[valid].abs().max())
    tol = FP32_TOL if dtype_name == "float32" else BF16_REL_TOL * max(1.0, scale)
    return {"max_abs_diff": diff, "max_abs_ref": scale, "tol": tol, "passed": diff <= tol}


def greedy_equivalence(adapter, dtype_name: str, new_tokens: int) -> dict:
    images, prompts = ragged()
    prep = adapter.prepare(images, prompts)
    tok = adapter.tokenizer
    ours = generate(
        Runner(adapter), prep, max_new_tokens=new_tokens, stop_ids=[tok.eos_token_id], pad_id=tok.pad_token_id
    ).tokens
    with torch.no_grad():
        ref = adapter.model.generate(
            input_ids=prep.input_ids, attention_mask=prep.attention_mask, **prep.model_inputs,
            max_new_tokens=new_tokens, do_sample=False, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )[:, prep.input_ids.shape[1] :]  # fmt: skip
    n = min(ours.shape[1], ref.shape[1])
    same = (ours[:, :n] == ref[:, :n]).all(0).tolist() + [False] * (max(ours.shape[1], ref.shape[1]) - n)
    steps = next((i for i, s in enumerate(same) if not s), len(same))  # leading steps equal in every sample
    full = ours.shape == ref.shape and bool(torch.equal(ours, ref))
    need = len(same) if dtype_name == "float32" else min(BF16_STEPS, len(same))
    return {"tokens_equal": full, "steps_equal": steps, "steps": len(same), "passed": steps >= need}


def shared_candidates(k: int) -> list[list[str]]:
    """Candidates sharing long prefixes (a trie with real sharing), different per request."""
    words = WORDS[20:]
    return [
        [f"red circle square {words[i % len(words)]}" for i in range(k)],
        [f"two three {words[(i + 7) % len(words)]} yes" for i in range(k)] + ["no"],
        ["yes", "yes no", "one two three"],
    ]


def executor_equivalence(vlm: VLM, dtype_name: str, k: int) -> dict:
    images, prompts = ragged()
    reqs = [ScoreRequest(images[i], prompts[i], c) for i, c in enumerate(shared_candidates(k))]
    base = vlm.score(reqs, readout="loglik", executor="independent")
    rows, worst = {}, 0.0
    for ex in EXECUTORS:
        got = vlm.score(reqs, readout="loglik", executor=ex)
        d = max(
            abs(x - y)
            for a, b in zip(got.results, base.results, strict=True)
            for x, y in zip(a.logits, b.logits, strict=True)
        )
        same_choice = [r.chosen for r in got.results] == [r.chosen for r in base.results]
        rows[ex] = {"max_abs_diff": d, "ran": got.executor, "tokens": got.tokens, "same_choice": same_choice}
        worst = max(worst, d)
    tol = EXEC_TOL[dtype_name]
    return {"max_abs_diff": worst, "tol": tol, "passed": worst <= tol, "executors": rows}


def noop_equivalence(adapter) -> dict:
    images, prompts = ragged()
    prep = adapter.prepare(images, prompts)
    runner = Runner(adapter)
    tok = adapter.tokenizer

    def run(recipe):
        return generate(
            runner, prep, make_plan(recipe, runner), max_new_tokens=6, stop_ids=[tok.eos_token_id],
            pad_id=tok.pad_token_id,
        )

    base = run("")
    rows, ok = {}, True
    for recipe in NOOP_RECIPES:
        got = run(recipe)
        d = float((got.first_logits - base.first_logits).abs().max())
        same = bool(torch.equal(got.tokens, base.tokens)) and got.costs.kv_bytes == base.costs.kv_bytes
        rows[recipe] = {"max_abs_diff": d, "tokens_and_kv_equal": same}
        ok = ok and d == 0.0 and same
    return {"passed": ok, "recipes": rows}


def run_equivalence(rep: Report, device: torch.device, dtypes: list[str], quick: bool, root: Path,
                    families=FAMILIES) -> None:
    new_tokens = 6 if quick else 16
    k = 6 if quick else 24
    for family in families:
        folder = tiny_checkpoint(family, root / family)
        for dtype_name in dtypes:
            tag = f"{family}/{dtype_name}"
            try:
                adapter = load_adapter(folder, dtype=DTYPES[dtype_name], device=str(device))
            except Exception as e:
                rep.check("equivalence", f"{tag} load", lambda e=e: {"passed": False, "error": repr(e)})
                continue
            rep.check(
                "equivalence",
                f"{tag} prefill logits",
                lambda a=adapter, d=dtype_name: prefill_equivalence(a, d),
            )
            rep.check(
                "equivalence",
                f"{tag} greedy tokens",
                lambda a=adapter, d=dtype_name: greedy_equivalence(a, d, new_tokens),
            )
            rep.check(
                "executors",
                f"{tag} vs independent",
                lambda a=adapter, d=dtype_name: executor_equivalence(VLM(a), d, k),
            )
            if family in NOOP_FAMILIES:
                rep.check("noop", f"{tag} keep=1.0", lambda a=adapter: noop_equivalence(a))
            del adapter
            if device.type == "cuda":
                torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ benchmarks
def bench_model(args, device: torch.device, root: Path):
    hidden = args.hidden
    folder = tiny_checkpoint(
        "qwen3_vl", root / "bench", hidden=hidden, layers=args.layers, heads=max(1, hidden // 64),
        kv_heads=max(1, hidden // 128), vision_hidden=32,
    )  # fmt: skip
    return load_adapter(folder, dtype=DTYPES[args.bench_dtype], device=str(device))


def prefill_once(runner: Runner, prep, plan, device: torch.device, clock: Clock):
    meter = Meter(device=device)  # synchronized phase timers on a GPU
    meter.start_memory()
    _, seconds = clock(lambda: runner.prefill(prep, plan, meter=meter))
    meter.stop_memory()
    return meter.costs, seconds


def run_prefill_bench(rep: Report, adapter, args, device: torch.device) -> None:
    clock = Clock(device)
    runner = Runner(adapter)
    images = [[random_image(i, (args.image, args.image))] for i in range(args.batch)]
    prep = adapter.prepare(images, ["what is the colour of the square in the image"] * args.batch)
    n_vis = int((prep.input_ids == adapter.image_token_id).sum()) // args.batch
    plans = {r: make_plan(r, runner) for r in PREFILL_RECIPES}
    rows = {r: {"total_s": [], "llm_s": [], "vision_s": []} for r in PREFILL_RECIPES}
    costs = {}
    for _ in range(args.warmup):
        for r in PREFILL_RECIPES:
            prefill_once(runner, prep, plans[r], device, clock)
    for rnd in range(args.repeats):
        shift = rnd % len(PREFILL_RECIPES)
        for r in PREFILL_RECIPES[shift:] + PREFILL_RECIPES[:shift]:  # interleaved, rotating order
            c, total = prefill_once(runner, prep, plans[r], device, clock)
            rows[r]["total_s"].append(total)
            rows[r]["llm_s"].append(c.seconds["prefill"])
            rows[r]["vision_s"].append(c.seconds["vision"])
            costs[r] = c
        if rep.over_budget():
            break
    base = costs[""]
    base_llm, base_total = statistics.median(rows[""]["llm_s"]), statistics.median(rows[""]["total_s"])
    out = []
    for r in PREFILL_RECIPES:
        c, llm, total = costs[r], statistics.median(rows[r]["llm_s"]), statistics.median(rows[r]["total_s"])
        bound = base.flops["prefill"] / c.flops["prefill"]
        out.append({
            "recipe": r or "baseline", "llm_prefill_ms": 1e3 * llm, "total_ms": 1e3 * total,
            "vision_ms": 1e3 * statistics.median(rows[r]["vision_s"]),
            "prefill_flops": c.flops["prefill"], "vision_flops": c.flops["vision"],
            "flop_ratio": c.flops["prefill"] / base.flops["prefill"],
            "llm_time_ratio": llm / base_llm, "total_time_ratio": total / base_total,
            "speedup": base_llm / llm, "bound": bound, "efficiency": (base_llm / llm) / bound,
            "method_flops": dict(c.method_flops),
            "method_flop_share": c.method_total_flops / max(1, c.total_flops),
            "peak_memory_bytes": c.peak_memory_bytes, "peak_memory_kind": c.peak_memory_kind,
            "llm_ms_all": [1e3 * x for x in rows[r]["llm_s"]],
        })  # fmt: skip
    rep.data["prefill"] = {
        "model": f"tiny qwen3_vl hidden {args.hidden}, {args.layers} layers, {args.bench_dtype}",
        "visual_tokens": n_vis, "batch": args.batch, "repeats": len(rows[""]["llm_s"]), "rows": out,
    }  # fmt: skip
    for x in out:
        print(
            f"[{rep.elapsed():6.1f}s] prefill     {x['recipe']:34s} LLM {x['llm_prefill_ms']:8.2f} ms  "
            f"FLOP ratio {x['flop_ratio']:.3f}  time ratio {x['llm_time_ratio']:.3f}  "
            f"speedup {x['speedup']:.2f}x "
            f"(bound {x['bound']:.2f}x, efficiency {x['efficiency']:.0%})",
            flush=True,
        )
    rep.write()


def decode_once(runner: Runner, prep, plan, steps: int, device: torch.device):
    return generate(
        runner, prep, plan, max_new_tokens=steps, stop_ids=[], pad_id=0, meter=Meter(device=device)
    ).costs


def run_decode_bench(rep: Report, adapter, args, device: torch.device) -> None:
    runner = Runner(adapter)
    plans = {"baseline": make_plan("", runner), DECODE_POLICY: make_plan(DECODE_POLICY, runner)}
    keep = float(DECODE_POLICY.split("keep=")[1])
    results = []
    for n_vis in args.contexts:
        prep = adapter.prepare([images_for(n_vis)] * args.batch, ["describe the image"] * args.batch)
        got_vis = int((prep.input_ids == adapter.image_token_id).sum()) // args.batch
        n_text = int(prep.attention_mask[0].sum()) - got_vis
        for name in plans:  # warm-up
            decode_once(runner, prep, plans[name], 2, device)
        runs = {name: [] for name in plans}
        for _ in range(args.decode_repeats):
            for name in plans:
                runs[name].append(decode_once(runner, prep, plans[name], args.steps, device))
        row = {"visual_tokens": got_vis, "text_tokens": n_text, "batch": args.batch, "steps": args.steps}
        for name, cs in runs.items():
            c = cs[-1]
            row[name] = {
                # kv_bytes_peak: the most KV held in the call (the full cache before an eviction included)
                "kv_bytes": c.kv_bytes, "kv_bytes_peak": c.kv_bytes_peak,
                "peak_memory_bytes": c.peak_memory_bytes, "peak_memory_kind": c.peak_memory_kind,
                "decode_ms_per_step": 1e3 * statistics.median(x.seconds["decode"] for x in cs) / args.steps,
                "prefill_ms": 1e3 * statistics.median(x.seconds["prefill"] for x in cs),
                "method_flops": dict(c.method_flops), "decode_flops": c.decode_flops,
            }  # fmt: skip
        cfg = adapter.text_config
        hk, hd = (
            cfg.num_key_value_heads,
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        )
        attn_layers = sum(t == ATTENTION for t in adapter.layer_types)
        per_entry = attn_layers * 2 * hk * hd * torch.finfo(adapter.model.dtype).bits // 8
        analytic = args.batch * per_entry * (n_text + math.ceil(got_vis * keep - 1e-9))
        base, ev = row["baseline"], row[DECODE_POLICY]
        row.update({
            "kv_ratio": ev["kv_bytes"] / base["kv_bytes"], "kv_bytes_analytic": analytic,
            "kv_matches_analytic": ev["kv_bytes"] == analytic,
            "peak_ratio": ev["peak_memory_bytes"] / max(1, base["peak_memory_bytes"]),
            "step_speedup": base["decode_ms_per_step"] / max(1e-9, ev["decode_ms_per_step"]),
        })  # fmt: skip
        results.append(row)
        print(
            f"[{rep.elapsed():6.1f}s] decode      {got_vis:5d} visual x {args.batch}: "
            f"KV {base['kv_bytes'] / 2**20:.2f} -> {ev['kv_bytes'] / 2**20:.2f} MiB "
            f"(ratio {row['kv_ratio']:.3f}, analytic {row['kv_matches_analytic']}), "
            f"peak {base['peak_memory_bytes'] / 2**20:.1f} -> {ev['peak_memory_bytes'] / 2**20:.1f} MiB, "
            f"step {base['decode_ms_per_step']:.2f} -> {ev['decode_ms_per_step']:.2f} ms",
            flush=True,
        )
        rep.data["decode"] = {"policy": DECODE_POLICY, "dtype": args.bench_dtype, "rows": results}
        rep.write()
        if rep.over_budget():
            break


# ------------------------------------------------------------------------------------------------ main
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="gpu_check.json")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a smoke test")
    ap.add_argument("--quick", action="store_true", help="tiny shapes everywhere: a smoke test of the script")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="equivalence dtypes, comma-separated")
    ap.add_argument(
        "--bench-dtype", default=None, choices=list(DTYPES), help="default bfloat16 (cuda), float32 (cpu)"
    )
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--families", default=",".join(FAMILIES), help="equivalence families, comma-separated")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: 2 at most on a CPU)")
    ap.add_argument(
        "--budget", type=float, default=420.0, help="seconds after which remaining parts are skipped"
    )
    args = ap.parse_args(argv)
    q = args.quick
    args.hidden, args.layers = (64, 4) if q else (1024, 4)
    # 512 px / patch 8 / merge 2 -> 32 x 32 = 1024 visual tokens per sample
    args.image, args.batch = (128, 2) if q else (512, 4)
    args.warmup, args.repeats = (1, 2) if q else (3, 10)
    args.contexts = [64] if q else [1024, 4096]
    args.steps, args.decode_repeats = (3, 1) if q else (32, 3)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: needs a CUDA GPU (torch.cuda.is_available() is False); nothing to do.")
        print("           smoke-test the script on a CPU with: --device cpu --quick")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    elif device.type == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    args.bench_dtype = args.bench_dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    import transformers

    meta = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "quick": args.quick,
        "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32},
        "dtypes": dtypes, "bench_dtype": args.bench_dtype, "tolerances": {
            "prefill_fp32_abs": FP32_TOL, "prefill_bf16_rel": BF16_REL_TOL, "greedy_bf16_steps": BF16_STEPS,
            "executors": EXEC_TOL, "noop": 0.0,
        },
    }  # fmt: skip
    rep = Report(args.json, meta, args.budget)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run_equivalence(rep, device, dtypes, args.quick, root, args.families.split(","))
        if not args.skip_bench and not rep.over_budget():
            adapter = None
            for part, run in (("prefill", run_prefill_bench), ("decode", run_decode_bench)):
                if rep.over_budget():
                    rep.data[part] = {"skipped": f"time budget ({rep.budget_s:.0f} s) spent"}
                    continue
                try:
                    adapter = adapter or bench_model(args, device, root)
                    run(rep, adapter, args, device)
                except Exception as e:  # a benchmark never fails the check; its error is reported
                    rep.data[part] = {**rep.data[part], "error": f"{type(e).__name__}: {e}"}
                    rep.data[part]["trace"] = traceback.format_exc()[-2000:]
                    print(f"[{rep.elapsed():6.1f}s] {part:11s} ERROR {type(e).__name__}: {e}", flush=True)
    rep.write()
    status = "all equivalence checks passed" if not rep.failures else f"FAILED: {', '.join(rep.failures)}"
    print(f"gpu_check: {status}; {rep.elapsed():.0f} s; wrote {args.json}")
    return 0 if not rep.failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
