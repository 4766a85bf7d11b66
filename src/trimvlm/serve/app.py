"""The FastAPI app over one `ServerState`, and `serve`: load a model and run the app under uvicorn (this module
needs the `serve` extra; `trimvlm.serve.require()` says so in one line)."""

from __future__ import annotations

import logging
import os
import sys
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from trimvlm.errors import InputError
from trimvlm.serve import chat, require, systemone
from trimvlm.serve.errors import ApiError
from trimvlm.serve.jobs import ShuttingDown
from trimvlm.serve.limits import ServerLimits
from trimvlm.serve.logs import AccessLog, configure
from trimvlm.serve.state import ServerState

# how long an idle client connection stays open: longer than clients keep theirs (httpx and the openai client:
# 5 s). With uvicorn's default, also 5 s, a client could send a request on a connection as the server closed
# it, and the request failed with a connection reset before the server read it.
KEEP_ALIVE_S = 75

log = logging.getLogger("trimvlm.serve")


def _errors(app) -> None:
    """Every error as its answer: an ApiError its status, the server closing 503, a client gone during the
    upload 499, a bug of ours a 500 (never a dead server)."""

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ShuttingDown)
    async def _closing(_request: Request, e: ShuttingDown):  # queued after the server began to stop
        err = ApiError(503, str(e))
        return JSONResponse(err.body(), status_code=503)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, _e: ClientDisconnect):  # during the upload: one line, no traceback
        client = request.client
        log.warning(
            "%s %s: the client%s closed the connection during the upload", request.method, request.url.path,
            f" {client.host}:{client.port}" if client else "",
        )  # fmt: skip
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, e: Exception):  # a bug of ours: a 500, never a dead server
        log.exception("unexpected error")
        err = ApiError(500, f"internal error ({type(e).__name__}: {' '.join(str(e).split())[:300]})")
        return JSONResponse(err.body(), status_code=500)


def build_app(state: ServerState):
    """The routes (docs/serving.md), behind the access log. The scheduler's thread starts with the app and stops
    with it (after the running streams and the queued requests are answered: uvicorn closes the app once its
    open requests are done)."""

    @asynccontextmanager
    async def lifespan(app):
        state.start()
        yield
        state.close()

    app = FastAPI(title="trimvlm serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    _errors(app)

    @app.post("/v1/systemone")
    async def systemone_route(request: Request):
        return await systemone.handle(state, request)

    @app.post("/v1/chat/completions")
    async def chat_route(request: Request):
        return await chat.handle(state, request)

    @app.post("/v1/score")
    async def score_route(request: Request):
        from trimvlm.serve import score

        return await score.handle(state, request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": state.model_id, "object": "model", "created": int(state.started), "owned_by": "trimvlm",
            "family": state.vlm.family, "recipe": state.default_recipe or "baseline",
            "endpoints": ["/v1/systemone"] + ([] if state.vlm.adapter.decision_head
                                              else ["/v1/chat/completions", "/v1/score"]),
        }]}  # fmt: skip

    @app.get("/metrics")
    async def metrics():
        body, kind = state.metrics.exposition()
        if hasattr(state.batcher, "metrics"):  # an API process: the engine's figures with its own (serve/ipc.py)
            from trimvlm.serve.ipc import merged_metrics

            body = merged_metrics(body, state.batcher.metrics())
        return Response(body, media_type=kind)

    @app.get("/health")
    async def health():
        body = {
            "status": "ok" if state.batcher.alive else "unhealthy", "model": state.model_id, "pid": os.getpid(),
            "max_batch": state.batcher.max_batch, "max_wait_ms": state.batcher.max_wait_s * 1000,
        } | state.batcher.stats()  # fmt: skip
        return JSONResponse(body, status_code=200 if state.batcher.alive else 503)

    if state.api_key is not None:
        from trimvlm.serve.keys import ApiKey

        app = ApiKey(app, state.api_key, metrics=state.key_metrics)
    return AccessLog(app, state.metrics)


def make_state(
    model: str,
    *,
    recipe: str = "",
    max_batch: int = 32,
    max_wait_ms: float = 10.0,
    limits: ServerLimits | None = None,
    decision_config=None,
    threads: int = 1,
    load_kw: dict | None = None,
    vision_cache_mb: float = 256,
    prefix_cache_mb: float = 512,
    request_cache_mb: float = 256,
    recipe_dir=None,
    api_key: str | None = None,
    key_metrics: bool = False,
    tuned=None,
    slo_ttft_ms: float | None = None,
    remote: tuple | None = None,
) -> ServerState:
    """Load `model` and check the server's options and recipe: what one server (or one replica) serves."""
    require()
    import torch

    import trimvlm

    if not isinstance(max_batch, int) or max_batch < 1:
        raise InputError(f"--max-batch must be a positive integer, got {max_batch!r}")
    if not max_wait_ms >= 0:
        raise InputError(f"--max-wait-ms must be >= 0, got {max_wait_ms!r}")
    if threads:
        torch.set_num_threads(threads)
    vlm = trimvlm.load(model, **(load_kw or {}))
    if decision_config is not None:
        from trimvlm.decision.config import resolve_config

        decision_config = resolve_config(vlm, decision_config)
    state = ServerState(
        vlm, model_id=model, recipe=recipe, limits=limits, max_batch=max_batch, max_wait_ms=max_wait_ms,
        decision_config=decision_config, vision_cache_mb=vision_cache_mb, prefix_cache_mb=prefix_cache_mb,
        request_cache_mb=request_cache_mb, recipe_dir=recipe_dir, api_key=api_key, key_metrics=key_metrics,
        tuned=tuned, slo_ttft_ms=slo_ttft_ms, remote=remote,
    )  # fmt: skip
    systemone.request_model()  # transformers' request schema, importable before the server listens
    kind = "chat" if vlm.adapter.decision_head is None else "decide"
    try:  # the server's recipe, checked before it listens
        state.recipe(kind, None)
    except ApiError as e:
        raise InputError(f"--recipe: {e}") from e
    return state


def serve(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    access_log: bool = True,
    replicas: int = 1,
    ray: str | None = None,
    api_workers: int = 0,
    **options,
) -> None:
    """Load `model`, check the server's options and recipe, and serve until interrupted: in this process
    under uvicorn, with `api_workers` N > 0 as an engine process and N API processes (serve/workers.py), or with `ray` (an address: auto, local, HOST:PORT) as `replicas` Ray Serve replicas behind
    one HTTP route (serve/replicas.py). `options`: `make_state`'s."""
    require()
    import torch
    import uvicorn

    if not 0 <= port <= 65535:
        raise InputError(f"--port must be in 0..65535, got {port}")
    if not isinstance(api_workers, int) or api_workers < 0:
        raise InputError(f"--api-workers must be an integer >= 0 (0: one process), got {api_workers!r}")
    if api_workers and (ray is not None or replicas != 1):
        raise InputError("--api-workers and --replicas / --ray: choose one")
    if api_workers:
        from trimvlm.serve.workers import serve_workers

        serve_workers(model, workers=api_workers, host=host, port=port, log_level=log_level, access_log=access_log,
                      **options)  # fmt: skip
        return
    if ray is not None or replicas != 1:
        from trimvlm.serve.replicas import serve_replicas

        serve_replicas(model, replicas=replicas, ray_address=ray, host=host, port=port, log_level=log_level,
                       access_log=access_log, **options)  # fmt: skip
        return
    state = make_state(model, **options)
    limits, o = state.limits, options
    print(
        f"trimvlm serve: {model} ({state.vlm.family}) on http://{host}:{port}, recipe {state.default_recipe or 'baseline'}, "
        f"max batch {state.batcher.max_batch}, max wait {o.get('max_wait_ms', 10.0):g} ms, max prefill tokens "
        f"{limits.max_prefill_tokens}, {torch.get_num_threads()} torch thread(s), "
        f"{'an API key on /v1' + (' and /metrics' if state.key_metrics else '') if state.api_key else 'no API key'}",
        file=sys.stderr,
        flush=True,
    )
    configure(log_level, access_log)
    uvicorn.run(build_app(state), host=host, port=port, log_level=log_level, access_log=False,
                timeout_keep_alive=KEEP_ALIVE_S)
