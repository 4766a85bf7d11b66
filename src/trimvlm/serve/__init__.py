"""`trimvlm serve`: an HTTP server (FastAPI + uvicorn, the optional extra `trimvlm[serve]`) for one loaded model:
System One decisions (systemone.py), OpenAI-style chat completions (chat.py, reply.py, engine.py), candidate
scoring (score.py), `/health`, `/v1/models` and `/metrics` (app.py, metrics.py), behind an optional API key
(keys.py) and JSON access logs (logs.py). One scheduler loop owns the model (scheduler.py). docs/serving.md
describes the endpoints, the scheduling, the limits, the metrics and the cost fields.
"""

from __future__ import annotations

import importlib.util

from trimvlm.errors import TrimVLMError

INSTALL = "pip install 'trimvlm[serve]'"


class MissingExtraError(TrimVLMError):
    """An optional dependency of a command is not installed."""


def require() -> None:
    """Raise a one-line error naming the extra when FastAPI or uvicorn is missing."""
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(f"trimvlm serve needs {' and '.join(missing)}: {INSTALL}")
