"""`n` choices off one prefill against n separate requests, on one `trimvlm serve` (a subprocess on loopback,
its caches off, so a repeated prompt is prefilled again as a new one would be).

`--clients` closed-loop clients each ask, again and again, for `--n` sampled answers (temperature 1) to one
question about one image (`--task`, default the checkpoint's own: the demo task's scenes asked "describe ?",
demo-scenes' images asked to read their text): either as one request with `n` (the choices branch off one
prefill, the prompt's KV shared), or as `n` separate requests sent at once (seeds s .. s + n - 1: the same
draws). The two ways alternate in `--rounds` slices of `--seconds`. Reported per way: choices per second,
completion tokens per second, p50 / p99 latency of a unit (the n answers), the prefill and vision FLOPs per
choice (the servers' `usage`), failed requests; and the ratios: throughput n / separate, prefill FLOPs n /
separate.

The clients run in this process on the same machine as the server: on a small machine they take CPU from it.
Times are of this machine; the ratios are the result.

    python benchmarks/serve_choices.py --model demo --n 8 --clients 4 --seconds 10 --json choices.json [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

console = Console(width=160)


def _serve_load():
    """benchmarks/serve_load.py (its server launcher and demo images)."""
    spec = importlib.util.spec_from_file_location("serve_load", Path(__file__).with_name("serve_load.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def prompts(sl, task: str, n: int) -> list[tuple[str, str]]:
    """n (base64 PNG image, question) pairs: the demo task's scenes asked "describe ?" (the longest answers), or
    another generated task's test questions with full answers (demo-scenes: reading its text)."""
    if task == "demo":
        return [(im, "describe ?") for im in sl.images(n, 128)]
    from trimvlm.evals.tasks import get_task

    return [(sl.png_b64(r.images[0]), r.prompt_text()) for r in get_task(task).records if r.probe == "full"][:n]


async def unit(c, way: str, n: int, prompt: tuple[str, str], seed: int, max_tokens: int) -> dict:
    """One unit of work: n answers, as one request with n or as n requests at once."""
    image, question = prompt
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}},
               {"type": "text", "text": question}]  # fmt: skip
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 1.0}
    t0 = time.perf_counter()
    if way == "n":
        rs = [await c.post("/v1/chat/completions", json=body | {"n": n, "seed": seed})]
    else:
        rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=body | {"seed": seed + i}) for i in range(n)))
    seconds = time.perf_counter() - t0
    ok = [r.json() for r in rs if r.status_code == 200]
    return {
        "seconds": seconds, "failed": len(rs) - len(ok), "choices": sum(len(o["choices"]) for o in ok),
        "tokens": sum(o["usage"]["completion_tokens"] for o in ok),
        "prefill_flops": sum(o["usage"]["prefill_flops"] + o["usage"]["vision_flops"] for o in ok),
    }  # fmt: skip


async def slice_(url: str, way: str, args, pool: list[tuple[str, str]], seconds: float) -> list[dict]:
    import httpx

    done, stop = [], time.perf_counter() + seconds

    async def client(k: int):
        async with httpx.AsyncClient(base_url=url, timeout=600) as c:
            i = 0
            while time.perf_counter() < stop:
                done.append(await unit(c, way, args.n, pool[(k + i) % len(pool)], 1000 * k + i, args.max_new_tokens))
                i += 1

    await asyncio.gather(*(client(k) for k in range(args.clients)))
    return done


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return 1e3 * xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def summarize(way: str, units: list[dict], seconds: float) -> dict:
    choices = sum(u["choices"] for u in units)
    return {
        "way": way, "units": len(units), "choices": choices, "failed": sum(u["failed"] for u in units),
        "choices_per_s": choices / seconds, "tokens_per_s": sum(u["tokens"] for u in units) / seconds,
        "p50_ms": pct([u["seconds"] for u in units], 0.5), "p99_ms": pct([u["seconds"] for u in units], 0.99),
        "prefill_flops_per_choice": sum(u["prefill_flops"] for u in units) / max(choices, 1),
    }  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--task", default=None, help="the questions (default: the checkpoint's own task)")
    ap.add_argument("--n", type=int, default=8, help="answers per unit")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=10.0, help="measured seconds per slice")
    ap.add_argument("--rounds", type=int, default=2, help="alternating slices per way")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="a smoke test: n 3, 1 client, 0.5 s slices, 1 round")
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.clients, args.seconds, args.rounds, args.max_new_tokens, args.images = 3, 1, 0.5, 1, 6, 2
    sl = _serve_load()
    args.max_wait_ms = 10.0
    from trimvlm.loading import checkpoint_task

    args.task = args.task or checkpoint_task(args.model)
    pool = prompts(sl, args.task, args.images)
    server = sl.Server(args, 64, ("--prefix-cache-mb", "0", "--vision-cache-mb", "0", "--request-cache-mb", "0"))
    try:
        units, spent = {"n": [], "separate": []}, {"n": 0.0, "separate": 0.0}
        for way in ("n", "separate"):  # warm-up: every shape once
            asyncio.run(slice_(server.url, way, args, pool, 0.01))
        for _ in range(args.rounds):
            for way in ("n", "separate"):
                t0 = time.perf_counter()
                units[way] += asyncio.run(slice_(server.url, way, args, pool, args.seconds))
                spent[way] += time.perf_counter() - t0
    finally:
        server.close()
    rows = [summarize(way, units[way], spent[way]) for way in ("n", "separate")]
    a, b = rows
    out = {
        "model": args.model, "task": args.task, "n": args.n, "clients": args.clients, "threads": args.threads,
        "rows": rows,
        "failed": a["failed"] + b["failed"],
        "throughput_ratio": a["choices_per_s"] / b["choices_per_s"] if b["choices_per_s"] else None,
        "prefill_flops_ratio": (a["prefill_flops_per_choice"] / b["prefill_flops_per_choice"]
                                if b["prefill_flops_per_choice"] else None),
    }  # fmt: skip
    t = Table(title=f"n = {args.n} choices off one prefill vs {args.n} separate requests ({args.clients} clients)")
    for col in ("way", "units", "choices/s", "tokens/s", "p50 ms", "p99 ms", "prefill+vision FLOPs / choice", "failed"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["way"], str(r["units"]), f"{r['choices_per_s']:.2f}", f"{r['tokens_per_s']:.1f}",
                  f"{r['p50_ms'] or 0:.0f}", f"{r['p99_ms'] or 0:.0f}", f"{r['prefill_flops_per_choice']:.3g}",
                  str(r["failed"]))  # fmt: skip
    console.print(t)
    console.print(f"throughput n / separate: {out['throughput_ratio'] or 0:.2f}x; prefill FLOPs n / separate: "
                  f"{out['prefill_flops_ratio'] or 0:.3f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
