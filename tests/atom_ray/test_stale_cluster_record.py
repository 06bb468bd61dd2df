"""ensure_ray never joins a cluster whose GCS does not answer (issue #26): a record left behind by a driver
killed with SIGKILL is ignored and removed, a dead RAY_ADDRESS is ignored, and an explicit address that does
not answer fails at once. Each driver is a fresh Python with its own RAY_TMPDIR (so its own current-cluster
record), as in test_cluster.py; the suite's shared cluster is not touched."""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from atom_ray.cluster import LOCAL_CLUSTER_SETTINGS

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = textwrap.dedent("""
    import json, sys, time
    import ray
    from atom_ray.cluster import ensure_ray
    # The first driver starts a cluster of its own even where another Ray runs here (the suite's).
    started = ensure_ray(sys.argv[2] if len(sys.argv) > 2 else None, join_running=sys.argv[1] != "hold")
    print(json.dumps({"started": started, "gcs": ray.get_runtime_context().gcs_address}), flush=True)
    if sys.argv[1] == "hold":
        time.sleep(600)
    ray.shutdown()
""")

START_BOUND_S = 60  # Ray itself retries a dead GCS for minutes


@pytest.fixture
def ray_tmpdir():
    """A RAY_TMPDIR of its own; any process still naming it at the end is killed."""
    folder = tempfile.mkdtemp(prefix="ar-", dir="/tmp")  # short: Ray's socket paths live under it
    yield folder
    kill_processes_naming(folder)
    shutil.rmtree(folder, ignore_errors=True)


def driver_env(ray_tmpdir: str, **extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if key not in LOCAL_CLUSTER_SETTINGS and not key.startswith("RAY_SERVE_") and key != "RAY_ADDRESS"}
    return {**env, "RAY_TMPDIR": ray_tmpdir, **extra}


def kill_processes_naming(folder: str) -> None:
    """SIGKILL every process of this user whose command line names `folder` (a driver's cluster: GCS,
    raylet, agents, workers)."""
    for process in psutil.process_iter(["cmdline", "username"]):
        try:
            if process.pid != os.getpid() and any(folder in arg for arg in process.info["cmdline"] or ()):
                process.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def first_line(process: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if select.select([process.stdout], [], [], 1)[0]:
            line = process.stdout.readline()
            if line.strip().startswith("{"):
                return line
            assert line, f"the driver exited with {process.wait()}"
    raise AssertionError(f"the driver did not start a cluster within {timeout_s} s")


def leave_a_stale_record(ray_tmpdir: str) -> tuple[str, str]:
    """Start a local cluster in a driver, then SIGKILL the driver and its cluster; returns the record's path
    and the dead GCS address it names."""
    driver = subprocess.Popen([sys.executable, "-c", PROGRAM, "hold"], cwd=ROOT, env=driver_env(ray_tmpdir),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        report = json.loads(first_line(driver, START_BOUND_S))
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
        kill_processes_naming(ray_tmpdir)
    gcs = report["gcs"]
    deadline = time.monotonic() + 10
    while answers(gcs) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not answers(gcs)
    record = os.path.join(ray_tmpdir, "ray", "ray_current_cluster")
    with open(record) as handle:  # the atexit that withdraws it never ran
        assert handle.read().strip() == gcs
    return record, gcs


def run_driver(ray_tmpdir: str, *args: str, **extra_env: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", PROGRAM, "exit", *args], cwd=ROOT,
                            env=driver_env(ray_tmpdir, **extra_env), capture_output=True, text=True,
                            timeout=START_BOUND_S + 30)
    return result, time.monotonic() - started


def test_a_start_after_a_killed_driver_ignores_its_stale_record_and_starts_its_own_cluster(ray_tmpdir):
    from ray._private.services import find_gcs_addresses
    record, dead_gcs = leave_a_stale_record(ray_tmpdir)
    other_rays = find_gcs_addresses()  # a Ray running elsewhere on this machine would be joined instead
    result, elapsed = run_driver(ray_tmpdir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert elapsed < START_BOUND_S
    assert f"the record at {record} names {dead_gcs}, which does not answer, so it is ignored" in result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["gcs"] != dead_gcs
    if not other_rays:
        assert report["started"]
    assert not os.path.exists(record)  # removed, and the new cluster's record withdrawn at its exit


def test_a_dead_ray_address_is_ignored_and_a_local_cluster_started(ray_tmpdir):
    dead = f"127.0.0.1:{closed_port()}"
    result, elapsed = run_driver(ray_tmpdir, RAY_ADDRESS=dead)
    assert result.returncode == 0, result.stderr[-3000:]
    assert elapsed < START_BOUND_S
    assert f"RAY_ADDRESS names {dead}, which does not answer, so it is ignored" in result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["started"] and report["gcs"] != dead


def test_an_explicit_address_that_does_not_answer_fails_fast_naming_it(ray_tmpdir):
    dead = f"127.0.0.1:{closed_port()}"
    result, elapsed = run_driver(ray_tmpdir, dead)
    assert result.returncode != 0
    assert elapsed < 20
    assert "ConnectionError" in result.stderr and f"no Ray cluster answers at {dead}" in result.stderr
