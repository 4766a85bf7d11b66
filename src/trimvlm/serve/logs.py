"""Structured access logs and per-request figures: one JSON line per HTTP request on the `trimvlm.serve.access`
logger (`{"ts", "client", "method", "path", "status", "seconds", "bytes"}`), and the request counted on
`/metrics`. A client that went away before its answer was sent is logged with status 499 (nginx's "client
closed request"): nothing was sent to it."""

from __future__ import annotations

import json
import logging
import time

access = logging.getLogger("trimvlm.serve.access")


class AccessLog:
    """ASGI middleware around the app."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        seen = {"status": None, "bytes": 0, "gone": False}

        async def watch_receive():
            msg = await receive()
            if msg["type"] == "http.disconnect":
                seen["gone"] = True
            return msg

        async def watch_send(msg):
            if msg["type"] == "http.response.start":
                seen["status"] = msg["status"]
            elif msg["type"] == "http.response.body":
                seen["bytes"] += len(msg.get("body", b""))
            await send(msg)

        try:
            await self.app(scope, watch_receive, watch_send)
        finally:
            status = seen["status"] or 500
            if seen["gone"] and (status == 499 or seen["bytes"] == 0):
                status = 499
            seconds = time.perf_counter() - t0
            self.metrics.request(scope["path"], status, seconds)
            client = scope.get("client")
            access.info(json.dumps({
                "ts": round(time.time(), 3), "client": f"{client[0]}:{client[1]}" if client else None,
                "method": scope["method"], "path": scope["path"], "status": status,
                "seconds": round(seconds, 6), "bytes": seen["bytes"],
            }))  # fmt: skip


def configure(level: str = "info", access_log: bool = True) -> None:
    """Print trimvlm's server logs (access lines as they are, JSON) on stderr."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    access.handlers[:] = [handler]
    access.propagate = False
    access.setLevel(logging.INFO if access_log else logging.CRITICAL + 1)
    serve_log = logging.getLogger("trimvlm.serve")
    if not serve_log.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(levelname)s: %(name)s: %(message)s"))
        serve_log.addHandler(h)
    serve_log.setLevel(level.upper() if level.upper() in logging._nameToLevel else logging.INFO)
