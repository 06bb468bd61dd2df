"""Failover inside a data-parallel engine on real Ray actors (CPU, gloo): 16 streams in flight, one DP rank's
process killed (SIGKILL) or hung (SIGSTOP) half-way. Every stream completes with the tokens of an undisturbed
run (greedy and seeded alike: nothing repeated, nothing dropped), the failed rank comes back and serves, and
every KV block is free afterwards. Dense DP=2 moves the failed rank's requests to the other rank; MoE with
EP=2 starts the whole EP group again and resumes every request on it. A request whose continuation no longer
fits ends with an error naming why while the others carry on."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

import atom_ray
from engine import SamplingParams
from engine.errors import RequestFailedError

NUM_STREAMS = 16
MAX_TOKENS = 48
PROMPTS = [[3 + i, 40 + 2 * i, 7, 90 + i, 11 + i % 5, 200 - i][: 4 + i % 3] for i in range(NUM_STREAMS)]
# Greedy and seeded sampling, mixed.
PARAMS = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True) if i % 2 == 0 else
          SamplingParams(temperature=1.0, top_k=50, seed=1000 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
          for i in range(NUM_STREAMS)]
KILL_AFTER_TOKENS = 6  # each stream has at least this many tokens when the fault comes
# The test of a continuation that cannot fit: with chunked prefill off, a prompt and its delivered tokens
# must fit one step of max_num_batched_tokens. The 16 streams' prompts and tokens stay well below it.
MAX_NUM_BATCHED_TOKENS = 96


def start(folder, **layout):
    return atom_ray.start(str(folder), dtype="float32", cpus_per_rank=1, step_timeout_s=2.0,
                          enable_chunked_prefill=False, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                          max_num_seqs=32, **layout)


@pytest.fixture(scope="module")
def dense(ray_cluster, llama_dir):
    engine = start(llama_dir, data_parallel_size=2)
    yield engine, [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]
    engine.shutdown()


@pytest.fixture(scope="module")
def moe(ray_cluster, tiny_model_dirs):
    engine = start(tiny_model_dirs["qwen3_moe"], data_parallel_size=2, enable_expert_parallel=True)
    yield engine, [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]
    engine.shutdown()


async def stream(engine, prompt, params, progress: list, slot: int):
    """One stream to its end: (final output, the new tokens of every output in order)."""
    streamed = []
    output = None
    async for output in engine.stream(prompt, params):
        streamed += output.outputs[0].new_token_ids
        progress[slot] = len(streamed)
    return output, streamed


def run_with_fault(engine, prompts, params, inject, wait_for_tokens: int = KILL_AFTER_TOKENS,
                   all_live: bool = True):
    """All streams at once; `inject()` once each has `wait_for_tokens` tokens (or, unless `all_live` is
    required, has ended: on 2 shared cores one rank can run several times ahead of the other). Returns each
    stream's outcome: (final output, streamed tokens) or the exception it raised."""
    async def scenario():
        progress = [0] * len(prompts)
        tasks = [asyncio.ensure_future(stream(engine, p, sp, progress, i))
                 for i, (p, sp) in enumerate(zip(prompts, params))]
        deadline = time.monotonic() + 60
        while any(n < wait_for_tokens and not t.done() for n, t in zip(progress, tasks)):
            assert time.monotonic() < deadline, progress
            await asyncio.sleep(0.01)
        ended = [index for index, task in enumerate(tasks) if task.done()]
        if all_live:
            assert not ended, f"streams {ended} ended before the fault (tokens so far: {progress})"
        else:
            assert len(ended) < len(tasks), f"every stream ended before the fault (tokens: {progress})"
        inject()
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 180)
    return asyncio.run(scenario())


def wait_until(engine, condition, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.stats()
        if condition(stats):
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)


def signal_process(pid: int, sig: int):
    def inject():
        os.kill(pid, sig)
    return inject


def resume_stopped(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)  # if it still exists (the failover kills it)
    except ProcessLookupError:
        pass


def assert_complete_and_undisturbed(outcomes, expected) -> None:
    for index, (outcome, tokens) in enumerate(zip(outcomes, expected)):
        assert not isinstance(outcome, BaseException), (index, outcome)
        output, streamed = outcome
        assert output.finished and output.finish_reason == "length", index
        assert output.token_ids == tokens, (index, PARAMS[index])  # greedy and seeded alike
        assert streamed == tokens, index  # no token repeated or dropped on the way
        assert len(output.prompt_token_ids) == len(PROMPTS[index])  # usage counts the original prompt


def fault_on_dp_rank_1(engine, sig: int, expected) -> tuple[dict, int]:
    """The 16 streams with DP rank 1's process (its only TP rank) killed or stopped half-way; every stream must
    complete undisturbed. Returns the stats from before and the pid that was hit."""
    before = engine.stats()
    _, pid = engine.rank_process_ids()[1]
    try:
        outcomes = run_with_fault(engine, PROMPTS, PARAMS, signal_process(pid, sig))
    finally:
        if sig == signal.SIGSTOP:
            resume_stopped(pid)
    assert_complete_and_undisturbed(outcomes, expected)
    return before, pid


def assert_back_and_serving(engine, expected, failed_dp: int, old_pid: int) -> None:
    """The failed rank serves again (a new process), takes new requests, and every KV block is free."""
    stats = wait_until(engine, lambda s: all(r["serving"] for r in s["dp_ranks"]))
    dp_size = len(stats["dp_ranks"])
    assert old_pid not in [pid for _, pid in engine.rank_process_ids()]
    routed = stats["dp_ranks"][failed_dp]["routed_requests"]
    outputs = engine.generate(PROMPTS[:4], PARAMS[:4])
    assert [o.token_ids for o in outputs] == expected[:4]
    stats = wait_until(engine, lambda s: all(r["num_running"] == 0 and r["num_waiting"] == 0 and
                                             r["outstanding_requests"] == 0 for r in s["dp_ranks"]))
    assert stats["dp_ranks"][failed_dp]["routed_requests"] > routed
    for rank in stats["dp_ranks"]:
        assert rank["num_free_kv_blocks"] == rank["num_kv_blocks"] > 0, rank
        assert rank.get("num_free_state_slots") == rank.get("num_state_slots"), rank
    assert stats["error"] is None and len(stats["dp_ranks"]) == dp_size


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_dense_streams_survive_a_failed_dp_rank_token_for_token(dense, sig):
    engine, expected = dense
    before, pid = fault_on_dp_rank_1(engine, sig, expected)
    stats = engine.stats()
    assert stats["resumed_requests"] > before["resumed_requests"]
    assert stats["failed_resumes"] == before["failed_resumes"]
    assert stats["resume_latency_s_max"] > 0
    assert_back_and_serving(engine, expected, 1, pid)
    assert engine.stats()["dp_rank_restarts"] == before["dp_rank_restarts"] + 1


def test_n_samples_logprobs_stop_strings_and_grammars_continue_as_undisturbed(dense):
    """Each rank runs one request of each kind, so the killed rank holds all kinds."""
    engine, _ = dense
    text_prompt = "The quick brown fox"
    plain = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    full_text = engine.generate([text_prompt], plain)[0].text
    # A stop string that first appears late in the text: after the fault.
    start = next(k for k in range(len(full_text) * 2 // 3, len(full_text) - 3)
                 if full_text[k:k + 3] not in full_text[:k + 2])
    stop = full_text[start:start + 3]
    n_samples = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    stopped = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop])
    grammar = SamplingParams(temperature=0, max_tokens=64, structured_outputs={"regex": r"[a-z]{3}( [a-z]{2,6}){14}\."})
    penalties = SamplingParams(temperature=0.7, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True, frequency_penalty=1.0,
                               presence_penalty=0.5, repetition_penalty=1.2, min_tokens=MAX_TOKENS - 2)
    # Routed alternately: each rank gets one of each.
    params = [n_samples, stopped, grammar, penalties, stopped, n_samples, penalties, grammar]
    prompts = [text_prompt] * len(params)
    expected = engine.generate(prompts, params)
    before = engine.stats()
    # Which rank gets which request depends on timing (the prompts share a prefix), and on 2 shared cores one
    # rank may finish its streams while the other's have a few tokens: the fault goes to the rank whose
    # streams are still running.
    killed = {}

    def kill_the_busier_rank():
        ranks = engine.stats()["dp_ranks"]
        killed["dp"] = max(range(len(ranks)), key=lambda r: ranks[r]["outstanding_requests"])
        killed["pid"] = engine.rank_process_ids()[killed["dp"]][1]
        os.kill(killed["pid"], signal.SIGKILL)
    outcomes = run_with_fault(engine, prompts, params, kill_the_busier_rank, wait_for_tokens=4, all_live=False)
    for index, (outcome, reference) in enumerate(zip(outcomes, expected)):
        assert not isinstance(outcome, BaseException), (index, outcome)
        output = outcome[0]
        for completion, undisturbed in zip(output.outputs, reference.outputs, strict=True):
            assert completion.token_ids == undisturbed.token_ids, index
            assert completion.text == undisturbed.text, index
            assert (completion.finish_reason, completion.stop_reason) == (undisturbed.finish_reason,
                                                                          undisturbed.stop_reason), index
            if undisturbed.logprobs is not None:
                assert len(completion.logprobs) == len(completion.token_ids)
                assert [max(p, key=lambda t: p[t].logprob) for p in completion.logprobs] == \
                    [max(p, key=lambda t: p[t].logprob) for p in undisturbed.logprobs]
        assert output.prompt_token_ids == reference.prompt_token_ids  # usage: the original prompt's tokens
    assert expected[1].finish_reason == "stop" and expected[2].finish_reason == "stop"  # the stop, the grammar's end
    assert engine.stats()["resumed_requests"] > before["resumed_requests"]
    assert_back_and_serving(engine, dense[1], killed["dp"], killed["pid"])


def test_a_continuation_that_cannot_fit_ends_with_an_error_and_the_others_finish(dense):
    engine, expected = dense
    long_prompt = list(range(5, 5 + MAX_NUM_BATCHED_TOKENS - 4))  # fits, but not with 5 more tokens
    long_params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    before = engine.stats()

    async def scenario():
        progress = [0] * 5
        long_one = asyncio.ensure_future(stream(engine, long_prompt, long_params, progress, 0))
        # The long request's rank is the one that fails.
        while not progress[0]:
            await asyncio.sleep(0.01)
        failed_dp = next(r["dp_rank"] for r in engine.stats()["dp_ranks"] if r["outstanding_requests"])
        pids = engine.rank_process_ids()
        others = [asyncio.ensure_future(stream(engine, PROMPTS[i], PARAMS[i], progress, i + 1)) for i in range(4)]
        while min(progress) < KILL_AFTER_TOKENS:
            await asyncio.sleep(0.01)
        os.kill(pids[failed_dp][1], signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(long_one, *others, return_exceptions=True), 180)
        return failed_dp, pids[failed_dp][1], results

    failed_dp, pid, (long_outcome, *outcomes) = asyncio.run(scenario())
    assert isinstance(long_outcome, RequestFailedError), long_outcome
    message = str(long_outcome)
    assert f"could not be resumed after DP rank {failed_dp} failed" in message
    assert "already generated" in message and "max_num_batched_tokens" in message
    for index, (outcome, tokens) in enumerate(zip(outcomes, expected[:4])):
        assert not isinstance(outcome, BaseException), (index, outcome)
        assert outcome[0].token_ids == tokens and outcome[1] == tokens
    stats = engine.stats()
    assert stats["failed_resumes"] == before["failed_resumes"] + 1
    assert_back_and_serving(engine, expected, failed_dp, pid)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_moe_expert_parallel_streams_resume_on_a_restarted_ep_group(moe, sig):
    engine, expected = moe
    before, pid = fault_on_dp_rank_1(engine, sig, expected)
    stats = engine.stats()
    # The EP group cannot step without a member: every live request resumed, both ranks started again.
    assert stats["resumed_requests"] - before["resumed_requests"] == NUM_STREAMS
    assert_back_and_serving(engine, expected, 1, pid)
    assert engine.stats()["dp_rank_restarts"] == before["dp_rank_restarts"] + 2
