"""Step-level continuous batching of chat completions, on the model thread (the scheduler calls it; docs/serving.md,
"Scheduling").

`admit(jobs)`: one `Runner.prefill` over requests of one recipe (each prepared alone), their first tokens sent,
their rows joining the running decode batch of that recipe (`Decoding.join`); a prompt whose earlier turns are in
the prefix cache prefills only its new tokens, a long one is prefilled in chunks (`prefill_chunk`). `step()`: one
decode step of every running batch, each row's token sent at once; a row that stopped, reached its `max_tokens`
or whose client has gone leaves at that step. A row is one choice of a request: the n rows of a request read its
prompt's KV as a shared prefix, and each draws as the request alone does (its own seeded generator, after its
penalties). A request's `usage` is its share of each model call it took part in.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from trimvlm.decision.costs import split
from trimvlm.plan import make_plan
from trimvlm.runtime.generate import Decoding, Sampling, choose
from trimvlm.runtime.meter import Meter
from trimvlm.runtime.prefix_cache import store
from trimvlm.serve.jobs import ChoiceEnd, Done, Failed, JobKey, LogProb, Token, call_soon
from trimvlm.serve.stops import token_start


@dataclass
class Row:
    """One choice of a request decoding: its sampler, its tokens and what its answer needs."""

    job: object  # jobs.Job; its payload is a chat.ChatJob
    index: int  # its choice among the request's n
    sampling: Sampling
    gen: torch.Generator | None
    counts: torch.Tensor | None = None  # [V] each token's generations so far (the penalties)
    tokens: list[int] = field(default_factory=list)  # generated, the stop token included
    text: str = ""  # its text so far (rows with stop strings)
    starts: list[int] = field(default_factory=list)  # where each token's text begins in it (stops.token_start)
    logprobs: list[LogProb] = field(default_factory=list)  # per token
    cut: int | None = None  # where a stop string begins in the text
    reason: str = "length"


@dataclass
class Partial:
    """The prompt being prefilled in chunks: its request, the chunked prefill, its plan, the seconds run so far."""

    job: object
    work: object  # the runner's chunked prefill (`Runner.prefill_chunked`)
    plan: object
    seconds: float


@dataclass
class Group:
    """Rows decoding together (one recipe; or the n choices of one request, off its shared prompt KV): its rows
    (in cache order) and each row's newest token."""

    rows: list[Row]
    decoding: Decoding
    last: torch.Tensor  # [B] long


class Outbox:
    """Events for the requests' tasks (jobs.py: `Token`, `ChoiceEnd`, `Done`, `Failed`), handed to their event
    loop together once a model call is done (one wake-up of the loop per step, not one per row)."""

    def __init__(self):
        self.items: dict[object, list] = {}  # event loop -> [(a request's event queue, an event)]

    def post(self, job, event) -> None:
        self.items.setdefault(job.loop, []).append((job.payload.events, event))

    def flush(self) -> None:
        by_loop, self.items = self.items, {}
        for loop, items in by_loop.items():
            call_soon(loop, _deliver, items)


def _deliver(items) -> None:
    for events, event in items:
        events.put_nowait(event)


class ChatEngine:
    kinds = frozenset({"chat"})

    def __init__(self, vlm, metrics=None, load=None):
        self.vlm, self.runner, self.metrics = vlm, vlm.runner, metrics
        self.load = load  # a serve.budgets.LoadBudget told what each prefill and step took, or None
        self.stops = set(vlm.stop_ids())
        self.groups: dict[object, Group] = {}
        self.steps: Counter[int] = Counter()  # rows in a decode call -> calls
        self.cancelled = 0  # rows that left because their client had gone
        self.failed = 0
        self.outbox = Outbox()
        self.partial: Partial | None = None  # the prompt prefilled in chunks
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
    def admit(self, jobs: list, chunk: int) -> None:
        """Prefill `jobs` (one recipe) and let their rows join the running batch. If the prefill raises, each
        request is tried alone, so one that breaks the model fails only itself. A request whose earlier turns
        are in the prefix cache prefills only its new tokens on top of them. `chunk`: a lone request whose
        prompt is longer is prefilled `chunk` tokens now and the rest over the next turns (`prefill_chunk`),
        when its recipe changes nothing inside the prefill (`Runner.prefill_chunked`); else it is prefilled whole."""
        t0 = time.perf_counter()
        for job in jobs:
            job.started, job.batch = t0, len(jobs)
            job.payload.batch = len(jobs)
        plan = make_plan(jobs[0].payload.recipe, self.runner)
        rest = []
        for job in jobs:  # one whose earlier turns are stored: only its new tokens, on top of them (all now)
            stored = self._earlier(job, plan)
            if stored is None:
                rest.append(job)
            elif part := self._chunked(job, plan, prefix=stored.entry):
                self._advance_chunked(part, part.work.left)
        long = len(rest) == 1 and self.prefill_tokens(rest[0]) > chunk
        if long and not self.partial and plan.chunkable and not self._stored(rest[0]):
            self.partial = self._chunked(rest[0], plan)
            self.prefill_chunk(chunk)
        elif rest:
            self._admit(rest, plan)
        self.outbox.flush()

    def _stored(self, job) -> bool:
        cache, key = self.runner.prefix_cache, job.payload.prompt_key
        return cache is not None and key is not None and key in cache

    def _earlier(self, job, plan):
        """The prefix-cache entry of the request's earlier turns (its prompt's start), when its own prompt is
        not stored and the plan lets a prompt be prefilled on top of a stored one; else None."""
        cache, p = self.runner.prefix_cache, job.payload
        if cache is None or p.prefix_key is None or not (plan.reuses_prompts and plan.chunkable):
            return None
        if self._stored(job) or p.prefix_key not in cache:
            return None
        return cache.get(p.prefix_key)

    def _fail(self, jobs, error: BaseException) -> None:
        """A model call raised: its requests are answered `error` (the loop and the other requests go on)."""
        self.failed += 1
        for job in dict.fromkeys(jobs):  # (a job is hashed as itself)
            self.outbox.post(job, Failed(error))

    def _admit(self, jobs: list, plan) -> None:
        t0 = time.perf_counter()
        meter = Meter(device=self.runner.device)
        parts, keys = [j.payload.prepared for j in jobs], [j.payload.prompt_key for j in jobs]
        try:
            out, found = self.runner.prefill_prompts(parts, plan, meter=meter, keys=keys)
        except Exception as e:  # noqa: BLE001  (a model error must not end the loop)
            if len(jobs) == 1:
                return self._fail(jobs, e)
            self.failed += 1
            for job in jobs:
                self._admit([job], plan)
            return
        reused = [j.payload.prompt_tokens if hit else 0 for j, hit in zip(jobs, found, strict=True)]
        self._start(jobs, plan, out, meter, time.perf_counter() - t0, reused)

    # ---- chunked prefill (one long prompt at a time, a chunk per turn) ----
    def _chunked(self, job, plan, prefix=None) -> Partial | None:
        """The request's prefill to be run in chunks (on top of `prefix`, a stored entry), or None (it failed)."""
        try:
            t0 = time.perf_counter()
            work = self.runner.prefill_chunked(job.payload.prepared, plan, meter=Meter(device=self.runner.device),
                                               prefix=prefix)  # fmt: skip
        except Exception as e:  # noqa: BLE001
            return self._fail([job], e)
        return Partial(job, work, plan, time.perf_counter() - t0)

    def prefill_chunk(self, tokens: int) -> int:
        """Run the next chunk (at most `tokens` positions) of the prompt being prefilled in chunks; once it is
        done its rows join the running batch (their first tokens sent). The positions run (0: none pending)."""
        part = self.partial
        if not part:
            return 0
        if part.job.cancelled:  # its client has gone: no more of it is computed
            self.partial = None
            self.cancelled += 1
            return 0
        n = min(tokens, part.work.left)
        if self._advance_chunked(part, n):
            self.partial = None
        self.outbox.flush()
        return n

    def _advance_chunked(self, part: Partial, n: int) -> bool:
        """Run `n` more positions of a chunked prefill; once it is done (True; or failed) its prompt is stored
        (where its recipe reuses prompts) and its rows join the running batch."""
        t0 = time.perf_counter()
        try:
            out = part.work.advance(n)
        except Exception as e:  # noqa: BLE001
            self._fail([part.job], e)
            return True
        self.chunks += part is self.partial  # (the rest of a continued conversation is not counted a chunk)
        part.seconds += time.perf_counter() - t0
        if out is None:
            return False
        cache, p = self.runner.prefix_cache, part.job.payload
        if part.plan.reuses_prompts and cache is not None and p.prompt_key is not None:
            store(cache, p.prompt_key, out, 0, p.prepared.n_images[0], p.prompt_tokens)
        self._start([part.job], part.plan, out, part.work.meter, part.seconds, [part.work.reused])
        return True

    # ---- the rows of prefilled requests ----
    def _start(self, jobs: list, plan, out, meter: Meter, seconds: float, reused: list[int]) -> None:
        """The prefilled requests' rows: their first tokens chosen and sent; those still going join the running
        batch of their recipe (n > 1 choices too, off their shared prompt KV; where caches cannot be joined,
        recurrent prefix states, they decode as a group of their own)."""
        group, logits = self._group(jobs, plan, out, meter, seconds, reused)
        self._advance(group, logits)
        if not group.rows:
            return
        key = JobKey(jobs[0].key.kind, jobs[0].key.recipe)  # an n > 1 request's own batch key joins its recipe's
        old = self.groups.get(key)
        if old is None:
            self.groups[key] = group
            return
        try:
            old.decoding.join(group.decoding)
        except ValueError:
            self.groups[dataclasses.replace(key, alone=str(id(group)))] = group
            return
        old.rows += group.rows
        old.last = torch.cat([old.last, group.last])

    def _group(self, jobs: list, plan, out, meter: Meter, seconds: float, reused: list[int]):
        """(the decode group of prefilled `jobs`, its rows' first logits): each row's sampler; each request's
        share of the prefill (none for one whose prompt was found whole in the prompt cache)."""
        runner, payloads = self.runner, [j.payload for j in jobs]
        rows, owner = [], []
        for b, (job, p) in enumerate(zip(jobs, payloads, strict=True)):
            p.open = p.n
            for i in range(p.n):  # choice i draws as the request alone with seed + i
                s = dataclasses.replace(p.sampling, seed=p.sampling.seed + i)
                gen = torch.Generator(device=runner.device).manual_seed(s.seed) if s.temperature > 0 else None
                counts = torch.zeros(out.logits.shape[-1], device=out.logits.device) if s.penalized else None
                rows.append(Row(job=job, index=i, sampling=s, gen=gen, counts=counts))
                owner.append(b)
        c, ones = meter.costs, [1] * len(jobs)
        ran = [0 if r == p.prompt_tokens else 1 for r, p in zip(reused, payloads, strict=True)]
        image = runner.adapter.image_token_id
        kv, peak, states = c.kv_bytes, c.kv_bytes_peak, c.state_bytes
        if any(reused):  # KV this prefill did not write (read from the prefix cache): what the batch holds
            kv = peak = out.cache.attention_bytes()
            states = out.cache.state_bytes()
        shares = {
            "vision_flops": split(c.flops.get("vision", 0),
                                  [r * int((p.prepared.input_ids == image).sum()) for r, p in zip(ran, payloads, strict=True)]),
            "prefill_flops": split(c.flops.get("prefill", 0), ran),
            "method_flops": split(c.method_prefill_flops, ran),
            "kv_bytes": split(kv, ones), "kv_bytes_peak": split(peak, ones), "state_bytes": split(states, ones),
            "prefix_reused": [int(r > 0) for r in reused], "prefix_tokens_reused": reused,
        }  # fmt: skip
        for i, p in enumerate(payloads):
            p.usage.update({k: v[i] for k, v in shares.items()})
            p.usage["forward_s"] += seconds
        if self.metrics is not None:
            self.metrics.prefill(len(jobs), sum(p.prompt_tokens for p in payloads))
        if self.load is not None:
            self.load.prefilled(jobs[0].key.recipe, sum(ran), sum(p.prompt_tokens - r for p, r in zip(payloads, reused,
                                                                                          strict=True)), seconds)  # fmt: skip
        idx = torch.tensor(owner, device=out.next_pos.device)
        cache, logits = out.cache, out.logits
        if len(rows) > len(jobs):  # n > 1 (a request alone): its rows branch off its prompt, nothing copied
            cache, logits = cache.share_prefix(idx), logits.index_select(0, idx)
        skip = plan.skip_decode
        if isinstance(skip, torch.Tensor):
            skip = skip.index_select(0, idx.to(skip.device))
        decoding = Decoding(runner, cache, out.next_pos.index_select(0, idx).clone(), skip)
        return Group(rows, decoding, torch.zeros(len(rows), dtype=torch.long, device=idx.device)), logits

    def abort(self, error: Exception) -> None:
        """Answer every running request `error` and drop its rows (the server stops)."""
        jobs = [r.job for g in self.groups.values() for r in g.rows] + ([self.partial.job] if self.partial else [])
        for job in dict.fromkeys(jobs):
            self.outbox.post(job, Failed(error))
        self.groups, self.partial = {}, None
        self.outbox.flush()

    # ---- decoding ----
    def step(self) -> None:
        """One decode step of every running group."""
        for key, group in list(self.groups.items()):
            self._leave(group, [i for i, r in enumerate(group.rows) if r.job.cancelled])
            if group.rows:
                self._step(group)
            if not group.rows:
                del self.groups[key]
            self.outbox.flush()  # each group's tokens as soon as its step is done

    def _step(self, group: Group) -> None:
        meter = Meter(device=self.runner.device)
        t0 = time.perf_counter()
        try:
            logits = group.decoding.step(group.last, meter)
        except Exception as e:  # noqa: BLE001  (its rows fail; the loop and the other groups go on)
            self._fail([r.job for r in group.rows], e)
            group.rows = []
            return
        seconds = time.perf_counter() - t0
        n = len(group.rows)
        self.steps[n] += 1
        c = meter.costs
        for row, d, m in zip(group.rows, split(c.decode_flops, [1] * n), split(c.method_decode_flops, [1] * n),
                             strict=True):  # fmt: skip
            u = row.job.payload.usage
            u["decode_flops"] += d
            u["method_flops"] += m
            row.job.payload.batch = max(row.job.payload.batch, n)
        for job in dict.fromkeys(r.job for r in group.rows):
            job.payload.usage["forward_s"] += seconds
        if self.metrics is not None:
            self.metrics.decode_step(n, seconds)
        if self.load is not None:
            self.load.stepped(seconds)
        self._advance(group, logits)

    def _choose(self, logits: torch.Tensor, rows: list[Row]) -> tuple[torch.Tensor, list]:
        """Each row's next token (its argmax, or its own seeded draw as its batch of one draws; its penalties
        first) and, for a request that asked for them, the token's log-probability and the top ones (of the
        model's distribution: before the penalties and the temperature)."""
        tok = logits.argmax(-1)
        lps = [None] * len(rows)
        for i, row in enumerate(rows):
            if row.gen is not None or row.counts is not None:
                counts = None if row.counts is None else row.counts[None]
                tok[i] = choose(logits[i : i + 1], row.sampling, row.gen, counts)[0]
            k = row.job.payload.logprobs
            if k is not None:
                lp = torch.log_softmax(logits[i].float(), -1)
                t = int(tok[i])
                top = torch.topk(lp, k)
                pairs = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
                lps[i] = LogProb(t, float(lp[t]), pairs)
        return tok, lps

    def _text(self, tokens: list[int]) -> str:
        return self.vlm.tokenizer.decode(tokens, skip_special_tokens=True).strip()

    def _advance(self, group: Group, logits: torch.Tensor) -> None:
        """Choose each row's new token from `logits` and send it at once; the rows that are done leave: the
        stop token, a stop string in the text, or `max_tokens`. A row whose client left while this step ran
        leaves as cancelled (nothing more is sent to it: it is not finished for nobody)."""
        last, lps = self._choose(logits, group.rows)
        group.last = last
        done = []
        for i, (row, t) in enumerate(zip(group.rows, last.tolist(), strict=True)):
            p = row.job.payload
            if row.job.cancelled:
                done.append(i)
                continue
            row.tokens.append(t)
            if row.counts is not None:
                row.counts[t] += 1
            if t in self.stops:
                row.reason = "stop"
                done.append(i)
                continue
            if lps[i] is not None:
                row.logprobs.append(lps[i])
            if "engine_ttft_s" not in p.usage:  # queued -> its first token sent by this thread
                p.usage["engine_ttft_s"] = time.perf_counter() - row.job.enqueued
            self.outbox.post(row.job, Token(row.index, t, lps[i]))
            if p.stop is not None:
                text = self._text([x for x in row.tokens if x not in self.stops])
                row.starts.append(token_start(row.text, text))
                row.text, row.cut = text, p.stop.find(text)
                if row.cut is not None:
                    row.reason = "stop"
                    done.append(i)
                    continue
            if len(row.tokens) >= p.max_tokens:  # (its reason stays "length")
                done.append(i)
        self._leave(group, done)

    def _leave(self, group: Group, rows: list[int]) -> None:
        """Rows `rows` leave the group (their cache rows freed): finished, or cancelled (their client has gone)."""
        if not rows:
            return
        n = len(group.rows)
        peak = split(group.decoding.cache.attention_bytes(), [1] * n)  # the cache is largest before rows leave
        held: Counter = Counter()
        for row, b in zip(group.rows, peak, strict=True):
            held[id(row.job)] += b
        gone = set(rows)
        for i in rows:
            row = group.rows[i]
            u = row.job.payload.usage
            u["kv_bytes_peak"] = max(u["kv_bytes_peak"], held[id(row.job)])
            if row.job.cancelled:
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
        """Send the row's choice (`ChoiceEnd`), and the request's result (`Done`) once all its rows are done."""
        p = row.job.payload
        tokens = [t for t in row.tokens if t not in self.stops]
        text, logprobs = self._text(tokens), row.logprobs
        if row.cut is not None:
            text = text[: row.cut]
            logprobs = logprobs[: sum(1 for start in row.starts if start < row.cut)]
        self.outbox.post(row.job, ChoiceEnd(row.index, text, len(tokens), row.reason, logprobs))
        p.open -= 1
        if p.open == 0:
            row.job.finished = True  # computed to the end (a client that leaves now left too late to save work)
            self.outbox.post(row.job, Done(p.usage, p.batch))
