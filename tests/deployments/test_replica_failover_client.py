"""A replica's failover client (deployments/replica_failover.py) without Ray: an in-process engine (the tiny
Llama in float32) whose streams fail mid-way on demand. Each stream continues on the restarted engine, or
on another replica's through the resume protocol, with exactly the outputs of an undisturbed run (greedy,
seeded, n=2 with logprobs, a stop string, a grammar, penalties with min_tokens): nothing repeated, nothing
dropped, the original prompt. Past resume_timeout_s a request ends with a clean error, and a continuation
the engine refuses ends alone, saying why; the counters say what happened."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time

import pytest

import tiny_models
from atom_ray.coordinator import OutputDelta
from deployments.replica_failover import RETRY_INTERVAL_S, ReplicaFailover
from engine import SamplingParams
from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from engine.errors import EngineDeadError, InvalidRequestError, RequestFailedError

PROMPTS = [[5, 17, 33, 60], [9, 8, 7, 6, 5], [100, 2, 300], [42, 43, 44, 45, 46, 47], [7, 70, 170], [1, 200, 30]]
PARAMS = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=40, ignore_eos=True),
          SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=40, ignore_eos=True, logprobs=2),
          SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True),
          # A grammar takes the delivered tokens first; penalties and min_tokens count them as outputs.
          SamplingParams(temperature=0, max_tokens=64, structured_outputs={"regex": r"[a-z]{3}( [a-z]{2,6}){14}\."}),
          SamplingParams(temperature=0.8, seed=9, max_tokens=40, min_tokens=36, frequency_penalty=1.5,
                         presence_penalty=1.0, repetition_penalty=1.3)]
FAIL_AFTER_TOKENS = 6
_incarnations = itertools.count()


class FlakyEngine:
    """A SupervisedEngine stand-in over an in-process engine: `fail()` ends every live stream with
    EngineDeadError, as a dead engine's client does, and leaves it unavailable for `restart_s` (None: for
    good), as the supervisor does while it starts a new one."""

    def __init__(self, llm: AsyncLLM, refuse_resumes: BaseException | None = None) -> None:
        self.llm = llm
        # Each stream runs under an id of its own in the shared engine (as on a separate engine): under the
        # request's id, a step of the failed stream published late would reach its continuation.
        self.engine_ids: dict[str, str] = {}
        self.tokenizer, self.max_model_len = llm.tokenizer, llm.max_model_len
        self.refuse_resumes = refuse_resumes
        self.back_at: float | None = 0.0
        self.live: dict[str, asyncio.Event] = {}
        self.resumes: list = []

    @property
    def is_healthy(self) -> bool:
        return self.back_at is not None and time.monotonic() >= self.back_at

    def fail(self, restart_s: float | None) -> None:
        self.back_at = None if restart_s is None else time.monotonic() + restart_s
        for failed in self.live.values():
            failed.set()

    def generate(self, prompt, params, request_id=None, resume=None):
        if not self.is_healthy:
            raise EngineDeadError("the engine is restarting")
        if resume is not None:
            self.resumes.append(resume)
            if self.refuse_resumes is not None:
                raise self.refuse_resumes
        return self._stream(prompt, params, request_id, resume)

    async def _stream(self, prompt, params, request_id, resume):
        failed = self.live.setdefault(request_id, asyncio.Event())
        self.engine_ids[request_id] = engine_id = f"{request_id}#{next(_incarnations)}"
        stream = self.llm.generate(prompt, params, engine_id, resume)
        try:
            while True:
                step = asyncio.ensure_future(anext(stream))
                waiter = asyncio.ensure_future(failed.wait())
                await asyncio.wait({step, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if failed.is_set():
                    step.cancel()
                    await asyncio.wait({step})  # the engine's stream is free to close only after
                    raise EngineDeadError("the engine failed: its coordinator died")
                try:
                    output = step.result()
                except StopAsyncIteration:
                    return
                yield dataclasses.replace(output, request_id=request_id)
        finally:
            self.live.pop(request_id, None)
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        self.llm.abort(self.engine_ids.get(request_id, request_id))

    def stats(self) -> dict:
        return self.llm.stats()


class InProcessPeers:
    """What a Serve handle to the other replicas offers the failover client, over another replica's failover
    client in this process: resume_stream(request, avoid_replica=...) as a stream one can cancel."""

    def __init__(self, other: ReplicaFailover) -> None:
        self.other = other
        self.calls: list[str] = []

    def __call__(self):
        return self, "replica-a"

    def options(self, stream: bool):
        assert stream
        return self

    @property
    def resume_stream(self):
        return self

    def remote(self, request: dict, avoid_replica: str):
        self.calls.append(avoid_replica)
        return _CancellableStream(self.other.resume_stream(request))


class _CancellableStream:
    def __init__(self, generator) -> None:
        self.generator = generator

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await anext(self.generator)

    def cancel(self) -> None:
        asyncio.ensure_future(self.generator.aclose())


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """One in-process engine for every "replica": two would share the process's forward context."""
    folder = tiny_models.make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")
    engine = AsyncLLM.from_config(EngineConfig.from_kwargs(str(folder), dtype="float32", max_num_seqs=16))
    yield engine
    engine.shutdown()


async def consume(client: ReplicaFailover, prompt, params: SamplingParams, request_id: str, progress: dict):
    """One request to its end: (final output, per sample the new tokens and text of every output in order)."""
    streamed: dict[int, tuple[list[int], str]] = {}
    output = None
    async for output in client.generate(prompt, params, request_id):
        for completion in output.outputs:
            tokens, text = streamed.get(completion.index, ([], ""))
            streamed[completion.index] = (tokens + completion.new_token_ids, text + completion.new_text)
        progress[request_id] = len(streamed[0][0])
    return output, streamed


async def run_all(client: ReplicaFailover, prompts, params, fault=None):
    """Every request at once; `fault()` once each has FAIL_AFTER_TOKENS tokens."""
    progress: dict = {}
    tasks = [asyncio.ensure_future(consume(client, p, sp, f"r{i}", progress))
             for i, (p, sp) in enumerate(zip(prompts, params))]
    if fault is not None:
        deadline = time.monotonic() + 60
        while any(progress.get(f"r{i}", 0) < FAIL_AFTER_TOKENS for i in range(len(tasks))):
            assert time.monotonic() < deadline and not any(task.done() for task in tasks), progress
            await asyncio.sleep(0.005)
        fault()
    return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)


@pytest.fixture(scope="module")
def undisturbed(llm):
    return asyncio.run(run_all(ReplicaFailover(FlakyEngine(llm), 10.0), PROMPTS, PARAMS))


def assert_undisturbed(outcomes, expected) -> None:
    assert expected[4][0].finish_reason == "stop"  # the grammar's end
    for index, (outcome, reference) in enumerate(zip(outcomes, expected)):
        assert not isinstance(outcome, BaseException), (index, outcome)
        (output, streamed), (reference_output, _) = outcome, reference
        assert output.finished and output.prompt_token_ids == PROMPTS[index]
        assert len(output.outputs) == PARAMS[index].n
        for completion, wanted in zip(output.outputs, reference_output.outputs):
            assert completion.token_ids == wanted.token_ids, (index, completion.index)
            assert completion.text == wanted.text and completion.finish_reason == wanted.finish_reason
            assert streamed[completion.index] == (wanted.token_ids, wanted.text)  # nothing repeated or dropped
            if wanted.logprobs is not None:
                assert [sorted(p) for p in completion.logprobs] == [sorted(p) for p in wanted.logprobs]


def test_streams_continue_on_the_restarted_engine_with_the_undisturbed_outputs(llm, undisturbed):
    engine = FlakyEngine(llm)
    client = ReplicaFailover(engine, resume_timeout_s=30.0)
    outcomes = asyncio.run(run_all(client, PROMPTS, PARAMS, fault=lambda: engine.fail(restart_s=0.5)))
    assert_undisturbed(outcomes, undisturbed)
    assert len(engine.resumes) == len(PROMPTS)
    n2 = next(resume for resume in engine.resumes if len(resume.samples) == 2)
    assert all(len(sample.token_ids) >= FAIL_AFTER_TOKENS for sample in n2.samples)
    stats = client.stats()
    assert stats["replica_resumed_requests"] == len(PROMPTS) and stats["replica_failed_resumes"] == 0
    assert stats["replica_resume_latency_s_max"] >= 0.4  # the restart's pause
    assert stats["replica_resume_latency_s_sum"] >= len(PROMPTS) * 0.4


def test_streams_continue_on_another_replica_while_the_engine_restarts(llm, undisturbed):
    local, other = FlakyEngine(llm), FlakyEngine(llm)
    other_replica = ReplicaFailover(other, resume_timeout_s=30.0)
    peers = InProcessPeers(other_replica)
    client = ReplicaFailover(local, resume_timeout_s=30.0, peers=peers)
    outcomes = asyncio.run(run_all(client, PROMPTS, PARAMS, fault=lambda: local.fail(restart_s=None)))
    assert_undisturbed(outcomes, undisturbed)
    assert len(other.resumes) == len(PROMPTS) and set(peers.calls) == {"replica-a"}
    assert client.stats()["replica_resumed_requests"] == len(PROMPTS)
    assert other_replica.stats()["peer_continuations"] == len(PROMPTS)


def test_a_stop_string_that_comes_after_the_failure_ends_the_stream_as_undisturbed(llm, undisturbed):
    """The stop string: three characters of the greedy text from its 20th token on (their first occurrence),
    so the engine holds text back for it when the fault comes, and finds it only in the continuation."""
    full, _ = undisturbed[0]
    start = len(llm.tokenizer.decode(full.token_ids[:20]))
    stop = full.text[start:start + 3]
    assert full.text.find(stop) == start
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    reference, = asyncio.run(run_all(ReplicaFailover(FlakyEngine(llm), 10.0), PROMPTS[:1], [params]))
    engine = FlakyEngine(llm)
    outcomes = asyncio.run(run_all(ReplicaFailover(engine, 30.0), PROMPTS[:1], [params],
                                   fault=lambda: engine.fail(restart_s=0.2)))
    (output, streamed), (wanted, _) = outcomes[0], reference
    assert output.text == wanted.text == full.text[:start] and output.finish_reason == "stop"
    assert output.token_ids == wanted.token_ids and streamed[0] == (wanted.token_ids, wanted.text)
    assert len(engine.resumes) == 1 and engine.resumes[0].samples[0].token_ids == tuple(full.token_ids[:20])[:len(
        engine.resumes[0].samples[0].token_ids)]


def test_a_request_no_engine_takes_within_the_timeout_ends_with_a_clean_error(llm):
    engine = FlakyEngine(llm)
    client = ReplicaFailover(engine, resume_timeout_s=0.5)
    began = time.monotonic()
    outcomes = asyncio.run(run_all(client, PROMPTS[:1], PARAMS[:1], fault=lambda: engine.fail(restart_s=None)))
    assert isinstance(outcomes[0], EngineDeadError) and "within 0.5 s" in str(outcomes[0])
    assert time.monotonic() - began < 30
    assert client.stats()["replica_failed_resumes"] == 1 and client.stats()["replica_resumed_requests"] == 0


def test_a_continuation_the_engine_refuses_ends_that_request_saying_why(llm):
    engine = FlakyEngine(llm, refuse_resumes=InvalidRequestError("the prompt and the tokens generated do not fit"))
    client = ReplicaFailover(engine, resume_timeout_s=30.0)
    outcomes = asyncio.run(run_all(client, PROMPTS[:1], PARAMS[:1], fault=lambda: engine.fail(restart_s=0.2)))
    assert isinstance(outcomes[0], RequestFailedError)
    assert "could not be continued" in str(outcomes[0]) and "do not fit" in str(outcomes[0])
    assert client.stats()["replica_failed_resumes"] == 1


def test_an_engine_that_fails_every_continuation_at_once_is_retried_until_the_timeout_only(llm):
    engine = FlakyEngine(llm, refuse_resumes=EngineDeadError("the engine failed again"))
    client = ReplicaFailover(engine, resume_timeout_s=1.0)
    began = time.monotonic()
    outcomes = asyncio.run(run_all(client, PROMPTS[:1], PARAMS[:1], fault=lambda: engine.fail(restart_s=0.1)))
    assert isinstance(outcomes[0], EngineDeadError) and "within 1 s" in str(outcomes[0])
    assert 1.0 <= time.monotonic() - began < 30
    assert 2 <= len(engine.resumes) <= 1.0 / RETRY_INTERVAL_S + 1  # tried again after a pause each time
    assert client.stats()["replica_failed_resumes"] == 1


def test_without_failover_the_engine_s_failure_reaches_the_caller(llm):
    engine = FlakyEngine(llm)
    client = ReplicaFailover(engine, resume_timeout_s=0)
    outcomes = asyncio.run(run_all(client, PROMPTS[:1], PARAMS[:1], fault=lambda: engine.fail(restart_s=0.2)))
    assert isinstance(outcomes[0], EngineDeadError) and engine.resumes == []


def test_a_continuation_for_another_replica_streams_deltas_after_an_empty_taken_message(llm):
    client = ReplicaFailover(FlakyEngine(llm), resume_timeout_s=30.0)

    async def collect():
        request = {"request_id": "peer-0", "prompt": PROMPTS[0], "params": PARAMS[0], "resume": None}
        return [deltas async for deltas in client.resume_stream(request)]

    messages = asyncio.run(collect())
    assert messages[0] == [] and all(len(m) == 1 and isinstance(m[0], OutputDelta) for m in messages[1:])
    assert messages[-1][0].finished and messages[1][0].prompt_token_ids == PROMPTS[0]
    assert sum(len(m[0].completions[0].new_token_ids) for m in messages[1:]) == PARAMS[0].max_tokens
