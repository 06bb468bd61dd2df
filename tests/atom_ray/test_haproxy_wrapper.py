"""atom-ray-haproxy: the config Serve writes, tightened (side ports on loopback, a private admin socket,
request time-outs) and still a valid HAProxy config; the real binary runs with the same arguments."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from atom_ray.cluster import haproxy_available
from atom_ray.haproxy_wrapper import harden, real_binary

# The shape of the config Ray Serve 2.60 generates (haproxy_templates.py), with its side ports on every
# interface and its admin socket open to every local user.
SERVE_CONFIG = """global
    log 127.0.0.1:514 local0 info
    stats socket {folder}/admin.sock mode 666 level admin expose-fd listeners
    stats timeout 30s
    maxconn 4096
defaults
    mode http
    timeout connect 5s
    timeout client 3600s
    timeout http-request 600s
    option http-buffer-request
    option abortonclose
frontend prometheus
    bind :{metrics_port}
    mode http
    http-request use-service prometheus-exporter if {{ path /metrics }}
    no log
frontend http_frontend
    bind 127.0.0.1:{http_port}
    default_backend default_backend
backend default_backend
    http-request return status 404 content-type text/plain string "not found"
listen stats
  bind *:{stats_port}
  stats enable
  stats uri /stats
  stats refresh 1s
"""


def serve_config(folder) -> str:
    return SERVE_CONFIG.format(folder=folder, metrics_port=59101, http_port=58000, stats_port=58404)


def test_side_ports_bind_loopback_and_the_api_port_is_left_alone(tmp_path):
    hardened = harden(serve_config(tmp_path))
    assert "    bind 127.0.0.1:59101" in hardened and "  bind 127.0.0.1:58404" in hardened
    assert "    bind 127.0.0.1:58000" in hardened  # the OpenAI port: as Serve's http_options say
    assert "bind :" not in hardened and "bind *" not in hardened


def test_the_admin_socket_is_private_and_requests_must_arrive_in_time(tmp_path):
    hardened = harden(serve_config(tmp_path))
    assert "mode 600 level admin" in hardened and "mode 666" not in hardened
    defaults = hardened.split("defaults\n")[1].split("frontend")[0]
    assert defaults.count("timeout http-request") == 1 and "timeout http-request 10s" in defaults
    assert defaults.count("option http-buffer-request") == 1


def test_hardening_is_idempotent(tmp_path):
    once = harden(serve_config(tmp_path))
    assert harden(once) == once


@pytest.mark.skipif(not haproxy_available(), reason="no haproxy binary")
def test_the_wrapper_hands_a_valid_hardened_config_to_the_real_haproxy(tmp_path):
    path = tmp_path / "haproxy.cfg"
    path.write_text(serve_config(tmp_path))
    # `-c`: haproxy checks the config and exits; the wrapper rewrote it in place first.
    result = subprocess.run([sys.executable, "-m", "atom_ray.haproxy_wrapper", "-c", "-f", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bind 127.0.0.1:58404" in path.read_text()
    assert os.path.realpath(real_binary()) != os.path.realpath(sys.argv[0])
