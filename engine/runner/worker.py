"""One rank of a tensor-parallel group: joins the group, builds its ModelRunner, and runs step plans.

Only the group leader (rank 0) receives plans from outside; it broadcasts each plan to its peers over the
CPU (gloo) group, so the caller makes one call per step per group, and only the leader returns tokens.
Peers sit in `follow()` until the leader broadcasts the stop signal.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.core.scheduler_output import RunnerOutput, SchedulerOutput
from engine.loader import resolve_model
from engine.parallel import destroy_parallel, get_parallel_state, init_parallel
from engine.runner.device import resolve_device
from engine.runner.model_runner import ModelRunner, PendingOutput

logger = logging.getLogger(__name__)

_STOP = "stop"


class StepTimer:
    """Diagnostics for multi-GPU stepping (off unless ATOM_RAY_STEP_TIMING_DIR is set): for the first
    `steps` plans after `skip`, CUDA events around each launch give each step's device time and the idle
    gap before the next one, plus the host time to launch; <name>.json gets the medians."""

    def __init__(self, folder: str, name: str, skip: int = 20, steps: int = 200) -> None:
        self.path = Path(folder) / f"{name}.json"
        self.skip, self.steps = skip, steps
        self.records: list[tuple] = []
        self.seen = 0

    def launch(self, fn):
        self.seen += 1
        if not self.skip < self.seen <= self.skip + self.steps:
            return fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host_start = time.perf_counter()
        start.record()
        result = fn()
        end.record()
        self.records.append((start, end, time.perf_counter() - host_start))
        if len(self.records) == self.steps:
            self._write()
        return result

    def _write(self) -> None:
        torch.cuda.synchronize()
        device_ms = [s.elapsed_time(e) for s, e, _ in self.records]
        gaps_ms = [a[1].elapsed_time(b[0]) for a, b in zip(self.records, self.records[1:])]
        host_ms = [h * 1e3 for _, _, h in self.records]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({
            "steps": len(device_ms), "device_ms_median": statistics.median(device_ms),
            "gap_ms_median": statistics.median(gaps_ms), "gap_ms_mean": statistics.mean(gaps_ms),
            "host_launch_ms_median": statistics.median(host_ms),
            "wall_per_step_ms": self.records[0][0].elapsed_time(self.records[-1][1]) / len(device_ms)}))


class Worker:
    def __init__(self, config: EngineConfig, rank: int, world_size: int, init_method: str,
                 max_model_len: int, eos_token_ids: frozenset[int], dp_rank: int = 0) -> None:
        """`rank` and `world_size` are this rank's place in its DP rank's TP group; with expert parallelism
        `init_method` is shared by every DP rank (their MoE layers form one group)."""
        self.rank, self.world_size = rank, world_size
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        init_parallel(rank, world_size, init_method, self.device,
                      reduce_in_fp32=config.tp_reduce_dtype == "float32"
                      or (config.tp_reduce_dtype == "auto" and self.device.type == "cuda"),
                      dp_rank=dp_rank, dp_size=config.data_parallel_size,
                      expert_parallel=config.enable_expert_parallel,
                      max_num_batched_tokens=config.max_num_batched_tokens or 0,
                      expert_exchange=config.expert_exchange)
        source = resolve_model(config.model, config.load_format, config.hf_overrides)
        self.runner = ModelRunner(config, source, self.device, max_model_len, eos_token_ids,
                                  show_progress=rank == 0)
        timing_dir = os.environ.get("ATOM_RAY_STEP_TIMING_DIR")
        self.timer = StepTimer(timing_dir, f"dp{dp_rank}_rank{rank}") if timing_dir and self.device.type == "cuda" \
            else None

    def _launch(self, scheduled: SchedulerOutput) -> PendingOutput:
        if self.timer is None:
            return self.runner.execute_async(scheduled)
        return self.timer.launch(lambda: self.runner.execute_async(scheduled))

    def determine_num_kv_blocks(self) -> int:
        return self.runner.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int):
        """Allocate this rank's caches; returns their CacheLayout."""
        return self.runner.initialize_kv_cache(num_blocks)

    def execute_async(self, scheduled: SchedulerOutput) -> PendingOutput:
        """Leader only: share the plan with the peers, then launch it."""
        assert self.rank == 0
        if self.world_size > 1:
            self._broadcast(scheduled)
        return self._launch(scheduled)

    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput | None:
        return self.execute_async(scheduled).result()

    def follow(self) -> None:
        """Peers only: run every plan the leader broadcasts until it says stop. Each plan is launched
        before the previous step's ids are recorded, so a peer keeps pace with a leader that runs ahead."""
        assert self.rank != 0
        previous = None
        while True:
            scheduled = self._broadcast(None)
            if scheduled == _STOP:
                break
            launched = self._launch(scheduled)
            if previous is not None:
                previous.result()
            previous = launched
        if previous is not None:
            previous.result()

    def stop_followers(self) -> None:
        if self.rank == 0 and self.world_size > 1:
            self._broadcast(_STOP)

    def shutdown(self) -> None:
        if self.device.type == "cuda":  # no collective of this rank still queued when its groups go
            torch.cuda.synchronize(self.device)
        destroy_parallel(abort=self.device.type == "cuda")  # the rank's process ends next

    def _broadcast(self, message):
        holder = [message]
        dist.broadcast_object_list(holder, group=get_parallel_state().cpu_group, group_src=0)
        return holder[0]
