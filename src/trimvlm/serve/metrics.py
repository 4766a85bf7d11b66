"""`GET /metrics`: the server's figures in Prometheus' text format (prometheus_client), one registry per server
(docs/serving.md, "Operations"). Other parts of the server add their own with `counter`, `gauge` and
`histogram`. Across processes (`--api-workers`: PROMETHEUS_MULTIPROC_DIR set by serve/workers.py) the figures
are prometheus_client's multiprocess ones. The gauges that read a function are written at each scrape (`refresh`).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import deque
from collections.abc import Callable

TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
RATE_WINDOW_S = 10.0
SCHEDULER_GAUGES = (  # (name, the scheduler's figure, doc)
    ("trimvlm_queue_depth", "waiting", "requests waiting to be admitted"),
    ("trimvlm_running_requests", "running", "chat completions decoding"),
    ("trimvlm_dropped_requests", "dropped", "queued requests whose client left: never computed"),
    ("trimvlm_model_thread_cpu_seconds", "model_cpu_s", "CPU seconds the model loop's thread has used: with --threads "
     "1 all of the model's work (prefills, decode steps, the methods), without HTTP, JSON or image decoding; "
     "torch's own worker threads, with more, are not in it"),
    ("trimvlm_failed_batches", "failed_batches", "model calls that raised"),
)  # fmt: skip
PATHS = {"/v1/systemone", "/v1/chat/completions", "/v1/score", "/v1/models", "/health", "/metrics"}


class ServeMetrics:
    def __init__(self, stats: Callable[[], dict] | None = None):
        """`stats()`: the scheduler's figures now (`waiting`, `running`, `failed_batches`), read at each scrape
        (None: the scheduler runs in another process, which records its figures and these gauges)."""
        from prometheus_client import CollectorRegistry  # (here: it picks its multiprocess mode at import)

        self.registry = CollectorRegistry()
        self.shared = "PROMETHEUS_MULTIPROC_DIR" in os.environ  # prometheus_client's multiprocess mode
        self._live: list[tuple[object, Callable[[], float]]] = []  # (gauge, fn) written at each scrape
        self._recent: deque[tuple[float, int]] = deque()  # (when, tokens) of the last RATE_WINDOW_S
        self._lock = threading.Lock()
        c, h = self.counter, self.histogram
        self.requests = c(
            "trimvlm_requests", "HTTP requests answered, by path and status", ("path", "status")
        )
        self.latency = h(
            "trimvlm_request_seconds", "HTTP request latency (body read to answer sent)", ("path",)
        )
        self.ttft = h("trimvlm_time_to_first_token_seconds", "chat: request received to its first token")
        self.itl = h("trimvlm_inter_token_seconds", "chat: time between a request's consecutive tokens")
        self.tokens = c("trimvlm_generated_tokens", "tokens generated (chat completions)")
        self.prompt = c("trimvlm_prompt_tokens", "prompt tokens prefilled (chat completions)")
        self.decode_batch = h("trimvlm_decode_batch_size", "rows per decode step", buckets=SIZE_BUCKETS)
        self.prefill_batch = h("trimvlm_prefill_batch_size", "requests per prefill", buckets=SIZE_BUCKETS)
        self.step_s = h("trimvlm_decode_step_seconds", "one decode step of a running batch")
        self.cancels = c(
            "trimvlm_cancelled_requests",
            "requests whose client left, by where they were: queued (never computed), running (left the batch "
            "at the next step), finished (already computed)",
            ("stage",),
        )
        if stats is not None:  # the model loop's figures, read at each scrape
            self.gauge("trimvlm_tokens_per_second", f"tokens generated per second over the last {RATE_WINDOW_S:g} s",
                       fn=self.rate)  # fmt: skip
            for name, stat, doc in SCHEDULER_GAUGES:
                self.gauge(name, doc, fn=lambda s=stat: stats().get(s, 0))

    # ---- registering figures ----
    def _metric(self, kind: str, name: str, doc: str, labels=(), **kw):
        import prometheus_client

        return getattr(prometheus_client, kind)(name, doc, list(labels), registry=self.registry, **kw)

    counter = functools.partialmethod(_metric, "Counter")  # (name, doc, labels=())
    histogram = functools.partialmethod(_metric, "Histogram", buckets=TIME_BUCKETS)  # (..., buckets=)

    def gauge(self, name: str, doc: str, labels=(), fn: Callable[[], float] | None = None):
        """A gauge; with `fn` (and no labels) its value is `fn()` at each scrape (summed over the live processes
        in multiprocess mode)."""
        made = self._metric("Gauge", name, doc, labels, multiprocess_mode="livesum")
        if fn is not None:
            self._live.append((made, fn))
        return made

    # ---- what the server records ----
    def request(self, path: str, status: int, seconds: float) -> None:
        path = path if path in PATHS else "other"
        self.requests.labels(path=path, status=str(status)).inc()
        self.latency.labels(path=path).observe(seconds)

    def prefill(self, rows: int, prompt_tokens: int) -> None:
        self.prefill_batch.observe(rows)
        self.prompt.inc(prompt_tokens)
        self._generated(rows)  # each row's first token

    def decode_step(self, rows: int, seconds: float) -> None:
        self.decode_batch.observe(rows)
        self.step_s.observe(seconds)
        self._generated(rows)

    def _generated(self, n: int) -> None:
        self.tokens.inc(n)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, n))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def refresh(self) -> None:
        """Write the gauges that read a function (in multiprocess mode the folder holds their values)."""
        for made, fn in self._live:
            made.set(fn())

    def exposition(self) -> tuple[bytes, str]:
        """The text format and its content type: this registry's, or (multiprocess mode) every process's."""
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector

        self.refresh()
        if not self.shared:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
