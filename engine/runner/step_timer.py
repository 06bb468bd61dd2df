"""Diagnostics for multi-GPU stepping, off unless ATOM_RAY_STEP_TIMING_DIR is set (benchmarks/multi_gpu.py
sets it): CUDA events around each launched step give its device time and the idle gap before the next
step, beside the host time to launch it. `<name>.json` in that folder gets medians over the first `steps`
plans after `skip` (written as soon as they are in), and at shutdown the same figures for every step kind
of the whole run: batch-1 decodes, larger decode-only batches, steps with prompt tokens, idle (a DP rank's
padding-only step). Large gaps beside short device times mean the host, not the GPU, bounds the steps.

With `profile_steps` > 0 it also traces the GPU's kernels over that many consecutive steps, starting
`profile_skip` steps after the first step that schedules `profile_min_seqs` sequences or more (an offline
run's full batches, not a warm-up's), and writes `<name>.kernels.json`: the window's wall time, the sum of
its kernels' device time, and the kernels that took the most device time, so a large-batch step that falls
short says which operations it spends its time on. At shutdown the report also says which Triton kernel
variants were compiled during the recorded steps (engine/runner/compile_log.py): seconds of compiling inside
a timed run, which a cold cache costs only the first layout run on a fresh machine."""
from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from engine.core.scheduler_output import SchedulerOutput
from engine.runner.compile_log import COMPILES

MAX_RECORDS = 50_000  # two CUDA events each; steps past this are not recorded


def step_kind(scheduled: SchedulerOutput, replayed: bool | None = None) -> str:
    """The step's kind; `replayed` False marks a decode step that ran eagerly rather than from a decode graph
    ("decode (eager)"), so that a layout whose large batches miss the graphs shows it."""
    counts = scheduled.num_scheduled_tokens
    if not counts:
        return "idle"
    if any(n != 1 for n in counts.values()):
        return "prefill"
    kind = "decode_b1" if len(counts) == 1 else "decode"
    return f"{kind} (eager)" if replayed is False else kind


def timings(records: list[tuple]) -> list[tuple[str, float, float, float, int]]:
    """(kind, device ms, idle gap ms before the step (0 for the first), host launch ms, tokens) of each
    (start event, end event, host seconds, kind, tokens) record, in launch order."""
    out = []
    for index, (start, end, host_s, kind, tokens) in enumerate(records):
        gap = records[index - 1][1].elapsed_time(start) if index else 0.0
        out.append((kind, start.elapsed_time(end), gap, host_s * 1e3, tokens))
    return out


def summary(rows: list[tuple[str, float, float, float, int]]) -> dict:
    device, gaps, host = [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows]
    return {"steps": len(rows), "tokens": sum(r[4] for r in rows),
            "device_ms_median": statistics.median(device), "device_s_total": sum(device) / 1e3,
            "gap_ms_median": statistics.median(gaps), "gap_ms_mean": statistics.mean(gaps),
            "gap_s_total": sum(gaps) / 1e3, "host_launch_ms_median": statistics.median(host)}


def kernel_summary(events, wall_ms: float, steps: int, top: int = 40) -> dict:
    """Device time by kernel name over a traced window of `steps` steps (torch profiler CUDA events)."""
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in events:
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = by_name[event.name[:120]]
            entry[0] += (event.time_range.end - event.time_range.start) / 1e3
            entry[1] += 1
    busy = sum(ms for ms, _ in by_name.values())
    ranked = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
    return {"steps": steps, "wall_ms": wall_ms, "kernel_ms": busy,
            "kernels": [{"name": name, "ms_per_step": ms / steps, "calls_per_step": calls / steps,
                         "share": ms / busy if busy else 0.0} for name, (ms, calls) in ranked]}


class StepTimer:
    def __init__(self, folder: str, name: str, skip: int = 20, steps: int = 200, profile_steps: int = 0,
                 profile_skip: int = 20, profile_min_seqs: int = 128) -> None:
        self.path = Path(folder) / f"{name}.json"
        self.skip, self.steps = skip, steps
        self.records: list[tuple] = []
        self.seen = 0
        self.profile_steps, self.profile_skip, self.profile_min_seqs = profile_steps, profile_skip, profile_min_seqs
        self._profile_at: int | None = None  # the step number the trace starts at, once the trigger is seen
        self._profiler = None
        self._profile_started = 0.0
        COMPILES.install()
        self._compiles_from: int | None = None  # the compile log's length when recording began

    def _trace(self, scheduled: SchedulerOutput) -> None:
        """Start or stop the kernel trace around the step about to launch (step number `self.seen`)."""
        if self.profile_steps <= 0:
            return
        if self._profile_at is None and len(scheduled.num_scheduled_tokens) >= self.profile_min_seqs:
            self._profile_at = self.seen + self.profile_skip
        if self._profile_at is None:
            return
        if self.seen == self._profile_at:
            torch.cuda.synchronize()
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self._profiler.__enter__()
            self._profile_started = time.perf_counter()
        elif self.seen == self._profile_at + self.profile_steps and self._profiler is not None:
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - self._profile_started) * 1e3
            self._profiler.__exit__(None, None, None)
            report = kernel_summary(self._profiler.events(), wall_ms, self.profile_steps)
            self._profiler = None
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.with_suffix(".kernels.json").write_text(json.dumps(report))

    def launch(self, scheduled: SchedulerOutput, fn, replayed=None):
        """Run `fn` (the step's launch) timed; `replayed()`, asked after it, says whether the step's forward
        pass was a graph replay (None: not known)."""
        self.seen += 1
        self._trace(scheduled)
        if self.seen <= self.skip or len(self.records) >= MAX_RECORDS:
            return fn()
        if self._compiles_from is None:
            self._compiles_from = len(COMPILES.events)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host_start = time.perf_counter()
        start.record()
        result = fn()
        end.record()
        self.records.append((start, end, time.perf_counter() - host_start,
                             step_kind(scheduled, replayed() if replayed is not None else None),
                             sum(scheduled.num_scheduled_tokens.values())))
        if len(self.records) == self.steps:
            self.write(final=False)
        return result

    def write(self, final: bool = True) -> None:
        """The first window's figures (the file's top level), and at shutdown (`final`) every kind's."""
        if not self.records:
            return
        torch.cuda.synchronize()
        rows = timings(self.records)
        report = summary(rows[:self.steps])
        first, last = self.records[0][0], self.records[min(self.steps, len(self.records)) - 1][1]
        report["wall_per_step_ms"] = first.elapsed_time(last) / min(self.steps, len(self.records))
        if final:  # each step's gap is the idle time before it, so the kinds' totals add up to the run's
            report["whole_run"] = summary(rows)
            report["by_kind"] = {kind: summary([r for r in rows if r[0] == kind])
                                 for kind in sorted({r[0] for r in rows})}
            report["triton"] = COMPILES.report(since=self._compiles_from or 0)  # during the recorded steps
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(report))
