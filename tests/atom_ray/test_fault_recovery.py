"""Faults of a distributed engine on real Ray actors: a killed rank, a hung (stopped) rank and a killed
coordinator fail the requests in flight within seconds with a clear error; meanwhile a new request is
refused at once; the supervisor then starts a new engine, which serves, with every KV block free."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

import atom_ray
from atom_ray.supervisor import SupervisedEngine
from engine import SamplingParams
from engine.errors import EngineDeadError

LONG = SamplingParams(max_tokens=100_000, ignore_eos=True)  # runs until the context ends or the fault


@pytest.fixture(scope="module")
def supervised(ray_cluster, llama_dir):
    # A context long enough that the streams are still decoding when the fault comes.
    engine = SupervisedEngine(lambda: atom_ray.start(
        str(llama_dir), dtype="float32", hf_overrides={"max_position_embeddings": 32768}, max_model_len=32768,
        tensor_parallel_size=2, cpus_per_rank=1, step_timeout_s=2.0))
    yield engine
    engine.shutdown()


async def stream_until_it_fails(engine, prompt) -> tuple[BaseException | None, float]:
    """Streams a long request; returns how it ended and when (time.monotonic())."""
    try:
        async for _ in engine.generate(prompt, LONG):
            await asyncio.sleep(0)
    except Exception as exc:
        return exc, time.monotonic()
    return None, time.monotonic()


def run_fault(engine, inject) -> tuple[list, float]:
    """Three streams in flight, then `inject()`; returns their outcomes and when the fault was injected."""
    assert engine.is_healthy
    async def scenario():
        streams = [asyncio.ensure_future(stream_until_it_fails(engine, [5 + i] * 8)) for i in range(3)]
        await asyncio.sleep(2.0)  # all three are decoding
        injected = time.monotonic()
        inject()
        return await asyncio.wait_for(asyncio.gather(*streams), 60), injected
    return asyncio.run(scenario())


def assert_failed_fast_then_serves_again(engine, outcomes, injected: float, within_s: float, restarts: int) -> None:
    for error, ended in outcomes:
        assert isinstance(error, EngineDeadError), error
        assert ended - injected < within_s
    # While the engine is down a new request is refused at once, not queued.
    began = time.monotonic()
    with pytest.raises(EngineDeadError):
        asyncio.run(stream_until_it_fails_strict(engine))
    assert time.monotonic() - began < 1.0
    deadline = time.monotonic() + 120
    while not engine.is_healthy:
        assert engine.failed is None, engine.failed
        assert time.monotonic() < deadline, "the engine was not restarted"
        time.sleep(0.2)
    assert engine.restarts == restarts + 1
    output = engine.handle.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(output.token_ids) == 4
    stats = engine.stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and stats["engine_restarts"] == restarts + 1


async def stream_until_it_fails_strict(engine):
    async for _ in engine.generate([5, 6], SamplingParams(max_tokens=2)):
        pass


# (rank hit, signal, a word of the error the streams get, how soon they must get it)
FAULTS = {
    "a killed rank": (1, signal.SIGKILL, "failed", 10),
    # SIGSTOP: the rank's process is alive but does nothing, so rank 0 waits in a collective for ever; the
    # step watchdog (step_timeout_s=2 plus twice the slowest step) ends it.
    "a hung rank": (1, signal.SIGSTOP, "watchdog", 15),
    # The coordinator (rank 0 and the scheduler) stops answering its polls; the client gives it
    # COORDINATOR_SILENCE_S, then fails its requests, and the supervisor kills it.
    "a hung coordinator": (0, signal.SIGSTOP, "has not answered", 15),
    "a killed coordinator": (0, signal.SIGKILL, "", 10),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_fault_fails_requests_fast_and_the_engine_comes_back(supervised, fault):
    rank, sig, word, within_s = FAULTS[fault]
    restarts, (_, pid) = supervised.restarts, supervised.handle.rank_process_ids()[rank]
    outcomes, injected = run_fault(supervised, lambda: os.kill(pid, sig))
    try:
        assert word in str(outcomes[0][0])
        assert_failed_fast_then_serves_again(supervised, outcomes, injected, within_s=within_s, restarts=restarts)
    finally:
        if sig == signal.SIGSTOP:
            try:
                os.kill(pid, signal.SIGCONT)  # if it still exists (the restart kills it)
            except ProcessLookupError:
                pass
