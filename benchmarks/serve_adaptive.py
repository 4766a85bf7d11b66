"""Budgets that follow the load against a fixed recipe, under open-loop arrivals: `trimvlm serve --tuned DIR
--slo-ttft-ms T` (requests naming no recipe take the most accurate rung of the tuned ladder whose predicted TTFT
fits T) and the same server with its fixed recipe (`--recipe`, default the baseline), both subprocesses on
loopback, one torch thread each (`--threads`), their caches off (every request is prefilled, as new prompts are).

First the fixed server's capacity is measured: `--clients` closed-loop clients for `--calibrate` seconds give
the requests per second it holds. Then each server gets `--warmup` seconds of the load (not measured: first
uses of kernels and plans), and Poisson arrivals at `--load` times that rate (default 2x) for `--seconds`, in
alternating slices (`--rounds`); every request is a test question of the model's task (`--task`, default the
checkpoint's own: demo or scenes; its image and question, streamed, `--max-new-tokens`), its answer graded
against the question's gold answer with the task's metric. Reported per server: requests, failed, TTFT p50 /
p99 (request sent -> first text chunk), the engine's TTFT p50 / p99 (`usage.engine_ttft_s`: queued in the
engine -> first token sent; the rest is HTTP, parsing, preparation and the clients), end-to-end p50 / p99,
accuracy, and for the adaptive one the recipes its answers ran (`usage.recipe`).

The clients run in this process on the same machine as the servers: on a small machine they take CPU from them.
Times are of this machine; what holds and what does not is the result.

    python benchmarks/serve_adaptive.py --model demo --tuned docs/results/tune-demo --slo-ttft-ms 300 \\
        --seconds 20 --json adaptive.json [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import time
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

console = Console(width=160)
ROOT = Path(__file__).resolve().parent.parent


def _serve_load():
    """benchmarks/serve_load.py (its server launcher, closed-loop load and percentiles)."""
    spec = importlib.util.spec_from_file_location("serve_load", Path(__file__).with_name("serve_load.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def items(task: str, n: int) -> list[dict]:
    """n test questions of `task` (a generated demo task: demo or scenes): the request body, the gold answer, the
    options, the task's metric."""
    from trimvlm.evals.tasks import get_task

    png_b64, out = _serve_load().png_b64, []
    for r in get_task(task, limit=n).records:
        url = "data:image/png;base64," + png_b64(r.images[0])
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": r.prompt_text()}]
        out.append({"messages": [{"role": "user", "content": content}], "gold": r.answers[0], "options": r.options,
                    "metric": r.metric})  # fmt: skip
    return out


async def one(c, item: dict, max_tokens: int) -> dict:
    """A streamed request: (TTFT, end to end, text, recipe, ok)."""
    body = {"messages": item["messages"], "max_tokens": max_tokens, "stream": True}
    t0 = time.perf_counter()
    ttft, text, recipe, ok, error, engine = None, "", None, True, None, None
    try:
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"{r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    ok, error = False, chunk["error"]["message"]
                for ch in chunk.get("choices", []):
                    piece = ch["delta"].get("content")
                    if piece:
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        text += piece
                usage = chunk.get("usage") or {}
                recipe, engine = usage.get("recipe", recipe), usage.get("engine_ttft_s", engine)
    except Exception as e:  # noqa: BLE001  (a failed request counts as failed)
        cause = e.__cause__ or e.__context__  # httpx's ReadError says little: the socket error under it
        return {"ok": False, "error": f"{type(e).__name__}: {e} ({cause!r}; {time.perf_counter() - t0:.2f} s)"[:200]}
    if not ok:
        return {"ok": False, "error": error}
    return {"ok": ok, "ttft": ttft if ttft is not None else time.perf_counter() - t0,
            "e2e": time.perf_counter() - t0, "text": text, "recipe": recipe, "item": item,
            "engine_ttft": engine}  # fmt: skip


async def open_loop(url: str, pool: list[dict], rate: float, seconds: float, max_tokens: int, seed: int) -> list:
    """Poisson arrivals at `rate` per second for `seconds`; every request's result."""
    import httpx

    rng = random.Random(seed)
    tasks, t, k = [], 0.0, 0
    # idle connections are dropped after 2 s, well before the server's keep-alive timeout (`serve.app.KEEP_ALIVE_S`)
    # closes them: a request sent on a connection as the server closes it fails (ReadError)
    limits = httpx.Limits(max_connections=None, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
        start = time.perf_counter()
        while True:
            t += rng.expovariate(rate)
            if t > seconds:
                break
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            tasks.append(asyncio.ensure_future(one(c, pool[k % len(pool)], max_tokens)))
            k += 1
        return list(await asyncio.gather(*tasks))


def graded(results: list[dict]) -> list[float]:
    from trimvlm.evals.metrics import get_metric

    return [get_metric(r["item"]["metric"]).score(r["text"], [r["item"]["gold"]], r["item"]["options"])
            for r in results if r["ok"]]  # fmt: skip


def summarize(name: str, results: list[dict], pct) -> dict:
    ok = [r for r in results if r["ok"]]
    acc, engine = graded(results), [r["engine_ttft"] for r in ok if r.get("engine_ttft") is not None]
    return {
        "server": name, "requests": len(results), "failed": len(results) - len(ok),
        "ttft_p50_ms": pct([r["ttft"] for r in ok], 0.5), "ttft_p99_ms": pct([r["ttft"] for r in ok], 0.99),
        "e2e_p50_ms": pct([r["e2e"] for r in ok], 0.5), "e2e_p99_ms": pct([r["e2e"] for r in ok], 0.99),
        # queued in the engine -> its first token sent by the model thread (usage.engine_ttft_s): the part of
        # the TTFT that the engine's queue and prefills take, without HTTP, parsing and preparation
        "engine_ttft_p50_ms": pct(engine, 0.5), "engine_ttft_p99_ms": pct(engine, 0.99),
        "accuracy": sum(acc) / len(acc) if acc else None, "recipes": dict(Counter(r["recipe"] for r in ok)),
        "failures": dict(Counter(r["error"] for r in results if not r["ok"]).most_common(3)),
    }  # fmt: skip


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--task", default=None, help="the test questions (default: the checkpoint's own task)")
    ap.add_argument("--tuned", default=str(ROOT / "docs" / "results" / "tune-demo"))
    ap.add_argument("--slo-ttft-ms", type=float, default=300.0)
    ap.add_argument("--recipe", default="", help="the fixed server's recipe (default: the baseline)")
    ap.add_argument("--load", type=float, default=2.0, help="arrival rate, as a multiple of the fixed capacity")
    ap.add_argument("--clients", type=int, default=8, help="closed-loop clients of the capacity measurement")
    ap.add_argument("--calibrate", type=float, default=8.0, help="seconds of the capacity measurement")
    ap.add_argument("--seconds", type=float, default=20.0, help="seconds of arrivals per slice")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds of arrivals per server before measuring")
    ap.add_argument("--rounds", type=int, default=1, help="alternating slices per server")
    ap.add_argument("--items", type=int, default=60, help="test questions the requests cycle through")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each server")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="a smoke test: 1 s slices, 12 items")
    args = ap.parse_args(argv)
    if args.quick:
        args.calibrate, args.seconds, args.warmup, args.items, args.clients, args.max_new_tokens = 1.0, 1.0, 0.5, 12, 2, 6
    args.max_wait_ms = 10.0
    return args


def run(args, sl, pool: list[dict]) -> tuple[dict, float, float]:
    """The fixed and the adaptive server: the fixed one's capacity (closed loop), then open-loop arrivals at
    --load times it on both in alternating slices. Returns each server's requests, the capacity and the rate."""
    off = ("--prefix-cache-mb", "0", "--vision-cache-mb", "0", "--request-cache-mb", "0")  # every prompt new
    fixed = sl.Server(args, args.max_batch, ("--recipe", args.recipe, *off))
    adaptive = None
    try:
        adaptive = sl.Server(args, args.max_batch, ("--tuned", args.tuned, "--slo-ttft-ms", str(args.slo_ttft_ms),
                                                    *off))  # fmt: skip
        bodies = [json.dumps({"messages": it["messages"], "max_tokens": args.max_new_tokens, "stream": True}).encode()
                  for it in pool]  # fmt: skip
        cap = asyncio.run(sl.load(fixed.url, "/v1/chat/completions", bodies, args.clients, args.calibrate))
        capacity = (len(cap["latencies"]) - len(cap["failures"])) / cap["seconds"]
        rate = args.load * capacity
        if args.quick:  # a slice of about four arrivals whatever the capacity (seeded: the same count every run)
            args.seconds = max(args.seconds, 4.0 / rate)
        results = {"fixed": [], "adaptive": []}
        for server in (fixed, adaptive):  # warm-up (first uses: kernels, plans)
            asyncio.run(open_loop(server.url, pool, rate, args.warmup, args.max_new_tokens, seed=-1))
        for r in range(args.rounds):
            for name, server in (("fixed", fixed), ("adaptive", adaptive)):
                results[name] += asyncio.run(open_loop(server.url, pool, rate, args.seconds, args.max_new_tokens,
                                                       seed=r))  # fmt: skip
    finally:
        fixed.close()
        if adaptive is not None:
            adaptive.close()
    return results, capacity, rate


def show(args, rows: list[dict], capacity: float, rate: float) -> None:
    t = Table(title=f"open-loop arrivals at {rate:.2f}/s ({args.load:g}x the fixed server's {capacity:.2f}/s), "
                    f"TTFT objective {args.slo_ttft_ms:g} ms")  # fmt: skip
    for col in ("server", "requests", "failed", "TTFT p50", "TTFT p99", "engine TTFT p99", "e2e p50", "e2e p99",
                "accuracy", "recipes"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["server"], str(r["requests"]), str(r["failed"]), f"{r['ttft_p50_ms'] or 0:.0f}",
                  f"{r['ttft_p99_ms'] or 0:.0f}", f"{r['engine_ttft_p99_ms'] or 0:.0f}",
                  f"{r['e2e_p50_ms'] or 0:.0f}", f"{r['e2e_p99_ms'] or 0:.0f}",
                  f"{r['accuracy'] or 0:.3f}", ", ".join(f"{k}: {v}" for k, v in r["recipes"].items()))  # fmt: skip
    console.print(t)


def main(argv=None):
    args = parse(argv)
    sl = _serve_load()
    from trimvlm.loading import checkpoint_task

    pool = items(args.task or checkpoint_task(args.model), args.items)
    results, capacity, rate = run(args, sl, pool)
    rows = [summarize(name, results[name], sl.pct) for name in ("fixed", "adaptive")]
    out = {"model": args.model, "tuned": args.tuned, "slo_ttft_ms": args.slo_ttft_ms, "capacity_rps": capacity,
           "rate_rps": rate, "threads": args.threads, "rows": rows,
           "failed": sum(r["failed"] for r in rows)}  # fmt: skip
    show(args, rows, capacity, rate)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
