"""Scheduling choices never change the tokens: prefix caching, chunked prefill and preemption give the
same greedy outputs as a plain run, and every KV block comes back afterwards."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

SHARED_PREFIX = list(range(3, 67))  # four full blocks of 16
PROMPTS = [SHARED_PREFIX + [70 + i] * (i + 1) for i in range(4)] + [list(range(100, 140)), [7, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _run(folder, **engine_args):
    llm = LLM(str(folder), dtype="float32", show_progress=False, **engine_args)
    return llm, [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def baseline(llama_dir):
    return _run(llama_dir, enable_prefix_caching=False)[1]


def _assert_all_blocks_free(llm):
    stats = llm.engine.stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_prefix_caching_gives_same_tokens_and_hits_on_second_pass(llama_dir, baseline):
    llm, first = _run(llama_dir, enable_prefix_caching=True)
    assert first == baseline
    hits_before = llm.engine.stats()["prefix_cache_hits"]
    second = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in second] == baseline
    assert llm.engine.stats()["prefix_cache_hits"] > hits_before
    assert all(o.num_cached_tokens >= 64 for o in second[:4])
    _assert_all_blocks_free(llm)


def test_prefix_cache_reuses_generated_tokens_of_an_earlier_turn(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", show_progress=False)
    first = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    follow_up = PROMPTS[0] + first.token_ids + [9, 9]
    second = llm.generate([follow_up], SamplingParams(temperature=0, max_tokens=1))[0]
    assert second.num_cached_tokens >= (len(follow_up) // 16 - 1) * 16


def test_prefix_caching_off_reports_no_hits(llama_dir):
    llm, _ = _run(llama_dir, enable_prefix_caching=False)
    second = llm.generate(PROMPTS, GREEDY)
    assert all(o.num_cached_tokens == 0 for o in second)
    assert llm.engine.stats()["prefix_cache_hits"] == 0


def test_chunked_prefill_with_tiny_token_budget_gives_same_tokens(llama_dir, baseline):
    llm, outputs = _run(llama_dir, max_num_batched_tokens=8, max_num_seqs=8, enable_prefix_caching=False)
    assert outputs == baseline
    _assert_all_blocks_free(llm)


def test_preemption_with_tiny_kv_cache_gives_same_tokens(llama_dir, baseline):
    # 11 blocks of 16 tokens: two sequences growing to 6 blocks each cannot both stay resident.
    llm, outputs = _run(llama_dir, num_kv_blocks=11, max_model_len=176, enable_prefix_caching=False)
    assert llm.engine.stats()["num_preemptions"] > 0
    assert outputs == baseline
    _assert_all_blocks_free(llm)


def test_preemption_with_prefix_caching_and_chunking_together(llama_dir, baseline):
    llm, outputs = _run(llama_dir, num_kv_blocks=11, max_model_len=176, max_num_batched_tokens=20,
                        max_num_seqs=6, enable_prefix_caching=True)
    assert llm.engine.stats()["num_preemptions"] > 0
    assert outputs == baseline
    _assert_all_blocks_free(llm)


def test_too_small_kv_cache_for_max_model_len_is_refused(llama_dir):
    from engine import ConfigError
    with pytest.raises(ConfigError, match="fewer than one sequence"):
        LLM(str(llama_dir), num_kv_blocks=4, max_model_len=512, show_progress=False)


def test_launching_steps_ahead_gives_the_synchronous_tokens(llama_dir):
    """The GPU loop plans step N+1 before step N's tokens reach the host; forced on here (on CPU the
    launch is synchronous, but the bookkeeping of pending tokens is the same)."""
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=11, max_model_len=176, show_progress=False)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=20 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    params[1] = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[7])
    params[2] = SamplingParams(temperature=0, max_tokens=25, repetition_penalty=1.3, frequency_penalty=0.5,
                               ignore_eos=True)  # needs every earlier token on the host
    params[3] = SamplingParams(temperature=0.5, seed=9, max_tokens=22, logprobs=2, ignore_eos=True)
    synchronous = [o.token_ids for o in llm.generate(PROMPTS, params)]
    llm.engine._run_ahead = True
    preemptions_before = llm.engine.stats()["num_preemptions"]
    ahead = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in ahead] == synchronous
    assert llm.engine.stats()["num_preemptions"] > preemptions_before  # pending tokens survive preemption
    _assert_all_blocks_free(llm)


def test_prompt_logprobs_cover_every_position_even_when_the_prefix_is_cached(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", show_progress=False)
    llm.generate([PROMPTS[0]], GREEDY)  # caches the shared prefix
    output = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    assert len(output.prompt_logprobs) == len(PROMPTS[1]) and all(output.prompt_logprobs[1:])


def test_a_running_stream_waits_at_most_one_step_while_a_long_prompt_is_prefilled(llama_dir):
    """Fairness, in steps: with a 32-token budget, a 300-token prompt takes 10 steps to prefill and the
    running stream gets a token in every one of them (its longest gap is one step, one chunk's time)."""
    from engine import EngineConfig, LLMEngine
    engine = LLMEngine(EngineConfig(str(llama_dir), dtype="float32", max_num_batched_tokens=32, max_num_seqs=8,
                                    max_model_len=512),
                       show_progress=False)
    engine.add_request("stream", [5, 6, 7], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    engine.step()
    engine.add_request("long", list(range(1, 301)), SamplingParams(temperature=0, max_tokens=1))
    steps, longest_gap, gap = 0, 0, 0
    while "long" in engine.output_processor.parents:
        outputs = {o.request_id: o for o in engine.step()}
        steps += 1
        gap = 0 if outputs.get("stream") and outputs["stream"].outputs[0].new_token_ids else gap + 1
        longest_gap = max(longest_gap, gap)
    assert longest_gap == 0
    assert steps == -(-300 // 31)
    engine.abort_request("stream")
