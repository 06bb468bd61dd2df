"""Connecting to Ray: join a running cluster, or start a local one bound to loopback without dashboard."""
from __future__ import annotations

import os

LOCAL_ENV = {
    # Bind every Ray process to 127.0.0.1 (Ray otherwise rewrites it to the outward address).
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    # Ray 2.60 turns token authentication on by default; a local cluster and its CLI must agree.
    "RAY_AUTH_MODE": "disabled",
}


def ensure_ray(address: str | None = None, join_running: bool = True, num_cpus: int | None = None) -> bool:
    """Join `address`; else, with `join_running`, a cluster found by Ray's discovery (RAY_ADDRESS, or a Ray
    running on this machine); else start a local one on 127.0.0.1 without dashboard. Returns True when
    this call started a new local cluster."""
    import ray
    if ray.is_initialized():
        return False
    for key, value in LOCAL_ENV.items():
        os.environ.setdefault(key, value)
    if address is not None:
        ray.init(address=address, logging_level="WARNING")
        return False
    if join_running:
        try:
            ray.init(address="auto", logging_level="WARNING")
            return False
        except ConnectionError:
            pass
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level="WARNING",
             _node_ip_address="127.0.0.1")
    return True
