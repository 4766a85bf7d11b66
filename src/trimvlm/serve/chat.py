"""`POST /v1/chat/completions`: OpenAI-style chat completions with base64 data-URL images (never fetched), each
answer what `VLM.generate` gives the request alone (docs/serving.md, "POST /v1/chat/completions"). A request is
checked (`parse`: 422 off the schema, 400 for what this server cannot honour) and prepared alone on the
preparation thread (`prepare`), then decoded step by step in the running batch (engine.py) and answered, whole
or streamed, by reply.py.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import re
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Annotated, Literal, NamedTuple

from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

from trimvlm.adapters.base import Conversation, Turn
from trimvlm.errors import TrimVLMError
from trimvlm.runtime.generate import Sampling
from trimvlm.runtime.limits import check_generation
from trimvlm.runtime.lru import digest, nbytes
from trimvlm.runtime.prefix_cache import prompt_key
from trimvlm.serve.errors import ApiError, check, parse_json, validated
from trimvlm.serve.jobs import JobKey
from trimvlm.serve.reply import ChatReply
from trimvlm.serve.stops import StopText


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
    n: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    user: str | None = None
    recipe: str | None = None  # trimvlm's extension


MAX_N = 16  # choices per request
MAX_STOPS = 4  # stop strings per request (OpenAI's limit)


@dataclass
class ChatJob:
    prepared: object  # the request alone, prepared on the preparation thread (collated into its batch)
    prompt_tokens: int
    recipe: object
    max_tokens: int
    sampling: object  # runtime.generate.Sampling (choice i draws with seed + i)
    preprocess_s: float
    events: asyncio.Queue  # what the model thread sends this request: its tokens, then its result (engine.py)
    n: int = 1  # choices, decoded off one prefill
    stop: StopText | None = None
    logprobs: int | None = None  # None: none; k: each token's log-probability and the top k
    prompt_key: bytes | None = None  # its key in the prompt cache (runtime/prefix_cache.py), made when prepared
    prefix_key: bytes | None = None  # the key its earlier turns' prompt was stored under (a conversation)
    request_cached: bool = False  # it was found prepared in the request cache
    usage: Counter = field(default_factory=Counter)  # its costs, added to by the model thread
    open: int = 0  # its choices still decoding
    batch: int = 0  # the most rows a model call of it held


@dataclass
class Parsed:
    """A checked chat request: the body, the prompt (a string: one user message; or a `Conversation`), the
    images' data URLs (in the order of the messages), max_tokens, its stop strings."""

    req: ChatBody
    prompt: object
    urls: list[str]
    max_tokens: int
    stop: StopText | None


class ChatReady(NamedTuple):
    """A chat request prepared alone (`vlm.prepare`), its key in the prompt cache (None: that cache is off), the
    key of its earlier turns' prompt (a conversation with an assistant turn; else None), whether it was found
    in the request cache."""

    prepared: object
    prompt_key: bytes | None
    prefix_key: bytes | None
    cached: bool = False


DATA_URL = re.compile(r"data:image/[\w.+-]+;base64,(.*)", re.DOTALL)


def parse(body: dict, limits) -> Parsed:
    """The checked request, or a 422 (not of the schema) / 400 (what this server cannot honour, named)."""
    req = validated(ChatBody, body)
    check(req.n is None or req.n <= MAX_N, f"n={req.n}: at most {MAX_N} choices per request")
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    check(len(stops) <= MAX_STOPS and all(stops),
          f"stop: up to {MAX_STOPS} non-empty strings, got {stops!r:.200}")
    check(req.top_logprobs is None or req.logprobs, "top_logprobs: set logprobs to true to ask for them")
    urls, turns = [], []
    for i, m in enumerate(req.messages):
        check(m.role != "tool", f"messages[{i}]: role 'tool': this server runs no tools")
        parts = [TextPart(type="text", text=m.content)] if isinstance(m.content, str) else m.content or []
        texts = [p.text for p in parts if isinstance(p, TextPart)]
        images = [getattr(p.image_url, "url", p.image_url) for p in parts if isinstance(p, ImagePart)]
        urls += images
        turns.append(Turn("system" if m.role == "developer" else m.role, "\n".join(texts), len(images)))
    check(len(urls) <= limits.max_images,
          f"too many images: {len(urls)}, at most {limits.max_images} per request")
    if [t.role for t in turns] == ["user"]:
        prompt = turns[0].text  # one user message: the prompt `vlm.generate` takes
    else:
        try:
            prompt = Conversation(tuple(turns))
        except TrimVLMError as e:
            raise ApiError(400, f"messages: {e}") from e
    max_tokens = req.max_completion_tokens or req.max_tokens or limits.default_max_tokens
    check(max_tokens <= limits.max_tokens,
          f"max_tokens is {max_tokens}, at most {limits.max_tokens} on this server")
    return Parsed(req, prompt, urls, max_tokens, StopText(tuple(stops)) if stops else None)


def decode_image(i: int, url: str, limits):
    """Image i of a request (1-based in messages) from its data URL, or a 400."""
    m = DATA_URL.fullmatch(url.strip())
    if m is None:
        shown = url[:40] + ("..." if len(url) > 40 else "")
        raise ApiError(
            400,
            f"image {i}: {shown!r} is not a base64 data URL (data:image/png;base64,...); trimvlm never fetches URLs",
        )
    data = m.group(1)
    check(len(data) <= limits.max_image_bytes,
          f"image {i} is {len(data)} bytes of base64, at most {limits.max_image_bytes}")
    try:
        im = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
        im.load()
        return im.convert("RGB")
    except (binascii.Error, ValueError, OSError, Image.DecompressionBombError) as e:
        raise ApiError(400, f"image {i} is not a decodable image ({type(e).__name__}: {str(e)[:200]})") from e


def prepare(vlm, prompt, urls: list[str], limits, max_tokens: int, plan, cache=None) -> ChatReady:
    """On the preparation thread: the images decoded and the request alone prepared at the plan's resolution
    (a bad prompt or image, or a prompt + max_tokens past the model's positions, fails here, never in a batch),
    its prompt-cache keys hashed (`ChatReady`). A request found in the server's request cache (`cache`: the same
    prompt, images' data URLs, max_tokens and recipe) is not decoded, processed, checked or hashed again."""
    label = plan.label()
    key = None if cache is None else digest("chat request", label, max_tokens, repr(prompt), *urls)
    found = None if key is None else cache.get(key)
    if found is not None:
        return found._replace(cached=True)
    images = [decode_image(i + 1, u, limits) for i, u in enumerate(urls)]
    prepared = vlm.prepare(images or None, prompt, plan=plan)  # at the plan's resolution (tokens=downsample)
    check_generation(vlm.adapter, prepared, max_tokens)
    out = ChatReady(prepared, None, None)
    if vlm.runner.prefix_cache is not None:
        out = ChatReady(prepared, prompt_key(label, prepared), earlier_key(vlm, prompt, images, prepared, plan))
    if key is not None:
        cache.put(key, out, nbytes([prepared.input_ids, prepared.attention_mask, prepared.model_inputs]))
    return out


def earlier_key(vlm, prompt, images: list, prepared, plan) -> bytes | None:
    """The prompt key of a conversation's earlier turns (the messages before its last assistant turn, as that
    turn's request sent them), when their prompt is the start of this one's; else None."""
    if not isinstance(prompt, Conversation):
        return None
    turns = prompt.turns
    last = max((i for i, t in enumerate(turns) if t.role == "assistant"), default=None)
    if last is None or last == 0 or turns[last - 1].role != "user":
        return None
    before = turns[:last]
    shown = sum(t.images for t in before)
    earlier = before[0].text if [t.role for t in before] == ["user"] else Conversation(before)
    part = vlm.prepare(images[:shown] or None, earlier, plan=plan)
    m = part.input_ids.shape[1]
    if m >= prepared.input_ids.shape[1] or not bool((prepared.input_ids[:, :m] == part.input_ids).all()):
        return None
    return prompt_key(plan.label(), part)


async def handle(state, request, arrival):
    t0 = time.perf_counter()
    body = parse_json(await state.read_body(request))
    parsed = parse(body, state.limits)
    req = parsed.req
    model = state.model_name(body)
    if req.recipe is None and state.load is not None:  # the ladder's rung that fits the load (serve/budgets.py)
        recipe = state.rung()
    else:
        recipe = state.recipes.get("chat", req.recipe)
    state.need_lm_head()
    n = req.n or 1
    check(n == 1 or not recipe.plan.per_sample,
          f"n={n}: recipe {recipe.label!r} plans layers per request (router=); ask for n=1")
    sampling = Sampling(  # checks them
        temperature=req.temperature or 0.0, top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed or 0,
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
    )  # fmt: skip
    t1 = time.perf_counter()
    ready = await state.prepare(
        prepare, state.vlm, parsed.prompt, parsed.urls, state.limits, parsed.max_tokens, recipe.plan,
        state.request_cache,
    )  # fmt: skip
    prepared = ready.prepared
    job = ChatJob(
        prepared=prepared, prompt_tokens=int(prepared.attention_mask.sum()), recipe=recipe.recipe,
        max_tokens=parsed.max_tokens, sampling=sampling, preprocess_s=time.perf_counter() - t1,
        events=asyncio.Queue(), n=n, stop=parsed.stop, logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        prompt_key=ready.prompt_key, prefix_key=ready.prefix_key, request_cached=ready.cached,
    )  # fmt: skip
    # n > 1: a key of its own (never batched with others: its rows decode off its own prompt's KV)
    batch_key = JobKey("chat", recipe.label, alone="" if n == 1 else uuid.uuid4().hex)
    queued = state.batcher.enqueue(batch_key, job, arrival)
    state.recipes_run.labels(recipe=recipe.label).inc()
    reply = ChatReply(state, request, queued, model=model, recipe=recipe.label, t0=t0)
    return await (reply.stream() if req.stream else reply.whole())
