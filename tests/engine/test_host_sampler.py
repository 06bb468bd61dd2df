"""The host sampler (engine/runner/host_sampler.py): every thread's stack, innermost frame and whole stack,
as shares of the samples; its report goes to the file at stop."""
from __future__ import annotations

import json
import threading

from engine.runner.host_sampler import HostSampler


def _inner(event: threading.Event) -> None:
    event.wait()


def _outer(event: threading.Event) -> None:
    _inner(event)


def test_a_blocked_thread_shows_where_it_waits_and_who_called(tmp_path):
    release, sampler = threading.Event(), HostSampler(tmp_path / "r.host.json", hz=1000)
    worker = threading.Thread(target=_outer, args=(release,), name="engine-loop")
    worker.start()
    try:
        for _ in range(20):
            sampler.sample()
    finally:
        release.set()
        worker.join()
    report = sampler.report()["threads"]["engine-loop"]
    assert report["samples"] == 20
    inclusive = dict(report["inclusive"])
    assert inclusive[next(k for k in inclusive if k.startswith("_outer ("))] == 1.0
    assert inclusive[next(k for k in inclusive if k.startswith("_inner ("))] == 1.0
    # the innermost Python frame is threading's wait, which _inner called
    assert report["self"][0][0].startswith("wait (") and report["self"][0][1] == 1.0


def test_the_background_thread_writes_its_report_at_stop(tmp_path):
    sampler = HostSampler(tmp_path / "r.host.json", hz=500)
    sampler.start()
    threading.Event().wait(0.1)
    sampler.stop()
    sampler.stop()  # a second stop is a no-op
    report = json.loads((tmp_path / "r.host.json").read_text())
    assert report["threads"]["MainThread"]["samples"] >= 5
    assert "host-sampler" not in report["threads"], "the sampler leaves itself out"
