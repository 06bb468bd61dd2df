"""Runs the engine's step plans on RankWorker actors: one call per step, to the TP group leader."""
from __future__ import annotations

import itertools
import logging

from engine.config import EngineConfig
from engine.core.scheduler_output import RunnerOutput, SchedulerOutput
from engine.loader import ModelSource

from atom_ray.placement import create_placement_group, placement_options, rank_options
from atom_ray.rank_worker import RankWorker

logger = logging.getLogger(__name__)


class RayExecutor:
    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int,
                 eos_token_ids: frozenset[int], show_progress: bool = False, cpus_per_rank: int | None = None,
                 accelerator_type: str | None = None, placement_timeout_s: float = 600.0) -> None:
        import ray
        world_size = config.tensor_parallel_size
        self.options = placement_options(config.device, world_size, cpus_per_rank, accelerator_type,
                                         placement_timeout_s)
        self.group = create_placement_group(world_size, self.options)
        actor = ray.remote(RankWorker)
        self.workers = [actor.options(**rank_options(self.group, rank, self.options)).remote()
                        for rank in range(world_size)]
        self._follow_refs = []
        self._plans = itertools.count()
        try:
            init_method = ray.get(self.workers[0].rendezvous_address.remote())
            ray.get([worker.init_worker.remote(config, rank, world_size, init_method, max_model_len, eos_token_ids)
                     for rank, worker in enumerate(self.workers)])
        except Exception:
            self.shutdown()
            raise
        self.leader = self.workers[0]

    def determine_num_kv_blocks(self) -> int:
        import ray
        return min(ray.get([w.determine_num_kv_blocks.remote() for w in self.workers]))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        import ray
        ray.get([w.initialize_kv_cache.remote(num_blocks) for w in self.workers])
        self._follow_refs = [w.follow.remote() for w in self.workers[1:]]

    def execute_async(self, scheduled: SchedulerOutput):
        """An ObjectRef of the leader's RunnerOutput (awaitable)."""
        return self.leader.execute.remote(scheduled, next(self._plans))

    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        import ray
        return ray.get(self.execute_async(scheduled))

    def shutdown(self) -> None:
        import ray
        try:
            if self._follow_refs:
                ray.get(self.workers[0].stop_followers.remote(), timeout=30)
                ray.get(self._follow_refs, timeout=30)
            ray.get([w.shutdown.remote() for w in self.workers], timeout=30)
        except Exception as exc:  # shutting down: report, then force
            logger.warning("rank workers did not stop cleanly: %r", exc)
        for worker in self.workers:
            ray.kill(worker)
        ray.util.remove_placement_group(self.group)
        self.workers, self._follow_refs = [], []
