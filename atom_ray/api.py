"""The Python API: `atom_ray.start(model, **engine_args)` runs an engine on Ray and returns a handle."""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import AsyncIterator, Sequence

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

from atom_ray.client import RayEngineClient, unwrap_ray_error
from atom_ray.cluster import ensure_ray
from atom_ray.coordinator import Coordinator
from atom_ray.dp_coordinator import DPCoordinator
from atom_ray.placement import check_gpus_per_rank, create_placement_group, placement_options, rank_options

logger = logging.getLogger(__name__)


class EngineHandle:
    """A running engine instance: a Coordinator actor (TP rank 0 and the scheduler), the RankWorker actors
    of its other ranks, and the placement group they run in."""

    def __init__(self, coordinator, client: RayEngineClient, group) -> None:
        self.coordinator = coordinator
        self.client = client
        self.tokenizer = client.tokenizer
        self.group = group

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Same contract as engine.LLM.generate: outputs in input order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidRequestError(f"{len(params)} sampling params for {len(prompts)} prompts")

        async def run_all():
            async def final(prompt, p):
                output = None
                async for output in self.client.generate(prompt, p):
                    pass
                return output
            return await asyncio.gather(*(final(prompt, p) for prompt, p in zip(prompts, params)))

        return _run_coroutine(run_all())

    def chat(self, messages, sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate([self.tokenizer.encode_chat(c) for c in conversations], sampling_params)

    async def stream(self, prompt, sampling_params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they are produced (each cumulative, with `new_text` deltas)."""
        async for output in self.client.generate(prompt, sampling_params or SamplingParams()):
            yield output

    def stats(self) -> dict:
        return self.client.stats()

    def rank_process_ids(self) -> list[tuple[str, int]]:
        """(node address, pid) of every rank, TP rank 0 first (under data parallelism, DP rank by DP rank, of
        the DP ranks that serve: one being started again after a failure is left out)."""
        import ray
        return ray.get(self.coordinator.rank_process_ids.remote())

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop the engine: a clean stop of its ranks if it comes within `timeout_s`, then the actors are
        killed and the placement group removed either way."""
        import ray
        self.client.close()
        try:
            ray.get(self.coordinator.shutdown.remote(), timeout=timeout_s)
        except Exception as exc:  # a rank that hangs in its collectives' teardown must not stop the caller
            logger.warning("the engine did not stop cleanly within %.0f s (%r); its actors are killed", timeout_s, exc)
        finally:
            ray.kill(self.coordinator)
            ray.util.remove_placement_group(self.group)


def start(model: str, *, address: str | None = None, cpus_per_rank: int | None = None,
          accelerator_type: str | None = None, placement_timeout_s: float = 600.0, gpus_per_rank: float = 1.0,
          **engine_args) -> EngineHandle:
    """Start an engine for `model` on Ray: joins `address` (or a running local cluster), else starts a
    local Ray on 127.0.0.1. Engine arguments are EngineConfig's (tensor_parallel_size, dtype, ...).
    `gpus_per_rank=0.5` puts two TP ranks on each GPU, for checking TP numerics on one GPU (slow: their
    all-reduces go through host memory, and CUDA graphs are off)."""
    import ray
    config = EngineConfig.from_kwargs(model, **engine_args)  # invalid arguments fail here, in the caller
    gpus_per_rank = check_gpus_per_rank(gpus_per_rank)
    ensure_ray(address)
    options = placement_options(config.device, config.tensor_parallel_size, cpus_per_rank, accelerator_type,
                                placement_timeout_s, gpus_per_rank, config.data_parallel_size,
                                config.enable_expert_parallel)
    group = create_placement_group(config.tensor_parallel_size * config.data_parallel_size, options)
    if config.data_parallel_size > 1:
        # The router takes no bundle; each DP rank's Coordinator is its TP rank 0.
        coordinator = ray.remote(DPCoordinator).options(num_cpus=0, max_concurrency=10_000).remote(
            config, group, options)
    else:
        # The coordinator is rank 0: it takes the first bundle (a GPU, or the rank's cores).
        coordinator = ray.remote(Coordinator).options(**rank_options(group, 0, options),
                                                      max_concurrency=10_000).remote(config, group, options)
    try:
        info = ray.get(coordinator.initialize.remote())
    except Exception as exc:
        ray.kill(coordinator)
        ray.util.remove_placement_group(group)
        raise unwrap_ray_error(exc) from None
    return EngineHandle(coordinator, RayEngineClient(coordinator, info), group)


def _run_coroutine(coroutine):
    """Run to completion from sync code, also when the calling thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    result: list = []

    def target():
        result.append(asyncio.run(coroutine))

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    return result[0]
