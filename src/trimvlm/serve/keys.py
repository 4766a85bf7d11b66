"""API keys (`trimvlm serve --api-key KEY`, or the environment variable TRIMVLM_API_KEY), as vLLM and the OpenAI
client expect: every model route (`/v1/...`) answers 401 unless the request carries `Authorization: Bearer
KEY`. `/health` stays open; `/metrics` is open unless the operator keys it too (`--key-metrics`). The key is
compared in constant time (`hmac.compare_digest`) and never logged or echoed. (Every other path is keyed
too: an unknown one answers 401 before 404.)"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from trimvlm.errors import InputError

OPEN = ("/health",)


@dataclass(frozen=True)
class Access:
    """Who may ask: `api_key` (None: anyone; never logged), `key_metrics` (/metrics needs the key too)."""

    api_key: str | None = None
    key_metrics: bool = False

    def __post_init__(self):
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise InputError("--api-key must be a non-empty string")
        if self.key_metrics and self.api_key is None:
            raise InputError("--key-metrics needs --api-key (or TRIMVLM_API_KEY)")

    def __repr__(self) -> str:  # the key is never shown
        return f"Access(api_key={'<set>' if self.api_key else None}, key_metrics={self.key_metrics})"


class ApiKey:
    """ASGI middleware: requests to keyed paths without the key get a 401 before the app sees them."""

    def __init__(self, app, key: str, *, metrics: bool = False):
        self.app, self._key, self.metrics = app, key.encode(), metrics

    def keyed(self, path: str) -> bool:
        """Every path but /health, and /metrics only when the operator keyed it."""
        return path not in OPEN and (self.metrics or path != "/metrics")

    def allowed(self, headers: list) -> bool:
        auth = {name.lower(): value for name, value in headers}.get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        return hmac.compare_digest(token.strip() if scheme.lower() == b"bearer" else b"", self._key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.keyed(scope["path"]) or self.allowed(scope.get("headers", [])):
            return await self.app(scope, receive, send)
        from starlette.responses import JSONResponse

        error = {"message": "a valid API key is required: send it as 'Authorization: Bearer KEY'",
                 "type": "invalid_request_error", "code": "invalid_api_key"}  # fmt: skip
        await JSONResponse({"error": error}, 401, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
