"""Connecting to Ray: join a running cluster, or start a local one bound to loopback without dashboard."""
from __future__ import annotations

import os

LOCAL_ENV = {
    # Bind every Ray process to 127.0.0.1 (Ray otherwise rewrites it to the outward address).
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    # Ray 2.60 turns token authentication on by default; a local cluster and its CLI must agree.
    "RAY_AUTH_MODE": "disabled",
}

# Only for a single-node cluster that atom-ray starts itself, never for one it joins. Ray's and Serve's
# background loops took ~15 % of a core on an idle 2-core machine, and on a small machine every core-second
# they take stalls the engine's compute threads. Each setting trades something a local cluster does not use;
# a value already in the environment wins. Child processes (GCS, raylet, agents, actors) inherit them.
LOCAL_CLUSTER_SETTINGS = {
    # Serve's controller reconciles deployments once a second instead of ten times (each pass also fetched
    # the node table from the GCS): deploys, scaling and replica restarts react up to 1 s later; requests
    # never pass through the controller.
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1.0",
    # No Ray/Serve Prometheus metrics (ray_*, ray_serve_*; they need a metrics agent scraped by a Prometheus
    # that a local cluster does not have). The app's own /metrics (atom_ray:*) does not use them.
    "RAY_enable_metrics_collection": "0",
    # Serve's replicas and routers hand their cached request metrics to those (now idle) Ray metrics every
    # 5 s instead of every 0.1 s; with collection re-enabled, Ray's Serve metrics would lag by up to 5 s.
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "5000",
    # The log monitor re-lists the log folder every 2 s instead of every 0.1 s: output of a newly started
    # worker reaches the driver's terminal up to 2 s later (nothing is lost; files are read from the start).
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "LOG_NAME_UPDATE_INTERVAL_S": "2",
    # The dashboard agent checks that its raylet is alive every 2 s instead of every 0.4 s.
    "RAY_DASHBOARD_AGENT_CHECK_PARENT_INTERVAL_S": "2",
}


def ensure_ray(address: str | None = None, join_running: bool = True, num_cpus: int | None = None) -> bool:
    """Join `address`; else, with `join_running`, a cluster found by Ray's discovery (RAY_ADDRESS, or a Ray
    running on this machine); else start a local one on 127.0.0.1 without dashboard, with
    LOCAL_CLUSTER_SETTINGS. Returns True when this call started a new local cluster."""
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
    for key, value in LOCAL_CLUSTER_SETTINGS.items():
        os.environ.setdefault(key, value)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level="WARNING",
             _node_ip_address="127.0.0.1")
    return True
