"""The shape of a System One request, checked before any model work, and its assets decoded.

`{"state": ..., "questions": {name: {"type": "noul" | "choice" | "score", "instructions": ..., "criteria": ...}},
"assets": {placeholder: image}}`, as a dict or its JSON (a `model` key, which `transformers serve` reads, is
allowed and ignored). The questions themselves are checked by transformers' `parse_questions` (prompts.py); here
only what transformers does not check: the top-level shape, the limits, and the images (decoded once, by
transformers' `load_image`, so a bad one is named; never fetched from a URL).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
from typing import Any

from trimvlm.decision.errors import AssetError, QuestionError, RequestError
from trimvlm.decision.limits import Limits

KEYS = ("state", "questions", "assets", "model")
SHAPE = '{"state": ..., "questions": {name: {"type": ..., ...}}, "assets": {placeholder: image}}'


def parse_request(request, limits: Limits) -> dict[str, Any]:
    """The request as a dict with its assets decoded to PIL images (`assets` may be empty)."""
    if isinstance(request, bytes | bytearray):
        request = request.decode("utf-8", errors="replace")
    if isinstance(request, str):
        try:
            request = json.loads(request)  # parsed, so that `\u` escapes cannot hide control tokens
        except json.JSONDecodeError as e:
            raise RequestError(f"the request is not valid JSON ({e}); a request is {SHAPE}") from e
    if not isinstance(request, dict):
        raise RequestError(f"a request is {SHAPE}, got a {type(request).__name__}")
    missing = [k for k in ("state", "questions") if k not in request]
    if missing:
        raise RequestError(
            f"the request has no {' or '.join(repr(k) for k in missing)}; a request is {SHAPE}"
        )
    unknown = sorted(str(k) for k in request if k not in KEYS)
    if unknown:
        raise RequestError(f"unknown request key(s) {unknown}; allowed: {', '.join(KEYS)}")
    questions = request["questions"]
    if not isinstance(questions, dict) or not questions:
        raise RequestError(f"`questions` maps names to questions, with at least one; got {questions!r:.80}")
    if not all(isinstance(name, str) for name in questions):  # "" is a name, as transformers' schema allows
        raise RequestError("question names must be strings")
    if len(questions) > limits.max_questions:
        raise QuestionError(
            f"too many questions: {len(questions)}, at most {limits.max_questions} per request"
        )
    assets = request.get("assets") or {}
    if not isinstance(assets, dict):
        raise RequestError(f"`assets` maps placeholders to images, got a {type(assets).__name__}")
    if len(assets) > limits.max_assets:
        raise AssetError(f"too many assets: {len(assets)}, at most {limits.max_assets} images per request")
    if not all(isinstance(name, str) for name in assets):
        raise RequestError("asset placeholders must be strings")
    if "" in assets:  # transformers' schema takes it, but it would match everywhere: unanswerable (400)
        raise AssetError("an asset placeholder is empty; name it with text written where the image goes")
    texts = list(_strings([request["state"], questions]))
    for name in assets:
        if not any(name in t for t in texts):
            raise AssetError(
                f"asset {name!r} is not referenced: write its placeholder in the state, the instructions or the "
                "criteria where the model should see the image"
            )
    decoded = {name: decode_asset(name, value, limits) for name, value in assets.items()}
    return {"state": request["state"], "questions": questions, "assets": decoded}


def _strings(value):
    """Every string (mapping keys included) in a JSON-like value."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        yield from _strings(list(value.items()))  # each key, then its value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def _base64_bytes(name: str, text: str) -> bytes:
    """The bytes of base64 text or of a base64 data URL (line breaks allowed), or an AssetError: where paths are
    refused, text that is not base64 is never looked up as a file."""
    if text.startswith("data:"):
        text = text.partition(",")[2]
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except binascii.Error as e:
        raise AssetError(
            f"asset {name!r} is not base64 image data (file paths are not accepted here; send the image as base64)"
        ) from e


def decode_asset(name: str, value, limits: Limits):
    """One asset -> an RGB PIL image, by transformers' `load_image` (what `prepare_inputs` calls): a System One
    asset `{"type": "image", "format": "png", "data_base64": ...}`, base64 text (or a data URL), a PIL image, or
    (unless the limits forbid it) a file path."""
    from PIL import Image
    from transformers.image_utils import load_image

    if isinstance(value, dict):
        if not isinstance(value.get("data_base64"), str):
            raise AssetError(
                f'asset {name!r}: a System One asset is {{"type": "image", "format": "png", "data_base64": ...}}, '
                f"got the keys {sorted(value)}"
            )
        value = value["data_base64"]
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str):
        if value.startswith(("http://", "https://")):
            raise AssetError(f"asset {name!r} is a URL; trimvlm never fetches images: send it as base64")
        is_path = limits.allow_paths and os.path.isfile(value)  # refused: the file system is never asked
        size = os.path.getsize(value) if is_path else len(value)
        if size > limits.max_asset_bytes:
            raise AssetError(f"asset {name!r} is {size} bytes, at most {limits.max_asset_bytes}")
        if not limits.allow_paths:
            value = _base64_bytes(name, value)
    elif not isinstance(value, Image.Image):
        raise AssetError(
            f"asset {name!r} has type {type(value).__name__}; an image is a System One asset dict, base64 text, "
            "a PIL image or a file path"
        )
    try:
        image = load_image(Image.open(io.BytesIO(value)) if isinstance(value, bytes) else value)
        image.load()
    except Exception as e:  # PIL and base64 raise many types for bad data
        detail = " ".join(str(e).split())
        if "Got " in detail:  # transformers' message repeats the whole input
            detail = detail.split("Got ")[0].strip()
        raise AssetError(
            f"asset {name!r} is not a decodable image ({type(e).__name__}: {detail[:200]})"
        ) from e
    return image
