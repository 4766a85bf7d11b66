"""Scale-out: `trimvlm serve --replicas N --ray ADDRESS` runs N copies of the server (`app.build_app` over
`app.make_state`, each its own scheduler and caches) as one Ray Serve deployment behind one HTTP route
(docs/serving.md, "Scale-out"). `--ray` is the address `trimvlm eval --ray` takes (`trimvlm.cluster.connect`);
each replica asks Ray for `--threads` CPUs (one GPU with `--device cuda`). Needs `trimvlm[ray]`.
"""

from __future__ import annotations

import sys
import time

from trimvlm.cluster import connect
from trimvlm.errors import InputError
from trimvlm.options import is_int
from trimvlm.serve.app import build_app, make_state
from trimvlm.serve.logs import configure

APP_NAME = "trimvlm"


def check_replicas(replicas) -> int:
    if not is_int(replicas) or replicas < 1:
        raise InputError(f"--replicas must be a positive number of model replicas, got {replicas!r}")
    return int(replicas)


def deployment(model: str, *, replicas: int, log_level: str = "info", access_log: bool = True, **options):
    """The bound Ray Serve application: `replicas` replicas of the server for `model` (`options`: make_state's)."""
    from ray import serve

    def build():  # on each replica, when it starts
        state = make_state(model, **options)
        configure(log_level, access_log)
        return build_app(state)

    threads = options.get("threads", 1) or 1
    device = str((options.get("load_kw") or {}).get("device", "cpu"))
    actor = {"num_cpus": threads, "num_gpus": 1 if device.startswith("cuda") else 0}
    server = serve.deployment(
        serve.ingress(build)(), name="TrimvlmServer", num_replicas=replicas, ray_actor_options=actor,
        max_ongoing_requests=options.get("max_batch", 32) * 4,  # the replica's own scheduler queues the rest
    )  # fmt: skip
    return server.bind()


def start_replicas(model: str, *, replicas: int, host: str = "127.0.0.1", port: int = 8000, **options) -> str:
    """Deploy the replicas on the Ray this process is connected to (Ray Serve's proxy on host:port); returns
    once every replica has loaded its model. The route's base URL."""
    from ray import serve

    replicas = check_replicas(replicas)
    serve.start(http_options={"host": host, "port": port})
    serve.run(deployment(model, replicas=replicas, **options), name=APP_NAME, route_prefix="/", blocking=False)
    return f"http://{host}:{port}"


def serve_replicas(model: str, *, replicas: int, ray_address: str | None, host: str, port: int, **options) -> None:
    """`trimvlm serve --replicas N --ray ADDRESS`: connect, deploy, serve until interrupted, then take the
    deployment down."""
    replicas = check_replicas(replicas)
    if ray_address is None:
        raise InputError(f"--replicas {replicas} runs replicas on Ray: give --ray local, auto or HOST:PORT")
    ray, started, where = connect(ray_address)
    try:
        from ray import serve
    except ImportError as e:
        raise InputError(f'--ray needs Ray Serve ({e}): pip install "trimvlm[ray]"') from None
    url = start_replicas(model, replicas=replicas, host=host, port=port, **options)
    print(f"trimvlm serve: {model}, {replicas} Ray Serve replica(s) on Ray ({where}), on {url}",
          file=sys.stderr, flush=True)  # fmt: skip
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP_NAME)
        if started:
            ray.shutdown()
