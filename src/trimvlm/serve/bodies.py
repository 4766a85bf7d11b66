"""A request's body: its bytes, read within the server's size limit (413 past it), and as a JSON object (422
for text that is not one)."""

from __future__ import annotations

import json

from trimvlm.serve.errors import ApiError, schema_error


async def read_body(request, limit: int) -> bytes:
    """The request body's bytes: 413 past `limit` bytes (by its Content-Length or as it is read)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"the request body is {int(length)} bytes, at most {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is over {limit} bytes")
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def parse_json(raw: bytes) -> dict:
    """A request body as a JSON object (422 for text that is not one)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise schema_error(f"JSON decode error: {e}", kind="json_invalid") from e
    if not isinstance(body, dict):
        raise schema_error(f"the body is a JSON object, got a {type(body).__name__}", kind="dict_type")
    return body
