"""`trimvlm serve`: an HTTP server (FastAPI + uvicorn, the optional extra `trimvlm[serve]`) for one loaded model.

- `POST /v1/systemone`: System One decision requests, the request and response JSON of `transformers serve`
  (systemone.py), answered by `trimvlm.decision`;
- `POST /v1/chat/completions`: OpenAI-style chat completions with base64 images, plain and streamed (chat.py),
  answered by `VLM.generate`;
- `GET /health`, `GET /v1/models` (app.py).

Concurrent requests are checked and tokenized one by one as they arrive, then micro-batched (batching.py): a
single worker thread owns the model and runs, per batch, one `decision.run` or one `vlm.generate` over the
requests that can share it. docs/serving.md describes the endpoints, the limits and the cost fields.
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
