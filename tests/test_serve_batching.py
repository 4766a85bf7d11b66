"""The server's scheduler without a step-level engine, a plain micro-batcher (no HTTP): batches by key, up to max_batch, within max_wait, waits only for
requests on their way (each test's requests are announced: its batches close when they are all queued, never on
a time window); a failing request fails alone and the worker goes on. The serve extra missing is one
line naming it."""

import asyncio
import threading
import time

import pytest
import torch

from trimvlm.serve.scheduler import Scheduler


@pytest.fixture(autouse=True)
def _one():
    torch.set_num_threads(1)


class Recorder:
    def __init__(self, delay=0.0):
        self.batches = []
        self.delay = delay
        self.lock = threading.Lock()

    def __call__(self, key, payloads):
        with self.lock:
            self.batches.append((key, list(payloads)))
        time.sleep(self.delay)
        if "boom" in payloads:
            raise RuntimeError("boom")
        return [ValueError(p) if p == "bad" else (key, p) for p in payloads]


def run_all(batcher, jobs, announce=True):
    """Submit all jobs at once; `announce`: each is announced first (as a server's request being prepared)."""

    async def main():
        batcher.start()
        arrivals = [batcher.arrival() if announce else None for _ in jobs]
        try:
            return await asyncio.gather(
                *(batcher.submit(k, p, a) for (k, p), a in zip(jobs, arrivals, strict=True)),
                return_exceptions=True,
            )
        finally:
            batcher.close()

    return asyncio.run(main())


def test_batches_by_key_and_size():
    rec = Recorder()
    b = Scheduler(rec, None, max_batch=3, max_wait_s=60)  # the batches close on the announcements, not a window
    jobs = [("a", 0), ("b", 1), ("a", 2), ("a", 3), ("a", 4), ("b", 5)]
    out = run_all(b, jobs)
    assert [r[0] for r in out] == [(k, p) for k, p in jobs]  # each its own result
    assert all(len(p) <= 3 and all(j[0] == key for j in jobs if j[1] in p) for key, p in rec.batches)
    assert sorted(p for _, ps in rec.batches for p in ps) == list(range(6))
    assert sorted(len(p) for _, p in rec.batches) == [1, 2, 3]  # a: 3 + 1, b: 2
    assert [job.batch for _, job in out] == [3, 2, 3, 3, 1, 2]
    assert b.stats()["requests"] == 6 and b.stats()["largest_batch"] == 3


def test_max_batch_one_runs_each_alone():
    rec = Recorder()
    out = run_all(Scheduler(rec, None, max_batch=1, max_wait_s=60), [("a", i) for i in range(4)])
    assert [len(p) for _, p in rec.batches] == [1, 1, 1, 1]
    assert [r[0][1] for r in out] == [0, 1, 2, 3]


def test_a_failing_request_fails_alone():
    rec = Recorder()
    b = Scheduler(rec, None, max_batch=8, max_wait_s=60)
    out = run_all(b, [("a", 0), ("a", "boom"), ("a", 2), ("a", "bad")])
    assert out[0][0] == ("a", 0) and out[2][0] == ("a", 2)
    assert isinstance(out[1], RuntimeError) and isinstance(out[3], ValueError)
    assert [len(p) for _, p in rec.batches] == [4, 1, 1, 1, 1]  # the batch, then each alone
    assert b.failed_batches == 2


def test_a_lone_request_does_not_wait():
    """Nothing else on its way: the batch runs at once, not after max_wait (60 s here): the worker takes the
    request and never polls the queue with a timeout for more."""
    rec = Recorder()
    b = Scheduler(rec, None, max_batch=32, max_wait_s=60)
    real, polls = b._queue.get, []

    def get(*args, **kw):
        if "timeout" in kw:
            polls.append(kw["timeout"])
        return real(*args, **kw)

    b._queue.get = get
    out = run_all(b, [("a", 0)], announce=False)
    assert out[0][0] == ("a", 0) and rec.batches == [("a", [0])]
    assert polls == []


def test_waits_for_announced_requests():
    """A request still being prepared is waited for (up to max_wait), and joins the batch."""
    rec = Recorder()
    b = Scheduler(rec, None, max_batch=32, max_wait_s=60)

    async def main():
        b.start()
        late = b.arrival()
        first = asyncio.ensure_future(b.submit("a", 0))
        await asyncio.sleep(0.2)  # "preparing" the second request
        second = await b.submit("a", 1, late)
        b.close()
        return await first, second

    (r0, j0), (r1, j1) = asyncio.run(main())
    assert (r0, r1) == (("a", 0), ("a", 1)) and j0.batch == j1.batch == 2
    assert rec.batches == [("a", [0, 1])]


def test_missing_extra_is_one_line(monkeypatch):
    import importlib.util

    from trimvlm.serve import MissingExtraError, require
    from trimvlm.testing.cli import assert_one_line_error, run_cli

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a)
    )
    with pytest.raises(MissingExtraError, match=r"pip install 'trimvlm\[serve\]'"):
        require()
    assert_one_line_error(run_cli("serve", "--model", "demo"), "pip install 'trimvlm[serve]'")


def test_a_budgeted_batch_skips_waiting_jobs_of_other_keys():
    """The budget's weight is asked only of the first job's key: waiting jobs of another endpoint (whose payload
    has no weight) are passed over, not weighed (that used to raise on the model thread), and a job of the key
    past them still joins."""
    from trimvlm.serve.jobs import Job

    b = Scheduler(Recorder(), None, max_batch=8, max_wait_s=0.0)
    loop = asyncio.new_event_loop()
    try:
        jobs = [Job(key=k, payload=p, future=loop.create_future(), loop=loop)
                for k, p in ((("chat", ""), 3), (("decide", ""), "no weight"), (("chat", ""), 4), (("chat", ""), 9))]  # fmt: skip
        b._pending.extend(jobs[1:])
        batch = b._collect(jobs[0], wait=False, weight=lambda j: j.payload, budget=8)
    finally:
        loop.close()
    assert batch == [jobs[0], jobs[2]]  # 3 + 4 fit in 8, 9 does not
    assert list(b._pending) == [jobs[1], jobs[3]]


def test_model_cpu_counts_the_model_threads_work_not_its_waits():
    """`model_cpu_s` (/metrics: trimvlm_model_thread_cpu_seconds) is the CPU the model thread used: at least
    what the thread's own CPU clock read at the end of its batch (a batch that computes for 0.2 s of CPU counts
    it), and not more than a little bookkeeping after it: a batch that sleeps 0.5 s adds no 0.5 s (wall time
    would), nor does the CPU the rest of the process used (the process' clock would)."""
    ends = []  # the model thread's CPU clock when each batch ends, read on that thread

    def run(key, payloads):
        if key == "spin":
            t0 = time.thread_time()
            while time.thread_time() - t0 < 0.2:
                pass
        else:
            time.sleep(0.5)
        ends.append(time.thread_time())
        return list(payloads)

    bookkeeping = 0.25  # CPU seconds the thread may spend after a batch: far above it, still below the sleep
    b = Scheduler(run, None, max_batch=4, max_wait_s=0.0)
    assert b.stats()["model_cpu_s"] == 0.0
    run_all(b, [("spin", 0)])
    spun = b.stats()["model_cpu_s"]
    assert spun >= ends[-1] >= 0.2
    assert spun < ends[-1] + bookkeeping
    b = Scheduler(run, None, max_batch=4, max_wait_s=0.0)
    run_all(b, [("sleep", 0)])
    slept = b.stats()["model_cpu_s"]
    assert ends[-1] <= slept < ends[-1] + bookkeeping  # the 0.5 s asleep is not CPU
