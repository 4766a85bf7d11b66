"""A chat completion's answer, built from the events the model thread sends its request (serve/engine.py, jobs.py):
`whole()` the `chat.completion` object once every choice has ended; `stream()` server-sent events as the tokens
come (text that may still become a stop string, or ends inside a character, is held back), each choice's end,
the usage, then `[DONE]`; `logprobs` in OpenAI's shape (docs/serving.md, "POST /v1/chat/completions"). A
request whose client has gone is cancelled (`Job.cancel`) and nothing is sent to it ("Cancellation").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

from trimvlm.serve.errors import ApiError, as_api_error
from trimvlm.serve.jobs import ChoiceEnd, Done, Failed, Token
from trimvlm.serve.stops import token_start


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


class TextStream:
    """One choice's text as its tokens come, piece by piece, decoded as `vlm.generate` decodes the whole: `push`
    returns the new text that may be sent ("" while the decoded text ends inside a character or could still
    become a stop string) and the log-probability entries of the tokens whose text has begun to be sent;
    `end(text, logprobs)` what the final text and entries add to those."""

    def __init__(self, tokenizer, stop=None):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids, self.text, self.sent = [], "", ""
        self.starts, self.entries, self.given = [], [], 0  # per token where its text starts; entries sent

    def push(self, token: int, entry=None) -> tuple[str, list]:
        self.ids.append(token)
        if entry is not None:
            self.entries.append(entry)
        now = self.tokenizer.decode(self.ids, skip_special_tokens=True).strip()
        self.starts.append(token_start(self.text, now))
        self.text = now
        ok = len(now) if self.stop is None else self.stop.safe(now)
        if now.endswith("\ufffd"):
            ok = min(ok, len(now) - 1)
        piece = ""
        if ok > len(self.sent) and now.startswith(self.sent):
            piece, self.sent = now[len(self.sent) : ok], now[:ok]
        return piece, self._entries(lambda k: self.starts[k] < len(self.sent))

    def end(self, text: str, entries: list) -> tuple[str, list]:
        self.entries = entries
        return (text[len(self.sent) :] if text.startswith(self.sent) else ""), self._entries(lambda k: True)

    def _entries(self, sent) -> list:
        out = []
        while self.given < len(self.entries) and sent(self.given):
            out.append(self.entries[self.given])
            self.given += 1
        return out


async def disconnected(request) -> None:
    """Returns when the client has gone (the body is read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def answered(state, request, job):
    """A queued job's result, or ClientGone (the job cancelled: never computed if it has not started) when the
    client closes the connection first. What its batch raised is its answer (`as_api_error`: a trimvlm error 400,
    the model's failure 500)."""
    work = asyncio.ensure_future(state.batcher.result(job))
    gone = asyncio.ensure_future(disconnected(request))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if work not in done:
        work.cancel()
        cancel(state, job)
        raise ClientGone()
    try:
        return work.result()
    except Exception as e:  # noqa: BLE001
        raise as_api_error(e) from e


def cancel(state, job) -> None:
    """The client has gone: its request is not computed further (it leaves its queue or its batch), counted by
    the stage it had reached."""
    if not job.cancelled:
        stage = "finished" if job.finished else "running" if job.started else "queued"
        job.cancel()
        state.metrics.cancels.labels(stage=stage).inc()


def served(recipe: str, job, t0: float) -> dict:
    """The server's part of an answer's `usage`: the recipe, the time queued and the server's latency."""
    return {"recipe": recipe, "queue_s": job.started - job.enqueued, "server_latency_s": time.perf_counter() - t0}


class ChatReply:
    def __init__(self, state, request, job, *, model: str, recipe: str, t0: float):
        self.state, self.request, self.job = state, request, job
        self.model, self.recipe, self.t0 = model, recipe, t0
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        self._last = None  # when the previous token came (inter-token latency)
        self._first = None  # when the first token came
        self._gone = None

    # ---- events ----
    async def _next(self):
        """The next event, or ClientGone when the client closes the connection first."""
        if self._gone is None:
            self._gone = asyncio.ensure_future(disconnected(self.request))
        get = asyncio.ensure_future(self.job.payload.events.get())
        done, _ = await asyncio.wait({get, self._gone}, return_when=asyncio.FIRST_COMPLETED)
        if get not in done:
            get.cancel()
            self.cancel()
            raise ClientGone()
        return self._seen(get.result())

    def _seen(self, event):
        now = time.perf_counter()
        metrics = self.state.metrics
        if isinstance(event, Token):
            if self._last is None:
                self._first = now
                metrics.ttft.observe(now - self.t0)
            else:
                metrics.itl.observe(now - self._last)
            self._last = now
        elif isinstance(event, Failed):
            raise as_api_error(event.error)
        return event

    def cancel(self) -> None:
        cancel(self.state, self.job)
        self._stop_watching()

    def _stop_watching(self) -> None:
        if self._gone is not None:
            self._gone.cancel()
            self._gone = None

    # ---- the answer ----
    def _usage(self, result: Done, ends: dict) -> dict:
        u, p = result.usage, self.job.payload
        completion = sum(e.completion_tokens for e in ends.values())
        model_flops = u["vision_flops"] + u["prefill_flops"] + u["decode_flops"]
        forward = u["forward_s"]
        return {
            "prompt_tokens": p.prompt_tokens, "completion_tokens": completion, "total_tokens": p.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": u["prefix_tokens_reused"]},
            "vision_flops": u["vision_flops"], "prefill_flops": u["prefill_flops"], "decode_flops": u["decode_flops"],
            "model_flops": model_flops, "method_flops": u["method_flops"], "total_flops": model_flops + u["method_flops"],
            "kv_bytes": u["kv_bytes"], "kv_bytes_peak": u["kv_bytes_peak"], "state_bytes": u["state_bytes"],
            "prefix_reused": bool(u["prefix_reused"]), "prefix_tokens_reused": u["prefix_tokens_reused"],
            "request_cached": p.request_cached,
            "preprocess_s": p.preprocess_s, "forward_s": forward, "latency_s": p.preprocess_s + forward,
            "batch_requests": result.batch, **served(self.recipe, self.job, self.t0),
            # the engine's time to first token (queued -> sent by the model thread) and the server's (received ->
            # the first token here)
            "engine_ttft_s": u.get("engine_ttft_s"),
            "server_ttft_s": None if self._first is None else self._first - self.t0,
        }  # fmt: skip

    def _logprobs(self, entries: list) -> dict | None:
        """OpenAI's `logprobs` of a choice (or of a chunk) from the engine's entries (`jobs.LogProb`); None when
        the request did not ask for them."""
        if self.job.payload.logprobs is None:
            return None
        tok = self.state.vlm.tokenizer

        def one(i: int, lp: float) -> dict:
            text = tok.decode([i])
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        return {"content": [one(e.token, e.logprob) | {"top_logprobs": [one(j, q) for j, q in e.top]}
                            for e in entries], "refusal": None}  # fmt: skip

    async def whole(self):
        ends = {}
        try:
            while True:
                event = await self._next()
                if isinstance(event, ChoiceEnd):
                    ends[event.choice] = event
                elif isinstance(event, Done):
                    break
        finally:
            self._stop_watching()
        choices = [{
            "index": i, "message": {"role": "assistant", "content": e.text},
            "logprobs": self._logprobs(e.logprobs), "finish_reason": e.finish_reason,
        } for i, e in sorted(ends.items())]  # fmt: skip
        return {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
            "choices": choices, "usage": self._usage(event, ends),
        }  # fmt: skip

    def chunk(self, index: int | None, delta: dict, finish=None, usage=None, logprobs=None) -> str:
        c = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
             "choices": [] if index is None else [{"index": index, "delta": delta, "logprobs": logprobs,
                                                   "finish_reason": finish}]}  # fmt: skip
        if usage is not None:
            c["usage"] = usage
        return f"data: {json.dumps(c)}\n\n"

    async def stream(self):
        """The event stream's response, once the first token (or the result) is there: an error before it is
        still the request's status code."""
        from fastapi.responses import StreamingResponse

        first = await self._next()
        self._stop_watching()  # from here Starlette watches the connection and cancels the stream
        return StreamingResponse(self._events(first), media_type="text/event-stream")

    async def _events(self, first):
        p = self.job.payload
        tok = self.state.vlm.tokenizer
        texts = [TextStream(tok, p.stop) for _ in range(p.n)]
        for i in range(p.n):
            yield self.chunk(i, {"role": "assistant", "content": ""})
        event, finished, ends = first, False, {}
        try:
            while True:
                if isinstance(event, Token):
                    piece, entries = texts[event.choice].push(event.token, event.logprob)
                    if piece or entries:
                        yield self.chunk(event.choice, {"content": piece}, logprobs=self._logprobs(entries))
                elif isinstance(event, ChoiceEnd):
                    ends[event.choice] = event
                    rest, entries = texts[event.choice].end(event.text, event.logprobs)
                    if rest or entries:
                        yield self.chunk(event.choice, {"content": rest}, logprobs=self._logprobs(entries))
                    if p.n > 1:
                        yield self.chunk(event.choice, {}, event.finish_reason)
                elif isinstance(event, Done):
                    finished = True
                    usage = self._usage(event, ends)
                    if p.n == 1:
                        yield self.chunk(0, {}, ends[0].finish_reason, usage)
                    else:
                        yield self.chunk(None, {}, usage=usage)
                    yield "data: [DONE]\n\n"
                    return
                event = self._seen(await self.job.payload.events.get())
        except ApiError as e:
            finished = True
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            if not finished:  # the stream was cancelled: the client has gone
                with contextlib.suppress(Exception):
                    self.cancel()
