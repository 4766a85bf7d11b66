"""What the model thread and the requests' event loops hand each other: a queued request (`Job`), its result
(`settle`: its future, or the event a request answered by events waits for), and `ShuttingDown` (503)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any


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


def settle(job: Job, result) -> None:
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
