"""The RankWorker actor: one per GPU rank (on CPU, a share of the cores), wrapping the engine's Worker."""
from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

from engine.config import EngineConfig
from engine.core.scheduler_output import RunnerOutput, SchedulerOutput
from engine.runner.worker import Worker


class RankWorker:
    def __init__(self) -> None:
        self.worker: Worker | None = None

    def rendezvous_address(self) -> str:
        """tcp://<this node's IP>:<a free port> for the group's torch.distributed rendezvous."""
        import ray
        host = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        return f"tcp://{host}:{port}"

    def init_worker(self, config: EngineConfig, rank: int, world_size: int, init_method: str,
                    max_model_len: int, eos_token_ids: frozenset[int]) -> None:
        if urlparse(init_method).hostname in ("127.0.0.1", "localhost"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.worker = Worker(config, rank, world_size, init_method, max_model_len, eos_token_ids)

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput | None:
        return self.worker.execute(scheduled)

    def follow(self) -> None:
        self.worker.follow()

    def stop_followers(self) -> None:
        self.worker.stop_followers()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
