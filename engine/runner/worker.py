"""One rank of a tensor-parallel group: joins the group, builds its ModelRunner, and runs step plans.

Only the group leader (rank 0) receives plans from outside; it broadcasts each plan to its peers over the
CPU (gloo) group, so the caller makes one call per step per group, and only the leader returns tokens.
Peers sit in `follow()` until the leader broadcasts the stop signal.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.core.scheduler_output import RunnerOutput, SchedulerOutput
from engine.loader import resolve_model
from engine.parallel import destroy_parallel, get_parallel_state, init_parallel
from engine.runner.device import resolve_device
from engine.runner.host_sampler import HostSampler
from engine.runner.model_runner import ModelRunner
from engine.runner.pending_output import PendingOutput
from engine.runner.step_timer import StepTimer

logger = logging.getLogger(__name__)

_STOP = "stop"


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
        profile_steps = int(os.environ.get("ATOM_RAY_KERNEL_PROFILE_STEPS", "0"))
        self.timer = StepTimer(timing_dir, f"dp{dp_rank}_rank{rank}", profile_steps=profile_steps) \
            if timing_dir and self.device.type == "cuda" else None
        sample_hz = float(os.environ.get("ATOM_RAY_HOST_SAMPLE_HZ", "0"))
        self.sampler = HostSampler(os.path.join(timing_dir, f"dp{dp_rank}_rank{rank}.host.json"), sample_hz) \
            if timing_dir and sample_hz > 0 else None

    def _launch(self, scheduled: SchedulerOutput, before_sampling=None) -> PendingOutput:
        if self.sampler is not None:
            self.sampler.start()  # from the first step: start-up and graph capture stay out
        if self.timer is None:
            return self.runner.execute_async(scheduled, before_sampling)
        return self.timer.launch(scheduled, lambda: self.runner.execute_async(scheduled, before_sampling),
                                 lambda: self.runner.last_step_replayed)

    def determine_num_kv_blocks(self) -> int:
        return self.runner.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int):
        """Allocate this rank's caches; returns their CacheLayout."""
        return self.runner.initialize_kv_cache(num_blocks)

    def execute_async(self, scheduled: SchedulerOutput, before_sampling=None) -> PendingOutput:
        """Leader only: share the plan with the peers, then launch it (`before_sampling`: one rank only, see
        ModelRunner.execute_async)."""
        assert self.rank == 0
        if self.world_size > 1:
            assert before_sampling is None, "peers need the plan's masks before the launch"
            self._broadcast(scheduled)
        return self._launch(scheduled, before_sampling)

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
        if self.timer is not None:
            self.timer.write()
        if self.sampler is not None:
            self.sampler.stop()
        destroy_parallel(abort=self.device.type == "cuda")  # the rank's process ends next

    def _broadcast(self, message):
        holder = [message]
        dist.broadcast_object_list(holder, group=get_parallel_state().cpu_group, group_src=0)
        return holder[0]
