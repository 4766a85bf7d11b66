"""`POST /v1/chat/completions`: OpenAI-style chat completions, answered by `VLM.generate`.

The conversation is one user message (trimvlm's `generate` renders one user turn): its `content` is text, or a
list of `{"type": "text", "text"}` and `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`
parts. The images go first, in their order, then the text parts joined by newlines (where the parts stood
among the text is not kept: the model's prompt format places the images). Images come only as base64 data
URLs; a URL is never fetched.

Fields: `model`?, `messages`, `max_tokens` / `max_completion_tokens` (default and limit: the server's),
`temperature` (default 0: greedy), `top_p`, `seed`, `stream`, `stream_options` (accepted; the usage is always
sent), `n` (1 only), `user` (ignored), and trimvlm's `recipe` extension. Unknown fields: 422.

Scheduling: continuous batching at the step level (serve/scheduler.py, serve/engine.py): a request is admitted
between two decode steps, prefilled, and joins the running decode batch; each row is what the request alone
returns from `vlm.generate`, greedy or sampled with its seed.

Streaming: `data: {chunk}` server-sent events (a role chunk, one chunk per token's new text as the step that
made it ends, a last chunk with `finish_reason` and `usage`), then `data: [DONE]` (serve/reply.py).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import re
import time
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trimvlm.errors import TrimVLMError
from trimvlm.serve.errors import ApiError, from_trimvlm


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: str | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL | str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] | None = None
    name: str | None = None


class ChatBody(_Strict):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int | None = None
    user: str | None = None
    recipe: str | None = None  # trimvlm's extension


@dataclass
class ChatJob:
    prepared: object  # the request alone, prepared on the preparation thread (collated into its batch)
    prompt_tokens: int
    recipe: object
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stream: bool
    preprocess_s: float
    events: asyncio.Queue  # what the model thread sends this request: its tokens, then its result (engine.py)
    prompt_key: bytes | None = None  # its key in the prompt cache (runtime/prefix_cache.py), made when prepared
    request_cached: bool = False  # it was found prepared in the request cache


DATA_URL = re.compile(r"data:image/[\w.+-]+;base64,(.*)", re.DOTALL)


def parse(body: dict, limits) -> tuple[ChatBody, str, list[str], int]:
    """(the body, the prompt, the images' base64 texts, max_tokens), or a 422 / 400."""
    try:
        req = ChatBody.model_validate(body)
    except ValidationError as e:
        detail = [
            {"loc": ["body", *item["loc"]], "msg": item["msg"], "type": item["type"]}
            for item in e.errors(include_url=False)
        ]
        raise ApiError(422, detail) from e
    if req.n not in (None, 1):
        raise ApiError(400, f"n={req.n}: one choice per request (n=1)")
    roles = [m.role for m in req.messages]
    if roles != ["user"]:
        raise ApiError(
            400,
            f"the messages are {roles}: this server answers one user message (trimvlm's generate renders one "
            "user turn); send the question and its images as one user message",
        )
    content = req.messages[0].content
    texts, images = [], []
    for part in [TextPart(type="text", text=content)] if isinstance(content, str) else content or []:
        if isinstance(part, TextPart):
            texts.append(part.text)
        else:
            images.append(part.image_url if isinstance(part.image_url, str) else part.image_url.url)
    if len(images) > limits.max_images:
        raise ApiError(400, f"too many images: {len(images)}, at most {limits.max_images} per request")
    max_tokens = req.max_completion_tokens or req.max_tokens or limits.default_max_tokens
    if max_tokens > limits.max_tokens:
        raise ApiError(400, f"max_tokens is {max_tokens}, at most {limits.max_tokens} on this server")
    return req, "\n".join(texts), images, max_tokens


def decode_image(i: int, url: str, limits):
    """Image i of a request (1-based in messages) from its data URL, or a 400."""
    from PIL import Image

    m = DATA_URL.fullmatch(url.strip())
    if m is None:
        shown = url[:40] + ("..." if len(url) > 40 else "")
        raise ApiError(
            400,
            f"image {i}: {shown!r} is not a base64 data URL (data:image/png;base64,...); trimvlm never fetches URLs",
        )
    data = m.group(1)
    if len(data) > limits.max_image_bytes:
        raise ApiError(400, f"image {i} is {len(data)} bytes of base64, at most {limits.max_image_bytes}")
    try:
        im = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
        im.load()
        return im.convert("RGB")
    except (binascii.Error, ValueError, OSError, Image.DecompressionBombError) as e:
        raise ApiError(400, f"image {i} is not a decodable image ({type(e).__name__}: {str(e)[:200]})") from e


def prepare(vlm, prompt: str, urls: list[str], limits, max_tokens: int, plan, cache=None):
    """On the preparation thread: the images decoded and the request alone prepared (a bad prompt or image,
    or a prompt + max_tokens past the model's positions, fails here, never in a batch); (it, its key in the
    prompt cache: hashed here, not on the model thread, None when that cache is off; whether it was found in
    the request cache). With the server's request cache (`cache`), a request seen before (the same prompt
    text, images' data URLs, max_tokens and recipe) is not decoded, processed, checked or hashed again (as
    System One bodies are not: serve/systemone.py; a content-keyed cache of processed inputs, as vLLM's
    multimodal processor cache)."""
    from trimvlm.runtime.limits import check_generation
    from trimvlm.runtime.lru import digest, nbytes
    from trimvlm.runtime.prefix_cache import prompt_key

    label = plan.label()
    key = None if cache is None else digest("chat request", label, max_tokens, prompt, *urls)
    found = None if key is None else cache.get(key)
    if found is not None:
        return (*found, True)
    images = [decode_image(i + 1, u, limits) for i, u in enumerate(urls)]
    prepared = vlm.prepare(images or None, prompt, plan=plan)  # at the plan's resolution (tokens=downsample)
    check_generation(vlm.adapter, prepared, max_tokens)
    out = prepared, None if vlm.runner.prefix_cache is None else prompt_key(label, prepared)
    if key is not None:
        cache.put(key, out, nbytes([prepared.input_ids, prepared.attention_mask, prepared.model_inputs]))
    return (*out, False)


async def handle(state, request):
    with state.batcher.arrival() as arrival:  # the model thread waits for it while it is prepared
        return await _handle(state, request, arrival)


async def _handle(state, request, arrival):
    from trimvlm.serve.reply import ChatReply

    t0 = time.perf_counter()
    body = await state.read_json(request)
    req, prompt, urls, max_tokens = parse(body, state.limits)
    model = state.model_name(body)
    recipe = state.recipe("chat", req.recipe)
    if state.vlm.adapter.decision_head is not None:
        raise ApiError(
            400,
            "this server holds a decision model (no LM head): ask it System One requests at /v1/systemone",
        )
    from trimvlm.runtime.generate import Sampling

    temperature = req.temperature or 0.0
    top_p = 1.0 if req.top_p is None else req.top_p
    seed = req.seed or 0
    try:
        Sampling(temperature=temperature, top_p=top_p, seed=seed)  # checks them
    except TrimVLMError as e:
        raise from_trimvlm(e) from e
    t1 = time.perf_counter()
    prepared, key, hit = await state.prepare(
        prepare, state.vlm, prompt, urls, state.limits, max_tokens, recipe.plan, state.request_cache
    )
    job = ChatJob(
        prepared=prepared, prompt_tokens=int(prepared.attention_mask.sum()),
        recipe=recipe.recipe, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
        stream=req.stream, preprocess_s=time.perf_counter() - t1, events=asyncio.Queue(), prompt_key=key,
        request_cached=hit,
    )  # fmt: skip
    queued = state.batcher.enqueue(("chat", recipe.label), job, arrival)
    reply = ChatReply(state, request, queued, model=model, recipe=recipe.label, t0=t0)
    return await (reply.stream() if req.stream else reply.whole())
