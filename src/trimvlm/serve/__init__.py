"""`trimvlm serve`: an HTTP server (FastAPI + uvicorn, the optional extra `trimvlm[serve]`) for one loaded model.

- `POST /v1/systemone`: System One decision requests, the request and response JSON of `transformers serve`
  (systemone.py), answered by `trimvlm.decision`;
- `POST /v1/chat/completions`: OpenAI-style chat completions with base64 images, plain and streamed token by
  token (chat.py, reply.py), each what `VLM.generate` gives the request alone: system messages and
  conversations, `n` choices off one prefill, `stop` (stops.py), `logprobs`, OpenAI's penalties;
- `POST /v1/score`: candidate scoring in vLLM's score shape, answered by `VLM.score` (score.py);
- `--api-key` (keys.py): a bearer key on every route but `/health`;
- `GET /health`, `GET /v1/models`, `GET /metrics` (Prometheus; app.py, metrics.py); JSON access logs (logs.py).

Concurrent requests are checked and tokenized one by one as they arrive; one scheduler loop owns the model
(scheduler.py): System One requests are micro-batched into one `decision.run`, chat completions
batched continuously at the step level (engine.py: admitted between decode steps, they join the running
decode batch; finished and cancelled rows leave at once). A request whose client has gone is not computed.
docs/serving.md describes the endpoints, the scheduling, the limits, the metrics and the cost fields.
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
