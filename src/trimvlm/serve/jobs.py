"""What the model thread and the requests' event loops hand each other: a queued request (`Job`) and the key it
batches by (`JobKey`), the events a chat completion is answered by (`Token`, `ChoiceEnd`, `Done`, `Failed`), a
job's result (`settle`: its future, or the event a request answered by events waits for), and `ShuttingDown`
(503)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple


class ShuttingDown(RuntimeError):
    """The server is shutting down: a request it will not answer any more (503)."""


@dataclass(frozen=True)
class JobKey:
    """What a request batches by: only requests with equal keys share a batch. `kind`: its endpoint ("chat",
    "decide", "score"); `recipe`: its recipe's label; a score's `readout` and `executor`; `alone`: a batch of its
    own (a chat completion of n > 1 choices, whose rows decode off its own prompt's KV)."""

    kind: str
    recipe: str
    readout: str = ""
    executor: str = ""
    alone: str = ""


@dataclass(eq=False)  # a job is itself (its payload may hold tensors)
class Job:
    key: Hashable  # a JobKey (any hashable for a plain micro-batcher)
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


class LogProb(NamedTuple):
    """A generated token's log-probability and the top ones, (token id, log-probability) each."""

    token: int
    logprob: float
    top: list


@dataclass(frozen=True)
class Token:
    choice: int
    token: int
    logprob: LogProb | None


@dataclass(frozen=True)
class ChoiceEnd:
    """A choice's answer: its text (cut where a stop string begins), its tokens' count, why it ended, the
    log-probabilities of the tokens whose text was returned."""

    choice: int
    text: str
    completion_tokens: int
    finish_reason: str
    logprobs: list


@dataclass(frozen=True)
class Done:
    """The request's last event: its costs and the most rows a model call of it held."""

    usage: dict
    batch: int


@dataclass(frozen=True)
class Failed:
    error: BaseException


def settle(job: Job, result) -> None:
    """Hand a job its result on its event loop: its future's, or (an error) the event a request that is
    answered by events waits for (`payload.events`: a chat completion)."""
    events = getattr(job.payload, "events", None)
    if events is not None and isinstance(result, BaseException):
        call_soon(job.loop, events.put_nowait, Failed(result))

    def put():
        if job.future.done():  # the client went away
            return
        if isinstance(result, BaseException):
            job.future.set_exception(result)
        else:
            job.future.set_result(result)

    call_soon(job.loop, put)


def call_soon(loop, fn, *args) -> None:
    """`fn(*args)` on the event loop `loop`, from another thread (nothing once that loop is closed)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)
