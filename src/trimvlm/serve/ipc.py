"""The front end in processes of its own (`trimvlm serve --api-workers N`): N API processes read HTTP, parse and
check JSON, decode images and tokenize (each holds the model's processor and tokenizer: it loads the
checkpoint), and one engine process owns the model and the one scheduler loop. They talk over local IPC
(`multiprocessing.connection`: a Unix socket with a random key) in typed messages (the dataclasses below):
`Submit` (a prepared request: its tensors, no event queue), `Cancel` (its client has gone), `Arrive` (+1 / -1: a
request is being read and prepared, the batching waits for it), `Ask` ("stats" | "metrics" | "load") from an API
process; `Event` (a chat completion's token, choice end, result or error), `Result` (a whole batch's answer:
System One, score; or its error), `Answer` from the engine.

On the engine side a remote request is a `jobs.Job` whose loop, future and event queue forward what the model
thread hands them over the connection (`_Forward*`); the scheduler and the engine do not know the difference.
On the API side `RemoteScheduler` has the scheduler's interface the handlers use. Errors cross as (status,
detail). Streaming, cancellation and batching work across the boundary; `/metrics` on an API process is its
own HTTP figures and the engine's (`merged_metrics`); `/health` asks the engine.

On the wire a message is a list of these records, pickled with tensors as their bytes (`dumps`): not through
multiprocessing's default, which shares each tensor's storage by passing a file descriptor (a handshake with
the sender's resource-sharer thread per tensor: a third of each process's samples under load). The engine holds a
step's events for an API process and sends them as one message when the model thread hands them over; an API
process sends a request's `Submit` and the end of its `Arrive` together.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import itertools
import os
import pickle
import socket
import threading
import time

import torch

from trimvlm.serve.engine import Outbox
from trimvlm.serve.errors import ApiError, as_api_error
from trimvlm.serve.jobs import Job, ShuttingDown
from trimvlm.serve.scheduler import Scheduler

ASK_TIMEOUT_S = 10.0


@dataclasses.dataclass
class Submit:
    rid: int
    key: object
    payload: object


@dataclasses.dataclass
class Cancel:
    rid: int


@dataclasses.dataclass
class Arrive:
    delta: int


@dataclasses.dataclass
class Ask:
    qid: int
    what: str  # "stats" | "metrics" | "load"


@dataclasses.dataclass
class Event:
    rid: int
    event: tuple  # engine.py's events; an error as ("error", (status, detail))


@dataclasses.dataclass
class Result:
    rid: int
    ok: bool
    value: object  # the answer, or (status, detail)


@dataclasses.dataclass
class Answer:
    qid: int
    value: object
# the /metrics families an API process records itself (HTTP, streaming, client-side cancels, its caches)
API_FAMILIES = frozenset({
    "trimvlm_requests", "trimvlm_request_seconds", "trimvlm_time_to_first_token_seconds",
    "trimvlm_inter_token_seconds", "trimvlm_cancelled_requests", "trimvlm_chat_requests_by_recipe",
    "trimvlm_seen_body_hits", "trimvlm_seen_bodies",
    *(f"trimvlm_request_cache_{s}" for s in ("hits", "misses", "bytes", "max_bytes", "entries", "evictions")),
})  # fmt: skip


def _tensor(dtype, shape, device, data) -> torch.Tensor:
    if not len(data):
        return torch.empty(shape, dtype=dtype, device=device)
    t = torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)
    return t if device == "cpu" else t.to(device)


class _Pickler(pickle.Pickler):
    """A tensor as (dtype, shape, device, its bytes): a copy in the message, no shared storage."""

    def reducer_override(self, obj):
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        t = obj.detach()
        data = bytearray(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()) if t.numel() else bytearray()
        return _tensor, (t.dtype, tuple(t.shape), str(t.device), data)


def dumps(obj) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


class Link:
    """One end of the connection. `send` (from any thread) sends what `hold` kept and the message, as one list;
    `recv` (from one reader) returns a list of messages."""

    def __init__(self, conn):
        self.conn, self._lock, self._held = conn, threading.Lock(), []

    def hold(self, msg) -> None:
        with self._lock:
            self._held.append(msg)

    def send(self, msg=None) -> None:
        """Send the held messages and `msg` (None: only the held ones, if any)."""
        with self._lock:
            msgs, self._held = self._held + ([] if msg is None else [msg]), []
            if msgs:
                self.conn.send_bytes(dumps(msgs))

    def recv(self) -> list:
        return pickle.loads(self.conn.recv_bytes())


def _wire(error: BaseException) -> tuple[int, object]:
    e = as_api_error(error)
    return e.status, e.detail


# ---- the engine's side ----
class _ForwardLoop:
    """A remote request's `loop` for the model thread: what it schedules runs at once, and the events and
    results that makes are sent as one message (a step's tokens for this API process together)."""

    def __init__(self, link: Link):
        self.link = link

    def call_soon_threadsafe(self, fn, *args) -> None:
        try:
            fn(*args)
        finally:
            with contextlib.suppress(OSError):
                self.link.send()


class _ForwardEvents:
    """A remote chat request's event queue: each event is sent to its API process."""

    def __init__(self, link: Link, rid: int, jobs: dict):
        self.link, self.rid, self.jobs = link, rid, jobs

    def put_nowait(self, event) -> None:
        if event[0] == "error":
            event = ("error", _wire(event[1]))
        if event[0] in ("done", "error"):
            self.jobs.pop(self.rid, None)
        self.link.hold(Event(self.rid, event))  # sent by the loop's call


class _ForwardFuture:
    """A remote whole-batch request's future: its result or error is sent to its API process."""

    def __init__(self, link: Link, rid: int, jobs: dict):
        self.link, self.rid, self.jobs = link, rid, jobs

    def done(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def cancel(self) -> None:
        self.jobs.pop(self.rid, None)

    def set_result(self, value) -> None:
        self._send(True, value)

    def set_exception(self, error: BaseException) -> None:
        self._send(False, _wire(error))

    def _send(self, ok: bool, value) -> None:
        self.jobs.pop(self.rid, None)
        self.link.hold(Result(self.rid, ok, value))  # sent by the loop's call


def bridge(state, conn) -> None:
    """On the engine process, one thread per API process: its requests into the scheduler, their answers back."""
    link, jobs = Link(conn), {}
    loop = _ForwardLoop(link)
    while True:
        try:
            msgs = link.recv()
        except (EOFError, OSError):  # the API process has gone: its requests are not computed further
            for job in list(jobs.values()):
                job.cancel()
            return
        for msg in msgs:
            _take(state, link, loop, jobs, msg)
        with contextlib.suppress(OSError):
            link.send()  # the answers and refusals these messages made


def _take(state, link: Link, loop: _ForwardLoop, jobs: dict, msg) -> None:
    if isinstance(msg, Submit):
        payload = msg.payload
        if hasattr(payload, "events"):
            payload.events = _ForwardEvents(link, msg.rid, jobs)
        job = Job(key=msg.key, payload=payload, future=_ForwardFuture(link, msg.rid, jobs), loop=loop)
        jobs[msg.rid] = job
        try:
            state.batcher.put(job)
        except ShuttingDown as e:
            job.future.set_exception(e)
    elif isinstance(msg, Cancel):
        job = jobs.pop(msg.rid, None)
        if job is not None:
            job.cancel()
    elif isinstance(msg, Arrive):
        state.batcher.arriving(msg.delta)
    elif isinstance(msg, Ask):
        if msg.what == "stats":
            value = state.batcher.stats()
        elif msg.what == "load":  # an API process's load-following request has come: what its choice reads
            value = None
            if state.load is not None:
                state.load.arrived()
                value = state.load.figures() | {"waiting": state.batcher.waiting(), "rate": state.load.rate()}
        else:
            value = state.metrics.exposition()[0]
        link.hold(Answer(msg.qid, value))


# ---- an API process's side ----
@dataclasses.dataclass(eq=False)
class _RemoteJob(Job):
    link: Link | None = None
    rid: int = 0

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            with contextlib.suppress(OSError):
                self.link.send(Cancel(self.rid))


class _RemoteArrival:
    def __init__(self, link: Link):
        self.link, self._open = link, True
        link.send(Arrive(1))

    def done(self) -> None:
        if self._open:
            self._open = False
            with contextlib.suppress(OSError):
                self.link.send(Arrive(-1))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.done()


class RemoteScheduler:
    """The engine's scheduler as an API process's handlers use it (`jobs.Job`s whose events and results come
    over the connection)."""

    engine = None

    def __init__(self, address, authkey: bytes, *, max_batch: int, max_wait_s: float):
        self.address, self.authkey = address, authkey
        self.max_batch, self.max_wait_s = max_batch, max_wait_s
        self._jobs: dict[int, _RemoteJob] = {}
        self._asked: dict[int, list] = {}  # qid -> [Event, value]
        self._ids = itertools.count()
        self._closed = False
        self.link = None
        self._reader = None
        self.on_lost = None  # called when the engine process has gone (the API process then stops)

    def start(self, conn=None) -> None:
        """Connect to the engine process (or use `conn`, an end of a connection already made) and read."""
        from multiprocessing.connection import Client

        if self._reader is not None:
            return
        self.link = Link(conn if conn is not None else Client(self.address, authkey=self.authkey))
        self._reader = threading.Thread(target=self._read, name="trimvlm-serve-ipc", daemon=True)
        self._reader.start()

    def close(self, timeout: float = 10.0) -> None:
        self._closed = True
        if self.link is None:
            return
        _shut_down(self.link.conn)  # the reader here and the engine's bridge thread for this process both return
        with contextlib.suppress(OSError):
            self.link.conn.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def alive(self) -> bool:
        return self._reader is not None and self._reader.is_alive() and not self._closed

    def arrival(self) -> _RemoteArrival:
        return _RemoteArrival(self.link)

    def waiting(self) -> int:
        """This process's requests sent and not yet started (the engine's queue holds others' too)."""
        return sum(1 for j in list(self._jobs.values()) if not j.started)

    def enqueue(self, key, payload, arrival=None) -> Job:
        if self._closed or not self.alive:
            if arrival is not None:
                arrival.done()
            raise ShuttingDown("the server is shutting down")
        loop = asyncio.get_running_loop()
        rid = next(self._ids)
        job = _RemoteJob(key=key, payload=payload, future=loop.create_future(), loop=loop, link=self.link, rid=rid)
        self._jobs[rid] = job
        sent = dataclasses.replace(payload, events=None) if hasattr(payload, "events") else payload
        self.link.hold(Submit(rid, key, sent))
        if arrival is not None:
            arrival.done()  # sent with the request
        self.link.send()
        return job

    result = staticmethod(Scheduler.result)  # (awaits the job's future, which the reader thread settles)

    def stats(self) -> dict:
        return self.ask("stats")

    def metrics(self) -> bytes:
        return self.ask("metrics")

    def ask(self, what: str):
        """The engine's answer to `what` ("stats", "metrics", "load"), waited for (at most ASK_TIMEOUT_S)."""
        qid = next(self._ids)
        slot = self._asked[qid] = [threading.Event(), None]
        self.link.send(Ask(qid, what))
        if not slot[0].wait(ASK_TIMEOUT_S):
            self._asked.pop(qid, None)
            raise ShuttingDown("the engine process does not answer")
        return slot[1]

    def _read(self) -> None:
        while True:
            try:
                msgs = self.link.recv()
            except (EOFError, OSError):
                break
            outbox = Outbox()  # the message's events: one wake-up of each event loop, as the model thread's
            for msg in msgs:
                if isinstance(msg, Answer):
                    slot = self._asked.pop(msg.qid, None)
                    if slot is not None:
                        slot[1] = msg.value
                        slot[0].set()
                    continue
                job = self._jobs.get(msg.rid)
                if job is None:
                    continue
                job.started = job.started or time.perf_counter()
                if isinstance(msg, Event):
                    event = msg.event
                    if event[0] == "error":
                        event = ("error", ApiError(*event[1]))
                    if event[0] in ("done", "error"):
                        self._jobs.pop(msg.rid, None)
                    outbox.post(job, event)
                elif isinstance(msg, Result):
                    self._jobs.pop(msg.rid, None)
                    _call(job.loop, _resolve, job.future, msg.ok, msg.value)
            outbox.flush()
        lost, self._closed = not self._closed, True
        for job in list(self._jobs.values()):  # the engine has gone: every request still waiting is answered
            error = ShuttingDown("the engine process has stopped")
            if hasattr(job.payload, "events"):
                _call(job.loop, job.payload.events.put_nowait, ("error", error))
            else:
                _call(job.loop, _resolve, job.future, False, (503, str(error)))
        if lost and self.on_lost is not None:
            self.on_lost()


def _shut_down(conn) -> None:
    """Shut down the socket under `conn`: both ends then read EOF, where a descriptor closed under a blocked read
    leaves that read (and the other end's) blocked for good. Nothing for a pipe or a closed connection."""
    try:
        fd = os.dup(conn.fileno())
    except (OSError, ValueError):
        return
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        os.close(fd)
        return
    with sock, contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _call(loop, fn, *args) -> None:
    with contextlib.suppress(RuntimeError):  # the event loop is closed
        loop.call_soon_threadsafe(fn, *args)


def _resolve(future, ok: bool, value) -> None:
    if future.done():
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(ApiError(*value))


def merged_metrics(local: bytes, engine: bytes) -> bytes:
    """An API process's /metrics: its own HTTP families (`API_FAMILIES`) and every other family from the engine."""

    def family(line: str) -> str:
        name = line.split()[2] if line.startswith("#") else line.split("{")[0].split()[0]
        for suffix in ("_total", "_created", "_bucket", "_count", "_sum"):
            if name.endswith(suffix) and name[: -len(suffix)] in API_FAMILIES:
                return name[: -len(suffix)]
        return name

    mine = [ln for ln in local.decode().splitlines() if ln and family(ln) in API_FAMILIES]
    theirs = [ln for ln in engine.decode().splitlines() if ln and family(ln) not in API_FAMILIES]
    return ("\n".join(theirs + mine) + "\n").encode()
