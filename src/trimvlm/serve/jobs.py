"""Micro-batching: requests that arrive together run as one batch on the one thread that owns the model.

A request is checked and tokenized before it gets here (a bad one never joins a batch). `submit` queues it
under a key: only requests with the same key can share a batch (the same endpoint and recipe, and for a chat
completion the same max_tokens; a sampled completion has a key of its own). The worker takes the oldest
waiting request, adds the waiting ones with its key, and waits for more until `max_wait_s` after that
request arrived or the batch holds `max_batch`; requests of other keys wait for the next batch, in arrival
order. It waits only while more may come: a request still being read or prepared (`arrival()`) or already
queued. A lone request therefore runs at once. `run(key, payloads)` answers a batch: a list with one result
(or exception) per payload.

If a batch raises, each of its requests runs again alone, so one request that breaks the model fails only
itself (500); the worker never stops on an error. A request whose client has gone (`Job.cancel`, set by the
event loop when the connection closes) is dropped wherever it waits and never run (`dropped` counts them).
`serve/scheduler.py` extends this loop with step-level continuous batching for chat completions.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

POLL_S = 0.002  # how often a waiting worker looks again whether more requests are on their way


class ShuttingDown(RuntimeError):
    """The server is shutting down: a request it will not answer any more (503)."""


@dataclass(eq=False)  # a job is itself (its payload may hold tensors)
class Job:
    key: Hashable
    payload: Any
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    enqueued: float = field(default_factory=time.perf_counter)
    started: float = 0.0  # when its batch began to run
    batch: int = 0  # requests in its batch
    cancelled: bool = False  # its client has gone: never run it (read by the model thread)
    finished: bool = False  # its answer is computed (set by the model thread)

    def cancel(self) -> None:
        self.cancelled = True


class Arrival:
    """A request on its way to the batcher (being read, checked, tokenized): the worker waits for it."""

    def __init__(self, batcher: MicroBatcher):
        self._batcher = batcher
        self._open = True
        batcher._arriving += 1

    def done(self) -> None:
        if self._open:
            self._open = False
            self._batcher._arriving -= 1

    def __enter__(self) -> Arrival:
        return self

    def __exit__(self, *exc) -> None:
        self.done()


class MicroBatcher:
    def __init__(
        self, run: Callable[[Hashable, list], list], *, max_batch: int = 32, max_wait_s: float = 0.01
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.run = run
        self.max_batch = max_batch
        self.max_wait_s = max(0.0, max_wait_s)
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._pending: deque[Job] = deque()  # taken from the queue, waiting for a batch of their key
        self._closing = False  # the worker has seen the end of the queue: it drains what is there, then stops
        self._closed = False  # close() was called: nothing more is queued
        self._abort = False  # the drain took too long: the worker answers what is left "shutting down" and stops
        self._thread = threading.Thread(target=self._loop, name="trimvlm-serve-model", daemon=True)
        self._arriving = 0  # requests on their way (Arrival); written by the event loop, read by the worker
        self.sizes: Counter[int] = Counter()  # batch size -> batches run
        self.failed_batches = 0
        self.dropped = 0  # requests whose client left before they ran: never computed

    # ---- the event loop's side ----
    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop: the requests queued and running are answered (drained) for up to `timeout`; past it, the worker
        answers every request still waiting or running with `ShuttingDown` at its next turn and stops."""
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._abort = True
            self._thread.join(timeout)
        if not self._thread.is_alive():  # (queued after the worker's last look)
            self._fail_waiting()

    def _fail_waiting(self) -> None:
        """Answer every request still waiting `ShuttingDown` (never computed)."""
        left = list(self._pending)
        self._pending.clear()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                left.append(job)
        for job in left:
            _settle(job, ShuttingDown("the server is shutting down"))

    @property
    def closed(self) -> bool:
        """close() was called: nothing more is queued (`ShuttingDown`)."""
        return self._closed

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def waiting(self) -> int:
        return self._queue.qsize() + len(self._pending)

    def arrival(self) -> Arrival:
        """Say a request is coming (use as a context manager around its reading and preparation)."""
        return Arrival(self)

    def enqueue(self, key: Hashable, payload, arrival: Arrival | None = None) -> Job:
        """Queue one request (from the event loop); its job, whose future holds its result. `ShuttingDown` once
        the server is closing."""
        if self._closed:
            if arrival is not None:
                arrival.done()
            raise ShuttingDown("the server is shutting down")
        loop = asyncio.get_running_loop()
        job = Job(key=key, payload=payload, future=loop.create_future(), loop=loop)
        self._queue.put(job)
        if arrival is not None:
            arrival.done()
        return job

    async def submit(self, key: Hashable, payload, arrival: Arrival | None = None) -> tuple[Any, Job]:
        """Queue one request; (its result, its job: times and batch size). An exception of its batch is raised.
        If the awaiting task is cancelled, the job is too (it will not run if it has not started)."""
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
            "waiting": self.waiting(), "dropped": self.dropped,
        }  # fmt: skip

    # ---- the worker thread ----
    def _next(self) -> Job | None:
        if self._pending:
            return self._pending.popleft()
        if self._closing:
            return None
        job = self._queue.get()
        if job is None:
            self._closing = True
        return job

    def _collect(self, first: Job, *, room: int | None = None, wait: bool = True, weight=None,
                 budget: int = 0) -> list[Job]:  # fmt: skip
        """`first` and the waiting jobs of its key, up to `room` (default max_batch) and, with `weight(job)`, up
        to `budget` in all (`first` always goes); `wait`: wait for more up to max_wait after `first` arrived.
        Jobs whose client has gone are dropped."""
        room = self.max_batch if room is None else room
        batch, used = [first], 0 if weight is None else weight(first)

        def fits(job) -> bool:
            return weight is None or used + weight(job) <= budget

        for job in list(self._pending):
            if len(batch) >= room:
                break
            if job.key != first.key:  # (a job of another endpoint may have no weight)
                continue
            if not fits(job):
                break
            self._pending.remove(job)
            batch.append(job)
            used += 0 if weight is None else weight(job)
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
            elif job.key == first.key and fits(job):
                batch.append(job)
                used += 0 if weight is None else weight(job)
            else:
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
                try:  # nobody awaits it any more
                    job.loop.call_soon_threadsafe(job.future.cancel)
                except RuntimeError:  # the event loop is closed
                    pass
        return live

    def _loop(self) -> None:
        while not self._abort:
            first = self._next()
            if first is None:
                break
            batch = self._collect(first)
            if batch:
                self._run(batch)
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
            _settle(job, result)


def _settle(job: Job, result) -> None:
    """Hand a job its result on its event loop: its future's, or (an error) the event a request that is
    answered by events waits for (`payload.events`: a chat completion)."""
    events = getattr(job.payload, "events", None)
    if events is not None and isinstance(result, BaseException):
        try:
            job.loop.call_soon_threadsafe(events.put_nowait, ("error", result))
        except RuntimeError:  # the event loop is closed
            pass

    def put():
        if job.future.done():  # the client went away
            return
        if isinstance(result, BaseException):
            job.future.set_exception(result)
        else:
            job.future.set_result(result)

    try:
        job.loop.call_soon_threadsafe(put)
    except RuntimeError:  # the event loop is closed
        pass
