"""Runs an engine's step plans: TP rank 0 in this process (the Coordinator's, which holds rank 0's GPU or
cores), ranks 1..N-1 as RankWorker actors that run every plan rank 0 broadcasts to them over the CPU
group. A step costs no Ray call at all: Ray only starts the peers and stops them."""
from __future__ import annotations

import logging
import threading

from engine.config import EngineConfig
from engine.core.scheduler_output import RunnerOutput, SchedulerOutput
from engine.loader import ModelSource
from engine.runner.worker import Worker

from atom_ray.placement import PlacementOptions, rank_options, rendezvous_address, select_assigned_device
from atom_ray.rank_worker import RankWorker

logger = logging.getLogger(__name__)


class RayExecutor:
    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int,
                 eos_token_ids: frozenset[int], show_progress: bool = False, *, group,
                 options: PlacementOptions, dp_rank: int = 0, init_method: str | None = None) -> None:
        """DP rank `dp_rank` takes bundles dp_rank * tp .. dp_rank * tp + tp - 1 of the placement group; with
        expert parallelism every DP rank is handed the same `init_method` (one group for all ranks)."""
        import ray
        world_size = config.tensor_parallel_size
        first_bundle = dp_rank * world_size
        actor = ray.remote(RankWorker)
        self.peers = [actor.options(**rank_options(group, first_bundle + rank, options)).remote()
                      for rank in range(1, world_size)]
        self.worker: Worker | None = None
        self._follow_refs: list = []
        try:
            init_method = init_method or rendezvous_address()
            # The peers join the group while rank 0 does: their calls are in flight before it blocks.
            joined = [peer.init_worker.remote(config, rank, world_size, init_method, max_model_len, eos_token_ids,
                                              dp_rank)
                      for rank, peer in enumerate(self.peers, start=1)]
            select_assigned_device()
            self.worker = Worker(config, 0, world_size, init_method, max_model_len, eos_token_ids, dp_rank)
            ray.get(joined)
        except Exception:
            self.shutdown()
            raise

    @property
    def runs_asynchronously(self) -> bool:
        """Whether launching a step returns before it finishes (a GPU), so running ahead pays."""
        return self.worker.runner.uses_cuda

    def determine_num_kv_blocks(self) -> int:
        return min(self._on_every_rank("determine_num_kv_blocks"))

    def initialize_kv_cache(self, num_blocks: int):
        """Every rank allocates its caches for `num_blocks`; the layout (the same group and slot counts on
        every rank) is rank 0's."""
        layouts = self._on_every_rank("initialize_kv_cache", num_blocks)
        self._follow_refs = [peer.follow.remote() for peer in self.peers]
        return layouts[0]

    def execute_async(self, scheduled: SchedulerOutput, before_sampling=None):
        """Rank 0 shares the plan with its peers and launches it; `.result()` gives its RunnerOutput."""
        return self.worker.execute_async(scheduled, before_sampling)

    @property
    def samples_after_forward(self) -> bool:
        """Only a single-rank engine: peers get the plan, with its masks filled, before the launch."""
        return not self.peers

    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        return self.execute_async(scheduled).result()

    def step_mode(self, scheduled: SchedulerOutput) -> tuple[int, bool]:
        return self.worker.runner.step_mode(scheduled)

    def expert_load(self) -> dict | None:
        """Rank 0's report: under expert parallelism it counts the whole EP group's routing."""
        tracker = self.worker.runner.expert_load
        return tracker.report() if tracker is not None else None

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the peers' loops, then tear every rank's process groups down together (NCCL's teardown waits
        for every rank); a rank that does not finish within `timeout_s` is left behind, its actor killed."""
        import ray
        try:
            if self._follow_refs:
                self.worker.stop_followers()
                ray.get(self._follow_refs, timeout=timeout_s)
            refs = [peer.shutdown.remote() for peer in self.peers]
            if self.worker is not None:
                leader = threading.Thread(target=self.worker.shutdown, name="rank0-teardown", daemon=True)
                leader.start()
                leader.join(timeout_s)
                if leader.is_alive():
                    logger.warning("rank 0's process groups did not tear down within %.0f s; left to the "
                                   "process's end", timeout_s)
            ray.get(refs, timeout=timeout_s)
        except Exception as exc:  # shutting down: report, then force
            logger.warning("rank workers did not stop cleanly: %r", exc)
        for peer in self.peers:
            ray.kill(peer)
        self.peers, self._follow_refs = [], []

    def _on_every_rank(self, method: str, *args, timeout_s: float | None = None) -> list:
        """Run a collective method on every rank at once (the peers' calls go out before rank 0's runs)."""
        import ray
        refs = [getattr(peer, method).remote(*args) for peer in self.peers]
        return [getattr(self.worker, method)(*args)] + ray.get(refs, timeout=timeout_s)
