"""The one loop that owns the model (docs/serving.md, "Scheduling"): continuous batching for chat completions
(the step-level `engine`, serve/engine.py, for the endpoints in `engine.kinds`), whole batches for the others
(`run(key, payloads)`: one result or exception per payload; a batch that raises runs each request again alone).

Requests are queued checked and prepared, under a key: only requests with equal keys share a batch. A request
still being read is announced (`arrival()`): with nothing running the loop waits for it, up to `max_wait_s` after
the first of a batch arrived. Each turn: take what has arrived (dropping the requests whose client has gone),
run the next chunk of a chunked prefill, let the oldest waiting request decide what runs (its whole batch, or
the chat requests of its key admitted while there is room and prefill budget, `max_prefill_tokens`), then one
decode step of every running batch. `close` drains what is queued and running, then answers the rest 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable
from typing import Any

from trimvlm.serve.jobs import Job, ShuttingDown, call_soon, settle

POLL_S = 0.002  # how often a waiting worker looks again whether more requests are on their way


class Scheduler:
    def __init__(
        self,
        run: Callable[[Hashable, list], list],
        engine=None,
        *,
        max_batch: int = 32,
        max_wait_s: float = 0.01,
        max_prefill_tokens: int = 4096,
    ):
        self.engine = engine  # the step-level engine (serve/engine.py) of the keys whose endpoint is in its kinds
        self.max_prefill_tokens = max_prefill_tokens
        self.run = run
        self.max_batch = max_batch
        self.max_wait_s = max(0.0, max_wait_s)
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._pending: deque[Job] = deque()  # taken from the queue, waiting for a batch of their key
        self._closing = False  # the worker has seen the end of the queue: it drains what is there, then stops
        self.closed = False  # close() was called: nothing more is queued
        self._abort = False  # the drain took too long: the worker answers what is left "shutting down" and stops
        self._thread = threading.Thread(target=self._loop, name="trimvlm-serve-model", daemon=True)
        self._arriving = 0  # requests on their way (`arrival()`); written by the event loop, read by the worker
        self.sizes: Counter[int] = Counter()  # batch size -> batches run
        self.failed_batches = 0
        self.dropped = 0  # requests whose client left before they ran: never computed
        self.cpu_s = 0.0  # CPU seconds of the model thread (time.thread_time there, after its last turn)

    # ---- the event loop's side ----
    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop: the requests queued and running are answered (drained) for up to `timeout`; past it, the worker
        answers every request still waiting or running with `ShuttingDown` at its next turn and stops."""
        self.closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._abort = True
            self._thread.join(timeout)
        if not self._thread.is_alive():  # (queued after the worker's last look)
            self._fail_waiting()

    def _fail_waiting(self) -> None:
        """Answer every request still waiting `ShuttingDown` (never computed)."""
        left = [*self._pending, *self._drained()]
        self._pending.clear()
        for job in filter(None, left):
            settle(job, ShuttingDown("the server is shutting down"))

    def _drained(self) -> list:
        """What is in the queue now (None: its end), taken out (by its one reader: the worker, or `close` after it)."""
        return [self._queue.get_nowait() for _ in range(self._queue.qsize())]

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def waiting(self) -> int:
        return self._queue.qsize() + len(self._pending)

    def arrival(self) -> contextlib.ExitStack:
        """Say a request is coming (being read, checked, tokenized; use as a context manager around it): the loop
        waits for it until it is queued or fails (the first exit: an exit stack calls its callback once)."""
        self.arriving(1)
        arrival = contextlib.ExitStack()
        arrival.callback(self.arriving, -1)
        return arrival

    def enqueue(self, key: Hashable, payload, arrival: contextlib.ExitStack | None = None) -> Job:
        """Queue one request (from the event loop); its job, whose future holds its result. `ShuttingDown` once
        the server is closing."""
        with arrival or contextlib.nullcontext():
            if self.closed:
                raise ShuttingDown("the server is shutting down")
            loop = asyncio.get_running_loop()
            job = Job(key=key, payload=payload, future=loop.create_future(), loop=loop)
            self._queue.put(job)
        return job

    def arriving(self, delta: int) -> None:
        """Requests on their way from elsewhere (an API process's `arrival()`): +1 when one begins, -1 after."""
        self._arriving += delta

    async def submit(self, key: Hashable, payload, arrival: contextlib.ExitStack | None = None) -> tuple[Any, Job]:
        """Queue one request; (its result as `result` gives it, its job: times and batch size)."""
        job = self.enqueue(key, payload, arrival)
        return await self.result(job), job

    @staticmethod
    async def result(job: Job):
        """A queued job's result (an exception of its batch is raised). If the awaiting task is cancelled, the
        job is too (it will not run if it has not started)."""
        try:
            return await job.future
        except asyncio.CancelledError:
            job.cancel()
            raise

    def stats(self) -> dict:
        n = sum(self.sizes.values())
        served = sum(k * v for k, v in self.sizes.items())
        return {
            "batches": n, "requests": served, "mean_batch": served / n if n else 0.0,
            "largest_batch": max(self.sizes, default=0), "failed_batches": self.failed_batches,
            "waiting": self.waiting(), "dropped": self.dropped, "model_cpu_s": self.cpu_s,
        } | ({} if self.engine is None else self.engine.stats()) | {"max_prefill_tokens": self.max_prefill_tokens}  # fmt: skip

    # ---- the worker thread ----
    def _collect(self, first: Job, *, room: int | None = None, wait: bool = True, weight=None,
                 budget: int = 0) -> list[Job]:  # fmt: skip
        """`first` and the waiting jobs of its key, up to `room` (default max_batch) and, with `weight(job)`, up
        to `budget` in all (`first` always goes); `wait`: wait for more up to max_wait after `first` arrived.
        Jobs whose client has gone are dropped."""
        room = self.max_batch if room is None else room
        weight = weight or (lambda job: 0)
        batch, used = [first], weight(first)

        def take(job) -> bool:
            """Whether `job` joins the batch: of `first`'s key (another endpoint's may have no weight), in budget."""
            nonlocal used
            if job.key != first.key or used + weight(job) > budget:
                return False
            batch.append(job)
            used += weight(job)
            return True

        for job in [j for j in self._pending if j.key == first.key]:
            if len(batch) >= room or not take(job):
                break
            self._pending.remove(job)
        deadline = first.enqueued + (self.max_wait_s if wait else 0.0)
        while len(batch) < room and not self._closing:
            left = deadline - time.perf_counter()
            try:
                if left <= 0 or (self._arriving == 0 and self._queue.empty()):
                    job = self._queue.get_nowait()  # what is there; nothing more is on its way
                else:
                    job = self._queue.get(timeout=min(left, POLL_S))
            except queue.Empty:
                if left <= 0 or self._arriving == 0:
                    break
                continue
            if job is None:
                self._closing = True
            elif not take(job):
                self._pending.append(job)
                if job.key == first.key:
                    break  # the budget is spent
        return self._live(batch)

    def _live(self, jobs: list[Job]) -> list[Job]:
        """The jobs whose client is still there; the others are settled and counted, never run."""
        live = [j for j in jobs if not (j.cancelled or j.future.cancelled())]
        for job in jobs:
            if job not in live:
                self.dropped += 1
                call_soon(job.loop, job.future.cancel)  # nobody awaits it any more
        return live

    def _running(self) -> int:
        return 0 if self.engine is None else self.engine.running

    def _take(self) -> None:
        """Move what has arrived to the waiting list; block for one request when nothing else is to do."""
        first = [self._queue.get()] if not self._pending and not self._running() and not self._closing else []
        for job in first + self._drained():
            if job is None:
                self._closing = True
            else:
                self._pending.append(job)
        self._pending = deque(self._live(list(self._pending)))

    def _loop(self) -> None:
        engine = self.engine
        while not self._abort:
            self._take()
            if not self._pending and not self._running():
                if self._closing:
                    break
                continue
            budget = self.max_prefill_tokens - (0 if engine is None else engine.prefill_chunk(self.max_prefill_tokens))
            if self._pending and budget > 0:
                first = self._pending[0]
                idle = not self._running()
                if engine is None or first.key.kind not in engine.kinds:  # a batch run whole
                    self._pending.popleft()
                    batch = self._collect(first, wait=idle)
                    if batch:
                        self._run(batch)
                elif engine.running < self.max_batch and (
                    engine.partial is None or engine.prefill_tokens(first) <= budget
                ):  # one prompt at a time is prefilled in chunks
                    self._pending.popleft()
                    batch = self._collect(
                        first, room=self.max_batch - engine.running, wait=idle,
                        weight=engine.prefill_tokens, budget=budget,
                    )  # fmt: skip
                    if batch:
                        self.sizes[len(batch)] += 1
                        engine.admit(batch, chunk=budget)
            if self._running():
                engine.step()
            self.cpu_s = time.thread_time()  # this thread's own: waiting for a request takes none
        if self._abort and engine is not None:  # the running rows too: nothing more of them is computed
            engine.abort(ShuttingDown("the server is shutting down"))
        self._fail_waiting()

    def _run(self, batch: list[Job]) -> None:
        t0 = time.perf_counter()
        for job in batch:
            job.started, job.batch = t0, len(batch)
        try:
            results = self.run(batch[0].key, [j.payload for j in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"{len(results)} results for a batch of {len(batch)}")
        except Exception as e:  # noqa: BLE001  (a model error must not end the worker)
            self.failed_batches += 1
            if len(batch) == 1:
                results = [e]
            else:  # alone, each request fails or succeeds by itself
                for job in batch:
                    self._run([job])
                return
        self.sizes[len(batch)] += 1
        for job, result in zip(batch, results, strict=True):
            settle(job, result)
