"""ensure_ray: a local cluster that atom-ray starts runs with LOCAL_CLUSTER_SETTINGS (a user's own value
wins); a cluster it joins is left as it is. Each case runs in a fresh Python, as a user's program would."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from atom_ray.cluster import LOCAL_CLUSTER_SETTINGS, haproxy_available

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = textwrap.dedent("""
    import json, os, sys
    import ray
    from atom_ray.cluster import LOCAL_CLUSTER_SETTINGS, ensure_ray
    address = sys.argv[1] if len(sys.argv) > 1 else None
    started = ensure_ray(address, join_running=False)

    @ray.remote(num_cpus=0)
    def settings():
        return {key: os.environ.get(key) for key in LOCAL_CLUSTER_SETTINGS}

    @ray.remote(num_cpus=0)
    def haproxy():
        return {key: value for key, value in os.environ.items() if key.startswith("RAY_SERVE_") and "HA" in key}

    print(json.dumps({"started": started, "worker": ray.get(settings.remote()), "haproxy": ray.get(haproxy.remote()),
                      "driver": {key: os.environ.get(key) for key in LOCAL_CLUSTER_SETTINGS}}))
    ray.shutdown()
""")


def run_program(*args: str, **extra_env: str) -> dict:
    env = {key: value for key, value in os.environ.items()
           if key not in LOCAL_CLUSTER_SETTINGS and not key.startswith("RAY_SERVE_")}
    env.pop("RAY_ADDRESS", None)
    env.update(extra_env, RAY_TMPDIR=tempfile.mkdtemp(prefix="ar-", dir="/tmp"))
    try:
        result = subprocess.run([sys.executable, "-c", PROGRAM, *args], cwd=ROOT, env=env, capture_output=True,
                                text=True, timeout=180)
    finally:
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_local_cluster_atom_ray_starts_has_the_local_settings_and_a_users_value_wins():
    report = run_program(RAY_SERVE_CONTROL_LOOP_INTERVAL_S="0.3")
    assert report["started"]
    expected = {**LOCAL_CLUSTER_SETTINGS, "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.3"}
    assert report["worker"] == expected


def test_a_cluster_atom_ray_joins_keeps_its_own_settings(ray_cluster):
    report = run_program(ray_cluster)
    assert not report["started"]
    assert set(report["worker"].values()) == {None}
    assert set(report["driver"].values()) == {None}


def test_a_local_cluster_gets_serves_haproxy_ingress_with_its_own_short_paths():
    if not haproxy_available():
        pytest.skip("no haproxy binary: Serve's Python proxy serves instead")
    first, second = run_program()["haproxy"], run_program()["haproxy"]
    assert first["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    # Two local clusters do not share HAProxy's files or side ports.
    for key in ("RAY_SERVE_HAPROXY_SOCKET_PATH", "RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT"):
        assert first[key] != second[key]
    # Serve adds a 56-character node id folder; HAProxy refuses socket paths over 97 characters.
    assert len(first["RAY_SERVE_HAPROXY_SOCKET_PATH"]) + 57 <= 97
    # The cluster's HAProxy folder goes when the program that started the cluster exits.
    assert not os.path.exists(first["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"])


def test_a_users_choice_of_ingress_wins():
    report = run_program(RAY_SERVE_ENABLE_HA_PROXY="0")
    assert report["haproxy"] == {"RAY_SERVE_ENABLE_HA_PROXY": "0"}
