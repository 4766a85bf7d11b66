"""A repeated-state System One workload against `trimvlm serve` with its caches and without them.

`--requests` requests (default 512) over `--states` distinct states (default 8: each its own image and words),
each asking one of four question sets (the demo's noul / choice / score questions, in different subsets), in a
seeded order. Two servers run side by side as subprocesses (benchmarks/serve_load.py's `Server`, one torch
thread each, the same `--max-batch`): one with the default caches (vision features, System One prefixes,
prepared requests), one with all three off (`--vision-cache-mb 0 --prefix-cache-mb 0 --request-cache-mb 0`).
`--clients` closed-loop clients replay the whole list once per round (each request sent once), against each
server in turn, `--rounds` times in alternating order. Both servers start cold (their first round pays the
misses). Reported per server: requests/s, p50 / p99 latency, failed requests, and how many answers reused a
prefix / a prepared request; the ratio of the throughputs; and whether every answer of the cached server equals
the uncached server's for the same request (`assert_same_answers`, 1e-5). The clients run in this process, on
the same host: `--client streams` (default) are plain keep-alive HTTP/1.1 connections (`Connection`, ~0.3 ms of
CPU per request), `--client httpx` httpx's pool (~3 ms per request, what the figures before issue 18's last
session used: on a 2-core host that client took CPU from the server it measured).

    python benchmarks/serve_cache.py --requests 512 --states 8 --clients 32 --json serve-cache.json [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from trimvlm.testing.decisions import DEMO_QUESTIONS as QUESTIONS
from trimvlm.testing.decisions import assert_same_answers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import Server, images  # noqa: E402  (the load benchmark's server and images)

console = Console(width=200)
NAMES = list(QUESTIONS)
QUESTION_SETS = [NAMES, NAMES[:1], NAMES[1:], [NAMES[2], NAMES[0]]]
WORDS = ["red", "blue", "green", "yellow", "purple", "circle", "square", "triangle"]
OFF = ("--vision-cache-mb", "0", "--prefix-cache-mb", "0", "--request-cache-mb", "0")


def workload(n: int, states: int, size: int, seed: int = 0) -> list[bytes]:
    """`n` request bodies over `states` distinct states, in a seeded order."""
    pool = images(states, size)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = int(rng.integers(states)) if i >= states else i  # every state appears
        qs = QUESTION_SETS[int(rng.integers(len(QUESTION_SETS)))]
        body = {
            "model": "demo", "state": {"photo": "<img>", "note": f"{WORDS[k % len(WORDS)]} {k}"},
            "questions": {q: QUESTIONS[q] for q in qs},
            "assets": {"<img>": {"type": "image", "format": "png", "data_base64": pool[k]}},
        }  # fmt: skip
        out.append(json.dumps(body).encode())
    return out


class Connection:
    """One keep-alive HTTP/1.1 connection on asyncio streams, POSTing JSON bodies: the lightest client this
    Python can run (`--client streams`; httpx costs the 2-core host ~3 ms of CPU per request, ~10x this, taken
    from the server it measures). It reads what `trimvlm serve` sends: a status line, headers, a body of
    `content-length` bytes (anything else is an error, counted as a failed request)."""

    def __init__(self, url: str):
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self.reader = self.writer = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-type: application/json\r\n"
        self.writer.write(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)
        await self.writer.drain()
        status = int((await self.reader.readline()).split()[1])
        length, close = None, False
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection":
                close = value.strip().lower() == b"close"
        if length is None:
            raise ConnectionError(f"an answer without content-length (status {status})")
        data = await self.reader.readexactly(length)
        if close:
            self.close()
        return status, data

    def close(self):
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def replay(url: str, reqs: list[bytes], clients: int, client: str = "streams") -> dict:
    """Every request once, by `clients` closed loops taking the next one (each its own keep-alive connection:
    `Connection`, or httpx's pool); what they saw."""
    import httpx

    latencies, failures, answers, usage = [], [], [None] * len(reqs), []
    todo = iter(range(len(reqs)))
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:

        async def send(conn, body: bytes) -> tuple[int, bytes]:
            if conn is not None:
                return await conn.post("/v1/systemone", body)
            r = await c.post("/v1/systemone", content=body, headers={"content-type": "application/json"})
            return r.status_code, r.content

        async def loop():
            conn = Connection(url) if client == "streams" else None
            try:
                for i in todo:
                    s = time.perf_counter()
                    try:
                        status, data = await send(conn, reqs[i])
                    except (OSError, ValueError, asyncio.IncompleteReadError) as e:
                        failures.append(f"{type(e).__name__}: {e}")
                        conn = Connection(url) if conn is not None else None
                        continue
                    latencies.append(time.perf_counter() - s)
                    if status != 200:
                        failures.append(f"{status}: {data[:200]!r}")
                        continue
                    out = json.loads(data)
                    answers[i] = out["answers"]
                    usage.append(out["usage"])
            finally:
                if conn is not None:
                    conn.close()

        t0 = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(clients)))
        elapsed = time.perf_counter() - t0
    return {"latencies": latencies, "failures": failures, "answers": answers, "usage": usage, "seconds": elapsed}


def summary(name: str, parts: list[dict]) -> dict:
    lat = sorted(x for p in parts for x in p["latencies"])
    usage = [u for p in parts for u in p["usage"]]
    elapsed = sum(p["seconds"] for p in parts)
    failures = [f for p in parts for f in p["failures"]]
    return {
        "server": name, "requests": len(lat), "failed": len(failures), "failures": failures[:5],
        "seconds": elapsed, "throughput_rps": len(lat) / elapsed,
        "p50_ms": 1e3 * statistics.median(lat), "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "prefix_reused": sum(bool(u.get("prefix_reused")) for u in usage),
        "request_cached": sum(bool(u.get("request_cached")) for u in usage),
        "mean_batch": statistics.fmean(u["batch_requests"] for u in usage) if usage else None,
        "mean_total_flops": statistics.fmean(u["total_flops"] for u in usage) if usage else None,
    }  # fmt: skip


def same(a, b) -> bool:
    try:
        assert_same_answers(a, b)
    except AssertionError:
        return False
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--states", type=int, default=8, help="distinct states (each its own image and words)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="replays of the whole list per server, alternating")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-wait-ms", type=float, default=10.0)
    ap.add_argument("--image-size", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each server")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--client", choices=("streams", "httpx"), default="streams",
                    help="the load generator: keep-alive connections on asyncio streams (light), or httpx")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="a smoke test: 48 requests, 4 states, 4 clients, 1 round")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.states, args.clients, args.rounds = 48, 4, 4, 1
    reqs = workload(args.requests, args.states, args.image_size)
    servers = {}
    try:
        servers["cached"] = Server(args, args.max_batch)
        servers["uncached"] = Server(args, args.max_batch, OFF)
        warm = workload(2, 2, args.image_size, seed=99)  # shapes only: other states than the workload's
        for s in servers.values():
            asyncio.run(replay(s.url, warm, 1))
        parts = {name: [] for name in servers}
        for r in range(args.rounds):
            order = list(servers) if r % 2 == 0 else list(servers)[::-1]
            for name in order:
                parts[name].append(asyncio.run(replay(servers[name].url, reqs, args.clients, args.client)))
    finally:
        for s in servers.values():
            s.close()
    cells = [summary(name, parts[name]) for name in servers]
    pairs = [(a, b) for pc, pu in zip(parts["cached"], parts["uncached"], strict=True)
             for a, b in zip(pc["answers"], pu["answers"], strict=True) if a is not None and b is not None]  # fmt: skip
    mismatches = sum(not same(a, b) for a, b in pairs)
    ratio = cells[0]["throughput_rps"] / cells[1]["throughput_rps"]
    out = {
        "requests": args.requests, "states": args.states, "clients": args.clients, "rounds": args.rounds,
        "client": args.client,
        "cells": cells, "ratio": ratio, "compared": len(pairs), "mismatches": mismatches,
        "failed": sum(c["failed"] for c in cells),
    }  # fmt: skip
    table = Table(title=f"System One, {args.requests} requests over {args.states} states, {args.clients} clients")
    for col in ("server", "req/s", "p50 ms", "p99 ms", "failed", "prefix reused", "request cached", "mean batch"):
        table.add_column(col)
    for c in cells:
        table.add_row(c["server"], f"{c['throughput_rps']:.1f}", f"{c['p50_ms']:.0f}", f"{c['p99_ms']:.0f}",
                      str(c["failed"]), str(c["prefix_reused"]), str(c["request_cached"]),
                      f"{c['mean_batch']:.1f}")  # fmt: skip
    console.print(table)
    console.print(f"cached / uncached throughput: {ratio:.2f}x; answers equal: {len(pairs) - mismatches}/{len(pairs)}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
