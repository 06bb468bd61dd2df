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


def test_one_client_address_holds_a_bounded_share_of_the_api_ports_connections(tmp_path):
    """The API frontend tracks connections per source address and refuses those past the limit (one client
    reopening idle connections cannot fill Serve's 4,096 slots); the side ports are not limited."""
    hardened = harden(serve_config(tmp_path), per_source=300)
    api = hardened.split("frontend http_frontend\n")[1].split("backend")[0]
    assert "tcp-request connection track-sc0 src" in api
    assert "tcp-request connection reject if { sc0_conn_cur gt 300 }" in api
    assert "stick-table type ip" in api and hardened.count("stick-table") == 1
    assert harden(hardened, per_source=300) == hardened
    relimited = harden(hardened, per_source=50)  # a new limit replaces the old one
    assert "gt 50 }" in relimited and "gt 300 }" not in relimited and relimited.count("track-sc0") == 1


@pytest.mark.skipif(not haproxy_available(), reason="no haproxy binary")
def test_a_bad_per_source_limit_is_refused_by_name(tmp_path):
    path = tmp_path / "haproxy.cfg"
    path.write_text(serve_config(tmp_path))
    result = subprocess.run([sys.executable, "-m", "atom_ray.haproxy_wrapper", "-c", "-f", str(path)],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "ATOM_RAY_MAX_CONNECTIONS_PER_SOURCE": "lots"})
    assert result.returncode != 0 and "ATOM_RAY_MAX_CONNECTIONS_PER_SOURCE must be a positive integer" in result.stderr


@pytest.mark.skipif(not haproxy_available(), reason="no haproxy binary")
def test_connections_past_the_per_source_limit_are_refused_and_the_others_answered(tmp_path):
    """The real haproxy with the hardened config, 3 connections per source: three idle connections stay open,
    a fourth is closed without an answer, and once one of the three goes a new one is answered."""
    import socket
    import time
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = (f"global\n    maxconn 4096\ndefaults\n    mode http\n    timeout connect 5s\n    timeout client 30s\n"
              f"    timeout server 30s\nfrontend http_frontend\n    bind 127.0.0.1:{port}\n"
              f"    default_backend default_backend\nbackend default_backend\n"
              f'    http-request return status 200 content-type text/plain string "ok"\n')
    path = tmp_path / "limit.cfg"
    path.write_text(harden(config, per_source=3))
    proxy = subprocess.Popen([real_binary(), "-f", str(path), "-db"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def ask(sock) -> bytes:
        """The start of the answer; b"" for a connection the proxy closed or reset."""
        sock.settimeout(5)
        try:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            return sock.recv(100)
        except (ConnectionResetError, BrokenPipeError, socket.timeout):
            return b""
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        time.sleep(0.2)  # the probe's slot expires from conn_cur as it closes
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", port)) as extra:
            assert ask(extra) == b""
        assert ask(held[0]).startswith(b"HTTP/1.1 200")
        held.pop().close()
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", port)) as again:
            assert ask(again).startswith(b"HTTP/1.1 200")
        for sock in held:
            sock.close()
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)
