"""Load test of `trimvlm serve` on loopback: throughput and latency, batching on vs off, a recipe vs none,
time to first token, and cancellation.

Two servers run side by side as subprocesses (one torch thread each, unless `--threads`): one batching
(`--max-batch`, default 32, `--max-wait-ms`: System One requests micro-batched, chat completions batched
continuously, step by step) and one answering one request at a time (`--max-batch 1`); an
idle one costs nothing, and every cell is measured on both in `--rounds` alternating slices. Against each,
for `/v1/systemone` (three questions, noul / choice / score, about one image) and `/v1/chat/completions`
(one image and one of the demo task's question kinds, short and long answers, `--max-new-tokens` 16), with no
recipe and with a token-reduction recipe (the requests' `recipe` field), `--clients` closed-loop clients
each send a request, wait for its answer and send the next, for `--seconds`; then they stop (a request in
flight finishes and counts). A short warm-up precedes each cell. Reported per cell: requests/s, p50 / p99
latency (client side: the whole answer), the mean batch the server reported (`usage.batch_requests`), failed
requests (any status but 200); for chat completions, which are streamed, also the time to the first token
(TTFT: request sent -> first chunk with text) and the inter-token latency (between text chunks), p50 / p99, and
the client's TTFT minus the engine's (`usage.engine_ttft_s`), p50: what HTTP, parsing, preparation and
streaming add, and its two parts: in the server (`usage.server_ttft_s`, received by the handler -> first token
there, minus the engine's) and outside it (the client's TTFT minus the server's: the connection, the HTTP
server before the handler, the writes and the clients' own event loop, which shares this machine).
CPU per cell, in cores: the clients' (this process), the server's processes' (/proc: the engine and any API
processes) and its model thread's alone (`trimvlm_model_thread_cpu_seconds` on /metrics: with one torch thread
all of the model's work, none of the HTTP); requests per CPU second of the model thread is `model_ceiling_rps`,
what the model loop would serve with a core of its own at the batches it ran (its ratio to the throughput: how
far a front end with cores of its own could lift the server, at most; a larger batch would go further).
The summary: batched / one-at-a-time throughput at each client count, and TTFT p50 / end-to-end p50, over all
answers and over the multi-token answers alone (>= `LONG` text chunks: a one-token answer ends one decode step
after its first token, so its TTFT is nearly all of its latency whatever the scheduler does). `--chat-prompts
long` asks only the question whose answers run to many tokens (a description), a chat workload where the
time to the first token and the whole answer differ by more than one step. `--no-caches`: both servers without
their caches.

Cancellation (`--cancel-clients N`, on the batching server, chat): N streaming clients run for `--seconds`;
half-way, half of them hang up (their request in flight is abandoned: the connection closes). The server's
own counts (`/health`) say what became of those requests: dropped while queued (never computed) or left the
decode batch at the next step; `cancelled_completed` (those neither) is what a server that ignores
disconnects would show.

The clients run in this process on the same machine as the server: on a small machine they take CPU from it
(the one-at-a-time server pays the same; `client_cpu_share` says how much, in cores). Times are of this
machine; the ratios are the result.

    python benchmarks/serve_load.py --model demo --clients 1,8,32,64 --seconds 20 --json serve.json [--quick]
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
# row's objects, the text read); `--chat-prompts long`: the description alone (5-16 tokens on the demo model)
PROMPTS = {
    "mixed": ["how many red ?", "is there a blue circle ?", "describe ?", "color at r2 c3 ?", "list row r1 ?",
              "read text ?"],  # fmt: skip
    "long": ["describe ?"],
}


def png_b64(image) -> str:
    """A PIL image as base64 PNG (a data URL's payload)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def images(n: int, size: int) -> list[str]:
    """n demo scenes as base64 PNG."""
    from trimvlm.demo.task import make_scene, render

    out = []
    for seed in range(n):
        im = render(make_scene(np.random.default_rng(1000 + seed)))
        out.append(png_b64(im if size == im.size[0] else im.resize((size, size))))
    return out


def bodies(endpoint: str, recipe: str, pool: list[str], max_tokens: int, kinds: str = "mixed") -> list[bytes]:
    """The requests the clients cycle through, encoded once (`kinds`: the chat questions, a key of PROMPTS)."""
    prompts = PROMPTS[kinds]
    out = []
    for i, img in enumerate(pool):
        if endpoint == "systemone":
            body = {"model": "demo", "state": {"photo": "<img>"}, "questions": QUESTIONS,
                    "assets": {"<img>": {"type": "image", "format": "png", "data_base64": img}}}  # fmt: skip
        else:
            content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + img}},
                       {"type": "text", "text": prompts[i % len(prompts)]}]  # fmt: skip
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "stream": True}
        if recipe:
            body["recipe"] = recipe
        body.pop("model", None)
        out.append(json.dumps(body).encode())
    return out


async def ask(c, path: str, body: bytes) -> dict:
    """One request: its status, latency (the whole answer), the server's batch, and for a streamed chat
    completion the time to its first text chunk and the gaps between text chunks."""
    t0 = time.perf_counter()
    out = {"ttft": None, "gaps": [], "batch": None, "chunks": 0}
    async with c.stream("POST", path, content=body, headers={"content-type": "application/json"}) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = (await r.aread()).decode(errors="replace")[:200]
        elif r.headers.get("content-type", "").startswith("text/event-stream"):
            last = None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    out["status"], out["error"] = chunk["error"].get("code", 500), chunk["error"]["message"]
                    break
                if chunk["choices"][0]["delta"].get("content"):
                    out["chunks"] += 1
                    now = time.perf_counter()
                    if last is None:
                        out["ttft"] = now - t0
                    else:
                        out["gaps"].append(now - last)
                    last = now
                if "usage" in chunk:
                    out["batch"] = chunk["usage"]["batch_requests"]
                    out["engine_ttft"] = chunk["usage"].get("engine_ttft_s")
                    out["server_ttft"] = chunk["usage"].get("server_ttft_s")
        else:
            out["batch"] = json.loads(await r.aread())["usage"]["batch_requests"]
    out["latency"] = time.perf_counter() - t0
    return out


async def load(url: str, path: str, reqs: list[bytes], clients: int, seconds: float, hang_up: float = 0.0) -> dict:
    """`clients` closed loops for `seconds`; what they saw (latencies, TTFTs, inter-token gaps, servers' batch
    sizes, failures). `hang_up` > 0: after that many seconds, half the clients hang up (`abandoned`: their
    requests in flight then)."""
    import httpx

    seen = {"latencies": [], "ttft": [], "gaps": [], "batches": [], "failures": [], "abandoned": 0, "long": [],
            "ttft_overhead": [], "ttft_split": []}  # fmt: skip
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
        t0, cpu0 = time.perf_counter(), time.process_time()
        stop = t0 + seconds
        busy = {}

        async def loop(k: int):
            i = k
            while time.perf_counter() < stop:
                busy[k] = True
                res = await ask(c, path, reqs[i % len(reqs)])
                busy[k] = False
                seen["latencies"].append(res["latency"])
                if res["status"] != 200:
                    seen["failures"].append(f"{res['status']}: {res.get('error', '')}")
                else:
                    seen["batches"].append(res["batch"])
                    if res["ttft"] is not None:
                        seen["ttft"].append(res["ttft"])
                        if res.get("engine_ttft") is not None:  # what the HTTP side adds to the engine's TTFT
                            seen["ttft_overhead"].append(res["ttft"] - res["engine_ttft"])
                            if res.get("server_ttft") is not None:  # (in the server, outside it)
                                seen["ttft_split"].append((res["server_ttft"] - res["engine_ttft"],
                                                           res["ttft"] - res["server_ttft"]))
                    if res["chunks"] >= LONG:  # (TTFT, end to end) of a multi-token answer
                        seen["long"].append((res["ttft"], res["latency"]))
                    seen["gaps"] += res["gaps"]
                i += clients

        tasks = [asyncio.ensure_future(loop(k)) for k in range(clients)]
        if hang_up > 0:
            await asyncio.sleep(hang_up)
            for k in range(0, clients, 2):
                seen["abandoned"] += bool(busy.get(k))
                tasks[k].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return seen | {"seconds": elapsed, "client_cpu_s": cpu}


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

    def cpu(self) -> tuple[float | None, float | None]:
        """(CPU seconds of the server's model thread, from its /metrics; of the server's processes: the
        engine and any API processes, from /proc, None where there is none)."""
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=30).text
        line = next((ln for ln in text.splitlines() if ln.startswith("trimvlm_model_thread_cpu_seconds ")), None)
        return (None if line is None else float(line.split()[-1])), tree_cpu(self.proc.pid)

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def tree_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) of process `pid` and its descendants, from /proc (None without it)."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        stats = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)"
                except OSError:  # gone meanwhile
                    continue
                stats[int(name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)  # ppid, utime+stime
    except (OSError, ValueError, AttributeError):
        return None
    tree, grew = {pid}, True
    while grew:  # the descendants, to a fixed point
        grew = False
        for p, (ppid, _) in stats.items():
            if ppid in tree and p not in tree:
                tree.add(p)
                grew = True
    return sum(stats[p][1] for p in tree if p in stats)


LONG = 4  # text chunks from which an answer counts as a multi-token one (its TTFT share reported apart)


def pct(xs: list[float], q: float) -> float | None:
    """The q-quantile of xs in ms (None if empty)."""
    xs = sorted(xs)
    return 1e3 * xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def merge(parts: list[dict]) -> dict:
    """The slices of one cell (one server) as one measurement."""
    lat = sorted(x for p in parts for x in p["latencies"])
    ttft = [x for p in parts for x in p["ttft"]]
    gaps = [x for p in parts for x in p["gaps"]]
    batches = [x for p in parts for x in p["batches"] if x is not None]
    failures = [x for p in parts for x in p["failures"]]
    long = [x for p in parts for x in p.get("long", [])]
    over = [x for p in parts for x in p.get("ttft_overhead", [])]
    split = [x for p in parts for x in p.get("ttft_split", [])]
    elapsed = sum(p["seconds"] for p in parts)
    return {
        "requests": len(lat), "failed": len(failures), "failures": failures[:5], "seconds": elapsed,
        "throughput_rps": len(lat) / elapsed,
        "p50_ms": 1e3 * statistics.median(lat) if lat else None, "p99_ms": pct(lat, 0.99),
        "ttft_p50_ms": 1e3 * statistics.median(ttft) if ttft else None, "ttft_p99_ms": pct(ttft, 0.99),
        "itl_p50_ms": 1e3 * statistics.median(gaps) if gaps else None, "itl_p99_ms": pct(gaps, 0.99),
        # the client's TTFT minus the engine's (usage.engine_ttft_s: queued -> first token sent by the model thread)
        "ttft_overhead_p50_ms": 1e3 * statistics.median(over) if over else None,
        # that overhead's two parts: in the server (received by the handler -> first token there, minus the
        # engine's TTFT: parsing, preparation, hand-offs) and outside it (the client's TTFT minus the server's:
        # the connection, uvicorn before the handler, the writes and the client's own event loop)
        "ttft_server_part_p50_ms": 1e3 * statistics.median(a for a, _ in split) if split else None,
        "ttft_outside_p50_ms": 1e3 * statistics.median(b for _, b in split) if split else None,
        "mean_batch": statistics.fmean(batches) if batches else None,
        # answers of >= LONG text chunks only: their TTFT p50 over their end-to-end p50
        "long_answers": len(long),
        "long_ttft_over_e2e_p50": statistics.median(t for t, _ in long) / statistics.median(e for _, e in long)
        if long else None,
        "client_cpu_share": sum(p["client_cpu_s"] for p in parts) / elapsed,  # CPU the clients took (1 = a core)
        # the server's: its processes (engine and API processes) and its model thread alone (cores)
        "server_cpu_share": cpu_share(parts, "server_cpu_s", elapsed),
        "model_cpu_share": cpu_share(parts, "model_cpu_s", elapsed),
        # requests per CPU second of the model thread: what it would serve with a core to itself at these batches
        "model_ceiling_rps": len(lat) / (elapsed * model) if (model := cpu_share(parts, "model_cpu_s", elapsed))
        else None,
    }  # fmt: skip


def cpu_share(parts: list[dict], key: str, elapsed: float) -> float | None:
    """Cores' worth of CPU seconds `key` over the slices (None if a slice has none)."""
    xs = [p.get(key) for p in parts]
    return None if not xs or None in xs else sum(xs) / elapsed


def measure(args, servers: dict, clients: list[int], endpoints: list[str], pool: list[str]) -> list[dict]:
    """Every cell on both servers, interleaved: `--rounds` slices per server, alternating which goes first, so
    that drift on a shared machine hits both alike."""
    paths = {"systemone": "/v1/systemone", "chat": "/v1/chat/completions"}
    rows = []
    for ep in endpoints:
        for recipe in ("", args.recipe):
            reqs = bodies(ep, recipe, pool, args.max_new_tokens, args.chat_prompts)
            for n in clients:
                parts = {mode: [] for mode in servers}
                for server in servers.values():
                    asyncio.run(load(server.url, paths[ep], reqs, n, args.warmup))
                for r in range(args.rounds):
                    order = list(servers) if r % 2 == 0 else list(servers)[::-1]
                    for mode in order:
                        seconds = args.seconds / args.rounds
                        before = servers[mode].cpu()
                        part = asyncio.run(load(servers[mode].url, paths[ep], reqs, n, seconds))
                        after = servers[mode].cpu()
                        part["model_cpu_s"], part["server_cpu_s"] = (
                            None if a is None or b is None else b - a for a, b in zip(before, after, strict=True))
                        parts[mode].append(part)
                for mode, server in servers.items():
                    res = merge(parts[mode])
                    row = {"server": mode, "max_batch": server.max_batch, "endpoint": ep,
                           "recipe": recipe or "baseline", "clients": n} | res  # fmt: skip
                    rows.append(row)
                    ttft = "" if res["ttft_p50_ms"] is None else (
                        f"  TTFT p50 {res['ttft_p50_ms']:6.1f} p99 {res['ttft_p99_ms']:6.1f} ms  "
                        f"ITL p50 {res['itl_p50_ms'] or 0:5.1f} ms")  # fmt: skip
                    console.print(
                        f"{mode:14s} {ep:9s} {row['recipe'][:32]:32s} clients {n:3d}: "
                        f"{res['throughput_rps']:7.2f} req/s  p50 {res['p50_ms']:7.1f} ms  "
                        f"p99 {res['p99_ms']:7.1f} ms  batch {res['mean_batch'] or 0:5.1f}  failed {res['failed']}  "
                        f"client CPU {res['client_cpu_share']:.2f} core  server "
                        f"{res['server_cpu_share'] or 0:.2f}  model {res['model_cpu_share'] or 0:.2f}{ttft}"
                    )
    return rows


def cancellation(args, server, pool: list[str]) -> dict:
    """`--cancel-clients` streaming clients on the batching server; half-way half of them hang up. What the
    server did with the requests they abandoned, by its own counts (`/health`), once it is idle again."""
    import httpx

    def stages() -> dict:
        """The server's counts of requests whose client left (/metrics), by where they were."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(server.url + "/metrics").text
        out = {"queued": 0, "running": 0, "finished": 0}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "trimvlm_cancelled_requests_total":
                    out[sample.labels["stage"]] = int(sample.value)
        return out

    reqs = bodies("chat", "", pool, args.max_new_tokens, args.chat_prompts)
    before, gone0 = httpx.get(server.url + "/health").json(), stages()
    seen = asyncio.run(load(server.url, "/v1/chat/completions", reqs, args.cancel_clients, args.seconds,
                            hang_up=args.seconds / 2))  # fmt: skip
    deadline = time.monotonic() + 60
    while True:
        after = httpx.get(server.url + "/health").json()
        if (after["running"] == 0 and after["waiting"] == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    gone = {k: v - gone0[k] for k, v in stages().items()}
    return {
        "clients": args.cancel_clients, "hung_up": (args.cancel_clients + 1) // 2, "abandoned": seen["abandoned"],
        # the server's view: queued ones never computed, running ones left the batch at the next step,
        # finished ones were already computed when their client left (too late to save anything)
        "dropped_queued": after["dropped"] - before["dropped"], "seen_queued": gone["queued"],
        "left_running": after["cancelled_running"] - before["cancelled_running"], "seen_running": gone["running"],
        "already_finished": gone["finished"],
        # cancelled before they finished, yet computed to the end: what this engine must keep at 0
        "cancelled_computed": gone["queued"] + gone["running"] - (after["dropped"] - before["dropped"])
        - (after["cancelled_running"] - before["cancelled_running"]),
        "failed": len(seen["failures"]), "answered": len(seen["latencies"]),
    }  # fmt: skip


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--clients", default=None, help="comma-separated client counts (default 32; --full: 1,8,32,64)")
    ap.add_argument("--seconds", type=float, default=None, help="measured seconds per cell (default 8; --full: 20)")
    ap.add_argument("--full", action="store_true", help="the long sweep: 1, 8, 32 and 64 clients, 20 s per cell "
                    "(about 15 minutes; the default, 32 clients and 8 s, takes about 3)")  # fmt: skip
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each measurement")
    ap.add_argument("--rounds", type=int, default=2, help="alternating slices of each cell per server")
    ap.add_argument("--max-batch", type=int, default=32, help="the batching server's --max-batch")
    ap.add_argument("--max-wait-ms", type=float, default=10.0)
    ap.add_argument("--max-prefill-tokens", type=int, default=4096, help="the batching server's")
    ap.add_argument("--recipe", default="tokens=density:keep=0.25:layer=1", help="the token-reduction recipe")
    ap.add_argument("--endpoints", default="systemone,chat")
    ap.add_argument("--max-new-tokens", type=int, default=16, help="chat completions' max_tokens")
    ap.add_argument("--chat-prompts", choices=sorted(PROMPTS), default="mixed",
                    help="the chat questions: mixed (six kinds, most answered in 1-3 tokens) or long (the "
                    "description alone: every answer 5-16 tokens)")  # fmt: skip
    ap.add_argument("--images", type=int, default=16, help="distinct images the requests cycle through")
    ap.add_argument("--image-size", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cancel-clients", type=int, default=32,
                    help="clients of the cancellation run (half hang up half-way; 0: no such run)")  # fmt: skip
    ap.add_argument("--no-caches", action="store_true",
                    help="both servers without their caches (vision features, prefixes and prompts, requests)")
    ap.add_argument("--api-workers", type=int, default=0,
                    help="compare the batching server with itself split into N API processes and the engine "
                         "process (instead of the one-at-a-time server)")  # fmt: skip
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="a smoke test in seconds: 2 clients, 0.5 s per "
                    "cell in 1 slice, 0.2 s warm-up, 2 images, 4 new tokens, 4 cancellation clients")  # fmt: skip
    args = ap.parse_args(argv)
    args.clients = args.clients or ("1,8,32,64" if args.full else "32")
    args.seconds = args.seconds or (20.0 if args.full else 8.0)
    if args.quick:
        args.clients, args.seconds, args.warmup, args.rounds = "2", 0.5, 0.2, 1
        args.images, args.max_new_tokens, args.cancel_clients = 2, 4, 4
    return args


def run_servers(args, clients: list[int], endpoints: list[str], other: str) -> tuple[list[dict], dict | None]:
    """The two servers started, every cell measured on both, the cancellation run; the servers closed."""
    pool = images(args.images, args.image_size)
    servers = {}
    try:
        budget = ("--max-prefill-tokens", str(args.max_prefill_tokens))
        off = ("--vision-cache-mb", "0", "--prefix-cache-mb", "0", "--request-cache-mb", "0") if args.no_caches else ()
        second = (other, args.max_batch, budget + ("--api-workers", str(args.api_workers))) if args.api_workers \
            else (other, 1, ())  # fmt: skip
        for mode, max_batch, extra in (("batched", args.max_batch, budget), second):
            servers[mode] = Server(args, max_batch, extra + off)
        rows = measure(args, servers, clients, endpoints, pool)
        cancel = cancellation(args, servers["batched"], pool) if args.cancel_clients and "chat" in endpoints else None
    finally:
        for server in servers.values():
            server.close()
    return rows, cancel


def summarize(rows: list[dict], other: str, api_workers: int) -> tuple[list[dict], Table]:
    """One summary row and one table row per cell of the batching server, beside the same cell of the other."""
    table = Table()
    for col in ("endpoint", "recipe", "clients", "batched req/s", f"{other} req/s", f"{other} / batched" if api_workers else "ratio",
                "p50 ms (b / 1)", "p99 ms (b / 1)", "TTFT p50 / p99 ms (b)", "TTFT / e2e p50 (b)", f"same, >= {LONG} chunks", "mean batch",
                "failed"):  # fmt: skip
        table.add_column(col)
    summary = []
    for row in rows:
        if row["server"] != "batched":
            continue
        one = next(
            r for r in rows if r["server"] == other
            and (r["endpoint"], r["recipe"], r["clients"]) == (row["endpoint"], row["recipe"], row["clients"])
        )  # fmt: skip
        # batched / one-at-a-time; with --api-workers: the split server / the one-process one
        ratio = one["throughput_rps"] / row["throughput_rps"] if api_workers else row["throughput_rps"] / one["throughput_rps"]
        ttft_share = None if row["ttft_p50_ms"] is None else row["ttft_p50_ms"] / row["p50_ms"]
        summary.append({"endpoint": row["endpoint"], "recipe": row["recipe"], "clients": row["clients"],
                        "batched_rps": row["throughput_rps"], "one_at_a_time_rps": one["throughput_rps"],
                        "other": other, "ratio": ratio, "ttft_over_e2e_p50": ttft_share,
                        "ttft_overhead_p50_ms": row["ttft_overhead_p50_ms"],
                        "ttft_server_part_p50_ms": row["ttft_server_part_p50_ms"],
                        "ttft_outside_p50_ms": row["ttft_outside_p50_ms"],
                        "other_ttft_overhead_p50_ms": one["ttft_overhead_p50_ms"],
                        # cores taken by the clients, the server's processes and its model thread (other_: the
                        # second server's)
                        **{f"{pre}{k}_cpu_share": r[f"{k}_cpu_share"] for pre, r in (("", row), ("other_", one))
                           for k in ("client", "server", "model")},
                        # the one-process server's requests per model-thread CPU second, over its throughput: how
                        # far a front end on cores of its own could lift it, at most, at its batches
                        "model_ceiling_rps": row["model_ceiling_rps"],
                        "ceiling_ratio": row["model_ceiling_rps"] / row["throughput_rps"]
                        if row["model_ceiling_rps"] else None,
                        "long_ttft_over_e2e_p50": row["long_ttft_over_e2e_p50"]})  # fmt: skip
        table.add_row(
            row["endpoint"], row["recipe"], str(row["clients"]), f"{row['throughput_rps']:.2f}",
            f"{one['throughput_rps']:.2f}", f"{ratio:.2f}x", f"{row['p50_ms']:.0f} / {one['p50_ms']:.0f}",
            f"{row['p99_ms']:.0f} / {one['p99_ms']:.0f}",
            "" if ttft_share is None else f"{row['ttft_p50_ms']:.0f} / {row['ttft_p99_ms']:.0f}",
            "" if ttft_share is None else f"{ttft_share:.2f}",
            "" if row["long_ttft_over_e2e_p50"] is None else f"{row['long_ttft_over_e2e_p50']:.2f}",
            f"{row['mean_batch'] or 0:.1f}",
            str(row["failed"] + one["failed"]),
        )  # fmt: skip
    return summary, table


def main(argv=None):
    args = parse(argv)
    clients = [int(x) for x in args.clients.split(",")]
    endpoints = args.endpoints.split(",")
    other = f"api-workers-{args.api_workers}" if args.api_workers else "one-at-a-time"  # the second server
    rows, cancel = run_servers(args, clients, endpoints, other)
    summary, table = summarize(rows, other, args.api_workers)
    table.title = f"trimvlm serve on {args.model}: {args.seconds:g} s per cell"
    console.print(table)
    failed = sum(r["failed"] for r in rows)
    console.print(f"failed requests: {failed}")
    if cancel is not None:
        console.print(f"cancellation: {cancel}")
    if args.json:
        out = {"args": vars(args), "cells": rows, "summary": summary, "failed": failed, "cancellation": cancel}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        console.print(f"[dim]wrote {args.json}[/]")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
