"""Step-level continuous batching of chat completions, on the model thread (the scheduler calls it).

`admit(jobs)`: one `Runner.prefill` over requests of one recipe (each prepared alone on the preparation thread,
collated here), their first tokens chosen and sent, then their rows join the running decode batch of that
recipe (`runtime.generate.Decoding.join`: the caches are left-padded to one length, padding attended by no
one). `step()`: one decode step of every running batch; each row's token is sent to its request at once
(true streaming); a row that stopped, reached its `max_tokens` or whose client has gone leaves the batch at
that step (its cache rows freed).

Each row is what the request alone gets from `vlm.generate`: greedy rows take their argmax, a sampled row
(temperature > 0) draws from its own `torch.Generator` seeded with its `seed`, one draw per token, exactly as
a batch of one does. (Rows of one batch agree with their solo runs to float rounding, as a padded batch does.)

Costs per request (its `usage`): its share of each model call it took part in: the prefill it was admitted
with (vision by its image tokens, the rest by rows) and every decode step it ran in (split by the rows of that
step); `forward_s` is the time of those calls; `batch_requests` the most rows a call of it held.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from trimvlm.decision.costs import split
from trimvlm.runtime.generate import Decoding, Sampling, choose
from trimvlm.runtime.meter import Meter


@dataclass
class Row:
    job: object  # batching.Job; its payload is a chat.ChatJob
    sampling: object  # runtime.generate.Sampling
    gen: torch.Generator | None
    tokens: list[int] = field(default_factory=list)  # generated, the stop token included
    usage: Counter = field(default_factory=Counter)
    batch: int = 0


@dataclass
class Group:
    """The running decode batch of one recipe: its rows (in cache order) and each row's newest token."""

    rows: list[Row]
    decoding: Decoding
    last: torch.Tensor  # [B] long


class Outbox:
    """Events for the requests' tasks: ("token", id), ("done", result), ("error", exc), handed to their event
    loop together once a model call is done (one wake-up of the loop per step, not one per row)."""

    def __init__(self):
        self.items: list[tuple[object, tuple]] = []

    def post(self, job, event) -> None:
        self.items.append((job, event))

    def flush(self) -> None:
        by_loop: dict[object, list] = {}
        for job, event in self.items:
            by_loop.setdefault(job.loop, []).append((job.payload.events, event))
        self.items = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the event loop is closed
                pass


def _deliver(items) -> None:
    for events, event in items:
        events.put_nowait(event)


class ChatEngine:
    kinds = frozenset({"chat"})

    def __init__(self, vlm, metrics=None):
        self.vlm, self.runner, self.metrics = vlm, vlm.runner, metrics
        self.stops = set(vlm.stop_ids())
        self.groups: dict[str, Group] = {}
        self.steps: Counter[int] = Counter()  # rows in a decode call -> calls
        self.cancelled = 0  # rows that left because their client had gone
        self.failed = 0
        self.outbox = Outbox()
        self.partial: list | None = (
            None  # [job, ChunkedPrefill, plan, seconds]: the prompt prefilled in chunks
        )
        self.chunks = 0  # chunks of chunked prefills run

    @property
    def running(self) -> int:
        """Rows decoding, and the request being prefilled in chunks (it holds a place in the batch)."""
        return sum(len(g.rows) for g in self.groups.values()) + (self.partial is not None)

    @staticmethod
    def prefill_tokens(job) -> int:
        return job.payload.prompt_tokens

    def stats(self) -> dict:
        n = sum(self.steps.values())
        return {
            "running": self.running, "decode_steps": n, "cancelled_running": self.cancelled,
            "prefill_chunks": self.chunks,
            "mean_decode_batch": sum(k * v for k, v in self.steps.items()) / n if n else 0.0,
        }  # fmt: skip

    # ---- admission ----
    def admit(self, jobs: list, chunk: int | None = None) -> None:
        """Prefill `jobs` (one recipe) and let their rows join the running batch. If the prefill raises, each
        request is tried alone, so one that breaks the model fails only itself. `chunk`: a lone request whose
        prompt is longer is prefilled `chunk` tokens now and the rest over the next turns (`prefill_chunk`),
        when its recipe changes nothing inside the prefill (runtime/chunked.py); else it is prefilled whole."""
        if chunk is not None and len(jobs) == 1 and self.prefill_tokens(jobs[0]) > chunk and not self.partial:
            self._begin_chunked(jobs[0], chunk)
        else:
            self._admit(jobs)
        self.outbox.flush()

    def _admit(self, jobs: list) -> None:
        t0 = time.perf_counter()
        for job in jobs:
            job.started, job.batch = t0, len(jobs)
        try:
            group = self._prefill(jobs)
        except Exception as e:  # noqa: BLE001  (a model error must not end the loop)
            self.failed += 1
            if len(jobs) == 1:
                self.outbox.post(jobs[0], ("error", e))
            else:
                for job in jobs:
                    self._admit([job])
            return
        self._start(group, jobs[0].key[1])

    def _start(self, group: Group, label: str) -> None:
        """The prefilled rows' first tokens sent; those still going join the running batch of their recipe."""
        self._advance(group, group.last)
        if not group.rows:
            return
        if label in self.groups:
            old = self.groups[label]
            old.decoding.join(group.decoding)
            old.rows += group.rows
            old.last = torch.cat([old.last, group.last])
        else:
            self.groups[label] = group

    def _prefill(self, jobs: list) -> Group:
        from trimvlm.plan import make_plan

        runner = self.runner
        plan = make_plan(jobs[0].payload.recipe, runner)
        meter = Meter(device=runner.device)
        t0 = time.perf_counter()
        parts, keys = [j.payload.prepared for j in jobs], [j.payload.prompt_key for j in jobs]
        out, found = runner.prefill_prompts(parts, plan, meter=meter, keys=keys)
        group = self._group(jobs, plan, out, meter, time.perf_counter() - t0, found)
        for row, hit in zip(group.rows, found, strict=True):
            if hit:  # its prompt was found (runtime/prefix_cache.py): no vision tower, no prefill ran for it
                row.usage["prefix_reused"] = 1
                row.usage["prefix_tokens_reused"] = row.job.payload.prompt_tokens
        return group

    # ---- chunked prefill (one long prompt at a time, a chunk per turn) ----
    def _begin_chunked(self, job, chunk: int) -> None:
        from trimvlm.plan import make_plan

        plan = make_plan(job.payload.recipe, self.runner)
        if not plan.chunkable:
            self._admit([job])
            return
        job.started, job.batch = time.perf_counter(), 1
        meter = Meter(device=self.runner.device)
        try:
            t0 = time.perf_counter()
            work = self.runner.prefill_chunked(job.payload.prepared, plan, meter=meter)
        except Exception as e:  # noqa: BLE001
            self.failed += 1
            self.outbox.post(job, ("error", e))
            return
        self.partial = [job, work, plan, time.perf_counter() - t0]
        self.prefill_chunk(chunk)

    def prefill_chunk(self, tokens: int) -> int:
        """Run the next chunk (at most `tokens` positions) of the prompt being prefilled in chunks; once it is
        done its row joins the running batch (its first token sent). The positions run (0: none pending)."""
        if not self.partial:
            return 0
        job, work, plan, seconds = self.partial
        if job.cancelled:  # its client has gone: no more of it is computed
            self.partial = None
            self.cancelled += 1
            return 0
        n = min(tokens, work.left)
        t0 = time.perf_counter()
        try:
            out = work.advance(n)
            self.chunks += 1
        except Exception as e:  # noqa: BLE001
            self.partial, self.failed = None, self.failed + 1
            self.outbox.post(job, ("error", e))
            self.outbox.flush()
            return n
        self.partial[3] = seconds = seconds + time.perf_counter() - t0
        if out is not None:
            self.partial = None
            self._start(self._group([job], plan, out, work.meter, seconds), job.key[1])
            self.outbox.flush()
        return n

    def _group(
        self, jobs: list, plan, out, meter: Meter, seconds: float, found: list[bool] | None = None
    ) -> Group:
        """The decode batch of prefilled `jobs`: each row's sampler, first token and share of the prefill (none
        for a row whose prompt was `found` in the prompt cache)."""
        runner, adapter = self.runner, self.runner.adapter
        payloads = [j.payload for j in jobs]
        rows = []
        for job, p in zip(jobs, payloads, strict=True):
            sampling = Sampling(temperature=p.temperature, top_p=p.top_p, seed=p.seed)
            gen = None
            if p.temperature > 0:
                gen = torch.Generator(device=runner.device).manual_seed(p.seed)
            rows.append(Row(job=job, sampling=sampling, gen=gen, batch=len(jobs)))
        t0 = time.perf_counter()
        last = self._choose(out.logits, rows)
        seconds += time.perf_counter() - t0
        c, ones = meter.costs, [1] * len(rows)
        ran = [0 if hit else 1 for hit in found or [False] * len(rows)]  # the rows whose prompt was prefilled
        image = adapter.image_token_id
        kv, peak, states = c.kv_bytes, c.kv_bytes_peak, c.state_bytes
        if 0 in ran:  # found prompts hold KV the prefill did not write: the assembled batch's, by rows
            kv = peak = out.cache.attention_bytes()
            states = out.cache.state_bytes()
        shares = {
            "vision_flops": split(c.flops.get("vision", 0),
                                  [r * int((p.prepared.input_ids == image).sum()) for r, p in zip(ran, payloads, strict=True)]),
            "prefill_flops": split(c.flops.get("prefill", 0), ran),
            "method_flops": split(c.method_prefill_flops, ran),
            "kv_bytes": split(kv, ones), "kv_bytes_peak": split(peak, ones), "state_bytes": split(states, ones),
        }  # fmt: skip
        for i, row in enumerate(rows):
            row.usage.update({k: v[i] for k, v in shares.items()})
            row.usage["forward_s"] += seconds
        if self.metrics is not None:
            self.metrics.prefill(len(rows), sum(p.prompt_tokens for p in payloads), seconds)
        return Group(rows, Decoding(runner, out.cache, out.next_pos.clone(), plan.skip_decode), last)

    # ---- decoding ----
    def step(self) -> None:
        """One decode step of every running batch."""
        for label, group in list(self.groups.items()):
            self._leave(group, [i for i, r in enumerate(group.rows) if r.job.cancelled], cancelled=True)
            if group.rows:
                self._step(group)
            if not group.rows:
                del self.groups[label]
            self.outbox.flush()  # each batch's tokens as soon as its step is done

    def _step(self, group: Group) -> None:
        meter = Meter(device=self.runner.device)
        t0 = time.perf_counter()
        try:
            logits = group.decoding.step(group.last, meter)
            last = self._choose(logits, group.rows)
        except Exception as e:  # noqa: BLE001  (its rows fail; the loop and the other batches go on)
            self.failed += 1
            for row in group.rows:
                self.outbox.post(row.job, ("error", e))
            group.rows = []
            return
        seconds = time.perf_counter() - t0
        n = len(group.rows)
        self.steps[n] += 1
        c = meter.costs
        for row, d, m in zip(group.rows, split(c.decode_flops, [1] * n), split(c.method_decode_flops, [1] * n),
                             strict=True):  # fmt: skip
            row.usage["decode_flops"] += d
            row.usage["method_flops"] += m
            row.usage["forward_s"] += seconds
            row.batch = max(row.batch, n)
        if self.metrics is not None:
            self.metrics.decode_step(n, seconds)
        self._advance(group, last)

    def _choose(self, logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """Each row's next token: its argmax, or its own seeded draw (as its batch of one draws)."""
        tok = logits.argmax(-1)
        for i, row in enumerate(rows):
            if row.gen is not None:
                tok[i] = choose(logits[i : i + 1], row.sampling, row.gen)[0]
        return tok

    def _advance(self, group: Group, last: torch.Tensor) -> None:
        """Give each row its new token (sent at once); the rows that are done leave. A row whose client left
        while this step ran leaves as cancelled (nothing more is sent to it: it is not finished for nobody)."""
        group.last = last
        done, gone = [], set()
        for i, (row, t) in enumerate(zip(group.rows, last.tolist(), strict=True)):
            if row.job.cancelled:
                done.append(i)
                gone.add(i)
                continue
            row.tokens.append(t)
            if t not in self.stops:
                self.outbox.post(row.job, ("token", t))
            if t in self.stops or len(row.tokens) >= row.job.payload.max_tokens:
                done.append(i)
        self._leave(group, done, cancelled=gone)

    def _leave(self, group: Group, rows: list[int], cancelled: bool | set = False) -> None:
        """Rows `rows` leave the batch (their cache rows freed): finished, or cancelled (`cancelled`: all of them,
        or the set of those that were)."""
        if not rows:
            return
        n = len(group.rows)
        peak = split(
            group.decoding.cache.attention_bytes(), [1] * n
        )  # the cache is largest before rows leave
        gone = set(rows)
        for i in rows:
            row = group.rows[i]
            row.usage["kv_bytes_peak"] = max(row.usage["kv_bytes_peak"], peak[i])
            if cancelled is True or (cancelled and i in cancelled):
                self.cancelled += 1
            else:
                self._finish(row)
        stay = [i for i in range(n) if i not in gone]
        if stay:
            keep = torch.tensor(stay, device=group.last.device)
            group.decoding.keep(keep)
            group.last = group.last.index_select(0, keep)
        group.rows = [group.rows[i] for i in stay]

    def _finish(self, row: Row) -> None:
        p = row.job.payload
        row.job.finished = True  # computed to the end (a client that leaves now left too late to save work)
        tokens = [t for t in row.tokens if t not in self.stops]
        self.outbox.post(row.job, ("done", {
            "tokens": tokens, "finish_reason": "length" if len(tokens) >= p.max_tokens else "stop",
            "usage": row.usage, "batch": row.batch,  # a Counter: a line it never ran (no decode step) is 0
        }))  # fmt: skip
