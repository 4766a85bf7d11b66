"""The FastAPI app over one `ServerState` (`build_app`), and the state of one server loaded from `trimvlm serve`'s
options (`make_state`). This module needs the `serve` extra (`trimvlm.serve.require()` says so in one line);
serve/main.py runs the app."""

from __future__ import annotations

import logging
import os
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

import trimvlm
from trimvlm.decision.config import resolve_config
from trimvlm.errors import InputError, TrimVLMError
from trimvlm.serve import chat, require, score, systemone
from trimvlm.serve.errors import ApiError, as_api_error
from trimvlm.serve.jobs import ShuttingDown
from trimvlm.serve.keys import Access, ApiKey
from trimvlm.serve.limits import Batching, CacheSizes, ServerLimits
from trimvlm.serve.logs import AccessLog
from trimvlm.serve.recipes import RecipeOptions
from trimvlm.serve.reply import ClientGone
from trimvlm.serve.state import ServerState

# how long an idle client connection stays open: longer than clients keep theirs (httpx and the openai client:
# 5 s). With uvicorn's default, also 5 s, a client could send a request on a connection as the server closed
# it, and the request failed with a connection reset before the server read it.
KEEP_ALIVE_S = 75

log = logging.getLogger("trimvlm.serve")


def _errors(app) -> None:
    """Every error as its answer: an ApiError its status, a trimvlm error 400 / 422, the server closing 503, a client gone during the
    upload 499 (gone later: 499, sent to nobody), a bug of ours a 500 (never a dead server)."""

    async def answer(_request: Request, e: Exception):
        err = as_api_error(e)
        return JSONResponse(err.body(), status_code=err.status)

    async def gone(_request: Request, _e: ClientGone):
        return Response(status_code=499)  # nobody reads it (uvicorn sends nothing to a closed connection)

    for error in (ApiError, TrimVLMError, ShuttingDown):  # (a trimvlm error raised reading a request: 400 / 422)
        app.add_exception_handler(error, answer)
    app.add_exception_handler(ClientGone, gone)

    @app.exception_handler(ClientDisconnect)
    async def _upload(request: Request, _e: ClientDisconnect):  # during the upload: one line, no traceback
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

    def endpoint(handle):
        async def route(request: Request):
            with state.batcher.arrival() as arrival:  # the model thread waits for it while it is prepared
                return await handle(state, request, arrival)

        return route

    for path, module in (("/v1/systemone", systemone), ("/v1/chat/completions", chat), ("/v1/score", score)):
        app.add_api_route(path, endpoint(module.handle), methods=["POST"])

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": state.model_id, "object": "model", "created": int(state.started), "owned_by": "trimvlm",
            "family": state.vlm.family, "recipe": state.recipes.default or "baseline",
            "endpoints": ["/v1/systemone"] + ([] if state.vlm.adapter.decision_head
                                              else ["/v1/chat/completions", "/v1/score"]),
        }]}  # fmt: skip

    @app.get("/metrics")
    async def metrics():
        body, kind = state.exposition()
        return Response(body, media_type=kind)

    @app.get("/health")
    async def health():
        body = {
            "status": "ok" if state.batcher.alive else "unhealthy", "model": state.model_id, "pid": os.getpid(),
            "max_batch": state.batcher.max_batch, "max_wait_ms": state.batcher.max_wait_s * 1000,
        } | state.batcher.stats()  # fmt: skip
        return JSONResponse(body, status_code=200 if state.batcher.alive else 503)

    if state.access.api_key is not None:
        app = ApiKey(app, state.access.api_key, metrics=state.access.key_metrics)
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
    """Load `model` and check the server's options (`trimvlm serve`'s) and recipe: what one server (or one
    replica, or one API process: `remote`) serves."""
    require()
    parts = {"batching": Batching(max_batch, max_wait_ms), "limits": limits,
             "caches": CacheSizes(vision_cache_mb, prefix_cache_mb, request_cache_mb),
             "recipes": RecipeOptions(recipe, recipe_dir, tuned, slo_ttft_ms), "access": Access(api_key, key_metrics)}  # fmt: skip
    if threads:
        torch.set_num_threads(threads)
    vlm = trimvlm.load(model, **(load_kw or {}))
    if decision_config is not None:
        decision_config = resolve_config(vlm, decision_config)
    state = ServerState(vlm, model_id=model, decision_config=decision_config, remote=remote, **parts)
    systemone.request_model()  # transformers' request schema, importable before the server listens
    kind = "chat" if vlm.adapter.decision_head is None else "decide"
    try:  # the server's recipe, checked before it listens
        state.recipes.get(kind, None)
    except ApiError as e:
        raise InputError(f"--recipe: {e}") from e
    return state
