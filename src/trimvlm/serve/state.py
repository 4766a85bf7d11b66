"""What the endpoints share: the model, the scheduler, the preparation thread, the limits, the recipes, the
metrics.

Preparation (decoding images, rendering and tokenizing prompts) runs on one thread of its own, beside the model
thread: the event loop never blocks on it, and the two CPU halves of serving overlap.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from trimvlm.errors import InputError, RecipeError, TrimVLMError
from trimvlm.scoring.executors import plan_cache
from trimvlm.serve.engine import ChatEngine
from trimvlm.serve.errors import ApiError, as_api_error, from_trimvlm, schema_error
from trimvlm.serve.jobs import ShuttingDown
from trimvlm.serve.limits import MiB, ServerLimits
from trimvlm.serve.metrics import ServeMetrics
from trimvlm.serve.scheduler import Scheduler


@dataclass
class Recipe:
    """A recipe a request may run with: `label` (the batching key), the parsed recipe, and the plan built when it
    was checked (its `resolution` is what the request is prepared at: tokens=downsample)."""

    label: str
    recipe: object
    plan: object = None


def reads_files(recipe) -> bool:
    """Whether a recipe names server-side files (a router checkpoint, a layer ranking): a remote request's may
    not (the server would read any path it is sent)."""
    from trimvlm.recipe import AXES

    specs = [getattr(recipe, a) for a in AXES if getattr(recipe, a) is not None]
    return recipe.router is not None or any("file" in spec.options for spec in specs)


def client_recipe(text: str, recipe_dir: Path | None):
    """A client's recipe text as `parse_recipe` may read it, or a 400 before anything is read: a recipe file
    (.yaml / .json) is refused, and `tuned=NAME` only names a tuned folder inside the server's `--recipe-dir`
    (a relative name; a path leaving the folder is refused). (The text to parse, whether it names the
    operator's folder.)"""
    from trimvlm.recipe import AXES

    stripped = text.strip()
    if stripped.startswith("tuned="):
        name, sep, options = stripped.removeprefix("tuned=").partition(":")
        if recipe_dir is None:
            raise ApiError(400, "recipe: tuned= names a folder on the server; this server takes no client tuned "
                                "recipes (its operator may allow some with --recipe-dir)")  # fmt: skip
        parts = Path(name).parts
        if not name or Path(name).is_absolute() or ".." in parts or "\\" in name:
            raise ApiError(400, f"recipe: tuned={name!r} is not a folder name inside the server's recipe folder "
                                "(a relative name, no '..')")  # fmt: skip
        root = recipe_dir.resolve()
        folder = (root / name).resolve()
        if not folder.is_relative_to(root) or folder == root:
            raise ApiError(400, f"recipe: tuned={name!r} is not a folder inside the server's recipe folder")
        return f"tuned={folder}{sep}{options}", True
    if stripped.endswith((".yaml", ".yml", ".json")) and not any(stripped.startswith(f"{a}=") for a in AXES):
        raise ApiError(400, "recipe: a recipe file names a path on the server; send the recipe itself "
                            "(axis=method:option=value,...)")  # fmt: skip
    return text, False


CACHE_STATS = ("hits", "misses", "bytes", "max_bytes", "entries", "evictions")


def cache_bytes(mb, flag: str) -> int | None:
    """A cache's bound in bytes from MiB (0: the cache is off)."""
    if isinstance(mb, bool) or not isinstance(mb, int | float) or not mb >= 0:
        raise InputError(f"{flag} must be a number of MiB >= 0 (0: off), got {mb!r}")
    return int(mb * MiB) or None


class ServerState:
    def __init__(
        self,
        vlm,
        *,
        model_id: str,
        recipe: str | None = None,
        limits: ServerLimits | None = None,
        max_batch: int = 32,
        max_wait_ms: float = 10.0,
        decision_config=None,
        vision_cache_mb: float = 256,
        prefix_cache_mb: float = 512,
        request_cache_mb: float = 256,
        recipe_dir: str | Path | None = None,
        api_key: str | None = None,
        key_metrics: bool = False,
        tuned: str | Path | None = None,
        slo_ttft_ms: float | None = None,
        remote: tuple | None = None,
    ):
        from trimvlm.runtime.lru import ByteLRU

        if recipe_dir is not None and not Path(recipe_dir).is_dir():
            raise InputError(f"--recipe-dir {recipe_dir}: not a folder")
        self.recipe_dir = None if recipe_dir is None else Path(recipe_dir)
        if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
            raise InputError("--api-key must be a non-empty string")
        if key_metrics and api_key is None:
            raise InputError("--key-metrics needs --api-key (or TRIMVLM_API_KEY)")
        self.api_key, self.key_metrics = api_key, key_metrics  # (never logged)

        self.vlm = vlm
        vlm.use_caches(vision_bytes=cache_bytes(vision_cache_mb, "--vision-cache-mb"),
                       prefix_bytes=cache_bytes(prefix_cache_mb, "--prefix-cache-mb"))  # fmt: skip
        requests = cache_bytes(request_cache_mb, "--request-cache-mb")  # System One bodies, prepared
        self.request_cache = None if requests is None else ByteLRU(requests, "request cache")
        self.model_id = model_id
        self.limits = limits or ServerLimits()
        self.default_recipe = recipe or ""
        self.decision_config = decision_config
        self.started = time.time()
        # an API process (`remote`: the engine process's address and key, serve/ipc.py) asks the engine for the
        # scheduler's figures; its /metrics takes them from the engine's own
        self.metrics = ServeMetrics(dict if remote else lambda: self.batcher.stats())
        if (tuned is None) != (slo_ttft_ms is None):
            raise InputError("--tuned DIR and --slo-ttft-ms T go together (budgets that follow the load)")
        self.load = None  # serve/budgets.py: the recipe of a request that names none, by the predicted TTFT
        if tuned is not None:
            from trimvlm.serve.budgets import LoadBudget, ladder

            self.load = LoadBudget(ladder(tuned), slo_ttft_ms / 1000)
        self.recipes_run = self.metrics.counter(
            "trimvlm_chat_requests_by_recipe", "chat completions admitted, by the recipe they run", ("recipe",)
        )
        if remote is not None:
            from trimvlm.serve.ipc import RemoteScheduler

            self.batcher = RemoteScheduler(*remote, max_batch=max_batch, max_wait_s=max_wait_ms / 1000)
        else:
            self.batcher = Scheduler(
                self._run_batch, ChatEngine(vlm, self.metrics, self.load), max_batch=max_batch,
                max_wait_s=max_wait_ms / 1000, max_prefill_tokens=self.limits.max_prefill_tokens,
            )  # fmt: skip
        self._prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trimvlm-serve-prepare")
        self._recipes: dict[tuple[str, str, bool], Recipe] = {}
        for rung in [] if self.load is None else self.load.rungs:  # each checked before the server listens
            try:
                self.recipe("chat", rung.text, own=True)
            except ApiError as e:
                raise InputError(f"--tuned: {e}") from e
        self.seen_bodies: OrderedDict[bytes, object] = OrderedDict()  # System One bodies answered (systemone.Seen)
        self._figures()

    def _figures(self) -> None:
        """The caches' and System One bodies' figures on /metrics, read at each scrape."""
        for cache in ("vision", "prefix", "request"):
            for stat in CACHE_STATS:
                self.metrics.gauge(
                    f"trimvlm_{cache}_cache_{stat}", f"the {cache} cache: {stat} (0 when it is off)",
                    fn=lambda c=cache, s=stat: (self.cache_stats()[c] or {}).get(s, 0),
                )  # fmt: skip
        self.seen_hits = self.metrics.counter(
            "trimvlm_seen_body_hits", "System One bodies answered from their digest (not parsed or prepared again)"
        )
        self.metrics.gauge(
            "trimvlm_seen_bodies", "System One bodies remembered by their digest (bounded by entries)",
            fn=lambda: len(self.seen_bodies),
        )  # fmt: skip
        for stat in ("entries", "hits", "misses"):
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
        from trimvlm.serve import score, systemone  # (they import this module's names)

        if key[0] == "score":
            return score.run(self, key, payloads)
        return systemone.run(self, key, payloads)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the model thread: what is queued and running is answered (drained) for up to `timeout`, then
        answered 503 (`Scheduler.close`)."""
        self.batcher.close(timeout)
        self._prep.shutdown(wait=False, cancel_futures=True)

    async def prepare(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` on the preparation thread; a trimvlm error becomes its HTTP error (503 once the
        server is shutting down)."""
        if self.batcher.closed:
            raise ShuttingDown("the server is shutting down")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._prep, lambda: fn(*args, **kwargs))
        except TrimVLMError as e:
            raise from_trimvlm(e) from e

    async def result(self, job):
        """A queued job's result (`Batcher.result`: cancelled with the awaiting task). A trimvlm error raised by
        the batch is the request's 400; any other, the model's failure: 500."""
        try:
            return await self.batcher.result(job)
        except Exception as e:  # noqa: BLE001
            raise as_api_error(e) from e

    def rung(self) -> Recipe:
        """The recipe of a chat request that names none on a load-following server (serve/budgets.py): the
        ladder's rung for the queue now (an API process asks the engine for its queue and measurements)."""
        if hasattr(self.batcher, "ask"):  # an API process (serve/ipc.py): the engine counts the arrival
            figures = self.batcher.ask("load")
            self.load.adopt(figures)
            waiting, rate = figures["waiting"], figures["rate"]
        else:
            self.load.arrived()
            waiting, rate = self.batcher.waiting(), self.load.rate()
        return self.recipe("chat", self.load.choose(waiting, rate).text, own=True)

    def recipe(self, kind: str, value, *, own: bool = False) -> Recipe:
        """The recipe of a request (`kind`: "decide", "chat" or "score"): its `recipe` field, else the server's.
        Checked once per distinct text (a bad one: 400, before the request is tokenized). `own`: a recipe of the
        operator's (the load-following ladder), which may read the server's files."""
        if value is None:
            value = self.default_recipe
        if not isinstance(value, str):
            raise schema_error(
                f"`recipe` is a recipe string, got {type(value).__name__}", "recipe", kind="string_type"
            )
        key = (kind, value, own)
        if key not in self._recipes:
            from trimvlm.plan import decision_plan, make_plan
            from trimvlm.recipe import parse_recipe

            own = own or value == self.default_recipe
            text, operators = (value, True) if own else client_recipe(value, self.recipe_dir)
            try:
                parsed = parse_recipe(text)
                if not operators and reads_files(parsed):
                    raise ApiError(
                        400,
                        f"recipe {value!r} reads files on the server (router=, file=): only the server's own "
                        "--recipe may; start the server with it",
                    )
                plan = (decision_plan if kind == "decide" else make_plan)(parsed, self.vlm.runner)
            except RecipeError as e:
                if not own and self.recipe_dir is not None:  # never the server's paths in a client's answer
                    raise ApiError(400, f"recipe {value!r}: {_hide(str(e), self.recipe_dir)}") from e
                raise ApiError(400, f"recipe {value!r}: {' '.join(str(e).split())}") from e
            except TrimVLMError as e:
                raise from_trimvlm(e) from e
            if len(self._recipes) > 256:  # a bounded memo of texts seen
                self._recipes.clear()
            self._recipes[key] = Recipe(label=parsed.label(), recipe=parsed, plan=plan)
        return self._recipes[key]

    def model_name(self, body: dict) -> str:
        """The `model` a request names (it may name none): this server answers for its model only (400 else)."""
        name = body.get("model")
        if name is None:
            return self.model_id
        if not isinstance(name, str):
            raise schema_error(f"`model` is a string, got {type(name).__name__}", "model", kind="string_type")
        if name not in self.aliases:
            raise ApiError(400, f"this server answers for {self.model_id!r}; the request asks for {name!r}")
        return name

    @property
    def aliases(self) -> set[str]:
        return {self.model_id, Path(self.model_id).name}

    async def read_json(self, request) -> dict:
        """The request body as a JSON object: 413 past `max_body_bytes` (by its Content-Length or as it is read),
        422 for text that is not a JSON object."""
        return parse_json(await self.read_body(request))

    async def read_body(self, request) -> bytes:
        """The request body's bytes: 413 past `max_body_bytes` (by its Content-Length or as it is read)."""
        limit = self.limits.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise ApiError(413, f"the request body is {int(length)} bytes, at most {limit}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is over {limit} bytes")
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _hide(message: str, folder: Path) -> str:
    """An error's text with the server's recipe folder written as `--recipe-dir`."""
    return " ".join(message.replace(str(folder.resolve()), "<--recipe-dir>").split())


def parse_json(raw: bytes) -> dict:
    """A request body as a JSON object (422 for text that is not one)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise schema_error(f"JSON decode error: {e}", kind="json_invalid") from e
    if not isinstance(body, dict):
        raise schema_error(f"the body is a JSON object, got a {type(body).__name__}", kind="dict_type")
    return body
