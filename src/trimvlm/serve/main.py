"""`trimvlm serve`: load a model and serve it until interrupted: in this process under uvicorn, as an engine
process and N API processes (`--api-workers`, serve/workers.py), or as Ray Serve replicas (`--replicas N
--ray ADDRESS`, serve/replicas.py)."""

from __future__ import annotations

import sys

import torch
import uvicorn

from trimvlm.errors import InputError
from trimvlm.serve.app import KEEP_ALIVE_S, build_app, make_state
from trimvlm.serve.logs import configure
from trimvlm.serve.replicas import serve_replicas
from trimvlm.serve.workers import serve_workers


def serve(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    access_log: bool = True,
    replicas: int = 1,
    ray: str | None = None,
    api_workers: int = 0,
    **options,
) -> None:
    """Load `model`, check the server's options and recipe, and serve until interrupted: in this process
    under uvicorn, with `api_workers` N > 0 as an engine process and N API processes, or with `ray` (an
    address: auto, local, HOST:PORT) as `replicas` Ray Serve replicas behind one HTTP route. `options`:
    `make_state`'s."""
    if not 0 <= port <= 65535:
        raise InputError(f"--port must be in 0..65535, got {port}")
    if not isinstance(api_workers, int) or api_workers < 0:
        raise InputError(f"--api-workers must be an integer >= 0 (0: one process), got {api_workers!r}")
    if api_workers and (ray is not None or replicas != 1):
        raise InputError("--api-workers and --replicas / --ray: choose one")
    if api_workers:
        serve_workers(model, workers=api_workers, host=host, port=port, log_level=log_level, access_log=access_log,
                      **options)  # fmt: skip
        return
    if ray is not None or replicas != 1:
        serve_replicas(model, replicas=replicas, ray_address=ray, host=host, port=port, log_level=log_level,
                       access_log=access_log, **options)  # fmt: skip
        return
    state = make_state(model, **options)
    limits, access = state.limits, state.access
    print(
        f"trimvlm serve: {model} ({state.vlm.family}) on http://{host}:{port}, recipe {state.recipes.default or 'baseline'},\n"
        f"  max batch {state.batcher.max_batch}, max wait {options.get('max_wait_ms', 10.0):g} ms, max prefill tokens "
        f"{limits.max_prefill_tokens}, {torch.get_num_threads()} torch thread(s), "
        f"{'an API key on /v1' + (' and /metrics' if access.key_metrics else '') if access.api_key else 'no API key'}",
        file=sys.stderr,
        flush=True,
    )
    configure(log_level, access_log)
    uvicorn.run(build_app(state), host=host, port=port, log_level=log_level, access_log=False,
                timeout_keep_alive=KEEP_ALIVE_S)
