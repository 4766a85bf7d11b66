"""HTTP errors, as `transformers serve` answers (docs/serving.md, "Limits and errors"): 422 with FastAPI's list
`[{"loc", "msg", "type"}]` for a request off the schema, 400 with the reason for a well-formed request that
cannot be answered, 413 for a body over the limit, 500 when the model failed; every body also carries OpenAI's
`{"error": {"message", "type", "code"}}`.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from trimvlm.decision import QuestionError, RequestError
from trimvlm.errors import TrimVLMError
from trimvlm.serve.jobs import ShuttingDown


class ApiError(Exception):
    """An error answer: `status` and `detail` (a message, or a list of `{"loc", "msg", "type"}` for 422)."""

    def __init__(self, status: int, detail):
        if not isinstance(detail, str):  # the message names where: "body.questions: ..."
            detail = [dict(d, msg=" ".join(str(d["msg"]).split())) for d in detail]
        text = detail if isinstance(detail, str) else "; ".join(f"{'.'.join(map(str, d['loc']))}: {d['msg']}"
                                                                 for d in detail)  # fmt: skip
        super().__init__(text)
        self.status, self.detail = status, detail

    def __reduce__(self):  # (it crosses to an API process as itself: serve/ipc.py)
        return ApiError, (self.status, self.detail)

    def body(self) -> dict:
        kind = {400: "invalid_request_error", 413: "request_too_large", 422: "invalid_request_error"}
        return {"detail": self.detail,
                "error": {"message": str(self), "type": kind.get(self.status, "server_error"), "code": self.status}}


def schema_error(msg: str, *loc, kind: str = "value_error") -> ApiError:
    """A 422 in FastAPI's shape, `loc` under "body"."""
    return ApiError(422, [{"loc": ["body", *loc], "msg": msg, "type": kind}])


def validated(schema, body: dict, **kw):
    """`schema.model_validate(body)` (a pydantic model), or a 422 with pydantic's errors in FastAPI's shape."""
    try:
        return schema.model_validate(body, **kw)
    except ValidationError as e:
        detail = [{"loc": ["body", *d["loc"]], "msg": d["msg"], "type": d["type"]} for d in e.errors(include_url=False)]
        raise ApiError(422, detail) from e


def check(ok, message: str, status: int = 400) -> None:
    """An ApiError(`status`, `message`) unless `ok`: a request this server cannot answer as it is (400)."""
    if not ok:
        raise ApiError(status, message)


def parse_json(raw: bytes) -> dict:
    """A request body as a JSON object (422 for text that is not one)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise schema_error(f"JSON decode error: {e}", kind="json_invalid") from e
    if not isinstance(body, dict):
        raise schema_error(f"the body is a JSON object, got a {type(body).__name__}", kind="dict_type")
    return body


def as_api_error(e: BaseException) -> ApiError:
    """What a request raised, as its answer: itself (an ApiError), 503 once the server is shutting down, 422 / 400
    for a trimvlm error (raised reading it: docs/serving.md, "Errors"), else 500 (the model failed on its batch;
    the server goes on serving)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ShuttingDown):
        return ApiError(503, str(e))
    if not isinstance(e, TrimVLMError):
        return ApiError(500, f"the model failed on this request ({type(e).__name__}: "
                             f"{' '.join(str(e).split())[:300]})")
    msg = " ".join(str(e).split())
    if isinstance(e, RequestError):
        return schema_error(msg)
    if isinstance(e, QuestionError):
        return schema_error(msg, "questions")
    # AssetError, other DecisionErrors, RecipeError, InputError, UnsupportedModelError: well-formed, unanswerable
    return ApiError(400, msg)
