"""`trimvlm serve --api-workers N`: the engine process (this one: the model, the scheduler) and N API processes
(HTTP, JSON, validation, image decoding, tokenization), joined over local IPC (serve/ipc.py). The API processes
share one port (SO_REUSEPORT: the kernel spreads the connections); each loads the checkpoint for its
processor and tokenizer (and to check recipes). Their metrics are prometheus_client's multiprocess ones, in a
folder of this run's own (PROMETHEUS_MULTIPROC_DIR, set before any process makes a metric; an API process that
stops is marked dead there; the folder is removed at the end)."""

from __future__ import annotations

import multiprocessing
import os
import secrets
import socket
import sys
import tempfile
import threading
from multiprocessing.connection import Listener

import torch
import uvicorn

from trimvlm.errors import InputError
from trimvlm.serve.app import KEEP_ALIVE_S, build_app, make_state
from trimvlm.serve.ipc import bridge
from trimvlm.serve.logs import configure

MULTIPROC = "PROMETHEUS_MULTIPROC_DIR"


def serve_workers(model: str, *, workers: int, host: str, port: int, log_level: str, access_log: bool,
                  **options) -> None:  # fmt: skip
    """Load `model` here, start `workers` API processes on host:port, serve until interrupted."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise InputError("--api-workers needs SO_REUSEPORT (Linux, macOS)")
    with tempfile.TemporaryDirectory(prefix="trimvlm-metrics-", ignore_cleanup_errors=True) as folder:
        os.environ[MULTIPROC] = folder  # this process's metrics and the API processes' (they inherit it)
        try:
            _run(model, workers, (host, port, log_level, access_log), options)
        finally:
            os.environ.pop(MULTIPROC, None)


def _run(model: str, workers: int, http: tuple, options: dict) -> None:
    # (prometheus_client is imported once PROMETHEUS_MULTIPROC_DIR is set: it picks its mode at import)
    from prometheus_client.multiprocess import mark_process_dead

    state = make_state(model, **options | {"request_cache_mb": 0})  # (the API processes prepare the requests)
    state.start()
    key = secrets.token_bytes(32)
    # a Unix socket where there is one (no delayed ACKs on small messages, as TCP on loopback has)
    listener = Listener(family="AF_UNIX" if hasattr(socket, "AF_UNIX") else "AF_INET", authkey=key)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=api_process, args=(model, options, listener.address, key, *http),
                         name=f"trimvlm-serve-api-{i}") for i in range(workers)]  # fmt: skip
    try:
        for p in procs:
            p.start()
        for _ in procs:
            threading.Thread(target=bridge, args=(state, listener.accept()), daemon=True).start()
        print(f"trimvlm serve: {model} engine (pid {os.getpid()}) with {workers} API process(es) on "
              f"http://{http[0]}:{http[1]}", file=sys.stderr, flush=True)  # fmt: skip
        for p in procs:
            p.join()
            mark_process_dead(p.pid)
    except KeyboardInterrupt:
        pass
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(10)
        listener.close()
        state.close()


def api_process(model, options, address, key, host, port, log_level, access_log) -> None:
    """One API process: the app over a `RemoteScheduler`, on a port it shares with the others."""
    torch.set_num_threads(1)  # it prepares requests; the engine process runs the model
    state = make_state(model, **options | {"threads": 1}, remote=(address, key))
    sock = shared_port(host, port)
    configure(log_level, access_log)
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level=log_level, access_log=False,
                                           timeout_keep_alive=KEEP_ALIVE_S))
    state.batcher.on_lost = lambda: setattr(server, "should_exit", True)  # the engine has gone: stop too
    server.run(sockets=[sock])


def shared_port(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port that other processes may bind too (SO_REUSEPORT).

    Its protocol is named: asyncio turns Nagle's algorithm off (TCP_NODELAY) on the connections it accepts
    only for a socket that says it is TCP. With protocol 0 each streamed chunk after the first waits for the
    client's delayed ACK, about 40 ms a request."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock
