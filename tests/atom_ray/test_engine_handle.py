"""atom_ray.start: the engine handle's generate (engine.LLM's contract), stream, abort and errors."""
from __future__ import annotations

import asyncio
import time

import pytest

import atom_ray
from engine import ConfigError, InvalidRequestError, LLM, SamplingParams


@pytest.fixture(scope="module")
def handle(ray_cluster, llama_dir):
    engine = atom_ray.start(str(llama_dir), dtype="float32", max_model_len=128)
    yield engine
    engine.shutdown()


def test_generate_has_the_offline_contract(handle, llama_dir):
    prompts = [[5, 6, 7], "The quick brown fox", list(range(10, 50))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 5)]
    expected = LLM(str(llama_dir), dtype="float32", max_model_len=128, show_progress=False).generate(prompts, params)
    outputs = handle.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert [o.text for o in outputs] == [o.text for o in expected]
    assert [o.prompt_token_ids for o in outputs] == [o.prompt_token_ids for o in expected]
    assert [o.finish_reason for o in outputs] == ["length"] * 3


def test_stream_yields_deltas_that_add_up(handle):
    async def collect():
        pieces, last = [], None
        async for output in handle.stream("The quick brown fox", SamplingParams(temperature=0, max_tokens=12,
                                                                               ignore_eos=True)):
            pieces.append(output.outputs[0].new_text)
            last = output
        return pieces, last
    pieces, last = asyncio.run(collect())
    assert last.finished and len(last.token_ids) == 12
    assert "".join(pieces) == last.text and len(pieces) > 1
    # The engine's timestamps travel back with the outputs (same node here, so they can be compared).
    m = last.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.finished_time <= time.monotonic()


def test_leaving_a_stream_early_aborts_and_frees_kv_blocks(handle):
    async def start_and_leave():
        async for output in handle.stream([5, 6, 7, 8], SamplingParams(max_tokens=100, ignore_eos=True)):
            if len(output.token_ids) >= 3:
                break
    asyncio.run(start_and_leave())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = handle.stats()
        if stats.get("num_running") == 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]:
            return
        time.sleep(0.1)
    pytest.fail(f"blocks not returned: {handle.stats()}")


def test_invalid_request_raises_the_engine_error(handle):
    with pytest.raises(InvalidRequestError, match="context length"):
        handle.generate([list(range(3, 200))], SamplingParams(max_tokens=2))
    assert handle.generate([[5]], SamplingParams(max_tokens=2, ignore_eos=True))[0].finish_reason == "length"


def test_invalid_engine_argument_fails_in_the_caller(ray_cluster, llama_dir):
    with pytest.raises(ConfigError, match="block_size"):
        atom_ray.start(str(llama_dir), block_size=3)


def test_engine_start_failure_is_reported_with_its_cause(ray_cluster, tmp_path):
    from engine.loader import ModelSourceError
    with pytest.raises(ModelSourceError, match="no config.json"):
        atom_ray.start(str(tmp_path))


def test_pipelined_plans_survive_aborts_and_preemption(ray_cluster, llama_dir):
    """Concurrent requests, some left early (aborted), on a KV cache small enough to preempt, while the
    coordinator keeps several plans in flight: every request ends and every block comes back."""
    import random
    engine = atom_ray.start(str(llama_dir), dtype="float32", max_model_len=256, num_kv_blocks=40,
                            max_num_seqs=16, max_num_batched_tokens=64)
    rng = random.Random(0)

    async def one(seed):
        prompt = [rng.randrange(3, 380) for _ in range(rng.randint(5, 120))]
        leave_after = rng.choice([None, None, 1, 3, 10])
        count = 0
        params = SamplingParams(max_tokens=rng.randint(1, 60), ignore_eos=True, temperature=0.7, seed=seed)
        async for _ in engine.stream(prompt, params):
            count += 1
            if leave_after and count >= leave_after:
                break

    async def waves():
        for wave in range(3):
            await asyncio.gather(*(one(wave * 100 + i) for i in range(24)))

    try:
        asyncio.run(waves())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            stats = engine.stats()
            if stats["num_running"] == 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]:
                break
            time.sleep(0.1)
        assert stats["num_preemptions"] > 0
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and stats["error"] is None
    finally:
        engine.shutdown()
