"""The multi-GPU step diagnostics (engine/runner/step_timer.py) on the CPU, with CUDA events stood in by a
clock the test advances: every step's device time, the idle gap before it and its kind add up per kind and
over the whole run, so an offline run's profile says whether the host or the GPU bounds it."""
from __future__ import annotations

import json

import pytest
import torch

from engine.core.scheduler_output import SchedulerOutput
from engine.runner import step_timer
from engine.runner.step_timer import StepTimer, step_kind


class Clock:
    now = 0.0


class FakeEvent:
    def __init__(self, enable_timing=True):
        self.at = None

    def record(self):
        self.at = Clock.now

    def elapsed_time(self, other) -> float:
        return other.at - self.at


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    Clock.now = 0.0


def plan(counts: dict) -> SchedulerOutput:
    return SchedulerOutput(num_scheduled_tokens=counts)


def test_step_kinds():
    assert step_kind(plan({})) == "idle"
    assert step_kind(plan({"a": 1})) == "decode_b1"
    assert step_kind(plan({"a": 1, "b": 1})) == "decode"
    assert step_kind(plan({"a": 1, "b": 7})) == "prefill"
    # a decode step that missed the decode graphs is its own kind; prefill and idle steps are not split
    assert step_kind(plan({"a": 1, "b": 1}), replayed=False) == "decode (eager)"
    assert step_kind(plan({"a": 1}), replayed=False) == "decode_b1 (eager)"
    assert step_kind(plan({"a": 1, "b": 1}), replayed=True) == "decode"
    assert step_kind(plan({"a": 1, "b": 7}), replayed=False) == "prefill"
    assert step_kind(plan({}), replayed=False) == "idle"


def test_eager_decode_steps_are_counted_apart(fake_cuda, tmp_path):
    timer = StepTimer(str(tmp_path), "r", skip=0, steps=1000)
    for counts, replayed in [({"a": 1, "b": 1}, True), ({"a": 1, "b": 1}, False), ({"a": 1, "b": 1}, False)]:
        timer.launch(plan(counts), lambda: None, lambda replayed=replayed: replayed)
    timer.write()
    kinds = json.loads((tmp_path / "r.json").read_text())["by_kind"]
    assert {k: v["steps"] for k, v in kinds.items()} == {"decode": 1, "decode (eager)": 2}


def test_every_kind_sums_its_device_time_and_the_gaps_before_its_steps(fake_cuda, tmp_path):
    timer = StepTimer(str(tmp_path), "dp0_rank0", skip=1, steps=2)
    # (plan, device ms, idle ms before the step): the first is skipped (warm-up)
    steps = [({"w": 1}, 5.0, 0.0), ({"a": 1}, 3.0, 1.0), ({"a": 1}, 3.0, 0.5), ({"a": 1, "b": 9}, 20.0, 4.0),
             ({"a": 1, "b": 1}, 6.0, 0.25), ({}, 2.0, 0.0)]
    for counts, device_ms, gap_ms in steps:
        Clock.now += gap_ms

        def run(device_ms=device_ms):
            Clock.now += device_ms
        timer.launch(plan(counts), lambda: run())
    first = json.loads((tmp_path / "dp0_rank0.json").read_text())
    assert first["steps"] == 2 and first["device_ms_median"] == 3.0 and "by_kind" not in first
    timer.write()
    report = json.loads((tmp_path / "dp0_rank0.json").read_text())
    kinds = report["by_kind"]
    assert {k: v["steps"] for k, v in kinds.items()} == {"decode_b1": 2, "prefill": 1, "decode": 1, "idle": 1}
    assert kinds["prefill"]["tokens"] == 10 and kinds["prefill"]["device_s_total"] == pytest.approx(0.020)
    assert kinds["prefill"]["gap_s_total"] == pytest.approx(0.004), "the idle time before the prefill step"
    assert kinds["decode_b1"]["gap_s_total"] == pytest.approx(0.0005), "its first step's gap is before recording"
    whole = report["whole_run"]
    assert whole["device_s_total"] == pytest.approx(0.034) and whole["gap_s_total"] == pytest.approx(0.00475)
    assert sum(k["gap_s_total"] for k in kinds.values()) == pytest.approx(whole["gap_s_total"])


def test_recording_stops_at_its_bound(fake_cuda, tmp_path, monkeypatch):
    monkeypatch.setattr(step_timer, "MAX_RECORDS", 3)
    timer = StepTimer(str(tmp_path), "r", skip=0, steps=100)
    for _ in range(5):
        timer.launch(plan({"a": 1}), lambda: None)
    assert len(timer.records) == 3


class FakeTrace:
    """torch.profiler.profile stood in: each launched step while tracing adds one CUDA event per kernel."""
    active = None

    def __init__(self, activities):
        self.kernels = []

    def __enter__(self):
        FakeTrace.active = self
        return self

    def __exit__(self, *exc):
        FakeTrace.active = None

    def events(self):
        class Range:
            def __init__(self, us):
                self.start, self.end = 0.0, us

        class Event:
            def __init__(self, name, us):
                self.name, self.time_range = name, Range(us)
                self.device_type = torch.autograd.DeviceType.CUDA
        return [Event(name, us) for name, us in self.kernels]


def test_kernel_trace_covers_the_full_batch_window_only(fake_cuda, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.profiler, "profile", FakeTrace)
    timer = StepTimer(str(tmp_path), "dp0_rank1", skip=0, steps=1000, profile_steps=3, profile_skip=2,
                      profile_min_seqs=4)
    small, full = {"a": 1, "b": 1}, {s: 1 for s in "abcd"}
    traced = []

    def step(counts):
        def run():
            if FakeTrace.active is not None:
                traced.append(len(counts))
                FakeTrace.active.kernels += [("gemm", 300.0), ("all_reduce", 100.0)]
        timer.launch(plan(counts), run)
    for counts in [small, small, full, small, full, full, full, full, small, full]:
        step(counts)
    # The trigger is the first full batch (step 3); the window is steps 5, 6 and 7.
    assert traced == [4, 4, 4]
    report = json.loads((tmp_path / "dp0_rank1.kernels.json").read_text())
    assert report["steps"] == 3 and report["kernel_ms"] == pytest.approx(1.2)
    assert [k["name"] for k in report["kernels"]] == ["gemm", "all_reduce"]
    assert report["kernels"][0]["ms_per_step"] == pytest.approx(0.3)
    assert report["kernels"][0]["calls_per_step"] == 1 and report["kernels"][1]["share"] == pytest.approx(0.25)


def test_no_trace_without_profile_steps(fake_cuda, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.profiler, "profile", FakeTrace)
    timer = StepTimer(str(tmp_path), "r", skip=0, steps=1000, profile_min_seqs=1)
    for _ in range(50):
        timer.launch(plan({"a": 1, "b": 1}), lambda: None)
    assert not (tmp_path / "r.kernels.json").exists()


def test_the_compile_log_times_each_variant_and_tells_compiles_from_loads(monkeypatch):
    import time

    from engine.runner import compile_log
    monkeypatch.setattr(compile_log, "COMPILE_S", 0.05)

    class FakeJIT:  # Triton's JITFunction: _do_compile makes or loads one variant
        def __init__(self, name, seconds):
            self.__name__, self.seconds = name, seconds

        def _do_compile(self, *args):
            time.sleep(self.seconds)
            return args

    log = compile_log.CompileLog()
    assert log.install(FakeJIT) and log.install(FakeJIT)  # a second install does not wrap twice
    slow, fast = FakeJIT("_decode_reduce_kernel", 0.06), FakeJIT("_prefill_kernel", 0.0)
    assert slow._do_compile(1, 2) == (1, 2)
    fast._do_compile()
    slow._do_compile()
    report = log.report()
    assert report["variants"] == 3 and report["compiled"] == 2 and report["compile_s"] >= 0.12
    assert report["kernels"] == [{"name": "_decode_reduce_kernel", "compiled": 2,
                                  "seconds": report["kernels"][0]["seconds"]}]
    assert log.report(since=2)["compiled"] == 1
    assert not compile_log.CompileLog().install(type("NoJIT", (), {}))
