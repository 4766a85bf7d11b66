"""A real uvicorn server on 127.0.0.1 in this process (a thread), for tests that talk to the app over HTTP and
also look at its model (cache counters, runner calls): `with live_server(state) as url: ...`."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager


@contextmanager
def live_server(state, timeout: float = 60.0):
    """Serve `build_app(state)` on a free port of 127.0.0.1; yields its base URL; stops it (and the state's
    model thread) at the end."""
    import uvicorn

    from trimvlm.serve.app import build_app

    config = uvicorn.Config(build_app(state), host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="trimvlm-test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
