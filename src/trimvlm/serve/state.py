"""What the endpoints share, in parts by concern: the model (`vlm`, `model_id`), the scheduler (`batcher`: the
model loop here, or the engine process's over a connection, serve/ipc.py) and the preparation thread, the
limits, the recipes (serve/recipes.py), the request cache and the System One bodies seen (serve/systemone.py),
who may ask (`access`), the metrics.

Preparation (decoding images, rendering and tokenizing prompts) runs on one thread of its own, beside the model
thread: the event loop never blocks on it, and the two CPU halves of serving overlap.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from trimvlm.runtime.lru import ByteLRU
from trimvlm.scoring.executors import plan_cache
from trimvlm.serve import score, systemone
from trimvlm.serve.engine import ChatEngine
from trimvlm.serve.errors import ApiError, check, schema_error
from trimvlm.serve.ipc import RemoteScheduler
from trimvlm.serve.jobs import ShuttingDown
from trimvlm.serve.keys import Access
from trimvlm.serve.limits import Batching, CacheSizes, ServerLimits
from trimvlm.serve.metrics import ServeMetrics
from trimvlm.serve.recipes import Recipe, RecipeOptions, Recipes
from trimvlm.serve.scheduler import Scheduler

CACHE_STATS = ("hits", "misses", "bytes", "max_bytes", "entries", "evictions")


class ServerState:
    """One server's state. `remote`: the engine process's (address, key) when this is an API process
    (serve/workers.py): its scheduler is the engine's over the connection, and the engine records the model's
    figures."""

    def __init__(self, vlm, *, model_id: str, limits: ServerLimits | None = None, batching: Batching = Batching(),
                 caches: CacheSizes = CacheSizes(), recipes: RecipeOptions = RecipeOptions(),
                 access: Access = Access(), decision_config=None, remote: tuple | None = None):  # fmt: skip
        self.vlm, self.model_id, self.started = vlm, model_id, time.time()
        self.limits, self.access, self.decision_config = limits or ServerLimits(), access, decision_config
        self.remote = remote is not None
        vlm.use_caches(vision_bytes=caches.bytes("vision"), prefix_bytes=caches.bytes("prefix"))
        requests = caches.bytes("request")  # System One bodies and chat requests, prepared
        self.request_cache = None if requests is None else ByteLRU(requests, "request cache")
        self.metrics = ServeMetrics(None if self.remote else lambda: self.batcher.stats())
        self.recipes = Recipes(vlm.runner, recipes)
        self.load = self.recipes.load  # the load-following ladder (serve/budgets.py), or None
        self.recipes_run = self.metrics.counter(
            "trimvlm_chat_requests_by_recipe", "chat completions admitted, by the recipe they run", ("recipe",)
        )
        wait_s = batching.max_wait_ms / 1000
        if self.remote:
            self.batcher = RemoteScheduler(*remote, max_batch=batching.max_batch, max_wait_s=wait_s)
        else:
            self.batcher = Scheduler(
                self._run_batch, ChatEngine(vlm, self.metrics, self.load), max_batch=batching.max_batch,
                max_wait_s=wait_s, max_prefill_tokens=self.limits.max_prefill_tokens,
            )  # fmt: skip
        self._prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trimvlm-serve-prepare")
        self.seen_bodies = systemone.SeenBodies(self.request_cache, self.metrics)
        self._figures()

    def _figures(self) -> None:
        """The caches' figures on /metrics, read at each scrape (the model's caches and the tree executor's
        layouts where the model runs)."""
        for cache in ("request",) if self.remote else ("vision", "prefix", "request"):
            for stat in CACHE_STATS:
                self.metrics.gauge(
                    f"trimvlm_{cache}_cache_{stat}", f"the {cache} cache: {stat} (0 when it is off)",
                    fn=lambda c=cache, s=stat: (self.cache_stats()[c] or {}).get(s, 0),
                )  # fmt: skip
        for stat in () if self.remote else ("entries", "hits", "misses"):
            self.metrics.gauge(
                f"trimvlm_plan_cache_{stat}", f"the tree executor's layout cache: {stat} (this process)",
                fn=lambda s=stat: plan_cache.stats()[s],
            )  # fmt: skip

    def cache_stats(self) -> dict:
        """The vision, prefix and request caches' figures (None: off)."""
        return self.vlm.cache_stats() | {"request": None if self.request_cache is None else self.request_cache.stats()}

    def start(self) -> None:
        self.batcher.start()

    def _run_batch(self, key, payloads: list) -> list:
        """On the model thread: one batch of System One or score requests with the same key (chat completions
        are the scheduler's engine's, step by step)."""
        return {"score": score.run, "decide": systemone.run}[key.kind](self, key, payloads)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the model thread (`Scheduler.close`) and the preparation thread."""
        self.batcher.close(timeout)
        self._prep.shutdown(wait=False, cancel_futures=True)

    def exposition(self) -> tuple[bytes, str]:
        """/metrics: the text format and its content type (an API process has the engine write its figures
        first)."""
        if self.remote:
            self.batcher.ask("refresh")
        return self.metrics.exposition()

    async def prepare(self, fn, *args):
        """`fn(*args)` on the preparation thread (503 once the server is shutting down; a trimvlm error
        it raises is answered as its HTTP error: app.py)."""
        if self.batcher.closed:
            raise ShuttingDown("the server is shutting down")
        return await asyncio.get_running_loop().run_in_executor(self._prep, fn, *args)

    def rung(self) -> Recipe:
        """The recipe of a chat request that names none on a load-following server (serve/budgets.py): the
        ladder's rung for the queue now (an API process asks the engine, which counts the request and chooses)."""
        return self.recipes.get("chat", self.batcher.ask("load") if self.remote else self.load_rung(), own=True)

    def load_rung(self) -> str:
        """A load-following request has come (counted): the text of the ladder's rung that fits the queue and the
        arrival rate now."""
        self.load.arrived()
        return self.load.choose(self.batcher.waiting(), self.load.rate()).text

    def need_lm_head(self) -> None:
        """400 for a chat or score request to a server holding a decision model."""
        check(self.vlm.adapter.decision_head is None,
              "this server holds a decision model (no LM head): ask it System One requests at /v1/systemone")

    def model_name(self, body: dict) -> str:
        """The `model` a request names (it may name none): this server answers for its model only (400 else)."""
        name = body.get("model")
        if name is None:
            return self.model_id
        if not isinstance(name, str):
            raise schema_error(f"`model` is a string, got {type(name).__name__}", "model", kind="string_type")
        check(name in {self.model_id, Path(self.model_id).name},
              f"this server answers for {self.model_id!r}; the request asks for {name!r}")
        return name

    async def read_body(self, request) -> bytes:
        """The request body's bytes: 413 past `max_body_bytes` (by its Content-Length or as it is read)."""
        limit, length = self.limits.max_body_bytes, request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise ApiError(413, f"the request body is {int(length)} bytes, at most {limit}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            check(size <= limit, f"the request body is over {limit} bytes", 413)
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
