"""One rank of a tensor-parallel group: joins the group, builds its ModelRunner, and runs step plans.

Only the group leader (rank 0) receives plans from outside; it broadcasts each plan to its peers over the
CPU (gloo) group, so the caller makes one call per step per group, and only the leader returns tokens.
Peers sit in `follow()` until the leader broadcasts the stop signal.
"""
from __future__ import annotations

import logging

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


class Worker:
    def __init__(self, config: EngineConfig, rank: int, world_size: int, init_method: str,
                 max_model_len: int, eos_token_ids: frozenset[int]) -> None:
        self.rank, self.world_size = rank, world_size
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        init_parallel(rank, world_size, init_method, self.device)
        source = resolve_model(config.model, config.load_format, config.hf_overrides)
        self.runner = ModelRunner(config, source, self.device, max_model_len, eos_token_ids,
                                  show_progress=rank == 0)

    def determine_num_kv_blocks(self) -> int:
        return self.runner.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_async(self, scheduled: SchedulerOutput) -> PendingOutput:
        """Leader only: share the plan with the peers, then launch it."""
        assert self.rank == 0
        if self.world_size > 1:
            self._broadcast(scheduled)
        return self.runner.execute_async(scheduled)

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
            launched = self.runner.execute_async(scheduled)
            if previous is not None:
                previous.result()
            previous = launched
        if previous is not None:
            previous.result()

    def stop_followers(self) -> None:
        if self.rank == 0 and self.world_size > 1:
            self._broadcast(_STOP)

    def shutdown(self) -> None:
        destroy_parallel()

    def _broadcast(self, message):
        holder = [message]
        dist.broadcast_object_list(holder, src=0, group=get_parallel_state().cpu_group)
        return holder[0]
