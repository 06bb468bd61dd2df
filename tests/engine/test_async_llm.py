"""AsyncLLM: the engine thread takes commands between steps, so callers never wait behind it."""
from __future__ import annotations

import asyncio
import time

import pytest

from engine import EngineConfig, InvalidRequestError, SamplingParams
from engine.async_llm import AsyncLLM

LONG = SamplingParams(max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir):
    engine = AsyncLLM.from_config(EngineConfig(str(llama_dir), dtype="float32", max_model_len=512))
    yield engine
    engine.shutdown()


def wait_until_idle(llm: AsyncLLM, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = llm.stats()
        if stats["num_running"] == 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]:
            return stats
        time.sleep(0.02)
    pytest.fail(f"engine not idle: {llm.stats()}")


def test_refused_request_raises_in_the_caller(llm):
    async def submit():
        async for _ in llm.generate([5] * 600, SamplingParams(max_tokens=2)):
            pass
    with pytest.raises(InvalidRequestError, match="context length"):
        asyncio.run(submit())


def test_streams_of_concurrent_requests_all_finish(llm):
    async def one(n):
        last = None
        async for last in llm.generate([5, 6, 7], SamplingParams(max_tokens=n, ignore_eos=True)):
            pass
        return len(last.token_ids)
    async def many():
        return await asyncio.gather(*(one(n) for n in (3, 9, 27)))
    assert asyncio.run(many()) == [3, 9, 27]


def test_abort_while_the_loop_is_busy_frees_blocks_at_once(llm):
    async def scenario():
        busy = [asyncio.ensure_future(_drain(llm.generate([9] * 20, LONG))) for _ in range(3)]
        async for output in llm.generate([5, 6, 7, 8], LONG):
            if len(output.token_ids) >= 3:
                break  # leaving the stream aborts the request
        start = time.monotonic()
        for task in busy:
            task.cancel()
        await asyncio.gather(*busy, return_exceptions=True)
        return start
    start = asyncio.run(scenario())
    wait_until_idle(llm)
    assert time.monotonic() - start < 5


def test_a_reader_whose_event_loop_closed_does_not_stop_the_engine(llm):
    async def start_and_vanish():
        stream = llm.generate([5, 6], LONG)
        await stream.__anext__()  # never closed: its loop ends underneath it
    asyncio.run(start_and_vanish())
    wait_until_idle(llm)
    async def afterwards():
        last = None
        async for last in llm.generate([7, 8], SamplingParams(max_tokens=4, ignore_eos=True)):
            pass
        return last
    assert asyncio.run(afterwards()).finished and llm.is_healthy


async def _drain(stream):
    async for _ in stream:
        pass
