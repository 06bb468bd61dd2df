"""What a process tree listens on, and whether each listening socket lets a caller without credentials in.

Each TCP socket is probed as what it is: a gRPC server (Ray's GCS, raylets, object managers, workers, the
dashboard agent) must answer a real read-only method of its service with UNAUTHENTICATED; an HTTP server
must refuse job submission (Ray's job API, which runs shell commands) and may only answer a plain GET
without credentials if it is a read-only page (Prometheus metrics, a health or route list, the OpenAI API
itself, which is the data plane and has its own key); anything else must at least be bound to loopback.
"""
from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass

import psutil
import requests

# A read-only method of each Ray gRPC service; a server answers the ones it does not implement with
# UNIMPLEMENTED before any authentication check, so each socket is tried until one is implemented.
GRPC_METHODS = ("/ray.rpc.NodeInfoGcsService/GetAllNodeInfo", "/ray.rpc.NodeManagerService/GetNodeStats",
                "/ray.rpc.CoreWorkerService/NumPendingTasks", "/ray.rpc.LogService/ListLogs",
                "/ray.rpc.ReporterService/HealthCheck", "/ray.rpc.ObjectManagerService/Pull",
                "/ray.serve.ASGIService/HandleRequest")
JOB_SUBMISSION_PATHS = ("/api/jobs/", "/api/job_agent/jobs/")


@dataclass
class Socket:
    process: str
    pid: int
    address: str
    port: int

    @property
    def on_loopback(self) -> bool:
        address = self.address.removeprefix("::ffff:")
        return ipaddress.ip_address(address).is_loopback


@dataclass
class Finding:
    socket: Socket
    kind: str  # grpc, http, other
    verdict: str  # "token required", "read-only page", ... or a problem
    problem: bool


def listening_sockets(root_pid: int) -> list[Socket]:
    root = psutil.Process(root_pid)
    names = {p.pid: _name(p) for p in [root, *root.children(recursive=True)]}
    return sorted((Socket(names[c.pid], c.pid, c.laddr.ip, c.laddr.port)
                   for c in psutil.net_connections(kind="tcp")
                   if c.status == psutil.CONN_LISTEN and c.pid in names), key=lambda s: s.port)


def audit(root_pid: int) -> list[Finding]:
    return [probe(socket) for socket in listening_sockets(root_pid)]


def probe(socket: Socket) -> Finding:
    """HTTP/1 first (an HTTP/2-only gRPC server does not answer it), then gRPC."""
    http = _probe_http(socket.port)
    if http is not None:
        problem = http.startswith("open:") or (not socket.on_loopback and not http.startswith("401"))
        return Finding(socket, "http", http, problem)
    grpc_verdict = _probe_grpc(socket.port)
    if grpc_verdict is not None:
        ok = grpc_verdict == "UNAUTHENTICATED"
        return Finding(socket, "grpc", "token required" if ok else f"answers without a token ({grpc_verdict})",
                       not ok)
    return Finding(socket, "other", "loopback only" if socket.on_loopback else "reachable from other machines",
                   not socket.on_loopback)


def _probe_grpc(port: int) -> str | None:
    import grpc
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=2)
        for method in GRPC_METHODS:
            try:
                channel.unary_unary(method)(b"", timeout=5)
                return "OK"
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                    return error.code().name
        return "no Ray service"
    except grpc.FutureTimeoutError:
        return None  # not an HTTP/2 (gRPC) server
    finally:
        channel.close()


def _probe_http(port: int) -> str | None:
    base = f"http://127.0.0.1:{port}"
    try:
        page = requests.get(f"{base}/", timeout=5)
    except requests.RequestException:
        return None
    for path in JOB_SUBMISSION_PATHS:
        try:
            submitted = requests.post(f"{base}{path}", timeout=5, json={"entrypoint": "true"})
        except requests.RequestException:
            continue
        if submitted.ok:
            return f"open: {path} accepted a job without credentials"
    if page.status_code in (401, 403):
        return f"{page.status_code}: credentials required"
    text = page.text[:2000]
    if page.ok and ("# HELP" in text or "# TYPE" in text):
        return "read-only page: Prometheus metrics"
    if _is_openai_or_serve(base):
        return "the OpenAI API or Serve's proxy (data plane)"
    if page.ok and _api_needs_credentials(base):
        return "a static page; its API needs credentials (Ray's dashboard)"
    if page.ok:
        return f"open: GET / answered {page.status_code} without credentials"
    return f"{page.status_code}: nothing served at /"


def _api_needs_credentials(base: str) -> bool:
    try:
        return requests.get(f"{base}/api/jobs/", timeout=5).status_code in (401, 403)
    except requests.RequestException:
        return False


def _is_openai_or_serve(base: str) -> bool:
    for path in ("/health", "/-/healthz", "/-/routes"):
        try:
            if requests.get(f"{base}{path}", timeout=5).status_code in (200, 503):
                return True
        except requests.RequestException:
            pass
    try:
        return "data" in requests.get(f"{base}/v1/models", timeout=5).json()
    except (requests.RequestException, json.JSONDecodeError):
        return False


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return "?"
