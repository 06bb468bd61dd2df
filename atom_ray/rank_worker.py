"""The RankWorker actor: TP ranks 1..N-1 of an engine instance (rank 0 runs in the Coordinator's process),
one per GPU (on CPU, a share of the cores), wrapping the engine's Worker. Once the KV cache is set up, a
peer sits in `follow()`, running every plan that rank 0 broadcasts, until rank 0 broadcasts the stop."""
from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

from engine.config import EngineConfig
from engine.runner.worker import Worker

from atom_ray.placement import select_assigned_device


class RankWorker:
    def __init__(self) -> None:
        self.worker: Worker | None = None
        # Every call into the Worker runs on this one thread: CUDA's current device is per thread.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rank-worker")

    async def init_worker(self, config: EngineConfig, rank: int, world_size: int, init_method: str,
                          max_model_len: int, eos_token_ids: frozenset[int], dp_rank: int = 0) -> None:
        await self._off_loop(self._init_worker, config, rank, world_size, init_method, max_model_len,
                             eos_token_ids, dp_rank)

    def _init_worker(self, config, rank, world_size, init_method, max_model_len, eos_token_ids, dp_rank) -> None:
        select_assigned_device()
        self.worker = Worker(config, rank, world_size, init_method, max_model_len, eos_token_ids, dp_rank)

    async def determine_num_kv_blocks(self) -> int:
        return await self._off_loop(self.worker.determine_num_kv_blocks)

    async def initialize_kv_cache(self, num_blocks: int):
        return await self._off_loop(self.worker.initialize_kv_cache, num_blocks)

    async def follow(self) -> None:
        await self._off_loop(self.worker.follow)

    def process_id(self) -> tuple[str, int]:
        """(node address, pid) of this rank's process: which process to look at when a rank misbehaves."""
        import ray
        return ray.util.get_node_ip_address(), os.getpid()

    async def shutdown(self) -> None:
        if self.worker is not None:
            await self._off_loop(self.worker.shutdown)

    async def _off_loop(self, fn, *args):
        """Collective work blocks until every rank takes part (joining the group, profiling, graph capture,
        following): never on the event loop, which must stay free to take the next call."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)
