"""Connecting to a Ray cluster (`--ray auto|local|HOST:PORT`), for `trimvlm eval --ray`
(trimvlm.integrations.ray_eval) and `trimvlm serve --replicas N --ray` (trimvlm.serve.replicas): an address
nobody answers on fails in seconds with a line naming it, not after Ray's minute of retries."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

from trimvlm.errors import InputError, TrimVLMError

CONNECT_TIMEOUT_S = 3.0
# ray.init retries a cluster's GCS about once a second, 20 times by default; an address that accepts TCP but
# is no Ray cluster (a proxy, another service) then takes 20 s to fail. Bounded here unless the operator set
# RAY_gcs_server_port_wait_time_s (Ray's own knob for that window) already.
CONNECT_RETRIES = 5


class RayError(TrimVLMError):
    """Ray is missing, its cluster cannot be reached, or a worker failed."""


def _auto_address() -> str:
    """The address `ray.init(address="auto")` would use: RAY_ADDRESS, else the cluster `ray start` last
    started on this machine (the file Ray writes in its temp folder)."""
    env = os.environ.get("RAY_ADDRESS")
    if env and env != "auto":
        return env
    for folder in {Path(tempfile.gettempdir()) / "ray", Path("/tmp/ray")}:
        f = folder / "ray_current_cluster"
        if f.exists() and f.read_text().strip():
            return f.read_text().strip()
    raise RayError(
        "--ray auto found no running Ray cluster: RAY_ADDRESS is not set and no cluster was started on this "
        "machine with `ray start --head`; start one, give its address (--ray HOST:6379), or use --ray local"
    )


def check_reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse an address nobody answers on within `timeout` seconds (ray.init would wait much longer)."""
    host, sep, port = address.split("://", 1)[-1].rstrip("/").rpartition(":")
    if not sep or not port.isdigit():
        raise InputError(
            f"Ray address {address!r} is not HOST:PORT (or ray://HOST:PORT); give --ray auto, local or "
            "an address such as 10.0.0.1:6379"
        )
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as e:
        why = f"no answer within {timeout:g} s" if isinstance(e, TimeoutError) else (e.strerror or str(e)).lower()
        raise RayError(
            f"cannot reach the Ray cluster at {address} ({why}); start it with "
            "`ray start --head` on that machine, check the address and port, or use --ray local"
        ) from None


def connect(ray_address: str | None):
    """Initialise Ray; returns (ray, whether this call started the connection, the address used).
    None: the Ray already initialised in this process, else a new local instance. "local": a new local
    instance. "auto": the running cluster (RAY_ADDRESS or `ray start` on this machine). Else HOST:PORT or
    ray://HOST:PORT, checked to answer within a few seconds first."""
    try:
        import ray
    except ImportError as e:
        raise RayError(f'--ray needs Ray ({e}): `make ray`, or `pip install "trimvlm[ray]"`') from None
    explicit = ray_address not in (None, "auto", "local")
    if explicit:  # before anything else: an address nobody answers on fails in seconds, not minutes
        check_reachable(str(ray_address))
    if ray.is_initialized():
        if explicit:
            raise RayError(
                f"Ray is already initialised in this process; cannot connect to {ray_address} as well"
            )
        return ray, False, "the running Ray instance"
    kw = {"log_to_driver": False, "include_dashboard": False}
    if ray_address in (None, "local"):
        ray.init(**kw)
        return ray, True, "local"
    address = str(ray_address)
    if ray_address == "auto":
        address = _auto_address()
        check_reachable(address)
    if address.startswith("ray://"):
        kw.pop("include_dashboard")
    knob = "RAY_gcs_server_port_wait_time_s"
    own = knob not in os.environ
    if own:
        os.environ[knob] = str(CONNECT_RETRIES)
    try:
        ray.init(address=address, **kw)
    except Exception as e:  # ConnectionError (no Ray cluster answers there), a version mismatch...
        raise RayError(
            f"cannot reach the Ray cluster at {address}: ray.init failed ({' '.join(str(e).split())[:300]}); "
            "check the address and port (the head's `ray start --head` prints it), or use --ray local"
        ) from None
    finally:
        if own:
            os.environ.pop(knob, None)
    return ray, True, address
