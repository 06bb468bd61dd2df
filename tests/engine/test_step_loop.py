"""The step loop that one request cannot kill: bounds at the engine's boundary, a request whose output
fails fails alone, a cancelled add is withdrawn, and a hung step is turned into a dead engine by the
watchdog within its limit."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine import EngineConfig, InvalidRequestError, LLMEngine, RequestFailedError, SamplingParams, SamplingParamsError
from engine.async_llm import AsyncLLM
from engine.engine_loop import EngineLoop
from engine.errors import EngineDeadError
from engine.llm_engine import InProcessExecutor
from tiny_models import VOCAB_SIZE

PROMPT = list(range(10, 30))


@pytest.fixture(scope="module")
def llm(llama_dir):
    engine = AsyncLLM.from_config(EngineConfig(str(llama_dir), dtype="float32", max_model_len=256))
    yield engine
    engine.shutdown()


async def complete(llm, prompt, params, request_id=None):
    output = None
    async for output in llm.generate(prompt, params, request_id):
        pass
    return output


def wait_idle(llm, timeout=10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = llm.stats()
        if (stats["num_running"] == 0 and stats["num_waiting"] == 0
                and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]):
            return stats
        time.sleep(0.02)
    pytest.fail(f"engine not idle: {llm.stats()}")


@pytest.mark.parametrize("values, field", [
    ({"top_k": 2**70}, "top_k"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"top_p": float("nan")}, "top_p"),
    ({"seed": 2**70}, "seed"), ({"seed": -(2**64)}, "seed"), ({"n": 10**6}, "n"), ({"max_tokens": 10**30}, "max_tokens"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"), ({"presence_penalty": float("-inf")}, "presence_penalty"),
    ({"min_tokens": 10**400}, "min_tokens"), ({"stop": ["x" * 5000]}, "stop"), ({"stop": ["a"] * 1000}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": [2**40]}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"), ({"stop": 5}, "stop"), ({"stop_token_ids": "1,2"}, "stop_token_ids"),
])
def test_out_of_range_sampling_params_are_refused_naming_the_field(values, field):
    with pytest.raises(SamplingParamsError, match=rf"SamplingParams\.{field}") as caught:
        SamplingParams(**values)
    assert caught.value.param == field


def test_unknown_sampling_parameter_from_a_mapping_is_named():
    with pytest.raises(SamplingParamsError, match="unknown sampling parameter.*top_q") as caught:
        SamplingParams.from_dict({"top_q": 0.5, "temperature": 0})
    assert caught.value.param == "top_q"


def test_stop_token_id_outside_the_vocabulary_is_refused_and_the_engine_serves_on(llm):
    params = SamplingParams(min_tokens=1, max_tokens=4, stop_token_ids=[VOCAB_SIZE])
    with pytest.raises(SamplingParamsError, match=r"stop_token_ids \[389\] are outside the vocabulary"):
        asyncio.run(complete(llm, PROMPT, params))
    output = asyncio.run(complete(llm, PROMPT, SamplingParams(min_tokens=1, max_tokens=4, stop_token_ids=[VOCAB_SIZE - 1])))
    assert output.finished and llm.is_healthy
    wait_idle(llm)


def test_top_k_beyond_the_vocabulary_samples_as_no_top_k(llm):
    wide = asyncio.run(complete(llm, PROMPT, SamplingParams(top_k=2**31 - 1, seed=3, max_tokens=8, ignore_eos=True)))
    plain = asyncio.run(complete(llm, PROMPT, SamplingParams(seed=3, max_tokens=8, ignore_eos=True)))
    assert wide.token_ids == plain.token_ids


def test_a_tiny_positive_temperature_samples_at_the_smallest_safe_one(llm):
    tiny = asyncio.run(complete(llm, PROMPT, SamplingParams(temperature=1e-300, seed=1, max_tokens=6, ignore_eos=True)))
    smallest = asyncio.run(complete(llm, PROMPT, SamplingParams(temperature=1e-2, seed=1, max_tokens=6, ignore_eos=True)))
    assert tiny.token_ids == smallest.token_ids and all(0 <= t < VOCAB_SIZE for t in tiny.token_ids)


def test_a_prompt_with_a_lone_surrogate_is_an_invalid_request(smollm2):
    with pytest.raises(InvalidRequestError, match="lone surrogate"):
        smollm2.generate("Hello \ud800 world", SamplingParams(max_tokens=2))


def test_a_request_whose_output_fails_fails_alone(llm, monkeypatch):
    processor = llm.engine.output_processor
    original = processor._add_tokens

    def add_tokens(sample, request):
        if request.request_id.startswith("doomed"):
            raise RuntimeError("detokenizer exploded")
        return original(sample, request)

    monkeypatch.setattr(processor, "_add_tokens", add_tokens)

    async def both():
        return await asyncio.gather(
            complete(llm, PROMPT, SamplingParams(max_tokens=30, ignore_eos=True, n=2, seed=0), "doomed"),
            complete(llm, PROMPT, SamplingParams(max_tokens=30, ignore_eos=True), "fine"),
            return_exceptions=True)

    doomed, fine = asyncio.run(both())
    assert isinstance(doomed, RequestFailedError) and "detokenizer exploded" in str(doomed)
    assert fine.finished and len(fine.token_ids) == 30
    assert llm.is_healthy
    wait_idle(llm)


def test_a_cancelled_caller_leaves_no_request_behind(llm):
    async def cancel_after_submit():
        task = asyncio.ensure_future(complete(llm, PROMPT, SamplingParams(max_tokens=200, ignore_eos=True)))
        await asyncio.sleep(0)  # the add is queued; cancel while the caller awaits its confirmation
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    for _ in range(5):
        asyncio.run(cancel_after_submit())
    wait_idle(llm)
    assert llm.is_healthy


def test_an_add_cancelled_before_the_loop_takes_it_is_withdrawn_and_the_loop_lives(llama_dir):
    released = threading.Event()
    config = EngineConfig(str(llama_dir), dtype="float32", max_model_len=128)

    def build():
        released.wait(30)
        return LLMEngine(config, show_progress=False)

    outputs = []
    loop = EngineLoop(build, outputs.extend, lambda exc: None)
    withdrawn = loop.add("gone", PROMPT, SamplingParams(max_tokens=4))
    assert withdrawn.cancel()  # the caller gave up while the engine was busy
    kept = loop.add("kept", PROMPT, SamplingParams(max_tokens=4))
    released.set()
    kept.result(timeout=60)
    deadline = time.monotonic() + 30
    while not any(o.request_id == "kept" and o.finished for o in outputs):
        assert time.monotonic() < deadline, "the loop stopped serving"
        time.sleep(0.02)
    assert loop.is_healthy
    assert not any(o.request_id == "gone" for o in outputs)
    loop.shutdown()


class HangingExecutor(InProcessExecutor):
    """Runs steps normally until `hang` is set, then blocks inside the step (a rank that stopped)."""
    hang = threading.Event()
    unblock = threading.Event()

    def execute(self, scheduled):
        if self.hang.is_set() and not scheduled.is_empty:
            self.unblock.wait(60)
        return super().execute(scheduled)


def test_the_watchdog_turns_a_hung_step_into_a_dead_engine_within_its_limit(llama_dir):
    config = EngineConfig(str(llama_dir), dtype="float32", max_model_len=128, step_timeout_s=1.0)
    llm = AsyncLLM(LLMEngine(config, executor_factory=HangingExecutor, show_progress=False))
    try:
        asyncio.run(complete(llm, PROMPT, SamplingParams(max_tokens=4)))  # steps complete: the limit settles
        limit = llm._loop.step_limit_s()
        assert 1.0 <= limit < 3.0
        HangingExecutor.hang.set()
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="watchdog"):
            asyncio.run(complete(llm, PROMPT, SamplingParams(max_tokens=4)))
        assert time.monotonic() - started < limit + 2.0
        assert not llm.is_healthy
        began = time.monotonic()
        with pytest.raises(EngineDeadError):  # a dead engine refuses at once
            asyncio.run(complete(llm, PROMPT, SamplingParams(max_tokens=4)))
        assert time.monotonic() - began < 1.0
    finally:
        HangingExecutor.unblock.set()
        llm.shutdown()
