"""The RankWorker actor: one per GPU rank (on CPU, a share of the cores), wrapping the engine's Worker.

It is an asyncio actor so that the leader takes the next plan (the coordinator keeps two or three in
flight) while the GPU still runs the current one: `execute` launches its step, then waits for the sampled ids in a
thread, letting the next call launch the following step meanwhile."""
from __future__ import annotations

import asyncio
import os
import socket
from urllib.parse import urlparse

from engine.config import EngineConfig
from engine.core.scheduler_output import RunnerOutput, SchedulerOutput
from engine.runner.worker import Worker


class RankWorker:
    def __init__(self) -> None:
        self.worker: Worker | None = None
        # Ray may start a concurrent actor's tasks out of submission order (a plan whose arguments must
        # be fetched first waits while a later, inlined one runs), so plans carry their sequence number.
        self._next_plan = 0
        self._turn: asyncio.Condition | None = None

    def rendezvous_address(self) -> str:
        """tcp://<this node's IP>:<a free port> for the group's torch.distributed rendezvous."""
        import ray
        host = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        return f"tcp://{host}:{port}"

    async def init_worker(self, config: EngineConfig, rank: int, world_size: int, init_method: str,
                    max_model_len: int, eos_token_ids: frozenset[int]) -> None:
        if urlparse(init_method).hostname in ("127.0.0.1", "localhost"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.worker = Worker(config, rank, world_size, init_method, max_model_len, eos_token_ids)

    async def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    async def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    async def execute(self, scheduled: SchedulerOutput, sequence: int) -> RunnerOutput | None:
        if self._turn is None:
            self._turn = asyncio.Condition()
        async with self._turn:
            await self._turn.wait_for(lambda: self._next_plan == sequence)
            # One more turn of the event loop: Ray sends the previous call's reply from a callback on this
            # loop, and a CPU step would otherwise hold that reply back for its whole computation.
            await asyncio.sleep(0)
            pending = self.worker.execute_async(scheduled)
            self._next_plan += 1
            self._turn.notify_all()
        if pending.in_flight:  # a GPU step: let the next call launch while this one's ids come back
            await asyncio.get_running_loop().run_in_executor(None, pending.wait)
        return pending.result()  # on the event loop: never interleaves with another call's launch

    async def follow(self) -> None:
        # Peers block in their broadcast loop for the engine's lifetime: off the event loop.
        await asyncio.get_running_loop().run_in_executor(None, self.worker.follow)

    async def stop_followers(self) -> None:
        self.worker.stop_followers()

    async def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
