"""Load test of `trimvlm serve` on loopback: throughput and latency, micro-batching on vs off, a recipe vs none.

Two servers run side by side as subprocesses (one torch thread each, unless `--threads`): one micro-batching
(`--max-batch`, default 32, `--max-wait-ms`) and one answering one request at a time (`--max-batch 1`); an
idle one costs nothing, and every cell is measured on both in `--rounds` alternating slices. Against each,
for `/v1/systemone` (three questions, noul / choice / score, about one image) and `/v1/chat/completions`
(one image and one of the demo task's question kinds, short and long answers, `--max-new-tokens` 16), with no
recipe and with a token-reduction recipe (the requests' `recipe` field), `--clients` closed-loop clients
each send a request, wait for its answer and send the next, for `--seconds`; then they stop (a request in
flight finishes and counts). A short warm-up precedes each cell. Reported per cell: requests/s, p50 / p99
latency (client side), the mean batch the server reported (`usage.batch_requests`), failed requests (any
status but 200). The summary: batched / one-at-a-time throughput at each client count.

The clients run in this process on the same machine as the server: on a small machine they take CPU from it
(the one-at-a-time server pays the same; `client_cpu_share` says how much, in cores). Times are of this
machine; the ratios are the result.

    python benchmarks/serve_load.py --model demo --clients 1,8,32 --seconds 20 --json serve.json [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from trimvlm.testing.decisions import DEMO_QUESTIONS as QUESTIONS

console = Console(width=200)

# the demo task's question kinds: short answers (a count, yes / no, a color) and long ones (a description, a
# row's objects, the text read)
PROMPTS = [
    "how many red ?",
    "is there a blue circle ?",
    "describe ?",
    "color at r2 c3 ?",
    "list row r1 ?",
    "read text ?",
]


def images(n: int, size: int) -> list[str]:
    """n demo scenes as base64 PNG."""
    from trimvlm.demo.task import make_scene, render

    out = []
    for seed in range(n):
        im = render(make_scene(np.random.default_rng(1000 + seed)))
        if size != im.size[0]:
            im = im.resize((size, size))
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        out.append(base64.b64encode(buf.getvalue()).decode())
    return out


def bodies(endpoint: str, recipe: str, pool: list[str], max_tokens: int) -> list[bytes]:
    """The requests the clients cycle through, encoded once."""
    out = []
    for i, img in enumerate(pool):
        if endpoint == "systemone":
            body = {"model": "demo", "state": {"photo": "<img>"}, "questions": QUESTIONS,
                    "assets": {"<img>": {"type": "image", "format": "png", "data_base64": img}}}  # fmt: skip
        else:
            content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + img}},
                       {"type": "text", "text": PROMPTS[i % len(PROMPTS)]}]  # fmt: skip
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
        if recipe:
            body["recipe"] = recipe
        body.pop("model", None)
        out.append(json.dumps(body).encode())
    return out


async def load(url: str, path: str, reqs: list[bytes], clients: int, seconds: float) -> dict:
    """`clients` closed loops for `seconds`; what they saw (latencies, servers' batch sizes, failures)."""
    import httpx

    latencies, batches, failures = [], [], []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
        t0, cpu0 = time.perf_counter(), time.process_time()
        stop = t0 + seconds

        async def loop(k: int):
            i = k
            while time.perf_counter() < stop:
                s = time.perf_counter()
                r = await c.post(
                    path, content=reqs[i % len(reqs)], headers={"content-type": "application/json"}
                )
                latencies.append(time.perf_counter() - s)
                if r.status_code != 200:
                    failures.append(f"{r.status_code}: {r.text[:200]}")
                else:
                    batches.append(r.json()["usage"]["batch_requests"])
                i += clients

        await asyncio.gather(*(loop(k) for k in range(clients)))
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {
        "latencies": latencies,
        "batches": batches,
        "failures": failures,
        "seconds": elapsed,
        "client_cpu_s": cpu,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args, max_batch: int, extra: tuple[str, ...] = ()):
        import httpx

        self.max_batch = max_batch
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
        cmd = [
            sys.executable, "-m", "trimvlm.cli", "serve", "--model", args.model, "--port", str(self.port),
            "--threads", str(args.threads), "--max-batch", str(max_batch), "--max-wait-ms", str(args.max_wait_ms),
            "--device", args.device, "--log-level", "warning", *extra,
        ]  # fmt: skip
        self.log = tempfile.TemporaryFile("w+")  # not a pipe: a full pipe would block the server
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise SystemExit(f"the server exited: {self.log.read()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise SystemExit("the server did not start within 300 s")
            time.sleep(0.3)

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def merge(parts: list[dict]) -> dict:
    """The slices of one cell (one server) as one measurement."""
    lat = sorted(x for p in parts for x in p["latencies"])
    batches = [x for p in parts for x in p["batches"]]
    failures = [x for p in parts for x in p["failures"]]
    elapsed = sum(p["seconds"] for p in parts)
    return {
        "requests": len(lat), "failed": len(failures), "failures": failures[:5], "seconds": elapsed,
        "throughput_rps": len(lat) / elapsed,
        "p50_ms": 1e3 * statistics.median(lat) if lat else None,
        "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
        "mean_batch": statistics.fmean(batches) if batches else None,
        "client_cpu_share": sum(p["client_cpu_s"] for p in parts) / elapsed,  # CPU the clients took (1 = a core)
    }  # fmt: skip


def measure(args, servers: dict, clients: list[int], endpoints: list[str], pool: list[str]) -> list[dict]:
    """Every cell on both servers, interleaved: `--rounds` slices per server, alternating which goes first, so
    that drift on a shared machine hits both alike."""
    paths = {"systemone": "/v1/systemone", "chat": "/v1/chat/completions"}
    rows = []
    for ep in endpoints:
        for recipe in ("", args.recipe):
            reqs = bodies(ep, recipe, pool, args.max_new_tokens)
            for n in clients:
                parts = {mode: [] for mode in servers}
                for server in servers.values():
                    asyncio.run(load(server.url, paths[ep], reqs, n, args.warmup))
                for r in range(args.rounds):
                    order = list(servers) if r % 2 == 0 else list(servers)[::-1]
                    for mode in order:
                        seconds = args.seconds / args.rounds
                        parts[mode].append(asyncio.run(load(servers[mode].url, paths[ep], reqs, n, seconds)))
                for mode, server in servers.items():
                    res = merge(parts[mode])
                    row = {"server": mode, "max_batch": server.max_batch, "endpoint": ep,
                           "recipe": recipe or "baseline", "clients": n} | res  # fmt: skip
                    rows.append(row)
                    console.print(
                        f"{mode:14s} {ep:9s} {row['recipe'][:32]:32s} clients {n:3d}: "
                        f"{res['throughput_rps']:7.2f} req/s  p50 {res['p50_ms']:7.1f} ms  "
                        f"p99 {res['p99_ms']:7.1f} ms  batch {res['mean_batch'] or 0:5.1f}  failed {res['failed']}  "
                        f"client CPU {res['client_cpu_share']:.2f} core"
                    )
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--clients", default="1,8,32", help="comma-separated client counts")
    ap.add_argument("--seconds", type=float, default=20.0, help="measured seconds per cell")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each measurement")
    ap.add_argument("--rounds", type=int, default=2, help="alternating slices of each cell per server")
    ap.add_argument("--max-batch", type=int, default=32, help="the batching server's --max-batch")
    ap.add_argument("--max-wait-ms", type=float, default=10.0)
    ap.add_argument("--recipe", default="tokens=density:keep=0.25:layer=1", help="the token-reduction recipe")
    ap.add_argument("--endpoints", default="systemone,chat")
    ap.add_argument("--max-new-tokens", type=int, default=16, help="chat completions' max_tokens")
    ap.add_argument("--images", type=int, default=16, help="distinct images the requests cycle through")
    ap.add_argument("--image-size", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="a smoke test in seconds: 2 clients, 0.5 s per "
                    "cell in 1 slice, 0.2 s warm-up, 2 images, 4 new tokens")  # fmt: skip
    args = ap.parse_args(argv)
    if args.quick:
        args.clients, args.seconds, args.warmup, args.rounds = "2", 0.5, 0.2, 1
        args.images, args.max_new_tokens = 2, 4
    clients = [int(x) for x in args.clients.split(",")]
    endpoints = args.endpoints.split(",")
    pool = images(args.images, args.image_size)
    servers = {}
    try:
        for mode, max_batch in (("batched", args.max_batch), ("one-at-a-time", 1)):
            servers[mode] = Server(args, max_batch)
        rows = measure(args, servers, clients, endpoints, pool)
    finally:
        for server in servers.values():
            server.close()
    table = Table(title=f"trimvlm serve on {args.model}: {args.seconds:g} s per cell")
    for col in ("endpoint", "recipe", "clients", "batched req/s", "one-at-a-time req/s", "ratio",
                "p50 ms (b / 1)", "p99 ms (b / 1)", "mean batch", "failed"):  # fmt: skip
        table.add_column(col)
    summary = []
    for row in rows:
        if row["server"] != "batched":
            continue
        one = next(
            r for r in rows if r["server"] == "one-at-a-time"
            and (r["endpoint"], r["recipe"], r["clients"]) == (row["endpoint"], row["recipe"], row["clients"])
        )  # fmt: skip
        ratio = row["throughput_rps"] / one["throughput_rps"]
        summary.append({"endpoint": row["endpoint"], "recipe": row["recipe"], "clients": row["clients"],
                        "batched_rps": row["throughput_rps"], "one_at_a_time_rps": one["throughput_rps"],
                        "ratio": ratio})  # fmt: skip
        table.add_row(
            row["endpoint"], row["recipe"], str(row["clients"]), f"{row['throughput_rps']:.2f}",
            f"{one['throughput_rps']:.2f}", f"{ratio:.2f}x", f"{row['p50_ms']:.0f} / {one['p50_ms']:.0f}",
            f"{row['p99_ms']:.0f} / {one['p99_ms']:.0f}", f"{row['mean_batch'] or 0:.1f}",
            str(row["failed"] + one["failed"]),
        )  # fmt: skip
    console.print(table)
    failed = sum(r["failed"] for r in rows)
    console.print(f"failed requests: {failed}")
    if args.json:
        out = {"args": vars(args), "cells": rows, "summary": summary, "failed": failed}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        console.print(f"[dim]wrote {args.json}[/]")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
