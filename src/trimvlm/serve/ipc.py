"""The front end in processes of its own (`trimvlm serve --api-workers N`, docs/serving.md "API processes"): N API
processes read HTTP, parse, check and tokenize; one engine process owns the model and the scheduler loop. They
talk over `multiprocessing.connection` in typed messages (the dataclasses below: an API process sends `Submit`,
`Cancel`, `Arrive`, `Ask`; the engine `Event`, `Answer`), lists of them as the standard `pickle` writes
them, a tensor as its bytes (`dumps`: multiprocessing's own pickler would pass a file descriptor per tensor,
torch's a `torch.save` per storage). The engine's side is `bridge` (a thread per API process, with an event loop
of its own: a task per request relays what the model thread hands it); an API process's is `RemoteScheduler`,
the scheduler's interface over the connection (a reader thread hands the events to the requests' event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import copyreg
import dataclasses
import io
import itertools
import pickle
import socket
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Client, Connection

import torch

from trimvlm.serve.engine import Outbox
from trimvlm.serve.errors import as_api_error
from trimvlm.serve.jobs import Done, Failed, Job, ShuttingDown, settle
from trimvlm.serve.scheduler import Scheduler

ASK_TIMEOUT_S = 10.0


@dataclasses.dataclass
class Submit:
    rid: int
    key: object  # jobs.JobKey
    payload: object
    streamed: bool = False  # answered by events (a chat completion): its `events` is made on the engine's side


@dataclasses.dataclass
class Cancel:
    rid: int


@dataclasses.dataclass
class Arrive:
    delta: int


@dataclasses.dataclass
class Ask:
    qid: int
    what: str  # "stats" | "refresh" (write the engine's gauges for /metrics) | "load" (a load-following rung)


@dataclasses.dataclass
class Event:
    rid: int
    event: object  # streamed: jobs.Token | ChoiceEnd | Done | Failed (its error an ApiError); else the result


@dataclasses.dataclass
class Answer:
    qid: int
    value: object


def _tensor(dtype, shape, device, data: bytearray) -> torch.Tensor:
    t = torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape) if data else torch.empty(shape, dtype=dtype)
    return t if device == "cpu" else t.to(device)


def _reduce_tensor(t: torch.Tensor):
    """A tensor as (dtype, shape, device, its bytes): a copy in the message (torch's pickling is slower)."""
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return _tensor, (t.dtype, tuple(t.shape), str(t.device), bytearray(data))


def dumps(msgs: list) -> bytes:
    """Messages as the standard pickle writes them, a tensor by `_reduce_tensor` (its dispatch table)."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = copyreg.dispatch_table | {torch.Tensor: _reduce_tensor}
    pickler.dump(msgs)
    return buf.getvalue()


def _answer(state, what: str):
    """The engine's answer to an API process's `Ask`."""
    if what == "load" and state.load is None:
        return None
    return {"stats": state.batcher.stats, "refresh": state.metrics.refresh, "load": state.load_rung}[what]()


# ---- the engine's side ----
def bridge(state, conn: Connection) -> None:
    """On the engine process, one thread per API process: its requests into the scheduler, their answers back,
    until the API process has gone (its requests still queued or running are then cancelled)."""
    asyncio.run(_Bridge(state, conn).serve())


class _Bridge:
    def __init__(self, state, conn: Connection):
        self.state, self.conn = state, conn
        self.requests: dict[int, tuple[Job, asyncio.Task]] = {}
        self.out: list = []  # the messages of this turn of the loop, sent as one

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        self.gone = loop.create_future()
        loop.add_reader(self.conn.fileno(), self._read)
        try:
            await self.gone
        finally:
            loop.remove_reader(self.conn.fileno())
            for job, task in self.requests.values():
                job.cancel()
                task.cancel()
            self.conn.close()

    def _read(self) -> None:
        try:
            msgs = self.conn.recv()
        except (EOFError, OSError):
            if not self.gone.done():
                self.gone.set_result(None)
            return
        for msg in msgs:
            if isinstance(msg, Submit):
                self._submit(msg)
            elif isinstance(msg, Cancel):
                job, task = self.requests.pop(msg.rid, (None, None))
                if job is not None:
                    job.cancel()
                    task.cancel()
            elif isinstance(msg, Arrive):
                self.state.batcher.arriving(msg.delta)
            elif isinstance(msg, Ask):
                self._post(Answer(msg.qid, _answer(self.state, msg.what)))

    def _submit(self, msg: Submit) -> None:
        if msg.streamed:
            msg.payload.events = asyncio.Queue()
        try:
            job = self.state.batcher.enqueue(msg.key, msg.payload)
        except ShuttingDown as e:
            error = as_api_error(e)
            self._post(Event(msg.rid, Failed(error) if msg.streamed else error))
            return
        self.requests[msg.rid] = (job, asyncio.ensure_future(self._relay(msg.rid, job, msg.streamed)))

    async def _relay(self, rid: int, job: Job, streamed: bool) -> None:
        """What the model thread hands the request over, as it comes: a chat completion's events up to its last,
        another request's result."""
        while True:
            try:
                event = await (job.payload.events.get() if streamed else job.future)
            except Exception as e:  # noqa: BLE001  (the batch's error is the request's answer)
                event = as_api_error(e)
            if isinstance(event, Failed):
                event = Failed(as_api_error(event.error))
            self._post(Event(rid, event))
            if not streamed or isinstance(event, Done | Failed):
                self.requests.pop(rid, None)
                return

    def _post(self, msg) -> None:
        if not self.out:
            asyncio.get_running_loop().call_soon(self._flush)
        self.out.append(msg)

    def _flush(self) -> None:
        msgs, self.out = self.out, []
        with contextlib.suppress(OSError):
            self.conn.send_bytes(dumps(msgs))


# ---- an API process's side ----
@dataclasses.dataclass(eq=False)
class _RemoteJob(Job):
    scheduler: RemoteScheduler | None = None
    rid: int = 0

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self.scheduler.send(Cancel(self.rid))


class RemoteScheduler:
    """The engine's scheduler as an API process's handlers use it (`jobs.Job`s whose events and results come
    over the connection)."""

    def __init__(self, address, authkey: bytes, *, max_batch: int, max_wait_s: float):
        self.address, self.authkey = address, authkey
        self.max_batch, self.max_wait_s = max_batch, max_wait_s
        self._jobs: dict[int, _RemoteJob] = {}
        self._asked: dict[int, Future] = {}
        self._ids = itertools.count()
        self.closed = False
        self._lock = threading.Lock()  # one message at a time on the connection
        self.conn: Connection | None = None
        self._reader = None
        self.on_lost = None  # called when the engine process has gone (the API process then stops)

    def start(self, conn: Connection | None = None) -> None:
        """Connect to the engine process (or use `conn`, an end of a connection already made) and read."""
        if self._reader is not None:
            return
        self.conn = conn if conn is not None else Client(self.address, authkey=self.authkey)
        self._reader = threading.Thread(target=self._read, name="trimvlm-serve-ipc", daemon=True)
        self._reader.start()

    def send(self, *msgs) -> None:
        with self._lock, contextlib.suppress(OSError):
            self.conn.send_bytes(dumps(list(msgs)))

    def close(self, timeout: float = 10.0) -> None:
        """Shut the connection's socket down: the reader here and the engine's bridge for this process both read
        EOF and return (a descriptor closed under a blocked read would leave both reads blocked)."""
        self.closed = True
        if self.conn is None:
            return
        with contextlib.suppress(OSError, ValueError):
            with socket.socket(fileno=socket.dup(self.conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.conn.close()

    @property
    def alive(self) -> bool:
        return self._reader is not None and self._reader.is_alive() and not self.closed

    arrival = Scheduler.arrival

    def arriving(self, delta: int) -> None:
        self.send(Arrive(delta))

    def enqueue(self, key, payload, arrival: contextlib.ExitStack | None = None) -> Job:
        with arrival or contextlib.nullcontext():
            if self.closed or not self.alive:
                raise ShuttingDown("the server is shutting down")
            loop = asyncio.get_running_loop()
            rid = next(self._ids)
            job = _RemoteJob(key=key, payload=payload, future=loop.create_future(), loop=loop, scheduler=self, rid=rid)
            self._jobs[rid] = job
            streamed = getattr(payload, "events", None) is not None
            self.send(Submit(rid, key, dataclasses.replace(payload, events=None) if streamed else payload, streamed))
        return job

    result = staticmethod(Scheduler.result)  # (awaits the job's future, which the reader thread settles)

    def stats(self) -> dict:
        return self.ask("stats")

    def ask(self, what: str):
        """The engine's answer to `what` ("stats", "refresh", "load"), waited for (at most ASK_TIMEOUT_S)."""
        if self.closed:
            raise ShuttingDown("the server is shutting down")
        qid = next(self._ids)
        answer = self._asked[qid] = Future()
        self.send(Ask(qid, what))
        try:
            return answer.result(ASK_TIMEOUT_S)
        except TimeoutError:
            raise ShuttingDown("the engine process does not answer") from None
        finally:
            self._asked.pop(qid, None)

    def _read(self) -> None:
        while True:
            try:
                msgs = self.conn.recv()
            except (EOFError, OSError):
                break
            outbox = Outbox()  # the message's events: one wake-up of each event loop, as the model thread's
            for msg in msgs:
                self._take(msg, outbox)
            outbox.flush()
        lost, self.closed = not self.closed, True
        for job in list(self._jobs.values()):  # the engine has gone: every request still waiting is answered
            settle(job, ShuttingDown("the engine process has stopped"))
        for answer in [a for a in list(self._asked.values()) if not a.done()]:
            answer.set_exception(ShuttingDown("the engine process has stopped"))
        if lost and self.on_lost is not None:
            self.on_lost()

    def _take(self, msg, outbox: Outbox) -> None:
        if isinstance(msg, Answer):
            answer = self._asked.get(msg.qid)
            if answer is not None and not answer.done():
                answer.set_result(msg.value)
            return
        job = self._jobs.get(msg.rid)
        if job is None:
            return
        job.started = job.started or time.perf_counter()
        if getattr(job.payload, "events", None) is None:  # answered by its result
            self._jobs.pop(msg.rid, None)
            settle(job, msg.event)
            return
        if isinstance(msg.event, Done | Failed):
            self._jobs.pop(msg.rid, None)
        outbox.post(job, msg.event)
