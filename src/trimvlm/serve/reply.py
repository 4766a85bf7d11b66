"""A chat completion's answer, built from what the model thread sends its request (serve/engine.py): a token at
each step, then the result (or an error).

- `whole()`: the `chat.completion` object, once the result is there.
- `stream()`: server-sent events as the tokens come: a role chunk when the first token is there, a chunk per
  token with the new text (a token that ends inside a character waits for the next), a last chunk with
  `finish_reason` and `usage`, then `[DONE]`. An error before the first token is the request's status code
  (500, 400); after it the stream ends with an error event.

A request whose client closes the connection is cancelled (`Job.cancel`): still queued, it is never computed;
running, its row leaves the batch at the next step. Nothing is sent to a gone client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

from trimvlm.serve.errors import ApiError, as_api_error


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


class TextStream:
    """The text of a growing list of tokens, piece by piece, decoded as `vlm.generate` decodes the whole: `push`
    returns the new text ("" while the decoded prefix ends inside a character or is not yet a prefix of what
    was sent); `rest(text)` is what the final text adds to the pieces."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        now = self.tokenizer.decode(self.ids, skip_special_tokens=True).strip()
        if len(now) > len(self.sent) and now.startswith(self.sent) and not now.endswith("\ufffd"):
            piece, self.sent = now[len(self.sent) :], now
            return piece
        return ""

    def rest(self, text: str) -> str:
        return text[len(self.sent) :] if text.startswith(self.sent) else ""


async def disconnected(request) -> None:
    """Returns when the client has gone (the body is read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request, awaitable):
    """The awaitable's result, or ClientGone when the client closes the connection first (the awaitable is then
    cancelled: a queued job is never run)."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(disconnected(request))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if work not in done:
        work.cancel()
        raise ClientGone()
    return work.result()


class ChatReply:
    def __init__(self, state, request, job, *, model: str, recipe: str, t0: float):
        self.state, self.request, self.job = state, request, job
        self.model, self.recipe, self.t0 = model, recipe, t0
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        self.tokens = 0
        self._last = None  # when the previous token came (inter-token latency)
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
        kind, value = event
        now = time.perf_counter()
        metrics = self.state.metrics
        if kind == "token":
            if self._last is None:
                metrics.first_token(now - self.t0)
            else:
                metrics.inter_token(now - self._last)
            self._last = now
        elif kind == "error":
            raise as_api_error(value)
        return kind, value

    def cancel(self) -> None:
        """The client has gone: the request is not computed further (it leaves its queue or its batch)."""
        if not self.job.cancelled:
            self.job.cancel()
            stage = "finished" if self.job.finished else "running" if self.job.started else "queued"
            self.state.metrics.cancelled(stage)
        self._stop_watching()

    def _stop_watching(self) -> None:
        if self._gone is not None:
            self._gone.cancel()
            self._gone = None

    # ---- the answer ----
    def _usage(self, result: dict) -> dict:
        u, p = result["usage"], self.job.payload
        n = len(result["tokens"])
        model_flops = u["vision_flops"] + u["prefill_flops"] + u["decode_flops"]
        forward = u["forward_s"]
        return {
            "prompt_tokens": p.prompt_tokens, "completion_tokens": n, "total_tokens": p.prompt_tokens + n,
            "vision_flops": u["vision_flops"], "prefill_flops": u["prefill_flops"], "decode_flops": u["decode_flops"],
            "model_flops": model_flops, "method_flops": u["method_flops"], "total_flops": model_flops + u["method_flops"],
            "kv_bytes": u["kv_bytes"], "kv_bytes_peak": u["kv_bytes_peak"], "state_bytes": u["state_bytes"],
            "prefix_reused": bool(u["prefix_reused"]), "prefix_tokens_reused": u["prefix_tokens_reused"],
            "request_cached": p.request_cached,
            "preprocess_s": p.preprocess_s, "forward_s": forward, "latency_s": p.preprocess_s + forward,
            "batch_requests": result["batch"], "recipe": self.recipe,
            "queue_s": self.job.started - self.job.enqueued, "server_latency_s": time.perf_counter() - self.t0,
        }  # fmt: skip

    def _text(self, tokens: list[int]) -> str:
        return self.state.vlm.tokenizer.decode(tokens, skip_special_tokens=True).strip()

    async def whole(self):
        from fastapi.responses import Response

        try:
            while True:
                kind, value = await self._next()
                if kind == "done":
                    break
        except ClientGone:
            return Response(status_code=499)  # nobody reads it (uvicorn sends nothing to a closed connection)
        finally:
            self._stop_watching()
        return {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": self._text(value["tokens"])},
                         "finish_reason": value["finish_reason"]}],
            "usage": self._usage(value),
        }  # fmt: skip

    def chunk(self, delta: dict, finish=None, usage=None) -> str:
        c = {
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }  # fmt: skip
        if usage is not None:
            c["usage"] = usage
        return f"data: {json.dumps(c)}\n\n"

    async def stream(self):
        """The event stream's response, once the first token (or the result) is there: an error before it is
        still the request's status code."""
        from fastapi.responses import Response, StreamingResponse

        try:
            first = await self._next()
        except ClientGone:
            return Response(status_code=499)
        self._stop_watching()  # from here Starlette watches the connection and cancels the stream
        return StreamingResponse(self._events(first), media_type="text/event-stream")

    async def _events(self, first):
        text = TextStream(self.state.vlm.tokenizer)
        yield self.chunk({"role": "assistant", "content": ""})
        event, finished = first, False
        try:
            while True:
                kind, value = event
                if kind == "done":
                    finished = True
                    rest = text.rest(self._text(value["tokens"]))
                    if rest:
                        yield self.chunk({"content": rest})
                    yield self.chunk({}, value["finish_reason"], self._usage(value))
                    yield "data: [DONE]\n\n"
                    return
                piece = text.push(value)
                if piece:
                    yield self.chunk({"content": piece})
                kind, value = event = self._seen(await self.job.payload.events.get())
        except ApiError as e:
            finished = True
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            if not finished:  # the stream was cancelled: the client has gone
                with contextlib.suppress(Exception):
                    self.cancel()
